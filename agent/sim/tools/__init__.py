"""Stand-ins for NVIDIA's GPU-sharing tools, acting on a simulated node.

The simulated driver root (:mod:`agent.sim.driverroot`) installs ``usr/bin/nvidia-smi`` and
``usr/bin/nvidia-cuda-mps-control`` there: small Python scripts (:mod:`agent.sim.tools.install`)
with the simulator's state directory and node model baked in, which call

* :mod:`agent.sim.tools.nvidia_smi`: compute mode (``-c``), ``--query-gpu``, and
  ``compute-policy`` (time-slice);
* :mod:`agent.sim.tools.mps_control`: the MPS control daemon (``-d``, ``-f``) and its client
  (commands on standard input), with the daemon in :mod:`agent.sim.tools.mps_daemon` and its
  command language in :mod:`agent.sim.tools.mps_commands`.

They act on the same shared state as every other simulator process (:mod:`agent.sim.sharing`,
through :class:`agent.sim.nvml.FakeNvml`, opened by :mod:`agent.sim.tools.simulator`), so the
driver runs the real commands against the simulated node. The MPS client loads only
:mod:`agent.sim.tools.common` and :mod:`agent.sim.tools.mps_paths`, so it starts fast; device
names (``-i``, ``CUDA_VISIBLE_DEVICES``) are resolved in :mod:`agent.sim.tools.targets`.
docs/gpu-facts.md ("Sharing tools") lists the upstream behaviour they follow.
The scripts are the entry points: they pass the environment in, nothing here reads it.
"""
