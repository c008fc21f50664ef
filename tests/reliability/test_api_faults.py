"""API faults (issue 15, reliability item 2): a real ``tessera run --simulate`` daemon in kube mode,
publishing its slices to the API-server emulator over HTTP, while the server answers conflicts
(409), 429s with a Retry-After (honoured: the next attempt waits at least that long), 500s and
503s, hangs past the client's read timeout, drops and cuts the slice watch, expires it (410), and
goes away altogether for a while (every request 503, open watches cut) while the node changes.

After each fault the node's slices must converge to exactly what ``tessera slices`` says the node
advertises (as it is then), with no slice twice, one pool generation, no device or counter set in
two slices, and nothing the server rejected; during the outage the daemon's requests must stay
under the bound its backoff implies (``most_attempts``).

``make reliability`` runs the long version (``LONG``: dgx-a100 in dynamic MIG mode, five slices;
a 30 s outage; the 30 s read timeout) and records its figures (``tests/reliability/report.py``);
``make test`` runs the short one (``SHORT``: the mixed node, two slices; a 2 s outage; the read
timeout is covered in process by ``test_recovers_after_a_timeout``)."""

from __future__ import annotations

import copy
import io
import json
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agent.cli import main
from agent.sim.apiserver import ApiServer
from agent.sim.apiserver_faults import RequestRecord
from dra_driver.advertise.publisher import Backoff
from dra_driver.cluster.kube import DEFAULT_TIMEOUT
from dra_driver.cluster.node_events import RETRY_DELAYS
from tests.integration.daemon import DRIVER, Daemon
from tests.reliability.report import add

Obj = dict[str, Any]
BACKOFF = Backoff()
"""The daemon's backoff (the publisher's and the slice watch's: the defaults)."""
LIST_ONLY = r"^fieldSelector=[^&]*$"
"""The query of the publisher's list of our slices (a watch adds more parameters)."""


@dataclass(frozen=True)
class Plan:
    model: str
    retry_after_s: int
    outage_s: float
    hung_list: bool
    """Also a list that hangs past the daemon's read timeout (30 s)."""
    remove_gpu: int
    """The GPU hot-removed during the outage (the node changes while the server is away)."""


SHORT = Plan("mixed", retry_after_s=1, outage_s=2.0, hung_list=False, remove_gpu=3)
LONG = Plan("dgx-a100", retry_after_s=5, outage_s=30.0, hung_list=True, remove_gpu=1)


def most_attempts(window: float, backoff: Backoff = BACKOFF) -> int:
    """The most requests one retry loop (the publisher's, or the slice watch's) makes in
    ``window`` seconds of a server that fails every request.

    After its n-th failure in a row a loop waits ``Backoff.delay(n)``: d_n = min(cap, base *
    2**(n-1)) times a jitter in [0.5, 1], or longer (a Retry-After; the publisher's device changes
    and watch events wait too), so its k-th request comes at least sum(d_n / 2, n < k) after its
    first. The requests whose earliest time falls in the window are the most it can make; one
    more is allowed for a round already under way when the window opened. With base 0.5 and cap
    30: 8 in 30 s (at 0, 0.25, 0.75, 1.75, 3.75, 7.75, 15.75 s, and the one under way), and
    after the first minute at most one every 15 s (4 a minute)."""
    attempts, t = 1, 0.0
    while True:
        t += min(backoff.cap, backoff.base * 2.0 ** (attempts - 1)) / 2
        if t > window:
            return attempts + 1
        attempts += 1


def most_event_attempts(window: float) -> int:
    """The most Event requests in ``window`` seconds of a failing server: one thread writes the
    Node events one after another, each tried ``len(RETRY_DELAYS) + 1`` times spread over
    ``sum(RETRY_DELAYS)`` seconds (1 s, 4 s) before it is dropped, and the next one starts at
    once."""
    tries = len(RETRY_DELAYS) + 1
    return tries * (math.floor(window / sum(RETRY_DELAYS)) + 1)


