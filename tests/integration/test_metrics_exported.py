"""Every metric the dashboard, the Prometheus rules, the autoscalers and the kit's tools
query is one the live server exports."""

import json

import requests
import tritonclient.grpc as grpcclient

from tests.docker_files import queried_metric_names
from tests.integration.helpers import as_tenant, grpc_embed, text_with_tokens
from tools.observe import metrics
from tools.observe.metrics import parse_exposition

# Exported only where Triton sees a GPU; this suite runs on CPU machines.
GPU_ONLY = {"nv_gpu_utilization"}


def tools_metric_names() -> set[str]:
    """What top, explain and autoscale read (tools/metrics.py)."""
    histograms = {metrics.ROUTER_LATENCY, metrics.BATCH_ROWS, metrics.LLM_TTFT}
    counters = {metrics.SUCCESS, metrics.FAILURE, metrics.ROWS, metrics.BATCHES, metrics.QUEUE_US, *metrics.COMPUTE_US,
                metrics.PENDING, metrics.ROUTER_REQUESTS, metrics.TENANT_REQUESTS, metrics.REAL_TOKENS,
                metrics.PADDED_TOKENS, metrics.LLM_RUNNING, metrics.LLM_WAITING, metrics.LLM_BLOCKS_USED,
                metrics.LLM_BLOCKS_TOTAL}
    return counters | {f"{name}_{part}" for name in histograms for part in ("bucket", "sum", "count")}


def test_every_queried_metric_is_exported(triton):
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        for tokens in (8, 24, 50, 100, 200):  # every bucket serves at least once
            grpc_embed(client, [text_with_tokens(tokens)], parameters=as_tenant("search-frontend"))
    finally:
        client.close()
    body = {"messages": json.dumps([{"role": "user", "content": "Say hello."}]), "max_tokens": 4}
    reply = requests.post(f"http://{triton.http_url}/v2/models/llm/generate", json=body, timeout=120)
    assert reply.status_code == 200, reply.text

    exported = {name for name, _ in parse_exposition(requests.get(triton.metrics_url, timeout=10).text)}
    queried = queried_metric_names()
    missing = {name: sorted(queried[name]) for name in queried.keys() - exported - GPU_ONLY}
    assert not missing, f"queried but not exported: {missing}"
    assert not tools_metric_names() - exported
    assert all(name.startswith("nv_gpu_") for name in GPU_ONLY)
