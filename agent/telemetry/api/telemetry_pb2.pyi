from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchRequest(_message.Message):
    __slots__ = ("interval_seconds", "devices")
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    interval_seconds: float
    devices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, interval_seconds: _Optional[float] = ..., devices: _Optional[_Iterable[str]] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("devices",)
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, devices: _Optional[_Iterable[str]] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("node", "tick", "wall_time", "interval_seconds", "gpus", "claims", "tick_duration_seconds", "lag_seconds")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TICK_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_FIELD_NUMBER: _ClassVar[int]
    TICK_DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    node: str
    tick: int
    wall_time: float
    interval_seconds: float
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    claims: _containers.RepeatedCompositeFieldContainer[ClaimUsage]
    tick_duration_seconds: float
    lag_seconds: float
    def __init__(self, node: _Optional[str] = ..., tick: _Optional[int] = ..., wall_time: _Optional[float] = ..., interval_seconds: _Optional[float] = ..., gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ..., claims: _Optional[_Iterable[_Union[ClaimUsage, _Mapping]]] = ..., tick_duration_seconds: _Optional[float] = ..., lag_seconds: _Optional[float] = ...) -> None: ...

class Gpu(_message.Message):
    __slots__ = ("index", "uuid", "name", "pci_bus_id", "lost", "healthy", "utilization_gpu", "utilization_memory", "memory_used_bytes", "memory_total_bytes", "power_watts", "energy_joules_total", "temperature_gpu_celsius", "temperature_memory_celsius", "clock_sm_hertz", "clock_memory_hertz", "xids", "mig", "holders", "minor")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_GPU_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_MEMORY_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    POWER_WATTS_FIELD_NUMBER: _ClassVar[int]
    ENERGY_JOULES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_GPU_CELSIUS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_MEMORY_CELSIUS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_SM_HERTZ_FIELD_NUMBER: _ClassVar[int]
    CLOCK_MEMORY_HERTZ_FIELD_NUMBER: _ClassVar[int]
    XIDS_FIELD_NUMBER: _ClassVar[int]
    MIG_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    MINOR_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    lost: bool
    healthy: bool
    utilization_gpu: float
    utilization_memory: float
    memory_used_bytes: int
    memory_total_bytes: int
    power_watts: float
    energy_joules_total: float
    temperature_gpu_celsius: float
    temperature_memory_celsius: float
    clock_sm_hertz: float
    clock_memory_hertz: float
    xids: _containers.RepeatedCompositeFieldContainer[Xid]
    mig: _containers.RepeatedCompositeFieldContainer[Mig]
    holders: _containers.RepeatedCompositeFieldContainer[Holder]
    minor: int
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., pci_bus_id: _Optional[str] = ..., lost: _Optional[bool] = ..., healthy: _Optional[bool] = ..., utilization_gpu: _Optional[float] = ..., utilization_memory: _Optional[float] = ..., memory_used_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., power_watts: _Optional[float] = ..., energy_joules_total: _Optional[float] = ..., temperature_gpu_celsius: _Optional[float] = ..., temperature_memory_celsius: _Optional[float] = ..., clock_sm_hertz: _Optional[float] = ..., clock_memory_hertz: _Optional[float] = ..., xids: _Optional[_Iterable[_Union[Xid, _Mapping]]] = ..., mig: _Optional[_Iterable[_Union[Mig, _Mapping]]] = ..., holders: _Optional[_Iterable[_Union[Holder, _Mapping]]] = ..., minor: _Optional[int] = ...) -> None: ...

class Xid(_message.Message):
    __slots__ = ("xid", "count")
    XID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    xid: int
    count: int
    def __init__(self, xid: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class Mig(_message.Message):
    __slots__ = ("gpu_instance_id", "compute_instance_id", "uuid", "profile", "memory_used_bytes", "memory_total_bytes", "utilization")
    GPU_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    gpu_instance_id: int
    compute_instance_id: int
    uuid: str
    profile: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilization: float
    def __init__(self, gpu_instance_id: _Optional[int] = ..., compute_instance_id: _Optional[int] = ..., uuid: _Optional[str] = ..., profile: _Optional[str] = ..., memory_used_bytes: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., utilization: _Optional[float] = ...) -> None: ...

class Holder(_message.Message):
    __slots__ = ("namespace", "claim", "device", "gpu_instance_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    GPU_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    claim: str
    device: str
    gpu_instance_id: int
    def __init__(self, namespace: _Optional[str] = ..., claim: _Optional[str] = ..., device: _Optional[str] = ..., gpu_instance_id: _Optional[int] = ...) -> None: ...

class ClaimUsage(_message.Message):
    __slots__ = ("namespace", "claim", "uid", "pool", "device", "gpu_index", "rule", "energy_joules_total", "gpu_seconds_total", "share")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    ENERGY_JOULES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GPU_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    claim: str
    uid: str
    pool: str
    device: str
    gpu_index: int
    rule: str
    energy_joules_total: float
    gpu_seconds_total: float
    share: float
    def __init__(self, namespace: _Optional[str] = ..., claim: _Optional[str] = ..., uid: _Optional[str] = ..., pool: _Optional[str] = ..., device: _Optional[str] = ..., gpu_index: _Optional[int] = ..., rule: _Optional[str] = ..., energy_joules_total: _Optional[float] = ..., gpu_seconds_total: _Optional[float] = ..., share: _Optional[float] = ...) -> None: ...
