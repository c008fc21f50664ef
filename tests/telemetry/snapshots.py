"""Synthetic snapshots for the exposition, stream and top tests."""

from __future__ import annotations

from agent.nvml.samples import GpuSample, MigSample, ProcessSample
from agent.telemetry.snapshot import ClaimUsage, GpuTelemetry, PreparedDevice, Snapshot

GIB = 1024**3


def make_snapshot(
    tick: int = 1, mig_devices: int = 2, claims: int = 2, lost_gpu: bool = True
) -> Snapshot:
    """GPU 0: whole, held by claims; GPU 1: MIG with ``mig_devices`` devices; GPU 2 (optional):
    lost. Values encode ``tick`` so a scrape can prove it read one snapshot."""
    gpus = [
        GpuTelemetry(
            sample=GpuSample(
                index=0, uuid="GPU-0", timestamp=float(tick), utilization_gpu=0.5,
                utilization_memory=0.25, memory_used_bytes=10 * GIB, memory_free_bytes=60 * GIB,
                memory_reserved_bytes=GIB // 2, power_watts=float(100 + tick),
                energy_joules=1000.0 * tick, temperature_gpu_celsius=55.0,
                temperature_memory_celsius=None, clock_sm_hertz=1.98e9, clock_memory_hertz=2.6e9,
                throttle_reasons=0x4, pcie_tx_bytes_per_second=1e6, pcie_rx_bytes_per_second=2e6,
                pcie_replays=0, nvlink_tx_bytes=10**9, nvlink_rx_bytes=2 * 10**9,
                ecc_corrected=1, ecc_uncorrected=0, remapped_rows_correctable=0,
                remapped_rows_uncorrectable=0, remap_pending=False,
                processes=(ProcessSample(4242, GIB, None, None, 0.5),),
            ),
            name="NVIDIA H100 80GB HBM3", pci_bus_id="0000:1b:00.0", minor=0,
            energy_joules_total=1000.0 * tick, xid_counts=((13, 2),), healthy=True,
        ),
        GpuTelemetry(
            sample=GpuSample(
                index=1, uuid="GPU-1", timestamp=float(tick), utilization_gpu=0.1,
                power_watts=float(100 + tick), energy_joules=10.0 * tick,
                memory_used_bytes=GIB, memory_free_bytes=70 * GIB,
                mig=tuple(
                    MigSample(i + 1, 0, f"MIG-{i}", GIB, 10 * GIB, 0.3 if i % 2 else None)
                    for i in range(mig_devices)
                ),
            ),
            name="NVIDIA H100 80GB HBM3", pci_bus_id="0000:43:00.0", minor=1,
            energy_joules_total=10.0 * tick, xid_counts=(),
            healthy=True, mig_profiles=tuple((i + 1, "1g.10gb") for i in range(mig_devices)),
        ),
    ]  # fmt: skip
    if lost_gpu:
        gpus.append(
            GpuTelemetry(
                sample=GpuSample(index=2, uuid="GPU-2", timestamp=float(tick), lost=True),
                name="NVIDIA H100 80GB HBM3", pci_bus_id="0000:52:00.0", minor=2,
                energy_joules_total=5.0, xid_counts=((79, 1),), healthy=False,
            )
        )  # fmt: skip
    usage = tuple(
        ClaimUsage("team-a", f"job-{i}", f"uid-{i}", "node-a",
                   "gpu-0" if i == 0 else f"gpu-1-mig-1g10gb-19-{i}",
                   0 if i == 0 else 1, "exclusive" if i == 0 else "mig-sm-share",
                   float(tick * (i + 1)), float(tick), 1.0 if i == 0 else None)
        for i in range(claims)
    )  # fmt: skip
    prepared = tuple(  # claim i > 0 holds the MIG device of GPU instance i
        PreparedDevice(u.pool, u.device, u.gpu_index, u.namespace, u.claim, u.uid, i or None)
        for i, u in enumerate(usage)
    )
    return Snapshot(
        node="node-a", tick=tick, wall_time=1_700_000_000.0 + tick, monotonic=float(tick),
        interval_seconds=1.0, gpus=tuple(gpus), claims=usage, prepared=prepared,
        tick_duration_seconds=0.002, lag_seconds=0.0,
    )  # fmt: skip
