"""The daemon: its composition root and the running agent's lifecycle.

- :mod:`~agent.daemon.compose`: ``build_agent``, the only place that constructs the object
  graph, in one pass, from a Config and what the CLI decided about the node (:class:`NodeAccess`:
  a real node or the simulator's; this package never imports the simulator);
- :mod:`~agent.daemon.budgets_compose`: ``build_budgets``, the budget controller's own root
  (``tessera budgets``; imported by that command only);
- :mod:`~agent.daemon.agent`: :class:`Agent`, ``start``/``stop``/``run``;
- :mod:`~agent.daemon.devices`: the node's devices, their publishing and health;
- :mod:`~agent.daemon.sampling`: telemetry (sampler, its state, its API server);
- :mod:`~agent.daemon.handover`: the state directory across agents (--rolling-update);
- :mod:`~agent.daemon.readiness`: the checks behind /readyz and /healthz;
- :mod:`~agent.daemon.paths`: the state directory and the kubelet and CDI directories;
- :mod:`~agent.daemon.wiring`: the parts built with more than a constructor call;
- :mod:`~agent.daemon.hub`: :class:`Relay`, a callback between parts built in either order.
"""

from agent.daemon.agent import Agent
from agent.daemon.compose import NodeAccess, build_agent
from agent.daemon.devices import CurrentDevices, NodeDevices
from agent.daemon.paths import (
    DEFAULT_STATE_DIR,
    AgentPaths,
    agent_paths,
    simulated_paths,
    take_state_dir,
)
from agent.daemon.wiring import cdi_hook, cdi_writer, crash_hook, sharing_effects

__all__ = [
    "DEFAULT_STATE_DIR",
    "Agent",
    "AgentPaths",
    "CurrentDevices",
    "NodeAccess",
    "NodeDevices",
    "agent_paths",
    "build_agent",
    "cdi_hook",
    "cdi_writer",
    "crash_hook",
    "sharing_effects",
    "simulated_paths",
    "take_state_dir",
]
