"""Level of detail for big timelines: the page keeps every span and draws what the zoom shows.

Every span stays in the page (typed arrays, base64). A small script draws, per category,
the spans in the visible time window as WebGL segments, merging neighbours in a lane that
are less than a pixel apart, so the drawn segments never exceed about lanes x pixels; once
the window holds at most ``HOVER_MAX`` spans, each span gets its own hover (op, rank, step,
layer, micro-batch, bytes, FLOPs, duration). Zooming or panning redraws. This keeps a
200,000-span trace quick to load even where WebGL is software-rendered (headless CI).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

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


def _payload(series: Series) -> dict:
    spans = sorted(series.spans, key=lambda s: s.start_us)
    n = len(spans)
    start = np.fromiter((s.start_us for s in spans), np.float64, n)
    end = np.fromiter((s.end_us for s in spans), np.float64, n)
    lane = np.fromiter((series.lane_of(s) for s in spans), np.int32, n)
    meta = np.array([(s.rank, s.step, s.layer, s.mb, s.bytes, s.flops) for s in spans],
                    dtype=np.float64).reshape(n, 6)
    return {"name": series.name, "start": _b64(start), "end": _b64(end), "lane": _b64(lane),
            "meta": _b64(meta), "ops": [s.op for s in spans],
            "max_dur": float((end - start).max()) if n else 0.0}


def merged(spans: list[Span], lane_of, tol_us: float) -> tuple[np.ndarray, np.ndarray]:
    """Segments (x, y with NaN gaps) of ``spans`` with neighbours in a lane closer than
    ``tol_us`` merged: what the page draws at full zoom out (same rule as LOD_JS)."""
    open_: dict[int, list[float]] = {}
    xs: list[float] = []
    ys: list[float] = []
    for s in sorted(spans, key=lambda s: s.start_us):
        lane = lane_of(s)
        cur = open_.get(lane)
        if cur is not None and s.start_us - cur[1] <= tol_us:
            cur[1] = max(cur[1], s.end_us)
            continue
        if cur is not None:
            xs += [cur[0], cur[1], np.nan]
            ys += [lane, lane, np.nan]
        open_[lane] = [s.start_us, s.end_us]
    for lane, cur in open_.items():
        xs += [cur[0], cur[1], np.nan]
        ys += [lane, lane, np.nan]
    return np.array(xs, dtype=float), np.array(ys, dtype=float)


def add_lod(fig: go.Figure, series: list[Series], lanes: int, x_range: tuple[float, float],
            line_px: float, hover: str, width_px: int = 1200) -> str:
    """Add two WebGL traces per series (segments, hover points), the segments pre-drawn at
    full zoom out, and return the HTML (data and script) to place after the figure's div;
    ``__DIV__`` stands for its id."""
    cats = []
    tol = (x_range[1] - x_range[0]) / width_px
    for s in series:
        line_idx = len(fig.data)
        x, y = merged(s.spans, s.lane_of, tol)
        fig.add_trace(go.Scattergl(x=x, y=y, mode="lines", name=s.name, opacity=s.opacity,
                                   legendgroup=s.group or s.name, showlegend=s.legend,
                                   line={"color": s.color, "width": line_px}, hoverinfo="skip",
                                   connectgaps=False))
        fig.add_trace(go.Scattergl(x=[], y=[], mode="markers", name=s.name,
                                   legendgroup=s.group or s.name, showlegend=False,
                                   marker={"color": s.color, "size": max(line_px, 4), "opacity": 0.0},
                                   hovertemplate=hover))
        cats.append({**_payload(s), "line": line_idx, "hover": line_idx + 1})
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
  const cats = spec.cats.map(c => ({name: c.name, ops: c.ops, maxDur: c.max_dur, line: c.line,
    hover: c.hover, start: typed(c.start, Float64Array), end: typed(c.end, Float64Array),
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
    const lines = {x: [], y: []}, lineIdx = [];
    cats.forEach((c, k) => {
      const oS = new Float64Array(spec.lanes).fill(NaN), oE = new Float64Array(spec.lanes);
      const cnt = new Int32Array(spec.lanes), first = new Int32Array(spec.lanes);
      const xs = [], ys = [], hx = [], hy = [], ht = [], hc = [];
      function flush(l) {
        if (isNaN(oS[l])) return;
        xs.push(oS[l], oE[l], NaN); ys.push(l, l, NaN);
        if (!exact) {
          const m = c.meta, j = first[l];
          hx.push((oS[l] + oE[l]) / 2); hy.push(l); hc.push([m[6 * j], m[6 * j + 1]]);
          ht.push(cnt[l] > 1 ? cnt[l] + ' ops merged at this zoom (rank ' + m[6 * j] + ', from '
                  + c.ops[j] + '); zoom in for each op' : c.ops[j]);
        }
      }
      for (let i = win[k][0]; i < win[k][1]; i++) {
        const s = c.start[i], e = c.end[i];
        if (e < x0) continue;
        const l = c.lane[i];
        if (exact) {
          const m = c.meta;
          hx.push((s + e) / 2); hy.push(l); ht.push(c.ops[i]);
          hc.push([m[6 * i], m[6 * i + 1], m[6 * i + 2], m[6 * i + 3], m[6 * i + 4], m[6 * i + 5], s, e - s]);
        }
        if (!isNaN(oS[l]) && s - oE[l] <= tol) { if (e > oE[l]) oE[l] = e; cnt[l]++; }
        else { flush(l); oS[l] = s; oE[l] = e; cnt[l] = 1; first[l] = i; }
      }
      for (let l = 0; l < spec.lanes; l++) flush(l);
      lines.x.push(xs); lines.y.push(ys); lineIdx.push(c.line);
      upd.x.push(hx); upd.y.push(hy); upd.text.push(ht); upd.customdata.push(hc);
      upd.hovertemplate.push(exact ? spec.hover : spec.merged_hover); idx.push(c.hover);
    });
    gd.dataset.lodVisible = String(visible);
    gd.dataset.lodExact = exact ? '1' : '0';
    return Plotly.restyle(gd, lines, lineIdx).then(() => Plotly.restyle(gd, upd, idx));
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
