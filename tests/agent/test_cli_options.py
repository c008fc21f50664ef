"""Every command's options: declared once, settable by flag or ``TESSERA_<FLAG>``, with help,
and errors that say where a bad value came from."""

import argparse
import io
import json
import subprocess
import sys
from importlib import metadata

import pytest

from agent.cli import TREE, build_parser, main
from agent.cli.docs import render_config_docs
from agent.config import Config, settings_of


def run(argv, environ=None):
    out, err = io.StringIO(), io.StringIO()
    code = main(argv, environ if environ is not None else {}, out, err)
    return code, out.getvalue(), err.getvalue()


def parsers(parser=None, name="tessera"):
    """Every (command path, parser) of the whole tree."""
    parser = parser or build_parser()
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from parsers(sub, f"{name} {sub_name}")


def chains(command=TREE, chain=()):
    chain = (*chain, command)
    yield chain
    for child in command.subcommands:
        yield from chains(child.resolved(), chain)


def test_every_option_and_command_has_help():
    missing = []
    for name, parser in parsers():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                missing += [f"{name} {c.dest}" for c in action._choices_actions if not c.help]
            elif not (action.help or "").strip():
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert missing == []


def test_every_option_is_a_declared_setting_with_its_tessera_variable():
    """Each option string of each command belongs to a setting the command declares, so the
    variable TESSERA_<FLAG> reaches it (and docs/configuration.md lists it)."""
    by_path = {" ".join(c.name for c in chain): chain for chain in chains()}
    docs = render_config_docs()
    for name, parser in parsers():
        chain = by_path[name]
        declared = {
            flag: s
            for use in chain[-1].uses
            for s in settings_of(use.cls)
            if s.in_groups(use.groups)
            for flag in s.flags
        }
        for action in parser._actions:
            if action.option_strings and action.dest not in ("help", "version"):
                for flag in action.option_strings:
                    assert flag in declared, f"{name} {flag} is not a declared setting"
        for s in declared.values():
            assert s.env[0] == "TESSERA_" + s.flags[-1].lstrip("-").replace("-", "_").upper()
            assert f"`{s.env[0]}`" in docs


def test_docs_list_command_options_under_their_command():
    docs = render_config_docs()
    for command in ("discover", "top", "kubelet prepare", "sim fault", "sim fault xid",
                    "sim apiserver"):  # fmt: skip
        assert f"### `tessera {command}`" in docs
    for needle in ("`-o`, `--output`", "`TESSERA_FORMAT`", "`TESSERA_SOCKET`", "`TESSERA_CLAIM`",
                   "`TESSERA_ENDPOINT`", "`TESSERA_XID`", "`TESSERA_KUBECONFIG_OUT`"):  # fmt: skip
        assert needle in docs


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["discover", "--simulate", "mixed"], {"TESSERA_OUTPUT": "xml"},
         "TESSERA_OUTPUT='xml' is not one of table, json, yaml"),
        (["discover", "--simulate", "mixed", "-o", "xml"], {"TESSERA_OUTPUT": "json"},
         "-o/--output: 'xml' is not one of table, json, yaml"),
        (["topo", "--simulate", "mixed"], {"TESSERA_FORMAT": "svg"},
         "TESSERA_FORMAT='svg' is not one of matrix, dot"),
        (["top"], {"TESSERA_INTERVAL": "0"}, "TESSERA_INTERVAL='0' is not a number of seconds > 0"),
        (["top"], {"TESSERA_ONCE": "maybe"}, "TESSERA_ONCE='maybe' is not a boolean"),
        (["kubelet", "prepare", "--socket", "/s"], {"TESSERA_CLAIM": "ns/a/u1,ns/b"},
         "TESSERA_CLAIM='ns/b' is not NAMESPACE/NAME/UID"),
        (["kubelet", "health", "--socket", "/s", "--count", "0"], {},
         "--count: '0' is not a positive whole number"),
        (["sim", "apiserver", "--kubeconfig-out", "/k"], {"TESSERA_PORT": "http"},
         "TESSERA_PORT='http' is not a whole number"),
        (["sim", "fault", "--state-dir", "/d", "xid", "--gpu", "0"], {"TESSERA_XID": "-1"},
         "TESSERA_XID='-1' is not a positive whole number"),
        (["sim", "fault", "--state-dir", "/d", "load", "--gpu", "0", "--utilization", "2"], {},
         "--utilization: '2' is not a fraction from 0 to 1"),
        (["run"], {"TESSERA_METRICS_ADDRESS": "9400"},
         "TESSERA_METRICS_ADDRESS='9400' is not HOST:PORT"),
    ],
)  # fmt: skip
def test_a_bad_value_names_the_flag_or_variable_it_came_from(argv, env, expected):
    code, out, err = run(argv, env)
    assert (code, out) == (2, "")
    assert err.startswith(f"tessera: configuration error: {expected}") and err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["kubelet", "info"], "--socket is required: give --socket PATH or set TESSERA_SOCKET"),
        (["kubelet", "prepare", "--socket", "/s"], "--claim is required"),
        (["sim", "apiserver"], "--kubeconfig-out is required"),
        (["sim", "fault", "driver-reload"], "--state-dir is required"),
        (["sim", "fault", "--state-dir", "/d", "xid", "--gpu", "1"], "--xid is required"),
    ],
)
def test_a_missing_required_option_says_how_to_give_it(argv, message):
    code, _, err = run(argv)
    assert code == 2 and message in err and err.count("\n") == 1


