"""The root of Tessera's exceptions, and the errors every layer may raise.

Each layer owns its errors in its own ``errors`` module, all subclasses of :class:`TesseraError`
(docs/architecture.md draws the whole tree)::

    agent.errors             TesseraError, ConfigError          (every layer)
    agent.nvml.errors        DriverNotFoundError, NvmlError and its codes
    agent.discovery.errors   DiscoveryError
    agent.sim.errors         ModelError, MigError               (the simulator)
    dra_driver.errors        KubeError, ClaimError, ParamsError, CheckpointError, CdiError, ...

Errors from libraries (NVML, gRPC, the Kubernetes client, the file system) are translated at the
boundary with ``raise ... from exc`` so callers only ever handle these. ``temporary`` on an error
says whether retrying the same operation later may succeed.
"""

from __future__ import annotations


class TesseraError(Exception):
    """Base of every error Tessera raises on purpose."""

    temporary: bool = False


class ConfigError(TesseraError):
    """A configuration value is wrong.

    The message names the setting, the offending value and what is allowed.
    """
