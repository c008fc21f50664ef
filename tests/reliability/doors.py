"""What the bad-input suites share (``tests/reliability/test_doors_*.py``, docs/reliability.md,
"Untrusted input at every door"): hostile strings, one long-lived daemon per door with the
checks every case ends with, and the figures they record.

The checks, for every case and again at the end of a door:

- **no unhandled exception**: every stderr line of the daemon is JSON, and none is an
  ERROR or CRITICAL record, carries a traceback (``exception``), says ``internal error`` or
  ``unhandled exception``, or is longer than ``MAX_LOG_LINE`` (an untrusted value echoed whole);
  the daemon never exits;
- **every rejection a clear message**: each door checks its own answers' text (the field or the
  value, shown short and printable, see ``clear``);
- **no file written outside the CDI root and the state directory**: everything under the door's
  root directory outside the state directory (the CDI root is inside it) is the same at the end
  (``outside``), and no file named with ``ESCAPE`` (the tail of every path-like string the
  suites send) exists anywhere a path could lead (``escaped``);
- **the daemon still serving at the end** (``DaemonDoor.still_serving``): ``GetInfo`` on the
  registration socket, a good claim prepared and unprepared, nothing left held (no claim in
  the checkpoint, no CDI spec: the cases release what they prepare), ``/healthz`` answering
  200; and it stops cleanly on SIGTERM (``close_door``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.integration.daemon import Daemon, claim_manifest, write_claims
from tests.reliability.report import add

SUITE = "bad-input"
RERUN = "make reliability (tests/reliability/test_doors_*.py)"
ESCAPE = "tessera-fuzz-escape"
"""The last part of every path-like string the suites send: a file of this name anywhere means a
path built from input left the directory it was meant for."""
MAX_LOG_LINE = 20_000
"""No log line of the daemon is longer (an HTTP request head, at most 16 KiB, is the longest
thing it may show)."""
MAX_MESSAGE = 2_000
"""No rejection the kubelet reads is longer than this."""
MODEL = "dgx-h100"
GOOD = ClaimRef("default", "door-good", "uid-door-good")
"""The claim every door prepares and unprepares at the end (on gpu-7, which no case uses)."""


def fast(examples: int) -> settings:
    """Settings of a door's `make test` part: a few cases, no deadline (the machine is shared)."""
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )


def long(examples: int) -> settings:
    """Settings of a door's `make reliability` part."""
    return fast(examples)


# -- hostile strings -------------------------------------------------------------------------

