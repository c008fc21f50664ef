"""``tessera explain``: would this claim fit, on which node, and if not, why not.

::

    tessera explain CLAIM.yaml --class CLASSES.yaml (--slices FILE|DIR | --simulate MODEL)
                    [--allocated FILE|DIR ...] [-o text|json] [--write]
    tessera explain CLAIM.yaml|NAMESPACE/NAME --kubeconfig FILE [-o text|json]

The claims to explain come from CLAIM (``dra_driver.scheduler.inputs.subjects``); the devices from
ResourceSlice files, the slices ``tessera slices --simulate`` prints (the same code path,
``agent.cli.node_commands.published_slices``), or the API server; the allocator
(``dra_driver.scheduler.explanation``) answers per node. Exit 0: the claims fit (on at least one
node), 1: they do not, 2: malformed input (file, document, field path) or a failed read.
Files are read strictly, as the API server reads them: bytes within limits, then every field
through the one decoder (``agent.decode``); a field the resource.k8s.io/v1 types do not define
is refused (``dra_driver.scheduler.shapes``). ``--write`` (standalone) fills the claim file's
``status.allocation`` as the scheduler would (``agent.cli.explain_write``). docs/explain.md
describes flags, output and exit codes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.cli.explain_write import devices_text, write_back
from agent.cli.framework import EXIT_ERROR, Command, Invocation, Uses
from agent.cli.node_commands import published_slices
from agent.config import REQUIRED, Config, seconds, setting
from agent.errors import ConfigError
from dra_driver.scheduler import inputs, shapes
from dra_driver.scheduler.inputs import Document, DocumentError, Subject

EXIT_FITS, EXIT_NO_FIT = 0, 1
JSON_VERSION = 1
"""``version`` of the JSON answer; bumped when a field changes meaning or goes away."""
FILE_SUFFIXES = (".yaml", ".yml", ".json")
RESOURCE = "/apis/resource.k8s.io/v1"
CLAIM_KEY = re.compile(r"([a-z0-9][-a-z0-9]*)/([a-z0-9][-a-z0-9.]*)")


@dataclass(frozen=True, kw_only=True)
class ExplainOptions:
    claim: str = setting(
        REQUIRED,
        "A YAML or JSON file (multi-document) with a ResourceClaim, a ResourceClaimTemplate, or a"
        " Pod (or Deployment, Job, ...) with the claims and templates it references; DeviceClasses"
        " in it are used too. With --kubeconfig also NAMESPACE/NAME of a ResourceClaim in the API.",
        flags=("CLAIM",),
        positional=True,
    )
    classes: tuple[Path, ...] = setting(
        (),
        "A file of DeviceClasses (e.g. deploy/daemonset/deviceclasses.yaml). Repeat for several."
        " With --kubeconfig the API server's classes are read; these replace those of the same"
        " name.",
        flags=("--class",),
        metavar="FILE",
    )
    slices: tuple[Path, ...] = setting(
        (),
        "ResourceSlices to allocate from: a file (multi-document YAML, JSON, List objects) or a"
        " directory of *.yaml, *.yml and *.json files (e.g. a standalone agent's"
        " <state-dir>/resourceslices). Slices of several nodes are answered per node; Node"
        " objects in them give labels to nodeSelector slices. Repeat for several.",
        metavar="FILE|DIR",
    )
    allocated: tuple[Path, ...] = setting(
        (),
        "ResourceClaims already allocated (with status.allocation): their devices, counters and"
        " capacity are taken. A file or a directory, like --slices. Repeat for several.",
        metavar="FILE|DIR",
    )
    kubeconfig: Path | None = setting(
        None,
        "Cluster mode: read the claim, every DeviceClass, every ResourceSlice, the Nodes and the"
        " allocated ResourceClaims from this API server, and answer for every node.",
        metavar="FILE",
    )
    time_limit: float = setting(
        10.0,
        "Seconds the allocator may search for one claim on one node before it gives up.",
        metavar="SECONDS",
        parse=seconds,
    )
    output: str = setting(
        "text",
        "text (for people) or json (for tools; docs/explain.md describes it).",
        flags=("-o", "--output"),
        choices=("text", "json"),
    )
    write: bool = setting(
        False,
        "Standalone mode: when the claims fit, write status.allocation (and a metadata.uid, if"
        " missing) into CLAIM's ResourceClaim documents, as the scheduler would, so that"
        " `tessera run --no-kube` can prepare them; the file's other documents are kept.",
    )


# -- reading files --------------------------------------------------------------------------------


def read_documents(path: Path) -> list[Document]:
    """The documents of one file; an unreadable file is an OSError the framework words. A field
    the API server would refuse as unknown is a DocumentError naming it (``shapes``)."""
    docs = inputs.parse_documents(path.read_text(encoding="utf-8"), str(path))
    shapes.check_known_fields(docs)
    return docs


def files_of(path: Path, option: str) -> list[Path]:
    """``path`` itself, or a directory's *.yaml, *.yml and *.json files (sorted)."""
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.suffix in FILE_SUFFIXES and p.is_file())
        if not found:
            raise ConfigError(f"{option} {path}: a directory without *.yaml, *.yml or *.json files")
        return found
    return [path]


