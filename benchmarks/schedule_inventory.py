"""The collective inventory of every parallel preset for one model (rank 0, one step).

Run: python benchmarks/schedule_inventory.py [model] [cluster]   (default llama3_8b dgx_h100)
Prints, per preset: the group, kind, count and total bytes of rank 0's collectives and p2p.
"""

from __future__ import annotations

import sys

from hydra import compose, initialize_config_dir

from paratwin.config import CONF_DIR, job_from_cfg, register_schemas
from twin.schedule.builder import build_schedule


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "llama3_8b"
    cluster = sys.argv[2] if len(sys.argv) > 2 else "dgx_h100"
    register_schemas()
    presets = sorted(p.stem for p in (CONF_DIR / "parallel").glob("*.yaml"))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for preset in presets:
            extra = ["cluster.gpus_per_node=1"] if preset == "single" else []
            cfg = compose(config_name="schedule",
                          overrides=[f"model={model}", f"cluster={cluster}", f"parallel={preset}",
                                     *extra])
            job = job_from_cfg(cfg)
            p = job.parallel
            prog = build_schedule(job).program(0)
            s = prog.summary()
            print(f"\n{preset}: dp={p.dp} tp={p.tp} pp={p.pp} zero={p.zero_stage} sp={p.sp} "
                  f"m={p.num_microbatches}; rank 0: {s['ops']} ops")
            for c in s["collectives"]:
                print(f"  {c['group']:<10} {c['kind']:<15} {c['count']:>6} x  "
                      f"{c['bytes'] / 1e9:>9.3f} GB total")


if __name__ == "__main__":
    main()
