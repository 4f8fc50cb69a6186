"""Replayed all-reduce vs a bare torch.distributed loop, measured in the same run (>= 16 MB).

Prints, per message size, the busbw (nccl-tests definition) of a bare ``dist.all_reduce``
loop and of the executor replaying a schedule of back-to-back all-reduces, and their
ratio. The goal is a ratio of at least 0.9: the replay machinery (per-(stream, group)
communicators, async issue, completion callbacks) costs under 10% at large messages.
Figures, not a pass/fail test; timing on a shared 2-core host is noisy (run it twice).

    python benchmarks/bench_replay_allreduce.py [--sizes-mb 16 64] [--world 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor.launch import launch_local  # noqa: E402
from twin import rundir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ops-per-step", type=int, default=4)
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    ap.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="paratwin-replay-ar-"))
    rundir.prepare(out)
    settings = {"task": "replay_vs_bare", "world_size": args.world, "backend": args.backend,
                "threads": 1, "timeout_s": 120.0, "comm_timeout_s": 300.0,
                "sizes": [mb * 2**20 for mb in args.sizes_mb], "rounds": args.rounds,
                "repeats": args.repeats, "warmup": 2, "ops_per_step": args.ops_per_step}
    rundir.write_json(out / rundir.SETTINGS, settings)
    t0 = time.time()
    launch_local(out, args.world, timeout_s=120.0)
    rows = json.loads((out / "replay_vs_bare.json").read_text())
    print(f"all-reduce over {args.world} ranks ({rows[0]['backend']}), {args.rounds} rounds x "
          f"{args.repeats} repeats; replay: {args.ops_per_step} back-to-back ops per step")
    print(f"{'size':>8} {'bare busbw':>12} {'replay busbw':>13} {'ratio':>7} "
          f"{'bare ms':>9} {'replay ms':>10}")
    for r in rows:
        print(f"{r['bytes'] / 2**20:>5.0f} MB {r['bare_busbw_GBps']:>8.3f} GB/s "
              f"{r['replay_busbw_GBps']:>9.3f} GB/s {r['ratio']:>7.3f} "
              f"{r['bare_time_s'] * 1e3:>9.2f} {r['replay_time_s'] * 1e3:>10.2f}")
    print(f"(wall {time.time() - t0:.1f} s; run directory {out})")


if __name__ == "__main__":
    main()