@dataclass
class Inputs:
    """Everything one explanation reads, wherever it came from."""

    subjects: list[Subject]
    claim_docs: list[Document]
    classes: dict[str, dict[str, Any]] = field(default_factory=dict)
    slices: list[dict[str, Any]] = field(default_factory=list)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    allocated: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _add_classes(found: dict[str, dict[str, Any]], docs: Iterable[Document]) -> int:
    n = 0
    for d in inputs.of_kind(docs, "DeviceClass"):
        found[d.name] = d.obj
        n += 1
    return n


def load_files(
    opts: ExplainOptions,
) -> tuple[
    dict[str, dict[str, Any]], list[dict[str, Any]], dict[str, dict[str, Any]], list[dict[str, Any]]
]:
    """Classes, slices, nodes and allocated claims of the --class, --slices and --allocated
    files (DeviceClasses are taken from any of them)."""
    classes: dict[str, dict[str, Any]] = {}
    slices: list[dict[str, Any]] = []
    nodes: dict[str, dict[str, Any]] = {}
    allocated: list[dict[str, Any]] = []
    for path in opts.classes:
        docs = read_documents(path)
        if _add_classes(classes, docs) == 0:
            raise DocumentError(str(path), None, "", "holds no DeviceClass (kind: DeviceClass)")
        inputs.only_kinds(docs, ("DeviceClass",), "a --class file")
    for given in opts.slices:
        for path in files_of(given, "--slices"):
            docs = read_documents(path)
            inputs.only_kinds(docs, ("ResourceSlice", "DeviceClass", "Node"), "a --slices file")
            _add_classes(classes, docs)
            slices += [d.obj for d in inputs.of_kind(docs, "ResourceSlice")]
            nodes |= {d.name: d.obj for d in docs if d.kind == "Node"}
    for given in opts.allocated:
        for path in files_of(given, "--allocated"):
            docs = read_documents(path)
            inputs.only_kinds(docs, ("ResourceClaim", "DeviceClass"), "an --allocated file")
            _add_classes(classes, docs)
            allocated += inputs.allocated_claims(docs)
    return classes, slices, nodes, allocated


def standalone_inputs(opts: ExplainOptions, config: Config) -> Inputs:
    if opts.slices and config.simulator.simulate:
        raise ConfigError("--slices and --simulate go against each other: give one of them")
    if not opts.slices and not config.simulator.simulate:
        raise ConfigError(
            "no devices to allocate from: give --slices FILE|DIR (ResourceSlices), --simulate"
            " MODEL (a simulated node, see `tessera sim models`) or --kubeconfig FILE"
        )
    path = Path(opts.claim)
    docs = read_documents(path)
    subjects = inputs.subjects(docs)
    classes, slices, nodes, allocated = load_files(opts)
    _add_classes(classes, docs)  # the claim file's own classes win
    if config.simulator.simulate:
        slices = published_slices(config)
    if not classes:
        raise ConfigError(
            f"no DeviceClass given: pass --class FILE (Tessera's: --class"
            f" deploy/daemonset/deviceclasses.yaml), or put the DeviceClasses in {path}"
        )
    return Inputs(subjects, docs, classes, slices, nodes, allocated)


def _no_subjects(source: str) -> DocumentError:
    return DocumentError(
        source, None, "", "nothing to explain: no ResourceClaim, ResourceClaimTemplate or Pod"
    )


# -- cluster mode ---------------------------------------------------------------------------------


class Cluster:
    """The reads of cluster mode, through dra_driver.cluster.kube.KubeClient."""

    def __init__(self, kubeconfig: Path) -> None:
        from dra_driver.cluster.kube import KubeClient

        self.kube = KubeClient.from_config(kubeconfig)

    def close(self) -> None:
        self.kube.close()

    def list(self, path: str) -> list[dict[str, Any]]:
        """Every item of a collection, page by page (limit/continue, as kubectl reads)."""
        items: list[dict[str, Any]] = []
        query: dict[str, str] = {"limit": "500"}
        while True:
            page = self.kube.request("GET", path, query=query)
            items += [i for i in page.get("items") or [] if isinstance(i, dict)]
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items
            query = {"limit": "500", "continue": str(token)}

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        from dra_driver.errors import KubeError

        plural = {
            "ResourceClaim": "resourceclaims",
            "ResourceClaimTemplate": "resourceclaimtemplates",
        }
        try:
            obj = self.kube.request(
                "GET", f"{RESOURCE}/namespaces/{namespace}/{plural[kind]}/{name}"
            )
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise
        obj.setdefault("apiVersion", "resource.k8s.io/v1")
        obj.setdefault("kind", kind)
        return obj


