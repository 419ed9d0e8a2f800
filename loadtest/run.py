"""The run-level glue of a Locust load run: options, setup, shipping samples, the verdict.

`register(events)` hooks it into Locust. On every process the init listener reads the mix and
the spec and sets the user classes' weights and pacing; on a worker the recorded samples ride
along with each stats report to the master; on the master (or a lone process) the quitting
listener judges the run, writes the reports and sets the exit code.
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from locust import constant_throughput
from locust.runners import WorkerRunner

from loadtest import triton_users
from loadtest.mix import LoadMix, Protocol, load_mix
from loadtest.shapes import LoadShape, compress, load_shape, scale_users
from loadtest.slo import Sample, judge, render_markdown, stage_rows, targets_for
from tools.bench.harness import detect_hardware, hardware_report
from tools.clients.tenant_token import KeysError, tenant_parameters
from tools.clients.tls import check_pem
from tools.paths import DEFAULT_SPEC
from tools.spec.serving import ServingSpec, SpecError, load_spec

log = logging.getLogger("loadtest")
SAMPLES_KEY = "slo_samples"  # in the worker -> master stats report


@dataclass
class RunState:
    shape: LoadShape | None = None  # the --shape table, scaled; None: --users for --run-time
    start_s: float | None = None  # wall clock when the test started (master or lone process)
    targets: dict | None = None  # model -> Target
    spec_path: Path = DEFAULT_SPEC
    workers: set[str] = field(default_factory=set)  # master: the workers that reported samples


STATE = RunState()


def add_options(parser) -> None:
    """The kit's options, each also read from a `LOCUST_<NAME>` variable as Locust's own are
    (the command line wins over the variable, the variable over locust.conf)."""
    def option(name: str, **kwargs) -> None:
        # Locust's parser itself: options added to a group lose `include_in_web_ui`.
        parser.add_argument(name, include_in_web_ui=False, env_var="LOCUST_" + name[2:].upper().replace("-", "_"),
                            **kwargs)

    option("--mix", default="embed",
           help="load mix: a file, or a name in loadtest/mixes/ (embed, mixed, llm); default embed")
    option("--shape", default="",
           help="load shape: a file, or a name in loadtest/shapes/ (step, spike, diurnal); "
                "default none: --users for --run-time")
    option("--shape-seconds", type=float, default=0.0,
           help="play the whole shape in this many seconds (0: as written)")
    option("--shape-user-scale", type=float, default=1.0,
           help="multiply the shape's users by this (e.g. 0.5 for a smaller machine)")
    option("--triton-grpc", default="localhost:8001",
           help="tritonserver gRPC endpoint, host:port (default localhost:8001)")
    option("--triton-grpc-tls-ca", default="",
           help="gRPC over TLS, trusting this CA certificate (PEM; a self-signed server "
                "certificate itself); default: plaintext")
    option("--triton-http", default="localhost:8000",
           help="tritonserver HTTP endpoint, host:port (default localhost:8000)")
    option("--spec", default=str(DEFAULT_SPEC),
           help="serving spec holding the SLOs and tenant tiers (default serving.toml)")
    option("--slo-report", default="build/loadtest/summary.md",
           help="where to write the Markdown verdict (default build/loadtest/summary.md)")
    option("--slo-json", default="build/loadtest/verdict.json",
           help="where to write the verdict as JSON (default build/loadtest/verdict.json)")
    option("--settle-s", type=float, default=5.0,
           help="seconds at the start of each shape stage left out of its stage row (default 5)")


def _load(options):
    """Mix, spec and shape from the options; ValueError or SpecError with a clear message."""
    mix = load_mix(options.mix)
    spec = load_spec(options.spec)
    if options.triton_grpc_tls_ca:
        check_pem(Path(options.triton_grpc_tls_ca), "gRPC TLS CA certificate")  # TlsConfigError is a ValueError
    shape = None
    if options.shape:
        shape = load_shape(options.shape)
        if options.shape_user_scale != 1.0:
            shape = scale_users(shape, options.shape_user_scale)
        if options.shape_seconds:
            shape = compress(shape, options.shape_seconds)
    return mix, spec, shape


def _server_ready(http_url: str, models: list[str]) -> str | None:
    """None when tritonserver answers and every model is ready, else what is wrong."""
    import tritonclient.http as httpclient

    try:
        client = httpclient.InferenceServerClient(http_url, connection_timeout=5, network_timeout=5)
        try:
            if not client.is_server_ready():
                return f"tritonserver at {http_url} is not ready"
            missing = [model for model in models if not client.is_model_ready(model)]
        finally:
            client.close()
    except Exception as err:  # any connection failure means the same thing here
        return f"cannot reach tritonserver at {http_url} ({err}); start it with `make serve`"
    if missing:
        return f"models not ready on {http_url}: {', '.join(missing)}"
    return None


def configure(environment) -> tuple[LoadMix, ServingSpec]:
    """Load the mix, spec and shape from the options and set up this process's users: their
    weights, their pacing, and the texts and chats they send (made now, not on the first
    request, so no call is timed while the process is busy making them)."""
    options = environment.parsed_options
    try:
        mix, spec, shape = _load(options)
        # Each tenant of the mix sends its token, signed with the spec's keys (the load
        # generator runs where the server's keys are).
        credentials = tenant_parameters(spec, [t.name for t in mix.tenants])
    except (ValueError, SpecError, KeysError) as err:
        log.error("%s", err)
        raise SystemExit(2) from None
    STATE.shape, STATE.spec_path = shape, Path(options.spec)
    tenants = spec.tenant_policy()
    context = triton_users.RunContext(
        mix=mix, grpc_url=options.triton_grpc, http_url=options.triton_http,
        priorities={t.name: tenants.tier_of(t.name).priority for t in mix.tenants}, credentials=credentials,
        grpc_tls_ca=Path(options.triton_grpc_tls_ca) if options.triton_grpc_tls_ca else None)
    context.prepare()
    triton_users.CONTEXT = context
    weights = mix.user_weights()
    used = []
    for key, user_class in triton_users.USER_CLASSES.items():
        user_class.weight = max(1, round(weights[key] * 1000)) if key in weights else 0
        user_class.wait_time = constant_throughput(mix.user_rps)
        if key in weights:
            used.append(user_class)
    environment.user_classes = used
    return mix, spec


def on_init(environment, **_kwargs) -> None:
    mix, spec = configure(environment)
    if isinstance(environment.runner, WorkerRunner):
        return
    try:
        STATE.targets = targets_for(
            mix, {m.name: m.slo_p95_ms for m in spec.models}, {m.name: m.ttft_p95_ms for m in spec.llm_models})
    except ValueError as err:
        log.error("%s", err)
        raise SystemExit(2) from None
    models = sorted({m.model for m in mix.models} | {m.http_model for m in mix.models
                                                       if any(p is Protocol.HTTP for p, _ in m.protocols)})
    problem = _server_ready(environment.parsed_options.triton_http, models)
    if problem:
        log.error("%s", problem)
        raise SystemExit(2)


def on_test_start(environment, **_kwargs) -> None:
    if isinstance(environment.runner, WorkerRunner):
        # The master has just sent its own options (mix, endpoints, ...): a worker follows them.
        configure(environment)
    elif STATE.start_s is None:
        STATE.start_s = time.time()


def on_report_to_master(client_id, data) -> None:
    """Worker: hand the samples recorded since the last report to the master."""
    context = triton_users.CONTEXT
    data[SAMPLES_KEY] = [sample.to_row() for sample in context.samples]
    context.samples.clear()


def on_worker_report(client_id, data) -> None:
    """Master: keep the samples a worker sent."""
    STATE.workers.add(client_id)
    triton_users.CONTEXT.samples.extend(Sample.from_row(row) for row in data.get(SAMPLES_KEY, ()))


def _shown(path: Path) -> str:
    """A path as the report shows it: relative to where the run started, when it is below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def on_test_stop(environment, **_kwargs) -> None:
    """Every process: close what the users left open (a worker exits right after)."""
    if triton_users.CONTEXT is not None:
        triton_users.CONTEXT.close_clients()


