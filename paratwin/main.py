"""The `paratwin` console script: one Hydra app per verb over conf/."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable

from paratwin.config import CONF_DIR

VERBS: dict[str, str] = {
    # verb: one line of help; its module paratwin.verbs.VERB has run(cfg)
    "inspect": "parameters, memory per category, FLOPs and traffic per rank",
    "simulate": "the twin: step time, MFU, bubbles, exposed comm and memory of a plan",
    "schedule": "one rank's program of ops: kinds, collectives per group, JSON dump",
    "execute": "run the schedule for real with torch.distributed, timing every op",
    "bench": "microbenchmark collectives and kernels of this machine (CSV)",
    "calibrate": "measure this machine and fit the twin's cost model",
    "validate": "run a suite for real and hold the twin's predictions against it",
    "conformance": "the schedule's collectives vs PyTorch's DDP/FSDP2/TP/PP",
    "report": "one self-contained HTML report of run directories",
    "search": "every legal plan pruned by memory, ranked by an estimate, the best simulated",
}

USAGE = """usage: paratwin VERB [key=value ...] [-m]

A digital twin of distributed deep-learning training.

verbs:
{verbs}

Every config field can be overridden (model=llama3_70b cluster.num_nodes=8 parallel.tp=8)
and swept with -m (Hydra multirun). `paratwin VERB --help` shows the composed config.
"""


def _usage() -> str:
    width = max(map(len, VERBS))
    return USAGE.format(verbs="\n".join(f"  {v.ljust(width)}  {h}" for v, h in VERBS.items()))


FAILED: list[str] = []
"""Points of a -m sweep that failed (one line each), reported when the sweep ends."""


def _os_error(err: OSError) -> str:
    """One line for an OS error: what, where, and what to do."""
    what = err.strerror or str(err)
    where = f" {err.filename}" if err.filename else ""
    fix = {13: "choose a directory you can write (out_dir=...)",
           30: "choose a writable directory (out_dir=...)",
           36: "use a shorter path",
           28: "free some space or choose another disk",
           20: "a path component is a file, not a directory",
           21: "give a file path, not a directory",
           2: "check the path"}.get(err.errno or 0, "check the path and its permissions")
    return f"{what}:{where} ({fix})"


def guarded(verb: str, run: Callable) -> Callable:
    """Wrap a verb so any bad input or OS error is one line on stderr and exit code 2, no
    traceback (``debug=true`` shows it); an interrupt is one line and exit 130. In a -m
    sweep a failed point is reported and the sweep goes on (exit 2 at its end)."""
    from omegaconf.errors import OmegaConfBaseException

    from twin.rundir import RunDirError
    from twin.spec import ConfigError

    def task(cfg):
        debug = bool(cfg.get("debug", False)) if hasattr(cfg, "get") else False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = _warn_line
                return run(cfg)
        except ConfigError as err:
            message = f"config error: {err}"
            if debug:
                raise
        except OmegaConfBaseException as err:
            message = f"config error: {str(err).splitlines()[0]}"
            if debug:
                raise
        except OSError as err:
            if debug:
                raise
            message = _os_error(err)
        except RunDirError as err:  # a file or directory paratwin will not write over
            if debug:
                raise
            message = str(err)
        except (ValueError, RuntimeError, KeyError, TypeError) as err:
            if debug:
                raise
            message = f"error: {str(err).splitlines()[0] if str(err) else type(err).__name__} " \
                      "(debug=true shows where)"
        except KeyboardInterrupt:
            print(f"paratwin {verb}: interrupted", file=sys.stderr)
            sys.exit(130)
        line = f"paratwin {verb}: {message}"
        print(line, file=sys.stderr)
        if _multirun():
            FAILED.append(line)
            return None
        sys.exit(2)

    return task


def _multirun() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:  # noqa: BLE001 - no Hydra context: a single run
        return False


_WARNED: set[str] = set()


def _warn_line(message, category, *args, **kwargs) -> None:
    if str(message) not in _WARNED:
        _WARNED.add(str(message))
        print(f"paratwin: warning: {message}", file=sys.stderr)


GROUPS = ("model", "cluster", "parallel")


def check_group_choices(args: list[str]) -> str | None:
    """A one-line error for ``group=name`` overrides that name no preset, else None.

    Hydra would say so too, over many lines and with exit code 1; a typo in a preset
    name is a config error like any other (one line, exit code 2).
    """
    for arg in args:
        key, sep, value = arg.partition("=")
        key = key.lstrip("+~")
        if not sep or key not in GROUPS:
            continue
        options = sorted(p.stem for p in (CONF_DIR / key).glob("*.yaml"))
        for name in value.split(","):
            if name and name not in options:
                return (f"{key}={name} is not a preset; choose one of {', '.join(options)} "
                        f"(files in conf/{key}/)")
    return None


def main(argv: list[str] | None = None) -> None:
    """Dispatch ``paratwin VERB ...`` to the verb's Hydra app."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return
    verb = argv[0]
    if verb not in VERBS:
        print(f"paratwin: unknown verb {verb!r}\n\n{_usage()}", file=sys.stderr)
        sys.exit(2)
    if not CONF_DIR.is_dir():
        print(f"paratwin: config tree not found at {CONF_DIR}; install from a source checkout "
              "with `pip install -e .`", file=sys.stderr)
        sys.exit(2)
    args = argv[1:]
    if verb == "report":  # Hydra takes no positional arguments: DIR ... becomes runs=[...]
        from paratwin.verbs.report import positional_runs

        args = positional_runs(args)
    flags = [a for a in args if a.startswith("-")]
    overrides = [a for a in args if not a.startswith("-")]
    problem = check_group_choices(overrides)
    import importlib

    import hydra

    from paratwin.config import register_schemas

    register_schemas()
    if problem is None and not {"--help", "-h", "--info", "--cfg", "-c"} & set(flags):
        from paratwin.overrides import check

        problem = check(str(CONF_DIR), verb, overrides)
    if problem:
        print(f"paratwin {verb}: config error: {problem}", file=sys.stderr)
        sys.exit(2)
    module = importlib.import_module(f"paratwin.verbs.{verb}")
    app = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=verb)(
        guarded(verb, module.run))
    sys.argv = [f"paratwin {verb}", *args]
    try:
        app()
    except KeyboardInterrupt:
        print(f"paratwin {verb}: interrupted", file=sys.stderr)
        sys.exit(130)
    if FAILED:
        print(f"paratwin {verb}: {len(FAILED)} point(s) of the sweep failed:\n  "
              + "\n  ".join(FAILED), file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
