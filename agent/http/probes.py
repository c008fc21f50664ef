"""/readyz's and /healthz's named checks, registered by the components that own them."""

from __future__ import annotations

import threading
from collections.abc import Callable

Check = Callable[[], tuple[bool, str]]


class Readiness:
    """Named checks, registered by the components that own them: /readyz's, and /healthz's
    (liveness: what a restart of the agent would repair)."""

    def __init__(self) -> None:
        self._checks: dict[str, Check] = {}
        self._lock = threading.Lock()

    def add(self, name: str, check: Check) -> None:
        with self._lock:
            self._checks[name] = check

    def evaluate(self, empty_ok: bool = False) -> tuple[bool, dict[str, str]]:
        """Whether every check passes (no checks at all passes only when ``empty_ok``), with
        every check's detail; for liveness, only the failing ones' details matter."""
        with self._lock:
            checks = dict(self._checks)
        results = {name: check() for name, check in checks.items()}
        ok = (bool(results) or empty_ok) and all(passed for passed, _ in results.values())
        if empty_ok:  # liveness: say what is wrong, not what is fine
            return ok, {name: detail for name, (passed, detail) in results.items() if not passed}
        return ok, {name: detail for name, (_, detail) in results.items()}
