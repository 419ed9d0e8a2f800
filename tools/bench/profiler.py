"""Measure the latency curves that the batching knobs are derived from.

For each bucket model of the serving spec: the compute time of one execution, c(b), at
batch sizes 1, 2, 4, ... (read from Triton's per-batch-size statistics, so queueing and
the client are excluded), until a batch costs more than half the SLO. Then the router
overhead o: single-row requests through the router, minus the bucket's c(1). Written to
profiles/<hardware>.json with a description of the machine.

By default a private tritonserver (explicit model control) is started on free ports; with
--url, a running server started with `--model-control-mode=explicit` is used and its
models are reloaded with probing configs (no dynamic batching) and restored afterwards.
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import numpy as np
from google.protobuf import json_format

from python_backends.embed.admission import ADMIT_ALL
from tools.bench.loadgen import batch_compute_ns
from tools.paths import DEFAULT_SPEC, PROFILE_DIR
from tools.planning.derivation import Admission, BatchingKnobs, RouterPlan
from tools.repository.configs import encoder_config, router_config
from tools.server.admin_key import AdminKeyError, add_key_file_argument, admin_headers, key_for_tool
from tools.server.triton_server import ModelControlMode, ServerConfig, ServerError, TritonServer, free_port
from tools.spec.profile import Hardware, LatencyCurve, LatencyProfile, ModelProfile, Overhead, save_profile
from tools.spec.serving import EmbedModelSpec, ServingSpec, SpecError, load_spec

MAX_PROBE_BATCH = 128
WARMUP_EXECUTIONS = 2


GPU_VENDOR_WORDS = frozenset({"nvidia", "tesla", "geforce", "quadro"})
GPU_FAMILY_WORDS = frozenset({"rtx", "gtx"})  # a family word names nothing alone: "RTX 4090" is one model


def profile_name_for_gpu(gpu: str) -> str:
    """The profile name for a GPU as nvidia-smi names it: its model, lower case.

    "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA A100-SXM4-80GB" -> "a100", "Tesla T4" -> "t4",
    "NVIDIA GeForce RTX 4090" -> "rtx4090"; memory size and form factor are left out, so
    one profile serves every variant of a model. "gpu" when no model word is left.
    """
    words = [word.lower() for word in gpu.split() if word.lower() not in GPU_VENDOR_WORDS]
    parts = [word.split("-")[0] for word in words]
    model = parts[:2] if parts and parts[0] in GPU_FAMILY_WORDS else parts[:1]
    name = "".join(ch for ch in "".join(model) if ch.isascii() and ch.isalnum())
    return name or "gpu"


def detect_hardware(name: str | None) -> Hardware:
    """Describe this machine: CPU model and count, the GPU if nvidia-smi sees one, versions."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = None
    if shutil.which("nvidia-smi"):
        result = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=30)
        gpu = result.stdout.strip().splitlines()[0] if result.returncode == 0 and result.stdout.strip() else None
    import onnxruntime

    kind = "gpu" if gpu else "cpu"
    if name is None:
        name = "cpu" if gpu is None else profile_name_for_gpu(gpu)
    memory_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return Hardware(
        name=name,
        kind=kind,
        description=f"{gpu} + {cpu}" if gpu else f"{os.cpu_count()} x {cpu}",
        cpu_count=os.cpu_count() or 0,
        gpu=gpu,
        details={"memory_gb": memory_gb, "platform": platform.platform(), "python": platform.python_version(),
                 "onnxruntime": onnxruntime.__version__, "providers": onnxruntime.get_available_providers()},
    )


def probe_knobs(name: str, max_batch: int) -> BatchingKnobs:
    return BatchingKnobs(model_name=name, max_batch_size=max_batch, preferred_batch_size=1, max_queue_delay_us=0,
                         default_timeout_us=0, max_queue_size=0, instance_count=1)


def profiled_version(model: EmbedModelSpec) -> int:
    """The encoder version whose c(b) the profile records: the one serving most unpinned traffic
    (the lowest of a tie), else the first. Its curve sets every version's knobs; a cheaper
    version (INT8) then runs with room to spare, never over its budget."""
    if model.traffic:
        return min(model.traffic, key=lambda version: (-model.traffic[version], version))
    return model.versions[0]


def profiling_router_config(model: EmbedModelSpec, spec: ServingSpec, bucket_max_batch: dict[int, int]):
    """The router as the overhead probe runs it: one instance and no admission bound, since the
    probe sends one request at a time and measures the router's own cost, not its refusals."""
    return router_config(model, spec, bucket_max_batch, RouterPlan(instance_count=1, max_concurrent_requests=1),
                         admission=Admission(policy=ADMIT_ALL, max_queue_size=0))


def load_with_config(client, config, control_headers: Mapping[str, str] | None = None) -> None:
    client.load_model(config.name, config=json_format.MessageToJson(config, preserving_proto_field_name=True),
                      headers=dict(control_headers or {}))


