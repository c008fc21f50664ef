"""`tessera explain` in standalone mode: real files in, exit codes 0/1/2, text and JSON out,
Pods with their templates, --write and then a prepare by the real agent."""

import io
import json
from pathlib import Path

import pytest
import yaml

from agent.cli import main
from tests.integration.daemon import DRIVER

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "daemonset" / "examples"
CLASSES = ROOT / "deploy" / "daemonset" / "deviceclasses.yaml"


def explain(*argv, env=None):
    out, err = io.StringIO(), io.StringIO()
    code = main(["explain", *map(str, argv)], env or {}, out, err)
    return code, out.getvalue(), err.getvalue()


def as_json(*argv):
    code, out, err = explain(*argv, "-o", "json")
    assert code in (0, 1), err
    return code, json.loads(out)


def write(path: Path, *docs) -> Path:
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


def claim(name, *requests, uid=None):
    meta = {"name": name, "namespace": "default"} | ({"uid": uid} if uid else {})
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": meta,
        "spec": {"devices": {"requests": list(requests)}},
    }


def gpus(name, count=1, cls=DRIVER):
    return {"name": name, "exactly": {"deviceClassName": cls, "count": count}}


def template(name, *requests):
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"spec": {"devices": {"requests": list(requests)}}},
    }


def pod(name, **claims):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "resourceClaims": [
                {"name": k, ("resourceClaimTemplateName" if t else "resourceClaimName"): v}
                for k, (v, t) in claims.items()
            ],
            "containers": [{"name": "c", "image": "busybox"}],
        },
    }


def results(allocation):
    return [(r["request"], r["pool"], r["device"]) for r in allocation["devices"]["results"]]


# -- fits / does not fit ----------------------------------------------------------------------


def test_a_gpu_claim_fits_on_a_simulated_node_with_the_node_it_is_tied_to():
    code, answer = as_json(
        EXAMPLES / "single-gpu.yaml", "--class", CLASSES, "--simulate", "l40s-pcie"
    )
    assert code == 0
    assert answer["fits"] is True and answer["fittingNodes"] == ["l40s-pcie"]
    (node,) = answer["nodes"]
    (c,) = node["claims"]
    assert c["claim"] == "default/single-gpu-gpu" and c["fits"]
    [(request, pool, device)] = results(c["allocation"])
    assert (request, pool) == ("gpu", "l40s-pcie") and device.startswith("gpu-")
    # what the scheduler writes for a node-local slice (allocator_stable.go createNodeSelector)
    assert c["allocation"]["nodeSelector"] == {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["l40s-pcie"]}]}
        ]
    }


def test_the_text_answer_says_fits_and_names_the_node():
    code, out, _ = explain(
        EXAMPLES / "single-gpu.yaml", "--class", CLASSES, "--simulate", "l40s-pcie"
    )
    assert code == 0
    assert out.splitlines()[0] == "claim default/single-gpu-gpu on node l40s-pcie: fits"


def test_more_gpus_than_the_node_has_exit_1_with_a_reason(tmp_path):
    f = write(tmp_path / "c.yaml", claim("eight", gpus("gpus", 8)))
    code, out, _ = explain(f, "--class", CLASSES, "--simulate", "l40s-pcie")
    assert code == 1
    assert out.splitlines()[0] == "claim default/eight on node l40s-pcie: does not fit"
    code, answer = as_json(f, "--class", CLASSES, "--simulate", "l40s-pcie")
    assert code == 1 and answer["fits"] is False and answer["fittingNodes"] == []
    (node,) = answer["nodes"]
    assert node["reason"] and node["claims"][0]["allocation"] is None


@pytest.mark.parametrize(
    ("example", "fits", "other"),
    [
        ("memory-share-8gi.yaml", "memory-shares", "time-slicing"),
        ("time-slicing.yaml", "time-slicing", "memory-shares"),
        ("time-slicing-shared.yaml", "time-slicing", "memory-shares"),
    ],
)
def test_a_sharing_example_fits_only_nodes_of_its_sharing_mode(example, fits, other):
    """The node's --sharing reaches the slices as the `sharing` attribute, which the example's
    class or selector reads: it fits its mode and, elsewhere, says what it saw."""
    args = [EXAMPLES / example, "--class", CLASSES, "--simulate", "dgx-h100"]
    code, out, err = explain(*args, "--sharing", fits)
    assert code == 0, out + err
    code, out, err = explain(*args, "--sharing", other)
    assert code == 1, out + err
    assert f'device.attributes["gpu.tessera.dev"].sharing="{other}"' in out


