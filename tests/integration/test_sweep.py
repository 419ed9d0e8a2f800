"""`python -m tools sweep` against the real server: open and closed loop, results file, plot,
the generator's outstanding-request cap, and the errors a user sees first.

The sweeps docs/loadtests.md shows run as written, with the session server's ports put in
for localhost:8000/8001, in the test's folder (their `build/` results land there)."""

from __future__ import annotations

import asyncio
import csv
import json
import subprocess
import sys
from pathlib import Path

from tests import doc_examples
from tests.doc_examples import shown
from tests.integration.helpers import as_tenant
from tools.bench.loadgen import LoadTarget, run_open_loop
from tools.server.triton_server import free_port

REPO = Path(__file__).resolve().parents[2]


def sweep_cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools", "sweep", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def run_shown(command: str, triton, folder: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """A shown sweep as written, against the session's server, run in `folder`."""
    return doc_examples.run_shown(command, folder, {"http": triton.config.http_port, "grpc": triton.config.grpc_port},
                                  timeout_s=timeout)


def test_open_loop_sweep_writes_per_step_results_with_server_times_and_a_plot(triton, tmp_path):
    done = run_shown(shown("docs/loadtests.md", "python -m tools sweep --url localhost:8001 --rates 5,10 "
                           "--duration 3 --warmup 1 --slo-ms 500 --out build/sweep.json"), triton, tmp_path)
    out = tmp_path / "build" / "sweep.json"
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5 rps: p50" in done.stdout and "10 rps: p50" in done.stdout
    assert "server queue/compute ms" in done.stdout

    document = json.loads(out.read_text())
    assert document["model"] == "embed" and document["mode"] == "open" and document["slo_ms"] == 500
    steps = document["steps"]
    assert [step["offered_rps"] for step in steps] == [5, 10]
    for step in steps:
        assert step["num_sent"] > 0 and step["num_errors"] == 0, step["error_samples"]
        assert step["num_ok"] == step["num_sent"]
        assert 0 < step["p50_ms"] <= step["p95_ms"] <= step["p99_ms"]
        assert step["throughput_rps"] > 0 and 0 <= step["goodput_fraction"] <= 1
        embed = step["server"]["embed"]
        assert embed["num_requests"] == step["num_ok"]  # the server saw exactly what we sent
        assert embed["queue_ms"] >= 0 and embed["compute_ms"] > 0
        busy = {name: t for name, t in step["server"].items() if name.startswith("encoder_") and t["execution_count"]}
        assert busy, step["server"]
        for times in busy.values():
            assert times["compute_ms"] > 0 and times["queue_ms"] > 0 and times["mean_batch_size"] >= 1
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_closed_loop_step_writes_csv(triton, tmp_path):
    """One request in flight. Back-to-back requests hit a Triton 2.51 dynamic-batcher race:
    now and then a request enqueued just as the previous batch finishes waits for the
    batcher's 500 ms idle wake-up, and its deadline in the bucket's queue rejects it as
    UNAVAILABLE. The sweep must count those as errors, and nothing else may fail."""
    done = run_shown(shown("docs/loadtests.md", "python -m tools sweep --url localhost:8001 --mode closed "
                           "--concurrency 1 --duration 2 --warmup 1 --out build/closed.csv --plot build/closed.png"),
                     triton, tmp_path)
    out = tmp_path / "build" / "closed.csv"
    assert done.returncode == 0, done.stdout + done.stderr
    assert "concurrency 1: p50" in done.stdout
    [row] = list(csv.DictReader(out.open()))
    assert row["mode"] == "closed" and row["concurrency"] == "1"
    num_sent, num_ok, num_errors = int(row["num_sent"]), int(row["num_ok"]), int(row["num_errors"])
    assert num_ok > 0 and num_sent == num_ok + num_errors and float(row["p99_ms"]) > 0
    if num_errors:
        assert num_errors <= 0.1 * num_sent, row["error_samples"]
        for sample in row["error_samples"].split(" | "):
            assert sample.startswith("StatusCode.UNAVAILABLE") and "Request timeout expired" in sample, sample
        assert float(row["goodput_fraction"]) < 1
    assert float(row["server.embed.compute_ms"]) > 0
    assert (tmp_path / "build" / "closed.png").is_file()


def test_open_loop_counts_requests_over_the_outstanding_cap_as_errors(triton):
    """An overloaded server cannot make the generator slow down and look good: with room
    for one request in flight, arrivals at 100 rps mostly cannot be sent, and say so."""
    target = LoadTarget(grpc_url=triton.grpc_url, model="embed", texts=("a short text",), slo_ms=1000,
                        max_outstanding=1, stats_models=("embed",))
    result = asyncio.run(run_open_loop(target, 100, 1.0, seed=3))
    assert result.num_errors > 0 and result.num_ok > 0
    assert result.num_sent == result.num_ok + result.num_errors
    assert any("not sent" in sample for sample in result.error_samples)
    assert result.goodput_fraction < 1
    assert set(result.server) == {"embed"}


