"""``explain`` answers every input clearly (hypothesis): it fits, it does not fit with a reason,
or the input is malformed (``InputError``, naming the field); never a traceback.

Inputs (tests/dra_driver/explain_inputs.py): the slices the driver publishes for simulated
nodes of every kind (whole GPUs, static and dynamic MIG, memory shares, time-slicing, vGPU and
passthrough devices, the 1.34 counter layout), a subset of their devices, some tainted, some
held by another claim; claims of one to three requests with selectors over every attribute and
capacity those slices carry, counts, ``All``, ``firstAvailable``, constraints, capacity
requests, tolerations and admin access; and, in two cases of three, one field of the claim, a
class, a slice or the allocated claim replaced by a value of any JSON type, or removed.

The library facade runs 150 cases in `make test` (the `default` profile of tests/conftest.py);
`make reliability` runs the `reliability` profile (2,500). The CLI (``tessera explain``
in-process, on the same inputs written to files, now and then a file cut short or garbled) runs
a sixth as many: it adds only the reading of files.

Below them, each traceback the fuzzing found, as the malformed input it now is.
"""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from agent.cli import main
from dra_driver.advertise.slices import SlicePolicy, build_slices
from dra_driver.device_model import DevicePolicy, advertised_devices
from dra_driver.scheduler.celenv import CelEnvironment
from dra_driver.scheduler.domain import InputError
from dra_driver.scheduler.explanation import explain
from tests.dra_driver.allocator_helpers import DRIVER, claim, dev, exact, klass, rslice
from tests.dra_driver.conftest import Inventory
from tests.dra_driver.explain_inputs import Base, Case, Catalogue, Nodes, cases

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "daemonset"
CLASSES = list(yaml.safe_load_all((DEPLOY / "deviceclasses.yaml").read_text()))
NODES: tuple[tuple[str, dict[str, Any], str], ...] = (
    ("dgx-a100", {}, "1.35"),
    ("dgx-a100", {"mig_mode": "dynamic"}, "1.35"),
    ("dgx-h100", {"mig_mode": "dynamic"}, "1.34"),
    ("dgx-h100", {"sharing": "memory-shares"}, "1.35"),
    ("mixed", {"sharing": "time-slicing"}, "1.35"),
    ("l40s-pcie", {}, "1.35"),
    ("vgpu-h200", {"virtualization": "vgpu"}, "1.35"),
    ("hgx-h200", {"virtualization": "passthrough"}, "1.35"),
    ("hgx-h200", {"sharing": "memory-shares", "mig_mode": "dynamic"}, "1.35"),
)
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
"""How many cases: the profile's (tests/conftest.py: `default` 150, `reliability` 2500)."""
CLI = settings(FUZZ, max_examples=max(1, settings().max_examples // 6))
"""A sixth as many through the CLI (25 in `make test`): each writes and reads files."""


@pytest.fixture(scope="module")
def nodes(inventory: Inventory) -> Nodes:
    """The simulated nodes' slices, and what their devices publish."""
    out = []
    for model, policy, layout in NODES:
        devices = advertised_devices(inventory(model), DevicePolicy(**policy))
        out.append(
            Base(
                f"{model} {policy} layout {layout}",
                tuple(
                    build_slices(
                        devices,
                        SlicePolicy(driver_name="gpu.tessera.dev", node_name=model, layout=layout),
                        generation=1,
                    )
                ),
            )
        )
    return Nodes(tuple(out), Catalogue.of(out))


def _fake_clock() -> Callable[[], float]:
    """A clock that moves 10 ms a reading: the search's time limit becomes a bound on its
    steps, the same on every machine."""
    now = [0.0]

    def clock() -> float:
        now[0] += 0.01
        return now[0]

    return clock


def _draw(data: st.DataObject, nodes: Nodes) -> Case:
    base = data.draw(st.sampled_from(nodes.bases), label="node")
    return data.draw(cases(base, nodes.catalogue, CLASSES), label="case")


def _check_answer(case: Case) -> str:
    """Explain ``case``; the kind of clear answer it got, or the assertion that it was none."""
    try:
        exp = explain(
            case.claim,
            case.classes,
            case.slices,
            case.allocated,
            cel=CelEnvironment(),
            time_limit_s=5.0,
            clock=_fake_clock(),
        )
    except InputError as exc:
        # the field's path, then what is wrong with it (a CEL compile error goes on with the
        # expression and a caret under the fault, as cel-go's does)
        assert exc.message.strip(), f"an InputError without a message at {exc.path!r}"
        assert str(exc).startswith(f"{exc.path}: " if exc.path else exc.message), str(exc)
        return f"malformed {case.broken or 'generated (edge values)'} input"
    if exp.ok:
        exp.allocation()  # empty for a claim without requests, as upstream
        what = "fits"
    else:
        assert exp.first_reason().strip()
        what = "gave up" if exp.gave_up else "does not fit"
    assert exp.text().strip()
    json.dumps(exp.to_json())
    return what


@FUZZ
@given(data=st.data())
def test_explain_answers_fits_no_fit_or_malformed_input(nodes: Nodes, data: st.DataObject) -> None:
    case = _draw(data, nodes)
    event(_check_answer(case))


def _write(path: Path, docs: list[dict[str, Any]], garble: tuple[int, str] | None) -> Path:
    """``docs`` as YAML; ``garble``: cut at that fraction (per mille) of the text and followed
    by that text (a file cut short, or with bytes of something else in it)."""
    text = yaml.safe_dump_all(docs)
    if garble is not None:
        at, tail = garble
        text = text[: len(text) * at // 1000] + tail
    path.write_text(text)
    return path


@CLI
@given(data=st.data())
def test_the_cli_answers_fits_no_fit_or_a_clear_error(
    nodes: Nodes,
    data: st.DataObject,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    case = _draw(data, nodes)
    garbled = data.draw(
        st.sampled_from((None, None, None, "claim", "classes", "slices", "allocated")),
        label="garbled file",
    )
    garble = (
        data.draw(st.integers(0, 1000)),
        data.draw(st.sampled_from(("", "\n", ": x\n", "- [\n", "\t", "&a *a", "...\n---\n7\n"))),
    )

    def write(name: str, docs: list[dict[str, Any]]) -> str:
        return str(_write(folder / f"{name}.yaml", docs, garble if garbled == name else None))

    folder = tmp_path_factory.mktemp("case")  # a case's files are removed after it (RAM: tmproot)
    try:
        argv = ["explain", write("claim", [case.claim])]
        argv += [
            "--class",
            write("classes", case.classes),
            "--slices",
            write("slices", case.slices),
        ]
        argv += ["--time-limit", "2", "-o", "json"]
        if case.allocated:
            argv += ["--allocated", write("allocated", case.allocated)]
        out, err = io.StringIO(), io.StringIO()
        rc = main(argv, out=out, err=err)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if rc == 2:
        lines = err.getvalue().splitlines()
        assert lines and lines[0].startswith("tessera: error: "), err.getvalue()
        assert "Traceback" not in err.getvalue()
        event("malformed input")
        return
    assert rc in (0, 1), (rc, err.getvalue())
    answer = json.loads(out.getvalue())
    assert answer["fits"] is (rc == 0)
    event("fits" if rc == 0 else "does not fit")


# -- what the fuzzing found: each a traceback once, now an InputError naming field and value --


def _one_gpu() -> list[dict[str, Any]]:
    return [rslice([dev("gpu-0", attrs={"type": "gpu"})], name="s1")]


@pytest.mark.parametrize(
    ("value", "field", "message"),
    [
        # the API's DeviceAttribute (k8s.io/api resource/v1 types.go): StringValue *string,
        # IntValue *int64, BoolValue *bool, VersionValue *string; the apiserver refuses any other
        ({"string": ["a", "b"]}, "string", 'expected a string, got a list: ["a", "b"]'),
        ({"version": {"major": 1}}, "version", 'expected a string, got an object: {"major": 1}'),
        ({"int": "3"}, "int", 'expected an integer, got a string: "3"'),
        ({"int": True}, "int", "expected an integer, got a boolean: true"),
        ({"int": 2**63}, "int", f"must be <= {2**63 - 1}, got {2**63}"),
        ({"bool": "true"}, "bool", 'expected true or false, got a string: "true"'),
    ],
)
def test_an_attribute_value_of_the_wrong_type_is_malformed_input(
    value: dict[str, Any], field: str, message: str
) -> None:
    slices = _one_gpu()
    slices[0]["spec"]["devices"][0]["attributes"]["type"] = value
    c = claim(exact("g", selectors=(f'device.attributes["{DRIVER}"].type == "gpu"',)))
    with pytest.raises(InputError) as err:
        explain(c, [klass("gpu", "true")], slices, [], cel=CelEnvironment())
    assert err.value.path == f"ResourceSlice s1.spec.devices[0].attributes.type.{field}"
    assert err.value.message == message


@pytest.mark.parametrize(
    "expression",
    [
        "true" + " && true" * 1200,
        "true" + " || false" * 400,
        "1" + " + 1" * 1000 + " > 0",
        "!" * 500 + "true",
        "-" * 500 + "1 > 0",
    ],
    ids=["and-chain", "or-chain", "sum", "nots", "negations"],
)
def test_a_selector_nested_too_deeply_to_analyse_is_malformed_input(expression: str) -> None:
    c = claim(exact("g", selectors=(expression,)))
    with pytest.raises(InputError) as err:
        explain(c, [klass("gpu", "true")], _one_gpu(), [], cel=CelEnvironment())
    assert err.value.path == "spec.devices.requests[0].exactly.selectors[0].cel.expression"
    assert "nested too deeply" in err.value.message


@pytest.mark.parametrize(
    ("result", "field", "message"),
    [
        # lookalike's grouping of nodes read the result's driver before explain checked it:
        # TypeError: unhashable type: 'list'
        ({"driver": []}, "driver", "expected a non-empty string, got a list: []"),
        # named the claim being explained, not the allocated claim's file
        (
            {"shareID": "s-1", "consumedCapacity": {"memory": "lots"}},
            "consumedCapacity.memory",
            "lots",
        ),
    ],
    ids=["driver-a-list", "bad-consumed-capacity"],
)
def test_a_malformed_allocated_claim_file_is_named_with_its_field(
    tmp_path: Path, result: dict[str, Any], field: str, message: str
) -> None:
    held = {"request": "g", "driver": DRIVER, "pool": "node-a", "device": "gpu-0", **result}
    other = {
        **claim(exact("g")),
        "metadata": {"name": "other", "namespace": "default"},
        "status": {"allocation": {"devices": {"results": [held]}}},
    }
    argv = ["explain", str(_write(tmp_path / "claim.yaml", [claim(exact("g"))], None))]
    argv += ["--class", str(_write(tmp_path / "classes.yaml", [klass("gpu", "true")], None))]
    argv += ["--slices", str(_write(tmp_path / "slices.yaml", _one_gpu(), None))]
    argv += ["--allocated", str(_write(tmp_path / "allocated.yaml", [other], None))]
    out, err = io.StringIO(), io.StringIO()
    assert main(argv, out=out, err=err) == 2
    where = f"{tmp_path / 'allocated.yaml'}: document 0: status.allocation.devices.results[0]"
    assert err.getvalue().startswith(f"tessera: error: {where}.{field}: "), err.getvalue()
    assert message in err.getvalue()


def test_a_counter_slice_beside_a_slice_with_a_list_for_its_driver_is_malformed_input(
    tmp_path: Path,
) -> None:
    """The node's slices were grouped by (driver, pool) in a set before any field was checked:
    a list for a slice's driver, next to a counter slice (the 1.35 layout), ended in
    ``TypeError: unhashable type: 'list'`` (node_reach.node_slices)."""
    devices = _one_gpu()[0]
    devices["spec"]["driver"] = ["not", "a", "name"]
    counters = rslice([], name="c1", counters={"set": {"c": 1}})
    argv = ["explain", str(_write(tmp_path / "claim.yaml", [claim(exact("g"))], None))]
    argv += ["--class", str(_write(tmp_path / "classes.yaml", [klass("gpu", "true")], None))]
    argv += ["--slices", str(_write(tmp_path / "slices.yaml", [devices, counters], None))]
    out, err = io.StringIO(), io.StringIO()
    assert main(argv, out=out, err=err) == 2, out.getvalue()
    assert err.getvalue().startswith("tessera: error: "), err.getvalue()
    assert "spec.driver" in err.getvalue() and "Traceback" not in err.getvalue()
