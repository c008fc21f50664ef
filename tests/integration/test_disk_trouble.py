"""Disk trouble (docs/reliability.md "Disk trouble"): a full disk, a read-only one, the state
directory deleted while the agent runs. Real daemons, real files, real tmpfs mounts (the test
skips, saying why, where it may not mount one).

What every case holds the agent to: each claim gets its own answer (a failing one names the file
and the file system's error), nothing is half-written (the checkpoint decodes, no temporary file
is left, a CDI spec exists exactly for the claims the checkpoint lists as prepared, no device is
held by two claims, no claim the kubelet was told is prepared is lost), the agent stays up and its
probes say what is wrong, and once the disk is back the kubelet's retries succeed.

Layout: the state directory is a small tmpfs (the agent's disk); the simulated node's own state
(``<state>/sim``) is a tmpfs of its own mounted inside it, since on a real node the GPUs are not on
the agent's disk. The CDI root is where ``--simulate`` puts it (``<state>/cdi``, the same disk)
unless a test gives it its own tmpfs (as ``/var/run/cdi`` on a real node).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dra_driver.errors import CheckpointError
from dra_driver.kubeletplugin.checkpoint import PREPARE_COMPLETED, decode
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.integration.daemon import DRIVER, Daemon, claim_manifest, write_claims
from tests.reliability.report import add

PAGE = os.sysconf("SC_PAGE_SIZE")
"""tmpfs allocates whole pages: a file of 1 byte takes one."""
MODEL = "dgx-h100"
SUITE = "disk-trouble"
RERUN = "pytest tests/integration/test_disk_trouble.py (as root; make reliability for the storm)"
NO_SPACE = os.strerror(28)  # ENOSPC: "No space left on device"
READ_ONLY = os.strerror(30)  # EROFS: "Read-only file system"


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)


@dataclass
class Disk:
    """A tmpfs mounted at ``path`` for one test: filled, freed, made read-only and back."""

    path: Path
    filler: Path = field(init=False)

    def __post_init__(self) -> None:
        self.filler = self.path / "filler"

    def fill(self, leave_pages: int = 0) -> None:
        """Take every free page but ``leave_pages`` (tmpfs counts whole pages). Filled again
        when a page came or went meanwhile (the agent saves its energy state now and then)."""
        for _ in range(5):
            fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                while True:
                    os.write(fd, b"\0" * PAGE)
            except OSError as exc:
                assert exc.errno == 28, exc
            finally:
                os.close(fd)
            size = self.filler.stat().st_size
            assert size >= leave_pages * PAGE, "the disk was nearly full already"
            os.truncate(self.filler, size - leave_pages * PAGE)
            if os.statvfs(self.path).f_bfree == leave_pages:
                return
        raise AssertionError(f"{self.path}: cannot leave exactly {leave_pages} pages free")

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    @contextmanager
    def read_only(self) -> Iterator[None]:
        """The disk read-only for the agent while inside: a read-only bind mount of it over
        itself. (``mount -o remount,ro`` of the tmpfs itself is refused while the agent holds its
        lock file open for writing; a kernel that remounts a failing disk read-only does not ask.)
        The mounts inside it (the simulated node) stay writable."""
        mounted = _run("mount", "--rbind", str(self.path), str(self.path))
        assert mounted.returncode == 0, mounted.stderr
        try:
            ro = _run("mount", "-o", "remount,bind,ro", str(self.path))
            assert ro.returncode == 0, ro.stderr
            yield
        finally:
            _run("umount", "-l", str(self.path))


class Mounts:
    """The tmpfs mounts of one test, all unmounted at its end (the daemon is gone by then)."""

    def __init__(self) -> None:
        self.paths: list[Path] = []

    def tmpfs(self, path: Path, size: str) -> Disk:
        path.mkdir(parents=True, exist_ok=True)
        if shutil.which("mount") is None:
            pytest.skip("disk trouble needs mount(8) to make a small tmpfs; there is none here")
        done = _run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0750", "tmpfs", str(path))
        if done.returncode != 0:
            why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[0]
            pytest.skip(
                f"disk trouble needs a small tmpfs, and mounting one was refused ({why};"
                f" uid {os.geteuid()}): run as root, or with CAP_SYS_ADMIN"
            )
        self.paths.append(path)
        return Disk(path)

    def unmount_all(self) -> None:
        for path in reversed(self.paths):
            _run("umount", "-l", str(path))
        self.paths.clear()


@pytest.fixture
def mounts() -> Iterator[Mounts]:
    m = Mounts()
    try:
        yield m
    finally:
        m.unmount_all()


@dataclass
class Node:
    daemon: Daemon
    state: Disk
    cdi: Path
    cdi_disk: Disk | None = None
    told_prepared: set[str] = field(default_factory=set)
    """The claims the kubelet was last told are prepared (a prepare answered without error, not
    unprepared since)."""

    @property
    def checkpoint_file(self) -> Path:
        return self.daemon.state / "checkpoint.json"

    def spec(self, uid: str) -> Path:
        return self.cdi / f"k8s.{DRIVER}-claim_{uid}.json"


def make_node(short_tmp: Path, mounts: Mounts, separate_cdi: bool = False) -> Node:
    state = mounts.tmpfs(short_tmp / "state", "1m")
    mounts.tmpfs(state.path / "sim", "64m")  # the simulated GPUs: not on the agent's disk
    extra: list[str] = []
    cdi, cdi_disk = state.path / "cdi", None
    if separate_cdi:
        cdi_disk = mounts.tmpfs(short_tmp / "cdi", "1m")
        cdi = cdi_disk.path
        extra = ["--cdi-root", str(cdi)]
    d = Daemon(state.path, MODEL, *extra)
    write_all_claims(state.path)
    return Node(d, state, cdi, cdi_disk)


def started_with_own_cdi_disk(short_tmp: Path, mounts: Mounts) -> tuple[Node, Disk]:
    """A node whose CDI root is a tmpfs of its own (as ``/var/run/cdi`` is), its daemon started."""
    node = make_node(short_tmp, mounts, separate_cdi=True)
    assert node.cdi_disk is not None
    node.daemon.start()
    return node, node.cdi_disk


def write_all_claims(state: Path) -> None:
    """The claim files (written before the disk fills): ``c<i>`` and ``o<i>`` for ``gpu-<i>``."""
    for i in range(8):
        for name, uid in ((f"c{i}", f"uid-{i}"), (f"o{i}", f"uid-o{i}")):
            write_claims(state, claim_manifest(name, uid, [("gpu", f"gpu-{i}")], MODEL))


def ref(i: int) -> ClaimRef:
    """Claim ``c<i>``, for ``gpu-<i>``."""
    return ClaimRef("default", f"c{i}", f"uid-{i}")


def other(i: int) -> ClaimRef:
    """Another claim for ``gpu-<i>``: ``o<i>``."""
    return ClaimRef("default", f"o{i}", f"uid-o{i}")


def call(node: Node, op: str, refs: Sequence[ClaimRef]) -> dict[str, dict[str, Any]]:
    """One kubelet call: every claim's answer (``error``, ``devices``), by UID. What the kubelet
    is told is remembered, so that a claim told prepared and then missing counts as lost."""
    with KubeletClient(node.daemon.dra_socket) as k:
        answer = (k.prepare if op == "prepare" else k.unprepare)(list(refs))
    claims: dict[str, dict[str, Any]] = answer["claims"]
    assert set(claims) == {r.uid for r in refs}, "every claim of the call is answered"
    for uid, a in claims.items():
        if not a["error"]:
            (node.told_prepared.add if op == "prepare" else node.told_prepared.discard)(uid)
    return claims


def errors(node: Node, op: str, *refs: ClaimRef) -> dict[str, str]:
    return {uid: str(a["error"]) for uid, a in call(node, op, refs).items()}


def ok(node: Node, op: str, *refs: ClaimRef) -> None:
    assert errors(node, op, *refs) == {r.uid: "" for r in refs}


def cannot_write(node: Node, claim: ClaimRef, error: str, why: str) -> bool:
    """Whether ``error`` says which of the claim's files could not be written, and why: its CDI
    spec (the first write of a claim that changes nothing else on the node) or the checkpoint."""
    files = (f"CDI spec {node.spec(claim.uid)}", f"checkpoint {node.checkpoint_file}")
    return any(f"cannot write {f}: {why}" in error for f in files)


def temp_files(*directories: Path) -> list[str]:
    """Temporary files of ``atomic_write`` (``.<name>.<random>.tmp``) in ``directories``."""
    return sorted(str(p) for d in directories if d.is_dir() for p in d.glob(".*.tmp"))


def problems(node: Node) -> list[str]:
    """Everything half-written, held twice or lost (empty when the files are consistent)."""
    found: list[str] = []
    try:
        cp, _ = decode(node.checkpoint_file.read_bytes(), str(node.checkpoint_file))
    except (OSError, CheckpointError) as exc:
        return [f"checkpoint unreadable: {exc}"]
    state = node.daemon.state
    left = temp_files(state, state / "resourceslices", node.cdi)
    found += [f"temporary file left: {p}" for p in left]
    completed = {u for u, e in cp.claims.items() if e.state == PREPARE_COMPLETED}
    specs = {
        p.name.split("-claim_", 1)[1].removesuffix(".json") for p in node.cdi.glob("*-claim_*")
    }
    found += [
        f"CDI spec of {u}, which the checkpoint does not list as prepared"
        for u in sorted(specs - completed)
    ]
    found += [f"claim {u} prepared without its CDI spec" for u in sorted(completed - specs)]
    found += [
        f"claim {u} told prepared, not in the checkpoint"
        for u in sorted(node.told_prepared - completed)
    ]
    holders: dict[str, list[str]] = {}
    for uid, entry in cp.claims.items():
        for dev in entry.devices:
            holders.setdefault(dev.device, []).append(uid)
    found += [f"{dev} held by {uids}" for dev, uids in sorted(holders.items()) if len(uids) > 1]
    for spec in node.cdi.glob("*-claim_*.json"):
        try:
            json.loads(spec.read_text())
        except ValueError as exc:
            found.append(f"CDI spec {spec.name} half-written: {exc}")
    return found


def prepared(node: Node) -> set[str]:
    cp, _ = decode(node.checkpoint_file.read_bytes())
    return {u for u, e in cp.claims.items() if e.state == PREPARE_COMPLETED}


def probe(node: Node, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(node.daemon.metrics_url(path), timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode()


def ready_check(node: Node) -> tuple[int, str]:
    """/readyz's status and its ``disk`` check."""
    code, body = probe(node, "/readyz")
    return code, json.loads(body)["checks"]["disk"]