def on_quitting(environment, **_kwargs) -> None:
    """Master or lone process: judge the run, write the reports, set the exit code."""
    if isinstance(environment.runner, WorkerRunner) or STATE.targets is None:
        return
    context = triton_users.CONTEXT
    options = environment.parsed_options
    samples = list(context.samples)
    verdict = judge(samples, STATE.targets, context.mix.max_error_rate, context.mix.tenant_error_rates())
    rows = []
    if STATE.shape is not None and STATE.start_s is not None:
        rows = stage_rows(samples, STATE.shape, STATE.start_s, STATE.targets, context.mix.max_error_rate,
                          settle_s=min(options.settle_s, min(s.duration_s for s in STATE.shape.stages) / 2),
                          tenant_error_rates=context.mix.tenant_error_rates())
    workers = len(STATE.workers)
    duration_s = time.time() - STATE.start_s if STATE.start_s else 0.0
    info = {
        "mix": f"{context.mix.name} ({context.mix.description})" if context.mix.description else context.mix.name,
        "shape": f"{STATE.shape.name}, {STATE.shape.duration_s:.0f} s, up to {STATE.shape.peak_users} users"
                 if STATE.shape else f"{options.num_users} users for {options.run_time or '?'} s",
        "server": f"gRPC {options.triton_grpc}, HTTP {options.triton_http}",
        "spec": _shown(STATE.spec_path),
        "duration": f"{duration_s:.0f} s",
        "load generators": f"master + {workers} workers" if workers else "one process",
        "max error rate": f"{context.mix.max_error_rate:.1%}" + "".join(
            f", {tenant} {rate:.0%}" for tenant, rate in sorted(context.mix.tenant_error_rates().items())),
    }
    markdown = render_markdown(verdict, info, rows)
    for path, text in ((options.slo_report, markdown),
                       (options.slo_json, json.dumps({**verdict.to_dict(), "info": info, "samples": len(samples),
                                                      "stages": [row.__dict__ for row in rows],
                                                      **provenance()}, indent=2))):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
    print("\n" + markdown, flush=True)  # noqa: T201 - the verdict is the run's result
    environment.process_exit_code = 0 if verdict.passed else 1


def provenance() -> dict:
    """What the JSON verdict records of the run: its command, when it ended, and the machine
    Locust ran on (the server's too when `make loadtest` runs beside `make serve`)."""
    return {"command": shlex.join(["python", "-m", "locust", *sys.argv[1:]]),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "hardware": hardware_report(detect_hardware(None))}


def register(events) -> None:
    events.init_command_line_parser.add_listener(add_options)
    events.init.add_listener(on_init)
    events.test_start.add_listener(on_test_start)
    events.test_stop.add_listener(on_test_stop)
    events.report_to_master.add_listener(on_report_to_master)
    events.worker_report.add_listener(on_worker_report)
    events.quitting.add_listener(on_quitting)
