import pytest
import yaml

from dra_driver.errors import ClaimError
from dra_driver.kubeletplugin.claim_sources import DirClaimSource
from dra_driver.kubeletplugin.claims import (
    ClaimKey,
    check_claim_key,
    configs_for,
    parse_allocation,
)

DRIVER, NODE = "gpu.tessera.dev", "node-a"
KEY = ClaimKey("default", "c1", "uid-1")


def claim(results=None, config=None, uid="uid-1", node_selector=None, allocated=True):
    obj = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c1", "namespace": "default", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x"}}]}},
    }
    if allocated:
        alloc = {"devices": {"results": results or [], "config": config or []}}
        if node_selector is not None:
            alloc["nodeSelector"] = node_selector
        obj["status"] = {"allocation": alloc}
    return obj


def result(device="gpu-0", request="gpu", driver=DRIVER, pool=NODE):
    return {"request": request, "driver": driver, "pool": pool, "device": device}


def opaque(source, params, requests=None, driver=DRIVER):
    c = {"source": source, "opaque": {"driver": driver, "parameters": params}}
    if requests:
        c["requests"] = requests
    return c


def test_picks_only_this_drivers_results():
    a = parse_allocation(
        claim([result(), result("nic-0", "nic", driver="nic.example.com", pool="x")]),
        KEY, DRIVER, NODE,
    )  # fmt: skip
    assert [d.device for d in a.devices] == ["gpu-0"]


def test_config_precedence_class_first_claim_wins_later_wins_request_scoped():
    cfgs = [
        opaque("FromClaim", {"n": 3}),
        opaque("FromClass", {"n": 1}),
        opaque("FromClaim", {"n": 4}, requests=["other"]),
        opaque("FromClass", {"n": 2}),
        opaque("FromClaim", {"n": 5}, requests=["gpu"]),
        opaque("FromClaim", {"n": 99}, driver="nic.example.com"),
    ]
    a = parse_allocation(claim([result()], cfgs), KEY, DRIVER, NODE)
    assert [c.parameters["n"] for c in configs_for(a, "gpu")] == [1, 2, 3, 5]
    assert [c.parameters["n"] for c in configs_for(a, "gpu/big")] == [1, 2, 3, 5]
    assert [c.parameters["n"] for c in configs_for(a, "other")] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("obj", "needle"),
    [
        (claim([result()], uid="uid-2"), "has UID 'uid-2', the kubelet asked for 'uid-1'"),
        (claim(allocated=False), "is not allocated"),
        (claim([result(pool="node-b")]), "pool 'node-b', which is another node's"),
        (
            claim([result()], node_selector={"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": ["node-b"]}]}]}),
            "allocated to another node (status.allocation.nodeSelector), not 'node-a'",
        ),
        ([], "claim default/c1 (uid-1): expected an object, got a list"),
    ],
    ids=["uid-mismatch", "not-allocated", "other-pool", "other-node-selector", "not-an-object"],
)  # fmt: skip
def test_bad_claims(obj, needle):
    with pytest.raises(ClaimError) as e:
        parse_allocation(obj, KEY, DRIVER, NODE)
    assert needle in str(e.value)


