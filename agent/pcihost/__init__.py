"""The node's PCI functions as the kernel shows them in sysfs, for handing GPUs to virtual
machines: IOMMU groups, which driver a function is bound to (and changing it), SR-IOV virtual
functions and NVIDIA's vGPU host interfaces (per-VF vGPU types, mediated devices).

Facts and sources: docs/gpu-facts.md, "GPUs for virtual machines (VFIO and vGPU)". Reads go to
the sysfs tree (``/sys``, or the simulator's); writes go through a :class:`KernelWrite`, the one
call the simulator stands in for (its kernel acts on the write as Linux does)."""
