"""Overload, tenant isolation and crash recovery of the `embed` service, in one run.

Starts tritonserver on the model repository (explicit model control, with the supervisor
that reloads crashed instances) and drives it open loop over HTTP (`send_all`):

  overload   Poisson arrivals at 3x the measured goodput (results/goodput.json) from many
             ordinary tenants: every request must get an answer (success or an explicit
             rejection), none lost; the p95 of the admitted ones must stay within the SLO.
             Beside the figures, where the admitted requests' time went (`wait_breakdown`)
             and the CPU the load generator and the server used (`cpu_share`).
  overload_10x  the same at 10x the goodput.
  refusals   requests stamped as already late (`X-Request-Start`) at 10x the goodput: the
             server's CPU per refused request.
  isolation  tenant B (premium) sends steady short texts, alone and then while tenant A
             (batch tier) floods the longest bucket: B's p95 and rejections with and without
             the flood, A's rejections.
  crash      steady traffic while one encoder instance's process is killed (SIGKILL), once
             with clients that do not retry and once with the retrying client policy of
             `tools.clients.retrying`: failed requests each way and seconds until the model is whole.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from python_backends.common.request_start import stamp
from tools.bench.harness import BENCH_DIR, detect_hardware, hardware_report
from tools.bench.loadgen import percentile, poisson_arrival_times
from tools.clients.http_infer import HttpInferClient, ProtocolError, error_message, infer_request, with_header
from tools.clients.retrying import NO_RETRIES, Outcome, RetryPolicy, classify, next_delay_s
from tools.observe.metrics import COMPUTE_US, QUEUE_US, ROUTER_LATENCY, SUCCESS, Window, take_snapshot
from tools.paths import DEFAULT_MODEL_REPOSITORY, DEFAULT_SPEC
from tools.server.supervisor import Supervisor, scan_stubs
from tools.server.triton_server import ModelControlMode, ServerConfig, ServerError, TritonServer, free_port
from tools.spec.serving import ServingSpec, load_spec
from tools.spec.workload import TextFactory, Workload

CRASH_BUDGET_S = 5.0  # a crash phase request's deadline: room for an attempt on the dying instance and retries
LOST_AFTER_S = 30.0  # no answer in this long: the request is lost (hung), not merely late
MAX_CONNECTIONS = 1024  # the load generator's keep-alive connections: enough for 10x goodput in flight
FLOOD_TENANT, STEADY_TENANT = "nightly-backfill", "search-frontend"  # batch and premium tier in serving.toml
NUM_ORDINARY_TENANTS = 32  # overload traffic comes from many standard-tier clients, each within its quota
WARMUP_TENANT, CRASH_TENANT = "warmup", "crash-test"


@dataclass(frozen=True)
class Arrival:
    """One request to send."""

    offset_s: float  # send time from the phase start
    stream: str  # which traffic it belongs to (e.g. "A", "B", "load")
    tenant: str
    priority: int  # Triton priority level (the tenant's tier)
    text: str


@dataclass(frozen=True)
class Record:
    """What became of one request."""

    stream: str
    tenant: str
    sent_at_s: float  # scheduled send time from the phase start
    outcome: str  # ok, rejected, crashed, failed, lost
    latency_ms: float | None  # successes: scheduled send to answer (retries included)
    attempts: int
    message: str  # last error, empty on success


def summarize(records: Sequence[Record], slo_ms: float) -> dict:
    """Counts per outcome, latency of the admitted (successful) requests, and error samples."""
    counts = Counter(r.outcome for r in records)
    latencies = [r.latency_ms for r in records if r.latency_ms is not None]
    errors = Counter(r.message[:160] for r in records if r.outcome != "ok")
    return {
        "offered": len(records),
        "ok": counts["ok"],
        "rejected": counts["rejected"],
        "crashed": counts["crashed"],
        "failed_other": counts["failed"],
        "lost": counts["lost"],
        "retried": sum(1 for r in records if r.attempts > 1),
        "admitted_mean_ms": round(sum(latencies) / len(latencies), 1) if latencies else None,
        "admitted_p50_ms": round(percentile(latencies, 50), 1) if latencies else None,
        "admitted_p95_ms": round(percentile(latencies, 95), 1) if latencies else None,
        "admitted_p99_ms": round(percentile(latencies, 99), 1) if latencies else None,
        "admitted_within_slo": round(sum(1 for x in latencies if x <= slo_ms) / len(latencies), 4)
        if latencies else None,
        "slo_ms": slo_ms,
        "error_samples": [f"{message} (x{count})" for message, count in errors.most_common(4)],
    }


def wait_breakdown(window: Window, router: str, bucket_models: Sequence[str], admitted_mean_ms: float | None) -> dict:
    """Where an admitted request's time went over `window`, as means in ms: the router
    model's Triton queue (arrival at its scheduler to an instance taking it), the router's own
    clock (`ROUTER_LATENCY`: the instance took it to the answer, bucket calls included), each
    bucket model's queue and compute, and `unseen_ms`: the client's mean less the first two,
    the time no server figure covers (the front end's threads, the network, the client).

    Means, not percentiles: they add up, so the parts account for the whole. The router's
    clock is observed for admitted answers only, and its queue time is Triton's mean over the
    requests Triton counts as successful (it adds queue time on success only)."""
    def per_request_ms(model: str, counters: Sequence[str]) -> tuple[float, float | None]:
        """(successful requests, mean of the microsecond counters per request), every version summed."""
        requests = window.increase(SUCCESS, model=model)
        total_us = sum(window.increase(name, model=model) for name in counters)
        return requests, total_us / requests / 1000.0 if requests else None

    _, queue_ms = per_request_ms(router, (QUEUE_US,))
    own_s = window.mean(ROUTER_LATENCY, model=router)
    own_ms = own_s * 1000.0 if own_s is not None else None
    p95_s = window.quantile(0.95, ROUTER_LATENCY, model=router)
    known = [part for part in (queue_ms, own_ms) if part is not None]
    buckets = {}
    for model in bucket_models:
        requests, queue = per_request_ms(model, (QUEUE_US,))
        _, compute = per_request_ms(model, COMPUTE_US)
        if requests:
            buckets[model] = {"requests": requests, "queue_ms": queue, "compute_ms": compute}
    return {
        "client_mean_ms": admitted_mean_ms,
        "router_queue_ms": None if queue_ms is None else round(queue_ms, 2),
        "router_ms": None if own_ms is None else round(own_ms, 2),
        "router_p95_ms": None if p95_s is None else round(p95_s * 1000.0, 1),
        "unseen_ms": (round(admitted_mean_ms - sum(known), 2)
                      if admitted_mean_ms is not None and len(known) == 2 else None),
        "buckets": {model: {"requests": int(entry["requests"]), "queue_ms": round(entry["queue_ms"], 2),
                            "compute_ms": round(entry["compute_ms"], 2)}
                    for model, entry in sorted(buckets.items()) if entry["requests"]},
    }


# The load generator shares the machine with the server it measures: a phase whose generator
# took more than this share of the machine's CPU describes the generator as much as the server.
LOAD_GENERATOR_MAX_SHARE = 0.15


def cpu_share(load_generator_s: float, server_s: float, wall_s: float, cores: int) -> dict:
    """The CPU the load generator and the server used over a phase: seconds, and each as a
    share of the machine's CPU over the phase (cores x wall time); with the load generator's
    bound (`LOAD_GENERATOR_MAX_SHARE`) and whether it held."""
    capacity = max(cores, 1) * wall_s
    generator_share = load_generator_s / capacity if capacity > 0 else None
    return {"load_generator_s": round(load_generator_s, 2), "server_s": round(server_s, 2),
            "load_generator_share": round(generator_share, 3) if generator_share is not None else None,
            "server_share": round(server_s / capacity, 3) if capacity > 0 else None, "cores": cores,
            "load_generator_max_share": LOAD_GENERATOR_MAX_SHARE,
            "load_generator_within_bound": generator_share is not None and generator_share <= LOAD_GENERATOR_MAX_SHARE}


def poisson_stream(stream: str, rate_rps: float, duration_s: float, texts: Sequence[str], tenants: Sequence[str],
                   priority: int, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    return [Arrival(offset, stream, tenants[i % len(tenants)], priority, texts[i % len(texts)])
            for i, offset in enumerate(poisson_arrival_times(rate_rps, duration_s, rng))]


async def send_all(http_url: str, arrivals: Sequence[Arrival], policy: RetryPolicy,
                   budget_s: float, credentials: Mapping[str, dict], seed: int = 0,
                   stamp_age_s: float = 0.0) -> list[Record]:
    """Send every arrival at its time (open loop), retrying per `policy` within `budget_s`;
    `credentials` holds the request parameters that make a request its tenant's (a token).
    Each request's `X-Request-Start` is the time it was due, less `stamp_age_s`.

    Over Triton's HTTP endpoint with the lean client of `tools.clients.http_infer`: the load
    generator shares the machine with the server, and at 10x goodput tritonclient's gRPC client
    would take most of a core by itself (0.64-0.77 CPU ms per request against 0.27-0.41)."""
    rng = random.Random(seed)
    records: list[Record] = []
    host, _, port = http_url.rpartition(":")

    async with HttpInferClient(host, int(port), max_connections=MAX_CONNECTIONS) as client:
        start, wall_start = time.perf_counter(), time.time()

        async def send(arrival: Arrival) -> None:
            scheduled = start + arrival.offset_s
            request = infer_request(http_url, "embed", "TEXT", [arrival.text.encode()],
                                    {**credentials[arrival.tenant], "priority": arrival.priority})
            attempts, message, outcome = 0, "", Outcome.FAILED
            deadline = scheduled + budget_s
            while True:
                attempts += 1
                remaining_s = max(0.001, scheduled + LOST_AFTER_S - time.perf_counter())
                # Stamped with the time it was due (a retry: sent), so that the router's admission
                # counts the wait in this client, the front end and the router's queue too.
                started = (wall_start + arrival.offset_s if attempts == 1 else time.time()) - stamp_age_s
                try:
                    status, body = await client.post(with_header(request, "X-Request-Start", stamp(started)),
                                                     remaining_s)
                except TimeoutError:
                    records.append(Record(arrival.stream, arrival.tenant, arrival.offset_s, "lost", None,
                                          attempts, f"no answer within {LOST_AFTER_S:.0f} s"))
                    return
                except (OSError, ProtocolError) as err:
                    status, body = 0, f"connection failed: {err}".encode()
                if status == 200:
                    latency_ms = (time.perf_counter() - scheduled) * 1e3
                    records.append(Record(arrival.stream, arrival.tenant, arrival.offset_s, "ok", latency_ms,
                                          attempts, ""))
                    return
                message = error_message(body)
                outcome = classify(str(status), message)
                delay_s = next_delay_s(policy, attempts, outcome, message, time.perf_counter(), deadline,
                                       rng.random())
                if delay_s is None:
                    records.append(Record(arrival.stream, arrival.tenant, arrival.offset_s, outcome.value, None,
                                          attempts, message))
                    return
                await asyncio.sleep(delay_s)

        tasks = []
        for arrival in sorted(arrivals, key=lambda a: a.offset_s):
            delay = start + arrival.offset_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(arrival)))
        await asyncio.gather(*tasks)
    return records


@dataclass(frozen=True)
class Durations:
    overload_s: float
    isolation_s: float  # each of the two phases
    crash_s: float  # each of the two phases; the kill comes at a third
    overload_10x_s: float = 0.0  # the 10x phase; 0: as long as the 3x one
    refusals_s: float = 10.0  # the phase of requests refused for their wait
    settle_s: float = 2.0  # quiet between phases, for the queues of the last one to drain

    def overload_phase_s(self, part: str) -> float:
        """How long the overload phase `part` (of OVERLOAD_PHASES) lasts."""
        return (self.overload_10x_s or self.overload_s) if part == "overload_10x" else self.overload_s


FULL = Durations(overload_s=60.0, isolation_s=30.0, crash_s=20.0)
METRICS_FLUSH_S = 1.0  # wait for the router's last metric flush (every 0.5 s) before reading /metrics
BENCH_EXIT_TIMEOUT_S = 5  # seconds tritonserver waits on stop (see run_benchmark)
QUICK = Durations(overload_s=10.0, isolation_s=5.0, crash_s=5.0, overload_10x_s=5.0, refusals_s=3.0, settle_s=0.5)
OVERLOAD_PHASES = {"overload": 3.0, "overload_10x": 10.0}  # part -> offered rate as a multiple of goodput


def ordinary_tenants() -> list[str]:
    return [f"client-{i:02d}" for i in range(NUM_ORDINARY_TENANTS)]


def run_overload(server: TritonServer, texts: Sequence[str], goodput_rps: float, slo_ms: float,
                 duration_s: float, credentials: Mapping[str, dict], log, router: str = "embed",
                 bucket_models: Sequence[str] = (), multiple: float = 3.0) -> dict:
    rate = multiple * goodput_rps
    tenants = ordinary_tenants()
    log(f"overload: {rate:.0f} req/s offered ({multiple:g} x goodput {goodput_rps:.0f}) for {duration_s:.0f} s "
        f"from {len(tenants)} tenants")
    arrivals = poisson_stream("load", rate, duration_s, texts, tenants, 0, seed=11)
    before = take_snapshot(server.metrics_url)
    # The load generator's CPU as the goodput benchmark takes it; the server's with its stubs.
    cpu_before = time.process_time(), server.cpu_seconds(), time.monotonic()
    records = asyncio.run(send_all(server.http_url, arrivals, NO_RETRIES, LOST_AFTER_S, credentials))
    cpu_after = time.process_time(), server.cpu_seconds(), time.monotonic()
    time.sleep(METRICS_FLUSH_S)  # the router hands its histograms to Triton every half second
    after = take_snapshot(server.metrics_url)
    summary = summarize(records, slo_ms)
    within_slo = sum(1 for r in records if r.latency_ms is not None and r.latency_ms <= slo_ms)
    result = {"goodput_rps": goodput_rps, "offered_rps": rate, "duration_s": duration_s,
              **summary, "within_slo_rps": round(within_slo / duration_s, 1),
              "within_slo_rps_vs_goodput": round(within_slo / duration_s / goodput_rps, 3),
              "server_ready_after": server.is_ready(),
              "wait_breakdown": wait_breakdown(Window(before, after), router, bucket_models,
                                               summary["admitted_mean_ms"]),
              "cpu": cpu_share(cpu_after[0] - cpu_before[0], cpu_after[1] - cpu_before[1],
                               cpu_after[2] - cpu_before[2], os.cpu_count() or 1)}
    log(f"  {result['ok']} ok, {result['rejected']} rejected, {result['failed_other']} failed, {result['lost']} lost; "
        f"admitted p95 {result['admitted_p95_ms']} ms (SLO {slo_ms:.0f})")
    parts = result["wait_breakdown"]
    log(f"  admitted mean {parts['client_mean_ms']} ms = router queue {parts['router_queue_ms']} + router "
        f"{parts['router_ms']} + unseen {parts['unseen_ms']}; CPU: load generator "
        f"{result['cpu']['load_generator_share']:.0%}, server {result['cpu']['server_share']:.0%} of the machine")
    if not result["cpu"]["load_generator_within_bound"]:
        log(f"  warning: the load generator took more than {LOAD_GENERATOR_MAX_SHARE:.0%} of the machine; "
            "these figures describe it as much as the server")
    return result


def run_refusals(server: TritonServer, texts: Sequence[str], rate_rps: float, duration_s: float, slo_ms: float,
                 credentials: Mapping[str, dict], log) -> dict:
    """What a refusal costs the server: requests stamped (`X-Request-Start`) as having waited
    twice the SLO already, so that the router refuses every one before any work on it, open
    loop at `rate_rps`; the server's CPU (tritonserver and every stub) per request, less what
    it burns idle over as long."""
    tenants = ordinary_tenants()
    log(f"refusals: {rate_rps:.0f} req/s for {duration_s:.0f} s, each stamped {2 * slo_ms:.0f} ms old")
    idle_before = server.cpu_seconds(), time.monotonic()
    time.sleep(min(duration_s, 5.0))
    idle_cpu_per_s = (server.cpu_seconds() - idle_before[0]) / (time.monotonic() - idle_before[1])
    arrivals = poisson_stream("refused", rate_rps, duration_s, texts, tenants, 0, seed=41)
    cpu_before, wall_before = server.cpu_seconds(), time.monotonic()
    records = asyncio.run(send_all(server.http_url, arrivals, NO_RETRIES, LOST_AFTER_S, credentials,
                                   stamp_age_s=2 * slo_ms / 1000.0))
    server_s, wall_s = server.cpu_seconds() - cpu_before, time.monotonic() - wall_before
    summary = summarize(records, slo_ms)
    busy_s = max(0.0, server_s - idle_cpu_per_s * wall_s)
    result = {"rate_rps": rate_rps, "duration_s": duration_s, "stamp_age_ms": 2 * slo_ms, **summary,
              "server_cpu_s": round(server_s, 2), "server_idle_cpu_s": round(idle_cpu_per_s * wall_s, 2),
              "server_cpu_ms_per_refusal": round(busy_s * 1000.0 / len(records), 3) if records else None}
    log(f"  {summary['rejected']} of {summary['offered']} refused; server CPU {result['server_cpu_ms_per_refusal']} "
        f"ms a refusal")
    return result


def run_isolation(server: TritonServer, factory: TextFactory, slo_ms: float, durations: Durations,
                  steady_rps: float, flood_rps: float, credentials: Mapping[str, dict], log) -> dict:
    spec_policy = load_spec(DEFAULT_SPEC).tenant_policy()
    steady_tier, flood_tier = spec_policy.tier_of(STEADY_TENANT), spec_policy.tier_of(FLOOD_TENANT)
    rng = random.Random(5)
    short = [factory.text(rng.randint(6, 14), rng) for _ in range(200)]
    long = [factory.text(rng.randint(200, 250), rng) for _ in range(200)]
    steady = poisson_stream("B", steady_rps, durations.isolation_s, short, [STEADY_TENANT], steady_tier.priority, 21)
    log(f"isolation: B ({STEADY_TENANT}, tier {steady_tier.name}) {steady_rps:.0f} req/s of short texts alone")
    alone = asyncio.run(send_all(server.http_url, steady, NO_RETRIES, LOST_AFTER_S, credentials))
    flood = poisson_stream("A", flood_rps, durations.isolation_s, long, [FLOOD_TENANT], flood_tier.priority, 22)
    log(f"isolation: the same, while A ({FLOOD_TENANT}, tier {flood_tier.name}) floods the 256-token bucket "
        f"at {flood_rps:.0f} req/s")
    both = asyncio.run(send_all(server.http_url, [*steady, *flood], NO_RETRIES, LOST_AFTER_S, credentials))
    b_alone = summarize(alone, slo_ms)
    b_flood = summarize([r for r in both if r.stream == "B"], slo_ms)
    a_flood = summarize([r for r in both if r.stream == "A"], slo_ms)
    a_over_quota = sum(1 for r in both if r.stream == "A" and "over its quota" in r.message)
    result = {
        "slo_ms": slo_ms,
        "b": {"tenant": STEADY_TENANT, "tier": steady_tier.name, "rate_rps": steady_rps,
              "p95_ms_alone": b_alone["admitted_p95_ms"], "p95_ms_with_flood": b_flood["admitted_p95_ms"],
              "rejected_with_flood": b_flood["rejected"] + b_flood["failed_other"] + b_flood["lost"],
              "alone": b_alone, "with_flood": b_flood},
        "a": {"tenant": FLOOD_TENANT, "tier": flood_tier.name, "rate_rps": flood_rps,
              "quota_rps": flood_tier.requests_per_s, "ok": a_flood["ok"],
              "rejected": a_flood["rejected"], "rejected_over_quota": a_over_quota, "summary": a_flood},
    }
    log(f"  B p95 {result['b']['p95_ms_alone']} ms alone, {result['b']['p95_ms_with_flood']} ms with A's flood; "
        f"B not served: {result['b']['rejected_with_flood']}; A: {a_flood['ok']} ok, {a_flood['rejected']} rejected "
        f"({a_over_quota} over quota)")
    return result


def kill_one_instance(server: TritonServer, model: str) -> str:
    stubs = sorted((s for s in scan_stubs(server.process.pid).values() if s.model == model),
                   key=lambda s: (s.version, s.instance))
    if not stubs:
        raise ServerError(f"no running instance of {model} to kill")
    victim = stubs[0]
    os.kill(victim.pid, signal.SIGKILL)
    return f"{victim.instance} v{victim.version} (pid {victim.pid})"


def wait_restart(supervisor: Supervisor, restarts_before: int, timeout_s: float = 120.0) -> dict:
    """The supervisor's record of the reload that followed the kill."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if len(supervisor.restarts) > restarts_before:
            return supervisor.restarts[restarts_before]
        time.sleep(0.05)
    raise ServerError(f"the supervisor did not reload the model within {timeout_s:.0f} s")


def run_crash(server: TritonServer, supervisor: Supervisor, texts: Sequence[str], slo_ms: float,
              durations: Durations, rate_rps: float, victim_model: str, credentials: Mapping[str, dict],
              log) -> dict:
    result: dict = {"rate_rps": rate_rps, "victim_model": victim_model, "slo_ms": slo_ms}
    for label, policy in (("without_retries", NO_RETRIES), ("with_retries", RetryPolicy())):
        arrivals = poisson_stream("load", rate_rps, durations.crash_s, texts, [CRASH_TENANT], 0,
                                  seed=31 if label == "without_retries" else 32)
        restarts_before = len(supervisor.restarts)

        async def phase(policy=policy, arrivals=arrivals, restarts_before=restarts_before):
            sending = asyncio.create_task(send_all(server.http_url, arrivals, policy, CRASH_BUDGET_S, credentials))
            await asyncio.sleep(durations.crash_s / 3)
            victim = kill_one_instance(server, victim_model)
            killed_at = time.time()
            restart = await asyncio.to_thread(wait_restart, supervisor, restarts_before)
            return await sending, victim, killed_at, restart

        log(f"crash ({label}): {rate_rps:.0f} req/s, one {victim_model} instance killed at "
            f"{durations.crash_s / 3:.0f} s")
        records, victim, killed_at, restart = asyncio.run(phase())
        summary = summarize(records, slo_ms)
        failed = summary["rejected"] + summary["crashed"] + summary["failed_other"] + summary["lost"]
        detected_s = restart["detected_at"] - killed_at
        result[label] = {
            "killed": victim, "failed": failed, "failed_by_crash": summary["crashed"],
            "seconds_to_detect": round(detected_s, 2), "seconds_to_recover": round(detected_s + restart["reload_s"], 2),
            "supervisor": restart, **summary,
        }
        log(f"  {summary['ok']} ok, {failed} failed ({summary['crashed']} by the crash, {summary['retried']} "
            f"retried); detected after {detected_s:.1f} s, whole again after {detected_s + restart['reload_s']:.1f} s")
        time.sleep(durations.settle_s)
    result["failed_without_retries"] = result["without_retries"]["failed"]
    result["failed_with_retries"] = result["with_retries"]["failed"]
    result["seconds_to_recover"] = max(result["without_retries"]["seconds_to_recover"],
                                       result["with_retries"]["seconds_to_recover"])
    return result


def benchmark_tenants() -> list[str]:
    """Every tenant the benchmark sends as: their tokens are signed before the server starts."""
    return [*ordinary_tenants(), STEADY_TENANT, FLOOD_TENANT, WARMUP_TENANT, CRASH_TENANT]


def run_benchmark(spec: ServingSpec, workload: Workload, credentials: Mapping[str, dict], parts: Sequence[str],
                  goodput_rps: float | None, steady_rps: float, flood_rps: float, crash_rps: float, victim: str,
                  durations: Durations, command: str, log) -> dict:
    """The `parts` (overload, isolation, crash) on one tritonserver with the supervisor on; the
    report. `credentials`: each tenant's request parameters (`benchmark_tenants`). Raises
    `ServerError` when the server does not start or the supervisor does not bring a killed
    instance back."""
    model = spec.models[0]
    hardware = detect_hardware(None)
    factory = TextFactory()
    texts = factory.texts_for(workload, 2000, seed=7)
    repository = DEFAULT_MODEL_REPOSITORY
    embed_models = [model.name, *model.bucket_models(repository)]
    # Every request is answered before the server stops, so a short exit timeout loses nothing.
    # The default 30 s all went by: after the crash phases Triton waited out its exit timeout
    # for the killed instance's model (the log counted 2 live models down from 30 s).
    config = ServerConfig(model_repository=repository, http_port=free_port(), grpc_port=free_port(),
                          metrics_port=free_port(), host="127.0.0.1", model_control_mode=ModelControlMode.EXPLICIT,
                          load_models=tuple(embed_models), exit_timeout_s=BENCH_EXIT_TIMEOUT_S)
    report: dict = {
        "hardware": hardware_report(hardware),
        "command": command,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "slo_ms": model.slo_p95_ms,
        "note": "load generator on the same machine as the server",
    }
    log(f"overload benchmark on {hardware.description}; SLO p95 {model.slo_p95_ms:.0f} ms")
    with TritonServer(config, log_path=BENCH_DIR / "overload.log") as server:
        supervisor = Supervisor(f"http://{server.http_url}", server.process.pid,
                                log=lambda line: log(f"  {line}")).start()
        try:
            asyncio.run(send_all(server.http_url, poisson_stream("warmup", 20, 2, texts, [WARMUP_TENANT], 0, 1),
                                 NO_RETRIES, LOST_AFTER_S, credentials))
            for part, multiple in OVERLOAD_PHASES.items():
                if part in parts:
                    report[part] = run_overload(server, texts, goodput_rps, model.slo_p95_ms,
                                                durations.overload_phase_s(part), credentials, log, model.name,
                                                embed_models[1:], multiple)
                    time.sleep(durations.settle_s)
            if "refusals" in parts:
                report["refusals"] = run_refusals(server, texts, OVERLOAD_PHASES["overload_10x"] * goodput_rps,
                                                  durations.refusals_s, model.slo_p95_ms, credentials, log)
                time.sleep(durations.settle_s)
            if "isolation" in parts:
                report["isolation"] = run_isolation(server, factory, model.slo_p95_ms, durations,
                                                    steady_rps, flood_rps, credentials, log)
                time.sleep(durations.settle_s)
            if "crash" in parts:
                report["crash"] = run_crash(server, supervisor, texts, model.slo_p95_ms, durations,
                                            crash_rps, victim, credentials, log)
            report["server_healthy_at_end"] = server.is_ready()
        finally:
            supervisor.stop()
    return report