def test_command_options_come_from_their_variables(tmp_path, short_tmp):
    # top: TESSERA_STATE_DIR points at the agent (none runs there, which the error names)
    code, _, err = run(["top"], {"TESSERA_STATE_DIR": str(tmp_path), "TESSERA_ONCE": "true"})
    assert code == 2 and f"unix://{tmp_path}/telemetry.sock" in err
    code, _, err = run(["top", "--once"], {"TESSERA_ENDPOINT": f"unix://{tmp_path}/t.sock"})
    assert code == 2 and f"unix://{tmp_path}/t.sock" in err
    # kubelet: socket and a comma-separated claim list
    sock = str(tmp_path / "dra.sock")
    env = {"TESSERA_SOCKET": sock, "TESSERA_CLAIM": "ns/a/u1, ns/b/u2", "TESSERA_API": "v1beta1"}
    code, _, err = run(["kubelet", "prepare"], env)
    assert code == 2 and f"no socket at {sock}" in err and "v1beta1.DRAPlugin" in err
    # sim fault: the state directory and the GPU from variables
    assert run(["discover", "--simulate", "dgx-h100", "--state-dir", str(short_tmp)])[0] == 0
    code, out, _ = run(
        ["sim", "fault", "load", "--utilization", "0.5"],
        {"TESSERA_STATE_DIR": str(short_tmp), "TESSERA_GPU": "2"},
    )
    assert (code, out) == (0, "GPU 2 load set to utilization 0.5\n")
    code, _, err = run(["sim", "fault", "recover"], {"TESSERA_STATE_DIR": str(short_tmp),
                                                     "TESSERA_GPU": "9"})  # fmt: skip
    assert code == 2 and "GPU index 9 does not exist" in err


def test_a_flag_wins_over_its_variable_which_wins_over_the_default(short_tmp):
    assert run(["discover", "--simulate", "dgx-h100", "--state-dir", str(short_tmp)])[0] == 0
    base = ["sim", "fault", "--state-dir", str(short_tmp), "fail-call", "--call", "nvmlX"]
    assert "NVML error 999 for the next 1 call(s)" in run(base)[1]
    assert "NVML error 3 for the next 1 call(s)" in run(base, {"TESSERA_CODE": "3"})[1]
    out = run([*base, "--code", "4", "--times", "0"], {"TESSERA_CODE": "3", "TESSERA_TIMES": "2"})
    assert "NVML error 4 for every call" in out[1]


