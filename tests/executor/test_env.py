"""Where a rank learns who it is: local launcher, torchrun, and SLURM's variables as a fallback."""

from __future__ import annotations

import pytest

from executor.env import DEFAULT_PORT, RankEnvError, first_host, rank_env


def test_local_launcher_variables():
    env = rank_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": "4242", "PARATWIN_LAUNCHER": "local", "PARATWIN_LOOPBACK": "1"})
    assert (env.rank, env.world_size, env.local_rank, env.master_port) == (1, 2, 1, 4242)
    assert env.launcher == "local" and env.loopback


def test_torchrun_is_recognised_and_wins_over_slurm():
    env = rank_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "MASTER_ADDR": "node0",
                    "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "x", "SLURM_PROCID": "0",
                    "SLURM_NTASKS": "1"})
    assert (env.rank, env.world_size, env.launcher) == (3, 8, "torchrun")
    assert not env.loopback


def test_slurm_fallback_takes_the_first_host_and_the_default_port():
    env = rank_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5",
                    "SLURM_JOB_NODELIST": "gpu[07-08,11],cpu1"})
    assert (env.rank, env.world_size, env.local_rank) == (5, 16, 5)
    assert env.master_addr == "gpu07" and env.master_port == DEFAULT_PORT
    assert env.launcher == "slurm"


@pytest.mark.parametrize("nodelist, host", [("node1", "node1"), ("a[1-3]", "a1"),
                                            ("x[010,12]", "x010"), ("h-2,h-3", "h-2")])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_missing_variables_say_how_to_start_ranks():
    with pytest.raises(RankEnvError, match="torchrun or srun"):
        rank_env({})
    with pytest.raises(RankEnvError, match="MASTER_ADDR"):
        rank_env({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(RankEnvError, match="outside the world"):
        rank_env({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})
    with pytest.raises(RankEnvError, match="not an integer"):
        rank_env({"RANK": "x", "WORLD_SIZE": "2"})
