"""Level of detail for big timelines: the page keeps every span and draws what the zoom shows.

Every span stays in the page (typed arrays, base64). A small script draws, per category,
the spans in the visible time window as one SVG path of segments (start, middle, end,
gap: hover works at each of those points). Past ``HOVER_MAX`` spans in the window,
neighbours in a lane less than a pixel apart are merged, so the path never holds more than
about lanes x pixels segments; below it, each span is its own segment with its own hover
(op, rank, step, layer, micro-batch, bytes, FLOPs, duration). Zooming or panning redraws.
SVG rather than WebGL: where WebGL is software-rendered (headless CI) every WebGL figure
costs seconds, while one path per category stays cheap at any trace size.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import plotly.graph_objects as go

from twin.trace import Span

HOVER_MAX = 20_000
"""Spans in the window up to which each span gets its own hover point."""
MERGED_HOVER = "%{text}<extra>%{fullData.name}</extra>"


@dataclass
class Series:
    """One legend entry's spans, drawn in one colour on given lanes."""

    name: str
    color: str
    spans: list[Span]
    lane_of: object
    opacity: float = 1.0
    legend: bool = True
    group: str = ""


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()


def _payload(name: str, spans: list[Span], lanes: list[int]) -> dict:
    """The page's data of one series: its spans (sorted by start) and their lanes."""
    n = len(spans)
    start = np.fromiter((s.start_us for s in spans), np.float64, n)
    end = np.fromiter((s.end_us for s in spans), np.float64, n)
    meta = np.empty((n, 6), dtype=np.float64)
    for j, field in enumerate(("rank", "step", "layer", "mb", "bytes", "flops")):
        meta[:, j] = np.fromiter(map(attrgetter(field), spans), np.float64, n)
    return {"name": name, "start": _b64(start), "end": _b64(end),
            "lane": _b64(np.array(lanes, dtype=np.int32)),
            "meta": _b64(meta), "ops": [s.op for s in spans],
            "max_dur": float((end - start).max()) if n else 0.0}


def _by_start(spans: list[Span], lane_of) -> tuple[list[Span], list[int]]:
    """``spans`` sorted by start (stable) and the lane of each."""
    spans = sorted(spans, key=attrgetter("start_us"))
    return spans, [lane_of(s) for s in spans]


def merged(spans: list[Span], lane_of, tol_us: float) -> list[tuple[int, float, float, int, Span]]:
    """Segments (lane, start, end, spans merged, first span) of ``spans`` with neighbours in
    a lane closer than ``tol_us`` merged: what the page draws when zoomed out (as LOD_JS)."""
    return _merged(*_by_start(spans, lane_of), tol_us)


def _merged(spans: list[Span], lanes: list[int], tol_us: float) -> list[tuple]:
    """``merged`` of spans sorted by start, given their lanes."""
    open_: dict[int, list] = {}
    out: list[tuple[int, float, float, int, Span]] = []
    for s, lane in zip(spans, lanes):
        cur = open_.get(lane)
        if cur is not None and s.start_us - cur[1] <= tol_us:
            if s.end_us > cur[1]:
                cur[1] = s.end_us
            cur[2] += 1
            continue
        if cur is not None:
            out.append((lane, cur[0], cur[1], cur[2], cur[3]))
        open_[lane] = [s.start_us, s.end_us, 1, s]
    out += [(lane, c[0], c[1], c[2], c[3]) for lane, c in open_.items()]
    return out


def _merged_arrays(segments) -> dict:
    """x, y (start, middle, end, gap per segment) and hover text of merged segments."""
    x, y, text = [], [], []
    for lane, a, b, n, first in segments:
        x += [a, (a + b) / 2, b, np.nan]
        y += [lane, lane, lane, np.nan]
        label = first.op if n == 1 else \
            f"{n} ops merged at this zoom (rank {first.rank}, from {first.op}); zoom in for each op"
        text += [label, label, label, ""]
    return {"x": np.array(x, dtype=float), "y": np.array(y, dtype=float), "text": text}


def add_lod(fig: go.Figure, series: list[Series], lanes: int, x_range: tuple[float, float],
            line_px: float, hover: str, width_px: int = 1200) -> str:
    """Add one SVG line trace per series, pre-drawn merged at full zoom out (what a PNG
    export shows), and return the HTML (data and script) to place after the figure's div;
    ``__DIV__`` stands for its id. The script redraws at load and on every zoom."""
    cats = []
    tol = (x_range[1] - x_range[0]) / width_px
    for s in series:
        spans, lanes_of = _by_start(s.spans, s.lane_of)
        a = _merged_arrays(_merged(spans, lanes_of, tol))
        cats.append({**_payload(s.name, spans, lanes_of), "trace": len(fig.data)})
        fig.add_trace(go.Scatter(x=a["x"], y=a["y"], text=a["text"], mode="lines", name=s.name,
                                 opacity=s.opacity, legendgroup=s.group or s.name,
                                 showlegend=s.legend, line={"color": s.color, "width": line_px},
                                 hovertemplate=MERGED_HOVER, connectgaps=False))
    fig.update_xaxes(range=list(x_range), autorange=False)
    data = json.dumps({"cats": cats, "lanes": lanes, "hover_max": HOVER_MAX, "range": list(x_range),
                       "hover": hover, "merged_hover": MERGED_HOVER}, separators=(",", ":"))
    safe = data.replace("</", "<\\/")
    return f"<script type='application/json' id='__DIV__-lod'>{safe}</script><script>{LOD_JS}</script>"


