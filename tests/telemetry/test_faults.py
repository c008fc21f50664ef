"""Sticky GPU faults survive a restart of the agent, within one boot (agent/telemetry/faults.py)."""

from __future__ import annotations

import json
import logging

import pytest

from agent.telemetry.faults import FAULTS_FILE, FaultStore

LOG = logging.getLogger("test.faults")


def test_faults_round_trip_within_one_boot_and_are_written_only_when_they_change(tmp_path):
    store = FaultStore(tmp_path, "boot-a", LOG)
    assert store.load(0) == {}
    store.save({})  # nothing held, nothing there: no file
    assert not (tmp_path / FAULTS_FILE).exists()
    store.save({"GPU-1": (48, 1.7e9), "GPU-0": (79, 1.8e9)})
    written = (tmp_path / FAULTS_FILE).stat().st_mtime_ns
    store.save({"GPU-0": (79, 1.8e9), "GPU-1": (48, 1.7e9)})  # the same: not written again
    assert (tmp_path / FAULTS_FILE).stat().st_mtime_ns == written
    assert FaultStore(tmp_path, "boot-a", LOG).load(0) == {
        "GPU-0": (79, 1.8e9),
        "GPU-1": (48, 1.7e9),
    }
    store.save({})  # recovered: the file says so
    assert FaultStore(tmp_path, "boot-a", LOG).load(0) == {}


def test_another_boots_faults_are_dropped_a_reboot_resets_the_gpus(tmp_path, caplog):
    FaultStore(tmp_path, "boot-a", LOG).save({"GPU-1": (48, 1.7e9)})
    with caplog.at_level(logging.INFO):
        assert FaultStore(tmp_path, "boot-b", LOG).load(0) == {}
    assert "from another boot" in caplog.text


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"[]",
        json.dumps({"version": 2, "bootId": "boot-a", "gpus": {}}).encode(),
        json.dumps({"version": 1, "bootId": "boot-a", "gpus": {"GPU-1": {"xid": "48"}}}).encode(),
        json.dumps(
            {"version": 1, "bootId": "boot-a", "gpus": {"GPU-1": {"xid": 48, "since": True}}}
        ).encode(),
        b"[" * 100 + b"]" * 100,
    ],
    ids=["not-json", "array", "version", "xid-string", "since-bool", "deep"],
)
def test_a_broken_file_is_moved_aside_and_the_agent_starts_without_it(tmp_path, caplog, content):
    (tmp_path / FAULTS_FILE).write_bytes(content)
    assert FaultStore(tmp_path, "boot-a", LOG).load(1.7e9) == {}
    assert "moved aside" in caplog.text
    assert not (tmp_path / FAULTS_FILE).exists()
    assert len(list(tmp_path.glob(f"{FAULTS_FILE}.corrupt-*"))) == 1


def test_a_failed_save_is_logged_and_not_raised(tmp_path, caplog):
    store = FaultStore(tmp_path / "missing" / "dir", "boot-a", LOG)
    (tmp_path / "missing").write_text("a file where the directory should be")
    store.save({"GPU-1": (48, 1.7e9)})
    assert "a restart would forget them" in caplog.text
