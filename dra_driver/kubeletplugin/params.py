"""The opaque device configuration API: what claims and classes may pass to this driver.

Versioned like a Kubernetes API (``apiVersion`` + ``kind``) and decoded strictly into typed,
frozen values: unknown fields, values of the wrong kind, values out of range and configs that do
not fit their kind of device are each a ParamsError naming the field path
(``parameters.sharing.mps.activeThreadPercentage``), the value and what is allowed. Prepare and
``tessera explain`` share the one entry point, ``validate()``. docs/claims-cookbook.md
("Configuration reference") is the user's version of this docstring; keep them together.

Kinds of ``gpu.tessera.dev/v1alpha1``::

    GpuConfig            whole GPUs (devices of type gpu)
      powerLimit:        e.g. "300W" or "0.3kW"; only with strategy Exclusive; unset: the
                         GPU's own limit (see "Power limits" below)
      sharing:
        strategy:        Exclusive (default) | TimeSlicing | MPS
        timeSlicing:     only with TimeSlicing
          interval:      Default (default) | Short | Medium | Long
        mps:             only with MPS
          activeThreadPercentage:      1..100; unset: the driver decides
          pinnedMemoryLimit:           quantity, 1Mi..2^63-1 bytes; unset: no limit
          perDevicePinnedMemoryLimit:  {gpu-<minor> | GPU-<uuid>: quantity}; unset: none
    MigDeviceConfig      MIG devices (devices of type mig)
      sharing:
        strategy:        Exclusive (default) | MPS   (never TimeSlicing: see below)
        mps:             as above; keys gpu-<minor>-mig-<profile>-<id>-<start> | MIG-<uuid>

Defaults, and what they mean:

- no ``sharing`` or no ``sharing.strategy``: ``Exclusive``, one claim per device;
- ``TimeSlicing`` without ``timeSlicing.interval``: ``Default``, the GPU driver's own timeslice.
  ``Short``, ``Medium`` and ``Long`` are the NVIDIA driver's other timeslice settings, shortest
  to longest (``nvidia-smi compute-policy --set-timeslice`` 1, 2 and 3; ``Default`` is 0, as
  NVIDIA's reference DRA driver, k8s-dra-driver-gpu, maps them);
- ``MPS`` without ``activeThreadPercentage``: the driver decides (it sets none, so MPS's own
  default applies: every client may use all of the device's SMs);
- ``MPS`` without ``pinnedMemoryLimit``: no limit on a device that
  ``perDevicePinnedMemoryLimit`` does not name.

Memory limits are Kubernetes quantities (``dra_driver.quantity``), a string such as ``"4Gi"`` or
an integer number of bytes, rounded up to whole bytes as Kubernetes rounds memory. Below 1Mi is
refused: such a limit leaves a CUDA client nothing to run in, and is almost always a missing
suffix (``1024`` meant as ``1024Mi``). ``perDevicePinnedMemoryLimit`` keys are checked for their
shape and kind only; whether the device is in the claim is prepare's business.

Time-slicing on MIG is refused: the timeslice is a setting of the whole GPU, which the driver
cannot make for one MIG device; share a MIG device with MPS or keep it Exclusive.

Power limits: ``powerLimit`` caps the power of each whole GPU the config applies to, while the
claim holds it (set at prepare with ``nvmlDeviceSetPowerManagementLimit``, the GPU's earlier
limit restored at unprepare). A string: a decimal number and a unit, ``W`` or ``kW`` (``"300W"``,
``"287.5W"``, ``"0.3kW"``), a whole number of milliwatts, more than 0 and at most 10kW; a bare
number is refused (watts or milliwatts? say which). Whether the GPU can take it (its NVML range,
``powerLimitMinWatts``..``powerLimitMaxWatts``) is checked at prepare, where the device is known.
Only for a GPU held alone: with TimeSlicing or MPS the cap would throttle the other sharers, and
a MIG device has no power limit of its own (NVML's limit is the physical GPU's), so
``powerLimit`` on a ``MigDeviceConfig`` is refused.

Versions: ``VERSIONS`` maps each ``apiVersion`` this driver reads to its decoder, and every
decoder produces the same internal values (``DeviceConfig``). A later ``v1`` is one more entry
(and its decoder); ``v1alpha1`` configs keep working because they are read into the same values.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from types import MappingProxyType
from typing import Any, ClassVar, TypeAlias

from agent.decode import fields
from dra_driver.errors import ParamsError, QuantityError
from dra_driver.quantity import Quantity, parse_quantity

API_VERSION = "gpu.tessera.dev/v1alpha1"
GPU_CONFIG = "GpuConfig"
MIG_DEVICE_CONFIG = "MigDeviceConfig"
KINDS = (GPU_CONFIG, MIG_DEVICE_CONFIG)
DEVICE_TYPES = MappingProxyType({GPU_CONFIG: "gpu", MIG_DEVICE_CONFIG: "mig"})
"""The ``type`` of the devices each kind configures (``AdvertisedDevice.kind``)."""

EXCLUSIVE = "Exclusive"
TIME_SLICING = "TimeSlicing"
MPS = "MPS"
STRATEGIES = MappingProxyType(
    {GPU_CONFIG: (EXCLUSIVE, TIME_SLICING, MPS), MIG_DEVICE_CONFIG: (EXCLUSIVE, MPS)}
)
DEFAULT_STRATEGY = EXCLUSIVE
INTERVALS = ("Default", "Short", "Medium", "Long")
DEFAULT_INTERVAL = "Default"
THREAD_PERCENTAGE_RANGE = (1, 100)
MIN_PINNED_MEMORY_BYTES = 1024 * 1024
MAX_PINNED_MEMORY_BYTES = 2**63 - 1
MAX_PARAMETERS_BYTES = 10 * 1024
MAX_POWER_LIMIT_MW = 10_000_000
"""10 kW: far above any GPU's limit, well inside NVML's unsigned int of milliwatts."""
POWER_UNITS = MappingProxyType({"W": 1000, "kW": 1_000_000})
"""The units ``powerLimit`` accepts, in milliwatts."""
NO_POWER_LIMIT_ON_MIG = (
    "a MIG device has no power limit of its own (NVML's power limit is the physical GPU's, shared"
    " by all its MIG devices); cap a whole GPU with a GpuConfig instead"
)
NO_TIME_SLICING_ON_MIG = (
    "MIG devices cannot be time-sliced by the driver (the timeslice is a whole-GPU setting it"
    " cannot make for one MIG device); use MPS or Exclusive"
)


# -- the internal values ---------------------------------------------------------------------
@dataclass(frozen=True)
class Exclusive:
    """One claim per device."""

    strategy: ClassVar[str] = EXCLUSIVE


@dataclass(frozen=True)
class TimeSlicing:
    """Claims share a whole GPU in turns; ``interval`` is one of ``INTERVALS``."""

    interval: str = DEFAULT_INTERVAL
    strategy: ClassVar[str] = TIME_SLICING


@dataclass(frozen=True)
class Mps:
    """Claims share a device through one MPS control daemon.

    ``None`` means unset (see the module docstring for what the driver does then). Per-device
    limits are (device name or UUID, bytes) pairs, sorted by key."""

    active_thread_percentage: int | None = None
    pinned_memory_limit_bytes: int | None = None
    per_device_pinned_memory_limit_bytes: tuple[tuple[str, int], ...] = ()
    strategy: ClassVar[str] = MPS

    def pinned_memory_limit_for(self, name: str, uuid: str | None = None) -> int | None:
        """The limit for one device: its entry by name, else by UUID, else the default."""
        per_device = dict(self.per_device_pinned_memory_limit_bytes)
        for key in (name, uuid):
            if key is not None and key in per_device:
                return per_device[key]
        return self.pinned_memory_limit_bytes


Sharing: TypeAlias = Exclusive | TimeSlicing | Mps


@dataclass(frozen=True)
class DeviceConfig:
    """A validated configuration for one kind of device, whatever version it was written in."""

    kind: str
    sharing: Sharing = Exclusive()
    power_limit_mw: int | None = None
    """``powerLimit`` in milliwatts (None: the GPU keeps its own limit)."""

    @property
    def sharing_strategy(self) -> str:
        """``Exclusive``, ``TimeSlicing`` or ``MPS``."""
        return self.sharing.strategy

    def applies_to(self, device_kind: str) -> bool:
        """``GpuConfig`` configures whole GPUs (``gpu``), ``MigDeviceConfig`` MIG devices."""
        return DEVICE_TYPES.get(self.kind) == device_kind


Decoder: TypeAlias = Callable[[dict[str, Any], str], DeviceConfig]
"""Reads one version's ``parameters`` object (checked to be an object within the size limit)
at ``path``; returns the internal value or raises ParamsError."""


# -- checking one value (agent.decode.fields words the value and its kind) --------------------
def _object(value: Any, path: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ParamsError(f"{path}: expected an object, got {fields.got(value)}")
    try:
        fields.check_known(value, path, allowed)
    except fields.UnknownField as exc:
        raise ParamsError(str(exc)) from None
    return value


def _choice(
    obj: dict[str, Any], name: str, path: str, allowed: tuple[str, ...], default: str
) -> str:
    if name not in obj:
        return default
    value = obj[name]
    if value in allowed and isinstance(value, str):
        return value
    hint = ""
    if isinstance(value, str):
        close = [a for a in allowed if a.lower() == value.lower()]
        hint = f" (did you mean {close[0]}?)" if close else ""
    raise ParamsError(
        f"{path}.{name}: {fields.shown(value)} is not allowed{hint}; allowed: {', '.join(allowed)}"
        f" (default: {default})"
    )


def _percentage(value: Any, path: str) -> int:
    low, high = THREAD_PERCENTAGE_RANGE
    allowed = f"allowed: an integer from {low} to {high}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamsError(f"{path}: {fields.is_a(value)}; {allowed}")
    if not low <= value <= high:
        raise ParamsError(f"{path}: {value} is out of range; {allowed}")
    return value


def _memory_bytes(value: Any, path: str) -> int:
    allowed = (
        f"allowed: a quantity from 1Mi to {MAX_PINNED_MEMORY_BYTES} bytes, a string such as"
        ' "4Gi" or "512Mi" or an integer number of bytes'
    )
    if isinstance(value, str):
        try:
            quantity = parse_quantity(value)
        except QuantityError as exc:
            raise ParamsError(f"{path}: {exc}") from None
    elif isinstance(value, int) and not isinstance(value, bool):
        quantity = Quantity.from_int(value)
    else:
        raise ParamsError(f"{path}: {fields.is_a(value)}; {allowed}")
    size = quantity.value()
    if not MIN_PINNED_MEMORY_BYTES <= size <= MAX_PINNED_MEMORY_BYTES:
        problem = "is less than 1Mi" if size < MIN_PINNED_MEMORY_BYTES else "is too large"
        raise ParamsError(f"{path}: {fields.shown(value)} {problem}; {allowed}")
    return size


_POWER = re.compile(r"(?P<number>(?:0|[1-9][0-9]*)(?:\.[0-9]+)?)(?P<unit>[A-Za-z]*)", re.ASCII)


def power_milliwatts(value: Any, path: str) -> int:
    """``powerLimit`` (``"300W"``, ``"0.3kW"``) in milliwatts; ParamsError otherwise."""
    allowed = (
        'allowed: a string of a number and a unit, W or kW, such as "300W", "287.5W" or'
        f' "0.3kW": a whole number of milliwatts from 1mW to {MAX_POWER_LIMIT_MW // 1000}W'
    )
    if isinstance(value, int | float) and not isinstance(value, bool):
        raise ParamsError(
            f"{path}: {fields.shown(value)} has no unit (watts or milliwatts?); write"
            f' "{value}W" for watts; {allowed}'
        )
    if not isinstance(value, str):
        raise ParamsError(f"{path}: {fields.is_a(value)}; {allowed}")
    m = _POWER.fullmatch(value.strip())
    if m is None:
        raise ParamsError(f"{path}: {fields.shown(value)} is not a power; {allowed}")
    unit = m["unit"]
    if not unit:
        raise ParamsError(
            f"{path}: {fields.shown(value)} has no unit (watts or milliwatts?); write"
            f' "{value.strip()}W" for watts; {allowed}'
        )
    if unit not in POWER_UNITS:
        close = [u for u in POWER_UNITS if u.lower() == unit.lower()]
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ParamsError(
            f"{path}: unit {fields.shown(unit)} of {fields.shown(value)} is not allowed{hint};"
            f" {allowed}"
        )
    milliwatts = Decimal(m["number"]) * POWER_UNITS[unit]
    if milliwatts != milliwatts.to_integral_value():
        raise ParamsError(f"{path}: {fields.shown(value)} is finer than 1mW; {allowed}")
    if not 0 < milliwatts <= MAX_POWER_LIMIT_MW:
        problem = "is not more than 0" if milliwatts <= 0 else "is too large"
        raise ParamsError(f"{path}: {fields.shown(value)} {problem}; {allowed}")
    return int(milliwatts)


def watts(milliwatts: int) -> str:
    """``300W``, ``287.5W``: milliwatts as people write them."""
    text = f"{Decimal(milliwatts) / 1000:f}"
    return (text.rstrip("0").rstrip(".") if "." in text else text) + "W"


_MINOR = r"(?:0|[1-9][0-9]{0,5})"
_UUID = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
_DEVICE_KEYS = {
    "gpu": (re.compile(f"gpu-{_MINOR}", re.ASCII), re.compile(f"GPU-{_UUID}", re.ASCII)),
    "mig": (
        re.compile(f"gpu-{_MINOR}-mig-[a-z0-9]+-(?:0|[1-9][0-9]*)-(?:0|[1-9][0-9]*)", re.ASCII),
        re.compile(f"MIG-{_UUID}", re.ASCII),
    ),
}
_KEY_FORMS = {
    "gpu": "a GPU's name (gpu-<minor>, e.g. gpu-0) or UUID (GPU-<uuid>)",
    "mig": "a MIG device's name (gpu-<minor>-mig-<profile>-<profileId>-<start>, e.g."
    " gpu-0-mig-1g10gb-19-0) or UUID (MIG-<uuid>)",
}
MAX_DEVICE_NAME_CHARS = 63
"""Device names are DNS labels in a ResourceSlice."""


def _device_type_of(key: str) -> str | None:
    """``gpu`` or ``mig`` for a key of either shape; None for anything else."""
    if len(key) > MAX_DEVICE_NAME_CHARS:  # a UUID has 40 characters
        return None
    for device_type, patterns in _DEVICE_KEYS.items():
        if any(p.fullmatch(key) for p in patterns):
            return device_type
    return None


def _device_key(key: Any, path: str, kind: str) -> str:
    want = DEVICE_TYPES[kind]
    allowed = f"allowed: {_KEY_FORMS[want]}"
    if not isinstance(key, str) or (found := _device_type_of(key)) is None:
        raise ParamsError(
            f"{path}: key {fields.shown(key)} is not a device name or UUID; {allowed}"
        )
    if found != want:
        what = "a MIG device" if found == "mig" else "a whole GPU"
        raise ParamsError(
            f"{path}: key {fields.shown(key)} is {what}, which a {kind} does not configure;"
            f" {allowed}"
        )
    return key


# -- v1alpha1 --------------------------------------------------------------------------------
def _mps_v1alpha1(value: Any, path: str, kind: str) -> Mps:
    obj = _object(
        value, path, ("activeThreadPercentage", "pinnedMemoryLimit", "perDevicePinnedMemoryLimit")
    )
    percentage = None
    if "activeThreadPercentage" in obj:
        percentage = _percentage(obj["activeThreadPercentage"], f"{path}.activeThreadPercentage")
    limit = None
    if "pinnedMemoryLimit" in obj:
        limit = _memory_bytes(obj["pinnedMemoryLimit"], f"{path}.pinnedMemoryLimit")
    per_device: list[tuple[str, int]] = []
    if "perDevicePinnedMemoryLimit" in obj:
        map_path = f"{path}.perDevicePinnedMemoryLimit"
        entries = obj["perDevicePinnedMemoryLimit"]
        if not isinstance(entries, dict):
            raise ParamsError(
                f"{map_path}: expected an object of device: quantity, got {fields.got(entries)}"
            )
        for key, limit_value in entries.items():
            name = _device_key(key, map_path, kind)
            per_device.append(
                (name, _memory_bytes(limit_value, f"{map_path}[{fields.shown(key)}]"))
            )
    return Mps(percentage, limit, tuple(sorted(per_device)))


def _sharing_v1alpha1(value: Any, path: str, kind: str) -> Sharing:
    if kind == MIG_DEVICE_CONFIG and isinstance(value, dict):  # say why, not "unknown field"
        if value.get("strategy") == TIME_SLICING:
            raise ParamsError(
                f"{path}.strategy: {fields.shown(TIME_SLICING)} is not allowed on a {kind}:"
                f" {NO_TIME_SLICING_ON_MIG}"
            )
        if "timeSlicing" in value:
            raise ParamsError(
                f"{path}.timeSlicing: not allowed on a {kind}: {NO_TIME_SLICING_ON_MIG}"
            )
    names = ("strategy", "mps") if kind == MIG_DEVICE_CONFIG else ("strategy", "timeSlicing", "mps")
    obj = _object(value, path, names)
    strategy = _choice(obj, "strategy", path, STRATEGIES[kind], DEFAULT_STRATEGY)
    for name, needs in (("timeSlicing", TIME_SLICING), ("mps", MPS)):
        if name in obj and strategy != needs:
            raise ParamsError(
                f"{path}.{name}: only allowed with strategy {needs}, and the strategy is"
                f" {strategy}{'' if 'strategy' in obj else ' (the default)'}"
            )
    if strategy == TIME_SLICING:
        ts = _object(obj.get("timeSlicing", {}), f"{path}.timeSlicing", ("interval",))
        return TimeSlicing(
            _choice(ts, "interval", f"{path}.timeSlicing", INTERVALS, DEFAULT_INTERVAL)
        )
    if strategy == MPS:
        return _mps_v1alpha1(obj.get("mps", {}), f"{path}.mps", kind)
    return Exclusive()


def decode_v1alpha1(obj: dict[str, Any], path: str) -> DeviceConfig:
    """``gpu.tessera.dev/v1alpha1``: ``GpuConfig`` and ``MigDeviceConfig``."""
    if obj.get("kind") == MIG_DEVICE_CONFIG and "powerLimit" in obj:  # say why, not "unknown"
        raise ParamsError(
            f"{path}.powerLimit: not allowed on a {MIG_DEVICE_CONFIG}: {NO_POWER_LIMIT_ON_MIG}"
        )
    _object(obj, path, ("apiVersion", "kind", "sharing", "powerLimit"))
    kind = obj.get("kind")
    if kind not in KINDS or not isinstance(kind, str):
        shown = (
            "missing"
            if "kind" not in obj
            else f"{fields.shown(kind)} is not a kind of {API_VERSION}"
        )
        raise ParamsError(f"{path}.kind: {shown}; allowed: {', '.join(KINDS)}")
    sharing: Sharing = Exclusive()
    if "sharing" in obj:
        sharing = _sharing_v1alpha1(obj["sharing"], f"{path}.sharing", kind)
    if "powerLimit" not in obj:
        return DeviceConfig(kind, sharing)
    power = power_milliwatts(obj["powerLimit"], f"{path}.powerLimit")
    if not isinstance(sharing, Exclusive):
        raise ParamsError(
            f"{path}.powerLimit: only allowed with strategy {EXCLUSIVE}, and the strategy is"
            f" {sharing.strategy}: a power limit caps the whole GPU, which would throttle the"
            " claims and processes sharing it"
        )
    return DeviceConfig(kind, sharing, power)


VERSIONS: Mapping[str, Decoder] = MappingProxyType({API_VERSION: decode_v1alpha1})
"""Every ``apiVersion`` this driver reads, with its decoder (the conversion seam)."""


# -- the entry point -------------------------------------------------------------------------
def validate(
    parameters: Any, path: str = "parameters", versions: Mapping[str, Decoder] = VERSIONS
) -> DeviceConfig:
    """Decode and check one opaque ``parameters`` object. Pure; raises ParamsError.

    ``versions`` is for tests of the conversion seam; callers use the default."""
    try:
        size = len(json.dumps(parameters, separators=(",", ":"), allow_nan=False))
    except (TypeError, ValueError, RecursionError) as exc:  # a YAML date, NaN, endless nesting
        raise ParamsError(f"{path}: not JSON data: {exc}") from exc
    if size > MAX_PARAMETERS_BYTES:
        raise ParamsError(f"{path}: {size} bytes, more than the {MAX_PARAMETERS_BYTES} allowed")
    if not isinstance(parameters, dict):
        raise ParamsError(f"{path}: expected an object, got {fields.got(parameters)}")
    version = parameters.get("apiVersion")
    decoder = versions.get(version) if isinstance(version, str) else None
    if decoder is None:
        shown = (
            "missing"
            if "apiVersion" not in parameters
            else f"{fields.shown(version)} is not supported"
        )
        raise ParamsError(f"{path}.apiVersion: {shown}; allowed: {', '.join(versions)}")
    return decoder(parameters, path)
