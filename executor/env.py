"""Where a rank learns who it is: the local launcher's variables, torchrun's, or SLURM's.

Precedence: RANK/WORLD_SIZE/LOCAL_RANK (set by the local launcher and by torchrun) win;
without them, SLURM's SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID stand in (``srun`` with one
task per GPU), and MASTER_ADDR defaults to the first host of SLURM_JOB_NODELIST.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_PORT = 29500


class RankEnvError(RuntimeError):
    """The process environment does not say which rank this is."""


@dataclass(frozen=True)
class RankEnv:
    """One rank's place in the run and how it reaches the others."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str
    """local | torchrun | slurm."""
    store_path: str = ""
    """A FileStore path (local runs with rendezvous=file); '' for TCP."""
    loopback: bool = False
    """Listen on the loopback interface only (local runs)."""


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[03-05,9],cpu1' -> 'gpu03'."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise RankEnvError(f"cannot read SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise RankEnvError(f"{key}={env[key]!r} is not an integer") from None


def rank_env(env: Mapping[str, str] | None = None) -> RankEnv:
    """Read the rank's environment (os.environ by default); errors name the missing variable."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = env.get("PARATWIN_LAUNCHER") or ("torchrun" if "TORCHELASTIC_RUN_ID" in env
                                                    else "env")
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        launcher = "slurm"
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    else:
        raise RankEnvError("no RANK/WORLD_SIZE (local launcher, torchrun) nor SLURM_PROCID/"
                           "SLURM_NTASKS (srun) in the environment; start ranks with "
                           "`paratwin execute`, torchrun or srun")
    addr = env.get("MASTER_ADDR")
    if not addr:
        if launcher == "slurm" and env.get("SLURM_JOB_NODELIST"):
            addr = first_host(env["SLURM_JOB_NODELIST"])
        elif world == 1 or env.get("PARATWIN_STORE_PATH"):
            addr = "127.0.0.1"
        else:
            raise RankEnvError("MASTER_ADDR is not set; export the address of rank 0's host")
    port = _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else DEFAULT_PORT
    if not 0 <= rank < world:
        raise RankEnvError(f"rank {rank} is outside the world of {world} ranks")
    return RankEnv(rank=rank, world_size=world, local_rank=local, master_addr=addr,
                   master_port=port, launcher=launcher,
                   store_path=env.get("PARATWIN_STORE_PATH", ""),
                   loopback=env.get("PARATWIN_LOOPBACK", "") == "1")
