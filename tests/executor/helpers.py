"""Shared by the executor tests: run the CLI, find rank processes, read their sockets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from executor.progress import Board

ROOT = Path(__file__).resolve().parents[2]


def paratwin(*args: str, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`paratwin ARGS` as a user runs it (a fresh process), with its output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "paratwin.main", *args], capture_output=True,
                          text=True, cwd=cwd or ROOT, timeout=timeout, env=env)


def rank_pids(run_dir: Path, world: int) -> list[int]:
    """The pids the ranks wrote on the progress board (0 where a rank never started)."""
    board = Board(world, Path(run_dir) / "progress.bin")
    try:
        return [board.read(r).pid for r in range(world)]
    finally:
        board.close()


def alive(pid: int) -> bool:
    """Whether a process with this pid exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def listening_addresses(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket the processes listen on (IPv4 and IPv6)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except FileNotFoundError:
            continue
    out = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            f = line.split()
            local, state, inode = f[1], f[3], f[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            addr_hex, port_hex = local.split(":")
            out.append((_addr(addr_hex, v6), int(port_hex, 16)))
    return out


def _addr(hexaddr: str, v6: bool) -> str:
    raw = bytes.fromhex(hexaddr)
    if not v6:
        return ".".join(str(b) for b in raw[::-1])
    words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
    full = b"".join(words)
    import ipaddress

    return str(ipaddress.IPv6Address(full))
