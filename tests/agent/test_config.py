from pathlib import Path

import pytest

from agent.cli import build_parser
from agent.config import (
    Config,
    CrashAt,
    crash_at,
    dest,
    env_name,
    flag_name,
    load_config,
    settings,
    settings_of,
)
from agent.errors import ConfigError
from dra_driver.kubeletplugin.crash_points import CRASH_POINTS


def test_defaults_are_pinned():
    c = load_config({}, {})
    assert c == Config()
    assert c.simulator.simulate is None
    assert c.simulator.sim_mig_layout is None
    assert c.node.sysfs_root is None
    assert c.node.state_dir is None
    assert c.node.node_name is None
    assert c.http.metrics_address == "127.0.0.1:9400"
    assert c.daemon.log_format == "json"
    assert c.daemon.log_level == "info"
    assert c.driver.driver_name == "gpu.tessera.dev"
    assert c.driver.mig_mode == "static"
    assert c.driver.kube_layout == "1.35"
    assert c.cluster.no_kube is False
    assert c.cluster.kubeconfig is None
    assert c.publishing.cleanup_on_exit is False
    assert c.publishing.resync_interval == 600.0


def test_every_setting_has_an_env_variable_and_a_flag_on_run():
    parser = build_parser()
    run = parser.parse_args(["run"])
    for name, meta, _default in settings():
        assert env_name(name).startswith("TESSERA_")
        assert dest(Config, name) in vars(run), f"{flag_name(name)} missing from `tessera run`"
        assert meta.help.strip()
    assert [s.env[0] for s in settings_of(Config)] == [env_name(n) for n, _, _ in settings()]


@pytest.mark.parametrize(
    ("env", "flags", "expected"),
    [
        ({"TESSERA_STATE_DIR": "/tmp/a"}, {}, Path("/tmp/a")),
        ({"TESSERA_STATE_DIR": "/tmp/a"}, {"state_dir": "/tmp/b"}, Path("/tmp/b")),
        ({}, {}, None),
    ],
    ids=["env", "flag-wins", "unset"],
)
def test_flag_beats_env_beats_default(env, flags, expected):
    assert load_config(flags, env).node.state_dir == expected


def test_node_name_falls_back_to_NODE_NAME_but_tessera_variable_wins():
    assert load_config({}, {"NODE_NAME": "n1"}).node.node_name == "n1"
    assert load_config({}, {"NODE_NAME": "n1", "TESSERA_NODE_NAME": "n2"}).node.node_name == "n2"


def test_bad_choice_names_where_it_came_from_the_value_and_what_is_allowed():
    with pytest.raises(ConfigError) as e:
        load_config({}, {"TESSERA_LOG_FORMAT": "xml"})
    assert str(e.value) == "TESSERA_LOG_FORMAT='xml' is not one of json, text"  # not the flag
    with pytest.raises(ConfigError) as e:
        load_config({"log_format": "xml"}, {"TESSERA_LOG_FORMAT": "text"})
    assert str(e.value) == "--log-format: 'xml' is not one of json, text"


def test_bad_metrics_address_is_reported():
    with pytest.raises(ConfigError, match="HOST:PORT"):
        load_config({"metrics_address": "localhost"}, {}).http.host_port()
    assert load_config({"metrics_address": "[::1]:9400"}, {}).http.host_port() == ("::1", 9400)


@pytest.mark.parametrize("bad", ["GPU.example.com", "gpu_x.com", "-gpu.com", "a" * 64])
def test_driver_name_must_be_a_dns_subdomain(bad):
    with pytest.raises(ConfigError, match="--driver-name"):
        load_config({"driver_name": bad}, {})


def test_booleans_and_seconds_from_the_environment():
    c = load_config({}, {"TESSERA_NO_KUBE": "true", "TESSERA_RESYNC_INTERVAL": "30"})
    assert c.cluster.no_kube is True and c.publishing.resync_interval == 30.0
    assert load_config({}, {"TESSERA_NO_KUBE": "off"}).cluster.no_kube is False
    with pytest.raises(ConfigError, match="'maybe'"):
        load_config({}, {"TESSERA_CLEANUP_ON_EXIT": "maybe"})
    with pytest.raises(ConfigError, match=r"^TESSERA_RESYNC_INTERVAL='-1' is not a number of sec"):
        load_config({}, {"TESSERA_RESYNC_INTERVAL": "-1"})
    with pytest.raises(ConfigError, match=r"^--resync-interval: 'soon' is not a number"):
        load_config({"resync_interval": "soon"}, {})
    with pytest.raises(ConfigError, match=r"^TESSERA_DRIVER_NAME='GPU' is not a lower-case DNS"):
        load_config({}, {"TESSERA_DRIVER_NAME": "GPU"})
    with pytest.raises(ConfigError, match=r"^TESSERA_METRICS_ADDRESS='x' is not HOST:PORT"):
        load_config({}, {"TESSERA_METRICS_ADDRESS": "x"})


