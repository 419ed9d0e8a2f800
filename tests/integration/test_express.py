"""The express model on a real tritonserver: at light load the router sends the lingering
buckets' rows to it and a short request waits no linger; over `up_rps` the bucket models take
them back, and a burst of single rows reaches encoder_16 as a few large batches; after the hold
the express model serves again.

The server serves the committed plan's router, encoder_16 and express model (version 1), with
the router's `linger_regimes` edited to thresholds a test reaches in seconds.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from python_backends.common.regimes import REGIMES_PARAMETER, LingerRegimes
from tests.integration.helpers import ROUTER_COUNTERS_LAG_S, cosines, model_counts, retry_unavailable, settled
from tools.paths import DEFAULT_MODEL_REPOSITORY
from tools.repository.configs import expected_files, plan_embed_model
from tools.server.triton_server import ModelControlMode, ServerConfig, TritonServer, free_port
from tools.spec.profile import load_profile
from tools.spec.serving import load_spec

from .conftest import EXIT_TIMEOUT_S, LOG_DIR, REPO

SPEC = load_spec(REPO / "serving.toml")
EMBED = SPEC.models[0]
SERVED = ("embed", "encoder_16", EMBED.express_name)
SHORT = ["a short query", "where is my order", "reset my password", "hello there"]  # under 16 tokens each
UP_RPS, DOWN_RPS, HOLD_S, WINDOW_S = 12.0, 6.0, 2.0, 5.0


def express_repository(target: Path) -> tuple[Path, LingerRegimes, int]:
    """The committed plan's router, encoder_16 and express model, version 1 only, the router's
    regimes edited; their files linked from the kit's repository. Also the regimes and encoder_16's linger."""
    plan = {model.name: model for model in plan_embed_model(EMBED, SPEC, load_profile(REPO / SPEC.profile))}
    router = plan["embed"].config
    regimes = LingerRegimes.from_json(router.parameters[REGIMES_PARAMETER].string_value)
    assert regimes.express in plan and "encoder_16" in regimes.peak_us  # what the committed profile derives
    regimes = dataclasses.replace(regimes, up_rps=UP_RPS, down_rps=DOWN_RPS, hold_s=HOLD_S, window_s=WINDOW_S)
    router.parameters[REGIMES_PARAMETER].string_value = regimes.to_json()
    models = [plan[name] for name in SERVED]
    for model in models[1:]:
        del model.config.version_policy.specific.versions[1:]
    for path, text in expected_files(models, target).items():
        if path.name == "config.pbtxt" or path.parent.name == "1":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for model in models:
        source = DEFAULT_MODEL_REPOSITORY / (model.files_of or model.name) / "1"
        for item in source.iterdir():
            if item.is_file() and item.name != "model.py":
                os.link(item, target / model.name / "1" / item.name)
    return target, regimes, plan["encoder_16"].knobs.max_queue_delay_us


@pytest.fixture(scope="module")
def express_server(tmp_path_factory):
    repository, regimes, linger_us = express_repository(tmp_path_factory.mktemp("express") / "model_repository")
    config = ServerConfig(model_repository=repository, http_port=free_port(), grpc_port=free_port(),
                          metrics_port=free_port(), host="127.0.0.1", model_control_mode=ModelControlMode.EXPLICIT,
                          load_models=SERVED, exit_timeout_s=EXIT_TIMEOUT_S)
    with TritonServer(config, log_path=LOG_DIR / "tritonserver-express.log") as server:
        client = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
        try:
            yield server, client, regimes, linger_us
        finally:
            client.close()


def embed(client: httpclient.InferenceServerClient, text: str) -> tuple[float, np.ndarray]:
    """One short request: its latency (ms) and its embedding."""
    data = np.array([[text.encode()]], dtype=object)
    tensor = httpclient.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(data)
    started = time.monotonic()
    result = retry_unavailable(lambda: client.infer("embed", [tensor]))
    return (time.monotonic() - started) * 1000.0, result.as_numpy("EMBEDDING")


def embed_ms(client: httpclient.InferenceServerClient, text: str) -> float:
    return embed(client, text)[0]


def served(client) -> dict[str, int]:
    """Rows each model has inferred (Triton's statistics; warm-up runs included, so take deltas)."""
    return {name: model_counts(client, name)[0] for name in SERVED[1:]}


def metric(server: TritonServer, name: str, **labels: str) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    values = [float(line.rsplit(" ", 1)[1]) for line in lines
              if line.startswith(name + "{") and all(label in line for label in wanted)]
    return sum(values)


def paced(url: str, rps: float, seconds: float, num_threads: int = 4) -> list[float]:
    """Short requests at `rps` in all from `num_threads` clients for `seconds`; their latencies."""
    latencies: list[float] = []

    def send(offset: int) -> None:
        client = httpclient.InferenceServerClient(url, network_timeout=60)
        interval = num_threads / rps
        next_at = time.monotonic() + offset / rps
        deadline = time.monotonic() + seconds
        index = offset
        while next_at < deadline:
            time.sleep(max(0.0, next_at - time.monotonic()))
            latencies.append(embed_ms(client, SHORT[index % len(SHORT)]))
            next_at += interval
            index += 1
        client.close()

    threads = [threading.Thread(target=send, args=(offset,)) for offset in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return latencies


def test_at_light_load_the_express_model_serves_short_rows_without_the_linger(express_server):
    server, client, regimes, linger_us = express_server
    before = served(client)
    latencies = paced(server.http_url, rps=3.0, seconds=5.0, num_threads=1)
    after = settled(lambda: served(client), lambda counts: counts[regimes.express] - before[regimes.express]
                    >= len(latencies))
    assert after[regimes.express] - before[regimes.express] == len(latencies)
    assert after["encoder_16"] == before["encoder_16"]
    p50 = statistics.median(latencies)
    assert p50 < 0.5 * linger_us / 1000, f"p50 {p50:.1f} ms, encoder_16 lingers {linger_us / 1000:.0f} ms"
    rows = settled(lambda: metric(server, "embed_bucket_express_rows_total", bucket="16"),
                   lambda value: value >= len(latencies))
    assert rows == len(latencies)
    assert metric(server, "embed_linger_regime", model="embed") == 0


def test_over_up_rps_the_bucket_model_takes_the_rows_back_and_batches_until_the_hold_ends(express_server):
    server, client, regimes, _ = express_server
    before = served(client)
    burst = 16
    clients = [httpclient.InferenceServerClient(server.http_url, network_timeout=60) for _ in range(burst)]
    paced(server.http_url, rps=3 * UP_RPS, seconds=3.0)  # the estimate passes up_rps within a second or two
    during = served(client)
    assert during["encoder_16"] > before["encoder_16"], (before, during)

    # A burst of single-row requests now reaches encoder_16, which lingers, as a few large batches.
    inferences_before, executions_before = model_counts(client, "encoder_16")
    results: list = []
    threads = [threading.Thread(target=lambda c=c: results.append(embed(c, SHORT[0])[1])) for c in clients]
    for thread in threads:
        thread.start()
        time.sleep(0.002)
    for thread in threads:
        thread.join(timeout=60)
    for one in clients:
        one.close()
    assert len(results) == burst
    inferences, executions = settled(lambda: model_counts(client, "encoder_16"),
                                     lambda counts: counts[0] - inferences_before >= burst)
    assert inferences - inferences_before == burst
    assert (executions - executions_before) * 2 < burst, f"{burst} requests ran in {executions - executions_before}"
    stacked = np.concatenate(results)  # and batching does not change the answer
    assert cosines(stacked, np.repeat(stacked[:1], burst, axis=0)).min() >= 0.9999
    time.sleep(ROUTER_COUNTERS_LAG_S)
    assert metric(server, "embed_linger_regime", model="embed") > 0  # the instances that saw the load went peak

    # Quiet for the window and the hold: the next short request goes to the express model again.
    time.sleep(regimes.window_s + regimes.hold_s + 0.5)
    quiet = served(client)
    embed_ms(client, SHORT[1])
    after = settled(lambda: served(client), lambda counts: counts[regimes.express] > quiet[regimes.express])
    assert after[regimes.express] == quiet[regimes.express] + 1 and after["encoder_16"] == quiet["encoder_16"]
