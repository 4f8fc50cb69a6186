"""PNG export of every figure through kaleido, driving the system's Chromium (optional)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from twin.report.browser import find_chromium
from twin.report.html import Section

WIDTH = 1400


def export_png(sections: list[Section], directory: Path) -> list[Path]:
    """One PNG per figure, named NN-section.png, in ``directory``; one browser for all."""
    try:
        import kaleido  # noqa: F401
        import plotly.io as pio
    except ImportError:
        raise RuntimeError("png=true needs the kaleido package (`pip install kaleido`); it drives "
                           "the system's chromium, so no browser is downloaded") from None
    if not os.environ.get("BROWSER_PATH"):
        exe = find_chromium()
        if exe is None:
            raise RuntimeError("png=true needs chromium (`apt-get install -y chromium`) or "
                               "BROWSER_PATH set to a Chrome/Chromium executable")
        os.environ["BROWSER_PATH"] = exe
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    figs, paths = [], []
    for s in sections:
        for i, fig in enumerate(s.plain_figures(), start=1):
            slug = re.sub(r"[^a-z0-9]+", "-", s.key.lower()).strip("-")
            figs.append(fig)
            paths.append(directory / f"{len(paths) + 1:02d}-{slug}-{i}.png")
    if not figs:
        return []
    heights = [int(f.layout.height or 500) for f in figs]
    try:
        pio.write_images(figs, paths, format="png", width=WIDTH, height=heights)
    except Exception as err:  # noqa: BLE001 - kaleido raises its own types; say which step failed
        raise RuntimeError(f"PNG export through kaleido failed: {type(err).__name__}: {err}") from None
    return paths
