"""Measure the latency curves that the batching knobs are derived from.

For each bucket model of the serving spec: the compute time of one execution, c(b), at
batch sizes 1, 2, 4, ... (read from Triton's per-batch-size statistics, so queueing and
the client are excluded), until a batch costs more than half the SLO. Then the router
overhead o: single-row requests through the router, minus the bucket's c(1). Written to
profiles/<hardware>.json with a description of the machine. With --model, only the models
named are measured, and their curves replace theirs in the existing profile of this hardware
(a model just added is profiled without measuring the others again). A model measured again
loses the knobs `python -m tools tune` chose for it (they were measured on the old curves);
the tuned knobs of models not measured stay.

An external model (a model of the user's own Triton repository) is measured the same way,
through the server, loaded with its own config but for the probing fields, on random inputs
of its declared types and shapes; the private server serves the spec's external repositories
beside the kit's.

By default a private tritonserver (explicit model control) is started on free ports; with
--url, a running server started with `--model-control-mode=explicit` is used and its
models are reloaded with probing configs (no dynamic batching) and restored afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import sys
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from tools.bench.harness import detect_hardware
from tools.bench.loadgen import MIN_P95_SAMPLES
from tools.bench.profiler import profile_models
from tools.paths import DEFAULT_MODEL_REPOSITORY, DEFAULT_SPEC, PROFILE_DIR
from tools.server.admin_key import AdminKeyError, add_key_file_argument, admin_headers, key_for_tool
from tools.server.triton_server import ModelControlMode, ServerConfig, ServerError, TritonServer, free_port
from tools.spec.profile import (
    Hardware,
    LatencyProfile,
    ProfileError,
    load_profile,
    save_profile,
    tuned_after_profiling,
)
from tools.spec.serving import SpecError, load_spec


def overhead_requests(text: str) -> int:
    """An argparse type: a request count enough for the overhead's p95 (MIN_P95_SAMPLES: with 10,
    one late answer made o = 277 ms and gen-config refused a 200 ms SLO)."""
    value = int(text)
    if value < MIN_P95_SAMPLES:
        raise argparse.ArgumentTypeError(f"must be >= {MIN_P95_SAMPLES} (a p95 of fewer requests is mostly "
                                         f"their slowest one), got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC, help="serving spec (default: %(default)s)")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY,
                        help="repository the private server serves (default: %(default)s)")
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
    parser.add_argument("--model", action="append", default=[], metavar="NAME",
                        help="measure only this model (repeatable) and merge it into the existing profile")
    parser.add_argument("--overhead-requests", type=overhead_requests, default=60,
                        help=f"single-row router requests timed for the overhead, at least {MIN_P95_SAMPLES} "
                             "(its p95 of fewer is mostly the slowest one; default: %(default)s)")


def existing_profile(path: Path, hardware: Hardware) -> LatencyProfile | None:
    """The profile a --model run merges into: None when there is none yet; ProfileError when it
    was measured on other hardware (one profile holds one machine's curves)."""
    if not path.is_file():
        return None
    profile = load_profile(path)
    if (profile.hardware.name, profile.hardware.cpu_count) != (hardware.name, hardware.cpu_count) or \
            profile.hardware.details.get("intra_op_threads") != hardware.details.get("intra_op_threads"):
        raise ProfileError(f"{path} was measured on {profile.hardware.description}, this is "
                           f"{hardware.description}: profile every model here (without --model), or "
                           "write to another file with --out")
    return profile


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
    try:
        merge_into = existing_profile(out, hardware) if args.model else None
    except ProfileError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"profiling on {hardware.description} -> {out}", flush=True)
    with ExitStack() as stack:
        url = args.url
        cpu_seconds = None
        if url is None:
            admin_key = secrets.token_urlsafe(32)  # a private server's control endpoints are this run's alone
            config = ServerConfig(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                                  host="127.0.0.1", model_control_mode=ModelControlMode.EXPLICIT, admin_key=admin_key,
                                  model_repository=args.model_repository.resolve(),
                                  extra_repositories=spec.external_repositories)
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
                                               cpu_seconds=cpu_seconds, control_headers=headers,
                                               only=tuple(args.model))
        except SpecError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        except Exception as err:
            print(f"error: profiling failed: {err}", file=sys.stderr)
            return 1
        finally:
            if args.url is not None:  # leave a shared server as it was: repository configs, same models
                for name in sorted(originally_loaded):
                    client.load_model(name, headers=headers)
    if merge_into is not None:
        models, overheads = {**merge_into.models, **models}, {**merge_into.overhead, **overheads}
    # Tuned knobs were measured against the curves they were tuned on: a model measured again
    # loses its entry; another model's (merged with --model) keeps its own.
    measured = set(args.model) or {model.name for model in spec.models}
    tuned = dict(merge_into.tuned) if merge_into is not None else {}
    if merge_into is None and out.is_file():
        with contextlib.suppress(ProfileError):
            tuned = dict(load_profile(out).tuned)
    tuned, dropped = tuned_after_profiling(tuned, measured)
    for name in dropped:
        print(f"dropped the tuned knobs of {name}: it was measured again; `python -m tools tune {name}` tunes it "
              "on the new curves")
    profile = LatencyProfile(path=out, sha256="", hardware=hardware,
                             measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                             models=models, overhead=overheads, tuned=tuned)
    save_profile(profile, out)
    for name, m in models.items():
        points = ", ".join(f"{b}:{ms:.1f}" for b, ms in sorted(m.curve.compute_ms.items()))
        print(f"  {name:<14} c(b) ms  {points}")
    print(f"wrote {out}; now run `python -m tools gen-config`")
    return 0
