"""`search` and `tune` without a server: their errors, resuming refused, what a finished climb
writes (a real climb fed hand-built results), and `tune --reset`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench.payloads import find_model
from tools.bench.search import bucket_spaces, derived_config
from tools.cli.tune import conclude, reset
from tools.planning.search import KnobSet, TuneClimb
from tools.spec.profile import TunedModel, load_profile, save_profile
from tools.spec.serving import load_spec

REPO = Path(__file__).resolve().parents[2]


def tools(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize("command", ["search", "tune"])
def test_help_explains_the_policy_and_the_examples(command):
    done = tools(command, "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "phase 1 measures each bucket model alone at its traffic share" in text
    assert "a per-bucket candidate that only wins jointly is missed" in text
    assert f"python -m tools {command} embed" in text


@pytest.mark.parametrize(("args", "message"), [
    (["search", "nosuch"], "no model 'nosuch'; the spec's [models]: embed"),
    (["tune", "llm"], "'llm' is a generative model"),
])
def test_an_unknown_model_is_one_line(args, message):
    done = tools(*args)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args", [["search", "embed", "--budget-min", "0"], ["tune", "embed", "--rounds", "0"],
                                  ["tune", "embed", "--min-gain", "-1"], ["search", "embed", "--top-k", "0"]])
def test_arguments_are_checked_where_declared(args):
    done = tools(*args)
    assert done.returncode == 2 and "must be" in done.stderr


def test_a_search_refuses_to_resume_another_run_and_says_what_to_do(tmp_path):
    out = tmp_path / "search_embed.json"
    out.write_text(json.dumps({"kind": "tune", "points": []}))
    done = tools("search", "embed", "--quick", "--out", str(out))
    assert done.returncode == 2
    assert done.stderr.strip() == (f"error: {out} holds a run of another kind ('tune'; this run: 'search'); pass "
                                   "--restart to measure from scratch, or another --out")
    out.write_text("{")
    done = tools("search", "embed", "--quick", "--out", str(out))
    assert done.returncode == 2 and "is not a search report" in done.stderr


@pytest.fixture
def home(tmp_path):
    """The checkout's spec with a copy of its profile and an empty repository to generate into."""
    shutil.copy2(REPO / "profiles" / "cpu.json", tmp_path / "cpu.json")
    (tmp_path / "repository").mkdir()
    spec = load_spec(REPO / "serving.toml")
    return spec, find_model(spec, "embed"), load_profile(tmp_path / "cpu.json"), tmp_path / "repository"


def finished_climb(spec, model, profile, better: bool) -> TuneClimb:
    """A climb to its end, each point's goodput from a hand-made table: with `better`, one more
    instance of encoder_16 serves 20% more."""
    seed = derived_config(spec, model, profile)
    climb = TuneClimb(seed, bucket_spaces(spec, model, profile), rounds=2)
    winner = {**seed, "encoder_16": KnobSet(**{**seed["encoder_16"].as_dict(), "instance_count": 3})}
    while (proposal := climb.next_point()) is not None:
        climb.record(proposal, 60.0 if better and proposal.config == winner else 50.0, 1.0)
    return climb


def test_a_better_neighbour_is_written_to_the_profile_and_the_configs(home, capsys):
    spec, model, profile, repository = home
    climb = finished_climb(spec, model, profile, better=True)
    assert conclude(spec, model, profile, climb, "python -m tools tune embed", False, repository) == 0
    entry = load_profile(profile.path).tuned["embed"]
    assert entry.knobs == {"encoder_16": {"instance_count": 3}} and entry.rounds == 2
    assert (entry.derived_goodput_rps, entry.tuned_goodput_rps, entry.command) == (50.0, 60.0,
                                                                                   "python -m tools tune embed")
    header = (repository / "encoder_16" / "config.pbtxt").read_text()
    assert "# tuned by `python -m tools tune embed` on " in header and "instance_count 2 -> 3" in header
    assert "count: 3" in header
    assert "goodput 50.0 -> 60.0 req/s" in capsys.readouterr().out


def test_a_dry_run_prints_and_writes_nothing(home, capsys):
    spec, model, profile, repository = home
    before = profile.path.read_bytes()
    climb = finished_climb(spec, model, profile, better=True)
    assert conclude(spec, model, profile, climb, "python -m tools tune embed", True, repository) == 0
    out = capsys.readouterr().out
    assert "encoder_16: tuned by `python -m tools tune embed`" in out and "--dry-run" in out
    assert profile.path.read_bytes() == before and not any(repository.iterdir())


def test_when_the_derived_configuration_holds_nothing_is_written(home, capsys):
    spec, model, profile, repository = home
    before = profile.path.read_bytes()
    assert conclude(spec, model, profile, finished_climb(spec, model, profile, False), "c", False, repository) == 0
    assert "the derived configuration held (50.0 req/s, median of 1): no tuned entry written" in \
        capsys.readouterr().out
    assert profile.path.read_bytes() == before


def test_reset_removes_the_entry_and_generates_the_configs_again(home, capsys):
    spec, model, profile, repository = home
    assert reset(spec, model, profile, repository) == 0
    assert "has no tuned entry for embed: nothing to reset" in capsys.readouterr().out
    entry = TunedModel(knobs={"encoder_16": {"instance_count": 3}}, tuned_at="2026-11-27T00:00:00Z", command="c",
                       slo_p95_ms=200, derived_goodput_rps=50, tuned_goodput_rps=60, rounds=3)
    from dataclasses import replace

    save_profile(replace(profile, tuned={"embed": entry}), profile.path)
    assert reset(spec, model, load_profile(profile.path), repository) == 0
    assert load_profile(profile.path).tuned == {}
    assert "tuned by" not in (repository / "encoder_16" / "config.pbtxt").read_text()
