"""What a check says: a :class:`Verdict` (ok, warn, fail or skip, one line, and the fix), and the
report of all of them as a table for people or JSON for scripts. Pure."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

Status = Literal["ok", "warn", "fail", "skip"]
STATUSES: tuple[Status, ...] = ("ok", "warn", "fail", "skip")
EXIT_OK = 0
EXIT_FAILED = 1
"""Some check failed (warnings and skipped checks do not count)."""


@dataclass(frozen=True)
class Verdict:
    """One check's answer. ``check`` is the check's stable name (``device-nodes``); ``subject``
    what it looked at when a check looks at several things (``GPU 0``, ``containerd``), else
    empty; ``detail`` one line of what was found; ``fix`` what to do about it (empty when ok)."""

    check: str
    status: Status
    detail: str
    fix: str = ""
    subject: str = ""

    @property
    def label(self) -> str:
        return f"{self.check} ({self.subject})" if self.subject else self.check


def ok(check: str, detail: str, *, subject: str = "") -> Verdict:
    return Verdict(check, "ok", detail, "", subject)


def warn(check: str, detail: str, fix: str, *, subject: str = "") -> Verdict:
    return Verdict(check, "warn", detail, fix, subject)


def fail(check: str, detail: str, fix: str, *, subject: str = "") -> Verdict:
    return Verdict(check, "fail", detail, fix, subject)


def skip(check: str, detail: str, *, subject: str = "") -> Verdict:
    return Verdict(check, "skip", detail, "", subject)


def exit_code(verdicts: Sequence[Verdict]) -> int:
    """0 when nothing failed, 1 otherwise."""
    return EXIT_FAILED if any(v.status == "fail" for v in verdicts) else EXIT_OK


def counts(verdicts: Sequence[Verdict]) -> dict[str, int]:
    return {s: sum(1 for v in verdicts if v.status == s) for s in STATUSES}


def to_json(node: str, verdicts: Sequence[Verdict]) -> str:
    """``{"node", "ok", "counts", "checks": [{check, subject, status, detail, fix}]}``."""
    data = {
        "node": node,
        "ok": exit_code(verdicts) == EXIT_OK,
        "counts": counts(verdicts),
        "checks": [asdict(v) for v in verdicts],
    }
    return json.dumps(data, indent=2) + "\n"


_MARK = {"ok": "ok", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


def to_table(node: str, verdicts: Sequence[Verdict]) -> str:
    """One line per verdict (status, check, detail), the fix indented under it, a summary last."""
    width = max((len(v.label) for v in verdicts), default=0)
    lines = [f"tessera doctor: node {node}", ""]
    for v in verdicts:
        lines.append(f"{_MARK[v.status]:<5} {v.label:<{width}}  {v.detail}")
        if v.fix:
            lines.append(f"{'':<5} {'':<{width}}  fix: {v.fix}")
    c = counts(verdicts)
    verdict = "some checks failed" if c["fail"] else "nothing failed"
    lines += ["", f"{verdict}: {c['ok']} ok, {c['warn']} warn, {c['fail']} fail, {c['skip']} skip"]
    return "\n".join(lines) + "\n"