def measure_bucket(client, name: str, seq_len: int, sizes: list[int], stop_ms: float, time_budget_s: float,
                   progress) -> ModelProfile:
    import tritonclient.http as httpclient

    rng = np.random.default_rng(seq_len)
    compute_ms: dict[int, float] = {}
    executions: dict[int, int] = {}
    for batch in sizes:
        ids = rng.integers(1000, 20000, size=(batch, seq_len), dtype=np.int64)
        ids[:, 0], ids[:, -1] = 101, 102
        inputs = [httpclient.InferInput("INPUT_IDS", list(ids.shape), "INT64"),
                  httpclient.InferInput("ATTENTION_MASK", list(ids.shape), "INT64")]
        inputs[0].set_data_from_numpy(ids)
        inputs[1].set_data_from_numpy(np.ones_like(ids))
        for _ in range(WARMUP_EXECUTIONS):
            client.infer(name, inputs)

        def compute_so_far(batch: int = batch) -> tuple[int, int]:
            return batch_compute_ns(client.get_inference_statistics(name)["model_stats"][0], batch)

        ns_before, count_before = compute_so_far()
        started = time.monotonic()
        reps = 0
        while reps < 3 or (reps < 30 and time.monotonic() - started < time_budget_s):
            client.infer(name, inputs)
            reps += 1
        ns_after, count_after = compute_so_far()
        if count_after - count_before < reps:  # statistics land just after each response
            time.sleep(0.2)
            ns_after, count_after = compute_so_far()
        compute_ms[batch] = (ns_after - ns_before) / max(count_after - count_before, 1) / 1e6
        executions[batch] = count_after - count_before
        progress.set_postfix_str(f"{name} b={batch}: {compute_ms[batch]:.1f} ms")
        progress.update(1)
        if compute_ms[batch] > stop_ms:
            progress.update(len(sizes) - sizes.index(batch) - 1)
            break
    return ModelProfile(seq_len=seq_len, curve=LatencyCurve(compute_ms), reps=executions)


def measure_overhead(client, model: EmbedModelSpec, bucket: str, c1_ms: float, num_requests: int,
                     cpu_seconds=None) -> Overhead:
    """Router-path latency outside the bucket's compute, from single-row requests; with
    `cpu_seconds` (the server's CPU so far) also the CPU each request costs outside the
    bucket model: the router stub, tokenization, BLS and Triton's own request handling."""
    import tritonclient.http as httpclient

    text = httpclient.InferInput("TEXT", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"a short query to time the router path"]], dtype=object))
    for _ in range(5):
        client.infer(model.name, [text])

    def bucket_compute_ns() -> int:
        return batch_compute_ns(client.get_inference_statistics(bucket)["model_stats"][0])[0]

    compute_before = bucket_compute_ns()
    cpu_before = cpu_seconds() if cpu_seconds else 0.0
    latencies = []
    for _ in range(num_requests):
        started = time.perf_counter()
        client.infer(model.name, [text])
        latencies.append((time.perf_counter() - started) * 1000.0)
    cpu_ms = None
    if cpu_seconds:
        time.sleep(0.2)  # statistics land just after each response
        # One ONNX Runtime thread per instance: the bucket's compute time is its CPU time.
        bucket_cpu_s = (bucket_compute_ns() - compute_before) / 1e9
        cpu_ms = max(cpu_seconds() - cpu_before - bucket_cpu_s, 0.0) / num_requests * 1000.0
    overheads = np.maximum(np.asarray(latencies) - c1_ms, 0.0)
    return Overhead(p50_ms=float(np.percentile(overheads, 50)), p95_ms=float(np.percentile(overheads, 95)),
                    cpu_ms=cpu_ms)


