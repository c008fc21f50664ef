from pathlib import Path

from agent.cli.docs import render_config_docs

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_current():
    on_disk = (ROOT / "docs" / "configuration.md").read_text()
    assert on_disk == render_config_docs(), "docs/configuration.md is stale: run `make docs`"
