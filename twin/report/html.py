"""The report page: sections of figures in one self-contained HTML file (plotly.js inlined once).

The page carries a small probe: it records JavaScript errors and, once every figure is
drawn, how many traces each one rendered (``#paratwin-probe``, hidden). The browser tests
and the load benchmark read it; a person never sees it.
"""

from __future__ import annotations

import html as _html
from dataclasses import dataclass, field
from pathlib import Path

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from twin.files import write_text_atomic

PLOT_CONFIG = {"displaylogo": False, "scrollZoom": True, "responsive": True,
               "modeBarButtonsToRemove": ["select2d", "lasso2d"]}

CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 0 auto; max-width: 1600px;
       padding: 12px 24px; color: #222; }
h1 { font-size: 22px; margin: 8px 0 2px; } h2 { font-size: 18px; margin: 28px 0 4px;
  border-bottom: 1px solid #ddd; padding-bottom: 3px; }
p.note { color: #555; font-size: 13px; margin: 2px 0 8px; } .runs { color: #555; font-size: 13px; }
nav a { margin-right: 14px; font-size: 13px; } .figure { margin: 6px 0 18px; }
table.kv { border-collapse: collapse; font-size: 13px; } table.kv td, table.kv th
  { border: 1px solid #ddd; padding: 3px 8px; text-align: right; } table.kv th { background: #f4f4f4; }
table.kv td:first-child, table.kv th:first-child { text-align: left; }
"""

# Errors are caught from the start (the first part is in <head>); the count waits for the
# page's load event, every plot's internal state, and two animation frames.
PROBE_HEAD = """<script>
window.__paratwinErrors = [];
window.addEventListener('error', e => window.__paratwinErrors.push(String(e.message || e)));
window.addEventListener('unhandledrejection', e => window.__paratwinErrors.push(String(e.reason)));
</script>"""
PROBE_TAIL = """<pre id="paratwin-probe" hidden></pre>
<script>
(function () {
  function count() {
    const figs = {};
    document.querySelectorAll('.js-plotly-plot').forEach(gd => {
      const full = gd._fullData || [];
      figs[gd.id] = {
        data: (gd.data || []).length, full: full.length,
        visible: full.filter(t => t.visible === true).length,
        svg: gd.querySelectorAll('.trace, .table').length,
        gl: full.filter(t => String(t.type).endsWith('gl')).length,
        canvas: gd.querySelectorAll('canvas').length,
        points: full.reduce((n, t) => n + (t._length || 0), 0)
      };
    });
    return figs;
  }
  function ready() {
    const el = document.getElementById('paratwin-probe');
    el.textContent = JSON.stringify({figures: count(), errors: window.__paratwinErrors,
                                     ready_ms: performance.now()});
    el.dataset.ready = '1';
  }
  window.addEventListener('load', () => {
    const t0 = performance.now();
    (function poll() {
      const plots = Array.from(document.querySelectorAll('.js-plotly-plot'));
      const drawn = plots.every(gd => gd._fullLayout && gd._fullData && gd.dataset.lod !== 'pending');
      if (!drawn && performance.now() - t0 < 20000) { setTimeout(poll, 50); return; }
      requestAnimationFrame(() => requestAnimationFrame(ready));
    })();
  });
})();
</script>"""


@dataclass
class Section:
    """One titled part of the report: a note and its figures (or ready HTML). A figure may
    come with HTML to place after its div (``__DIV__`` there stands for the div's id)."""

    key: str
    title: str
    note: str = ""
    figures: list[go.Figure | tuple[go.Figure, str]] = field(default_factory=list)
    html: str = ""

    def plain_figures(self) -> list[go.Figure]:
        return [f[0] if isinstance(f, tuple) else f for f in self.figures]


GENERATOR = "<meta name='generator' content='paratwin'>"
"""Says in the page's head who wrote it (twin.rundir.is_kind: never overwrite a user's page)."""


def render(title: str, subtitle: str, sections: list[Section]) -> str:
    """The whole page as a string."""
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'>{GENERATOR}"
             f"<title>{_html.escape(title)}</title>",
             f"<style>{CSS}</style>", PROBE_HEAD,
             f"<script type='text/javascript'>{get_plotlyjs()}</script></head><body>",
             f"<h1>{_html.escape(title)}</h1><div class='runs'>{subtitle}</div>",
             "<nav>" + "".join(f"<a href='#{s.key}'>{_html.escape(s.title)}</a>" for s in sections)
             + "</nav>"]
    for s in sections:
        parts.append(f"<h2 id='{s.key}'>{_html.escape(s.title)}</h2>")
        if s.note:
            parts.append(f"<p class='note'>{s.note}</p>")
        if s.html:
            parts.append(s.html)
        for n, item in enumerate(s.figures, start=1):
            fig, after = item if isinstance(item, tuple) else (item, "")
            div = f"fig-{s.key}-{n}"
            parts.append("<div class='figure'>" + fig.to_html(
                full_html=False, include_plotlyjs=False, div_id=div, config=PLOT_CONFIG)
                + after.replace("__DIV__", div) + "</div>")
    parts += [PROBE_TAIL, "</body></html>"]
    return "\n".join(parts)


def write(path: Path, title: str, subtitle: str, sections: list[Section]) -> Path:
    """Write the page atomically (a half-written report never replaces a good one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, render(title, subtitle, sections))


def kv_table(rows: list[list[str]], header: list[str]) -> str:
    """A small HTML table (values already formatted)."""
    head = "".join(f"<th>{_html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_html.escape(str(c))}</td>" for c in r) + "</tr>"
                   for r in rows)
    return f"<table class='kv'><tr>{head}</tr>{body}</table>"