def problems(ours: list[Obj], expected: dict[str, Obj]) -> list[str]:
    """What keeps the published slices from being exactly ``expected`` (name -> spec, as
    ``tessera slices`` prints them): duplicates, mixed generations, missing, stray or different
    slices. Empty when they are."""
    found = [f"slice {n} {c} times" for n, c in Counter(_name(s) for s in ours).items() if c > 1]
    generations = sorted({s["spec"]["pool"]["generation"] for s in ours})
    if len(generations) > 1:
        found.append(f"pool generations {generations} at once")
    counts = sorted({s["spec"]["pool"]["resourceSliceCount"] for s in ours})
    if counts and counts != [len(ours)]:
        found.append(f"resourceSliceCount {counts} for {len(ours)} slices")
    for what, key in (("device", "devices"), ("counter set", "sharedCounters")):
        seen = Counter(d["name"] for s in ours for d in s["spec"].get(key) or [])
        found += [f"{what} {n} in {c} slices" for n, c in seen.items() if c > 1]
    have = {_name(s): _content(s["spec"]) for s in ours}
    want = {n: _content(spec) for n, spec in expected.items()}
    found += [f"missing {n}" for n in sorted(want.keys() - have.keys())]
    found += [f"stray {n}" for n in sorted(have.keys() - want.keys())]
    found += [f"{n} is not what tessera slices says" for n in sorted(want.keys() & have.keys())
              if want[n] != have[n]]  # fmt: skip
    return found


def _name(s: Obj) -> str:
    return str(s["metadata"]["name"])


def _content(spec: Obj) -> Obj:
    out = copy.deepcopy(spec)
    out["pool"].pop("generation", None)
    return out


