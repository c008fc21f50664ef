"""``python -m bench.gpu_check``: see :mod:`bench.gpu_check.check`."""

from __future__ import annotations

from bench.gpu_check.check import main

if __name__ == "__main__":
    raise SystemExit(main())
