"""docs/tuning.md as written: `search` and `tune` on embed against a real tritonserver, and
`tune --reset`, in a scratch serving home (`KIT_HOME`): the checkout's spec, a copy of its
profile, and a repository whose configs are copies (gen-config writes them) and whose model
files are hard links (only read)."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tests.doc_examples import REPO, run_shown, shown
from tools.bench.payloads import find_model
from tools.bench.search import derived_config
from tools.clients.tenant_token import ensure_key
from tools.planning.search import JOINT, KnobSet
from tools.spec.profile import TunedModel, load_profile, save_profile
from tools.spec.serving import load_spec

pytestmark = pytest.mark.integration

MODELS = ("embed", "encoder_16", "encoder_32", "encoder_64", "encoder_128", "encoder_256", "llm", "llm_infer")


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """A serving home with the checkout's spec and models, whose configs and profile may be written."""
    folder = tmp_path_factory.mktemp("tuning-home")
    shutil.copy2(REPO / "serving.toml", folder / "serving.toml")
    (folder / "profiles").mkdir()
    shutil.copy2(REPO / "profiles" / "cpu.json", folder / "profiles" / "cpu.json")
    shutil.copytree(REPO / "loadtest" / "workloads", folder / "loadtest" / "workloads")
    ensure_key(folder / "build" / "tenant_keys.json")
    for name in MODELS:
        source = REPO / "model_repository" / name
        for path in source.rglob("*"):
            target = folder / "model_repository" / name / path.relative_to(source)
            if path.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            elif path.name in ("config.pbtxt", "model.py"):  # written by gen-config: never a link
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(path, target)
    return folder


def run(command: str, folder: Path, timeout_s: float = 300) -> str:
    done = run_shown(command, folder, timeout_s=timeout_s, KIT_HOME=str(folder))
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def derived_knobs(folder: Path) -> dict[str, KnobSet]:
    """The knobs gen-config derives for embed in the home (its tuned entry left out)."""
    spec = load_spec(folder / "serving.toml")
    return derived_config(spec, find_model(spec, "embed"), load_profile(folder / "profiles" / "cpu.json"))


def configs(folder: Path) -> dict[str, str]:
    return {path.parent.name: path.read_text() for path in sorted((folder / "model_repository").glob("*/config.pbtxt"))}


def test_search_measures_within_its_budget_and_writes_every_point(home):
    started = time.monotonic()
    out = run(shown("docs/tuning.md", "python -m tools search embed --quick --budget-min 0.5"), home)
    took = time.monotonic() - started
    report = json.loads((home / "results" / "search_embed.json").read_text())
    assert (report["kind"], report["model"], report["slo_ms"], report["workload"]) == ("search", "embed", 200,
                                                                                      "embed_mix")
    assert report["options"]["step_s"] == 1.0 and report["top_k"] == 1 and report["points_per_bucket"] == 1
    points = report["points"]
    assert points and took < 30 + points[-1]["measure_s"] + 20  # no point starts that would overrun much
    first = points[0]
    if first["phase"] == "bucket":  # phase 1 runs first, unless the server's start took half the budget
        assert first["bucket"] == "encoder_16" and list(first["config"]) == ["encoder_16"]
        assert all(step["mix_rps"] == pytest.approx(step["offered_rps"] / 0.5, rel=0.01) for step in first["steps"])
    for point in points:
        assert point["measure_s"] > 0 and point["steps"] and point["goodput_rps"] >= 0
        assert all(set(knobs) == {"max_batch_size", "preferred_batch_size", "max_queue_delay_us", "instance_count"}
                   for knobs in point["config"].values())
    joint = [p for p in points if p["bucket"] == JOINT]  # the full mix: other edges' points and phase 2's
    if joint:
        assert report["best"] in joint and report["best"]["goodput_rps"] >= 0.95 * max(p["goodput_rps"] for p in joint)
    else:
        assert report["best"] is None
    assert report["edge_sets"] == [[24, 64, 128, 256], [8, 16, 32, 64, 128, 256]]
    for point in points:  # a point on other edges ran them: the router answered every request
        if point["edges"]:
            assert point["phase"] == "edges" and point["edges"] in report["edge_sets"]
            assert point["goodput_rps"] > 0 and all(step["errors"] == 0 for step in point["steps"] if step["passed"])
    assert report["measure_s"] == pytest.approx(sum(p["measure_s"] for p in points), abs=0.5)
    assert (home / "results" / "search_embed.png").stat().st_size > 1000
    assert f"wrote results/search_embed.json ({len(points)} points" in out
    # The server served a copy: the home's configs are as they were.
    assert "tuned by" not in "".join(configs(home).values())