PATHS = [
    "..",
    ".",
    "/",
    "//",
    "~",
    f"../{ESCAPE}",
    f"../../{ESCAPE}",
    "../" * 12 + f"tmp/{ESCAPE}",
    f"/tmp/{ESCAPE}",
    f"a/../../{ESCAPE}",
    f"./{ESCAPE}",
    f"..\\..\\{ESCAPE}",
    f"%2e%2e%2f{ESCAPE}",
    f"{ESCAPE}/../../..",
    f"\x00{ESCAPE}",
    f"{ESCAPE}\x00.yaml",
]
CONTROL = ["\x00", "\n", "\r\n", "\t", "\x1b[31m", "\x7f", "\u2028", "\ufeff"]
valid_label = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?", fullmatch=True)
non_ascii = st.text(st.characters(min_codepoint=0x80, exclude_categories=["Cs"]), max_size=12)
very_long = st.sampled_from([64, 254, 1_000, 20_000, 100_000]).flatmap(
    lambda n: st.sampled_from(["a" * n, "ü" * n, "-" * n, "a." * (n // 2), "../" * (n // 3)])
)
hostile_text = st.one_of(
    st.sampled_from(PATHS),
    st.just(""),
    non_ascii,
    very_long,
    st.lists(
        st.one_of(valid_label, st.sampled_from(PATHS), st.sampled_from(CONTROL), non_ascii),
        min_size=1,
        max_size=4,
    ).map("".join),
    st.text(max_size=30),
)
"""Strings a hostile or broken writer puts where a name goes: path separators, '..', NUL and
other control characters, very long and non-ASCII text."""
names = st.one_of(valid_label, valid_label, hostile_text)
"""Mostly valid names (so that cases get past the first check), often hostile ones."""


NAMES_WHAT = re.compile(
    r"[\w-]+(\.[\w-]+|\[\d+\])+: |'[^']*'|\"[^\"]*\""
    r"|expected an object|is not allocated| not found in "
)
"""A field path (``status.allocation.devices.results[0].pool: ``), a value shown quoted, or what
is wrong with the claim as a whole (not allocated, not found)."""


def clear(message: str) -> list[str]:
    """What keeps ``message`` (a rejection a user reads) from being clear: empty, naming no
    field or value, too long, control characters (an untrusted value echoed raw). Empty list:
    clear."""
    problems = []
    if not message.strip():
        problems.append("empty")
    elif not NAMES_WHAT.search(message):
        problems.append("names no field or value")
    if len(message) > MAX_MESSAGE:
        problems.append(f"{len(message)} characters long")
    if re.search(r"[\x00-\x1f\x7f]", message):
        problems.append("a control character")
    return problems


# -- files -----------------------------------------------------------------------------------


def tree(root: Path, *skip: Path) -> dict[str, tuple[str, int, int]]:
    """Every path under ``root`` but those under ``skip`` (not followed into symlinks): its
    kind, size and modification time."""
    found: dict[str, tuple[str, int, int]] = {}
    for top, dirs, files in os.walk(root):
        here = Path(top)
        dirs[:] = [d for d in dirs if here / d not in skip]
        for name in dirs + files:
            path = here / name
            try:
                st_ = path.lstat()
            except OSError:
                continue
            kind = "link" if path.is_symlink() else "dir" if path.is_dir() else "file"
            found[str(path.relative_to(root))] = (kind, st_.st_size, st_.st_mtime_ns)
    return found


def escaped(root: Path) -> list[str]:
    """Files named with ESCAPE where a path built from input could have led: the door's root
    (all of it), its parents, the temporary directories, the home and working directories, /."""
    places = {Path("/"), Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"), Path.home()}
    places |= {Path.cwd(), *root.parents}
    found = [str(p) for p in root.rglob(f"*{ESCAPE}*")]
    for place in places:
        try:
            found += [str(place / n) for n in os.listdir(place) if ESCAPE in n]
        except OSError:
            continue
    return sorted(set(found))


# -- one daemon per door ---------------------------------------------------------------------


@dataclass
class DaemonDoor:
    """A door's daemon, its root directory and what its cases did."""

    name: str
    root: Path
    daemon: Daemon
    before: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    cases: Counter[str] = field(default_factory=Counter)
    recorded: Counter[str] = field(default_factory=Counter)
    """What ``finish`` already added to the suite's figures (a door's tests share its counts)."""
    prepared: dict[str, str] = field(default_factory=dict)
    """Claim UIDs the cases left prepared, with their device."""
    seen_logs: int = 0
    own: tuple[Path, ...] = ()
    """Directories outside the state directory that the tests themselves write (symlinks'
    targets): each case checks them itself."""
    itemize: tuple[str, ...] = ()
    """Kinds of case whose count the suite's record shows apart (besides the door's total)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def state(self) -> Path:
        return self.daemon.state

    def count(self, kind: str) -> None:
        with self.lock:
            self.cases[kind] += 1

    def check(self) -> None:
        """The daemon is alive and logged nothing bad since the last check."""
        d = self.daemon
        assert d.proc is not None and d.proc.poll() is None, f"the agent died: {d.raw[-5:]}"
        raw = d.raw[self.seen_logs :]
        self.seen_logs += len(raw)
        bad = [line for line in raw if bad_line(line)]
        assert not bad, f"the agent logged {len(bad)} bad line(s); the first: {bad[0][:3000]}"

    def outside(self) -> list[str]:
        """What changed under the root outside the state directory since the door opened."""
        now = tree(self.root, self.state, *self.own)
        return sorted(
            f"{path}: {'new' if path not in self.before else 'changed'}"
            for path, info in now.items()
            if self.before.get(path) != info
        ) + sorted(f"{path}: gone" for path in self.before.keys() - now.keys())

    def still_serving(self) -> list[str]:
        """What the end of a door finds wrong with the daemon (empty: it serves)."""
        problems = []
        d = self.daemon
        if d.proc is None or d.proc.poll() is not None:
            return [f"the agent exited: {d.raw[-5:]}"]
        try:
            with KubeletClient(d.reg_socket, timeout=10) as reg:
                if reg.get_info()["name"] != "gpu.tessera.dev":
                    problems.append("GetInfo names another driver")
            with KubeletClient(d.dra_socket, timeout=30) as k:
                prepared = k.prepare([GOOD])["claims"][GOOD.uid]
                if prepared["error"] or [x["deviceName"] for x in prepared["devices"]] != ["gpu-7"]:
                    problems.append(f"the good claim did not prepare: {prepared}")
                if not (d.cdi_dir / f"k8s.gpu.tessera.dev-claim_{GOOD.uid}.json").exists():
                    problems.append("the good claim has no CDI spec")
                released = k.unprepare([GOOD])["claims"][GOOD.uid]["error"]
                if released:
                    problems.append(f"the good claim did not unprepare: {released}")
            held = sorted(d.checkpoint()["claims"])
            if held or d.cdi_files():
                problems.append(f"claims left held: {held}, CDI specs left: {d.cdi_files()}")
            with urllib.request.urlopen(d.metrics_url("/healthz"), timeout=10) as r:
                if r.status != 200:
                    problems.append(f"/healthz answered {r.status}")
        except Exception as exc:  # any failure to serve is what this reports
            problems.append(f"{type(exc).__name__}: {exc}")
        return problems

    def finish(self, record: bool) -> tuple[list[str], list[str], list[str]]:
        """The end of a door: (not serving, files outside, escaped files); recorded in the
        suite's figures when ``record`` (the `make reliability` part)."""
        serving = self.still_serving()
        time.sleep(0.2)  # the last records reach the reader
        outside, out = self.outside(), escaped(self.root)
        if record:
            new = self.cases - self.recorded
            self.recorded = Counter(self.cases)
            add(
                SUITE,
                cases=sum(new.values()),
                lost=len(outside) + len(out) + (1 if serving else 0),
                details={f"{self.name}_{kind}_total": new[kind] for kind in self.itemize}
                | {f"{self.name}_cases_total": sum(new.values())},
                rerun=RERUN,
            )
        return serving, outside, out


def bad_line(line: str) -> bool:
    """A stderr line of the daemon that shows an unhandled problem (see the module docstring)."""
    if len(line) > MAX_LOG_LINE:
        return True
    try:
        rec = json.loads(line)
    except ValueError:
        return True
    if not isinstance(rec, dict):
        return True
    msg = str(rec.get("msg", ""))
    return (
        "exception" in rec
        or rec.get("level") in ("error", "critical")
        or "internal error" in msg
        or "unhandled exception" in msg
    )


DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
"""A Kubernetes DNS label and subdomain: the names the kubelet's door lets through."""


def end(door: DaemonDoor, record: bool) -> None:
    serving, outside, out = door.finish(record)
    assert not serving, serving
    assert not outside, f"written outside the state directory: {outside}"
    assert not out, f"a path left its directory: {out}"
    door.check()


def open_door(
    name: str, *extra: str, own: tuple[str, ...] = (), itemize: tuple[str, ...] = ()
) -> DaemonDoor:
    """A daemon of its own for door ``name``, in a new root under /tmp (short: unix socket
    paths), with the good claim in its claim files, a file outside the state directory that
    must stay as it is, and the directories ``own`` (under the root) for the tests' files."""
    root = Path(tempfile.mkdtemp(prefix="ts-door-", dir="/tmp"))
    (root / "outside").mkdir()
    (root / "outside" / "keep.yaml").write_text("kind: ResourceClaim\n")
    for directory in own:
        (root / directory).mkdir()
    state = root / "s"
    write_claims(state, claim_manifest(GOOD.name, GOOD.uid, [("gpu", "gpu-7")], MODEL))
    d = Daemon(state, MODEL, *extra)
    door = DaemonDoor(name, root, d, own=tuple(root / o for o in own), itemize=itemize)
    door.before = tree(root, state, *door.own)
    d.start()
    return door


def close_door(door: DaemonDoor) -> None:
    """Stop the door's daemon as the kubelet's pod would be (SIGTERM): after everything it was
    sent, it still shuts down cleanly, exit status 0."""
    try:
        code = door.daemon.stop()
        assert code == 0, f"the agent exited {code} on SIGTERM: {door.daemon.raw[-5:]}"
    finally:
        door.daemon.kill()
        shutil.rmtree(door.root, ignore_errors=True)