def test_allocated_claims_take_their_devices(tmp_path):
    out = io.StringIO()
    assert main(["slices", "--simulate", "l40s-pcie"], {}, out, io.StringIO()) == 0
    slices = tmp_path / "slices.yaml"
    slices.write_text(out.getvalue())
    four = claim("four", gpus("gpus", 4), uid="u-4")
    code, answer = as_json(
        write(tmp_path / "four.yaml", four), "--class", CLASSES, "--slices", slices
    )
    assert code == 0
    four["status"] = {"allocation": answer["nodes"][0]["claims"][0]["allocation"]}
    (tmp_path / "held").mkdir()
    write(tmp_path / "held" / "four.yaml", four)
    args = (EXAMPLES / "single-gpu.yaml", "--class", CLASSES, "--slices", slices)
    code, answer = as_json(*args, "--allocated", tmp_path / "held")
    assert code == 1  # claim default/four holds every GPU
    code, answer = as_json(*args)
    assert code == 0


def test_slices_as_tessera_slices_json_prints_them(tmp_path):
    """`tessera slices -o json` prints a JSON list of slices: taken as a stream of documents."""
    out = io.StringIO()
    assert main(["slices", "--simulate", "l40s-pcie", "-o", "json"], {}, out, io.StringIO()) == 0
    (tmp_path / "slices.json").write_text(out.getvalue())
    code, answer = as_json(
        EXAMPLES / "single-gpu.yaml", "--class", CLASSES, "--slices", tmp_path / "slices.json"
    )
    assert code == 0 and answer["fittingNodes"] == ["l40s-pcie"]


# -- Pods and templates -------------------------------------------------------------------------


def test_a_pods_claims_are_placed_together_on_one_node(tmp_path):
    f = write(
        tmp_path / "pod.yaml",
        template("two-gpus", gpus("gpus", 2)),
        pod("trainer", a=("two-gpus", True), b=("two-gpus", True)),
    )
    code, answer = as_json(f, "--class", CLASSES, "--simulate", "l40s-pcie")
    assert code == 0
    assert [c["claim"] for c in answer["claims"]] == ["default/trainer-a", "default/trainer-b"]
    assert "pod default/trainer, claim a from template two-gpus" in answer["claims"][0]["via"]
    devices = [d for c in answer["nodes"][0]["claims"] for _, _, d in results(c["allocation"])]
    assert len(devices) == 4 and len(set(devices)) == 4  # the second claim got the other two
    f = write(
        tmp_path / "pod3.yaml",
        template("two-gpus", gpus("gpus", 2)),
        pod("greedy", a=("two-gpus", True), b=("two-gpus", True), c=("two-gpus", True)),
    )
    code, answer = as_json(f, "--class", CLASSES, "--simulate", "l40s-pcie")
    assert code == 1
    assert answer["nodes"][0]["reason"].startswith("default/greedy-c: ")


def test_pods_sharing_a_claim_explain_it_once():
    code, answer = as_json(
        EXAMPLES / "time-slicing.yaml", "--class", CLASSES, "--simulate", "dgx-h100"
    )
    assert code == 0
    assert [c["claim"] for c in answer["claims"]] == ["default/shared-gpu"]


def test_a_deployments_pod_template_counts_as_a_pod():
    _, answer = as_json(
        EXAMPLES / "memory-share-8gi.yaml", "--class", CLASSES, "--simulate", "dgx-h100",
        "--sharing", "memory-shares",
    )  # fmt: skip
    assert [c["claim"] for c in answer["claims"]] == ["default/small-models-gpu"]


def test_classes_in_the_claim_file_are_used(tmp_path):
    code, answer = as_json(EXAMPLES / "time-slicing-shared.yaml", "--simulate", "dgx-h100")
    assert code in (0, 1)
    assert answer["claims"][0]["claim"] == "default/batch-inference-gpu"


# -- malformed input: exit 2 with file, document and field ------------------------------------


