"""How prepared devices are partitioned and shared: each module applies one kind of side effect
and undoes it, idempotently, so a prepare that crashed half way can be rolled back and redone.

- ``tools``: running the node's NVIDIA tools (``nvidia-smi``, ``nvidia-cuda-mps-control``) with
  a deadline and validated arguments only;
- ``mig``: dynamic MIG, a GPU instance created at exactly the allocated placement;
- ``timeslice``: compute mode and time-slice interval of a whole GPU;
- ``mps``: MPS control daemons (per claim, or per GPU for memory shares);
- ``power_cap``: a whole GPU's power limit, for a claim that holds it alone (``powerLimit``).
"""
