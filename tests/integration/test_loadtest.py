"""Locust load runs against the real tritonserver: the short forms of `make loadtest`.

Each test runs Locust headless as its own process, the way `make loadtest` does, and reads
what a pipeline would read: the exit code, Locust's CSV and HTML reports, and the SLO
verdict (Markdown and JSON). The full-length step ramp is marked `slow`.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.server.triton_server import free_port

REPO = Path(__file__).resolve().parents[2]
EMBED_TENANTS = {"search-frontend", "acme", "nightly-backfill"}


def locust_command(triton, out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "locust", "--config", "loadtest/locust.conf",
            "--triton-grpc", triton.grpc_url, "--triton-http", triton.http_url,
            "--csv", str(out / "locust"), "--html", str(out / "locust.html"),
            "--slo-report", str(out / "summary.md"), "--slo-json", str(out / "verdict.json"), *args]


def run_locust(triton, out: Path, *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(locust_command(triton, out, *args), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s)


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


def test_a_short_embed_run_within_slo_passes_and_writes_every_report(triton, tmp_path):
    result = run_locust(triton, tmp_path, "--mix", "embed", "-u", "3", "-r", "3", "--run-time", "30s")
    assert result.returncode == 0, explain(result)
    assert "# Load run: PASS" in result.stdout
    report = verdict(tmp_path)
    assert report["passed"] is True
    overall = check(report, "embed", None)
    assert overall["metric"] == "latency" and overall["target_ms"] == 200
    assert 0 < overall["p95_ms"] <= 200
    # Both protocols were driven, every request went through Locust's events, and the
    # verdict counted the requests Locust counted.
    totals = locust_totals(tmp_path)
    assert totals["gRPC embed"][0] > 0 and totals["HTTP embed"][0] > 0
    assert same_count(overall["requests"], totals["Aggregated"][0], users=3)
    assert totals["Aggregated"][0] > 100
    tenants = {c["tenant"] for c in report["checks"] if c["tenant"] is not None}
    assert tenants == EMBED_TENANTS
    assert sum(check(report, "embed", t)["requests"] for t in tenants) == overall["requests"]
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# Load run: PASS")
    assert "| embed | acme |" in summary and "| embed | all |" in summary
    assert (tmp_path / "locust.html").stat().st_size > 10_000
    assert (tmp_path / "locust_stats_history.csv").exists()


def test_a_run_that_misses_its_slo_exits_non_zero_and_says_why(triton, tmp_path):
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
    result = run_locust(triton, tmp_path / "out", "--mix", str(mix), "-u", "1", "-r", "1", "--run-time", "8s")
    assert result.returncode == 1, explain(result)
    report = verdict(tmp_path / "out")
    assert report["passed"] is False
    overall = check(report, "embed", None)
    assert overall["target_ms"] == 1 and overall["requests"] > 0
    assert any("p95 latency" in reason and "> 1 ms" in reason for reason in overall["reasons"])
    assert "# Load run: FAIL" in (tmp_path / "out" / "summary.md").read_text()


def test_llm_streams_report_time_to_first_token_and_per_output_token_as_their_own_entries(triton, tmp_path):
    result = run_locust(triton, tmp_path, "--mix", "llm", "-u", "2", "-r", "2", "--run-time", "30s")
    assert result.returncode in (0, 1), explain(result)
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
    assert result.returncode == (0 if report["passed"] else 1)


def test_a_compressed_step_ramp_reports_every_stage_and_the_knee(triton, tmp_path):
    result = run_locust(triton, tmp_path, "--mix", "embed", "--shape", "step", "--shape-seconds", "32",
                        "--shape-user-scale", "0.125", "--settle-s", "1")
    assert result.returncode in (0, 1), explain(result)
    report = verdict(tmp_path)
    stages = report["stages"]
    assert len(stages) == 8
    assert [s["users"] for s in stages] == sorted(s["users"] for s in stages)
    assert all(s["throughput_rps"] > 0 for s in stages[:4])
    summary = (tmp_path / "summary.md").read_text()
    assert "| stage | users | ok req/s |" in summary and "Knee" in summary
    assert "shape: step, 32 s" in summary


def test_a_distributed_run_merges_both_workers_into_one_verdict(triton, tmp_path):
    port = free_port()
    master = subprocess.Popen(
        locust_command(triton, tmp_path, "--mix", "embed", "-u", "4", "-r", "4", "--run-time", "20s", "--master",
                       "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port),
                       "--expect-workers", "2", "--expect-workers-max-wait", "60"),
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Workers get only the locustfile and the master's address: mix, endpoints and spec come
    # from the master when the test starts (the server here is on non-default ports).
    time.sleep(2)
    workers = [subprocess.Popen([sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--worker",
                                 "--master-host", "127.0.0.1", "--master-port", str(port)],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for _ in range(2)]
    try:
        stdout, stderr = master.communicate(timeout=180)
        worker_logs = [w.communicate(timeout=60)[0] for w in workers]
    finally:
        for process in (master, *workers):
            process.kill()
    result = subprocess.CompletedProcess(master.args, master.returncode, stdout, stderr)
    assert master.returncode == 0, explain(result) + "\n".join(worker_logs)
    assert all(w.returncode == 0 for w in workers), worker_logs
    report = verdict(tmp_path)
    assert report["info"]["load generators"] == "master + 2 workers"
    overall = check(report, "embed", None)
    totals = locust_totals(tmp_path)
    assert same_count(overall["requests"], totals["Aggregated"][0], users=4)
    assert totals["Aggregated"][0] > 50
    assert report["passed"] is True


@pytest.mark.slow
def test_the_full_step_ramp_reports_every_stage_against_the_slo(triton, tmp_path):
    """The step shape as written (4 minutes, up to 96 req/s): the form whose figures docs/benchmarks.md renders."""
    result = run_locust(triton, tmp_path, "--mix", "embed", "--shape", "step", timeout_s=420)
    assert result.returncode in (0, 1), explain(result)
    report = verdict(tmp_path)
    assert len(report["stages"]) == 8 and report["stages"][0]["within_slo"]
    assert result.returncode == (0 if report["passed"] else 1)
    assert "Knee" in (tmp_path / "summary.md").read_text()
