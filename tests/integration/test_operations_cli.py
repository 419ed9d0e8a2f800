"""top, explain and autoscale against the live server while traffic flows."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from tests.integration.helpers import as_tenant, grpc_embed, text_with_tokens
from tools.observe.metrics import BATCH_ROWS, Window, take_snapshot

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def traffic(triton):
    """Short and medium texts from 8 threads until the test ends."""
    stop = threading.Event()
    texts = [text_with_tokens(n) for n in (6, 9, 12, 20, 28)]

    def send(seed: int) -> None:
        client = grpcclient.InferenceServerClient(triton.grpc_url)
        i = seed
        try:
            while not stop.is_set():
                grpc_embed(client, [texts[i % len(texts)]], parameters=as_tenant("search-frontend"))
                i += 1
        finally:
            client.close()

    threads = [threading.Thread(target=send, args=(seed,), daemon=True) for seed in range(8)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    yield
    stop.set()
    for thread in threads:
        thread.join(timeout=30)


def run_tool(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "COLUMNS": "160"})


def test_bucket_models_export_their_formed_batch_sizes(triton, traffic):
    start = take_snapshot(triton.metrics_url)
    time.sleep(3.0)
    window = Window(start, take_snapshot(triton.metrics_url))
    batches = window.increase(BATCH_ROWS + "_count", model="encoder_16")
    rows = window.increase(BATCH_ROWS + "_sum", model="encoder_16")
    assert batches > 0
    # The histogram agrees with Triton's own counters: rows inferred over executions.
    executions = window.increase("nv_inference_exec_count", model="encoder_16")
    inferred = window.increase("nv_inference_count", model="encoder_16")
    assert rows == pytest.approx(inferred, abs=16)
    assert batches == pytest.approx(executions, abs=8)


def test_top_once_shows_every_model_with_traffic(triton, traffic, tmp_path):
    record = tmp_path / "top.jsonl.gz"
    result = run_tool("top", "--once", "--interval", "3", "--metrics-url", triton.metrics_url, "--record", str(record))
    assert result.returncode == 0, result.stderr
    for text in ("models, last", "embed", "encoder_16", "encoder_32", "tenants", "search-frontend", "premium",
                 "padding waste", "200.0"):
        assert text in result.stdout, text
    replayed = run_tool("top", "--replay", str(record), "--interval", "3")
    assert replayed.returncode == 0 and "encoder_16" in replayed.stdout


def test_explain_reads_metrics_configs_and_statistics(triton, traffic):
    http = triton.http_url
    result = run_tool("explain", "embed", "--window", "4", "--metrics-url", triton.metrics_url, "--http-url", http,
                      "--json")
    assert result.returncode == 0, result.stderr
    diagnosis = json.loads(result.stdout)
    assert diagnosis["model"] == "embed"
    assert "req/s" in diagnosis["summary"] and "bucket queue" in diagnosis["summary"]
    assert diagnosis["findings"], diagnosis
    assert all(f["knob"] for f in diagnosis["findings"])
    # The statistics API's batch_stats: batches formed at encoder_16 in the window, by size.
    assert sum(diagnosis["formed_batches"]["encoder_16"].values()) > 0


def test_autoscale_makes_live_decisions(triton, traffic):
    result = run_tool("autoscale", "embed", "--interval", "2", "--count", "2", "--json",
                      "--metrics-url", triton.metrics_url, "--http-url", triton.http_url)
    assert result.returncode == 0, result.stderr
    decisions = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(decisions) == 2
    assert all(d["desired_replicas"] >= 1 and {"queue", "pending", "utilization"} <= d["ratios"].keys()
               for d in decisions)


def test_tools_say_what_is_wrong_when_no_server_answers():
    result = run_tool("explain", "embed", "--window", "1", "--metrics-url", "http://127.0.0.1:9/metrics",
                      "--http-url", "127.0.0.1:9")
    assert result.returncode == 1
    assert "is the server running" in result.stderr
    assert "Traceback" not in result.stderr
    result = run_tool("top", "--once", "--metrics-url", "http://127.0.0.1:9/metrics")
    assert result.returncode == 1 and "is the server running" in result.stderr


def test_explain_the_llm_engine(triton):
    result = run_tool("explain", "llm", "--window", "2", "--metrics-url", triton.metrics_url,
                      "--http-url", triton.http_url, "--json")
    assert result.returncode == 0, result.stderr
    diagnosis = json.loads(result.stdout)
    assert "KV blocks" in diagnosis["summary"] and diagnosis["findings"]
