"""Locust load runs against the real tritonserver: the commands docs/loadtests.md shows.

Each test runs a shown command as written (`make loadtest ...`, or the distributed master and
workers), pointed at the session's server and shortened only through the `LOCUST_*`
variables the command leaves to the environment, with Locust's reports and the SLO verdict
going to the test's folder. It reads what a pipeline would read: the exit code, Locust's CSV
and HTML reports, and the SLO verdict (Markdown and JSON). The full-length step ramp is
marked `slow`.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

import pytest

from tests import doc_examples
from tests.doc_examples import REPO, setup_problem, shell, shown
from tools.server.triton_server import free_port

EMBED_TENANTS = {"search-frontend", "acme", "nightly-backfill"}
MAKE_ERROR = re.compile(r"\*\*\* \[[^\]]*\bloadtest\] Error (\d+)")


@pytest.fixture(scope="module")
def venv_up_to_date():
    """`make loadtest` first brings the venv up to date; it must not re-point a shared one."""
    if (problem := setup_problem()) is not None:
        pytest.fail(problem)


def reports(triton, out: Path) -> dict[str, str]:
    """The environment that points a shown Locust command at the session's server and writes
    its reports (Locust's and the verdict) under `out`."""
    return {"LOCUST_TRITON_GRPC": triton.grpc_url, "LOCUST_TRITON_HTTP": triton.http_url,
            "LOCUST_CSV": str(out / "locust"), "LOCUST_HTML": str(out / "locust.html"),
            "LOCUST_SLO_REPORT": str(out / "summary.md"), "LOCUST_SLO_JSON": str(out / "verdict.json")}


def run_shown(command: str, triton, out: Path, timeout_s: float = 240, **env: str) -> subprocess.CompletedProcess:
    """Run a shown `make loadtest ...` command in the repository (its make target and
    `--config loadtest/locust.conf` are relative to it), its reports going under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    return doc_examples.run_shown(command, timeout_s=timeout_s, **reports(triton, out), **env)


def locust_exit(result: subprocess.CompletedProcess) -> int:
    """Locust's exit code under `make loadtest`: make says it (`*** [...] Error N`) and exits 2."""
    if result.returncode == 0:
        return 0
    error = MAKE_ERROR.search(result.stderr)
    assert result.returncode == 2 and error, explain(result)
    return int(error[1])


def locust_totals(out: Path) -> dict[str, tuple[int, int]]:
    """Locust's own stats CSV: entry name -> (requests, failures)."""
    with (out / "locust_stats.csv").open() as handle:
        return {f"{row['Type']} {row['Name']}".strip(): (int(row["Request Count"]), int(row["Failure Count"]))
                for row in csv.DictReader(handle)}


def verdict(out: Path) -> dict:
    return json.loads((out / "verdict.json").read_text())


def check(report: dict, model: str, tenant: str | None) -> dict:
    return next(c for c in report["checks"] if c["model"] == model and c["tenant"] == tenant)


def same_count(verdict_count: int, locust_count: int, users: int) -> bool:
    """Equal but for the calls in flight when the run stopped: one per user at most may end
    after Locust has written its final CSV."""
    return 0 <= verdict_count - locust_count <= users


def explain(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"


def test_a_short_embed_run_within_slo_passes_and_writes_every_report(triton, tmp_path, venv_up_to_date):
    result = run_shown(shown("docs/loadtests.md", "make loadtest"), triton, tmp_path,
                       LOCUST_USERS="3", LOCUST_SPAWN_RATE="3", LOCUST_RUN_TIME="15s")
    assert result.returncode == 0, explain(result)
    assert "# Load run: PASS" in result.stdout
    report = verdict(tmp_path)
    assert report["passed"] is True
    # It says how it was run, when, and on what machine (the benchmark tables print these).
    assert report["command"] == "python -m locust --config loadtest/locust.conf"
    assert report["measured_at"].endswith("Z") and report["hardware"]["cpu_count"] >= 1
    overall = check(report, "embed", None)
    assert overall["metric"] == "latency" and overall["target_ms"] == 200
    assert 0 < overall["p95_ms"] <= 200
    # Both protocols were driven, every request went through Locust's events, and the
    # verdict counted the requests Locust counted.
    totals = locust_totals(tmp_path)
    assert totals["gRPC embed"][0] > 0 and totals["HTTP embed"][0] > 0
    assert same_count(overall["requests"], totals["Aggregated"][0], users=3)
    assert totals["Aggregated"][0] > 50  # 3 users for 15 s
    tenants = {c["tenant"] for c in report["checks"] if c["tenant"] is not None}
    assert tenants == EMBED_TENANTS
    assert sum(check(report, "embed", t)["requests"] for t in tenants) == overall["requests"]
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# Load run: PASS")
    assert "| embed | acme |" in summary and "| embed | all |" in summary
    assert (tmp_path / "locust.html").stat().st_size > 10_000
    assert (tmp_path / "locust_stats_history.csv").exists()


def test_a_run_that_misses_its_slo_exits_non_zero_and_says_why(triton, tmp_path, venv_up_to_date):
    workload = (REPO / "loadtest" / "workloads" / "embed_mix.toml").resolve()
    mix = tmp_path / "impossible.toml"
    mix.write_text(f'''name = "impossible"
user_rps = 2.0
request_timeout_s = 10
max_error_rate = 0.01

[[models]]
model = "embed"
weight = 1
protocols = {{ grpc = 1.0 }}
workload = "{workload}"
slo_p95_ms = 1

[[tenants]]
name = "acme"
weight = 1
''')
    result = run_shown(shown("docs/loadtests.md", "make loadtest"), triton, tmp_path / "out",
                       LOCUST_MIX=str(mix), LOCUST_USERS="1", LOCUST_SPAWN_RATE="1", LOCUST_RUN_TIME="8s")
    assert locust_exit(result) == 1, explain(result)
    report = verdict(tmp_path / "out")
    assert report["passed"] is False
    overall = check(report, "embed", None)
    assert overall["target_ms"] == 1 and overall["requests"] > 0
    # 8 s at 2 req/s: too few requests for a p95, so the line is judged on its median.
    assert any(" latency " in reason and "> 1 ms" in reason for reason in overall["reasons"])
    assert "# Load run: FAIL" in (tmp_path / "out" / "summary.md").read_text()


def test_llm_streams_report_time_to_first_token_and_per_output_token_as_their_own_entries(
        triton, tmp_path, venv_up_to_date):
    result = run_shown(shown("docs/loadtests.md", 'make loadtest LOADTEST_ARGS="--mix llm"'), triton, tmp_path,
                       LOCUST_USERS="2", LOCUST_SPAWN_RATE="2", LOCUST_RUN_TIME="15s")
    exit_code = locust_exit(result)
    assert exit_code in (0, 1), explain(result)
    totals = locust_totals(tmp_path)
    # One entry per whole call (stream or plain infer) and one per token-timing metric.
    assert totals["gRPC llm"][0] > 0, totals
    assert totals["gRPC llm ttft"][0] > 0 and totals["gRPC llm tpot"][0] > 0, totals
    report = verdict(tmp_path)
    overall = check(report, "llm", None)
    assert overall["metric"] == "ttft" and overall["target_ms"] == 1000
    assert overall["errors"] == 0, explain(result)
    assert overall["p95_ms"] is not None and overall["p95_ms"] > 0
    # The verdict and the exit code agree.
    assert exit_code == (0 if report["passed"] else 1)


def test_a_compressed_step_ramp_reports_every_stage_and_the_knee(triton, tmp_path, venv_up_to_date):
    result = run_shown(shown("docs/loadtests.md", 'make loadtest LOADTEST_ARGS="--shape step"'), triton, tmp_path,
                       LOCUST_SHAPE_SECONDS="16", LOCUST_SHAPE_USER_SCALE="0.125", LOCUST_SETTLE_S="1")
    assert locust_exit(result) in (0, 1), explain(result)
    report = verdict(tmp_path)
    stages = report["stages"]
    assert len(stages) == 8
    assert [s["users"] for s in stages] == sorted(s["users"] for s in stages)
    assert all(s["throughput_rps"] > 0 for s in stages[:4])
    summary = (tmp_path / "summary.md").read_text()
    assert "| stage | users | ok req/s |" in summary and "Knee" in summary
    assert "shape: step, 16 s" in summary


def test_a_distributed_run_merges_both_workers_into_one_verdict(triton, tmp_path):
    """The three shown lines as one script, the workers first and the master in the
    foreground. Each line runs with the environment of the terminal it would be typed in:
    all of them with the master's port (a free one, not 5557) and the run's length, only the
    master with Locust's report files (a worker given them writes its own over the master's).
    Workers get nothing else: mix, endpoints and spec come from the master when the test
    starts (the server here is on non-default ports)."""
    worker = shown("docs/loadtests.md", "python -m locust -f loadtest/locustfile.py --worker --master-host 127.0.0.1 &")
    master = shown("docs/loadtests.md", "python -m locust --config loadtest/locust.conf --master --expect-workers 2")
    port = str(free_port())
    files = reports(triton, tmp_path)
    script = "\n".join([
        worker, "first=$!", worker, "second=$!",
        "export " + " ".join(f"{name}={shlex.quote(files[name])}" for name in ("LOCUST_CSV", "LOCUST_HTML")),
        master, "master=$?",
        "wait $first; first=$?; wait $second; second=$?",
        'echo "exit codes: master $master, workers $first $second"', "exit $master"])
    argv, environ = shell(script, LOCUST_MASTER_BIND_PORT=port, LOCUST_MASTER_NODE_PORT=port,
                          LOCUST_USERS="4", LOCUST_SPAWN_RATE="4", LOCUST_RUN_TIME="12s",
                          LOCUST_EXPECT_WORKERS_MAX_WAIT="60",
                          **{name: value for name, value in files.items() if name.startswith(("LOCUST_TRITON",
                                                                                               "LOCUST_SLO"))})
    process = subprocess.Popen(argv, cwd=REPO, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    timed_out = False
    try:
        stdout, stderr = process.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # whatever of the script is left
    if timed_out:  # what each process printed up to then says which one hung
        stdout, stderr = process.communicate()
    result = subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)
    assert not timed_out, "the master and workers had not all exited after 180 s\n" + explain(result)
    assert "exit codes: master 0, workers 0 0" in stdout, explain(result)
    assert process.returncode == 0, explain(result)
    report = verdict(tmp_path)
    assert report["info"]["load generators"] == "master + 2 workers"
    overall = check(report, "embed", None)
    totals = locust_totals(tmp_path)
    assert same_count(overall["requests"], totals["Aggregated"][0], users=4)
    assert totals["Aggregated"][0] > 50
    assert report["passed"] is True


@pytest.mark.slow
def test_the_full_step_ramp_reports_every_stage_against_the_slo(triton, tmp_path, venv_up_to_date):
    """The step shape as written (4 minutes, up to 96 req/s): the form whose figures docs/benchmarks.md renders."""
    result = run_shown(shown("docs/loadtests.md", 'make loadtest LOADTEST_ARGS="--shape step"'), triton, tmp_path,
                       timeout_s=420)
    exit_code = locust_exit(result)
    assert exit_code in (0, 1), explain(result)
    report = verdict(tmp_path)
    assert len(report["stages"]) == 8 and report["stages"][0]["within_slo"]
    assert exit_code == (0 if report["passed"] else 1)
    assert "Knee" in (tmp_path / "summary.md").read_text()
