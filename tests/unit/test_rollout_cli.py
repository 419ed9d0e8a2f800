"""The rollout command's checks that need no server: the dry-run plan and refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from python_backends.common.drift import DriftMeasure
from tools.cli import main
from tools.ops.rollout import (
    Recorder,
    RolloutError,
    RolloutLock,
    lock_path,
    make_plan,
    request_abort,
    rollout_running,
)
from tools.paths import DEFAULT_MODEL_REPOSITORY, DEFAULT_SPEC, REPO_ROOT

ROUTING = DEFAULT_MODEL_REPOSITORY / "embed" / "routing.json"


def rollout(tmp_path, *args: str) -> int:
    return main(["rollout", *args, "--records", str(tmp_path / "records")])


def test_dry_run_prints_the_plan_and_changes_nothing(tmp_path, capsys):
    existed = ROUTING.exists()
    assert rollout(tmp_path, "embed", "--to", "2", "--dry-run") == 0
    out = capsys.readouterr().out
    assert ("encoder version 1 -> 2 on encoder_16, encoder_32, encoder_64, encoder_128, encoder_256, encoder_express"
            in out)
    assert "1% -> 5% -> 25% -> 50% -> 100%" in out
    assert "p95 <= 200 ms (SLO)" in out and "mean cosine vs v1 >= 0.98" in out
    assert "dry run: nothing changed" in out
    assert ROUTING.exists() == existed
    assert not (tmp_path / "records").exists()


def test_the_plan_states_the_drift_gate_of_the_models_measure():
    def gates_line(**drift) -> str:
        plan = make_plan(DEFAULT_SPEC, "embed", DEFAULT_MODEL_REPOSITORY, 2, **drift)
        return next(line for line in plan.describe().splitlines() if line.startswith("  gates: "))

    assert "; mean cosine vs v1 >= 0.98 on a 20% shadowed sample; " in gates_line()
    assert ("; top-1 agreement vs v1 >= 0.995 and largest logit difference <= 0.25 on a 20% shadowed sample; "
            in gates_line(drift=DriftMeasure.TOP1, min_top1_agreement=0.995, max_logit_diff=0.25))
    assert ("; largest absolute difference vs v1 <= 0.003 (judged at the histogram edge 0.0025) on a 20% "
            "shadowed sample; " in gates_line(drift=DriftMeasure.ABS_DIFF, tolerance=0.003))
    with pytest.raises(RolloutError, match="the abs_diff drift gate needs a declared tolerance"):
        make_plan(DEFAULT_SPEC, "embed", DEFAULT_MODEL_REPOSITORY, 2, drift=DriftMeasure.ABS_DIFF)


@pytest.mark.parametrize(("args", "message"), [
    (["embed", "--to", "9"], "version 9 has no model folder"),
    (["embed", "--to", "2", "--steps", "5,50"], "the last step must be 100"),
    (["embed", "--to", "2", "--steps", "50,5,100"], "steps must rise"),
    (["embed", "--to", "1"], "version 1 already takes all traffic"),
    (["embed", "--to", "2", "--from", "2"], "--from and --to are both version 2"),
    (["embed", "--to", "2", "--max-error-rate", "1.5"], "max_error_rate must be within [0, 1)"),
    (["embed", "--to", "2", "--shadow-rate", "0"], "--shadow-rate must be within (0, 1]"),
    (["embed", "--to", "2", "--min-top1-agreement", "1.5"], "min_top1_agreement must be within [0, 1], got 1.5"),
    (["embed", "--to", "2", "--max-logit-diff", "0"], "max_logit_diff must be >= 0.0001"),
    (["embed", "--to", "2", "--tolerance", "-1"], "tolerance must be >= 0.0001"),
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


def test_a_held_lock_is_a_running_rollout_and_a_second_one_is_refused(tmp_path):
    records = tmp_path / "records"
    assert not rollout_running(records, "embed")
    assert not records.exists()  # asking creates nothing
    first, second = RolloutLock(records, "embed"), RolloutLock(records, "embed")
    assert first.acquire()
    try:
        assert rollout_running(records, "embed")
        assert not second.acquire()
        assert not rollout_running(records, "other")  # one lock per model
    finally:
        first.release()
    assert not rollout_running(records, "embed")
    assert second.acquire()
    second.release()


def test_the_lock_of_a_killed_tool_is_released_by_the_system(tmp_path):
    records = tmp_path / "records"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from tools.ops.rollout import RolloutLock; "
         "lock = RolloutLock(Path(sys.argv[1]), 'embed'); assert lock.acquire(); print(flush=True); sys.stdin.read()",
         str(records)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        holder.stdout.readline()
        assert rollout_running(records, "embed")
        holder.kill()  # no chance to release anything
        holder.wait()
        assert lock_path(records, "embed").exists()  # the file stays; the lock on it does not
        assert not rollout_running(records, "embed")
    finally:
        holder.kill()
        holder.wait()


def test_a_second_rollout_is_refused_while_one_runs(tmp_path, capsys):
    records = tmp_path / "records"
    records.mkdir()
    (records / "embed.state.json").write_text(json.dumps({"status": "step 5%", "baseline": 1, "candidate": 2,
                                                           "model": "embed", "pid": 4321}))
    running = RolloutLock(records, "embed")
    assert running.acquire()
    try:
        assert rollout(tmp_path, "embed", "--to", "2", "--dry-run") == 2
        assert "a rollout of embed is already running (pid 4321)" in capsys.readouterr().err
        assert rollout(tmp_path, "status", "embed") == 0
        assert "rollout v1 -> v2: step 5% (tool running)" in capsys.readouterr().out
    finally:
        running.release()
    assert rollout(tmp_path, "status", "embed") == 0
    assert "(tool no longer running: `rollout abort`)" in capsys.readouterr().out


def test_abort_after_the_tool_died_and_its_pid_was_reused_rolls_back_at_once(tmp_path, capsys):
    records = tmp_path / "records"
    records.mkdir()
    # The state a rollout tool left when it was killed; its pid now belongs to this test process,
    # which runs, but holds no rollout lock.
    state = {"status": "stepping", "baseline": 1, "candidate": 2, "model": "embed", "pid": os.getpid()}
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


def test_an_abort_request_survives_the_running_tool_saving_its_state(tmp_path):
    # The tool rewrites its state file at every check; a request written into that file was
    # lost when the tool saved between reading it and the request landing.
    plan = make_plan(DEFAULT_SPEC, "embed", DEFAULT_MODEL_REPOSITORY, 2)
    recorder = Recorder(tmp_path, "embed")
    recorder.start(plan)
    assert not recorder.abort_requested()
    request_abort(tmp_path, "embed")
    recorder.event("step 10%: v2 takes 10% of unpinned traffic")  # saves the state file
    assert recorder.abort_requested()
    Recorder(tmp_path, "embed").start(plan)  # the next rollout does not inherit it
    assert not recorder.abort_requested()