def disk_errors(node: Node, operation: str, reason: str) -> float:
    counts = node.daemon.scrape().get("tessera_prepare_errors_total", {})
    return sum(
        v
        for labels, v in counts.items()
        if ("operation", operation) in labels and ("reason", reason) in labels
    )


def record(cases: int, faults: int, node: Node, crashes: int = 0, **details: Any) -> list[str]:
    """Add to the suite's figures (lost: what ``problems`` finds now) and return the problems."""
    found = problems(node)
    add(
        SUITE,
        cases=cases,
        faults=faults,
        crashes=crashes,
        lost=len(found),
        details=details,
        rerun=RERUN,
    )
    return found


def test_a_full_disk_fails_each_new_claim_clearly_keeps_the_held_ones_and_recovers(
    short_tmp: Path, mounts: Mounts
) -> None:
    node = make_node(short_tmp, mounts)
    d = node.daemon
    d.start()
    try:
        a, b, c, e = ref(0), ref(1), ref(2), ref(3)
        ok(node, "prepare", a, b)
        before = call(node, "prepare", [a])[a.uid]["devices"]
        node.state.fill()
        code, disk = ready_check(node)
        assert code == 503 and f"{d.state}: {NO_SPACE}" in disk
        assert probe(node, "/healthz") == (200, "ok\n")  # a restart would not free the disk

        answers = call(node, "prepare", [a, c, e])
        assert answers[a.uid] == {"devices": before, "error": ""}  # held ones are answered
        for r in (c, e):
            assert cannot_write(node, r, answers[r.uid]["error"], NO_SPACE)
        (error,) = errors(node, "unprepare", b).values()
        assert "claim default/c1 (uid-1): its release cannot be recorded" in error
        assert NO_SPACE in error and "stays prepared" in error
        (error,) = errors(node, "prepare", other(1)).values()  # b still holds its GPU
        assert "gpu-1 is already prepared for claim" in error and "uid-1" in error
        assert prepared(node) == {a.uid, b.uid} and problems(node) == []
        assert disk_errors(node, "prepare", "disk_full") == 2
        assert disk_errors(node, "unprepare", "disk_full") == 1
        assert d.proc is not None and d.proc.poll() is None

        node.state.free()  # the operator frees the disk; the kubelet retries
        assert ready_check(node) == (200, "writable")
        ok(node, "prepare", c, e)
        ok(node, "unprepare", b)
        ok(node, "prepare", other(1))
        assert prepared(node) == {a.uid, c.uid, e.uid, other(1).uid}
        found = record(1, 1, node)
        assert found == []
        ok(node, "unprepare", a, c, e, other(1))
        assert prepared(node) == set() and list(node.cdi.glob("*-claim_*")) == []
    finally:
        d.kill()


