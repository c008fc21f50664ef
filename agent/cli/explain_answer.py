"""``tessera explain``: the answer per node, one evaluation per group of look-alike nodes.

The nodes are grouped by what their claims can see of them
(:mod:`dra_driver.scheduler.lookalike`); the first node of a group is evaluated on its own
slices, and the others get that answer renamed to their own devices
(:mod:`dra_driver.scheduler.relabel`). A node that stands alone is evaluated as before grouping.

On one node, each pod's claims are allocated together, as the scheduler's Filter hands them to
``Allocate`` (:mod:`dra_driver.scheduler.joint`); the pods of a file (and the claims no pod
references, as one more) one after another, each seeing the devices the earlier ones took.
``_evaluate`` answers one node, ``_renamed`` carries an answer to a look-alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dra_driver.scheduler import node_reach
from dra_driver.scheduler.inputs import Document, DocumentError, Subject
from dra_driver.scheduler.lookalike import NodeLabel, SliceIndex, plan, reads_of
from dra_driver.scheduler.versions import Scheduler

if TYPE_CHECKING:
    from agent.cli.explain_cluster import Progress
    from dra_driver.scheduler.celenv import CelEnvironment
    from dra_driver.scheduler.joint import PodExplanation


@dataclass
class Inputs:
    """Everything one explanation reads, wherever it came from. ``index`` holds the slices
    read in cluster mode (streamed); standalone mode gives ``slices`` and the index is built
    from them."""

    subjects: list[Subject]
    claim_docs: list[Document]
    classes: dict[str, dict[str, Any]] = field(default_factory=dict)
    slices: list[dict[str, Any]] = field(default_factory=list)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    allocated: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    index: SliceIndex | None = None
    held: list[Subject] = field(default_factory=list)
    """A pod's claims that are allocated already (``hold_allocated``): not allocated again."""
    scheduler: Scheduler = field(default_factory=Scheduler.of)
    """The scheduler version and feature gates modelled (``--kube-version``)."""


@dataclass
class ClaimAnswer:
    subject: Subject
    explanation: Any
    allocation: dict[str, Any] | None
    pod: PodExplanation | None = None
    """The answer of the claims it was allocated with; ``index``: its place there."""
    index: int = 0

    def text(self) -> str:
        return self.explanation.text() if self.pod is None else self.pod.text(self.index)

    @property
    def status(self) -> str:
        """``allocated``, ``blocked``, ``placed`` or ``not-tried`` (``PodExplanation.status``)."""
        if self.pod is None:
            return "allocated" if self.allocation is not None else "blocked"
        return self.pod.status(self.index)


@dataclass
class NodeAnswer:
    node: str | None
    """None: slices that name no node (allNodes, nodeSelector without Nodes)."""
    claims: list[ClaimAnswer]
    reason: str | None = None

    @property
    def fits(self) -> bool:
        return self.reason is None

    @property
    def blocked(self) -> str | None:
        """The first claim that could not be placed (None: it fits, or no claim was tried)."""
        return next((c.subject.key for c in self.claims if c.status == "blocked"), None)

    @property
    def error(self) -> str | None:
        """``reason`` when it is the allocator's error for a claim here, not a "does not fit":
        the scheduler then stops scheduling the pod with it, it does not try other nodes
        (``dra_driver.scheduler.outcome.Fatal``)."""
        if any(c.explanation.error is not None for c in self.claims):
            return self.reason
        return None


def _input_error(s: Subject, exc: ValueError) -> DocumentError:
    path = str(getattr(exc, "path", ""))
    message = str(getattr(exc, "message", exc))
    if s.doc is None and s.source != "API" and path.startswith("spec."):
        path = "spec." + path  # a template: the claim spec is the template's spec.spec
    source, _, index = s.source.rpartition(": document ")
    if not source:
        return DocumentError(f"claim {s.key} (from the API server)", None, path, message)
    return DocumentError(source, int(index), s.doc.field(path) if s.doc else path, message)


def _reason(subjects: Sequence[Subject], pods: Sequence[PodExplanation]) -> str | None:
    """The first pod's reason (naming its claim when there are several claims)."""
    for pod in pods:
        if not pod.ok:
            first = pod.first_reason()
            if len(subjects) > 1 and len(pod.claims) == 1:
                return f"{pod.claims[0].claim.ref}: {first}"
            return first
    return None


def _allocation(claim: dict[str, Any]) -> Any:
    status = claim.get("status")
    return status.get("allocation") if isinstance(status, dict) else None


def hold_allocated(data: Inputs) -> Inputs:
    """A pod's claims that are allocated already, held: dynamicresources.go PreFilter hands
    ``Allocate`` only the claims without ``status.allocation`` (``claimStore.toAllocate``); an
    allocated one's devices are taken (``ListAllAllocatedDevices``) and its allocation's
    ``nodeSelector`` must match the node (Filter, ``availableOnNodes``). A claim named on its
    own (no pod) is explained as if it were not allocated."""
    held = [s for s in data.subjects if s.pod is not None and _allocation(s.claim) is not None]
    if not held:
        return data
    known = {_key(c) for c in data.allocated}
    notes = [
        f"{s.key} ({s.via}) is allocated already: the scheduler does not allocate it again;"
        " its devices are taken and its nodeSelector must match the node"
        for s in held
    ]
    return dataclasses.replace(
        data,
        allocated=[*data.allocated, *(s.claim for s in held if s.key not in known)],
        notes=[*data.notes, *notes],
        held=held,
    )


def _key(claim: dict[str, Any]) -> str:
    """``namespace/name`` of a claim object, as ``Subject.key`` names it."""
    meta = claim.get("metadata")
    meta = meta if isinstance(meta, dict) else {}
    return f"{meta.get('namespace') or 'default'}/{meta.get('name')}"


