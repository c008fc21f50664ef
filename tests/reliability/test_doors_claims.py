"""Bad input in ResourceClaims, their opaque configs and the standalone claim files
(docs/reliability.md, "Untrusted input at every door"; the checks every daemon case ends with:
tests/reliability/doors.py).

- The pure door: generated claim objects (allocations pointing at wrong pools, devices,
  drivers and nodes, huge lists, wrong types, near-valid opaque configs) through
  ``parse_allocation`` and ``plan_claim`` on simulated nodes in every sharing and MIG mode:
  a plan of exactly this driver's devices, or a ClaimError or ParamsError with a clear
  message, never another exception.
- Through the daemon: the same claims as claim files in ``<state>/resourceclaims/``, prepared
  and unprepared over the DRA socket: prepared with their CDI spec (then released), or refused
  with a clear message; and claim files of any content and kind (not YAML, not UTF-8, huge,
  alias bombs, deep nesting, FIFOs, symlinks to files, devices, directories, nothing or
  themselves, hostile file names): no call blocks, a claim that is not found says so, and
  nothing the symlinks point to is changed.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from dra_driver.errors import ClaimError, ParamsError
from dra_driver.kubeletplugin.claims import ClaimKey, parse_allocation
from dra_driver.kubeletplugin.plan import SharingPolicy, plan_claim
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.reliability.claim_strategies import DRIVER, claim_objects, device_model, tame_claims
from tests.reliability.doors import (
    DNS_LABEL,
    DNS_SUBDOMAIN,
    MODEL,
    RERUN,
    DaemonDoor,
    clear,
    close_door,
    end,
    fast,
    hostile_text,
    long,
    open_door,
)

# a failing case of huge generated values is still worth reporting in full
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

POLICIES = [
    SharingPolicy(),
    SharingPolicy(mode="time-slicing"),
    SharingPolicy(mode="memory-shares"),
    SharingPolicy(dynamic_mig=True),
]


# -- the pure door: parse_allocation and plan_claim ------------------------------------------


def key_of(obj: Any) -> ClaimKey:
    """The key the kubelet would send for ``obj``: its own names where the door lets them in
    (a DNS label, subdomain and UID), else another claim's (the object's own UID then differs)."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    namespace, name, uid = (meta.get(f) for f in ("namespace", "name", "uid"))
    namespace = "default" if namespace is None else namespace
    if (
        all(isinstance(v, str) for v in (namespace, name, uid))
        and DNS_LABEL.fullmatch(uid)
        and DNS_LABEL.fullmatch(namespace)
        and len(name) <= 253
        and DNS_SUBDOMAIN.fullmatch(name)
    ):
        return ClaimKey(namespace, name, uid)
    return ClaimKey("default", "c", "uid-c")


def ours(obj: dict[str, Any]) -> list[str]:
    """The devices of this driver the results of a claim that parsed name, in order, once each."""
    devices = obj["status"]["allocation"].get("devices") or {}
    found = []
    for r in devices.get("results") or []:
        if r["driver"] == DRIVER and r["device"] not in found:
            found.append(r["device"])
    return found


def pure_case(counts: dict[str, int]) -> Any:
    @given(claim_objects(MODEL), st.sampled_from(POLICIES))
    def case(obj: dict[str, Any], policy: SharingPolicy) -> None:
        model = device_model(MODEL, "dynamic" if policy.dynamic_mig else "static")
        key = key_of(obj)
        try:
            plan = plan_claim(parse_allocation(obj, key, DRIVER, MODEL), model, policy)
        except ClaimError as exc:
            assert not clear(str(exc)), (clear(str(exc)), str(exc))
            assert str(exc).startswith("claim "), str(exc)
            counts["refused"] += 1
        except ParamsError as exc:
            assert not clear(str(exc)), (clear(str(exc)), str(exc))
            assert re.match(r"[\w.\[\]\"'-]+: ", str(exc)), str(exc)  # a field path or device
            counts["refused"] += 1
        else:
            assert [p.device.name for p in plan.devices] == ours(obj)
            advertised = {d.name for d in model.devices}
            assert all(p.device.name in advertised for p in plan.devices)
            counts["planned"] += 1
        counts["cases"] += 1

    return case


