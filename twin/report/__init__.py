"""Reports: Plotly HTML of run directories (timeline, memory, summary, twin vs real, sweeps,
calibration) and their Chrome/Perfetto export.

Entry point: ``write_report(run_dirs, out=None, options=None) -> Path``.
"""

from twin.report.build import Options, write_report

__all__ = ["Options", "write_report"]
