"""The Chrome/Perfetto export: pid per node, tid per rank and stream, flows send -> recv."""

from __future__ import annotations

import json

import pytest

from twin.chrome import chrome_text, write_chrome
from twin.chrome import chrome_trace as chrome_events
from twin.report import rundir as rd
from twin.rundir import CHROME_FALLBACK as FALLBACK_NAME
from twin.rundir import chrome_path


@pytest.fixture(scope="module")
def exported(runs):
    run = rd.load(runs["single"])
    return run, chrome_events(run.trace, gpus_per_node=4)


def test_pid_per_node_and_named_tid_per_rank_and_stream(exported):
    run, data = exported
    ev = data["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e.get("name") == "thread_name"}
    assert {n.split(" #")[0] for n in names.values()} == \
        {f"rank {s.rank} {s.stream}" for s in run.trace.spans}
    for e in ev:
        if e["ph"] == "X":
            rank = int(names[(e["pid"], e["tid"])].split()[1])
            assert e["pid"] == rank // 4
    procs = {e["pid"]: e["args"]["name"] for e in ev if e.get("name") == "process_name"}
    assert procs == {0: "node 0", 1: "node 1"}
    order = [names[k] for k in sorted(names, key=lambda k: k[1])]
    assert order[0] == "rank 0 compute" and order.index("rank 0 p2p") < order.index("rank 1 compute")


def test_every_recv_gets_a_flow_from_its_send_inside_both_slices(exported):
    run, data = exported
    ev = data["traceEvents"]
    slices = {(e["pid"], e["tid"], e["ts"]): e for e in ev if e["ph"] == "X"}
    starts = {e["id"]: e for e in ev if e["ph"] == "s"}
    ends = {e["id"]: e for e in ev if e["ph"] == "f"}
    recvs = [s for s in run.trace.spans if s.kind == "recv"]
    assert len(starts) == len(ends) == len(recvs) > 0
    assert all(e["bp"] == "e" for e in ends.values())

    def inside(flow):
        hits = [x for (p, t, ts), x in slices.items() if p == flow["pid"] and t == flow["tid"]
                and ts <= flow["ts"] <= ts + x["dur"]]
        return [x["cat"] for x in hits]

    for i in starts:
        assert inside(starts[i]) == ["send"] and inside(ends[i]) == ["recv"]
        assert ends[i]["ts"] >= starts[i]["ts"]


def test_slices_on_one_thread_never_overlap(exported):
    """Chrome's format needs slices on a thread to nest; concurrent p2p ops get extra tids."""
    _, data = exported
    by_tid: dict = {}
    for e in data["traceEvents"]:
        if e["ph"] == "X":
            by_tid.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for iv in by_tid.values():
        iv.sort()
        assert all(b[0] >= a[1] - 1e-9 for a, b in zip(iv, iv[1:]))


def test_memory_counters_per_rank(exported):
    run, data = exported
    counters = [e for e in data["traceEvents"] if e["ph"] == "C"]
    assert {e["name"] for e in counters} == {f"memory rank {r} (GiB)" for r in range(8)}
    assert {"params", "activations"} <= set(counters[0]["args"])


def test_never_overwrites_a_paratwin_trace_named_trace_json(runs, tmp_path):
    run = rd.load(runs["pp"])
    run.trace.save(tmp_path / "trace.json")  # an executor directory: the trace is trace.json
    assert chrome_path(tmp_path) == tmp_path / FALLBACK_NAME
    with pytest.raises(ValueError, match="must not overwrite"):
        write_chrome(run.trace, tmp_path / "trace.json")
    out = write_chrome(run.trace, chrome_path(tmp_path))
    assert json.loads(out.read_text())["traceEvents"]
    assert rd.load(tmp_path).trace_path.name == "trace.json"  # still the paratwin trace


def test_the_export_is_the_compact_json_of_its_events(runs, tmp_path):
    """The export is written as text, span by span, not through a dict per event: it must be
    exactly what json.dumps writes for the events it holds (numbers, escapes, key order), for
    spans as the twin makes them and as a file gives them back (ints, numpy floats, quotes)."""
    import dataclasses

    import numpy as np

    run = rd.load(runs["single"])
    spans = list(run.trace.spans)
    for i in (1, next(i for i, s in enumerate(spans) if s.kind == "gemm")):  # an alloc, a slice
        spans[i] = dataclasses.replace(spans[i], start_us=np.float64(spans[i].start_us),
                                       op='a "quoted" \\ op \u00e9', bytes=4096)
    trace = dataclasses.replace(run.trace, spans=spans)
    text = "".join(chrome_text(trace, gpus_per_node=4))
    data = json.loads(text)
    assert json.dumps(data, separators=(",", ":")) == text
    # one slice ("X") or instant ("i", memory ops) per span, at the span's own start
    marks = [e for e in data["traceEvents"] if e["ph"] in ("X", "i")]
    assert len(marks) == len(spans)
    assert sorted(e["ts"] for e in marks) == sorted(float(s.start_us) for s in spans)
    mine = [e for e in data["traceEvents"] if e.get("args", {}).get("op") == 'a "quoted" \\ op \u00e9']
    assert {e["ph"] for e in mine} == {"i", "X"} and all(e["args"]["bytes"] == 4096 for e in mine)
    out = write_chrome(trace, tmp_path / "trace.json", gpus_per_node=4)
    assert out.read_text() == text
