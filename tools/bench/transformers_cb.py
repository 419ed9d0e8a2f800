"""The LLM benchmark's peer: transformers' own continuous batching, same model, same machine.

Setup `transformers_cb` of `bench llm`. The model folder the `llm` model serves
(model_repository/llm/<version>: safetensors, config), the same requests as the engine's
saturated run (prompts tokenized here by the engine's own chat tokenizer, so both compute the
same token ids; the same output budgets and stop tokens; greedy), in-process: no server, no
client, no network. transformers' `ContinuousBatchingManager` (its paged cache, SDPA attention)
gets the engine's limits: the same KV-cache memory in blocks of the engine's block size, at
most max_num_seqs sequences and max_num_batched_tokens tokens per step. Those limits cost it
nothing measurable here: with 96 streams of chat on 2 vCPU it ran 103 to 117 tokens/s with its
own choice of tokens per step and 109 to 111 with the engine's 256 (runs of 60 s spread that
much), and 136 with pages of the engine's 16 tokens against 126 with its default 256-token
pages (where a short chat holds a whole page; all defaults, with the cache sized from the
machine's memory: 81). The closed loop is the engine's: as many requests in flight as the
engine's saturated run keeps, the next request of the list sent each time one finishes,
tokens counted as they stream out.

Why a virtualenv of its own. The kit pins transformers 4.57.6, whose continuous batching
does not run on CPU: `PagedAttentionMemoryHandler.get_available_memory` subtracts the memory in
use from the device's total, which `get_device_and_memory_breakdown` reports as None on a CPU,
so the generation thread dies with a TypeError before its first step, whatever `num_blocks`,
`max_batch_tokens` and attention (`sdpa_paged`, `eager_paged`, `paged_attention`) it is given,
and `generate_batch` returns no results. With that one query patched to report memory, 4.57.6
ran 23 tokens/s on 48 chat prompts x 96 tokens on 2 vCPU, where 5.18 ran 48: a patched old
release would understate the peer. transformers 5 reads a CPU's memory with psutil. So the peer
runs transformers 5.23.0, with torch 2.13.0 from the kit's CPU wheels and every other
dependency pinned (`transformers_cb.lock`), in a virtualenv the benchmark makes under build/
the first time (pip, from the package index; again whenever the lock file changes), and talks
to it through a worker script (`transformers_cb_worker.py`) that prints its records as JSON.
The kit's own pins do not change.

I/O: `ensure_venv` (makes the virtualenv), `run_peer` (the worker's process). Pure:
`peer_job`, `generations_from_records`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tools.clients.llm import STREAM_CLOSED, Generation
from tools.paths import REPO_ROOT

PEER = "transformers_cb"
TRANSFORMERS_VERSION = "5.23.0"  # what transformers_cb.lock pins; recorded in the results
LOCK_FILE = Path(__file__).with_name("transformers_cb.lock")
WORKER = Path(__file__).with_name("transformers_cb_worker.py")
VENV_DIR = REPO_ROOT / "build" / "transformers_cb" / "venv"
ATTENTION = "sdpa"  # its continuous batching runs SDPA over its paged cache (a CPU has no flash attention)
STAMP = ".installed"  # in the virtualenv: the digest of the lock file it was made from
# What keeps the worker offline and quiet: the model is a local folder, nothing may come from a hub.
WORKER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
              "TOKENIZERS_PARALLELISM": "false"}
# The kit's environment must not leak into the peer's interpreter.
KIT_ONLY_ENV = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")


class PeerError(RuntimeError):
    """The peer's virtualenv could not be made, or its worker failed; the message says which."""


