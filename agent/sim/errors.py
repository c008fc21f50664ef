"""Errors of the simulator (``agent.sim``)::

TesseraError
├── ModelError    a simulated node model that does not load or validate
└── MigError      a MIG layout or placement that the rules forbid
"""

from __future__ import annotations

from agent.errors import TesseraError


class ModelError(TesseraError):
    """A simulated node model file is missing or does not validate."""


class MigError(TesseraError):
    """A MIG operation that the placement rules forbid."""
