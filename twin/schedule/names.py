"""Micro-batch tokens of op names and tags: the IR's naming rule (twin/schedule/ir.py) read
back. A token is ``mb`` not inside a word, then all its digits (``fwd/mb3/L7/qkv``,
``free.act.L7.mb3``); the same op d micro-batches later has every token moved by d. The
fast-forward finds an op's counterpart a period later by them (twin/sim/fastforward.py);
the builder stamps a later action from a recorded one by them (twin/schedule/actions.py)."""

from __future__ import annotations

import re
from functools import lru_cache

_WORD = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")
_DIGITS = "0123456789"
_TOKEN = re.compile(r"(?<![A-Za-z0-9_])mb([0-9]+)")
"""A micro-batch token of a name or tag: ``mb`` not inside a word, then all its digits."""


@lru_cache(maxsize=1 << 18)
def _tokens(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    parts = _TOKEN.split(text)
    return tuple(parts[0::2]), tuple(map(int, parts[1::2]))


def mb_tokens(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``text`` split around its micro-batch tokens: (the text between them, one more piece
    than tokens; each token's micro-batch). An op's name can name other micro-batches than
    its own (a buffer kept from a forward freed in a later backward:
    ``bwd/mb6/L3/free.gathered.3.fwd.mb11``); the same op d micro-batches later has every
    one of them moved by d."""
    head, found, tail = text.partition("mb")
    if not found:
        return (text,), ()
    if "mb" not in tail:  # one "mb" (most names): the pattern's test by hand
        k = len(tail) - len(tail.lstrip(_DIGITS))
        if not k or head[-1:] in _WORD:
            return (text,), ()
        return (head, tail[k:]), (int(tail[:k]),)
    return _tokens(text)


def moved(text: str, d: int) -> str:
    """``text`` (an op's name or tag) with every micro-batch token moved by ``d``: the name of
    the same op d micro-batches later."""
    if not d or "mb" not in text:
        return text
    return joined(*mb_tokens(text), d)


def joined(pieces: tuple[str, ...], mbs: tuple[int, ...], d: int) -> str:
    """The text ``mb_tokens`` split, its micro-batches moved by ``d``."""
    if not mbs:
        return pieces[0]
    if len(mbs) == 1:  # most names
        return f"{pieces[0]}mb{mbs[0] + d}{pieces[1]}"
    out = [pieces[0]]
    for mb, piece in zip(mbs, pieces[1:]):
        out += (f"mb{mb + d}", piece)
    return "".join(out)