def cluster_inputs(opts: ExplainOptions, cluster: Cluster) -> Inputs:
    path = Path(opts.claim)
    if path.exists() or not CLAIM_KEY.fullmatch(opts.claim):
        docs = read_documents(path)
        subjects = inputs.subjects(docs, cluster.get)
    else:
        namespace, name = opts.claim.split("/", 1)
        obj = cluster.get("ResourceClaim", namespace, name)
        if obj is None:
            raise ConfigError(
                f"CLAIM {opts.claim}: no such file, and no ResourceClaim {namespace}/{name} in the"
                " API server"
            )
        docs = []
        subjects = [Subject(opts.claim, obj, None, None, "API")]
    classes = {str(c["metadata"]["name"]): c for c in cluster.list(f"{RESOURCE}/deviceclasses")}
    files_classes, slices, nodes, allocated = load_files(opts)
    classes |= files_classes
    _add_classes(classes, docs)
    slices += cluster.list(f"{RESOURCE}/resourceslices")
    nodes |= {str(n["metadata"]["name"]): n for n in cluster.list("/api/v1/nodes")}
    mine = {s.key for s in subjects}
    notes = []
    for c in cluster.list(f"{RESOURCE}/resourceclaims"):
        meta = c.get("metadata") or {}
        key = f"{meta.get('namespace', 'default')}/{meta.get('name')}"
        if not (c.get("status") or {}).get("allocation"):
            continue
        if key in mine:
            notes.append(f"{key} is allocated already; explained as if it were not")
            continue
        allocated.append(c)
    return Inputs(subjects, docs, classes, slices, nodes, allocated, notes)


# -- the answer -----------------------------------------------------------------------------------


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
    slices: list[dict[str, Any]]
    reason: str | None = None

    @property
    def fits(self) -> bool:
        return self.reason is None


def _node_list(data: Inputs) -> list[tuple[str | None, dict[str, Any]]]:
    names = sorted(set(data.nodes) | set(inputs.slice_nodes(data.slices)))
    if not names:
        return [(None, {"metadata": {}})]
    return [(n, data.nodes.get(n, {"metadata": {"name": n}})) for n in names]


def answer(data: Inputs, opts: ExplainOptions) -> list[NodeAnswer]:
    """Each node's answer: the claims allocated in order, each seeing the devices the earlier
    ones took (a pod's claims all go to one node)."""
    # imported here, not at the top: the CEL libraries cost 0.3 s to import (the Rust
    # binding's package loads its own CLI, prompt_toolkit and rich), which every other
    # tessera command would pay
    from dra_driver.scheduler.celenv import CelEnvironment
    from dra_driver.scheduler.explanation import explain

    cel = CelEnvironment()
    classes = list(data.classes.values())
    answers = []
    for name, node in _node_list(data):
        slices = data.slices if name is None else inputs.node_slices(data.slices, node)
        if not slices:
            answers.append(NodeAnswer(name, [], [], "no ResourceSlice applies to this node"))
            continue
        allocated = list(data.allocated)
        claims = []
        reason = None
        for s in data.subjects:
            try:
                exp = explain(
                    s.claim, classes, slices, allocated, cel=cel, time_limit_s=opts.time_limit
                )
            except ValueError as exc:  # the allocator's InputError: malformed claim or class
                raise _input_error(s, exc) from exc
            allocation = None
            if exp.ok:
                allocation = exp.allocation()
                allocated.append({**s.claim, "status": {"allocation": allocation}})
            elif reason is None:
                first = exp.first_reason()
                reason = first if len(data.subjects) == 1 else f"{s.key}: {first}"
            claims.append(ClaimAnswer(s, exp, allocation))
        answers.append(NodeAnswer(name, claims, slices, reason))
    return answers


def _input_error(s: Subject, exc: ValueError) -> DocumentError:
    path = str(getattr(exc, "path", ""))
    message = str(getattr(exc, "message", exc))
    if s.doc is None and s.source != "API" and path.startswith("spec."):
        path = "spec." + path  # a template: the claim spec is the template's spec.spec
    source, _, index = s.source.rpartition(": document ")
    if not source:
        return DocumentError(f"claim {s.key} (from the API server)", None, path, message)
    return DocumentError(source, int(index), s.doc.field(path) if s.doc else path, message)


