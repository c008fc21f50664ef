"""GPUs for virtual machines: a whole GPU handed to a VM through VFIO (passthrough) and NVIDIA
vGPUs, made at prepare and undone at unprepare, with the same crash safety as dynamic MIG
(docs/virtualization.md)."""