def test_claim_objects_plan_or_are_refused_clearly():
    counts = {"cases": 0, "planned": 0, "refused": 0}
    fast(150)(pure_case(counts))()
    assert counts["cases"] == counts["planned"] + counts["refused"] > 0


@pytest.mark.reliability
@pytest.mark.timeout(1800)
def test_claim_objects_plan_or_are_refused_clearly_long():
    from tests.reliability.report import add

    counts = {"cases": 0, "planned": 0, "refused": 0}
    long(3000)(pure_case(counts))()
    add(
        "bad-input",
        cases=counts["cases"],
        details={
            "claims_pure_cases_total": counts["cases"],
            "claims_pure_planned_total": counts["planned"],
        },
        rerun=RERUN,
    )
    assert counts["planned"] > 0 and counts["refused"] > 0  # both ways were tried


# -- through the daemon: claim files -----------------------------------------------------------


@pytest.fixture(scope="module")
def door() -> Iterator[DaemonDoor]:
    # targets: what the generated symlinks point to (the tests' own files)
    d = open_door("claims", own=("targets",), itemize=("prepared", "any_file"))
    try:
        yield d
    finally:
        close_door(d)


@pytest.fixture(scope="module")
def kubelet(door: DaemonDoor) -> Iterator[KubeletClient]:
    with KubeletClient(door.daemon.dra_socket, timeout=60) as k:
        yield k


def ref_of(obj: dict[str, Any]) -> ClaimRef:
    key = key_of(obj)
    return ClaimRef(key.namespace, key.name, key.uid)


def released(door: DaemonDoor, kubelet: KubeletClient, ref: ClaimRef) -> None:
    assert kubelet.unprepare([ref])["claims"][ref.uid]["error"] == ""
    assert door.daemon.cdi_files() == [], "a CDI spec outlived its claim"


def file_case(door: DaemonDoor, kubelet: KubeletClient) -> Any:
    claims = door.state / "resourceclaims"
    counter = iter(range(10**9))

    @given(st.data())
    def case(data: st.DataObject) -> None:
        n = next(counter)
        obj = data.draw(
            tame_claims(MODEL, f"fz-{n}", f"uid-fz-{n}")
            | claim_objects(MODEL, name=f"fz-{n}", uid=f"uid-fz-{n}")
            | claim_objects(MODEL)
        )
        path = claims / f"fz-{n}.yaml"
        path.write_text(yaml.safe_dump(obj, allow_unicode=True))
        ref = ref_of(obj)
        try:
            answer = kubelet.prepare([ref], data.draw(st.sampled_from(["v1", "v1beta1"])))
            (result,) = answer["claims"].values()
            if result["error"]:
                assert not clear(result["error"]), (clear(result["error"]), result["error"])
                assert result["error"].startswith("claim "), result["error"]
                door.count("refused")
            else:
                assert [d["deviceName"] for d in result["devices"]] == ours(obj)
                spec = [f"k8s.{DRIVER}-claim_{ref.uid}.json"] if ours(obj) else []
                assert door.daemon.cdi_files() == spec  # a claim of no devices of ours: none
                door.count("prepared")
            released(door, kubelet, ref)
        finally:
            path.unlink()
        door.check()

    return case


def test_claim_files_prepare_or_are_refused_clearly(door, kubelet):
    fast(25)(file_case(door, kubelet))()
    end(door, record=False)


@pytest.mark.reliability
@pytest.mark.timeout(3600)
def test_claim_files_prepare_or_are_refused_clearly_long(door, kubelet):
    long(1500)(file_case(door, kubelet))()
    end(door, record=True)


# -- claim files of any content and kind -----------------------------------------------------

