"""The one fake clock of the tests: a ``Callable[[], float]`` a test moves by hand, passed where
the code takes ``clock=`` / ``monotonic=`` (Unix time or monotonic seconds alike), so no test
waits for real time to pass."""

from __future__ import annotations


class FakeClock:
    """Reads ``t``; a test moves it (``clock.t += 5``, ``clock.advance(5)``, or ``clock.now`` —
    the same value under the name some callers use). ``step``: each read first moves the clock on
    by that much (time that passes as the code looks at it)."""

    def __init__(self, t: float = 1000.0, *, step: float = 0.0) -> None:
        self.t = t
        self.step = step

    def __call__(self) -> float:
        self.t += self.step
        return self.t

    @property
    def now(self) -> float:
        return self.t

    @now.setter
    def now(self, value: float) -> None:
        self.t = value

    def advance(self, seconds: float) -> None:
        self.t += seconds
