"""The bundled node models and GPU product table match the reference facts."""

from importlib import resources

import pytest
import yaml

from agent.sim.errors import ModelError
from agent.sim.model import all_model_names, load_model, model_names, parse_model, vm_model_names
from agent.sim.specs import gpu_specs, profile_name

MIB = 1024 * 1024


def test_bundled_models():
    assert model_names() == ["dgx-a100", "dgx-h100", "hgx-h200", "l40s-pcie", "mixed"]


@pytest.mark.parametrize("key", sorted(gpu_specs()), ids=str)
def test_profile_names_follow_the_slot_fraction_rule(key):
    spec = gpu_specs()[key]
    for p in spec.mig_profiles:
        assert p.name == profile_name(
            p.slice_count, p.memory_mib, spec.memory_mib, p.media_extensions
        )


def test_profile_tables_match_reference():
    a100 = gpu_specs()["A100-SXM4-40GB"]
    table = {p.name: (p.profile_id, p.memory_slots, p.placement_starts) for p in a100.mig_profiles}
    assert table == {
        "1g.5gb": (19, 1, (0, 1, 2, 3, 4, 5, 6)),
        "1g.5gb+me": (20, 1, (0, 1, 2, 3, 4, 5, 6)),
        "1g.10gb": (15, 2, (0, 2, 4, 6)),
        "2g.10gb": (14, 2, (0, 2, 4)),
        "3g.20gb": (9, 4, (0, 4)),
        "4g.20gb": (5, 4, (0,)),
        "7g.40gb": (0, 8, (0,)),
    }
    h100 = {
        p.name: (p.memory_mib, p.multiprocessors)
        for p in gpu_specs()["H100-SXM5-80GB"].mig_profiles
    }
    assert h100["1g.10gb"] == (9984, 16)
    assert h100["3g.40gb"] == (40448, 60)
    assert h100["7g.80gb"] == (81152, 132)
    assert gpu_specs()["H200-SXM5-141GB"].memory_mib == 143771
    assert not gpu_specs()["L40S"].mig_capable and not gpu_specs()["L4"].mig_capable


def test_dgx_h100_layout():
    m = load_model("dgx-h100")
    assert [g.bus[5:7] for g in m.gpus] == ["1b", "43", "52", "61", "9d", "c3", "d1", "df"]
    assert [g.numa for g in m.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert m.numa_nodes == {0: "0-55,112-167", 1: "56-111,168-223"}
    assert len(m.nics) == 12 and len(m.nvswitches) == 4
    assert {g.spec.key for g in m.gpus} == {"H100-SXM5-80GB"}
    assert [g.index for g in m.gpus] == list(range(8))
    assert len({g.uuid for g in m.gpus}) == 8


def test_dgx_a100_defaults_to_balanced_mig_and_others_to_none():
    assert load_model("dgx-a100").default_mig_layout == "balanced"
    for name in ("dgx-h100", "hgx-h200", "l40s-pcie", "mixed"):
        assert load_model(name).default_mig_layout == "none"


def test_uuids_are_stable_across_loads():
    assert load_model("mixed").gpus[0].uuid == load_model("mixed").gpus[0].uuid


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(ModelError, match="dgx-h100") as e:
        load_model("dgx-z900")
    assert "dgx-z900" in str(e.value)


def _doc(**over):
    raw = yaml.safe_load(resources.files("agent.sim").joinpath("models", "mixed.yaml").read_text())
    raw.update(over)
    return raw


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            {
                "gpus": [
                    {"bus": "0000:3d:00.0", "product": "X100", "numa": 0, "parent": "pci0000:3a"}
                ]
            },
            "unknown product",
        ),
        (
            {"gpus": [{"bus": "3d:00.0", "product": "L4", "numa": 0, "parent": "pci0000:3a"}]},
            "not a PCI address",
        ),
        (
            {"gpus": [{"bus": "0000:3d:00.0", "product": "L4", "numa": 7, "parent": "pci0000:3a"}]},
            "NUMA node 7",
        ),
        (
            {
                "gpus": [
                    {
                        "bus": "0000:3d:00.0",
                        "product": "L4",
                        "numa": 0,
                        "parent": "root/0000:3a:00.0",
                    }
                ]
            },
            "root complex",
        ),
        ({"nvlink": {"kind": "mesh"}}, "nvlink.kind"),
    ],
    ids=["product", "bus", "numa", "parent", "nvlink-kind"],
)
def test_bad_models_are_refused_with_the_reason(override, message):
    raw = _doc(**override)
    if "gpus" in override:
        raw["nvlink"] = {"kind": "none"}
    with pytest.raises(ModelError, match=message):
        parse_model(raw, "test.yaml")