def test_settings_of_other_commands_never_fail_a_command():
    env = {"TESSERA_LOG_FORMAT": "xml", "TESSERA_SOCKET": "", "TESSERA_INTERVAL": "-1"}
    code, out, err = run(["discover", "--simulate", "mixed", "-o", "json"], env)
    assert code == 0 and json.loads(out)["hostname"] == "mixed", err


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["discover", "--bogus"], "usage: tessera discover "),
        (["kubelet", "info", "--socket", "/s", "--bogus"], "usage: tessera kubelet info "),
        (["sim", "fault", "--state-dir", "/d", "xid", "-x"], "usage: tessera sim fault xid "),
        (["kubelet", "nope"], "usage: tessera kubelet "),
        (["sim"], "usage: tessera sim "),
    ],
)
def test_a_bad_option_shows_the_subcommands_usage(argv, usage):
    code, out, err = run(argv)
    assert (code, out) == (2, "")
    assert err.startswith(usage), err
    assert err.splitlines()[-1].startswith(f"tessera {argv[0]}")


def test_version_and_help_go_to_stdout():
    code, out, err = run(["--version"])
    assert (code, out, err) == (0, f"tessera {metadata.version('tessera')}\n", "")
    code, out, err = run(["kubelet", "prepare", "--help"])
    assert code == 0 and err == "" and "TESSERA_CLAIM" in out and "exactly as the kubelet" in out


def test_the_agent_settings_keep_their_variables():
    run_parser = dict(parsers())["tessera run"]
    flags = {f for a in run_parser._actions for f in a.option_strings}
    for s in settings_of(Config):
        assert s.flags[0] in flags
    node_name = next(s for s in settings_of(Config) if s.name == "node_name")
    assert node_name.env == ("TESSERA_NODE_NAME", "NODE_NAME")


def test_a_lower_layers_message_names_the_variable_that_gave_the_value():
    """Lower layers name a setting by its flag; the CLI knows where the value came from."""
    from agent.cli.framework import describe
    from agent.config import resolve_settings
    from agent.errors import ConfigError

    _, origins = resolve_settings(Config, {}, {"TESSERA_STATE_DIR": "/x"}, ("node",))
    error = ConfigError("--state-dir: cannot create /x: Not a directory (--state-dirs stay)")
    assert describe(error, origins) == (
        "TESSERA_STATE_DIR: cannot create /x: Not a directory (--state-dirs stay)"
    )
    _, origins = resolve_settings(Config, {"state_dir": "/x"}, {}, ("node",))
    assert describe(error, origins) == str(error)


def test_a_command_loaded_on_demand_is_listed_with_its_own_name_and_help():
    """``tessera --help`` lists explain, doctor, kubelet and sim from stubs, so that a start
    imports none of them; each stub says what the command itself says."""
    stubs = [c for c in TREE.subcommands if c.module is not None]
    assert {c.name for c in stubs} == {
        "explain",
        "doctor",
        "kubelet",
        "sim",
        "usage",
        "budgets",
        "uninstall",
    }
    for stub in stubs:
        full = stub.resolved()
        assert full.module is None and full is not stub
        assert (full.name, full.help) == (stub.name, stub.help)


def test_a_command_line_imports_only_the_commands_it_names(tmp_path):
    code = (
        "import sys; from agent.cli import main; main(['discover', '--simulate', 'l40s-pcie',"
        " '--state-dir', sys.argv[1], '-o', 'json']);"
        " print(sorted(m for m in sys.modules if m.startswith('agent.cli.')), file=sys.stderr)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True
    )
    loaded = result.stderr.strip().splitlines()[-1]
    assert "'agent.cli.framework'" in loaded  # what is printed is the list of modules
    for lazy in ("agent.cli.explain", "agent.cli.doctor", "agent.cli.kubelet", "agent.cli.sim"):
        assert f"'{lazy}'" not in loaded