HUGE = 1024 * 1024 + 1
contents = st.one_of(
    claim_objects(MODEL, name="any", uid="uid-any").map(
        lambda o: yaml.safe_dump(o, allow_unicode=True).encode()
    ),
    st.binary(max_size=300),
    st.text(max_size=300).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.sampled_from(
        [
            b"kind: ResourceClaim\nspec: " + b"9" * 5000 + b"\n",
            b"a: &a ["
            + b"x, " * 50
            + b"x]\nb: &b ["
            + b"*a, " * 50
            + b"*a]\nc: ["
            + b"*b, " * 50
            + b"*b]\n",
            b"[" * 10_000 + b"]" * 10_000,
            b"{a: " * 5_000 + b"1" + b"}" * 5_000,
            b"---\n" * 20_000,
            b"kind: ResourceClaim\nmetadata: {name: any, uid: \xff\xfe}\n",
            b"!!python/object/apply:os.system ['touch /tmp/tessera-fuzz-escape']\n",
            b"kind: ResourceClaim\n" + b" " * HUGE,
            b"\x00" * HUGE,
        ]
    ),
)
kinds = st.sampled_from(
    ["file", "file", "link", "link-to-dev-zero", "link-to-fifo", "link-to-dir", "dangling",
     "loop", "link-to-checkpoint", "fifo", "dir"]
)  # fmt: skip
file_names = st.one_of(
    st.just("x"),
    hostile_text.filter(
        lambda t: "/" not in t and "\x00" not in t and 0 < len(t.encode("utf-8", "replace")) < 200
    ),
)


def make(path: Path, kind: str, content: bytes, targets: Path) -> Path:
    """``path`` as ``kind`` holding ``content``; returns where a link of ours points."""
    target = targets / path.name
    if kind == "file":
        path.write_bytes(content)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    elif kind == "link":
        target.write_bytes(content)
        path.symlink_to(target)
    elif kind == "link-to-fifo":
        os.mkfifo(target)
        path.symlink_to(target)
    elif kind == "link-to-dir":
        target.mkdir()
        path.symlink_to(target)
    elif kind == "link-to-dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "link-to-checkpoint":
        path.symlink_to(path.parent.parent / "checkpoint.json")
    elif kind == "dangling":
        path.symlink_to(targets / "nothing-here")
    elif kind == "loop":
        path.symlink_to(path)
    return target


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    elif path.is_symlink() or path.exists():
        path.unlink()


def any_file_case(door: DaemonDoor, kubelet: KubeletClient) -> Any:
    claims, targets = door.state / "resourceclaims", door.root / "targets"
    counter = iter(range(10**9))

    @given(contents, kinds, file_names)
    def case(content: bytes, kind: str, name: str) -> None:
        n = next(counter)
        path = claims / f"{name}-{n}.yaml"
        target = make(path, kind, content, targets)
        any_ref = ClaimRef("default", "any", "uid-any")
        absent = ClaimRef("default", "absent", "uid-absent")
        try:
            answers: dict[str, Any] = {}
            caller = threading.Thread(
                target=lambda: answers.update(kubelet.prepare([any_ref, absent])["claims"])
            )
            started = time.monotonic()
            caller.start()
            caller.join(30)
            assert not caller.is_alive(), f"a claim file of kind {kind} blocked the call"
            assert time.monotonic() - started < 30
            missing = answers["uid-absent"]["error"]
            assert missing.startswith(f"claim default/absent not found in {claims}"), missing
            assert not clear(missing), (clear(missing), missing)
            if answers["uid-any"]["error"]:
                assert not clear(answers["uid-any"]["error"]), answers["uid-any"]["error"]
            released(door, kubelet, any_ref)
            if kind == "link":
                assert target.read_bytes() == content, "a file a symlink points to was changed"
        finally:
            remove(path)
            remove(target)
        assert not list(targets.iterdir()), "written next to a symlink's target"
        door.count("any_file")
        door.check()

    return case


def test_claim_files_of_any_content_and_kind(door, kubelet):
    fast(30)(any_file_case(door, kubelet))()
    end(door, record=False)


@pytest.mark.reliability
@pytest.mark.timeout(3600)
def test_claim_files_of_any_content_and_kind_long(door, kubelet):
    long(1000)(any_file_case(door, kubelet))()
    end(door, record=True)