def test_model_file_path(tmp_path):
    p = tmp_path / "tiny.yaml"
    p.write_text(yaml.safe_dump(_doc(name="tiny")))
    assert load_model(str(p)).name == "tiny"
    with pytest.raises(ModelError, match="cannot read"):
        load_model(str(tmp_path / "missing.yaml"))


def _gpu0(**over):
    return [{**_doc()["gpus"][0], **over}, *_doc()["gpus"][1:]]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"name": None}, "test.yaml: name: missing"),
        ({"gpus": "4x A100"}, 'test.yaml: gpus: expected a list, got a string: "4x A100"'),
        ({"gpus": _gpu0(product=None)}, "test.yaml: gpus[0].product: missing"),
        ({"gpus": _gpu0(bus=None)}, "test.yaml: gpus[0].bus: missing"),
        (
            {"gpus": _gpu0(numa="zero")},
            'test.yaml: gpus[0].numa: expected an integer, got a string: "zero"',
        ),
        (
            {"nics": [{"bus": "0000:3f:00.0", "numa": 0, "parent": "pci0000:3a"}]},
            "test.yaml: nics[0].name: missing",
        ),
        ({"nvlink": ["bridge"]}, 'test.yaml: nvlink: expected an object, got a list: ["bridge"]'),
        ({"numaNodes": None}, "test.yaml: numaNodes: missing"),
        ({"driverVersion": None}, "test.yaml: driverVersion: missing"),
    ],
    ids=["name", "gpus-list", "product", "bus", "numa", "nic-name", "nvlink", "numa-nodes",
         "driver-version"],
)  # fmt: skip
def test_a_malformed_model_is_reported_by_field(override, message):
    """The field's place, what is wrong and what is allowed: not ``KeyError('name')``."""
    with pytest.raises(ModelError) as e:
        parse_model(_doc(**override), "test.yaml")
    assert str(e.value).startswith(message), str(e.value)
    assert "KeyError" not in str(e.value) and "TypeError" not in str(e.value)


def test_a_malformed_model_file_is_reported_by_field(tmp_path):
    p = tmp_path / "tiny.yaml"
    p.write_text("description: no name\ngpus: []\n")
    with pytest.raises(ModelError) as e:
        load_model(str(p))
    assert str(e.value) == f"{p}: name: missing"


def test_the_hosts_for_vms_are_listed_apart_and_load():
    """vgpu-h200 and vgpu-t4 live in models/vm/: the tests that go over every container model
    (model_names) stay as they are; load_model and `tessera sim models` find them."""
    assert vm_model_names() == ["vgpu-h200", "vgpu-t4"]
    assert all_model_names() == [*model_names(), *vm_model_names()]
    h200, t4 = load_model("vgpu-h200"), load_model("vgpu-t4")
    assert (h200.vgpu_interface, t4.vgpu_interface) == ("vf", "mdev")
    assert [g.spec.key for g in h200.gpus] == ["H200-SXM5-141GB"] * 2
    assert [g.spec.key for g in t4.gpus] == ["T4"] * 2
    assert all(load_model(m).vgpu_interface is None for m in model_names())


def test_vgpu_types_follow_nvidias_tables():
    """Names and instance counts of NVIDIA's vGPU types reference (agent/sim/gpus.yaml)."""
    h200 = {t.name: (t.type_id, t.max_instances) for t in gpu_specs()["H200-SXM5-141GB"].vgpu_types}
    assert h200 == {
        "NVIDIA H200X-141C": (1428, 1),
        "NVIDIA H200X-70C": (1429, 2),
        "NVIDIA H200X-35C": (1430, 4),
        "NVIDIA H200X-17C": (1431, 8),
    }
    t4 = gpu_specs()["T4"]
    assert {t.name: t.max_instances for t in t4.vgpu_types}["GRID T4-2Q"] == 8
    assert {t.name: t.framebuffer_mib for t in t4.vgpu_types}["GRID T4-16Q"] == 15268
    h200 = gpu_specs()["H200-SXM5-141GB"]  # every type fits the GPU in full, read as 10^9 bytes
    assert all(t.max_instances * t.framebuffer_mib <= h200.memory_mib for t in h200.vgpu_types)


@pytest.mark.parametrize(
    ("vgpu", "product", "message"),
    [({"interface": "grid"}, "L4", "vgpu.interface"),
     ({"interface": "mdev"}, "L4", "product L4 has no vgpuTypes")],
)  # fmt: skip
def test_a_bad_vgpu_host_is_refused(vgpu, product, message):
    raw = _doc(vgpu=vgpu, nvlink={"kind": "none"})
    raw["gpus"] = [{"bus": "0000:3d:00.0", "product": product, "numa": 0, "parent": "pci0000:3a"}]
    with pytest.raises(ModelError, match=message):
        parse_model(raw, "test.yaml")