@pytest.mark.slow  # a second server start and more points: the resume itself is unit-tested
def test_search_run_again_resumes_without_measuring_a_point_twice(home):
    before = json.loads((home / "results" / "search_embed.json").read_text())["points"]
    out = run(shown("docs/tuning.md", "python -m tools search embed --quick --budget-min 0.5"), home)
    report = json.loads((home / "results" / "search_embed.json").read_text())
    assert f"resuming results/search_embed.json: {len(before)} point(s)" in out
    assert report["points"][:len(before)] == before and len(report["server_start_s"]) == 2
    keys = [(p["phase"], p["bucket"], json.dumps(p["config"], sort_keys=True)) for p in report["points"]]
    assert len(keys) == len(set(keys))


def test_tune_starts_from_the_derived_configuration_and_a_dry_run_writes_nothing(home):
    profile_before, configs_before = (home / "profiles" / "cpu.json").read_bytes(), configs(home)
    out = run(shown("docs/tuning.md", "python -m tools tune embed --quick --budget-min 0.5 --dry-run"), home)
    report = json.loads((home / "results" / "tune_embed.json").read_text())
    assert report["kind"] == "tune" and report["rounds"] == 2
    points = report["points"]
    derived = {name: KnobSet.from_dict(knobs) for name, knobs in report["derived"].items()}
    assert points[0]["phase"] == "derived" and points[0]["bucket"] == JOINT
    assert {name: KnobSet.from_dict(k) for name, k in points[0]["config"].items()} == derived
    assert derived == derived_knobs(home)  # what gen-config derives here
    for point in points[1:]:  # one knob of one bucket model, one step away
        config = {name: KnobSet.from_dict(k) for name, k in point["config"].items()}
        changed = [(name, knob) for name in config for knob, value in config[name].as_dict().items()
                   if value != derived[name].as_dict()[knob]]
        if point["phase"] == "neighbour":
            assert len(changed) == 1 and changed[0][0] == point["bucket"]
    assert (home / "profiles" / "cpu.json").read_bytes() == profile_before and configs(home) == configs_before
    assert "the derived configuration held" in out or "--dry-run: " in out


def test_reset_removes_the_tuned_entry_and_generates_the_configs_again(home):
    path = home / "profiles" / "cpu.json"
    entry = TunedModel(knobs={"encoder_32": {"max_queue_delay_us": 20000}}, tuned_at="2026-11-27T10:00:00Z",
                       command="python -m tools tune embed --budget-min 30", slo_p95_ms=200,
                       derived_goodput_rps=52.5, tuned_goodput_rps=60.0, rounds=3)
    save_profile(replace(load_profile(path), tuned={"embed": entry}), path)
    done = run_shown("python -m tools gen-config", home, KIT_HOME=str(home))
    assert done.returncode == 0, done.stderr
    header = configs(home)["encoder_32"]
    derived_delay = derived_knobs(home)["encoder_32"].max_queue_delay_us
    assert "# tuned by `python -m tools tune embed --budget-min 30` on 2026-11-27: max_queue_delay_microseconds " \
           f"{derived_delay} -> 20000; the model's goodput 52.5 -> 60.0 req/s (medians of 3 rounds)" in header
    assert "max_queue_delay_microseconds: 20000" in header
    out = run(shown("docs/tuning.md", "python -m tools tune embed --reset"), home)
    assert "removed the tuned entry of embed" in out
    assert load_profile(path).tuned == {}
    assert "tuned by" not in "".join(configs(home).values())
    check = run_shown("python -m tools gen-config --check", home, KIT_HOME=str(home))
    assert check.returncode == 0, check.stderr
