"""Workload math: parameters, FLOPs, memory and communication volume (pure functions)."""
