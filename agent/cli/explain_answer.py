"""``tessera explain``: the answer per node, one evaluation per group of look-alike nodes.

The nodes are grouped by what their claims can see of them
(:mod:`dra_driver.scheduler.lookalike`); the first node of a group is evaluated on its own
slices, each claim in order seeing the devices the earlier ones took (a pod's claims all go to
one node), and the others get that answer renamed to their own devices
(:mod:`dra_driver.scheduler.relabel`). A node that stands alone is evaluated as before grouping.
A seam for more than one allocation per node (issue 26): ``_evaluate`` answers one node,
``_renamed`` carries an answer to a look-alike; both work per claim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dra_driver.scheduler import inputs
from dra_driver.scheduler.inputs import Document, DocumentError, Subject
from dra_driver.scheduler.lookalike import NodeLabel, SliceIndex, plan, reads_of
from dra_driver.scheduler.versions import Scheduler

if TYPE_CHECKING:
    from agent.cli.explain_cluster import Progress
    from dra_driver.scheduler.celenv import CelEnvironment


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
    scheduler: Scheduler = field(default_factory=Scheduler.of)
    """The scheduler version and feature gates modelled (``--kube-version``)."""


@dataclass
class ClaimAnswer:
    subject: Subject
    explanation: Any
    allocation: dict[str, Any] | None


@dataclass
class NodeAnswer:
    node: str | None
    """None: slices that name no node (allNodes, nodeSelector without Nodes)."""
    claims: list[ClaimAnswer]
    reason: str | None = None

    @property
    def fits(self) -> bool:
        return self.reason is None


def _input_error(s: Subject, exc: ValueError) -> DocumentError:
    path = str(getattr(exc, "path", ""))
    message = str(getattr(exc, "message", exc))
    if s.doc is None and s.source != "API" and path.startswith("spec."):
        path = "spec." + path  # a template: the claim spec is the template's spec.spec
    source, _, index = s.source.rpartition(": document ")
    if not source:
        return DocumentError(f"claim {s.key} (from the API server)", None, path, message)
    return DocumentError(source, int(index), s.doc.field(path) if s.doc else path, message)


def _reason(subjects: Sequence[Subject], claims: Sequence[ClaimAnswer]) -> str | None:
    for c in claims:
        if c.allocation is None:
            first = c.explanation.first_reason()
            return first if len(subjects) == 1 else f"{c.subject.key}: {first}"
    return None


def _evaluate(
    name: str | None,
    slices: list[dict[str, Any]],
    data: Inputs,
    cel: CelEnvironment,
    time_limit: float,
) -> NodeAnswer:
    from dra_driver.scheduler.explanation import explain

    if not slices:
        return NodeAnswer(name, [], "no ResourceSlice applies to this node")
    classes = list(data.classes.values())
    allocated = list(data.allocated)
    claims = []
    for s in data.subjects:
        try:
            exp = explain(
                s.claim,
                classes,
                slices,
                allocated,
                cel=cel,
                time_limit_s=time_limit,
                scheduler=data.scheduler,
            )
        except ValueError as exc:  # the allocator's InputError: malformed claim or class
            raise _input_error(s, exc) from exc
        allocation = None
        if exp.ok:
            allocation = exp.allocation()
            allocated.append({**s.claim, "status": {"allocation": allocation}})
        claims.append(ClaimAnswer(s, exp, allocation))
    return NodeAnswer(name, claims, _reason(data.subjects, claims))


def _renamed(first: NodeAnswer, label: NodeLabel, subjects: Sequence[Subject]) -> NodeAnswer | None:
    """``first``'s answer for the look-alike node ``label`` names; None when it cannot be
    carried over (a pool with a problem: its text names the pool)."""
    from dra_driver.scheduler.relabel import renamed, renaming

    if not first.claims:
        return None
    r = renaming(first.claims[0].explanation.node, label)
    if r is None:
        return None
    claims = []
    for c in first.claims:
        exp = renamed(c.explanation, r)
        claims.append(ClaimAnswer(c.subject, exp, exp.allocation() if exp.ok else None))
    return NodeAnswer(label.node, claims, _reason(subjects, claims))


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
        slices = inputs.node_slices(index.slices(index.for_node(first_name)), node_obj)
        first = _evaluate(first_name, slices, data, cel, time_limit)
        answers[first_name] = first
        del slices
        for name in group.members[1:]:
            label = group.labels.get(name)
            found = _renamed(first, label, data.subjects) if label is not None else None
            if found is None:
                node_obj = data.nodes.get(name, {"metadata": {"name": name}})
                slices = inputs.node_slices(index.slices(index.for_node(name)), node_obj)
                found = _evaluate(name, slices, data, cel, time_limit)
            answers[name] = found
            if progress is not None:
                progress.show(f"evaluated {len(answers):,} of {len(names):,} nodes")
        if progress is not None:
            progress.show(f"evaluated {len(answers):,} of {len(names):,} nodes")
    if progress is not None:
        progress.done()
    return [answers[n] for n in names]


__all__ = ["ClaimAnswer", "Inputs", "NodeAnswer", "answer"]
