"""Candidates per request, as the scheduler's structured allocator finds them
(k8s.io/dynamic-resource-allocation ``structured/internal/incubating/allocator_incubating.go``:
validateDeviceRequest, isSelectable, selectorsMatch, taintPreventsAllocation).

What is computed once per call, so that a node of 200 devices costs a few milliseconds:

- each device's CEL view, when a selector first needs it, and each selector's verdict on each
  device (a class's selectors are shared by every request of that class);
- per request (and subrequest): the candidates, in first-fit order (pools by driver and name,
  slices by name, devices as listed), and for every other device the *first* reason it is not
  one: class selector false, request selector false, CEL runtime error, tainted, allocated to
  another claim, capacity too small, counters already used up, lacks a constrained attribute.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dra_driver.scheduler.capacity import Usage
from dra_driver.scheduler.cel.selector import DeviceView, Selector
from dra_driver.scheduler.celenv import CelCompileError, CelEnvironment
from dra_driver.scheduler.domain import (
    MAX_RESULTS,
    Allocated,
    Claim,
    Device,
    DeviceClass,
    InputError,
    Mode,
    Node,
    Request,
    SelectorSpec,
)
from dra_driver.scheduler.outcome import Analysis, Reason


def _seen(seen: Sequence[tuple[str, str]]) -> str:
    return ", ".join(f"{p}={v}" for p, v in seen)


class Candidates:
    """Analyses the requests of one claim against one node's devices (``analyse``)."""

    def __init__(
        self,
        claim: Claim,
        classes: Mapping[str, DeviceClass],
        node: Node,
        allocated: Allocated,
        cel: CelEnvironment,
        usage: Usage,
    ) -> None:
        self.claim = claim
        self.classes = classes
        self.node = node
        self.allocated = allocated
        self.cel = cel
        self.usage = usage
        self._views: dict[int, DeviceView] = {}
        self._class_verdicts: dict[tuple[str, int], Reason | None] = {}
        self._compiled: dict[str, Selector] = {}

    # -- CEL ---------------------------------------------------------------------------------
    def compile(self, spec: SelectorSpec) -> Selector:
        sel = self._compiled.get(spec.expression)
        if sel is None:
            try:
                sel = self.cel.compile(spec.expression)
            except CelCompileError as e:
                raise InputError(f"{spec.path}.cel.expression", str(e)) from None
            self._compiled[spec.expression] = sel
        return sel

    def _view(self, dev: Device) -> DeviceView:
        view = self._views.get(dev.index)
        if view is None:
            view = self.cel.device(
                dev.driver, dev.raw_attributes, dev.raw_capacity, dev.allow_multiple
            )
            self._views[dev.index] = view
        return view

    def _selectors(
        self,
        selectors: Sequence[tuple[SelectorSpec, Selector]],
        dev: Device,
        kind: str,
        owner: str,
    ) -> Reason | None:
        """selectorsMatch: every selector in order; the first false or error decides."""
        for i, (spec, sel) in enumerate(selectors):
            verdict = sel.evaluate(self._view(dev))
            details = {"selector": i, "expression": spec.expression, "seen": dict(verdict.seen)}
            if kind == "class-selector":
                details["class"] = owner.removeprefix("class ")
            if verdict.error is not None:
                return Reason(
                    "cel-error",
                    f"{owner} selector #{i}: CEL runtime error: {verdict.error}"
                    " (the scheduler stops allocating on this node at such an error)",
                    {**details, "error": verdict.error, "source": kind},
                )
            if not verdict.matched:
                seen = f" (saw {_seen(verdict.seen)})" if verdict.seen else ""
                return Reason(
                    kind, f"{owner} selector #{i} is false: {spec.expression}{seen}", details
                )
        return None

    # -- analysis --------------------------------------------------------------------------------
    def analyse(self, req: Request, selected_by: Request | None = None) -> Analysis:
        """``req`` against every device. ``selected_by``: select its devices with that
        request's class and selectors instead of its own (upstream's cached isSelectable
        verdicts of another subrequest: see ``search.Search._analyse``)."""
        cls = self.classes.get(req.class_name)
        a = Analysis(req, cls)
        if cls is None:
            known = ", ".join(sorted(self.classes)) or "none given"
            a.problem = Reason(
                "unknown-class",
                f"request {req.full_name}: DeviceClass {req.class_name!r} not found"
                f" (known: {known})",
                {"class": req.class_name},
            )
            return a
        chooser = req
        sel_cls = cls
        if selected_by is not None and selected_by.class_name in self.classes:
            chooser = selected_by
            sel_cls = self.classes[selected_by.class_name]
            a.selected_as = selected_by.full_name
        class_sels = [(s, self.compile(s)) for s in sel_cls.selectors]
        req_sels = [(s, self.compile(s)) for s in chooser.selectors]
        constraints = [(c, i) for i, c in enumerate(self.claim.constraints) if c.applies_to(req)]
        a.constraint_values = [(c, i, {}) for c, i in constraints]
        all_mode = req.mode is Mode.ALL
        for dev in self.node.devices:
            pool = self.node.pools[dev.pool_index]
            if pool.problem is not None:
                # allocateOne skips incomplete and invalid pools
                a.rejections[dev.index] = Reason("pool", pool.problem, {"pool": pool.ref})
                continue
            held = self.allocated.owners.get(dev.key)
            # For ExactCount upstream checks "in use" before the selectors, so a CEL error on
            # an allocated device never stops it; the explanation still evaluates them, so
            # that a device that would not match anyway is not reported as merely allocated.
            fatal = held is None or req.admin_access or all_mode
            if self._selected(sel_cls, class_sels, req_sels, dev, a, fatal, chooser) is not None:
                continue
            a.matched += 1
            reason, consumed = self.usage.check_capacity(req, dev, in_claim=False)
            if reason is not None:
                a.rejections[dev.index] = reason
                continue
            if all_mode:
                # validateDeviceRequest: selected and the capacity fits (CmpRequestOverCapacity)
                a.all_devices.append(dev.index)
            reason = self._static(req, dev, held)
            if reason is None:
                for c, _, values in a.constraint_values:
                    v = dev.attribute(c.attribute)
                    if v is None:
                        reason = Reason(
                            "constraint",
                            f"{c}: the device has no attribute {c.attribute}",
                            {"constraint": c.kind, "attribute": c.attribute, "value": None},
                        )
                        break
                    values[dev.index] = v
            if reason is not None:
                # under All the search meets it in order (allocateDevice(must=true))
                a.rejections[dev.index] = reason
                continue
            if dev.allow_multiple:
                a.consumed[dev.index] = consumed
            a.candidates.append(dev.index)
        if all_mode:
            for pool in self.node.pools:
                if pool.problem is not None and a.problem is None:
                    # validateDeviceRequest: "all" cannot be known while a pool is unusable,
                    # an error of the claim (the search turns it into one)
                    being = "being updated" if pool.incomplete else "invalid"
                    upstream = (
                        f"claim {self.claim.ref}, request {req.name}: asks for all devices,"
                        f" but resource pool {pool.ref} is currently {being}"
                    )
                    a.problem = Reason(
                        "pool",
                        f"{upstream} ({pool.problem})",
                        {"pool": pool.ref, "upstream": upstream},
                    )
            if a.problem is None and not a.all_devices:
                how = ""
                if a.selected_as is not None:
                    how = (
                        f" (Kubernetes 1.34 and 1.35 select them with subrequest"
                        f" {a.selected_as}'s class and selectors)"
                    )
                a.problem = Reason(
                    "no-candidates",
                    f"request {req.full_name} asks for all matching devices, and none matches{how}",
                )
            if a.problem is None and len(a.all_devices) > MAX_RESULTS:
                a.problem = Reason(
                    "too-many",
                    f"request {req.full_name} asks for all {len(a.all_devices)} matching"
                    f" devices, more than the {MAX_RESULTS} one claim may hold",
                )
        return a

    def _selected(
        self,
        cls: DeviceClass,
        class_sels: Sequence[tuple[SelectorSpec, Selector]],
        req_sels: Sequence[tuple[SelectorSpec, Selector]],
        dev: Device,
        a: Analysis,
        fatal: bool,
        chooser: Request,
    ) -> Reason | None:
        """isSelectable: the class's selectors, then the request's (``chooser``'s: the
        request's own unless ``analyse`` was given another); the first that is false or fails
        decides (and is recorded as the device's rejection)."""
        key = (cls.name, dev.index)
        if key in self._class_verdicts:
            reason = self._class_verdicts[key]
        else:
            reason = self._selectors(class_sels, dev, "class-selector", f"class {cls.name}")
            self._class_verdicts[key] = reason
        if reason is None:
            reason = self._selectors(
                req_sels, dev, "request-selector", f"request {chooser.full_name}"
            )
        if reason is not None:
            a.rejections[dev.index] = reason
            if reason.kind == "cel-error" and fatal and a.cel_error is None:
                a.cel_error = Reason(
                    "cel-error",
                    f"request {a.request.full_name}, device {dev.name}: {reason.text}",
                    {**reason.details, "device": dev.name},
                )
        return reason

    def _static(self, req: Request, dev: Device, held: str | None) -> Reason | None:
        if dev.unallocatable is not None:  # allocateDevice, without DRAPartitionableDevices
            return Reason("feature-gate", dev.unallocatable, {"gate": "DRAPartitionableDevices"})
        for taint in dev.taints:
            if taint.blocks() and not any(t.tolerates(taint) for t in req.tolerations):
                return Reason(
                    "tainted",
                    f"tainted {taint}, not tolerated",
                    {
                        "taint": str(taint),
                        "key": taint.key,
                        "value": taint.value,
                        "effect": taint.effect,
                    },
                )
        if held is not None and not req.admin_access:
            return Reason("allocated", f"allocated to {held}", {"owner": held})
        return self.usage.check_counters(dev, in_claim=False, picks=())