LOD_JS = """
(function () {
  const gd = document.getElementById('__DIV__');
  if (!gd) return;
  gd.dataset.lod = 'pending';
  const spec = JSON.parse(document.getElementById('__DIV__-lod').textContent);
  function typed(s, T) {
    const bin = atob(s), buf = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) buf[i] = bin.charCodeAt(i);
    return new T(buf.buffer);
  }
  const cats = spec.cats.map(c => ({name: c.name, ops: c.ops, maxDur: c.max_dur, trace: c.trace,
    start: typed(c.start, Float64Array), end: typed(c.end, Float64Array),
    lane: typed(c.lane, Int32Array), meta: typed(c.meta, Float64Array)}));
  function lower(a, x) { let lo = 0, hi = a.length;
    while (lo < hi) { const m = (lo + hi) >> 1; if (a[m] < x) lo = m + 1; else hi = m; } return lo; }
  function draw(x0, x1) {
    const width = (gd._fullLayout && gd._fullLayout._size && gd._fullLayout._size.w) || 1200;
    const tol = (x1 - x0) / width;
    const win = cats.map(c => [lower(c.start, x0 - c.maxDur), lower(c.start, x1)]);
    let visible = 0;
    cats.forEach((c, k) => { for (let i = win[k][0]; i < win[k][1]; i++) if (c.end[i] >= x0) visible++; });
    const exact = visible <= spec.hover_max;
    const upd = {x: [], y: [], text: [], customdata: [], hovertemplate: []}, idx = [];
    cats.forEach((c, k) => {
      const m = c.meta, xs = [], ys = [], tx = [], cd = [];
      const oS = new Float64Array(spec.lanes).fill(NaN), oE = new Float64Array(spec.lanes);
      const cnt = new Int32Array(spec.lanes), first = new Int32Array(spec.lanes);
      function seg(l, s, e, text, row) {
        xs.push(s, (s + e) / 2, e, NaN); ys.push(l, l, l, NaN);
        tx.push(text, text, text, ''); cd.push(row, row, row, null);
      }
      function flush(l) {
        if (isNaN(oS[l])) return;
        const j = first[l];
        seg(l, oS[l], oE[l], cnt[l] > 1 ? cnt[l] + ' ops merged at this zoom (rank ' + m[6 * j] +
            ', from ' + c.ops[j] + '); zoom in for each op' : c.ops[j], null);
        oS[l] = NaN;
      }
      for (let i = win[k][0]; i < win[k][1]; i++) {
        const s = c.start[i], e = c.end[i];
        if (e < x0) continue;
        const l = c.lane[i];
        if (exact) {
          seg(l, s, e, c.ops[i], [m[6 * i], m[6 * i + 1], m[6 * i + 2], m[6 * i + 3], m[6 * i + 4],
                                   m[6 * i + 5], s, e - s]);
        } else if (!isNaN(oS[l]) && s - oE[l] <= tol) { if (e > oE[l]) oE[l] = e; cnt[l]++; }
        else { flush(l); oS[l] = s; oE[l] = e; cnt[l] = 1; first[l] = i; }
      }
      for (let l = 0; l < spec.lanes; l++) flush(l);
      upd.x.push(xs); upd.y.push(ys); upd.text.push(tx); upd.customdata.push(exact ? cd : null);
      upd.hovertemplate.push(exact ? spec.hover : spec.merged_hover); idx.push(c.trace);
    });
    gd.dataset.lodVisible = String(visible);
    gd.dataset.lodExact = exact ? '1' : '0';
    return Plotly.restyle(gd, upd, idx);
  }
  let busy = false;
  function onRelayout(ev) {
    if (busy) return;
    if (ev['xaxis.autorange']) { Plotly.relayout(gd, {'xaxis.range': spec.range}); return; }
    if (!('xaxis.range[0]' in ev) && !('xaxis.range' in ev)) return;
    const r = gd._fullLayout.xaxis.range;
    busy = true;
    draw(r[0], r[1]).then(() => { busy = false; gd.dataset.lodDraws = String(+gd.dataset.lodDraws + 1); });
  }
  (function start() {
    if (!gd._fullLayout || !gd.on) { setTimeout(start, 20); return; }
    gd.dataset.lodDraws = '0';
    draw(spec.range[0], spec.range[1]).then(() => {
      gd.on('plotly_relayout', onRelayout);
      gd.dataset.lodDraws = '1';
      gd.dataset.lod = 'ready';
    }).catch(e => { window.__paratwinErrors && window.__paratwinErrors.push('lod: ' + e); });
  })();
})();
"""
