"""`tessera discover`, `topo` and `sim` as a user runs them."""

import io
import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from agent.cli import main
from agent.sim.model import all_model_names, model_names
from tests.hardware import needs_no_driver
from tests.k8sschema import validate as validate_k8s

LEVEL = re.compile(r"^(X|NV\d+|PIX|PXB|PHB|NODE|SYS)$")


def run(argv, environ=None):
    out, err = io.StringIO(), io.StringIO()
    code = main(argv, environ if environ is not None else {}, out, err)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("model", model_names())
def test_discover_json_shape(model):
    code, out, err = run(["discover", "--simulate", model, "-o", "json"])
    assert code == 0, err
    data = json.loads(out)
    assert data["gpus"], "no GPUs discovered"
    for g in data["gpus"]:
        for key in (
            "index", "minor", "uuid", "productName", "architecture", "memoryBytes", "pciBusID",
            "numaNode", "cpus", "pcieRoot", "nvlinkClique", "migCapable", "migEnabled",
        ):  # fmt: skip
            assert key in g, key
        assert re.match(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$", g["pciBusID"])
        assert re.match(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$", g["pcieRoot"])
        assert re.match(r"^\d+(-\d+)?(,\d+(-\d+)?)*$", g["cpus"])
        assert g["memoryBytes"] > 0
    assert isinstance(data["nics"], list)
    matrix = data["topology"]["matrix"]
    idx = [str(g["index"]) for g in data["gpus"]]
    assert sorted(matrix) == sorted(idx)
    for a in idx:
        assert matrix[a][a] == "X"
        for b in idx:
            assert LEVEL.match(matrix[a][b])
            assert matrix[a][b] == matrix[b][a]


def test_dgx_a100_reports_its_mig_devices():
    data = json.loads(run(["discover", "--simulate", "dgx-a100", "-o", "json"])[1])
    for g in data["gpus"]:
        assert g["migCapable"] and g["migEnabled"]
        assert sorted(m["profile"] for m in g["migDevices"]) == [
            "1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb",
        ]  # fmt: skip


def test_yaml_equals_json():
    j = json.loads(run(["discover", "--simulate", "mixed", "-o", "json"])[1])
    y = yaml.safe_load(run(["discover", "--simulate", "mixed", "-o", "yaml"])[1])
    assert j == y


def test_table_output_names_gpus_and_nics():
    code, out, _ = run(["discover", "--simulate", "l40s-pcie"])
    assert code == 0
    assert "NVIDIA L40S" in out and "mlx5_0" in out and "4 GPUs" in out


def test_table_shows_bus_ids_as_they_are_not_as_emoji():
    """rich would turn ``:cd:`` into an emoji (0000💿00.0): data is printed without markup."""
    code, out, _ = run(["discover", "--simulate", "l40s-pcie"])
    assert code == 0
    assert "0000:cd:00.0" in out and "0000:ce:00.0" in out
    assert "💿" not in out and not any(ord(c) > 0x1F000 for c in out)


def test_topo_matrix_and_dot():
    code, out, _ = run(["topo", "--simulate", "mixed"])
    assert code == 0
    assert out.splitlines()[0].split("\t")[1:3] == ["GPU0", "GPU1"]
    assert "Legend:" in out and "NV12" in out
    code, dot, _ = run(["topo", "--simulate", "mixed", "--format", "dot"])
    assert code == 0 and dot.lstrip().startswith("graph") and dot.count("{") == dot.count("}")


def test_sim_models_lists_every_model_with_a_description():
    code, out, _ = run(["sim", "models"])
    lines = out.splitlines()
    assert code == 0 and [line.split()[0] for line in lines] == all_model_names()
    assert all(len(line.split(None, 1)) == 2 for line in lines)
    assert all_model_names()[-2:] == ["vgpu-h200", "vgpu-t4"]  # the hosts for VMs, listed too


def test_simulate_from_environment():
    code, out, _ = run(["discover", "-o", "json"], {"TESSERA_SIMULATE": "mixed"})
    assert code == 0 and len(json.loads(out)["gpus"]) == 4


def test_state_dir_keeps_simulated_mig_state_between_commands(tmp_path):
    args = ["discover", "--simulate", "dgx-h100", "--state-dir", str(tmp_path), "-o", "json"]
    first = json.loads(run([*args, "--sim-mig-layout", "all-1g"])[1])
    assert [len(g["migDevices"]) for g in first["gpus"]] == [7] * 8
    again = json.loads(run(args)[1])  # no layout given: the GPUs keep their state
    assert [m["uuid"] for m in again["gpus"][0]["migDevices"]] == [
        m["uuid"] for m in first["gpus"][0]["migDevices"]
    ]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["discover", "--simulate", "dgx-z900"], "unknown simulated node model 'dgx-z900'"),
        (["discover", "--simulate", "dgx-h100", "--sim-mig-layout", "half"], "'half'"),
        (["topo", "--simulate", "l40s-pcie", "--sysfs-root", "/nonexistent"], "/nonexistent"),
    ],
    ids=["unknown-model", "unknown-layout", "missing-sysfs"],
)
def test_bad_input_is_one_line_and_exit_2(argv, needle):
    code, out, err = run(argv)
    assert code == 2 and out == ""
    assert needle in err and err.count("\n") == 1, err


