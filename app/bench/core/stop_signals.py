"""How a bench run stops: the first SIGTERM or SIGINT unwinds it through the ``finally`` that
stops its engines, and later ones cannot cut that short."""

from __future__ import annotations

import signal
import sys
from types import FrameType


def exit_on_signal() -> None:
    """The first SIGTERM or SIGINT unwinds the run through its ``finally`` (which stops its
    engines); later ones are ignored. Raising again while that cleanup runs would leave the
    engines behind: Ctrl-C reaches the child and ``run_child`` then sends SIGTERM too."""

    def stop(signum: int, _frame: FrameType | None) -> None:
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        sys.exit(128 + signum)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, stop)