def profile_models(client, spec: ServingSpec, hardware_kind: str, time_budget_s: float, overhead_requests: int,
                   log, cpu_seconds=None, control_headers: Mapping[str, str] | None = None,
                   ) -> tuple[dict[str, ModelProfile], dict[str, Overhead]]:
    from tqdm import tqdm

    hardware = spec.hardware.get(hardware_kind)
    if hardware is None:
        raise SpecError(f"{spec.path}: no [hardware.{hardware_kind}] table")
    sizes = [2**i for i in range(MAX_PROBE_BATCH.bit_length()) if 2**i <= MAX_PROBE_BATCH]
    if hardware.kind != "cpu" or hardware.intra_op_threads != 1:
        cpu_seconds = None  # the bucket's compute time is its CPU time only for one thread on a CPU
    models: dict[str, ModelProfile] = {}
    overheads: dict[str, Overhead] = {}
    total = sum(len(sizes) * len(m.bucket_lens) for m in spec.models)
    with tqdm(total=total, desc="profiling", unit="point", file=sys.stderr, dynamic_ncols=True) as progress:
        for model in spec.models:
            # Beyond half the SLO a batch can never be used (o + 2·c(b) <= S); one point past it is enough.
            stop_ms = model.slo_p95_ms / 2
            for bucket_len in model.bucket_lens:
                name = model.encoder_name(bucket_len)
                # One version loaded, so that requests and statistics are both that version's.
                config = encoder_config(name, bucket_len, probe_knobs(name, MAX_PROBE_BATCH), hardware,
                                        (profiled_version(model),))
                config.ClearField("dynamic_batching")  # one request = one execution of exactly b rows
                load_with_config(client, config, control_headers)
                models[name] = measure_bucket(client, name, bucket_len, sizes, stop_ms, time_budget_s, progress)
            limits = {b: MAX_PROBE_BATCH for b in model.bucket_lens}
            load_with_config(client, profiling_router_config(model, spec, limits), control_headers)
            first = model.encoder_name(model.bucket_lens[0])
            overhead = measure_overhead(client, model, first, models[first].curve.at(1), overhead_requests,
                                        cpu_seconds)
            overheads[model.name] = overhead
            log(f"{model.name}: router overhead p50 {overhead.p50_ms:.2f} ms, p95 {overhead.p95_ms:.2f} ms"
                + (f", {overhead.cpu_ms:.2f} CPU ms per request" if overhead.cpu_ms is not None else
                   " (CPU per request not measured: needs a private server and one thread per CPU instance)"))
    return models, overheads


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC, help="serving spec (default: %(default)s)")
    parser.add_argument("--url", default=None,
                        help="HTTP address of a running tritonserver in explicit model-control mode; "
                             "default: start a private one")
    add_key_file_argument(parser)
    parser.add_argument("--name", default=None,
                        help="profile name (default: 'cpu' without a GPU, else the GPU's model: h100 for "
                             "'NVIDIA H100 80GB HBM3', a100 for 'NVIDIA A100-SXM4-80GB')")
    parser.add_argument("--out", type=Path, default=None, help="profile file (default: profiles/<name>.json)")
    parser.add_argument("--time-per-point", type=float, default=1.0, metavar="SECONDS",
                        help="measuring time per batch size (3 to 30 executions; default: %(default)s)")
    parser.add_argument("--overhead-requests", type=int, default=60,
                        help="single-row router requests timed for the overhead (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    import tritonclient.http as httpclient

    try:
        spec = load_spec(args.spec)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    hardware = detect_hardware(args.name)
    if hardware.kind in spec.hardware:  # c(b) depends on the threads each instance runs: record them
        threads = spec.hardware[hardware.kind].intra_op_threads
        hardware = replace(hardware, details={**hardware.details, "intra_op_threads": threads})
    out = args.out or PROFILE_DIR / f"{hardware.name}.json"
    print(f"profiling on {hardware.description} -> {out}", flush=True)
    with ExitStack() as stack:
        url = args.url
        cpu_seconds = None
        if url is None:
            admin_key = secrets.token_urlsafe(32)  # a private server's control endpoints are this run's alone
            config = ServerConfig(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                                  host="127.0.0.1", model_control_mode=ModelControlMode.EXPLICIT, admin_key=admin_key)
            server = TritonServer(config, log_path=Path("build/profile-logs/tritonserver.log").resolve())
            try:
                stack.enter_context(server)
            except ServerError as err:
                print(f"error: {err}", file=sys.stderr)
                return 2
            url = server.http_url
            cpu_seconds = server.cpu_seconds
        else:
            try:
                admin_key = key_for_tool(args)
            except AdminKeyError as err:
                print(f"error: {err}", file=sys.stderr)
                return 2
        headers = admin_headers(admin_key)
        client = httpclient.InferenceServerClient(url, network_timeout=300)
        # Closed before the server stops: an open connection holds a stopping server for its
        # whole exit timeout, after which it quits without unloading its models.
        stack.callback(client.close)
        try:
            if not client.is_server_live():
                raise ConnectionError
        except Exception:
            print(f"error: no tritonserver answering at {url}", file=sys.stderr)
            return 2
        originally_loaded = {m["name"] for m in client.get_model_repository_index(headers=headers)
                             if m.get("state") == "READY"}
        try:
            models, overheads = profile_models(client, spec, hardware.kind, args.time_per_point,
                                               args.overhead_requests, log=lambda m: print(m, flush=True),
                                               cpu_seconds=cpu_seconds, control_headers=headers)
        except Exception as err:
            print(f"error: profiling failed: {err}", file=sys.stderr)
            return 1
        finally:
            if args.url is not None:  # leave a shared server as it was: repository configs, same models
                for name in sorted(originally_loaded):
                    client.load_model(name, headers=headers)
    profile = LatencyProfile(path=out, sha256="", hardware=hardware,
                             measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                             models=models, overhead=overheads)
    save_profile(profile, out)
    for name, m in models.items():
        points = ", ".join(f"{b}:{ms:.1f}" for b, ms in sorted(m.curve.compute_ms.items()))
        print(f"  {name:<14} c(b) ms  {points}")
    print(f"wrote {out}; now run `python -m tools gen-config`")
    return 0