def _pinned(data: Inputs, name: str | None) -> str | None:
    """Why a held claim keeps the pod off node ``name`` (its nodeSelector does not match)."""
    if name is None:
        return None
    node = data.nodes.get(name, {"metadata": {"name": name}})
    for s in data.held:
        selector = _allocation(s.claim).get("nodeSelector")
        if isinstance(selector, dict) and not node_reach.selector_matches(selector, node):
            return (
                f"{s.key} is allocated already, for other nodes: its nodeSelector does not"
                " match this node"
            )
    return None


def _units(data: Inputs) -> list[list[Subject]]:
    """The claims allocated together: each pod's, in the pod's order, then those of no pod;
    held claims are not allocated again."""
    units: dict[str | None, list[Subject]] = {}
    for s in data.subjects:
        if all(s is not h for h in data.held):
            units.setdefault(s.pod, []).append(s)
    return [units[k] for k in sorted(units, key=lambda k: k is None)]


def _answers(unit: Sequence[Subject], pod: PodExplanation) -> list[ClaimAnswer]:
    return [
        ClaimAnswer(s, exp, exp.allocation() if pod.ok else None, pod, i)
        for i, (s, exp) in enumerate(zip(unit, pod.claims, strict=True))
    ]


def _evaluate(
    name: str | None,
    slices: list[dict[str, Any]],
    data: Inputs,
    cel: CelEnvironment,
    time_limit: float,
) -> NodeAnswer:
    from dra_driver.scheduler.domain import InputError
    from dra_driver.scheduler.joint import ClaimInputError, explain_pod

    if not slices:
        return NodeAnswer(name, [], "no ResourceSlice applies to this node")
    classes = list(data.classes.values())
    allocated = list(data.allocated)
    claims: list[ClaimAnswer] = []
    pods = []
    for unit in _units(data):
        try:
            pod = explain_pod(
                [s.claim for s in unit],
                classes,
                slices,
                allocated,
                cel=cel,
                time_limit_s=time_limit,
                scheduler=data.scheduler,
            )
        except ClaimInputError as exc:  # a malformed claim
            raise _input_error(unit[exc.index], exc) from exc
        except InputError as exc:  # a malformed class (any other error is ours: a traceback)
            raise _input_error(unit[0], exc) from exc
        pods.append(pod)
        for c in _answers(unit, pod):
            claims.append(c)
            if c.allocation is not None:
                allocated.append({**c.subject.claim, "status": {"allocation": c.allocation}})
    return NodeAnswer(name, claims, _reason(data.subjects, pods))


def _renamed(first: NodeAnswer, label: NodeLabel, subjects: Sequence[Subject]) -> NodeAnswer | None:
    """``first``'s answer for the look-alike node ``label`` names; None when it cannot be
    carried over (a pool with a problem: its text names the pool)."""
    from dra_driver.scheduler.relabel import renamed, renaming

    if not first.claims:
        return None
    r = renaming(first.claims[0].explanation.node, label)
    if r is None:
        return None
    claims: list[ClaimAnswer] = []
    pods: list[PodExplanation] = []
    for c in first.claims:
        if c.pod is None or c.index != 0:
            continue
        pod = c.pod.renamed(
            [renamed(e, r) for e in c.pod.claims],
            None if c.pod.alone is None else renamed(c.pod.alone, r),
        )
        pods.append(pod)
        unit = [a.subject for a in first.claims[len(claims) : len(claims) + len(pod.claims)]]
        claims += _answers(unit, pod)
    return NodeAnswer(label.node, claims, _reason(subjects, pods))


def answer(
    data: Inputs, time_limit: float, cel: CelEnvironment, progress: Progress | None = None
) -> list[NodeAnswer]:
    """Each node's answer, in node order; ``cel`` compiles and evaluates every selector."""
    index = data.index
    if index is None:
        classes = list(data.classes.values())
        index = SliceIndex(reads_of([s.claim for s in data.subjects], classes, cel))
        for obj in data.slices:
            index.add(obj)
    names = sorted(set(data.nodes) | set(index.node_names()))
    if not names:
        return [_evaluate(None, index.slices(), data, cel, time_limit)]
    answers: dict[str, NodeAnswer] = {}
    for group in plan(index, names, data.nodes, data.allocated):
        first_name = group.members[0]
        node_obj = data.nodes.get(first_name, {"metadata": {"name": first_name}})
        slices = node_reach.node_slices(index.slices(index.for_node(first_name)), node_obj)
        first = _evaluate(first_name, slices, data, cel, time_limit)
        answers[first_name] = first
        del slices
        for name in group.members[1:]:
            label = group.labels.get(name)
            found = _renamed(first, label, data.subjects) if label is not None else None
            if found is None:
                node_obj = data.nodes.get(name, {"metadata": {"name": name}})
                slices = node_reach.node_slices(index.slices(index.for_node(name)), node_obj)
                found = _evaluate(name, slices, data, cel, time_limit)
            answers[name] = found
            if progress is not None:
                progress.show(f"evaluated {len(answers):,} of {len(names):,} nodes")
        if progress is not None:
            progress.show(f"evaluated {len(answers):,} of {len(names):,} nodes")
    if progress is not None:
        progress.done()
    for n in names:
        pinned = _pinned(data, n)
        if pinned is not None:
            answers[n] = NodeAnswer(n, [], pinned)
    return [answers[n] for n in names]


__all__ = ["ClaimAnswer", "Inputs", "NodeAnswer", "answer", "hold_allocated"]
