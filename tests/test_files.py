"""Atomic writes (twin.files): the whole text or nothing, never half a file."""

from __future__ import annotations

import gzip

import pytest

from twin.files import write_pieces_atomic, write_text_atomic


def test_pieces_are_written_whole_and_compressed_on_request(tmp_path):
    out = write_pieces_atomic(tmp_path / "a.txt", iter(["ab", "", "cé"]))
    assert out.read_text(encoding="utf-8") == "abcé"
    gz = write_text_atomic(tmp_path / "a.txt.gz", "abcé", compress=True)
    with gzip.open(gz, "rt", encoding="utf-8") as fh:
        assert fh.read() == "abcé"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "a.txt.gz"]


def test_a_piece_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "kept.json"
    path.write_text("the old text")

    def pieces():
        yield "half of the new "
        raise RuntimeError("the writer failed")

    with pytest.raises(RuntimeError, match="the writer failed"):
        write_pieces_atomic(path, pieces())
    assert path.read_text() == "the old text"
    assert [p.name for p in tmp_path.iterdir()] == ["kept.json"]
