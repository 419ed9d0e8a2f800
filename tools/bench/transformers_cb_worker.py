"""The `transformers_cb` peer's closed loop, run by the peer's own Python (see `transformers_cb`).

A standalone script: it imports only the standard library, torch and transformers, because it
runs in the peer's virtualenv (a newer transformers than the kit's), never in the kit's. It
reads one JSON job on stdin, loads the model from a local folder (offline: nothing comes from a
hub), keeps `concurrency` requests in transformers' continuous-batching manager (paged
attention), sending the next request of the job's list each time one finishes, for
`duration_s` seconds, and prints one JSON object on stdout: every request's send time and the
arrival time and running token count of each streamed output, in seconds from the start of the
loop. Progress lines go to stderr. The caller summarises the records as it does the kit's own.

Job fields: model_dir, device, dtype (a torch dtype's name), requests ([[prompt token ids],
max_tokens] pairs, cycled), concurrency, duration_s, num_threads, eos_token_ids,
kv_cache_bytes, block_size, max_num_seqs, max_num_batched_tokens, attn_implementation.
"""

from __future__ import annotations

import itertools
import json
import sys
import time

PROGRESS_EVERY_S = 30.0
POLL_S = 0.2  # how long one wait for an output lasts before the loop checks the clock


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """Keys and values of one token in every layer."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_heads = int(text.num_attention_heads)
    num_kv_heads = int(getattr(text, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // num_heads)
    return 2 * int(text.num_hidden_layers) * num_kv_heads * head_dim * dtype_bytes


def run(job: dict) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(int(job["num_threads"]))
    dtype = getattr(torch, job["dtype"])
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=dtype, local_files_only=True,
                                                 attn_implementation=job["attn_implementation"])
    model = model.to(job["device"]).eval()
    load_s = time.perf_counter() - started
    # The engine's limits: the same KV memory in blocks of the same size, as many sequences and
    # tokens per step.
    block_size = int(job["block_size"])
    per_token = kv_bytes_per_token(model.config, dtype.itemsize)
    num_blocks = max(1, int(job["kv_cache_bytes"]) // (block_size * per_token))
    limits = {"page_size": block_size, "num_blocks": num_blocks, "max_requests_per_batch": int(job["max_num_seqs"]),
              "max_batch_tokens": int(job["max_num_batched_tokens"])}
    cb_config = ContinuousBatchingConfig(**limits)
    generation = GenerationConfig(do_sample=False, eos_token_id=list(job["eos_token_ids"]),
                                  pad_token_id=job["eos_token_ids"][0])
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=cb_config)
    manager.start()
    requests = itertools.cycle(enumerate(job["requests"]))
    records: dict[str, dict] = {}
    in_flight: set[str] = set()
    start = time.perf_counter()
    end = start + float(job["duration_s"])

    def send() -> None:
        index, (prompt, max_tokens) = next(requests)
        request_id = f"r{len(records)}"
        records[request_id] = {"request": index, "sent_s": round(time.perf_counter() - start, 4), "arrivals_s": [],
                               "token_counts": [], "finished": False, "error": None}
        manager.add_request(prompt, request_id=request_id, max_new_tokens=int(max_tokens), streaming=True)
        in_flight.add(request_id)

    for _ in range(int(job["concurrency"])):
        send()
    next_progress = start + PROGRESS_EVERY_S
    try:
        while (now := time.perf_counter()) < end:
            if now >= next_progress:
                tokens = sum(r["token_counts"][-1] for r in records.values() if r["token_counts"])
                log(f"    transformers_cb: {now - start:.0f} s, {len(records)} requests sent, "
                    f"{len(records) - len(in_flight)} finished, {tokens} tokens")
                next_progress += PROGRESS_EVERY_S
            output = manager.get_result(timeout=POLL_S)
            if output is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous-batching loop stopped (its error is above)")
                continue
            record = records[output.request_id]
            count = len(output.generated_tokens)
            if count > (record["token_counts"][-1] if record["token_counts"] else 0):
                record["arrivals_s"].append(round(time.perf_counter() - start, 4))
                record["token_counts"].append(count)
            if output.is_finished():
                record["finished"] = True
                record["error"] = output.error
                in_flight.discard(output.request_id)
                send()
    finally:
        manager.stop(block=True, timeout=60, hard_stop=True)  # what is still running is dropped, not finished
    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "attn_implementation": str(model.config._attn_implementation), "load_s": round(load_s, 1),
            "num_threads": torch.get_num_threads(), "device": job["device"], "dtype": job["dtype"],
            "cache": limits,
            "records": list(records.values())}


def main() -> None:
    # An exception ends the process with its traceback on stderr and status 1: the caller
    # fails the benchmark with it.
    result = run(json.load(sys.stdin))
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
