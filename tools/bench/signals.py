"""Record /metrics under known traffic: the series explain and autoscale are tested on.

Starts its own tritonserver on the model repository (the embedding models), drives one
scenario with open-loop Poisson traffic while reading /metrics every 2 s, and writes the
snapshots as gzip-compressed JSON lines (the format of `python -m tools top --record`):

  steady      the spec's expected rate with the workload's length mix, 45 s
  overload    30 req/s for 20 s, then 2x the measured goodput for 40 s, then 20 req/s for 50 s
  fragmented  90 req/s of short texts on version 1 for 30 s (batches fill before the timer),
              then the same 90 req/s spread over the two shortest buckets and both versions
              for 40 s: four thin queues waiting out their timers, an idle device and a
              rising p99, the trap where adding replicas makes it worse

  python -m tools bench signals --out tests/data/metrics            # all three, about 4 minutes
  python -m tools bench signals --scenarios fragmented --out /tmp/rec
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tools.bench.harness import BENCH_DIR
from tools.bench.loadgen import poisson_arrival_times
from tools.observe.metrics import open_recording, snapshot_line, take_snapshot
from tools.paths import DEFAULT_MODEL_REPOSITORY
from tools.server.triton_server import ModelControlMode, ServerConfig, TritonServer, free_port
from tools.spec.serving import ServingSpec
from tools.spec.workload import DEFAULT_WORKLOAD, TextFactory, load_workload

SCENARIOS = ("steady", "overload", "fragmented")
NUM_TENANTS = 32
# Fast enough that one queue fills the shortest bucket's preferred batch before its timer.
FRAGMENT_RPS = 90.0


@dataclass(frozen=True)
class Phase:
    """Open-loop traffic for a while: texts cycled, each request pinned to a version or not."""

    duration_s: float
    rate_rps: float
    texts: tuple[str, ...]
    versions: tuple[int | None, ...] = (None,)  # cycled per request; None: the router's split


def recorder_tenants() -> list[str]:
    return [f"recorder-{i}" for i in range(NUM_TENANTS)]


async def drive(grpc_url: str, phases: Sequence[Phase], model: str, credentials: Mapping[str, dict],
                seed: int = 0) -> dict[str, int]:
    """Send every phase's requests at their Poisson times, each as one of the recorder's tenants
    (`credentials`: its request parameters); count the outcomes."""
    import numpy as np
    import tritonclient.grpc.aio as grpcclient
    from tritonclient.utils import InferenceServerException

    counts = {"ok": 0, "rejected": 0, "failed": 0}
    rng = random.Random(seed)
    tenants = recorder_tenants()
    async with grpcclient.InferenceServerClient(grpc_url) as client:

        async def send(text: str, version: int | None, tenant: str) -> None:
            tensor = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
            parameters = credentials[tenant] | ({"version": version} if version is not None else {})
            try:
                await client.infer(model, [tensor], parameters=parameters, client_timeout=10.0)
                counts["ok"] += 1
            except InferenceServerException as err:
                counts["rejected" if "UNAVAILABLE" in str(err.status()) else "failed"] += 1

        tasks = []
        for phase in phases:
            start = time.perf_counter()
            for i, offset in enumerate(poisson_arrival_times(phase.rate_rps, phase.duration_s, rng)):
                delay = start + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                # Many tenants, so no tenant quota shapes the traffic: only capacity does.
                tasks.append(asyncio.create_task(send(phase.texts[i % len(phase.texts)],
                                                      phase.versions[i % len(phase.versions)],
                                                      tenants[i % NUM_TENANTS])))
            await asyncio.sleep(max(0.0, start + phase.duration_s - time.perf_counter()))
        await asyncio.gather(*tasks)
    return counts


class Recorder:
    """Reads /metrics every `interval_s` on a thread, appending snapshots to a file."""

    def __init__(self, metrics_url: str, path: Path, interval_s: float = 2.0):
        self.metrics_url, self.path, self.interval_s = metrics_url, path, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.num_snapshots = 0

    def _run(self) -> None:
        with open_recording(self.path, "wt") as out:
            while True:
                out.write(snapshot_line(take_snapshot(self.metrics_url)))
                self.num_snapshots += 1
                if self._stop.wait(self.interval_s):
                    break

    def __enter__(self) -> Recorder:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        time.sleep(self.interval_s * 2)  # let the counters of the last requests land
        self._stop.set()
        self._thread.join()


def scenario_phases(name: str, factory: TextFactory, expected_rps: float, goodput_rps: float,
                    bucket_lens: Sequence[int], mix: Sequence[str]) -> list[Phase]:
    if len(bucket_lens) < 2:
        raise ValueError("the scenarios need at least two length buckets")
    rng = random.Random(11)
    # Texts of the two shortest buckets, alternating; versions change every two requests, so
    # the split spreads each bucket's traffic over both versions.
    first, second = bucket_lens[0], bucket_lens[1]
    short = tuple(factory.text(rng.randint(first // 2 + 1, first - 2), rng) for _ in range(200))
    mixed = tuple(text for pair in zip(short, (factory.text(rng.randint(first + 1, second - 2), rng)
                                               for _ in range(200)), strict=True) for text in pair)
    if name == "steady":
        return [Phase(45.0, expected_rps, tuple(mix))]
    if name == "overload":
        return [Phase(20.0, 30.0, tuple(mix)), Phase(40.0, 2.0 * goodput_rps, tuple(mix)),
                Phase(50.0, 20.0, tuple(mix))]
    if name == "fragmented":
        return [Phase(30.0, FRAGMENT_RPS, short, (1,)), Phase(40.0, FRAGMENT_RPS, mixed, (1, 1, 2, 2))]
    raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")


def record(spec: ServingSpec, scenarios: Sequence[str], out_dir: Path, goodput_rps: float | None,
           credentials: Mapping[str, dict], log) -> None:
    """Record each scenario to `out_dir`/<scenario>.jsonl.gz on one tritonserver; `credentials`:
    each of `recorder_tenants()`'s request parameters. Raises `ServerError`."""
    model = spec.models[0]
    factory = TextFactory()
    mix = factory.texts_for(load_workload(DEFAULT_WORKLOAD), 1000, seed=5)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = ServerConfig(model_repository=DEFAULT_MODEL_REPOSITORY, http_port=free_port(), grpc_port=free_port(),
                          metrics_port=free_port(), host="127.0.0.1", model_control_mode=ModelControlMode.EXPLICIT,
                          load_models=(model.name, *model.bucket_models(DEFAULT_MODEL_REPOSITORY)))
    with TritonServer(config, log_path=BENCH_DIR / "signals.log") as server:
        asyncio.run(drive(server.grpc_url, [Phase(3.0, 10.0, tuple(mix))], model.name, credentials))  # warm-up
        for name in scenarios:
            phases = scenario_phases(name, factory, model.expected_rps, goodput_rps or 0.0, model.bucket_lens, mix)
            path = out_dir / f"{name}.jsonl.gz"
            total = sum(p.duration_s for p in phases)
            log(f"{name}: {len(phases)} phases, {total:.0f} s -> {path}")
            with Recorder(server.metrics_url, path) as recorder:
                counts = asyncio.run(drive(server.grpc_url, phases, model.name, credentials, seed=len(name)))
            log(f"  {recorder.num_snapshots} snapshots; requests {counts}")
            time.sleep(5.0)  # quiet between scenarios, so one's queues do not leak into the next