def test_settings_outside_the_commands_groups_are_not_read():
    """`discover` offers only the node settings: a bad daemon variable cannot fail it."""
    env = {"TESSERA_LOG_FORMAT": "xml", "TESSERA_SIMULATE": "mixed"}
    c = load_config({}, env, groups=("node",))
    assert c.simulator.simulate == "mixed" and c.daemon.log_format == "json"


def test_network_limits_have_defaults_and_are_checked():
    c = load_config({}, {})
    assert (c.http.http_max_connections, c.http.http_threads, c.http.fd_reserve) == (64, 4, 64)
    assert (c.http.http_header_timeout, c.http.http_body_timeout, c.http.http_response_timeout) == (
        10,
        10,
        10,
    )
    assert (c.telemetry.telemetry_max_watchers, c.telemetry.telemetry_streams_per_connection) == (
        32,
        8,
    )
    assert c.telemetry.telemetry_send_timeout == 10 and c.kubelet.kubelet_health_streams == 4
    assert c.http.tls() is None and c.telemetry.tls() is None
    assert load_config({}, {"TESSERA_FD_RESERVE": "0"}).http.fd_reserve == 0
    with pytest.raises(ConfigError, match=r"^TESSERA_HTTP_THREADS='0' is not a positive whole"):
        load_config({}, {"TESSERA_HTTP_THREADS": "0"})
    with pytest.raises(ConfigError, match=r"^--telemetry-max-watchers: 'many' is not a whole"):
        load_config({"telemetry_max_watchers": "many"}, {})


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"metrics_tls_cert": "c.pem"}, "--metrics-tls-cert and --metrics-tls-key go together"),
        ({"telemetry_tls_key": "k.pem"}, "--telemetry-tls-cert and --telemetry-tls-key go"),
        ({"metrics_tls_client_ca": "ca.pem"}, "--metrics-tls-client-ca needs --metrics-tls-cert"),
        (
            {"telemetry_tls_cert": "c.pem", "telemetry_tls_key": "k.pem"},
            "--telemetry-tls-cert applies to the TCP listener, and --telemetry-address is not set",
        ),
    ],
)
def test_tls_files_must_come_in_pairs_and_only_where_they_apply(given, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        load_config(given, {})


def test_tls_files_name_their_options():
    c = load_config(
        {"metrics_tls_cert": "c.pem", "metrics_tls_key": "k.pem", "metrics_tls_client_ca": "a"}, {}
    )
    tls = c.http.tls()
    assert tls is not None and (tls.cert, tls.key, tls.ca) == (
        Path("c.pem"),
        Path("k.pem"),
        Path("a"),
    )
    assert tls.label("ca") == "--metrics-tls-client-ca" and tls.label("key") == "--metrics-tls-key"


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"sim_driver_layout": "rhel"}, "--sim-driver-layout rhel: only with --simulate"),
        (
            {"host_driver_root": "run/nvidia/driver"},
            "--host-driver-root 'run/nvidia/driver' is not",
        ),
        ({"cdi_hook_path": "nvidia-ctk"}, "--cdi-hook-path 'nvidia-ctk' is not absolute"),
    ],
)
def test_driver_root_settings_are_checked(given, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        load_config(given, {})


def test_driver_roots_from_the_environment():
    c = load_config(
        {},
        {"TESSERA_DRIVER_ROOT": "/driver-root", "TESSERA_HOST_DRIVER_ROOT": "/run/nvidia/driver"},
    )
    assert (c.node.driver_root, c.node.host_driver_root) == (
        Path("/driver-root"),
        Path("/run/nvidia/driver"),
    )
    with pytest.raises(ConfigError, match="one of ubuntu, rhel, container"):
        load_config({"simulate": "dgx-h100"}, {"TESSERA_SIM_DRIVER_LAYOUT": "debian"})


POD_UID = "4f1b2c3d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"


def test_rolling_update_takes_the_pod_uid_from_the_downward_api_variable():
    c = load_config({}, {"TESSERA_ROLLING_UPDATE": "true", "TESSERA_POD_UID": POD_UID})
    assert c.daemon.rolling_update is True and c.daemon.pod_uid == POD_UID
    assert load_config({}, {}).daemon.rolling_update is False  # classic names and lock by default


def test_rolling_update_without_a_pod_uid_is_a_configuration_error():
    with pytest.raises(ConfigError) as e:
        load_config({"rolling_update": True}, {})
    assert "--rolling-update needs this pod's UID" in str(e.value)
    assert "TESSERA_POD_UID" in str(e.value) and "metadata.uid" in str(e.value)


@pytest.mark.parametrize(
    "bad", ["4F1B2C3D-5E6F", "-abc", "abc-", "a/b", "a.b", "a_b", "x" * 64, "../../etc"]
)
def test_a_pod_uid_must_be_a_dns_label(bad):
    with pytest.raises(ConfigError) as e:
        load_config({}, {"TESSERA_ROLLING_UPDATE": "1", "TESSERA_POD_UID": bad})
    assert str(e.value).startswith(f"TESSERA_POD_UID={bad!r} is not a pod UID")
    with pytest.raises(ConfigError, match=r"^--pod-uid: .* is not a pod UID"):
        Config.of(rolling_update=True, pod_uid=bad)  # checked however the Config is made


def test_cleanup_on_exit_would_delete_the_successors_slices():
    with pytest.raises(ConfigError, match="--cleanup-on-exit and --rolling-update"):
        load_config({}, {"TESSERA_ROLLING_UPDATE": "1", "TESSERA_POD_UID": POD_UID,
                         "TESSERA_CLEANUP_ON_EXIT": "1"})  # fmt: skip


def test_sim_crash_at_takes_a_point_and_an_occurrence() -> None:
    sim = {"TESSERA_SIMULATE": "dgx-h100"}
    assert load_config({}, sim).simulator.sim_crash_at is None
    first = load_config({"sim_crash_at": "after-cdi"}, sim).simulator.sim_crash_at
    assert first == CrashAt("after-cdi", 1) and str(first) == "after-cdi"
    third = load_config(
        {}, {**sim, "TESSERA_SIM_CRASH_AT": "after-gi-create:3"}
    ).simulator.sim_crash_at
    assert third == CrashAt("after-gi-create", 3) and str(third) == "after-gi-create:3"
    for point in CRASH_POINTS:  # every point the driver has can be armed
        assert crash_at(point) == CrashAt(point) and crash_at(f"{point}:2") == CrashAt(point, 2)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("after-nothing", "does not name a crash point (POINT or POINT:N); POINT is one of "),
        ("after-nothing:2", "does not name a crash point"),
        ("", "does not name a crash point"),
        ("after-cdi:0", "is not POINT:N with N a whole number >= 1"),
        ("after-cdi:-1", "is not POINT:N with N a whole number >= 1"),
        ("after-cdi:", "is not POINT:N with N a whole number >= 1"),
        ("after-cdi:two", "is not POINT:N with N a whole number >= 1"),
        ("after-cdi:2:3", "is not POINT:N with N a whole number >= 1"),
        ("after-cdi:\u00b2", "is not POINT:N with N a whole number >= 1"),  # int() refuses it
        ("after-cdi:1234567890", "is not POINT:N with N a whole number >= 1"),
    ],
)
def test_a_bad_crash_point_is_refused_naming_the_known_ones(raw: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config({"sim_crash_at": raw}, {"TESSERA_SIMULATE": "dgx-h100"})
    assert str(e.value).startswith(f"--sim-crash-at: {raw!r} {message}")
    if "crash point" in message:
        assert ", ".join(CRASH_POINTS) in str(e.value)


def test_sim_crash_at_needs_simulate() -> None:
    with pytest.raises(ConfigError, match="only allowed with --simulate"):
        load_config({"sim_crash_at": "after-cdi:2"}, {})


def test_every_setting_is_in_one_group_and_config_of_places_it_there():
    from agent.config import sections_of

    groups = dict(sections_of(Config))
    names = [s.name for s in settings_of(Config)]
    assert len(names) == len(set(names)) == 65  # one flag, one variable, one group each
    assert {s.section for s in settings_of(Config)} == set(groups)
    for s in settings_of(Config):
        assert s.name in {f.name for f in settings_of(groups[s.section])}
    c = Config.of(metrics_address="0.0.0.0:9400", telemetry_interval=5.0, simulate="dgx-h100")
    assert c.http.host_port() == ("0.0.0.0", 9400)
    assert c.telemetry.telemetry_interval == 5.0 and c.simulator.simulate == "dgx-h100"
    assert c == load_config({"metrics_address": "0.0.0.0:9400", "simulate": "dgx-h100"},
                            {"TESSERA_TELEMETRY_INTERVAL": "5"})  # fmt: skip
    with pytest.raises(TypeError, match="no setting bogus"):
        Config.of(bogus=1)


def test_the_usage_report_interval_is_a_positive_number_of_seconds():
    assert Config().cluster.usage_report_interval == 60.0
    env = {"TESSERA_USAGE_REPORT_INTERVAL": "15"}
    assert load_config({}, env).cluster.usage_report_interval == 15.0
    with pytest.raises(
        ConfigError, match="TESSERA_USAGE_REPORT_INTERVAL='0' is not a number of seconds > 0"
    ):
        load_config({}, {"TESSERA_USAGE_REPORT_INTERVAL": "0"})


def test_malloc_arenas_default_to_two_and_are_checked():
    assert Config().daemon.malloc_arenas == 2
    assert load_config({}, {"TESSERA_MALLOC_ARENAS": "1"}).daemon.malloc_arenas == 1
    assert load_config({"malloc_arenas": "0"}, {}).daemon.malloc_arenas == 0
    with pytest.raises(ConfigError) as e:
        load_config({}, {"TESSERA_MALLOC_ARENAS": "-1"})
    assert str(e.value) == (
        "TESSERA_MALLOC_ARENAS='-1' is not a number of malloc arenas from 0 (glibc's own) to 64"
    )
    with pytest.raises(ConfigError, match=r"^--malloc-arenas: 'two' is not a whole number"):
        load_config({"malloc_arenas": "two"}, {})
