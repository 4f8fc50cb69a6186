"""Microbenchmarks of this machine: collective sweeps (multi-rank) and kernel sweeps (one device), as CSV."""
