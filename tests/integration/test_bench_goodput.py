"""The goodput benchmark's short form, end to end against real tritonservers: the built-in
`embed`, a user's tensor model bucketed by its frame count (the suite's audio model, in a
serving home of its own), and a model of the user's own Triton repository (external)."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.user_models import EXTERNAL_MODEL, audio_conv_onnx, external_repository

REPO = Path(__file__).resolve().parents[2]
REPORT_KEYS = {"model", "hardware", "slo_ms", "workload", "workload_file", "criterion", "command", "measured_at",
               "rounds", "load_generator", "setups", "ceiling_rps", "ceiling_rps_by_round", "ceiling", "ratios",
               "light_load", "router_overhead_ms", "router_cpu_ms_per_request", "router_overhead"}
HOME_SPEC = """# A user's serving home: their audio model only.
profile = "profiles/cpu.json"

[hardware.cpu]
max_instances = 2
intra_op_threads = 1
ort_spinning = false

[tenants.auth]
mode = "off"
"""
FRAMES_MIX = """name = "frames"
rows_per_request = 2

[[lengths]]
min_tokens = 5
max_tokens = 16
weight = 0.6

[[lengths]]
min_tokens = 17
max_tokens = 64
weight = 0.4
"""


def test_quick_goodput_benchmark_writes_json_and_plot(tmp_path):
    out = tmp_path / "goodput.json"
    result = subprocess.run(
        [sys.executable, "-m", "tools", "bench", "goodput", "--quick", "--setups", "slo_bucketed",
         "--start-rps", "8", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["model"] == "embed" and report["slo_ms"] == 200
    assert report["load_generator"] == {"protocol": "http", "on_the_measured_machine": True}
    assert report["hardware"]["cpu_count"] >= 1 and report["hardware"]["description"]
    setup = report["setups"]["slo_bucketed"]
    assert setup["goodput_rps"] >= 8  # 8 req/s is far below this machine's capacity
    # One round (the short form's default), a search and a ceiling; the figures are the rounds'
    # medians (tests/unit/test_bench_goodput.py takes medians of several).
    assert report["rounds"] == 1 and len(setup["goodput_rps_by_round"]) == 1
    assert setup["goodput_rps"] == statistics.median(setup["goodput_rps_by_round"])
    assert {step["round"] for step in setup["steps"]} == {1}
    assert len(report["ceiling_rps_by_round"]) == 1
    assert report["ceiling_rps"] == pytest.approx(statistics.median(report["ceiling_rps_by_round"]), abs=0.1)
    ratios = report["ratios"]["slo_bucketed_vs_ceiling_by_round"]
    assert ratios == [pytest.approx(g / c, abs=0.01) for g, c in
                      zip(setup["goodput_rps_by_round"], report["ceiling_rps_by_round"], strict=True)]
    assert report["ratios"]["slo_bucketed_vs_ceiling"] == pytest.approx(statistics.median(ratios), abs=0.002)
    for step in setup["steps"]:
        assert {"offered_rps", "p50_ms", "p95_ms", "p99_ms", "num_errors", "goodput_fraction"} <= set(step)
    assert report["ceiling_rps"] > setup["goodput_rps"]
    assert set(report["ceiling"]["buckets"]) == {"16", "32", "64", "128", "256"}
    for bucket in report["ceiling"]["buckets"].values():  # the better of the two ways to use every core
        ways = bucket["seconds_by_way"]
        assert set(ways) == {"one_session_all_cores", "one_thread_per_core"}
        assert bucket["seconds"] == min(ways.values()) and ways[bucket["way"]] == bucket["seconds"]
    assert out.with_suffix(".png").stat().st_size > 1000
    assert set(report) == REPORT_KEYS
    assert report["workload_file"] == "loadtest/workloads/embed_mix.toml"
    # Light load, in the short form's first round: the short requests at 10% of expected_rps on the
    # slo_bucketed server, then one at a time on the linger-free one.
    light = report["light_load"]
    assert light["rate_rps"] == pytest.approx(0.1 * 40) and light["short_bucket"] == "16"
    assert light["rounds"] == 1 and light["num_requests"] == [20] and light["num_errors"] == 0
    assert light["p50_ms"] > 0 and light["unbatched_p50_ms"] > 0 and light["p95_ms"] >= light["p50_ms"]
    assert light["ratio"] == pytest.approx(light["p50_ms"] / light["unbatched_p50_ms"], rel=0.01)
    overhead, detail = report["router_overhead_ms"], report["router_overhead"]
    assert set(overhead) == {"p50", "p95"}
    assert detail["num_pairs"] == [40] and detail["num_errors"] == 0
    router_ms, direct_ms = detail["router_ms"]["p50_ms"], detail["direct_ms"]["p50_ms"]
    assert router_ms > 0 and direct_ms > 0
    assert abs(overhead["p50"]) < router_ms  # a difference of two latencies, not a latency
    # The floor: a Python model that only forwards the short bucket's rows, in turn with both.
    floor = detail["python_floor_ms"]
    assert floor["bucket"] == "encoder_16" and floor["num_triples"] == [40]
    assert all(isinstance(floor[key], float) for key in ("p50", "p95", "router_p50", "router_p95", "own_p50"))
    assert floor["p50"] > 0  # one more hop through a Python stub costs something
    # Where the two Python models spend a request inside the server, from Triton's statistics.
    for side in ("router", "forward"):
        assert set(floor["server_ms"][side]) == {"queue", "input", "in_stub", "output"}
    assert floor["server_ms"]["forward"]["in_stub"] > 0  # a stub's own work and round trips beside the BLS call
    # None where the router answered some requests from its workers (its statistics end at execute's return)
    assert floor["server_ms"]["router"]["in_stub"] is None or floor["server_ms"]["router"]["in_stub"] > 0
    assert {"tritonserver", "embed", "encoder_16"} <= set(detail["cpu_ms_per_request_router_phase"])
    assert report["router_cpu_ms_per_request"] == pytest.approx(
        sum(ms for part, ms in detail["cpu_ms_per_request_router_phase"].items() if not part.startswith("encoder_"))
        - sum(ms for part, ms in detail["cpu_ms_per_request_direct_phase"].items() if not part.startswith("encoder_")),
        abs=0.002)


@pytest.mark.slow  # a whole short run on another mix; the unit tests check where each mix goes
def test_another_mix_gets_configs_derived_for_it_and_a_result_file_beside_the_default(tmp_path):
    out = tmp_path / "goodput.json"
    result = subprocess.run(
        [sys.executable, "-m", "tools", "bench", "goodput", "--quick", "--setups", "slo_bucketed",
         "--start-rps", "8", "--mixes", "embed_bimodal", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert not out.exists()  # the spec's own mix was not asked for
    report = json.loads((tmp_path / "goodput.embed_bimodal.json").read_text())
    assert (report["workload"], report["workload_file"]) == ("embed_bimodal", "loadtest/workloads/embed_bimodal.toml")
    assert report["setups"]["slo_bucketed"]["goodput_rps"] >= 8
    served = (REPO / report["setups"]["slo_bucketed"]["repository"] / "encoder_16" / "config.pbtxt").read_text()
    assert "embed_bimodal.toml: 70.0%" in served  # the bucket's traffic share is the mix's
    assert report["light_load"]["p50_ms"] > 0


def in_home(home: Path, *args: str) -> subprocess.CompletedProcess:
    """A tools command on the serving home `home` (KIT_HOME)."""
    done = subprocess.run([sys.executable, "-m", "tools", *args], cwd=home, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "KIT_HOME": str(home), "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.mark.slow  # three server starts and a profile: a load run; the embed case above is CI's short form
def test_a_tensor_model_bucketed_by_frames_gets_the_same_setups_and_report(tmp_path):
    home = tmp_path / "home"
    (home / "model_repository").mkdir(parents=True)
    (home / "serving.toml").write_text(HOME_SPEC)
    (home / "frames.toml").write_text(FRAMES_MIX)
    audio = audio_conv_onnx(tmp_path / "my-models")
    in_home(home, "add-model", "audio", "--onnx", str(audio), "--buckets", "16,64", "--workload", "frames.toml",
            "--slo-ms", "300", "--expected-rps", "8", "--peak-rps", "20", "--tolerance", "0.001")
    in_home(home, "profile", "--model", "audio", "--time-per-point", "0.2", "--overhead-requests", "20")
    out = tmp_path / "goodput_audio.json"
    # The short steps of a smoke run: what is checked is that every setup serves the frames.
    in_home(home, "bench", "goodput", "--model", "audio", "--step-seconds", "1", "--max-steps", "2", "--repeats", "1",
            "--start-rps", "8", "--out", str(out))
    report = json.loads(out.read_text())
    assert set(report) == REPORT_KEYS
    assert (report["model"], report["workload"], report["slo_ms"]) == ("audio", "frames", 300)
    assert set(report["setups"]) == {"no_batching", "default_batching", "slo_bucketed"}
    for name, setup in report["setups"].items():
        assert setup["goodput_rps"] >= 8, name  # far below what the machine serves of this small model
        assert all(step["num_errors"] == 0 for step in setup["steps"]), name
    # The baselines send every clip to the largest bucket; the kit's router to the smallest that holds it.
    served = {name: {key.split(".")[1] for step in setup["steps"] for key, value in step.items()
                     if key.endswith(".inference_count") and value} for name, setup in report["setups"].items()}
    assert served["no_batching"] == served["default_batching"] == {"audio", "audio_64"}
    assert served["slo_bucketed"] == {"audio", "audio_16", "audio_64"}
    ceiling = report["ceiling"]
    assert set(ceiling["buckets"]) == {"16", "64"} and ceiling["rows"] == 1000
    assert report["ceiling_rps"] > report["setups"]["slo_bucketed"]["goodput_rps"]
    assert out.with_suffix(".png").stat().st_size > 1000


def user_files(repository: Path) -> dict[str, str]:
    """Each file's digest in the user's repository (Python's bytecode caches, which the server's
    stubs write beside a model.py, left out)."""
    return {str(p.relative_to(repository)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(repository.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


@pytest.mark.slow  # three server starts and a profile: a load run; the embed case above is CI's short form
def test_an_external_model_is_benchmarked_on_copies_of_its_folder_and_has_no_ceiling(tmp_path):
    home = tmp_path / "home"
    (home / "model_repository").mkdir(parents=True)
    (home / "serving.toml").write_text(HOME_SPEC)
    user_repository = external_repository(home)
    in_home(home, "add-model", "scorer", "--external", f"user-repository/{EXTERNAL_MODEL}", "--slo-ms", "200",
            "--expected-rps", "20", "--peak-rps", "50")
    in_home(home, "profile", "--model", "scorer", "--time-per-point", "0.2", "--overhead-requests", "20")
    before = user_files(user_repository)
    out = tmp_path / "goodput_scorer.json"
    in_home(home, "bench", "goodput", "--model", "scorer", "--step-seconds", "1", "--max-steps", "2", "--repeats",
            "1", "--start-rps", "8", "--out", str(out))
    assert user_files(user_repository) == before  # the user's repository is only read
    report = json.loads(out.read_text())
    assert set(report) == REPORT_KEYS | {"ceiling_note"}
    assert (report["model"], report["workload"], report["slo_ms"]) == ("scorer", None, 200)
    assert report["ceiling_rps"] is None and report["ceiling"] is None and report["ceiling_rps_by_round"] == []
    assert "external model" in report["ceiling_note"]
    assert set(report["ratios"]) == {"slo_bucketed_vs_default_batching", "slo_bucketed_vs_no_batching"}
    assert set(report["setups"]) == {"no_batching", "default_batching", "slo_bucketed"}
    for name, setup in report["setups"].items():
        assert setup["goodput_rps"] >= 8, name  # far below what the machine serves of this small model
        assert all(step["num_errors"] == 0 for step in setup["steps"]), name
        served = {key.split(".")[1] for step in setup["steps"] for key, value in step.items()
                  if key.endswith(".inference_count") and value}
        assert "scorer" in served, name  # through the router, which answers only with the user's model's rows
    assert out.with_suffix(".png").stat().st_size > 1000


def test_unknown_setup_is_refused():
    result = subprocess.run([sys.executable, "-m", "tools", "bench", "goodput", "--setups", "fastest"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "unknown setups ['fastest']" in result.stderr


def test_zero_rounds_are_refused():
    result = subprocess.run([sys.executable, "-m", "tools", "bench", "goodput", "--repeats", "0"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--repeats must be >= 1, got 0" in result.stderr


def test_a_model_the_spec_does_not_have_is_refused_with_the_specs_models():
    result = subprocess.run([sys.executable, "-m", "tools", "bench", "goodput", "--model", "rerank"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "no model 'rerank'; the spec's [models]: embed" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
