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


def guarded(verb: str, run: Callable) -> Callable:
    """Wrap a verb so a config error is one line on stderr and exit code 2, no traceback."""
    from omegaconf.errors import OmegaConfBaseException

    from twin.spec import ConfigError

    def task(cfg):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = _warn_line
                return run(cfg)
        except ConfigError as err:
            print(f"paratwin {verb}: config error: {err}", file=sys.stderr)
            sys.exit(2)
        except OmegaConfBaseException as err:
            print(f"paratwin {verb}: config error: {str(err).splitlines()[0]}", file=sys.stderr)
            sys.exit(2)

    return task


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
    problem = check_group_choices(argv[1:])
    if problem:
        print(f"paratwin {verb}: config error: {problem}", file=sys.stderr)
        sys.exit(2)
    import importlib

    import hydra

    from paratwin.config import register_schemas

    register_schemas()
    module = importlib.import_module(f"paratwin.verbs.{verb}")
    app = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=verb)(
        guarded(verb, module.run))
    args = argv[1:]
    if verb == "report":  # Hydra takes no positional arguments: DIR ... becomes runs=[...]
        from paratwin.verbs.report import positional_runs

        args = positional_runs(args)
    sys.argv = [f"paratwin {verb}", *args]
    app()


if __name__ == "__main__":
    main()