@pytest.mark.parametrize(
    ("docs", "expected"),
    [
        ("a: [1, 2\n", "c.yaml: not valid YAML"),
        ("kind: ResourceClaim\n", "c.yaml: document 0: apiVersion: None is not supported"),
        (
            "---\nkind: ConfigMap\napiVersion: v1\n---\napiVersion: resource.k8s.io/v1\n"
            "kind: ResourceClaim\nmetadata: {name: x}\n",
            "c.yaml: document 1: spec: missing",
        ),
        (
            "apiVersion: resource.k8s.io/v1beta1\nkind: ResourceClaim\nmetadata: {name: x}\n"
            "spec: {}\n",
            "c.yaml: document 0: apiVersion: 'resource.k8s.io/v1beta1' is not supported",
        ),
        (
            "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  resourceClaims:\n"
            "  - {name: gpu, resourceClaimTemplateName: nowhere}\n  containers: []\n",
            "c.yaml: document 0: spec.resourceClaims[0].resourceClaimTemplateName:"
            " ResourceClaimTemplate default/nowhere is not in",
        ),
        ("- 1\n- 2\n", "c.yaml: document 0: a list, not an object"),
        ("apiVersion: v1\nkind: ConfigMap\n", "nothing to explain"),
    ],
)
def test_malformed_claim_files_exit_2_naming_the_field(tmp_path, docs, expected):
    (tmp_path / "c.yaml").write_text(docs)
    code, out, err = explain(tmp_path / "c.yaml", "--class", CLASSES, "--simulate", "l40s-pcie")
    assert code == 2 and out == ""
    assert expected in err, err


# -- strict like the API server: an unknown field is refused, naming its path ----------------


def _typo_in_claim(c):
    c["spec"]["devices"]["requests"][0]["exactly"]["selector"] = [{"cel": {"expression": "true"}}]


def _requests_misspelt(c):
    c["spec"]["devices"]["request"] = c["spec"]["devices"].pop("requests")


def _v1beta1_count(c):
    c["spec"]["devices"]["requests"][0]["count"] = 2


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            _typo_in_claim,
            'c.yaml: document 0: unknown field "spec.devices.requests[0].exactly.selector";'
            " allowed: adminAccess, allocationMode, capacity, count, deviceClassName, selectors,"
            " tolerations",
        ),
        (
            _requests_misspelt,
            'c.yaml: document 0: unknown field "spec.devices.request"; allowed: config,'
            " constraints, requests",
        ),
        (
            _v1beta1_count,
            'c.yaml: document 0: unknown field "spec.devices.requests[0].count": a v1beta1 field;'
            " in resource.k8s.io/v1 it goes under `exactly`",
        ),
    ],
    ids=["selector-for-selectors", "request-for-requests", "v1beta1-field"],
)
def test_an_unknown_field_in_a_claim_exits_2_naming_its_path(tmp_path, edit, expected):
    """The API server refuses these (strict decoding: unknown field "..."): explain must not
    answer "fits" for them."""
    c = claim("c1", gpus("gpu"))
    edit(c)
    code, out, err = explain(
        write(tmp_path / "c.yaml", c), "--class", CLASSES, "--simulate", "l40s-pcie"
    )
    assert (code, out) == (2, "")
    assert expected in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_unknown_fields_are_found_in_templates_pods_classes_slices_and_lists(tmp_path):
    t = template("t", gpus("gpu"))
    t["spec"]["spec"]["devices"]["requests"][0]["exactly"]["cout"] = 1
    code, _, err = explain(
        write(tmp_path / "t.yaml", t), "--class", CLASSES, "--simulate", "l40s-pcie"
    )
    assert code == 2 and 'unknown field "spec.spec.devices.requests[0].exactly.cout"' in err, err

    p = pod("p", gpu=("t", True))
    p["spec"]["resourceClaims"][0]["resourceClaimTemplate"] = "t"
    code, _, err = explain(
        write(tmp_path / "p.yaml", template("t", gpus("gpu")), p),
        "--class",
        CLASSES,
        "--simulate",
        "l40s-pcie",
    )
    assert (
        code == 2
        and 'p.yaml: document 1: unknown field "spec.resourceClaims[0].resourceClaimTemplate"'
        in err
    ), err

    p = pod("p", gpu=("c1", False))
    p["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu", "requests": "x"}]}
    code, _, err = explain(
        write(tmp_path / "p2.yaml", claim("c1", gpus("gpu")), p),
        "--class",
        CLASSES,
        "--simulate",
        "l40s-pcie",
    )
    assert code == 2 and 'unknown field "spec.containers[0].resources.claims[0].requests"' in err, (
        err
    )

    classes = list(yaml.safe_load_all(CLASSES.read_text()))
    classes[0]["spec"]["selector"] = classes[0]["spec"].pop("selectors")
    code, _, err = explain(
        EXAMPLES / "single-gpu.yaml",
        "--class",
        write(tmp_path / "cls.yaml", *classes),
        "--simulate",
        "l40s-pcie",
    )
    assert code == 2 and 'cls.yaml: document 0: unknown field "spec.selector"' in err, err

    rs = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "s"},
        "spec": {
            "driver": DRIVER,
            "nodeName": "n",
            "device": [],
            "pool": {"name": "n", "generation": 1, "resourceSliceCount": 1},
        },
    }
    code, _, err = explain(
        EXAMPLES / "single-gpu.yaml", "--class", CLASSES, "--slices", write(tmp_path / "s.yaml", rs)
    )
    assert code == 2 and 's.yaml: document 0: unknown field "spec.device"' in err, err

    listed = {"apiVersion": "v1", "kind": "List", "items": [claim("c1", gpus("gpu"))]}
    listed["items"][0]["spec"]["devices"]["requests"][0]["exactly"]["selector"] = []
    code, _, err = explain(
        write(tmp_path / "l.yaml", listed), "--class", CLASSES, "--simulate", "l40s-pcie"
    )
    assert (
        code == 2
        and 'l.yaml: document 0: unknown field "items[0].spec.devices.requests[0].exactly.selector"'
        in err
    ), err


