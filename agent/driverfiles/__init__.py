"""The NVIDIA driver's files as a node has them: the loader's cache (:mod:`.ldcache`) and the
libraries, binaries, firmware and sockets of a driver root (:mod:`.discover`).

A primitive: it reads files and imports nothing of Tessera's but ``agent.errors``. The NVML layer
uses it to load ``libnvidia-ml.so.1`` from the driver root, the CDI writer to mount the driver
into containers, the simulator to write driver roots that look like real ones.
"""
