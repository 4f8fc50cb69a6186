"""paratwin twin: specs, workload math, schedules and the SimPy simulator."""

__version__ = "0.1.0"
