"""paratwin.progress.Progress: the progress line the verbs draw on a terminal's stderr."""

from __future__ import annotations

import io

from paratwin.progress import Progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_new_stage_is_drawn_at_once_and_pads_over_the_longer_line_before():
    out = _Tty()
    bar = Progress("paratwin simulate", stream=out, delay_s=0.0)
    bar.update(1, 4, "simulating step 1/1")
    bar.update(2, 4, "simulating step 1/1")  # the same stage within 0.2 s: not drawn
    bar.update(0, None, "critical path")  # a new stage: drawn now, without a bar
    bar.close()
    drawn = out.getvalue().split("\r")[1:]
    assert len(drawn) == 2
    assert "[######                  ]  25.0% simulating step 1/1" in drawn[0]
    assert drawn[1].startswith("paratwin simulate critical path ") and "[" not in drawn[1]
    assert len(drawn[1].rstrip("\n")) >= len(drawn[0])  # nothing of the longer line left
    assert out.getvalue().endswith("\n")


def test_nothing_is_drawn_off_a_terminal_or_in_the_first_second():
    piped = io.StringIO()
    bar = Progress("x", stream=piped, delay_s=0.0)
    bar.update(0, None, "stage")
    bar.close()
    assert piped.getvalue() == ""
    tty = _Tty()
    bar = Progress("x", stream=tty)  # the default delay: a second
    bar.update(1, 2, "stage")
    bar.close()
    assert tty.getvalue() == ""
