"""Measured-run files and nccl-tests output: read with their column map, refused row by row."""

from __future__ import annotations

from pathlib import Path

import pytest

from twin.calibrate.nccl_tests import NcclTestsError, read_nccl_tests
from twin.calibrate.runs import ColumnMap, RunsFileError, evaluate, read_runs

ROOT = Path(__file__).resolve().parents[2]
A100 = ROOT.parent / "shared" / "reference" / "a100_measured"


def write(tmp_path: Path, text: str, name: str = "runs.csv") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_native_file(tmp_path):
    p = write(tmp_path, "name,model,parallel.tp,parallel.dp,step_time_ms\na,tiny,2,1,12.5\n"
                        "b,tiny,1,2,10\n")
    a, b = read_runs(p)
    assert a.overrides == {"model": "tiny", "parallel.tp": 2, "parallel.dp": 1}
    assert a.step_time_s == pytest.approx(0.0125) and a.label == "a" and a.line == 2
    assert b.step_time_s == pytest.approx(0.010)


def test_an_empty_cell_leaves_the_key_to_the_presets(tmp_path):
    p = write(tmp_path, "model,model.seq_len,parallel.tp,step_time_s\ntiny,128,,0.5\ntiny,,2,0.7\n")
    a, b = read_runs(p)
    assert a.overrides == {"model": "tiny", "model.seq_len": 128}
    assert b.overrides == {"model": "tiny", "parallel.tp": 2}
    with pytest.raises(RunsFileError, match="line 2: step_time_s='' must be a positive number"):
        read_runs(write(tmp_path, "model,step_time_s\ntiny,\n", "blank.csv"))


def test_kind_columns_are_measured_times_per_kind(tmp_path):
    p = write(tmp_path, "model,parallel.tp,step_time_s,gemm_s,optimizer_s,attention_s\n"
                        "tiny,2,0.5,0.2,0.05,\ntiny,1,0.7,,,\n")
    a, b = read_runs(p)
    assert a.kinds == {"gemm": 0.2, "optimizer": 0.05}  # an empty cell: not measured
    assert a.overrides == {"model": "tiny", "parallel.tp": 2} and b.kinds == {}
    with pytest.raises(RunsFileError, match="line 3: optimizer_s=-0.1 must be a positive number "
                                            "of seconds"):
        read_runs(write(tmp_path, "model,step_time_s,optimizer_s\ntiny,1,0.2\ntiny,1,-0.1\n",
                        "neg.csv"))


def test_column_map_sets_and_derives(tmp_path):
    cmap = tmp_path / "map.yaml"
    cmap.write_text("columns: {'hidden size': model.hidden_size, 'TP': parallel.tp, "
                    "'time (ms)': step_time_ms}\nset: {model.dtype: fp16}\n"
                    "derive: {model.ffn_hidden_size: 4 * model.hidden_size, "
                    "model.vocab_size: -(-50257 // (128 * parallel.tp)) * 128 * parallel.tp}\n")
    p = write(tmp_path, "hidden size,TP,time (ms)\n1024,4,100\n")
    (run,) = read_runs(p, ColumnMap.load(cmap))
    assert run.overrides["model.ffn_hidden_size"] == 4096
    assert run.overrides["model.vocab_size"] == 50688  # Megatron's padding to 128 x 4
    assert run.overrides["model.dtype"] == "fp16" and run.step_time_s == pytest.approx(0.1)


@pytest.mark.parametrize("text, message", [
    ("model.hidden_size,parallel.tp\n1024,2\n", "needs exactly one of step_time_s, step_time_ms"),
    ("model.hidden_size,step_time_ms\n1024,-3\n", "line 2: step_time_ms=-3 must be a positive number"),
    ("model.hidden_size,step_time_ms\n1024,abc\n", "line 2: step_time_ms='abc' must be a positive"),
    ("model.hidden_size,step_time_ms\n1024,5\n1024\n", "line 3: 1 values for 2 columns"),
    ("hiden,step_time_ms\n1024,5\n", "'hiden' is not a config key"),
    ("gemm_ms,step_time_ms\n1,5\n", "or a kind's time (gemm_s / attention_s"),
    ("step_time_ms\n", "has a header but no rows"),
])
def test_malformed_runs_file_names_the_row(tmp_path, text, message):
    with pytest.raises(RunsFileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_runs(write(tmp_path, text))


def test_derive_names_what_the_row_lacks(tmp_path):
    cmap = tmp_path / "m.yaml"
    cmap.write_text("derive: {model.ffn_hidden_size: 4 * model.hidden_size}\n")
    with pytest.raises(RunsFileError, match="line 2: derive model.ffn_hidden_size = 4 \\* "
                                            "model.hidden_size needs model.hidden_size"):
        read_runs(write(tmp_path, "parallel.tp,step_time_s\n2,1.0\n"), ColumnMap.load(cmap))
    with pytest.raises(ValueError, match="is not arithmetic"):
        evaluate("__import__('os')", {})


@pytest.mark.skipif(not A100.is_dir(), reason="the shared A100 set is not here")
def test_the_a100_set_reads_with_its_shipped_map():
    cmap = ColumnMap.load(ROOT / "conf/column_maps/vtrain_a100.yaml")
    runs = read_runs(A100 / "step_times_1node.csv", cmap)
    assert len(runs) == 1440
    first = runs[0].overrides
    assert first["cluster.gpus_per_node"] == 2 and first["parallel.pp"] == 2
    assert first["model.vocab_size"] == 50304 and runs[0].step_time_s == pytest.approx(0.372160408)
    rows = read_nccl_tests(A100 / "nccl_allreduce_8gpu.csv")
    assert len(rows) == 1024 and rows[0]["group_size"] == 8 and rows[0]["kind"] == "all_reduce"
    assert rows[0]["bytes"] == 1048576 and rows[0]["time_s_median"] == pytest.approx(92.15e-6)


def test_nccl_tests_text_output(tmp_path):
    text = ("# nThread 1 nGpus 1 minBytes 8 maxBytes 1048576 step: 2(factor)\n# Using devices\n"
            "#  Rank  0 Group  0 Pid 1 on h device  0 [0x07] NVIDIA H100\n"
            "#  Rank  1 Group  0 Pid 2 on h device  1 [0x08] NVIDIA H100\n"
            "#       size    count   type   redop    root     time   algbw   busbw #wrong     time"
            "   algbw   busbw #wrong\n"
            "           8        2  float     sum      -1    28.33    0.00    0.00      0    27.71"
            "    0.00    0.00      0\n"
            "     1048576   262144  float     sum      -1    40.10   26.15   26.15    N/A    39.90"
            "   26.28   26.28    N/A\n")
    rows = read_nccl_tests(write(tmp_path, text, "all_reduce_perf.txt"))
    assert [r["group_size"] for r in rows] == [2, 2]
    assert [r["time_s_median"] for r in rows] == pytest.approx([27.71e-6, 39.90e-6])
    with pytest.raises(NcclTestsError, match="no measurement rows"):
        read_nccl_tests(write(tmp_path, "# Rank  0 \nhello\n", "all_reduce_2gpu.txt"))
