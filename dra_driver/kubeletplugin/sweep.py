"""The start's sweep of what no claim owns: dynamic MIG instances and MPS daemons (the steps of
:meth:`dra_driver.kubeletplugin.effects.Effects.sweep`; a VM's GPUs and vGPUs are
:meth:`dra_driver.kubeletplugin.vm_steps.VmSteps.sweep`'s)."""

from __future__ import annotations

import logging

from agent.logs import fields_
from dra_driver.errors import SharingError
from dra_driver.kubeletplugin.checkpoint import Checkpoint
from dra_driver.sharing.dynamic_mig import DynamicMig
from dra_driver.sharing.mps import MpsControl


def sweep_mig(mig: DynamicMig, gpus: dict[str, int], cp: Checkpoint, log: logging.Logger) -> None:
    """Destroy the dynamic MIG instances of GPUs ``gpus`` (UUID -> NVML index) that no claim of
    ``cp`` owns; one that cannot be is logged (its placement stays taken)."""
    owned: dict[str, set[tuple[int, int]]] = {}
    for entry in cp.claims.values():
        for d in entry.devices:
            if d.placement is not None:
                owned.setdefault(d.gpu_uuid, set()).add((d.placement[0], d.placement[1]))
    for uuid, index in sorted(gpus.items(), key=lambda kv: kv[1]):
        for gi, profile, start in mig.strays(index, owned.get(uuid, set())):
            try:
                mig.release(f"gpu {index} instance {gi}", index, profile, start)
            except SharingError as exc:  # in use by a process outside Kubernetes?
                log.error(
                    "cannot destroy a MIG instance no claim owns; its placement stays"
                    " taken until it is destroyed",
                    extra=fields_(gpu=index, profile=profile, placement_start=start,
                                  error=str(exc)),
                )  # fmt: skip
                continue
            log.warning(
                "destroyed a MIG instance no claim owns",
                extra=fields_(gpu=index, profile=profile, placement_start=start),
            )


def sweep_mps(mps: MpsControl, cp: Checkpoint, log: logging.Logger) -> None:
    """Stop and remove the MPS daemons (by directory) no claim of ``cp`` owns."""
    for key in sorted(mps.keys_on_disk() - set(cp.claims)):
        daemon = mps.found(key)
        if daemon is not None:
            mps.stop(daemon)
        mps.remove(key)
        log.warning(
            "removed an MPS daemon no claim owns",
            extra=fields_(claim_uid=key, was_running=daemon is not None),
        )