def test_the_disk_running_out_between_a_spec_and_its_completion_leaves_no_spec(
    short_tmp: Path, mounts: Mounts
) -> None:
    """With one page left: the claim's CDI spec takes the last page (a whole GPU's start needs no
    write of its own), and the checkpoint cannot record it completed. The prepare is rolled
    back: no spec of a claim the checkpoint does not list as prepared."""
    node = make_node(short_tmp, mounts)
    d = node.daemon
    d.start()
    try:
        a, c = ref(0), ref(2)
        ok(node, "prepare", a)
        assert node.checkpoint_file.stat().st_size < PAGE  # one page: rewritten in one page
        node.state.fill(leave_pages=1)
        (error,) = errors(node, "prepare", c).values()
        assert f"cannot write checkpoint {node.checkpoint_file}: {NO_SPACE}" in error
        assert not node.spec(c.uid).exists()
        assert problems(node) == [] and prepared(node) == {a.uid}

        # and with a few pages for a call of seven claims: some get in, the rest fail cleanly
        node.state.free()
        node.state.fill(leave_pages=3)
        rest = [ref(i) for i in range(1, 8)]
        answers = errors(node, "prepare", *rest)
        failed = [r for r in rest if answers[r.uid]]
        assert failed, "seven specs cannot fit in three pages"
        assert all(NO_SPACE in answers[r.uid] for r in failed), answers
        assert problems(node) == []
        node.state.free()
        ok(node, "prepare", *failed)
        assert prepared(node) == {f"uid-{i}" for i in range(8)}
        found = record(2, 2, node)
        assert found == []
    finally:
        d.kill()