@dataclass
class Rig:
    """The emulator, the daemon publishing to it, and what the suite did to them."""

    server: ApiServer
    daemon: Daemon
    plan: Plan
    faults: int = 0
    cases: int = 0
    lost: int = 0
    figures: dict[str, Any] = field(default_factory=dict)
    advertised: dict[str, Obj] | None = None
    """What ``tessera slices`` printed for the node; None after the node changed."""

    @property
    def node(self) -> str:
        return self.daemon.node

    def ours(self) -> list[Obj]:
        return [
            s
            for s in self.server.objects("resourceslices")
            if s["spec"]["driver"] == DRIVER and s["spec"].get("nodeName") == self.node
        ]

    def expected(self) -> dict[str, Obj]:
        """name -> spec of what ``tessera slices`` prints for the node as it is now (the
        daemon's own simulated sysfs tree and driver root, only read); read again only after
        the node changed (``advertised`` None)."""
        if self.advertised is None:
            self.advertised = self._tessera_slices()
        return self.advertised

    def _tessera_slices(self) -> dict[str, Obj]:
        sim = self.daemon.state / "sim"
        out, err = io.StringIO(), io.StringIO()
        argv = ["slices", "--simulate", self.plan.model, "--mig-mode", "dynamic",
                "--state-dir", str(self.daemon.state), "--sysfs-root", str(sim / "sys"),
                "--driver-root", str(sim / "driver-root"), "-o", "json"]  # fmt: skip
        assert main(argv, {}, out, err) == 0, err.getvalue()
        return {_name(s): s["spec"] for s in json.loads(out.getvalue())}

    def arm(
        self, method: str, path: str, kind: str, times: int = 1, query: str | None = None
    ) -> None:
        self.server.faults.add(method, path, kind, times, query_regex=query)
        self.faults += times

    def records(self, since: float) -> list[RequestRecord]:
        """The requests that arrived at or after ``since``, in the order they arrived."""
        return sorted((r for r in self.server.requests if r.at >= since), key=lambda r: r.at)

    def last_slice(self) -> str:
        """The slice written last in a round (names end in the slice's index)."""
        return max((_name(s) for s in self.ours()), key=lambda n: int(n.rsplit("-", 1)[1]))

    def drift(self) -> None:
        """Someone else edits our last slice (a device fewer): the watch sees it, the publisher
        puts it back, that slice alone, in place at the same generation (``plan_changes``): the
        slice the faults below are armed on."""
        last = self.last_slice()
        target = next(s for s in self.ours() if _name(s) == last)
        assert target["spec"].get("devices"), f"{last} holds no devices to edit"
        target["spec"]["devices"] = target["spec"]["devices"][:-1]
        self.server.put_object("resourceslices", target)

    def converge(self, what: str, timeout: float = 60.0) -> float:
        """Wait until the slices are exactly what the node advertises (a hang guard, not a
        speed limit); the seconds it took. Fails naming what is still wrong."""
        self.cases += 1
        start = time.monotonic()
        expected = self.expected()
        while found := problems(self.ours(), expected) + self.armed():
            assert self.daemon.proc is not None and self.daemon.proc.poll() is None, (
                f"{what}: the agent died: {self.daemon.logs[-5:]}"
            )
            if time.monotonic() - start > timeout:
                self.lost += len(problems(self.ours(), expected))  # the slices', not the faults'
                raise AssertionError(f"{what}: not converged in {timeout:.0f} s: {found}")
            threading.Event().wait(0.05)
        assert self.server.rejected == [], f"{what}: {self.server.rejected}"
        return time.monotonic() - start

    def armed(self) -> list[str]:
        """The armed faults no request has met yet."""
        return [f"{f.kind} on {f.method} {f.path} not met" for f in self.server.faults.pending()]

    def wait_for(self, cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
        """Wait for ``cond`` (a hang guard, not a speed limit)."""
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"never: {what}"
            threading.Event().wait(0.05)

    def settle(self, quiet: float = 0.5, timeout: float = 30.0) -> None:
        """Wait until the publisher has made no request for ``quiet`` seconds: the rounds the
        watch events of its own writes start are over, so what comes next is the fault's."""
        deadline = time.monotonic() + timeout
        while True:
            last = max((r.at for r in self.server.requests if _publisher(r)), default=0.0)
            if time.monotonic() - last >= quiet:
                return
            assert time.monotonic() < deadline, "the publisher never went quiet"
            threading.Event().wait(0.05)


def _publisher(r: RequestRecord) -> bool:
    return r.resource == "resourceslices" and not r.watch


def _watch(r: RequestRecord) -> bool:
    return r.resource == "resourceslices" and r.watch


# -- the faults ---------------------------------------------------------------------------------


def conflicts(rig: Rig) -> None:
    """409 on the update of the edited slice, twice: re-read and written again at once."""
    since = time.monotonic()
    rig.arm("PUT", f"/resourceslices/{rig.last_slice()}$", "409", times=2)
    rig.drift()
    rig.converge("409 conflicts")
    assert [r.status for r in rig.records(since) if r.method == "PUT"].count(409) == 2


def too_many_requests(rig: Rig) -> None:
    """429 with Retry-After on the update of the edited slice: no request of the publisher
    comes before the wait is over, not even for another edit the
    watch reports during the wait. The gap is measured on the server's side of a real process:
    a lower bound only."""
    seconds = rig.plan.retry_after_s
    since = time.monotonic()
    rig.arm("PUT", f"/resourceslices/{rig.last_slice()}$", f"429:{seconds}")
    rig.drift()
    rig.wait_for(lambda: any(r.status == 429 for r in rig.records(since)), "the 429")
    threading.Event().wait(seconds / 2)  # well inside the wait, after the agent took the 429
    rig.drift()  # the watch sees it at once; the publisher still waits
    rig.converge(f"429 with Retry-After: {seconds}")
    records = [r for r in rig.records(since) if _publisher(r)]
    refused = next(i for i, r in enumerate(records) if r.status == 429)
    gap = records[refused + 1].at - records[refused].at
    assert gap >= seconds, f"the next request came {gap:.2f} s after a 429 asking {seconds} s"
    rig.figures["retry_after_s"] = seconds
    rig.figures["next_request_after_429_s"] = round(gap, 2)


def server_errors(rig: Rig) -> None:
    """503 on a list, then 500 on the update of the edited slice, then a 429 whose Retry-After is
    not a number (it asks for nothing): each backed off on the publisher's own backoff, never
    retried sooner than its first step, then written."""
    since = time.monotonic()
    rig.arm("GET", "/resourceslices$", "503", query=LIST_ONLY)
    last = rig.last_slice()
    rig.arm("PUT", f"/resourceslices/{last}$", "500")
    rig.arm("PUT", f"/resourceslices/{last}$", "429:soon")  # met after the 500 is used up
    rig.drift()
    rig.converge("503, 500, and a 429 with a Retry-After that is not a number")
    records = [r for r in rig.records(since) if _publisher(r)]
    failed = [i for i, r in enumerate(records) if r.status >= 429]
    assert [records[i].status for i in failed] == [503, 500, 429]
    least = BACKOFF.base / 2  # the first backoff step, with the most jitter
    assert all(records[i + 1].at - records[i].at >= least for i in failed)


def hung_list(rig: Rig) -> None:
    """A list the server never answers in time: the client gives up at its read timeout and the
    next round lists again."""
    read_timeout = DEFAULT_TIMEOUT[1]
    rig.settle()  # the first list from now on is the one that hangs
    since = time.monotonic()
    hang = read_timeout + 3
    rig.arm("GET", "/resourceslices$", f"slow:{hang}", query=LIST_ONLY)
    rig.drift()
    took = rig.converge("a list that hangs", timeout=read_timeout + 60)
    # the hung list is logged when the server answers it at last (at its arrival time)
    threading.Event().wait(max(0.0, since + hang + 1 - time.monotonic()))
    first, second = [r for r in rig.records(since) if _publisher(r) and r.method == "GET"][:2]
    assert second.at - first.at >= read_timeout  # the next round came after the client gave up
    rig.figures["converge_after_hung_list_s"] = round(took, 1)


def dropped_watch(rig: Rig) -> None:
    """The watch is cut mid-stream and its first reconnect dropped; a change made meanwhile is
    still seen: the watch resumes from its resourceVersion."""
    rig.settle()
    since = time.monotonic()
    rig.server.faults.cut_watches()
    rig.faults += 1
    rig.arm("GET", "/resourceslices$", "drop", query="watch=true")
    rig.drift()
    rig.converge("a cut watch, its reconnect dropped")
    watches = [r for r in rig.records(since) if _watch(r)]
    assert watches[0].status == 0
    assert watches[1].status == 200 and watches[1].params.get("resourceVersion")


def expired_watch(rig: Rig) -> None:
    """The watch is cut, our slice edited, and the history compacted: the watch's
    resourceVersion is too old (410), so it starts over from a fresh list, which repairs what
    it missed."""
    rig.settle()
    since = time.monotonic()
    rig.server.faults.cut_watches()
    rig.drift()  # after the cut: the watch never sees it ...
    rig.server.compact()  # ... and the history that had it is gone
    rig.faults += 1
    rig.converge("an expired watch (410)")
    rig.wait_for(lambda: len([r for r in rig.records(since) if _watch(r)]) > 1, "a new watch")
    records = rig.records(since)
    watches = [r for r in records if _watch(r)]
    old = watches[0].params.get("resourceVersion")
    assert old, "the watch did not try to resume"
    # then a fresh list, and a watch from it ("" or the list's resourceVersion), never the old
    assert any(_publisher(r) and r.method == "GET" and r.at > watches[0].at for r in records)
    assert old not in {w.params.get("resourceVersion") for w in watches[1:]}


def outage(rig: Rig) -> None:
    """Every request answered 503 for ``outage_s`` (open watches cut), while a GPU is
    hot-removed: the publisher and the watch back off, the Node events give up, and after the
    server is back the slices are the node's without that GPU."""
    seconds = rig.plan.outage_s
    start = time.monotonic()
    rig.server.faults.start_outage("503")
    rig.faults += 1
    rig.daemon.fault("remove-gpu", "--gpu", str(rig.plan.remove_gpu))
    rig.advertised = None
    threading.Event().wait(seconds)
    rig.server.faults.end_outage()
    end = time.monotonic()
    took = rig.converge(f"a {seconds:.0f} s outage", timeout=2 * BACKOFF.cap + 60)
    during = [r for r in rig.records(start) if r.at < end]
    assert {r.status for r in during} <= {503}, "something got through the outage"
    window = end - start
    publisher = sum(1 for r in during if _publisher(r))
    watch = sum(1 for r in during if _watch(r))
    events = sum(1 for r in during if r.resource == "events")
    # the usage report (its Node's labels, then its report: docs/budgets.md) has a loop of its
    # own, on its own interval
    usage = sum(1 for r in during if r.resource in ("nodes", "gpuusagereports"))
    # the publisher tries at once (the GPU left); the watch, cut, after its backoff: in a short
    # outage perhaps only after the server is back
    assert publisher >= 1, "the publisher never tried during the outage"
    assert len(during) == publisher + watch + events + usage, [r for r in during if r.resource]
    assert usage <= most_attempts(window), f"{usage} usage-report requests in {window:.1f} s"
    assert publisher <= most_attempts(window), f"{publisher} publisher requests in {window:.1f} s"
    assert watch <= most_attempts(window), f"{watch} watch requests in {window:.1f} s"
    assert events <= most_event_attempts(window), f"{events} Event requests in {window:.1f} s"
    bound = 2 * most_attempts(window) + most_event_attempts(window)
    rig.figures.update(
        outage_s=round(window, 1),
        requests_in_outage=len(during),
        requests_per_minute_in_outage=round(len(during) * 60 / window, 1),
        slice_requests_per_minute_in_outage=round((publisher + watch) * 60 / window, 1),
        publisher_requests_in_outage=publisher,
        watch_requests_in_outage=watch,
        event_requests_in_outage=events,
        usage_report_requests_in_outage=usage,
        bound_requests_per_minute_in_outage=round(bound * 60 / window, 1),
        converge_after_outage_s=round(took, 1),
    )


def rig(server: ApiServer, state: Path, plan: Plan) -> Rig:
    """The daemon for ``plan`` (not started) against ``server``, whose Node it publishes for."""
    daemon = Daemon(state, plan.model, "--kubeconfig", str(server.kubeconfig(state.parent)),
                    "--mig-mode", "dynamic", "--rediscovery-debounce", "0.2")  # fmt: skip
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": daemon.node}}
    server.put_object("nodes", node)
    return Rig(server, daemon, plan)


def run(rig: Rig) -> None:
    """Start the daemon, publish, then every fault of the plan in turn; stop it."""
    scenarios: list[Callable[[Rig], None]] = [
        conflicts, too_many_requests, server_errors,
        *([hung_list] if rig.plan.hung_list else []), dropped_watch, expired_watch, outage,
    ]  # fmt: skip
    try:
        rig.daemon.start()
        rig.converge("the first publish")
        for scenario in scenarios:
            scenario(rig)
        assert rig.daemon.stop() == 0
    finally:
        rig.daemon.kill()


def test_api_faults_short(short_tmp: Path) -> None:
    """Every fault once (but the hung list), a 2 s outage: what `make test` runs."""
    with ApiServer() as server:
        run(rig(server, short_tmp / "state", SHORT))


@pytest.mark.reliability
def test_api_faults(short_tmp: Path) -> None:
    started = time.monotonic()
    with ApiServer() as server:
        long = rig(server, short_tmp / "state", LONG)
        try:
            run(long)
        finally:
            add(
                "api-faults",
                cases=long.cases,
                faults=long.faults,
                lost=long.lost,
                details={**long.figures, "suite_s": round(time.monotonic() - started, 1)},
                rerun="make reliability (tests/reliability/test_api_faults.py)",
            )
