"""top, explain and autoscale against the live server while traffic flows; `top` and `explain`
as docs/operations.md shows them."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from tests.doc_examples import shell, shown
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


def ports(triton) -> dict[str, int]:
    return {"http": triton.config.http_port, "metrics": triton.config.metrics_port}


def start_shown(command: str, triton, cwd: Path) -> subprocess.Popen:
    """A command the docs show, on the session server's ports."""
    argv, env = shell(command, ports(triton))
    return subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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


def test_top_shows_every_model_with_traffic(triton, traffic, tmp_path):
    """`top --once` and both live forms the docs show, side by side; the live ones are stopped
    by Ctrl-C once they have drawn a window or two (a live view off a terminal prints its last
    one as it stops)."""
    record = tmp_path / "top.jsonl.gz"
    views = [start_shown(shown("docs/operations.md", "python -m tools top --metrics-url http://localhost:8002/metrics"),
                         triton, tmp_path),
             start_shown(shown("docs/operations.md", "python -m tools top --metrics-url http://localhost:8002/metrics "
                                                     "--record run.jsonl.gz"), triton, tmp_path)]
    try:
        once = run_tool("top", "--once", "--interval", "3", "--metrics-url", triton.metrics_url,
                        "--record", str(record))
        time.sleep(1.5)  # the live views, started with it, refresh every 2 s
        for view in views:
            view.send_signal(signal.SIGINT)
        outputs = [view.communicate(timeout=30) for view in views]
    finally:
        for view in views:
            view.kill()
    assert once.returncode == 0, once.stderr
    for stdout, stderr, code in [(once.stdout, once.stderr, once.returncode)] + [
            (stdout, stderr, view.returncode) for view, (stdout, stderr) in zip(views, outputs, strict=True)]:
        assert code == 0, stderr
        for text in ("models, last", "embed", "encoder_16", "encoder_32", "tenants", "search-frontend", "premium",
                     "padding waste", "200.0"):
            assert text in stdout, (text, stdout)
    for recording in (record, tmp_path / "run.jsonl.gz"):
        replayed = run_tool("top", "--replay", str(recording), "--interval", "3")
        assert replayed.returncode == 0 and "encoder_16" in replayed.stdout


def test_explain_reads_metrics_configs_and_statistics(triton, traffic, tmp_path):
    # Both shown forms (10 s windows) run beside the JSON form, so the three take one window.
    shown_form = start_shown(shown("docs/operations.md", "python -m tools explain embed --metrics-url "
                                   "http://localhost:8002/metrics --http-url localhost:8000"), triton, tmp_path)
    shown_llm = start_shown(shown("docs/operations.md", "python -m tools explain llm --metrics-url "
                                  "http://localhost:8002/metrics --http-url localhost:8000"), triton, tmp_path)
    http = triton.http_url
    result = run_tool("explain", "embed", "--window", "4", "--metrics-url", triton.metrics_url, "--http-url", http,
                      "--json")
    stdout, stderr = shown_form.communicate(timeout=120)
    assert shown_form.returncode == 0, stderr
    assert stdout.startswith("embed: ") and "req/s" in stdout and "bucket queue" in stdout, stdout
    assert "busy over " in stdout and "\n- " in stdout and "knob: " in stdout, stdout
    stdout, stderr = shown_llm.communicate(timeout=120)
    assert shown_llm.returncode == 0, stderr
    assert stdout.startswith("llm: ") and "KV blocks" in stdout and "knob: " in stdout, stdout
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