def test_a_full_or_read_only_cdi_root_fails_the_claim_naming_its_spec(
    short_tmp: Path, mounts: Mounts
) -> None:
    node, cdi = started_with_own_cdi_disk(short_tmp, mounts)
    d = node.daemon
    try:
        a, b, c, e = ref(0), ref(1), ref(2), ref(3)
        ok(node, "prepare", a, b)
        cdi.fill()
        code, disk = ready_check(node)
        assert code == 503 and f"{node.cdi}: {NO_SPACE}" in disk
        (error,) = errors(node, "prepare", c).values()
        assert error == f"cannot write CDI spec {node.spec(c.uid)}: {NO_SPACE}"
        assert c.uid not in prepared(node)  # its start was recorded, and rolled back
        ok(node, "unprepare", a)  # removing a spec needs no space
        assert problems(node) == []
        cdi.free()
        ok(node, "prepare", c)

        with cdi.read_only():
            code, disk = ready_check(node)
            assert code == 503 and f"{node.cdi}: {READ_ONLY}" in disk
            (error,) = errors(node, "prepare", e).values()
            assert error == f"cannot write CDI spec {node.spec(e.uid)}: {READ_ONLY}"
            # the release is recorded first: the spec it could not remove is left for the retry
            (error,) = errors(node, "unprepare", b).values()
            assert error == f"cannot remove CDI spec {node.spec(b.uid)}: {READ_ONLY}"
            assert b.uid not in prepared(node) and node.spec(b.uid).exists()
        ok(node, "unprepare", b)  # the kubelet's retry
        ok(node, "prepare", e)
        assert prepared(node) == {c.uid, e.uid}
        assert disk_errors(node, "prepare", "disk_full") == 1
        assert disk_errors(node, "prepare", "disk_read_only") == 1
        found = record(2, 2, node)
        assert found == []
    finally:
        d.kill()


