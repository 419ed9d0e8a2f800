"""The rollout command's checks that need no server: the dry-run plan and refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tools.cli import main
from tools.ops.rollout import process_stamp, same_process, tool_alive
from tools.paths import DEFAULT_MODEL_REPOSITORY

ROUTING = DEFAULT_MODEL_REPOSITORY / "embed" / "routing.json"


def rollout(tmp_path, *args: str) -> int:
    return main(["rollout", *args, "--records", str(tmp_path / "records")])


def test_dry_run_prints_the_plan_and_changes_nothing(tmp_path, capsys):
    existed = ROUTING.exists()
    assert rollout(tmp_path, "embed", "--to", "2", "--dry-run") == 0
    out = capsys.readouterr().out
    assert "encoder version 1 -> 2 on encoder_16, encoder_32, encoder_64, encoder_128, encoder_256" in out
    assert "1% -> 5% -> 25% -> 50% -> 100%" in out
    assert "p95 <= 200 ms (SLO)" in out and "mean cosine vs v1 >= 0.98" in out
    assert "dry run: nothing changed" in out
    assert ROUTING.exists() == existed
    assert not (tmp_path / "records").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["embed", "--to", "9"], "version 9 has no model folder"),
    (["embed", "--to", "2", "--steps", "5,50"], "the last step must be 100"),
    (["embed", "--to", "2", "--steps", "50,5,100"], "steps must rise"),
    (["embed", "--to", "1"], "version 1 already takes all traffic"),
    (["embed", "--to", "2", "--from", "2"], "--from and --to are both version 2"),
    (["embed", "--to", "2", "--max-error-rate", "1.5"], "max_error_rate must be within [0, 1)"),
    (["embed", "--to", "2", "--shadow-rate", "0"], "--shadow-rate must be within (0, 1]"),
    (["nosuch", "--to", "2"], "no embedding model 'nosuch'"),
    (["embed"], "say which version to roll out with --to VERSION"),
    (["status"], "`rollout status` needs the model name"),
])
def test_bad_requests_are_refused_with_a_reason(tmp_path, capsys, args, message):
    assert rollout(tmp_path, *args) == 2
    assert message in capsys.readouterr().err


def test_status_without_any_rollout(tmp_path, capsys):
    assert rollout(tmp_path, "status", "embed") == 0
    out = capsys.readouterr().out
    assert "no rollout of embed recorded" in out


def test_abort_without_a_running_rollout(tmp_path, capsys):
    records = tmp_path / "records"
    records.mkdir()
    (records / "embed.state.json").write_text(json.dumps({"status": "promoted", "baseline": 1, "candidate": 2}))
    assert rollout(tmp_path, "abort", "embed") == 1
    assert "no rollout of embed is running" in capsys.readouterr().out


def test_a_stamp_matches_only_the_process_that_wrote_it():
    stamp = {"pid": 4321, "pid_start_ticks": 900, "boot_id": "boot-a"}
    assert same_process(stamp, running=True, start_ticks=900, boot="boot-a")
    assert not same_process(stamp, running=False, start_ticks=None, boot="boot-a")  # the pid runs nothing
    assert not same_process(stamp, running=True, start_ticks=1500, boot="boot-a")  # the pid went to a later process
    assert not same_process(stamp, running=True, start_ticks=900, boot="boot-b")  # the machine rebooted
    # A stamp of an older tool names the pid only; where nothing more can be read, the pid decides.
    assert same_process({"pid": 4321}, running=True, start_ticks=1500, boot="boot-b")
    assert same_process(stamp, running=True, start_ticks=None, boot=None)


def test_this_process_is_alive_by_its_stamp_and_a_dead_or_reused_pid_is_not():
    mine = process_stamp(os.getpid())
    assert mine["pid_start_ticks"] is not None and mine["boot_id"]
    assert tool_alive(mine)
    assert not tool_alive({**mine, "pid_start_ticks": mine["pid_start_ticks"] + 1})  # same pid, another process
    assert not tool_alive({**mine, "boot_id": "another-boot"})
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not tool_alive(process_stamp(child.pid))
    assert not tool_alive({})  # no pid recorded: not signal 0 to our own process group


def test_abort_after_the_tool_died_and_its_pid_was_reused_rolls_back_at_once(tmp_path, capsys):
    records = tmp_path / "records"
    records.mkdir()
    # The state a rollout tool left when it was killed; its pid now belongs to this test process.
    mine = process_stamp(os.getpid())
    reused = {**mine, "pid_start_ticks": mine["pid_start_ticks"] + 1}
    state = {"status": "stepping", "baseline": 1, "candidate": 2, "model": "embed", **reused}
    (records / "embed.state.json").write_text(json.dumps(state))
    routing = ROUTING.read_text() if ROUTING.exists() else None
    try:
        assert rollout(tmp_path, "abort", "embed") == 0
        assert "the rollout tool is gone; all traffic moved back to v1" in capsys.readouterr().out
        assert json.loads((records / "embed.state.json").read_text())["status"] == "aborted"
    finally:
        if routing is None:
            ROUTING.unlink(missing_ok=True)
        else:
            ROUTING.write_text(routing)
