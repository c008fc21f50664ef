"""``make gpu-check``: compare a node's real NVIDIA GPUs with the simulator's model of them
(:mod:`bench.gpu_check.check`; docs/troubleshooting.md, "make gpu-check")."""