def test_a_base_spec_gone_is_written_again_and_one_that_cannot_be_fails_the_whole_call(
    short_tmp: Path, mounts: Mounts
) -> None:
    """Every claim's spec names the driver's base spec: a call's prepare makes sure of it once,
    before the claims' specs. Removed (an admin cleaning /var/run/cdi), it is written again; when
    it cannot be, each claim of the call fails naming it and is rolled back."""
    node, cdi = started_with_own_cdi_disk(short_tmp, mounts)
    d = node.daemon
    try:
        base = node.cdi / f"k8s.{DRIVER}-driver.json"
        ok(node, "prepare", ref(0))
        written = base.read_bytes()
        base.unlink()
        ok(node, "prepare", ref(1), ref(2))
        assert base.read_bytes() == written
        base.unlink()
        with cdi.read_only():
            found = errors(node, "prepare", ref(3), ref(4))
        assert found == {
            r.uid: f"cannot write CDI spec {base}: {READ_ONLY}" for r in (ref(3), ref(4))
        }
        assert prepared(node) == {ref(0).uid, ref(1).uid, ref(2).uid}
        assert not node.spec(ref(3).uid).exists() and not node.spec(ref(4).uid).exists()
        ok(node, "prepare", ref(3), ref(4))  # the kubelet's retry
        assert base.read_bytes() == written
        assert problems(node) == []
    finally:
        d.kill()


def test_a_read_only_state_disk_fails_each_claim_and_recovers_when_writable(
    short_tmp: Path, mounts: Mounts
) -> None:
    node = make_node(short_tmp, mounts)
    d = node.daemon
    d.start()
    try:
        a, b, c = ref(0), ref(1), ref(2)
        ok(node, "prepare", a, b)
        with node.state.read_only():
            code, disk = ready_check(node)
            assert code == 503 and f"{d.state}: {READ_ONLY}" in disk
            assert probe(node, "/healthz") == (200, "ok\n")
            answers = errors(node, "prepare", a, c)
            assert answers[a.uid] == ""
            assert cannot_write(node, c, answers[c.uid], READ_ONLY)
            (error,) = errors(node, "unprepare", b).values()
            assert READ_ONLY in error and "stays prepared" in error
            assert prepared(node) == {a.uid, b.uid} and problems(node) == []
        assert ready_check(node) == (200, "writable")
        ok(node, "unprepare", b)
        ok(node, "prepare", c)
        assert prepared(node) == {a.uid, c.uid}
        assert disk_errors(node, "prepare", "disk_read_only") == 1
        found = record(1, 1, node)
        assert found == []
    finally:
        d.kill()


def test_a_start_on_a_full_disk_comes_up_degraded_and_recovers_when_there_is_room(
    short_tmp: Path, mounts: Mounts
) -> None:
    """A restart on a full disk (issue 23, item 8): it used to exit at every start (each start
    rewrote the base CDI spec and the checkpoint), a crash loop. A start writes neither when they
    hold what it would write, so it comes up: /readyz says the disk is full and a log line says
    what is degraded; the claim prepared before is still answered; once there is room a new
    claim is prepared."""
    node = make_node(short_tmp, mounts)
    d = node.daemon
    d.start()
    try:
        a, b = ref(0), ref(1)
        ok(node, "prepare", a)
        d.kill()
        base = node.cdi / f"k8s.{DRIVER}-driver.json"
        before = {p: p.stat().st_ino for p in (base, node.checkpoint_file)}
        node.state.fill()
        d.start()  # waits for the sockets: it comes up
        assert {p: p.stat().st_ino for p in before} == before  # neither file was rewritten
        code, disk = ready_check(node)
        assert code == 503 and NO_SPACE in disk and str(d.state) in disk
        (line,) = [r for r in d.logs if r.get("msg") == "started on a disk that cannot be written"]
        assert NO_SPACE in line["problem"]
        ok(node, "prepare", a)  # the kubelet asks again: prepared already
        assert cannot_write(node, b, errors(node, "prepare", b)[b.uid], NO_SPACE)
        node.state.free()
        assert ready_check(node) == (200, "writable")
        ok(node, "prepare", b)
        assert prepared(node) == {a.uid, b.uid}
        found = record(1, 1, node)
        assert found == []
    finally:
        d.kill()


