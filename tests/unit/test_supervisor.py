"""The crash supervisor's decision, and one poll with its I/O replaced (the stub reader itself:
tests/unit/test_stubs.py)."""

from dataclasses import replace

import pytest

from tools.server import supervisor
from tools.server.supervisor import (
    RESTART_PARAMETER,
    StubProcess,
    Supervisor,
    crashed_models,
    with_restart_marker,
)

SERVER_PID = 4242


def stubs(*entries: tuple[int, str, str]) -> dict[int, StubProcess]:
    return {pid: StubProcess(pid, model, "1", instance) for pid, model, instance in entries}


def test_a_vanished_stub_of_a_ready_model_is_a_crash():
    before = stubs((1, "encoder_16", "encoder_16_0_0"), (2, "encoder_16", "encoder_16_0_1"),
                   (3, "embed", "embed_0_0"))
    after = stubs((2, "encoder_16", "encoder_16_0_1"), (3, "embed", "embed_0_0"))
    dead = crashed_models(before, after, ready=[("encoder_16", "1"), ("embed", "1")])
    assert dead == {"encoder_16": [before[1]]}


def test_a_reload_or_an_unload_is_not_a_crash():
    before = stubs((1, "encoder_16", "encoder_16_0_0"), (2, "encoder_32", "encoder_32_0_0"))
    # encoder_16's instance came back under the same name (a reload); encoder_32 was unloaded.
    after = stubs((9, "encoder_16", "encoder_16_0_0"))
    assert crashed_models(before, after, ready=[("encoder_16", "1")]) == {}


def test_the_restart_marker_changes_the_config_and_leaves_the_original_alone():
    config = {"name": "encoder_16", "parameters": {"intra_op_threads": {"string_value": "1"}}}
    changed = with_restart_marker(config, 3)
    assert changed["parameters"][RESTART_PARAMETER] == {"string_value": "3"}
    assert changed["parameters"]["intra_op_threads"] == {"string_value": "1"}
    assert RESTART_PARAMETER not in config["parameters"]
    assert with_restart_marker({"name": "m"}, 1)["parameters"] == {RESTART_PARAMETER: {"string_value": "1"}}


def test_one_poll_reloads_each_crashed_model_once_logs_it_and_unlinks_the_dead_stubs_regions(monkeypatch):
    before = stubs((1, "encoder_16", "encoder_16_0_0"), (2, "encoder_16", "encoder_16_0_1"),
                   (3, "encoder_32", "encoder_32_0_0"))
    before[1] = replace(before[1], shm_region="triton_python_backend_shm_region_a")  # the other has none
    removed = []
    monkeypatch.setattr(supervisor, "remove_shm_regions", lambda names: removed.extend(names))
    after = stubs((3, "encoder_32", "encoder_32_0_0"))
    scans = iter([after, after])
    monkeypatch.setattr(supervisor, "scan_stubs", lambda pid: next(scans))
    lines, reloads = [], []
    watcher = Supervisor("http://localhost:1", SERVER_PID, log=lines.append)
    monkeypatch.setattr(watcher, "ready_versions", lambda: {("encoder_16", "1"), ("encoder_32", "1")})

    def reload(model, dead):
        reloads.append((model, sorted(s.pid for s in dead)))
        return {"ok": True, "reload_s": 1.5}

    monkeypatch.setattr(watcher, "reload", reload)
    assert watcher.check(before) == after
    assert reloads == [("encoder_16", [1, 2])]
    assert removed == ["triton_python_backend_shm_region_a"]  # the server does not unlink a dead stub's
    assert lines == ["supervisor: encoder_16: instance encoder_16_0_0 (pid 1), encoder_16_0_1 (pid 2) died; "
                     "reloading the model", "supervisor: encoder_16: back after 1.5 s"]


def test_a_poll_with_every_stub_alive_asks_the_server_nothing(monkeypatch):
    alive = stubs((1, "encoder_16", "encoder_16_0_0"))
    monkeypatch.setattr(supervisor, "scan_stubs", lambda pid: alive)
    watcher = Supervisor("http://localhost:1", SERVER_PID)
    monkeypatch.setattr(watcher, "ready_versions", lambda: pytest.fail("no stub died: nothing to ask"))
    assert watcher.check(alive) == alive
