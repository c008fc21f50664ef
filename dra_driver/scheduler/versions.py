"""Which scheduler ``explain`` models: a Kubernetes version (1.34 or 1.35) and the DRA feature
gates it runs with, and what follows from them (domain types, no I/O).

The feature gates, their stage and default per version (kubernetes ``pkg/features/
kube_features.go``, ``defaultVersionedKubernetesFeatureGates`` on release-1.34 and release-1.35;
the two versions agree)::

    gate                     1.34           1.35
    DRAAdminAccess           beta, on       beta, on
    DRAPrioritizedList       beta, on       beta, on
    DRAPartitionableDevices  alpha, off     alpha, off
    DRAConsumableCapacity    alpha, off     alpha, off
    DRADeviceTaints          alpha, off     alpha, off

Which allocator runs (k8s.io/dynamic-resource-allocation ``structured/allocator.go``,
``NewAllocator``): the first of stable, incubating, experimental whose ``SupportedFeatures``
include every enabled feature: stable supports none, incubating AdminAccess, PrioritizedList,
PartitionableDevices and DeviceTaints, experimental also ConsumableCapacity (and the binding
conditions ``explain`` does not model). The same in both versions.

Where the versions differ (``structured/internal/*/pools_*.go``, ``GatherPools``, ``buildPool``;
``allocator_*.go``, ``checkAvailableCounters``, ``allocateDevice``):

- **1.34**: a device's counters are those of its own slice (the 1.34 layout: a slice holds its
  counter sets and the devices that consume them); a consumed counter set that the slice does not
  hold is not checked at all, so the 1.35 layout (counters in a slice of their own) gets no
  counter enforcement. Every taint must be tolerated (``allTaintsTolerated``).
- **1.35**: a pool's counter sets come from its slices that hold ``sharedCounters``; the devices
  of such a slice are ignored (``buildPool``: a slice is a counter-set slice or a device slice),
  so the 1.34 layout loses the devices that sit beside their counters; a consumed counter set or
  counter the pool does not define, or a counter set defined twice, makes the pool invalid. Only
  NoSchedule and NoExecute taints must be tolerated (``taintPreventsAllocation``).

With a gate off, both versions (``allocator_incubating.go``): DRAPrioritizedList: a claim with
``firstAvailable`` is an error; DRAAdminAccess: a request with ``adminAccess`` is an error;
DRAPartitionableDevices: a device that consumes counters is never allocated, a slice with
``perDeviceNodeSelection`` is skipped (1.35: a slice with ``sharedCounters`` too);
DRADeviceTaints: taints are ignored; DRAConsumableCapacity: ``allowMultipleAllocations`` and
capacity requests are ignored (the incubating allocator knows neither) and every allocated result
holds its whole device (``allocateddevices.go``, ``foreachAllocatedDevice``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

VERSIONS = ("1.34", "1.35")
"""The versions ``explain`` models, oldest first."""
NEWEST = VERSIONS[-1]

ADMIN_ACCESS = "DRAAdminAccess"
CONSUMABLE_CAPACITY = "DRAConsumableCapacity"
DEVICE_TAINTS = "DRADeviceTaints"
PARTITIONABLE_DEVICES = "DRAPartitionableDevices"
PRIORITIZED_LIST = "DRAPrioritizedList"
GATES = (ADMIN_ACCESS, CONSUMABLE_CAPACITY, DEVICE_TAINTS, PARTITIONABLE_DEVICES, PRIORITIZED_LIST)
"""The DRA feature gates the allocator reads (``internal.Features.Set``), sorted."""


@dataclass(frozen=True)
class GateSpec:
    stage: str
    default: bool


DEFAULT_GATES: Mapping[str, Mapping[str, GateSpec]] = {
    version: {
        ADMIN_ACCESS: GateSpec("beta", True),
        CONSUMABLE_CAPACITY: GateSpec("alpha", False),
        DEVICE_TAINTS: GateSpec("alpha", False),
        PARTITIONABLE_DEVICES: GateSpec("alpha", False),
        PRIORITIZED_LIST: GateSpec("beta", True),
    }
    for version in VERSIONS
}
"""Per version, each gate's stage and default (the table in the module doc)."""

INSTALL_GATES = frozenset({PARTITIONABLE_DEVICES, CONSUMABLE_CAPACITY, DEVICE_TAINTS})
"""The alpha gates docs/install.md asks a cluster to turn on for Tessera's modes (dynamic MIG,
sharing, device taints): explain assumes them on unless told otherwise (``--feature-gates``)."""

_INCUBATING = frozenset({ADMIN_ACCESS, PRIORITIZED_LIST, PARTITIONABLE_DEVICES, DEVICE_TAINTS})
_EXPERIMENTAL = _INCUBATING | {CONSUMABLE_CAPACITY}
ALLOCATORS: tuple[tuple[str, frozenset[str]], ...] = (
    ("stable", frozenset()),
    ("incubating", _INCUBATING),
    ("experimental", _EXPERIMENTAL),
)
"""``availableAllocators`` (structured/allocator.go), most stable first, with the gates each
supports (``SupportedFeatures`` of ``internal/<name>/allocator_<name>.go``)."""

_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:[.+-].*)?")


class VersionError(ValueError):
    """A version or feature gate ``explain`` does not model; the text names the value and what is
    allowed."""


