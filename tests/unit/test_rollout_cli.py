"""The rollout command's checks that need no server: the dry-run plan and refusals."""

from __future__ import annotations

import json

import pytest

from tools.cli import main
from tools.triton_server import DEFAULT_MODEL_REPOSITORY

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
