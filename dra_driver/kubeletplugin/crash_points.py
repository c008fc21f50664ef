"""The points where a simulated crash can be injected (``--sim-crash-at``): the steps of the claim
transaction (:mod:`dra_driver.kubeletplugin.transaction`) and of its side effects
(:mod:`dra_driver.kubeletplugin.effects`), in the order a prepare and an unprepare reach them.

Its own module, with nothing imported, so that reading the settings does not load the plugin."""

from __future__ import annotations

CRASH_POINTS = (
    "after-started",
    "after-vfio-unbind",
    "after-vfio-bind",
    "after-vgpu-create",
    "after-gi-create",
    "after-ci-create",
    "after-compute-policy",
    "after-mps-start",
    "after-power-recorded",
    "after-power-limit",
    "after-cdi",
    "after-completed",
    "after-unprepare-vfio-unbind",
    "after-unprepare-undo",
    "after-unprepare-commit",
)
"""Where ``crash_hook`` is called: the steps of ``transaction`` and of the side effects."""
