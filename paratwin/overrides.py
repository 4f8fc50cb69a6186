"""Command-line overrides checked before Hydra runs: every key a field, every value its type.

Hydra reports an unknown key in a block of six lines with exit code 1 and suggests
``+key=value``, which our schemas then refuse; an added top-level key (``+stepz=3``) it
accepts and nobody reads. Here each override is checked against the composed config of
the verb (with the preset choices the command line makes): an unknown key is one line
naming the closest field, a top-level value that cannot be the type of its default
(``steps=abc``) one line naming the type. Group fields (``parallel.tp``) are typed by
their specs when the job is built (``paratwin.config.to_spec``).
"""

from __future__ import annotations

import difflib
from typing import Any

from omegaconf import DictConfig

GROUPS = ("model", "cluster", "parallel")
FREE = ("hydra",)
"""Keys below which anything goes (Hydra's own settings)."""

TYPES = {bool: "true or false", int: "a whole number", float: "a number"}


def parse(args: list[str]) -> tuple[list, str | None]:
    """Hydra's parse of the overrides, or one line saying which cannot be read."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    out = []
    for arg in args:
        try:
            out += parser.parse_overrides([arg])
        except HydraException as err:
            return [], (f"cannot read the override {arg!r} ({str(err).splitlines()[0]}); write "
                        "key=value, e.g. steps=3 or parallel.tp=2")
    return out, None


def compose(conf_dir: str, verb: str, choices: list[str]) -> DictConfig:
    """The verb's config with the preset choices of the command line (no other override)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        return hydra_compose(config_name=verb, overrides=choices)


def _unknown(key: str, i: int, fields: list[str], where: str) -> str:
    parts = key.split(".")
    near = difflib.get_close_matches(parts[i], fields, n=1, cutoff=0.6)
    if near:
        return f"{key} is not a field; did you mean {'.'.join([*parts[:i], near[0], *parts[i + 1:]])}?"
    return f"{key} is not a field (fields {where}: {', '.join(sorted(fields))})"


def _lookup(cfg: DictConfig, key: str) -> tuple[bool, Any, str]:
    """(found, default, problem): walk ``key`` through ``cfg``; below a null node or a
    free-form one anything is allowed (found, default None)."""
    node: Any = cfg
    parts = key.split(".")
    for i, part in enumerate(parts):
        here = ".".join(parts[:i])
        if node is None or not isinstance(node, DictConfig):
            return True, None, ""  # below a null (e.g. fault) or a scalar: the verb checks it
        if part not in node:
            where = f"in {here}" if here else "at the top level"
            return False, None, _unknown(key, i, [str(k) for k in node], where)
        node = node._get_node(part)  # noqa: SLF001 - the raw node: no interpolation resolved
        node = node if isinstance(node, DictConfig) else node._value()  # noqa: SLF001
    return True, node, ""


def _type_problem(key: str, value: Any, default: Any) -> str | None:
    if default is None or isinstance(default, (str, DictConfig)) or \
            (isinstance(value, str) and value.startswith("${")):
        return None
    want = bool if isinstance(default, bool) else int if isinstance(default, int) else \
        float if isinstance(default, float) else None
    if want is None:
        return None
    if want is int and key.endswith("_s"):
        want = float  # seconds: timeout_s=1.5 is fine
    ok = isinstance(value, bool) if want is bool else \
        isinstance(value, int) and not isinstance(value, bool) if want is int else \
        isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        return None
    shown = str(default).lower() if isinstance(default, bool) else default
    return f"{key}={value!r} must be {TYPES[want]} (default {shown})"


def check(conf_dir: str, verb: str, args: list[str]) -> str | None:
    """One line for the first override that names no field or has a value of the wrong
    type, else None."""
    parsed, problem = parse(args)
    if problem:
        return problem
    choices = [f"{o.key_or_group}={o.value()}" for o in parsed
               if o.key_or_group in GROUPS and not o.is_sweep_override() and not o.is_delete()]
    cfg = compose(conf_dir, verb, choices)
    for o in parsed:
        key = o.key_or_group
        if key in GROUPS or key.split(".")[0] in FREE or o.package:
            continue
        found, default, problem = _lookup(cfg, key)
        if not found:
            return problem
        if o.is_delete() or "." in key:
            continue
        values = list(o.sweep_iterator()) if o.is_sweep_override() else [o.value()]
        for v in values:
            problem = _type_problem(key, v, default)
            if problem:
                return problem
    return None
