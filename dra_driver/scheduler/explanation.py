"""``explain(claim, classes, slices, allocated, cel=...)``: would the scheduler allocate this
claim on this node, with which devices, and if not, why not.

An ``Explanation`` answers in four forms:

- ``ok`` / ``gave_up``;
- ``allocation()``: the ``status.allocation`` object the scheduler would write
  (``devices.results`` in request order, ``devices.config`` as upstream copies class and claim
  configs, ``nodeSelector`` as ``node_reach.node_selector`` makes it);
- ``text()``: a few lines a person reads in ten seconds;
- ``to_json()``: the same for tools, in this shape (``DeviceRef`` is
  ``{"driver", "pool", "device"}``; ``Reason`` is ``{"kind", "text", ...details}``)::

    {"claim": "ns/name", "fits": bool, "gaveUp": bool,
     "reason": str | null,                  # first_reason() when it does not fit
     "error": str | null,                   # the allocator's error for the claim (below)
     "fatal": Reason | null,                # the same error with its details and "upstream"
     "allocation": {...} | null,            # allocation() when it fits
     "requests": [{"name": "gpus", "firstAvailable": bool,
                   "selected": "gpus" | "gpus/sub" | null,
                   "alternatives": [{        # one, or one per subrequest in order
                       "request": "gpus" | "gpus/sub", "deviceClassName": str,
                       "allocationMode": "ExactCount" | "All", "count": int | null,
                       "adminAccess": bool, "matched": int, "candidates": int,
                       "chosen": [DeviceRef + {"shareID"?, "consumedCapacity"?}],
                       "failure": {"reason": str, "placed": [DeviceRef + {"request"}]} | null,
                       "rejected": {kind: count},
                       "devices": [DeviceRef + {"status": "chosen" | "candidate" | "rejected",
                                                "reason": Reason | null}]}]}],
     "pools": [{"driver", "pool", "generation", "slices", "resourceSliceCount", "devices",
                "problem": str | null}],
     "ignored": [str],                      # slices, or their devices, the scheduler does not read
     "scheduler": {"kubernetesVersion", "allocator", "featureGates"},  # Scheduler.to_json()
     "steps": int}

Reason kinds: ``pool`` (incomplete or invalid pool), ``unknown-class``, ``class-selector``,
``request-selector`` (with ``expression`` and ``seen``: the values it read), ``cel-error``,
``tainted``, ``feature-gate`` (``gate``: a gate that is off refuses the claim or the device),
``allocated`` (``owner``), ``capacity``, ``counters`` (``counterSet``,
``counter``), ``constraint`` (``attribute``, ``value``, ``conflictsWith``), ``taken`` (by
another request of this claim), ``taken-in-pod`` (by another claim allocated with it:
``claim``, ``request``; ``joint``), ``no-completion``, ``too-few``, ``too-many``, ``gave-up``.

An error (``outcome.Fatal``: upstream's Allocate returns it) is not "does not fit": the scheduler
stops scheduling the pod with it. ``fatal`` adds ``upstream``, the scheduler's own message.

Not modelled (the caller passes one node's slices, so node selection is its business): slice
and per-device node selectors, binding conditions, scoring. The admin-access rule that the
claim's namespace carries ``resource.kubernetes.io/admin-access: "true"`` is enforced by the API
server's admission, not by the allocator, so it is not checked here either.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from dra_driver.scheduler import gates
from dra_driver.scheduler.allocation_config import allocation_config
from dra_driver.scheduler.celenv import CelEnvironment
from dra_driver.scheduler.domain import (
    Claim,
    Device,
    Mode,
    Node,
    parse_claim,
)
from dra_driver.scheduler.node_reach import node_selector
from dra_driver.scheduler.node_read import read_node
from dra_driver.scheduler.outcome import Analysis, Outcome, Pick, Reason
from dra_driver.scheduler.search import Search
from dra_driver.scheduler.versions import Scheduler

KIND_LABELS = {
    "pool": "pool unusable",
    "unknown-class": "unknown class",
    "class-selector": "class selector false",
    "request-selector": "request selector false",
    "cel-error": "CEL runtime error",
    "tainted": "tainted",
    "allocated": "allocated",
    "capacity": "capacity",
    "counters": "counters exhausted",
    "constraint": "constraint",
    "taken": "taken in this claim",
    "taken-in-pod": "taken by the pod's other claims",
    "no-completion": "no complete allocation",
    "feature-gate": "feature gate off",
}
STOPS = "the scheduler stops scheduling the pod with this error; it does not try other nodes"
SHOWN = 3
"""Devices named per group of rejections in text()."""


def explain(
    claim: Mapping[str, Any],
    classes: Sequence[Mapping[str, Any]],
    slices: Sequence[Mapping[str, Any]],
    allocated: Sequence[Mapping[str, Any]],
    *,
    cel: CelEnvironment,
    time_limit_s: float = 10.0,
    in_use: Iterable[tuple[str, str, str]] = (),
    clock: Callable[[], float] = time.monotonic,
    scheduler: Scheduler | None = None,
) -> Explanation:
    """Allocate ``claim`` against one node's ``slices`` as the scheduler would, given the
    ``allocated`` claims (and ``in_use`` devices); InputError for malformed input. ``clock``
    (seconds) bounds the search with ``time_limit_s``; tests pass a fake one. ``scheduler``
    is the version and feature gates modelled (default: the newest, ``Scheduler.of()``)."""
    read = read_node(classes, slices, allocated, in_use, scheduler)
    parsed = gates.as_read(parse_claim(claim, read.quantities), read.scheduler)
    search = Search(
        parsed, read.classes, read.node, read.allocated, cel, time_limit_s=time_limit_s, clock=clock
    )
    outcome = gates.run(search, read.scheduler)
    return Explanation(
        parsed, read.node, outcome, time_limit_s, read.classes, slices, read.scheduler
    )


def _ref(dev: Device) -> dict[str, str]:
    return {"driver": dev.driver, "pool": dev.pool, "device": dev.name}


def _reason_json(reason: Reason) -> dict[str, Any]:
    return {"kind": reason.kind, "text": reason.text, **reason.details}


def _names(devs: Sequence[str], shown: int = SHOWN) -> str:
    text = ", ".join(devs[:shown])
    return text + (f" and {len(devs) - shown} more" if len(devs) > shown else "")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


class Explanation:
    """The answer of ``explain``; see the module doc for the shapes."""

    def __init__(
        self,
        claim: Claim,
        node: Node | Callable[[], Node],
        outcome: Outcome,
        time_limit_s: float,
        classes: Mapping[str, Any],
        slices: Sequence[Mapping[str, Any]] = (),
        scheduler: Scheduler | None = None,
    ) -> None:
        self.claim = claim
        self._node = node
        self.outcome = outcome
        self.time_limit_s = time_limit_s
        self._classes = classes
        self._slices = slices
        self.scheduler = scheduler or Scheduler.of()  # the version and feature gates modelled
        self.ok = outcome.ok
        self.gave_up = outcome.gave_up
        # the allocator's error; a missing class is none: the scheduler's PreFilter answers it
        # unschedulable first (dynamicresources.go, validateDeviceClass)
        fatal = outcome.fatal
        self.error = None if fatal is None or fatal.kind == "unknown-class" else fatal

    @property
    def node(self) -> Node:
        """The node's pools and devices (made on first use when given as a function: a renamed
        answer needs them only for the full text or JSON)."""
        if not isinstance(self._node, Node):
            self._node = self._node()
        return self._node

    def renamed(
        self,
        node: Node | Callable[[], Node],
        outcome: Outcome,
        slices: Sequence[Mapping[str, Any]],
    ) -> Explanation:
        """The same answer about another node that looks the same to the claim
        (:mod:`dra_driver.scheduler.relabel` renames ``node`` and ``outcome``)."""
        return Explanation(
            self.claim, node, outcome, self.time_limit_s, self._classes, slices, self.scheduler
        )

    # -- allocation ----------------------------------------------------------------------------
    def allocation(self) -> dict[str, Any]:
        """The status.allocation object; ValueError when the claim does not fit."""
        if not self.ok:
            raise ValueError(f"claim {self.claim.ref} does not fit: {self.first_reason()}")
        results = []
        for pick in self.outcome.picks:
            r: dict[str, Any] = {"request": pick.request.full_name, **_ref(pick.device)}
            if pick.request.admin_access:
                r["adminAccess"] = True
            if pick.request.tolerations:
                r["tolerations"] = [
                    {
                        k: v
                        for k, v in (
                            ("key", t.key),
                            ("operator", t.operator),
                            ("value", t.value),
                            ("effect", t.effect),
                        )
                        if v
                    }
                    for t in pick.request.tolerations
                ]
            if pick.share_id is not None:
                r["shareID"] = pick.share_id
            if pick.consumed:
                r["consumedCapacity"] = {k: str(v) for k, v in sorted(pick.consumed.items())}
            results.append(r)
        devices: dict[str, Any] = {"results": results}
        config = allocation_config(self.claim, self.outcome.selected, self._classes)
        if config:
            devices["config"] = config
        out: dict[str, Any] = {"devices": devices}
        # createNodeSelector, for node-local slices and nodeSelector slices alike
        selector = node_selector(results, self._slices)
        if selector is not None:
            out["nodeSelector"] = selector
        return out

    # -- reasons -------------------------------------------------------------------------------
    def _failure_line(self, gi: int, ai: int) -> str:
        a = self.outcome.analyses[gi][ai]
        attempt = self.outcome.attempts.get((gi, ai))
        req = a.request
        if attempt is None:
            return f"request {req.full_name}: not tried (an earlier request did not fit)"
        if attempt.reason is not None:
            text = attempt.reason.text
            if attempt.reason.kind == "too-few":
                text += self._rejected_summary(a)
            return text
        placed = [p for p in attempt.placed if p.request is req]
        dynamic = [r for r in attempt.rejections.values() if r.kind != "no-completion"]
        need = req.count if req.mode is Mode.EXACT_COUNT else len(a.all_devices)
        some = (
            "none fits with the rest of the claim"
            if need == 1
            else f"no {need} of them fit together with the rest of the claim"
        )
        cands = _plural(len(a.candidates), "candidate")
        text = f"request {req.full_name} needs {need}, {cands}, but {some}"
        if dynamic:
            first_idx = next(i for i, r in attempt.rejections.items() if r.kind != "no-completion")
            text += f": {self.node.devices[first_idx].name}: {dynamic[0].text}"
        elif placed and len(placed) == need:
            text = f"request {req.full_name}: its devices fit, but then a later request does not"
        return text

    def _rejected_summary(self, a: Analysis) -> str:
        kinds = Counter(r.kind for r in a.rejections.values())
        if not kinds:
            return ""
        parts = ", ".join(f"{n} {KIND_LABELS.get(k, k)}" for k, n in kinds.most_common())
        return f" ({sum(kinds.values())} rejected: {parts})"

    def first_reason(self) -> str:
        """One line: the first reason the claim does not fit here ("fits" when it does), and
        how many slices the modelled scheduler does not read (``Node.ignored``)."""
        reason = self._first_reason()
        if self.ok or not self.node.ignored:
            return reason
        n = _plural(len(self.node.ignored), "slice")
        return f"{reason} ({n} not read by the Kubernetes {self.scheduler.version} scheduler)"

    def _first_reason(self) -> str:
        if self.ok:
            return "fits"
        o = self.outcome
        if o.fatal is not None:
            return o.fatal.text
        if o.gave_up:
            return (
                f"gave up after {self.time_limit_s:g} s ({o.steps} steps) without finding"
                " an allocation; none may exist"
            )
        if o.blocker is None:
            return "does not fit"
        return self._failure_line(*o.blocker)

    # -- text -----------------------------------------------------------------------------------
    def text(self) -> str:
        if self.ok:
            return self._text_ok()
        lines = [f"does not fit: {self.first_reason()}"]
        if self.error is not None:
            lines[0] = f"error: {self.error.text} ({STOPS})"
        for pool in self.node.pools:
            if pool.problem is not None:
                lines.append(f"  {pool.problem}")
        lines.extend(f"  {why}" for why in self.node.ignored)
        for gi, group in enumerate(self.claim.requests):
            for ai, a in enumerate(self.outcome.analyses[gi]):
                lines.extend(self._text_alternative(gi, ai, a, group.first_available))
        return "\n".join(lines)

    def _text_ok(self) -> str:
        if not self.outcome.picks:
            return "fits: the claim requests no devices"
        parts = []
        for gi, group in enumerate(self.claim.requests):
            picks = [p for p in self.outcome.picks if p.request.base_name == group.name]
            name = picks[0].request.full_name if picks else group.name
            pools = sorted({p.device.pool for p in picks})
            shares = [self._share(p) for p in picks if p.share_id is not None]
            extra = f"; {'; '.join(shares)}" if shares else ""
            ptext = f"pool{'s' if len(pools) > 1 else ''} {', '.join(pools)}"
            # another subrequest's device: 1.34/1.35's All continues as it (search._as_first)
            own = picks[0].request if picks else None
            as_ = ["" if p.request is own else f" (as {p.request.full_name})" for p in picks]
            devs = ", ".join(p.device.name + a for p, a in zip(picks, as_, strict=True))
            parts.append(f"{name} -> {devs} ({ptext}{extra})")
            del gi
        if len(parts) == 1:
            return f"fits: {parts[0]}"
        return "fits:\n" + "\n".join(f"  {p}" for p in parts)

    @staticmethod
    def _share(pick: Pick) -> str:
        consumed = ", ".join(f"{k} {v}" for k, v in sorted((pick.consumed or {}).items()))
        return (
            f"{pick.device.name} shared: {consumed}" if consumed else f"{pick.device.name} shared"
        )

    def _text_alternative(self, gi: int, ai: int, a: Analysis, sub: bool) -> list[str]:
        req = a.request
        mode = f"{req.count} x" if req.mode is Mode.EXACT_COUNT else "all"
        head = f"  {'subrequest' if sub else 'request'} {req.full_name} ({mode} {req.class_name}"
        head += ", admin access)" if req.admin_access else ")"
        attempt = self.outcome.attempts.get((gi, ai))
        if a.problem is not None and a.problem.kind == "unknown-class":
            return [f"{head}: {a.problem.text}"]
        lines = [
            f"{head}: {_plural(a.matched, 'device')} match, "
            f"{_plural(len(a.candidates), 'candidate')}"
        ]
        names = [self.node.devices[i].name for i in a.candidates]
        if names:
            lines.append(f"    candidates: {_names(names, 8)}")
        if attempt is not None and attempt.reason is None:
            placed = [p.device.name for p in attempt.placed if p.request is req]
            if placed:
                lines.append(f"    best attempt: {', '.join(placed)}; then")
            lines.extend(self._groups(attempt.rejections, "      "))
        elif (
            attempt is not None and attempt.reason is not None and attempt.reason.kind != "too-few"
        ):
            lines.append(f"    {attempt.reason.text}")
        lines.extend(self._groups(a.rejections, "    "))
        return lines

    def _groups(self, rejections: Mapping[int, Reason], indent: str) -> list[str]:
        groups: dict[tuple[str, str], list[tuple[int, Reason]]] = {}
        for idx, r in rejections.items():
            sig = str(r.details.get("expression", "")) if "selector" in r.kind else r.text
            if r.kind in ("allocated", "counters", "capacity", "constraint", "tainted"):
                sig = r.kind
            groups.setdefault((r.kind, sig), []).append((idx, r))
        lines = []
        for (kind, _), members in sorted(groups.items(), key=lambda g: -len(g[1])):
            names = [self.node.devices[i].name for i, _ in members]
            label = KIND_LABELS.get(kind, kind)
            first = members[0][1].text
            if len(members) == 1:
                lines.append(f"{indent}{names[0]}: {first}")
            else:
                lines.append(
                    f"{indent}{len(members)} {label}: {_names(names)}; {names[0]}: {first}"
                )
        return lines

    # -- JSON -----------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        o = self.outcome
        chosen: dict[int, list[Pick]] = {}
        for p in o.picks:
            chosen.setdefault(id(p.request), []).append(p)
        requests = []
        for gi, group in enumerate(self.claim.requests):
            alts = []
            for ai, a in enumerate(o.analyses[gi]):
                alts.append(self._alt_json(gi, ai, a, chosen.get(id(a.request), [])))
            selected = None
            if self.ok:
                selected = group.alternatives[o.selected.get(gi, 0)].full_name
            requests.append(
                {
                    "name": group.name,
                    "firstAvailable": group.first_available,
                    "selected": selected,
                    "alternatives": alts,
                }
            )
        return {
            "claim": self.claim.ref,
            "fits": self.ok,
            "gaveUp": self.gave_up,
            "reason": None if self.ok else self.first_reason(),
            "error": self.error.text if self.error is not None else None,
            "fatal": _reason_json(o.fatal) if o.fatal is not None else None,
            "allocation": self.allocation() if self.ok else None,
            "requests": requests,
            "pools": [
                {
                    "driver": p.driver,
                    "pool": p.name,
                    "generation": p.generation,
                    "slices": len(p.slices),
                    "resourceSliceCount": p.slice_count,
                    "devices": len(p.devices),
                    "problem": p.problem,
                }
                for p in self.node.pools
            ],
            "ignored": list(self.node.ignored),
            "scheduler": self.scheduler.to_json(),
            "steps": o.steps,
        }

    def _alt_json(self, gi: int, ai: int, a: Analysis, picks: list[Pick]) -> dict[str, Any]:
        req = a.request
        attempt = self.outcome.attempts.get((gi, ai))
        failure = None
        dynamic: Mapping[int, Reason] = {}
        if not self.ok and attempt is not None:
            failure = {
                "reason": self._failure_line(gi, ai),
                "placed": [
                    {"request": p.request.full_name, **_ref(p.device)} for p in attempt.placed
                ],
            }
            dynamic = attempt.rejections
        picked = {p.device.index for p in picks}
        devices: list[dict[str, Any]] = []
        for dev in self.node.devices:
            if dev.index in picked:
                devices.append({**_ref(dev), "status": "chosen", "reason": None})
                continue
            reason = a.rejections.get(dev.index) or dynamic.get(dev.index)
            status = "rejected" if dev.index in a.rejections else "candidate"
            devices.append(
                {
                    **_ref(dev),
                    "status": status,
                    "reason": _reason_json(reason) if reason is not None else None,
                }
            )
        chosen = []
        for p in picks:
            c: dict[str, Any] = _ref(p.device)
            if p.share_id is not None:
                c["shareID"] = p.share_id
            if p.consumed:
                c["consumedCapacity"] = {k: str(v) for k, v in sorted(p.consumed.items())}
            chosen.append(c)
        return {
            "request": req.full_name,
            "deviceClassName": req.class_name,
            "allocationMode": req.mode.value,
            "count": req.count if req.mode is Mode.EXACT_COUNT else None,
            "adminAccess": req.admin_access,
            "matched": a.matched,
            "candidates": len(a.candidates),
            "chosen": chosen,
            "failure": failure,
            "rejected": dict(Counter(r.kind for r in a.rejections.values())),
            "devices": devices,
        }
