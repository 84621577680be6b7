"""The progress bar redraws at most every LOG_INTERVAL_S when stderr is a log, not once per step."""

import io
import sys

from splash.progress import LOG_INTERVAL_S, progress_bar


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_bar_is_throttled_and_tty_bar_is_not(monkeypatch) -> None:
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    bar = progress_bar(1000, "steps", "step")
    assert bar.mininterval == LOG_INTERVAL_S
    clock = iter(range(10**6))
    t0 = bar.last_print_t
    bar._time = lambda: t0 + next(clock)  # a fake clock: each step takes 1 s
    for _ in range(200):  # one step per second for 200 s: a draw every LOG_INTERVAL_S, not every step
        bar.set_postfix_str("x", refresh=False)
        bar.update(1)
    draws = log.getvalue().count("\r")
    bar.close()
    assert 2 <= draws <= 200 / LOG_INTERVAL_S + 2
    monkeypatch.setattr(sys, "stderr", _Tty())
    tty_bar = progress_bar(10, "steps", "step")
    assert tty_bar.mininterval < 1
    tty_bar.close()