def test_node_selector_for_this_node_is_accepted():
    sel = {"nodeSelectorTerms": [{"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}  # fmt: skip
    assert parse_allocation(claim([result()], node_selector=sel), KEY, DRIVER, NODE).devices


def test_dir_source_reads_multi_document_files(tmp_path):
    (tmp_path / "claims.yaml").write_text(
        yaml.safe_dump_all([claim([result()]), {"kind": "ConfigMap", "metadata": {"name": "c1"}}])
    )
    src = DirClaimSource(tmp_path)
    assert src.get("default", "c1")["metadata"]["uid"] == "uid-1"
    with pytest.raises(ClaimError, match="claim default/c2 not found"):
        src.get("default", "c2")
    (tmp_path / "broken.yaml").write_text("a: [")
    assert src.get("default", "c1")["metadata"]["uid"] == "uid-1"  # one bad file hides nothing
    with pytest.raises(ClaimError, match=r"not found .*unreadable claim files: broken.yaml: "):
        src.get("default", "c2")  # a claim that is missing names the file that may hold it


def test_dir_source_sees_edited_files(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(claim([result()])))
    src = DirClaimSource(tmp_path)
    assert src.get("default", "c1")["metadata"]["uid"] == "uid-1"
    path.write_text(yaml.safe_dump(claim([result()], uid="uid-22")))
    assert src.get("default", "c1")["metadata"]["uid"] == "uid-22"


@pytest.mark.parametrize(
    ("namespace", "name"),
    [("../kube-system", "x"), ("default", "a/../../secrets"), ("UPPER", "x"),
     ("default", "x" * 300), ("default", "with space"), ("", "x"), ("ns", "a\x00b")],
    ids=["ns-dots", "name-path", "ns-upper", "name-long", "name-space", "ns-empty", "name-nul"],
)  # fmt: skip
def test_claim_names_are_checked_before_they_reach_a_url(namespace, name):
    from dra_driver.kubeletplugin.claim_sources import KubeClaimSource

    class NoCalls:
        def request(self, *args, **kwargs):
            raise AssertionError("a request was made")

    with pytest.raises(ClaimError, match="is not a DNS"):
        KubeClaimSource(NoCalls()).get(namespace, name)  # type: ignore[arg-type]


def test_claims_are_found_by_uid_across_namespaces_in_pages_of_the_api(tmp_path):
    from agent.sim.apiserver import ApiServer
    from dra_driver.cluster.kube import KubeClient
    from dra_driver.kubeletplugin.claim_sources import KubeClaimSource

    with ApiServer() as server:
        for i, ns in enumerate(("a", "b", "c", "d", "e")):
            obj = claim([result()], uid=f"uid-{ns}")
            obj["metadata"].update(namespace=ns, name=f"c{i}")
            server.put_object("resourceclaims", obj)
        kube = KubeClient.from_config(server.kubeconfig(tmp_path / "kubeconfig"))
        try:
            found = KubeClaimSource(kube, page=2).by_uid(["uid-b", "uid-e", "uid-zzz"])
        finally:
            kube.close()
        pages = [
            r.params
            for r in server.requests.snapshot()
            if r.path == "/apis/resource.k8s.io/v1/resourceclaims"
        ]
    namespaces = {uid: o["metadata"]["namespace"] for uid, o in found.items()}
    assert namespaces == {"uid-b": "b", "uid-e": "e"}
    assert len(pages) == 3 and all(p["limit"] == "2" for p in pages)  # every page, then stop
    assert "continue" not in pages[0] and all("continue" in p for p in pages[1:])


def test_claim_files_are_found_by_uid(tmp_path):
    (tmp_path / "claims.yaml").write_text(
        yaml.safe_dump_all([claim([result()]), claim([result()], uid="uid-2")])
    )
    (tmp_path / "broken.yaml").write_text("a: [")
    src = DirClaimSource(tmp_path)
    assert set(src.by_uid({"uid-2", "uid-3"})) == {"uid-2"}


def test_a_missing_claim_names_at_most_ten_unreadable_files_each_printable(tmp_path):
    """A directory of thousands of broken files must not make every answer megabytes long (the
    kubelet's answer holds one per claim), and a file name with a newline stays one line."""
    for i in range(25):
        (tmp_path / f"broken-{i:02d}.yaml").write_text("a: [")
    (tmp_path / "a\nb.yaml").write_text("a: [")
    with pytest.raises(ClaimError) as e:
        DirClaimSource(tmp_path).get("default", "c2")
    message = str(e.value)
    assert message.isprintable() and len(message) < 2000
    assert "'a\\nb.yaml': " in message  # sorted first, shown escaped
    assert "broken-08.yaml: " in message and "broken-09.yaml" not in message
    assert message.endswith("; and 16 more")


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("device", "d" * 5000, "'" + "d" * 60 + "'... (5000 characters)"),
        ("pool", "p\x00\n", "'p\\x00\\n'"),
        # short enough, but its escapes are not: cut within the quotes, never through them
        ("device", "gpu-" + "\x80" * 40, "'gpu-" + "\\x80" * 14 + "'... (44 characters)"),
    ],
)
def test_untrusted_values_in_errors_are_escaped_and_cut_short(field, value, shown):
    r = result()
    r[field] = value
    with pytest.raises(ClaimError) as e:
        plan_or_parse(claim([r]))
    assert shown in str(e.value) and str(e.value).isprintable() and len(str(e.value)) < 400


def plan_or_parse(obj):
    from dra_driver.device_model import DeviceModel
    from dra_driver.kubeletplugin.plan import plan_claim

    return plan_claim(parse_allocation(obj, KEY, DRIVER, NODE), DeviceModel((), ()))


def test_a_claim_key_is_checked_field_by_field():
    check_claim_key(ClaimKey("default", "my.claim-1", "0b6c7e1a-1111-2222-3333-444455556666"), "c")
    with pytest.raises(ClaimError) as e:
        check_claim_key(ClaimKey("Default", "a_b", "../x"), "claims[4]")
    assert str(e.value) == (
        "claims[4].uid: '../x' is not a claim UID (a lower-case DNS label: at most 63 of a-z,"
        " 0-9 and '-', starting and ending alphanumeric); claims[4].namespace: 'Default' is not"
        " a DNS label (at most 63 of a-z, 0-9 and '-', starting and ending alphanumeric);"
        " claims[4].name: 'a_b' is not a DNS subdomain (at most 253 of a-z, 0-9, '-' and '.')"
    )
    assert e.value.reason == "invalid_claim"
    check_claim_key(ClaimKey("Default", "a_b", "uid-1"), "c", names=False)  # the UID only


def test_unknown_fields_in_a_claim_are_ignored_as_before():
    """The kubelet's claim reads stay lenient (the API server checked the claim; a newer one may
    add fields): only ``tessera explain`` refuses unknown fields in its files."""
    obj = claim([result() | {"newField": 1}], [opaque("FromClaim", {"x": 1}) | {"extra": True}])
    obj["status"]["allocation"]["devices"]["newThing"] = []
    obj["spec"]["devices"]["requests"][0]["selector"] = []
    a = parse_allocation(obj, KEY, DRIVER, NODE)
    assert [(d.request, d.device) for d in a.devices] == [("gpu", "gpu-0")]
    assert [c.parameters for c in a.configs] == [{"x": 1}]


def test_each_result_carries_the_device_class_its_request_or_subrequest_names():
    """What labels a holding's usage: ``exactly.deviceClassName``, or for ``firstAvailable`` the
    chosen subrequest's (a result names ``req/sub``); "" when the spec does not say."""
    from dra_driver.kubeletplugin.claims import device_classes
    from tests.k8sschema import VERSIONS, validate

    obj = claim([result("gpu-0", "gpu"), result("gpu-1", "any/small"), result("gpu-2", "odd")])
    obj["spec"]["devices"]["requests"] = [
        {"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev"}},
        {
            "name": "any",
            "firstAvailable": [
                {"name": "big", "deviceClassName": "h100.tessera.dev"},
                {"name": "small", "deviceClassName": "mig.tessera.dev"},
            ],
        },
    ]
    for version in VERSIONS:
        validate(obj, version)
    a = parse_allocation(obj, KEY, DRIVER, NODE)
    assert [(d.request, d.device_class) for d in a.devices] == [
        ("gpu", "gpu.tessera.dev"),
        ("any/small", "mig.tessera.dev"),
        ("odd", ""),
    ]
    assert device_classes({"spec": {"devices": {"requests": "not a list"}}}) == {}


def test_a_claim_file_that_is_a_symlink_is_not_followed(tmp_path):
    """Standalone mode: whoever can write resourceclaims/ must not make the driver read a file
    elsewhere (a claim planted outside, or /dev/zero) by linking to it: the link is refused and
    named, the real files beside it are still read."""
    claims, outside = tmp_path / "resourceclaims", tmp_path / "elsewhere"
    claims.mkdir()
    outside.mkdir()
    (outside / "planted.yaml").write_text(yaml.safe_dump(claim([result()], uid="uid-planted")))
    (claims / "link.yaml").symlink_to(outside / "planted.yaml")
    (claims / "zero.yaml").symlink_to("/dev/zero")
    (claims / "real.yaml").write_text(yaml.safe_dump(claim([result()], uid="uid-real")))
    src = DirClaimSource(claims)
    assert set(src.by_uid({"uid-planted", "uid-real"})) == {"uid-real"}
    (claims / "real.yaml").unlink()
    with pytest.raises(ClaimError) as e:
        src.get("default", "c1")
    assert "link.yaml: cannot open it: a symbolic link" in str(e.value)
    assert "zero.yaml: cannot open it: a symbolic link" in str(e.value)