@needs_no_driver
@pytest.mark.parametrize("command", ["discover", "topo"])
def test_no_driver_without_simulate(command):
    code, _, err = run([command])
    assert code == 2
    assert "no NVIDIA driver found" in err and "--simulate" in err
    assert err.count("\n") == 1


@needs_no_driver
def test_no_driver_run_says_so_without_traceback(tmp_path):
    """The installed console script, in a real process, on this driverless machine."""
    tessera = os.path.join(os.path.dirname(sys.executable), "tessera")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    p = subprocess.run(
        [tessera, "run", "--state-dir", str(tmp_path), "--metrics-address", "127.0.0.1:0"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    last = json.loads(p.stderr.strip().splitlines()[-1])  # the daemon logs JSON to the end
    assert last["msg"] == "agent cannot run"
    assert last["error"].startswith("no NVIDIA driver found") and "--simulate" in last["error"]


@pytest.mark.parametrize("layout", ["1.35", "1.34"])
def test_slices_prints_valid_resourceslices(layout):

    code, out, err = run(
        ["slices", "--simulate", "dgx-a100", "--mig-mode", "dynamic", "--kube-layout", layout]
    )
    assert code == 0, err
    docs = list(yaml.safe_load_all(out))
    assert len(docs) == docs[0]["spec"]["pool"]["resourceSliceCount"] > 1
    for d in docs:
        for v in ("1.34.0", "1.35.0"):
            validate_k8s(d, v)
    names = [dev["name"] for d in docs for dev in d["spec"].get("devices", [])]
    # an A100 in MIG mode offers its placements, not itself (leaving MIG needs a GPU reset)
    assert "gpu-0" not in names and "gpu-0-mig-3g20gb-9-4" in names


def test_slices_json_static_mig_and_node_name_from_env():
    code, out, _ = run(["slices", "--simulate", "dgx-a100", "-o", "json"], {"NODE_NAME": "gpu-7"})
    assert code == 0
    (s,) = json.loads(out)
    assert s["spec"]["nodeName"] == "gpu-7" and s["spec"]["pool"]["name"] == "gpu-7"
    assert len(s["spec"]["devices"]) == 32  # 8 GPUs x 4 MIG devices, no whole GPUs
    assert {d["attributes"]["type"]["string"] for d in s["spec"]["devices"]} == {"mig"}


def test_slices_driver_name_flag():
    code, out, _ = run(["slices", "--simulate", "l40s-pcie", "--driver-name", "gpu.example.com"])
    assert code == 0 and yaml.safe_load(out)["spec"]["driver"] == "gpu.example.com"


def test_command_options_come_from_tessera_variables_too(tmp_path):
    code, out, _ = run(["discover", "--simulate", "mixed"], {"TESSERA_OUTPUT": "json"})
    assert code == 0 and json.loads(out)["hostname"] == "mixed"
    code, out, _ = run(  # a flag still wins over the variable
        ["discover", "--simulate", "mixed", "-o", "yaml"], {"TESSERA_OUTPUT": "json"}
    )
    assert code == 0 and yaml.safe_load(out)["hostname"] == "mixed" and not out.startswith("{")
    code, out, _ = run(["topo", "--simulate", "mixed"], {"TESSERA_FORMAT": "dot"})
    assert code == 0 and out.lstrip().startswith("graph")


def test_a_bad_option_variable_fails_only_the_command_that_uses_it():
    env = {"TESSERA_OUTPUT": "table"}  # fine for discover, not for slices
    assert run(["discover", "--simulate", "mixed"], env)[0] == 0
    code, out, err = run(["slices", "--simulate", "mixed"], env)
    assert code == 2 and out == ""
    assert err == "tessera: configuration error: TESSERA_OUTPUT='table' is not one of yaml, json\n"


def test_required_option_from_the_environment(tmp_path):
    code, _, err = run(["kubelet", "info"], {"TESSERA_SOCKET": str(tmp_path / "none.sock")})
    assert code == 2 and "none.sock" in err  # the socket came from the variable


def test_a_closed_pipe_is_not_a_traceback():
    """`tessera slices ... | head -1`: the reader leaves early; no traceback, exit 141."""
    tessera = os.path.join(os.path.dirname(sys.executable), "tessera")
    p = subprocess.Popen(
        [tessera, "slices", "--simulate", "dgx-a100", "--mig-mode", "dynamic", "-o", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={"PATH": os.environ["PATH"]},
    )  # fmt: skip
    assert p.stdout is not None and p.stderr is not None
    assert p.stdout.readline().strip() == b"["
    p.stdout.close()  # more than a pipe buffer is still to come
    err = p.stderr.read().decode()
    p.stderr.close()
    assert p.wait(timeout=60) == 141
    assert "Traceback" not in err


@pytest.mark.parametrize("where", ["state-dir", "endpoint"])
def test_top_without_an_agent_says_so_and_how_to_point_at_one(tmp_path, where):
    argv = ["top", "--once"]
    argv += (
        ["--state-dir", str(tmp_path)] if where == "state-dir" else ["--endpoint", "127.0.0.1:1"]
    )
    code, out, err = run(argv)
    assert (code, out) == (2, "")
    target = f"unix://{tmp_path}/telemetry.sock" if where == "state-dir" else "127.0.0.1:1"
    assert err.startswith(f"tessera: error: no Tessera agent answers at {target};"), err
    assert "--state-dir DIR" in err and "--endpoint" in err and err.count("\n") == 1
    assert "UNAVAILABLE" not in err and "failed to connect" not in err
