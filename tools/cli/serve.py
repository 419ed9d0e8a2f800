"""Serve the model repository on tritonserver 2.51 (from the nvidia-pytriton wheel).

Starts the server, waits until every model is ready, prints the endpoints and an
example request, and stops cleanly on Ctrl-C or SIGTERM (in-flight requests finish).
When it serves an LLM model of the spec, the OpenAI-compatible API (`python -m tools
llm-api`) runs beside it on --llm-api-port, started once the server is ready (left out, with a
line saying so, when that port is taken) and stopped before it.
The serving spec's external models are served from the users' own repositories, given to
tritonserver beside the kit's (each `--model-repository`); of those repositories only the
models the spec names are loaded.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from tools.clients.tls import TlsConfigError, check_pem
from tools.paths import DEFAULT_MODEL_REPOSITORY, DEFAULT_SPEC
from tools.server.admin_key import ADMIN_HEADER, ADMIN_KEY_ENV, AdminKeyError, find_admin_key
from tools.server.supervisor import serve_until_stopped
from tools.server.triton_server import (
    GrpcTls,
    ModelControlMode,
    ServerConfig,
    ServerError,
    TritonServer,
    busy_ports,
    find_distribution,
    model_names,
)
from tools.spec.serving import ServingSpec, SpecError, load_spec


def port_or_zero(value: str) -> int:
    return 0 if value.strip() == "0" else port(value)


def port(value: str) -> int:
    number = int(value)
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (1-65535)")
    return number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY,
                        help="model repository to serve (default: %(default)s)")
    parser.add_argument("--spec", type=Path, default=None,
                        help="serving spec whose external models' repositories are served too (default: "
                             f"{DEFAULT_SPEC.name} of the kit, when there is one)")
    parser.add_argument("--http-port", type=port, default=8000, help="HTTP/REST port (default: %(default)s)")
    parser.add_argument("--grpc-port", type=port, default=8001, help="gRPC port (default: %(default)s)")
    parser.add_argument("--metrics-port", type=port, default=8002,
                        help="Prometheus metrics port (default: %(default)s)")
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default: %(default)s)")
    parser.add_argument("--model-control-mode", type=ModelControlMode,
                        choices=list(ModelControlMode), default=ModelControlMode.EXPLICIT,
                        help="explicit: load every model at start, then load/unload versions through the "
                             "repository API (what `rollout` uses); none: load all, no changes; poll: follow "
                             "repository changes (default: %(default)s)")
    parser.add_argument("--load-model", action="append", default=[], metavar="NAME",
                        help="with explicit mode: a model to load at start (repeatable; default: all)")
    parser.add_argument("--log-verbose", type=int, default=0, metavar="LEVEL",
                        help="tritonserver verbose log level, 0 = off (default: %(default)s)")
    parser.add_argument("--log-file", type=Path, default=None,
                        help="write the server log here instead of the terminal")
    parser.add_argument("--no-supervisor", dest="supervise", action="store_false",
                        help="do not reload a model whose Python backend instance died (by default, in explicit "
                             "mode, a watcher reloads it within about a second; Triton itself never restarts one)")
    parser.add_argument("--triton-home", type=Path, default=None, metavar="DIR",
                        help="run the tritonserver of this Triton installation (e.g. /opt/tritonserver in the "
                             "nvcr.io 24.10 container, the same 2.51 release) instead of the nvidia-pytriton wheel's; "
                             "the wheel still provides the Python backend stub for this interpreter")
    parser.add_argument("--admin-key-file", type=Path, default=None, metavar="FILE",
                        help=f"put the control endpoints (load/unload, shared memory, trace, logging) behind the key "
                             f"in FILE (default: ${ADMIN_KEY_ENV}); explicit mode refuses to start without a key. "
                             "`python -m tools admin-key new FILE` makes one; clients send it in the "
                             f"'{ADMIN_HEADER}' header")
    parser.add_argument("--grpc-tls-cert", type=Path, default=None, metavar="PEM",
                        help="serve gRPC over TLS with this certificate (with --grpc-tls-key); plaintext gRPC is "
                             "then refused. Clients pass the CA with --grpc-tls-ca. Triton's HTTP port has no TLS: "
                             "put a TLS-terminating proxy in front of it")
    parser.add_argument("--grpc-tls-key", type=Path, default=None, metavar="PEM",
                        help="the private key of --grpc-tls-cert")
    parser.add_argument("--pinned-memory-mb", type=int, default=0, metavar="MB",
                        help="CUDA pinned host memory pool: 0 without a GPU (default), e.g. 256 on GPU nodes")
    parser.add_argument("--llm-api-port", type=port_or_zero, default=LLM_API_PORT, metavar="PORT",
                        help="port of the OpenAI-compatible API in front of the spec's LLM models, started when "
                             "one is served (default: %(default)s; 0: none)")
    parser.add_argument("--ready-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="give up if the models are not ready within this time (default: %(default)s)")


LLM_API_PORT = 9000
API_STOP_TIMEOUT_S = 15  # the API cuts streams still open 10 s after SIGTERM (tools.llm_api.app)


def llm_api_argv(port: int, host: str, grpc_port: int, models: list[str], tls: GrpcTls | None) -> list[str]:
    """The command line of the LLM API beside the server: it calls the server's gRPC port
    (over TLS when the server's gRPC is, trusting the server's certificate)."""
    argv = [sys.executable, "-m", "tools", "llm-api", "--host", host, "--port", str(port),
            "--triton-url", f"localhost:{grpc_port}"]
    for model in models:
        argv += ["--model", model]
    return argv + (["--grpc-tls-ca", str(tls.cert)] if tls is not None else [])


def stop_process(process: subprocess.Popen | None, timeout_s: float) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def example_request(http_port: int) -> str:
    return (
        f"curl -s -X POST localhost:{http_port}/v2/models/embed/infer \\\n"
        "  -H 'Content-Type: application/json' \\\n"
        "  -d '{\"inputs\":[{\"name\":\"TEXT\",\"shape\":[1,1],\"datatype\":\"BYTES\","
        "\"data\":[\"Triton batches requests by length\"]}]}'"
    )


def server_admin_key(key_file: Path | None, mode: ModelControlMode, env: Mapping[str, str]) -> str | None:
    """The admin key `serve` starts tritonserver with; explicit mode without one is refused,
    since anyone reaching the port could then unload models."""
    key = find_admin_key(key_file, env)
    if key is None and mode is ModelControlMode.EXPLICIT:
        raise AdminKeyError(f"explicit model control needs an admin key, so that only operators can load and unload "
                            f"models: pass --admin-key-file FILE or set ${ADMIN_KEY_ENV} (`python -m tools admin-key "
                            "new build/admin.key` makes one; `make serve` does it for you)")
    return key


def admin_line(key_file: Path | None, key: str | None) -> str:
    if key is None:
        return "control endpoints (load/unload, shared memory, trace, logging) OPEN: no admin key given"
    source = key_file if key_file is not None else f"${ADMIN_KEY_ENV}"
    return f"control endpoints need the key from {source} in the '{ADMIN_HEADER}' header"


def grpc_tls(cert: Path | None, key: Path | None) -> GrpcTls | None:
    """The server's gRPC TLS files, both or neither, each a PEM file."""
    if (cert is None) != (key is None):
        raise TlsConfigError("--grpc-tls-cert and --grpc-tls-key go together: give both, or neither for plaintext")
    if cert is None or key is None:
        return None
    return GrpcTls(cert=check_pem(cert, "gRPC TLS certificate").resolve(),
                   key=check_pem(key, "gRPC TLS private key").resolve())


