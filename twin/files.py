"""Atomic file writes: a temporary file in the same folder renamed into place, so a reader
(or a crash) never sees half a file and a good file is never half-overwritten."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path


def write_pieces_atomic(path: str | Path, pieces, *, compress: bool = False) -> Path:
    """Write the text ``"".join(pieces)`` atomically, a piece at a time (never held whole);
    ``compress``: gzip. A piece that fails to come (an exception) leaves the file as it was
    and no temporary behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with (gzip.open(tmp, "wt", encoding="utf-8") if compress
              else open(tmp, "w", encoding="utf-8")) as fh:
            for piece in pieces:
                fh.write(piece)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)
    return path


def write_text_atomic(path: str | Path, text: str, *, compress: bool = False) -> Path:
    return write_pieces_atomic(path, (text,), compress=compress)


def write_json_atomic(path: str | Path, data, indent: int | None = 2) -> Path:
    return write_text_atomic(path, json.dumps(data, indent=indent, default=str,
                                              separators=None if indent else (",", ":")))