def test_metadata_may_carry_any_of_object_metas_fields(tmp_path):
    c = claim("c1", gpus("gpu"), uid="u-1")
    c["metadata"] |= {
        "labels": {"a": "b"},
        "annotations": {"x/y": "z"},
        "resourceVersion": "7",
        "creationTimestamp": "2025-01-01T00:00:00Z",
        "finalizers": ["f"],
    }
    code, answer = as_json(
        write(tmp_path / "c.yaml", c), "--class", CLASSES, "--simulate", "l40s-pcie"
    )
    assert code == 0 and answer["claims"][0]["claim"] == "default/c1"
    c["metadata"]["lables"] = {}
    code, _, err = explain(
        write(tmp_path / "c.yaml", c), "--class", CLASSES, "--simulate", "l40s-pcie"
    )
    assert code == 2 and 'unknown field "metadata.lables"' in err, err


def test_a_pod_in_a_slices_file_is_the_wrong_kind(tmp_path):
    f = write(tmp_path / "s.yaml", pod("p"))
    code, _, err = explain(EXAMPLES / "single-gpu.yaml", "--class", CLASSES, "--slices", f)
    assert code == 2
    assert "s.yaml: document 0: kind: 'Pod' does not belong in a --slices file" in err


def test_without_classes_it_says_to_pass_class():
    code, _, err = explain(EXAMPLES / "single-gpu.yaml", "--simulate", "l40s-pcie")
    assert code == 2 and "--class" in err and "deviceclasses.yaml" in err


def test_without_devices_it_says_where_they_can_come_from():
    code, _, err = explain(EXAMPLES / "single-gpu.yaml", "--class", CLASSES)
    assert code == 2 and "--slices" in err and "--simulate" in err and "--kubeconfig" in err


def test_every_option_is_a_variable_too():
    env = {
        "TESSERA_CLAIM": str(EXAMPLES / "single-gpu.yaml"),
        "TESSERA_CLASS": str(CLASSES),
        "TESSERA_SIMULATE": "l40s-pcie",
        "TESSERA_OUTPUT": "json",
        "TESSERA_TIME_LIMIT": "5",
    }
    out, err = io.StringIO(), io.StringIO()
    assert main(["explain"], env, out, err) == 0, err.getvalue()
    assert json.loads(out.getvalue())["fits"] is True


# -- slices of several nodes ------------------------------------------------------------------


def test_a_directory_of_several_nodes_slices_is_answered_per_node(tmp_path):
    d = tmp_path / "slices"
    d.mkdir()
    for model in ("l40s-pcie", "dgx-h100"):
        out = io.StringIO()
        assert main(["slices", "--simulate", model], {}, out, io.StringIO()) == 0
        (d / f"{model}.yaml").write_text(out.getvalue())
    f = write(tmp_path / "c.yaml", claim("six", gpus("gpus", 6)))
    code, out, _ = explain(f, "--class", CLASSES, "--slices", d)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "claim default/six: fits on 1 of 2 nodes"
    assert lines[1].split()[:2] == ["dgx-h100", "fits"]
    assert lines[2].split()[:2] == ["l40s-pcie", "no"]


# -- --write ----------------------------------------------------------------------------------


def test_write_keeps_the_other_documents_and_adds_a_uid(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        "# a comment about the pod\napiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n"
        "  resourceClaims: [{name: gpu, resourceClaimName: one}]\n  containers: []\n---\n"
        + yaml.safe_dump(claim("one", gpus("gpu")), sort_keys=False)
    )
    code, out, _ = explain(f, "--class", CLASSES, "--simulate", "l40s-pcie", "--write")
    assert code == 0
    text = f.read_text()
    assert text.startswith("# a comment about the pod\napiVersion: v1\nkind: Pod\n")
    written = list(yaml.safe_load_all(text))[1]
    assert written["metadata"]["uid"] and written["status"]["allocation"]
    assert f"metadata.uid {written['metadata']['uid']}" in out