def serving_spec(path: Path | None) -> ServingSpec | None:
    """The spec named (SpecError when it is missing or invalid), else the kit's own if present."""
    if path is None and not DEFAULT_SPEC.is_file():
        return None
    return load_spec(path or DEFAULT_SPEC)


def run(args: argparse.Namespace) -> int:
    try:
        admin_key = server_admin_key(args.admin_key_file, args.model_control_mode, os.environ)
        tls = grpc_tls(args.grpc_tls_cert, args.grpc_tls_key)
        spec = serving_spec(args.spec)
    except (AdminKeyError, TlsConfigError, SpecError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    external_models = spec.external_models if spec is not None else ()
    load_models = tuple(args.load_model)
    if args.model_control_mode is ModelControlMode.EXPLICIT and not load_models:
        load_models = (*model_names(args.model_repository), *external_models)
    config = ServerConfig(
        model_repository=args.model_repository.resolve(),
        extra_repositories=spec.external_repositories if spec is not None else (),
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        host=args.host,
        model_control_mode=args.model_control_mode,
        load_models=load_models,
        log_verbose=args.log_verbose,
        pinned_memory_bytes=args.pinned_memory_mb * 1024 * 1024,
        admin_key=admin_key,
        grpc_tls=tls,
    )
    served = set(load_models) if load_models else set(model_names(config.model_repository))
    llm_models = [m.name for m in (spec.llm_models if spec is not None else ()) if m.name in served]
    api_port = args.llm_api_port if llm_models else 0
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        if args.pinned_memory_mb < 0:
            raise ServerError(f"--pinned-memory-mb must be >= 0, got {args.pinned_memory_mb}")
        dist = find_distribution(triton_home=args.triton_home) if args.triton_home else None
        server = TritonServer(config, log_path=args.log_file, dist=dist)
        server.start()
    except ServerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"tritonserver starting on {config.model_repository} ...", flush=True)
    try:
        server.wait_ready(timeout_s=args.ready_timeout)
    except ServerError as err:
        print(f"error: {err}", file=sys.stderr)
        server.stop()
        return 1
    api, api_line = None, ""
    if api_port and busy_ports({"--llm-api-port": api_port}, args.host):
        # The API is beside the server, not part of it: a taken port leaves it out, not the server.
        api_line = f"  OpenAI   not started: port {api_port} is in use (--llm-api-port moves it)\n"
    elif api_port:
        # Its own process group: Ctrl-C reaches serve, which stops the API first, then the server.
        api = subprocess.Popen(llm_api_argv(api_port, args.host, config.grpc_port, llm_models, tls),
                               stdout=subprocess.DEVNULL, start_new_session=True)
        api_line = (f"  OpenAI   http://localhost:{api_port}/v1   ({', '.join(llm_models)}; the API key is a "
                    "tenant token)\n")
    print(
        "\ntritonserver is ready\n"
        f"  HTTP     http://localhost:{config.http_port}   (KServe v2 REST)\n"
        f"  gRPC     localhost:{config.grpc_port}{'   (TLS)' if tls else ''}\n"
        f"  metrics  http://localhost:{config.metrics_port}/metrics\n"
        f"  models   {', '.join([*model_names(config.model_repository), *external_models])}\n"
        f"{api_line}"
        f"  admin    {admin_line(args.admin_key_file, admin_key)}\n\n"
        f"Try:\n{example_request(config.http_port)}\n\nCtrl-C stops the server.",
        flush=True,
    )
    supervise = args.supervise and config.model_control_mode is ModelControlMode.EXPLICIT
    try:
        exited = serve_until_stopped(server, stop, supervise=supervise, admin_key=admin_key,
                                     log=lambda line: print(line, flush=True))
    finally:
        stop_process(api, API_STOP_TIMEOUT_S)
    if exited is not None:
        print(f"error: tritonserver exited with code {exited}", file=sys.stderr)
        server.stop()  # its stubs' stragglers and the shared memory it left
        return 1
    print("stopping tritonserver (in-flight requests finish first) ...", flush=True)
    code = server.stop()
    print(f"tritonserver stopped (exit code {code})", flush=True)
    return 0
