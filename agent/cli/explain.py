"""``tessera explain``: would this claim fit, on which node, and if not, why not.

::

    tessera explain CLAIM.yaml --class CLASSES.yaml (--slices FILE|DIR | --simulate MODEL)
                    [--allocated FILE|DIR ...] [-o text|json] [--write]
    tessera explain CLAIM.yaml|NAMESPACE/NAME|pod/NAMESPACE/NAME --kubeconfig FILE [-o text|json]

The claims to explain come from CLAIM (``dra_driver.scheduler.inputs.subjects``); the devices from
ResourceSlice files, the slices ``tessera slices --simulate`` prints (the same code path,
``agent.cli.node_commands.published_slices``), or the API server; the allocator
(``dra_driver.scheduler.explanation``) answers per node, once per group of nodes that look the
same to the claims (``agent.cli.explain_answer``; cluster reads in ``agent.cli.explain_cluster``).
Exit 0: the claims fit (on at least one
node, and no node answers an allocator error), 1: they do not, 2: malformed input (file,
document, field path) or a failed read.
Files are read strictly, as the API server reads them: bytes within limits, then every field
through the one decoder (``agent.decode``); a field the resource.k8s.io/v1 types do not define
is refused (``dra_driver.scheduler.shapes``). ``--write`` (standalone) fills the claim file's
``status.allocation`` as the scheduler would (``agent.cli.explain_write``). docs/explain.md
describes flags, output and exit codes.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.cli.explain_answer import Inputs, NodeAnswer, answer, hold_allocated
from agent.cli.explain_cluster import RESOURCE, Cluster, Progress, gc_paused, generated_claims
from agent.cli.explain_version import feature_gates_arg, kube_version_arg, resolve
from agent.cli.explain_write import devices_text, write_back
from agent.cli.framework import EXIT_ERROR, Command, Invocation, Uses
from agent.cli.node_commands import published_slices
from agent.config import REQUIRED, Config, seconds, setting
from agent.errors import ConfigError
from dra_driver.scheduler import inputs, shapes
from dra_driver.scheduler.inputs import Document, DocumentError, Subject
from dra_driver.scheduler.lookalike import SliceIndex, reads_of
from dra_driver.scheduler.versions import Scheduler

if TYPE_CHECKING:
    from dra_driver.scheduler.celenv import CelEnvironment

EXIT_FITS, EXIT_NO_FIT = 0, 1
JSON_VERSION = 1
"""``version`` of the JSON answer; bumped when a field changes meaning or goes away."""
FILE_SUFFIXES = (".yaml", ".yml", ".json")
CLAIM_KEY = re.compile(r"([a-z0-9][-a-z0-9]*)/([a-z0-9][-a-z0-9.]*)")
POD_KEY = re.compile(r"pods?/([a-z0-9][-a-z0-9]*)/([a-z0-9][-a-z0-9.]*)")


@dataclass(frozen=True, kw_only=True)
class ExplainOptions:
    claim: str = setting(
        REQUIRED,
        "A YAML or JSON file (multi-document) with a ResourceClaim, a ResourceClaimTemplate, or a"
        " Pod (or Deployment, Job, ...) with the claims and templates it references; DeviceClasses"
        " in it are used too. With --kubeconfig also NAMESPACE/NAME of a ResourceClaim in the API,"
        " or pod/NAMESPACE/NAME of a Pod there (its claims, allocated together).",
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
        "Seconds the allocator may search for a pod's claims (allocated together) on one node"
        " before it gives up.",
        metavar="SECONDS",
        parse=seconds,
    )
    kube_version: str | None = setting(
        None,
        "The Kubernetes version whose scheduler explain models: 1.34 or 1.35 (they read counters"
        " and slices differently; docs/explain.md). Default: the newest; with --kubeconfig the"
        " API server's own (its /version). A newer version is modelled as the newest.",
        metavar="VERSION",
        parse=kube_version_arg,
    )
    feature_gates: str | None = setting(
        None,
        "The modelled scheduler's DRA feature gates, as kube-scheduler takes them:"
        " NAME=true|false,... of DRAAdminAccess, DRAConsumableCapacity, DRADeviceTaints,"
        " DRAPartitionableDevices, DRAPrioritizedList. Unset: the version's defaults, with the"
        " alpha gates docs/install.md asks for (DRAPartitionableDevices, DRAConsumableCapacity,"
        " DRADeviceTaints) on.",
        metavar="GATE=BOOL,...",
        parse=feature_gates_arg,
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


def standalone_inputs(
    opts: ExplainOptions, config: Config, scheduler: Scheduler, notes: list[str]
) -> Inputs:
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
    return Inputs(subjects, docs, classes, slices, nodes, allocated, notes, scheduler=scheduler)


def _no_subjects(source: str) -> DocumentError:
    return DocumentError(
        source, None, "", "nothing to explain: no ResourceClaim, ResourceClaimTemplate or Pod"
    )


# -- cluster mode ---------------------------------------------------------------------------------


def cluster_inputs(
    opts: ExplainOptions,
    cluster: Cluster,
    cel: CelEnvironment,
    progress: Progress,
    scheduler: Scheduler,
    notes: list[str],
) -> Inputs:
    """The claims (a file, or NAMESPACE/NAME in the API), then the classes (what the claims
    read decides how slices are indexed), then the slices page by page, the Nodes and the
    allocated claims."""
    path = Path(opts.claim)
    pod_key = POD_KEY.fullmatch(opts.claim)
    if not path.exists() and pod_key:
        pod = cluster.get("Pod", pod_key[1], pod_key[2])
        if pod is None:
            raise ConfigError(
                f"CLAIM {opts.claim}: no such file, and no Pod {pod_key[1]}/{pod_key[2]} in the"
                " API server"
            )
        docs = []
        subjects = inputs.subjects([Document("API", 0, generated_claims(pod))], cluster.get)
    elif path.exists() or not CLAIM_KEY.fullmatch(opts.claim):
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
    reads = reads_of([s.claim for s in subjects], list(classes.values()), cel)
    index = SliceIndex(reads)
    for obj in slices:
        index.add(obj)
    with gc_paused():
        for page in cluster.pages(f"{RESOURCE}/resourceslices"):
            for obj in page:
                index.add(obj)
            del page
            read = f"{len(index.records):,} ResourceSlices of {len(index.node_names()):,} nodes"
            progress.show(f"read {read}", force=True)
    nodes |= {str(n["metadata"]["name"]): n for n in cluster.list("/api/v1/nodes")}
    mine = {s.key for s in subjects if s.pod is None}  # a pod's allocated claims are held
    for c in cluster.list(f"{RESOURCE}/resourceclaims"):
        meta = c.get("metadata") or {}
        key = f"{meta.get('namespace', 'default')}/{meta.get('name')}"
        if not (c.get("status") or {}).get("allocation"):
            continue
        if key in mine:
            notes.append(f"{key} is allocated already; explained as if it were not")
            continue
        allocated.append(c)
    return Inputs(subjects, docs, classes, [], nodes, allocated, notes, index, scheduler=scheduler)


# -- the answer -----------------------------------------------------------------------------------


def first_error(answers: Sequence[NodeAnswer]) -> NodeAnswer | None:
    """The first node (by name) where the allocator answers an error. The scheduler filters
    nodes in parallel and an error on any of them ends the pod's scheduling attempt with it
    (kubernetes ``pkg/scheduler/schedule_one.go``, findNodesThatPassFilters), so the pod does
    not get scheduled even where it would fit."""
    return next((a for a in answers if a.error is not None), None)


def to_json(data: Inputs, answers: Sequence[NodeAnswer], written: str | None) -> dict[str, Any]:
    fitting = [a.node or "" for a in answers if a.fits]
    error = first_error(answers)
    return {
        "version": JSON_VERSION,
        "fits": bool(fitting) and error is None,
        "error": None if error is None else {"node": error.node, "text": error.error},
        "claims": [{"claim": s.key, "source": s.source, "via": s.via} for s in data.subjects],
        "fittingNodes": fitting,
        "nodes": [
            {
                "node": a.node,
                "fits": a.fits,
                "reason": a.reason,
                "blockedClaim": a.blocked,
                "error": a.error,
                "claims": [
                    {
                        "claim": c.subject.key,
                        "fits": c.allocation is not None,
                        "status": c.status,
                        "allocation": c.allocation,
                        "explanation": c.explanation.to_json(),
                    }
                    for c in a.claims
                ],
            }
            for a in answers
        ],
        "scheduler": data.scheduler.to_json(),
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
        verdict = "fits" if a.fits else "error" if a.error else "does not fit"
        lines.append(f"{claims} {what}{on}: {verdict}")
        if not a.claims and a.reason:
            lines.append(f"  {a.reason}")
        for c in a.claims:
            via = f" ({c.subject.via})" if c.subject.via else ""
            if len(a.claims) > 1 or via:
                lines.append(f"{c.subject.key}{via}:")
            lines.append(_indent(c.text().rstrip("\n")))
    else:
        fitting = [a for a in answers if a.fits]
        lines.append(f"{claims} {what}: fits on {len(fitting)} of {len(answers)} nodes")
        error = first_error(answers)
        if error is not None:
            lines.append(
                f"error on node {error.node}: the scheduler stops scheduling the pod at an"
                " error, wherever it fits"
            )
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
                word = "error" if a.error else "no   "
                lines.append(f"  {a.node or '':<{width}}  {word} {a.reason}")
    lines.append(f"modelled: {data.scheduler.describe()}")
    lines += [f"note: {n}" for n in data.notes]
    if written:
        lines.append(f"wrote status.allocation to {written}")
    return "\n".join(lines) + "\n"


# -- the command ----------------------------------------------------------------------------------


def cel_environment() -> CelEnvironment:
    """The one CEL environment of a run (its compiled selectors are shared)."""
    # imported here, not at the top: the CEL libraries cost 0.3 s to import (the Rust
    # binding's package loads its own CLI, prompt_toolkit and rich), which every other
    # tessera command would pay
    from dra_driver.scheduler.celenv import CelEnvironment

    # the CEL grammar's parser is kept in the user's cache directory: building it costs 0.3 s
    # a run (1 s loaded), of the 1.5 s goal on 64 nodes
    return CelEnvironment(parser_cache=user_cache_dir(os.environ))


def user_cache_dir(environ: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME/tessera``, else ``~/.cache/tessera`` (the XDG base directory rule); read
    here, in the command, as every setting from the environment is (nothing below the CLI reads
    it: tests/test_architecture.py)."""
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tessera"


def cmd_explain(inv: Invocation) -> int:
    opts = inv.get(ExplainOptions)
    config = inv.get(Config)
    cluster: Cluster | None = None
    progress = Progress(inv.err)
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
            scheduler, said = resolve(opts.kube_version, opts.feature_gates, cluster.version)
            cel = cel_environment()
            data = cluster_inputs(opts, cluster, cel, progress, scheduler, said)
        else:
            scheduler, said = resolve(opts.kube_version, opts.feature_gates)
            data = standalone_inputs(opts, config, scheduler, said)
            cel = cel_environment()
        if not data.subjects:
            raise _no_subjects(opts.claim)
        data = hold_allocated(data)
        answers = answer(data, opts.time_limit, cel, progress)
        written = None
        fitting = [] if first_error(answers) else [a for a in answers if a.fits]
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
        progress.done()
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
    " least one node, and no node answers an error), 1: it does not, 2: malformed input."
    " --write fills the claim file's status.allocation. docs/explain.md has the details.",
)

__all__ = ["COMMAND", "ExplainOptions", "cmd_explain"]