def test_write_leaves_a_claim_that_does_not_fit_alone(tmp_path):
    f = write(tmp_path / "c.yaml", claim("eight", gpus("gpus", 8)))
    before = f.read_text()
    code, _, _ = explain(f, "--class", CLASSES, "--simulate", "l40s-pcie", "--write")
    assert code == 1 and f.read_text() == before


def test_write_of_a_template_only_file_is_refused(tmp_path):
    code, _, err = explain(
        EXAMPLES / "dynamic-mig-2g.yaml", "--class", CLASSES, "--simulate", "dgx-h100",
        "--mig-mode", "dynamic", "--write",
    )  # fmt: skip
    assert code == 2 and "--write needs a ResourceClaim" in err


# -- an error of the claim (the allocator's, not "does not fit") ------------------------------

CLIQUE_ERROR = (
    "claim default/all, request gpus: cannot add device gpu.tessera.dev/{pool}/gpu-0 because a"
    " claim constraint would not be satisfied"
)


def all_gpus_of_one_clique():
    """All GPUs with one NVLink clique: a PCIe GPU has no clique, which allocationMode All
    cannot skip (structured/internal/incubating/allocator_incubating.go, allocateDevice with
    must=true: an error of the claim)."""
    c = claim(
        "all", {"name": "gpus", "exactly": {"deviceClassName": DRIVER, "allocationMode": "All"}}
    )
    c["spec"]["devices"]["constraints"] = [{"matchAttribute": f"{DRIVER}/nvlinkClique"}]
    return c


def slices_dir(tmp_path, *nodes):
    """A directory of `tessera slices --simulate MODEL --node-name NODE` per (model, node)."""
    d = tmp_path / "slices"
    d.mkdir()
    for model, node in nodes:
        out = io.StringIO()
        argv = ["slices", "--simulate", model, "--node-name", node]
        assert main(argv, {}, out, io.StringIO()) == 0
        (d / f"{node}.yaml").write_text(out.getvalue())
    return d


def test_an_allocator_error_says_error_not_does_not_fit(tmp_path):
    f = write(tmp_path / "c.yaml", all_gpus_of_one_clique())
    code, out, _ = explain(f, "--class", CLASSES, "--simulate", "l40s-pcie")
    assert code == 1
    first, second = out.splitlines()[:2]
    assert first == "claim default/all on node l40s-pcie: error"
    assert second.startswith("  error: " + CLIQUE_ERROR.format(pool="l40s-pcie"))
    code, j = as_json(f, "--class", CLASSES, "--simulate", "l40s-pcie")
    assert code == 1
    assert j["fits"] is False
    assert j["error"]["node"] == "l40s-pcie"
    (node,) = j["nodes"]
    assert node["error"] == node["reason"] == j["error"]["text"]
    fatal = node["claims"][0]["explanation"]["fatal"]
    assert fatal["upstream"] == CLIQUE_ERROR.format(pool="l40s-pcie")


def test_an_error_on_one_node_stops_the_pod_though_another_fits(tmp_path):
    d = slices_dir(tmp_path, ("dgx-h100", "node-h100"), ("l40s-pcie", "node-l40s"))
    f = write(tmp_path / "c.yaml", all_gpus_of_one_clique())
    code, out, _ = explain(f, "--class", CLASSES, "--slices", d, "--write")
    assert code == 1
    lines = out.splitlines()
    assert lines[0] == "claim default/all: fits on 1 of 2 nodes"
    assert lines[1].startswith("error on node node-l40s: the scheduler stops")
    assert lines[2].split()[:2] == ["node-h100", "fits"]
    assert lines[3].split()[:3] == ["node-l40s", "error", "claim"]
    assert "status" not in yaml.safe_load(f.read_text())  # nothing written: it would not run
    code, j = as_json(f, "--class", CLASSES, "--slices", d)
    assert (j["fits"], j["fittingNodes"], j["error"]["node"]) == (False, ["node-h100"], "node-l40s")
    assert [n["error"] is None for n in j["nodes"]] == [True, False]


def test_a_look_alike_nodes_error_names_its_own_device(tmp_path):
    d = slices_dir(tmp_path, ("l40s-pcie", "node-a"), ("l40s-pcie", "node-b"))
    f = write(tmp_path / "c.yaml", all_gpus_of_one_clique())
    code, j = as_json(f, "--class", CLASSES, "--slices", d)
    assert code == 1
    for node in j["nodes"]:
        want = CLIQUE_ERROR.format(pool=node["node"])
        assert node["claims"][0]["explanation"]["fatal"]["upstream"] == want
        assert node["error"].startswith(want)