def to_json(data: Inputs, answers: Sequence[NodeAnswer], written: str | None) -> dict[str, Any]:
    fitting = [a.node or "" for a in answers if a.fits]
    return {
        "version": JSON_VERSION,
        "fits": bool(fitting),
        "claims": [{"claim": s.key, "source": s.source, "via": s.via} for s in data.subjects],
        "fittingNodes": fitting,
        "nodes": [
            {
                "node": a.node,
                "fits": a.fits,
                "reason": a.reason,
                "claims": [
                    {
                        "claim": c.subject.key,
                        "fits": c.allocation is not None,
                        "allocation": c.allocation,
                        "explanation": c.explanation.to_json(),
                    }
                    for c in a.claims
                ],
            }
            for a in answers
        ],
        "notes": data.notes,
        "written": written,
    }


def _indent(text: str, by: str = "  ") -> str:
    return "".join(by + line if line.strip() else line for line in text.splitlines(True))


def render_text(data: Inputs, answers: Sequence[NodeAnswer], written: str | None) -> str:
    what = ", ".join(s.key for s in data.subjects)
    claims = "claim" if len(data.subjects) == 1 else "claims"
    lines = []
    if len(answers) == 1:
        a = answers[0]
        on = "" if a.node is None else f" on node {a.node}"
        lines.append(f"{claims} {what}{on}: {'fits' if a.fits else 'does not fit'}")
        if not a.claims:
            lines.append(f"  {a.reason}")
        for c in a.claims:
            via = f" ({c.subject.via})" if c.subject.via else ""
            if len(a.claims) > 1 or via:
                lines.append(f"{c.subject.key}{via}:")
            lines.append(_indent(c.explanation.text().rstrip("\n")))
    else:
        fitting = [a for a in answers if a.fits]
        lines.append(f"{claims} {what}: fits on {len(fitting)} of {len(answers)} nodes")
        width = max(len(a.node or "") for a in answers)
        for a in answers:
            if a.fits:
                detail = "; ".join(
                    (f"{c.subject.key}: " if len(a.claims) > 1 else "")
                    + devices_text(c.allocation or {})
                    for c in a.claims
                )
                lines.append(f"  {a.node or '':<{width}}  fits  {detail}")
            else:
                lines.append(f"  {a.node or '':<{width}}  no    {a.reason}")
    lines += [f"note: {n}" for n in data.notes]
    if written:
        lines.append(f"wrote status.allocation to {written}")
    return "\n".join(lines) + "\n"


# -- the command ----------------------------------------------------------------------------------


def cmd_explain(inv: Invocation) -> int:
    opts = inv.get(ExplainOptions)
    config = inv.get(Config)
    cluster: Cluster | None = None
    try:
        if opts.kubeconfig is not None:
            if opts.write:
                raise ConfigError(
                    "--write is for standalone mode: in a cluster the scheduler writes"
                    " status.allocation (drop --kubeconfig or --write)"
                )
            if config.simulator.simulate:
                raise ConfigError("--simulate and --kubeconfig go against each other: give one")
            cluster = Cluster(opts.kubeconfig)
            data = cluster_inputs(opts, cluster)
        else:
            data = standalone_inputs(opts, config)
        if not data.subjects:
            raise _no_subjects(opts.claim)
        answers = answer(data, opts)
        written = None
        fitting = [a for a in answers if a.fits]
        if opts.write and fitting:
            chosen = fitting[0]
            done = write_back(Path(opts.claim), [(c.subject, c.allocation) for c in chosen.claims])
            written = opts.claim
            if len(answers) > 1:
                data.notes.append(f"written for node {chosen.node}, the first that fits")
            data.notes += [f"wrote {d}" for d in done]
    except DocumentError as exc:
        inv.err.write(f"tessera: error: {exc}\n")
        return EXIT_ERROR
    finally:
        if cluster is not None:
            cluster.close()
    if opts.output == "json":
        inv.out.write(json.dumps(to_json(data, answers, written), indent=2) + "\n")
    else:
        inv.out.write(render_text(data, answers, written))
    return EXIT_FITS if fitting else EXIT_NO_FIT


COMMAND = Command(
    "explain",
    "would a ResourceClaim fit, on which node, and why not (the scheduler's allocator)",
    cmd_explain,
    (Uses(ExplainOptions), Uses(Config, ("node", "driver"))),
    description="Allocate a ResourceClaim (a ResourceClaimTemplate, or a Pod's claims) the way"
    " the scheduler's structured allocator does, against ResourceSlice files, a simulated node"
    " (--simulate: the slices `tessera slices` prints) or a cluster (--kubeconfig: every node),"
    " and say which devices it gets or why each candidate was rejected. Exit 0: it fits (on at"
    " least one node), 1: it does not, 2: malformed input. --write fills the claim file's"
    " status.allocation. docs/explain.md has the details.",
)

__all__ = ["COMMAND", "ExplainOptions", "cmd_explain"]