def lock_digest(lock: Path = LOCK_FILE) -> str:
    return hashlib.sha256(lock.read_bytes()).hexdigest()


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_venv(log: Callable[[str], None], venv: Path = VENV_DIR, lock: Path = LOCK_FILE) -> Path:
    """The peer's interpreter: the virtualenv at `venv`, made with `lock`'s pins unless it was
    made from this very lock file already. Raises PeerError when venv or pip fails."""
    stamp = venv / STAMP
    digest = lock_digest(lock)
    if stamp.is_file() and stamp.read_text().strip() == digest and venv_python(venv).is_file():
        return venv_python(venv)
    log(f"  {PEER}: making its virtualenv (transformers {TRANSFORMERS_VERSION}) in {venv}; pip, once ...")
    shutil.rmtree(venv, ignore_errors=True)
    try:
        venv.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PeerError(f"{PEER}: cannot make {venv.parent}: {err}") from None
    for command in ([sys.executable, "-m", "venv", str(venv)],
                    [str(venv_python(venv)), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                     "-r", str(lock)]):
        result = subprocess.run(command, capture_output=True, text=True, env=_peer_env())
        if result.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            raise PeerError(f"{PEER}: `{' '.join(command)}` failed (exit {result.returncode}):\n"
                            f"{(result.stdout + result.stderr).strip()[-3000:]}")
    stamp.write_text(digest + "\n")
    return venv_python(venv)


def _peer_env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in KIT_ONLY_ENV}
    return {**env, **WORKER_ENV}


def peer_job(model_dir: Path, requests: Sequence[tuple[Sequence[int], int]], *, concurrency: int, duration_s: float,
             num_threads: int, eos_token_ids: Sequence[int], kv_cache_bytes: int, block_size: int, max_num_seqs: int,
             max_num_batched_tokens: int, device: str, dtype: str) -> dict[str, Any]:
    """The worker's job: the requests as (prompt token ids, max_tokens), cycled in a closed loop
    of `concurrency` for `duration_s` seconds, under the engine's limits."""
    if concurrency < 1 or duration_s <= 0 or not requests:
        raise ValueError(f"{PEER}: needs requests, concurrency >= 1 and a duration > 0")
    return {"model_dir": str(model_dir),
            "requests": [[list(prompt), int(max_tokens)] for prompt, max_tokens in requests],
            "concurrency": concurrency, "duration_s": duration_s, "num_threads": num_threads,
            "eos_token_ids": list(eos_token_ids), "kv_cache_bytes": kv_cache_bytes, "block_size": block_size,
            "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
            "attn_implementation": ATTENTION, "device": device, "dtype": dtype}


def generations_from_records(records: Sequence[dict[str, Any]]) -> list[Generation]:
    """The worker's records as the client records of the engine's runs (times in seconds from the
    start of the loop), so that one summary measures both: a request still running when the loop
    ended is `STREAM_CLOSED`, as the engine's cancelled ones are."""
    generations = []
    for index, record in enumerate(records):
        counts = [int(count) for count in record["token_counts"]]
        generation = Generation(request_id=str(index), sent_s=float(record["sent_s"]),
                                arrivals_s=[float(at) for at in record["arrivals_s"]], token_counts=counts,
                                completion_tokens=counts[-1] if counts else 0)
        if record["error"]:
            generation.error = str(record["error"])
        elif record["finished"]:
            generation.finish_reason = "stop"
        else:
            generation.error = STREAM_CLOSED
        generation.done.set()
        generations.append(generation)
    return generations


def run_peer(python: Path, job: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """Run the worker on `job` with the peer's interpreter; its JSON. Its progress lines reach
    the terminal as they come; raises PeerError when it fails or prints no result."""
    log(f"  {PEER}: {job['concurrency']} streams for {job['duration_s']:.0f} s in transformers' continuous "
        f"batching ({len(job['requests'])} requests in the list) ...")
    timeout_s = job["duration_s"] + 600  # loading the model and stopping the loop take seconds, not minutes
    try:
        result = subprocess.run([str(python), str(WORKER)], input=json.dumps(job), stdout=subprocess.PIPE,
                                stderr=None, text=True, env=_peer_env(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise PeerError(f"{PEER}: the worker ran past {timeout_s:.0f} s") from None
    if result.returncode != 0:
        raise PeerError(f"{PEER}: the worker failed (exit {result.returncode}; its error is above)")
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise PeerError(f"{PEER}: the worker printed no result: {result.stdout[-500:]!r}") from None
