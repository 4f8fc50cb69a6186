"""Where a verb writes when the user does not say: the one rule for every verb.

``out_dir=DIR`` is used as given (nothing else is created); in a ``-m`` sweep each point
gets Hydra's job directory; otherwise ``reports/VERB/<timestamp>[-what]``. Hydra's own run
directory stays ``.`` so that it never creates an empty folder beside the one we write.
"""

from __future__ import annotations

import time
from pathlib import Path


def out_dir(cfg, verb: str, what: str = "") -> Path:
    """The run directory of ``verb`` for ``cfg`` (see the module docstring)."""
    if cfg.get("out_dir"):
        return Path(str(cfg.out_dir))
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:
        return Path(hc.runtime.output_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("reports") / verb / (f"{stamp}-{what}" if what else stamp)