def test_a_state_dir_deleted_while_running_is_not_written_behind_the_lock(short_tmp: Path) -> None:
    """No tmpfs: the CDI root is outside the state directory, as on a real node. The agent
    refuses to write a state directory that is no longer the one it locked (another agent
    could lock the new one); /healthz fails so that the kubelet restarts it, and the start
    rebuilds the prepared claims from their CDI specs and claim files."""
    d = Daemon(short_tmp / "state", MODEL, "--cdi-root", str(short_tmp / "cdi"))
    node = Node(d, Disk(d.state), short_tmp / "cdi")
    write_all_claims(d.state)
    d.start()
    try:
        a, b, c = ref(0), ref(1), ref(2)
        ok(node, "prepare", a, b)
        # the agent's state goes; what stands for the node and the cluster (the simulated GPUs,
        # the kubelet's directory, the claims) is not in the state directory of a real node
        for entry in d.state.iterdir():
            if entry.name not in ("sim", "kubelet", "resourceclaims"):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        code, body = probe(node, "/healthz")
        assert code == 503 and f"state-dir: {d.state} was deleted or replaced" in body
        answers = errors(node, "prepare", a, c)
        assert answers[a.uid] == ""
        assert "the state directory was deleted or replaced while the agent runs" in answers[c.uid]
        (error,) = errors(node, "unprepare", b).values()
        assert "stays prepared" in error and "deleted or replaced" in error
        assert not node.checkpoint_file.exists()  # nothing written behind the lock's back
        assert node.spec(b.uid).exists() and not node.spec(c.uid).exists()

        d.kill()  # the liveness probe's restart
        d.start()
        (error,) = errors(node, "prepare", other(1)).values()
        assert "gpu-1 is already prepared for claim" in error and "uid-1" in error
        ok(node, "unprepare", b)
        ok(node, "prepare", c, other(1))
        assert prepared(node) == {a.uid, c.uid, other(1).uid}
        found = record(1, 1, node)
        assert found == []
    finally:
        d.kill()


@pytest.mark.reliability
def test_disk_storm(short_tmp: Path, mounts: Mounts) -> None:
    """Rounds of a disk with a random few pages free (or none, or read-only) while the kubelet
    prepares and unprepares random claims in calls of three, and now and then a kill -9 and a
    start on a sound disk; after every round the files are consistent and the checkpoint holds
    exactly the claims the kubelet was told are prepared; with the disk back, every retry
    succeeds."""
    node = make_node(short_tmp, mounts)
    d = node.daemon
    d.start()
    rng = random.Random(1515)
    rounds, faults, restarts = 200, 0, 0
    try:
        for _ in range(rounds):
            node.state.free()
            kind = rng.choice(["pages"] * 4 + ["full", "full", "read-only", "restart"])
            refs = rng.sample([ref(i) for i in range(8)] + [other(i) for i in range(8)], 3)
            op = rng.choice(["prepare", "unprepare"])
            if kind == "restart":
                d.kill()
                d.start()
                restarts += 1
                answers = errors(node, op, *refs)
            elif kind == "read-only":
                faults += 1
                with node.state.read_only():
                    answers = errors(node, op, *refs)
            else:
                faults += 1
                node.state.fill(leave_pages=rng.randint(1, 4) if kind == "pages" else 0)
                answers = errors(node, op, *refs)
            for r in refs:
                error = answers[r.uid]
                assert (
                    not error
                    or NO_SPACE in error
                    or READ_ONLY in error
                    or (
                        "already prepared for claim" in error  # c<i> and o<i> share gpu-<i>
                    )
                ), answers
            found = problems(node)
            assert found == [] and prepared(node) == node.told_prepared, (kind, answers, found)
        node.state.free()
        held = sorted(node.told_prepared)
        ok(node, "unprepare", *[r for r in (ref(i) for i in range(8)) if r.uid in held])
        ok(node, "unprepare", *[r for r in (other(i) for i in range(8)) if r.uid in held])
        ok(node, "prepare", *[ref(i) for i in range(8)])
        ok(node, "unprepare", *[ref(i) for i in range(8)])
        assert prepared(node) == set()
        found = record(rounds, faults, node, crashes=restarts, storm_rounds=rounds)
        assert found == []
    finally:
        d.kill()