def test_a_search_over_http_finds_the_highest_rate_and_the_server_sees_every_request(triton, tmp_path):
    """Two steps of the search from 5 rps (doubling while the SLO holds). That the HTTP client's requests carry a
    tenant token the server honours is checked by the quota refusals below."""
    done = run_shown(shown("docs/loadtests.md", "python -m tools sweep --url localhost:8001 --http-url localhost:8000 "
                           "--search 5 --max-steps 2 --duration 1 --warmup 0.5 --slo-ms 1000 --out build/search.json"),
                     triton, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"at {triton.http_url} over HTTP" in done.stdout
    assert "highest rate meeting the SLO: " in done.stdout
    steps = json.loads((tmp_path / "build" / "search.json").read_text())["steps"]
    assert len(steps) == 2 and steps[0]["offered_rps"] == 5
    for step in steps:
        assert step["num_sent"] > 0 and step["num_ok"] == step["num_sent"], step["error_samples"]
        assert step["server"]["embed"]["num_requests"] == step["num_ok"]
        assert step["client_cpu_s"] > 0


def test_over_http_refusals_are_rejections_and_bad_input_is_an_error_with_the_servers_message(triton):
    """The HTTP client classifies answers as the gRPC one does: 503 (here the batch tier's
    quota, 20 req/s with a burst of 20) is a rejection, 400 a failure, each with its message."""
    quota = LoadTarget(grpc_url=triton.grpc_url, http_url=triton.http_url, model="embed", texts=("a short text",),
                       slo_ms=1000, parameters=as_tenant("nightly-backfill"), stats_models=("embed",))
    result = asyncio.run(run_open_loop(quota, 120, 1.0, seed=5))
    assert result.num_ok >= 15 and result.num_rejected > 0 and result.num_errors == 0, result.error_samples
    assert any(sample.startswith("503: ") and "quota" in sample for sample in result.error_samples)

    too_long = LoadTarget(grpc_url=triton.grpc_url, http_url=triton.http_url, model="embed", texts=("x" * 70000,),
                          slo_ms=1000, stats_models=("embed",))
    result = asyncio.run(run_open_loop(too_long, 5, 0.6, seed=6))
    assert result.num_ok == 0 and result.num_errors == result.num_sent > 0
    assert all(sample.startswith("400: ") and "70000 bytes" in sample for sample in result.error_samples)


def test_a_model_that_takes_no_texts_is_swept_with_inputs_made_from_its_metadata(triton, tmp_path):
    """A bucket model takes token ids, not texts: random INT64 ids of its declared shape
    ([rows, 16]), as perf_analyzer would make them; its own stats are the ones read."""
    out = tmp_path / "bucket.json"
    done = sweep_cli("--url", triton.grpc_url, "--http-url", triton.http_url, "--model", "encoder_16", "--rates", "5",
                     "--duration", "1", "--warmup", "0", "--rows", "2", "--slo-ms", "1000", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sweeping encoder_16" in done.stdout and "random" in done.stdout
    document = json.loads(out.read_text())
    assert document["workload"] == "random"
    [step] = document["steps"]
    assert step["num_sent"] > 0 and step["num_ok"] == step["num_sent"], step["error_samples"]
    assert set(step["server"]) == {"encoder_16"}
    assert step["server"]["encoder_16"]["inference_count"] == 2 * step["num_ok"]


def test_a_sample_file_gives_the_routers_texts(triton, tmp_path):
    """perf_analyzer's --input-data JSON form, over gRPC: each sample one row of TEXT."""
    samples = tmp_path / "texts.json"
    samples.write_text(json.dumps({"data": [{"TEXT": ["a short text"]}, {"TEXT": ["another, somewhat longer text"]}]}))
    out = tmp_path / "file.json"
    done = sweep_cli("--url", triton.grpc_url, "--input-data", str(samples), "--rates", "5", "--duration", "1",
                     "--warmup", "0", "--slo-ms", "1000", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    [step] = json.loads(out.read_text())["steps"]
    assert step["num_ok"] == step["num_sent"] > 0, step["error_samples"]
    assert step["server"]["embed"]["num_requests"] == step["num_ok"]
    assert any(name.startswith("encoder_") for name in step["server"])  # the router's buckets, from its config


def test_an_unreachable_http_endpoint_is_one_line_and_exit_code_2(triton):
    done = sweep_cli("--url", triton.grpc_url, "--http-url", f"127.0.0.1:{free_port()}", "--duration", "1")
    assert done.returncode == 2
    assert done.stderr.startswith("error: cannot reach tritonserver over HTTP")
    assert len(done.stderr.strip().splitlines()) == 1


def test_unreachable_server_is_one_line_and_exit_code_2():
    done = sweep_cli("--url", f"localhost:{free_port()}", "--duration", "1")
    assert done.returncode == 2
    assert done.stderr.startswith("error: cannot reach tritonserver over gRPC")
    assert len(done.stderr.strip().splitlines()) == 1


def test_model_not_ready_is_one_line_and_exit_code_2(triton):
    done = sweep_cli("--url", triton.grpc_url, "--model", "no_such_model", "--duration", "1")
    assert done.returncode == 2
    assert "model 'no_such_model' is not ready" in done.stderr and "embed" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_help_lists_sweep_and_its_options():
    top = subprocess.run([sys.executable, "-m", "tools", "--help"], cwd=REPO, capture_output=True, text=True)
    assert top.returncode == 0 and "sweep" in top.stdout
    done = sweep_cli("--help")
    assert done.returncode == 0
    for option in ("--url", "--http-url", "--model", "--mode", "--rates", "--concurrency", "--duration", "--warmup",
                   "--workload", "--slo-ms", "--out", "--plot", "--parameters", "--search", "--spec", "--input-data",
                   "--variable-len", "--rows"):
        assert option in done.stdout