@dataclass(frozen=True)
class Scheduler:
    """The scheduler ``explain`` models: its version and the DRA gates that are on."""

    version: str
    gates: frozenset[str]

    @classmethod
    def of(cls, version: str = NEWEST, overrides: Mapping[str, bool] | None = None) -> Scheduler:
        """``version``'s defaults, with the :data:`INSTALL_GATES` on, then ``overrides``."""
        if version not in VERSIONS:
            raise VersionError(
                f"Kubernetes {version} is not modelled: explain models {', '.join(VERSIONS)}"
            )
        on = {g for g, spec in DEFAULT_GATES[version].items() if spec.default} | INSTALL_GATES
        for gate, value in (overrides or {}).items():
            if gate not in GATES:
                raise VersionError(
                    f"feature gate {gate!r} is not one explain models: {', '.join(GATES)}"
                )
            if value:
                on.add(gate)
            else:
                on.discard(gate)
        return cls(version, frozenset(on))

    def enabled(self, gate: str) -> bool:
        return gate in self.gates

    @property
    def allocator(self) -> str:
        """The variant ``NewAllocator`` picks for these gates."""
        return next(name for name, supported in ALLOCATORS if self.gates <= supported)

    @property
    def counters_per_slice(self) -> bool:
        """1.34: a device draws on its own slice's counter sets (``checkAvailableCounters``)."""
        return self.version == "1.34"

    @property
    def every_taint_blocks(self) -> bool:
        """1.34: ``allTaintsTolerated`` (1.35: ``taintPreventsAllocation``, NoSchedule and
        NoExecute only)."""
        return self.version == "1.34"

    def gate_states(self) -> dict[str, bool]:
        return {g: g in self.gates for g in GATES}

    def describe(self) -> str:
        """One line: ``Kubernetes 1.35 scheduler, experimental allocator; feature gates:
        DRAAdminAccess=true, ...`` (each gate off by default in that version but assumed on says
        so)."""
        defaults = DEFAULT_GATES[self.version]
        parts = []
        for gate, on in self.gate_states().items():
            note = " (off by default)" if on and not defaults[gate].default else ""
            parts.append(f"{gate}={'true' if on else 'false'}{note}")
        return (
            f"Kubernetes {self.version} scheduler, {self.allocator} allocator; feature gates: "
            + ", ".join(parts)
        )

    def to_json(self) -> dict[str, object]:
        return {
            "kubernetesVersion": self.version,
            "allocator": self.allocator,
            "featureGates": self.gate_states(),
        }


def version_of(text: str) -> tuple[str, str | None]:
    """A version as written (``1.34``, ``v1.35.2``, ``v1.35.1-gke.100``, ``1.35+``) -> (the
    modelled version, a note when a newer one is modelled as the newest); VersionError for one
    that is malformed or older than the oldest modelled."""
    m = _VERSION.fullmatch(text.strip())
    if m is None:
        raise VersionError(
            f"Kubernetes version {text!r} is not a version: expected MAJOR.MINOR, one of"
            f" {', '.join(VERSIONS)}"
        )
    major, minor = int(m.group(1)), int(m.group(2))
    short = f"{major}.{minor}"
    if short in VERSIONS:
        return short, None
    newest = tuple(int(p) for p in NEWEST.split("."))
    if (major, minor) > newest:
        return NEWEST, (
            f"Kubernetes {short} is newer than the newest version explain models:"
            f" modelled as {NEWEST}"
        )
    raise VersionError(f"Kubernetes {short} is not modelled: explain models {', '.join(VERSIONS)}")


def server_version(info: Mapping[str, object]) -> str:
    """The version a ``GET /version`` answer names: the emulated one when it says
    (``emulationMajor``.``emulationMinor``: a control plane run with ``--emulated-version``
    behaves as that version, apimachinery ``pkg/version`` ``Info``), else ``gitVersion``
    (``v1.35.0``), else ``major``.``minor`` (``minor`` may carry a ``+`` on managed clusters)."""
    em, en = info.get("emulationMajor"), info.get("emulationMinor")
    if isinstance(em, str) and isinstance(en, str) and em and en:
        return f"{em}.{en.rstrip('+')}"
    git = info.get("gitVersion")
    if isinstance(git, str) and git:
        return git
    major, minor = info.get("major"), info.get("minor")
    if isinstance(major, str) and isinstance(minor, str) and major and minor:
        return f"{major}.{minor.rstrip('+')}"
    raise VersionError(f"the API server's /version names no version: {dict(info)!r}")


def parse_gates(text: str) -> dict[str, bool]:
    """``--feature-gates`` as kube-scheduler takes it: ``Gate=true,Other=false`` (empty: none);
    a VersionError's text is a phrase about the value (``names Foo, not a gate ...``)."""
    out: dict[str, bool] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip().lower()
        if not sep or value not in ("true", "false"):
            raise VersionError(f"is not NAME=true|false,... ({item!r} is not)")
        if name not in GATES:
            raise VersionError(f"names {name}, not a gate explain models ({', '.join(GATES)})")
        out[name] = value == "true"
    return out


__all__ = [
    "ALLOCATORS",
    "DEFAULT_GATES",
    "GATES",
    "INSTALL_GATES",
    "NEWEST",
    "VERSIONS",
    "GateSpec",
    "Scheduler",
    "VersionError",
    "parse_gates",
    "server_version",
    "version_of",
]
