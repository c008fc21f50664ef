"""NVML is loaded from the driver root: the exact file, in the real pynvml, before nvmlInit.

A real shared library (this machine's libc, copied) stands in for libnvidia-ml.so.1: it loads
like NVML and proves which file was chosen; it is not NVML, so nvmlInit then fails naming a
missing function, never "library not found". Each case runs in a fresh interpreter, since
pynvml keeps the loaded library for the life of the process. Machines with and without a GPU
behave the same: the driver root given is the test's own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent.driverfiles.ldcache import CacheEntry, build
from agent.nvml.loader import load_nvml

VERSION = "550.90.07"
LIB_DIR = "usr/lib/x86_64-linux-gnu"


def real_shared_library() -> Path:
    """A shared library this Python has loaded (libc), by its path."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if "/libc.so" in path or "/libc-" in path:
            return Path(path)
    pytest.skip("no libc mapped in this process")


def driver_root(tmp_path: Path, *, cache: bool) -> Path:
    """A driver root whose libnvidia-ml.so.1 is a copy of libc (listed in its ld cache when
    ``cache``, else found in the standard directory)."""
    root = tmp_path / "driver-root"
    libs = root / LIB_DIR
    libs.mkdir(parents=True)
    shutil.copyfile(real_shared_library(), libs / f"libnvidia-ml.so.{VERSION}")
    (libs / "libnvidia-ml.so.1").symlink_to(f"libnvidia-ml.so.{VERSION}")
    if cache:
        (root / "lib").symlink_to("usr/lib")
        (root / "etc").mkdir()
        entry = CacheEntry("libnvidia-ml.so.1", "/lib/x86_64-linux-gnu/libnvidia-ml.so.1")
        (root / "etc/ld.so.cache").write_bytes(build([entry]))
    return root


PROBE = """
import json, sys
from pathlib import Path
import pynvml
from agent.node import real_node
from agent.nvml.errors import DriverNotFoundError, NvmlError

src = real_node(node_name="n", sysfs_root=None, driver_root=Path(sys.argv[1]))
lib = src.nvml_library
handle = getattr(pynvml.nvmlLib, "_name", None)
maps = Path("/proc/self/maps").read_text()
try:
    src.nvml.init()
    init = "ok"
except DriverNotFoundError:
    init = "driver not found"
except NvmlError as exc:
    init = f"code {exc.code}"
print(json.dumps({"path": lib.path, "reason": lib.reason, "handle": handle,
                  "mapped": sys.argv[1] in maps, "init": init}))
"""


def probe(root: Path) -> dict[str, object]:
    env = dict(os.environ, LD_LIBRARY_PATH="")
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(root)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=Path(__file__).parents[2],
    )
    result: dict[str, object] = json.loads(out.stdout)
    return result


@pytest.mark.parametrize("cache", [True, False], ids=["ld-cache", "standard-dir"])
def test_the_driver_roots_file_is_loaded_before_init(tmp_path: Path, cache: bool) -> None:
    root = driver_root(tmp_path, cache=cache)
    got = probe(root)
    expected = str(root / LIB_DIR / f"libnvidia-ml.so.{VERSION}")
    assert got["path"] == expected and got["handle"] == expected
    assert got["mapped"] is True  # that very file is in the process
    assert str(root) in str(got["reason"])
    assert got["init"] == "code 13"  # FUNCTION_NOT_FOUND: it loaded, and it is not NVML


def test_no_file_under_the_driver_root_leaves_it_to_the_system_loader(tmp_path: Path) -> None:
    got = probe(tmp_path)
    assert got["path"] is None and got["mapped"] is False
    assert got["reason"] == f"no libnvidia-ml.so.1 under the driver root {tmp_path}"
    # pynvml's own CDLL("libnvidia-ml.so.1"): the machine's driver if it has one
    assert got["init"] in ("ok", "driver not found")


def test_a_file_that_does_not_load_is_reported_and_skipped(tmp_path: Path) -> None:
    libs = tmp_path / LIB_DIR
    libs.mkdir(parents=True)
    (libs / "libnvidia-ml.so.1").write_text("not a shared library\n")
    got = probe(tmp_path)
    assert got["path"] is None
    assert "does not load" in str(got["reason"]) and "libnvidia-ml.so.1" in str(got["reason"])
    assert got["init"] in ("ok", "driver not found")


def test_a_library_already_loaded_is_kept(tmp_path: Path) -> None:
    root = driver_root(tmp_path, cache=False)
    loaded = SimpleNamespace(_name="/opt/other/libnvidia-ml.so.1")
    module = SimpleNamespace(nvmlLib=loaded, libLoadLock=threading.Lock())
    lib = load_nvml(module, root)  # type: ignore[arg-type]
    assert module.nvmlLib is loaded
    assert lib.path == "/opt/other/libnvidia-ml.so.1" and "already loaded" in lib.reason
