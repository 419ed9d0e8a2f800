"""Measuring points of the knob search and of `tune`: one configuration's goodput on a real tritonserver.

`PointSession` serves one model of the spec from its own repository under build/bench/search/
(`harness.build_repository`; an external model's folder copied beside it) on a tritonserver
in explicit model-control mode, and measures a point (`measure`): it plans the model with the
point's knobs through gen-config's own path (the profile's tuned entry, `apply_tuned`), so
what is measured is what gen-config would write (but for the versions that take no traffic,
`serving_one_version`); reloads the models whose config changed
through Triton's model control with the config as an override (the router too when a bucket's
max_batch_size or preferred size moves its chunking or admission), checks that the served
configs carry the knobs, and runs the goodput search of `bench goodput`
(`goodput.search_goodput`: the highest offered open-loop rate with >= 95% within the SLO and
no errors) on the full mix or on one bucket's rows offered at its share of the rate. Reloading
one bucket model took 3.2 s on the 2-vCPU machine where a server restart took 24-32 s (23.6 s
to start in explicit mode with embed's 22 models, 3.5 s to stop), so a session keeps its
server. `measure_point` is the one-call form (a session for one point).

`run_search` and `run_tune` drive `tools.planning.search`'s `StructuredSearch` and `TuneClimb`
within a time budget, writing every point to a JSON report after each one (`write_points`,
with a plot beside it, `plot_points`) so an interruption loses at most the point in flight;
`run_search` resumes from its report. Everything here does I/O but `check_resumable`,
`new_report` and the bucket spaces' arithmetic.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from python_backends.embed.kinds import ModelKind
from tools.bench.goodput import (
    GoodputOptions,
    payload_fields,
    router_of,
    search_goodput,
    served_version,
    tensor_router_of,
)
from tools.bench.harness import (
    BENCH_DIR,
    add_to_repository,
    build_repository,
    build_user_repository,
    detect_hardware,
    hardware_report,
    without_tenant_quotas,
)
from tools.bench.loadgen import LoadTarget, StepResult
from tools.bench.payloads import TensorPayload, TextPayload, model_payload
from tools.planning.buckets import search_edge_sets
from tools.planning.derivation import InfeasibleSLO
from tools.planning.search import (
    JOINT,
    BucketSpace,
    Config,
    KnobSet,
    Point,
    StructuredSearch,
    TuneClimb,
    config_label,
    search_start_rps,
    with_config,
)
from tools.repository.configs import ROUTER_VERSIONS, GeneratedModel, bucket_curves, plan_embed_model
from tools.server.control import ControlError, ServerControl
from tools.server.triton_server import ModelControlMode, ServerConfig, ServerError, TritonServer, free_port
from tools.spec.profile import LatencyProfile, profile_to_dict
from tools.spec.serving import BucketedModelSpec, ServingSpec
from tools.spec.workload import Workload, load_workload

SEARCH_DIR = BENCH_DIR / "search"
PHASE1_BUDGET_SHARE = 0.5  # of the budget, the most phase 1 may take: phase 2 is where the answer is
# After a reload Triton unloads the old instances once the new ones are ready: 2.4 s later for
# embed's router and encoder_16 on 2 vCPU. Their teardown must not land in a measured step.
SETTLE_S = 3.0
MIN_BUCKET_ROWS = 20  # rows of the smallest bucket in the payload, at least: a phase-1 load cycles them


@dataclass(frozen=True)
class SearchOptions:
    """How long each point's goodput search measures."""

    step_s: float = 5.0  # seconds of open-loop load per measured rate
    max_steps: int = 6  # measured rates per point at most
    num_rows: int = 1000  # distinct rows drawn from the workload
    start_rps: float = 8.0  # the first rate search's start, before anything is known
    protocol: str = "http"  # how the load generator sends: "http" or "grpc"

    def as_dict(self) -> dict[str, Any]:
        return {"step_s": self.step_s, "max_steps": self.max_steps, "num_rows": self.num_rows,
                "start_rps": self.start_rps, "protocol": self.protocol}


QUICK = SearchOptions(step_s=1.0, max_steps=2, num_rows=300)  # the test suite's short form


@dataclass(frozen=True)
class Measured:
    """One point's measurement."""

    goodput_rps: float  # requests/s of the whole mix (one bucket's: its rate over its share)
    measure_s: float  # seconds: reloading, warm-up and the rate search
    steps: tuple[dict, ...]  # each measured rate: offered_rps (as sent), mix_rps, within_slo, errors, p95_ms, passed


def workload_of(model: BucketedModelSpec) -> Workload | None:
    return load_workload(model.workload) if model.workload is not None else None


def bucket_shares(model: BucketedModelSpec, workload: Workload | None) -> dict[str, float]:
    """Each bucket model's share of the rows (gen-config's: the workload's), by name."""
    shares = workload.bucket_shares(model.bucket_lens) if workload is not None else {model.bucket_lens[0]: 1.0}
    return {model.encoder_name(length): shares.get(length, 0.0) for length in model.bucket_lens}


def bucket_spaces(spec: ServingSpec, model: BucketedModelSpec, profile: LatencyProfile) -> list[BucketSpace]:
    """What the search knows of each bucket model: share, c(b), SLO, overhead, the spec's caps."""
    hardware = spec.hardware[profile.hardware.kind]
    workload = workload_of(model)
    return [BucketSpace(model_name=name, share=share, curve=profile.curve(name), slo_p95_ms=model.slo_p95_ms,
                        overhead_ms=profile.overhead_for(model.name).p95_ms, max_instances=hardware.max_instances,
                        lanes=hardware.lanes(profile.hardware.cpu_count),
                        rows_per_request=workload.rows_per_request if workload is not None else 1)
            for name, share in bucket_shares(model, workload).items()]


def without_tuned(profile: LatencyProfile, model: str) -> LatencyProfile:
    """The profile as the derivation sees `model`: without its tuned entry."""
    return replace(profile, tuned={name: t for name, t in profile.tuned.items() if name != model})


def plan_with(spec: ServingSpec, model: BucketedModelSpec, profile: LatencyProfile, config: Config,
              label: str = "a measured point") -> list[GeneratedModel]:
    """The model's configs with `config`'s knobs over the derived ones, through gen-config's path
    (the profile's tuned entry), and without the tenant quotas, as every benchmark serves it."""
    tuned = with_config(without_tuned(profile, model.name).tuned, model.name, model.slo_p95_ms, config, label)
    plan = without_tenant_quotas(plan_embed_model(model, spec, replace(profile, tuned=tuned)), model.name)
    return serving_one_version(plan, served_version(model))


def serving_one_version(plan: Sequence[GeneratedModel], version: int) -> list[GeneratedModel]:
    """The plan with each bucket model of the kit serving only `version`, the one the traffic
    goes to (an external model's versions are the user's config's). Every version has
    instances and a batcher of its own and the others take no requests, so they do not change
    a point's goodput; leaving them out halves the server's start and each reload for embed's
    two versions."""
    out = []
    for generated in plan:
        if generated.knobs is not None and generated.user_config is None and len(generated.versions) > 1:
            config = mc.ModelConfig()
            config.CopyFrom(generated.config)
            del config.version_policy.specific.versions[:]
            config.version_policy.specific.versions.append(version)
            generated = replace(generated, config=config, versions=(version,))
        out.append(generated)
    return out


def with_edges(model: BucketedModelSpec, edges: Sequence[int]) -> BucketedModelSpec:
    """The model with other bucket edges; () leaves it as it is."""
    return replace(model, bucket_lens=tuple(edges)) if edges else model


def searchable_edges(model: BucketedModelSpec, profile: LatencyProfile) -> list[tuple[int, ...]]:
    """The edges a search tries besides the model's own (`search_edge_sets` on its workload
    and measured curves); none for an external model (one model behind every bucket) or a
    model without a length mix."""
    if model.kind is ModelKind.EXTERNAL or model.workload is None:
        return []
    curves, _ = bucket_curves(model, profile)
    return search_edge_sets(load_workload(model.workload), model.bucket_lens, curves)


def derived_config(spec: ServingSpec, model: BucketedModelSpec, profile: LatencyProfile) -> Config:
    """The derived knobs of every bucket model (the seed `tune` starts from)."""
    plan = plan_embed_model(model, spec, without_tuned(profile, model.name))
    buckets = set(model.bucket_names)  # the express model is not searched: it serves light load only
    return {generated.name: KnobSet.of(generated.knobs) for generated in plan
            if generated.knobs is not None and generated.name in buckets}


def served_config(model: GeneratedModel) -> mc.ModelConfig:
    """The config a model is loaded with: the generated message, or an external model's merged text."""
    if model.user_config is None:
        return model.config
    config = text_format.Parse(model.config_text(), mc.ModelConfig())
    config.name = model.name
    return config


def knobs_served(config: Mapping[str, Any]) -> KnobSet:
    """The tunable knobs of a served config (Triton's JSON)."""
    batching = config.get("dynamic_batching") or {}
    preferred = [int(size) for size in batching.get("preferred_batch_size") or []]
    max_batch = int(config.get("max_batch_size", 0))
    # Triton fills in max_batch_size as the preferred size when a config names none.
    return KnobSet(max_batch_size=max_batch,
                   preferred_batch_size=preferred[0] if preferred and preferred[0] < max_batch else 1,
                   max_queue_delay_us=int(batching.get("max_queue_delay_microseconds", 0)),
                   instance_count=sum(int(group.get("count", 1)) for group in config.get("instance_group") or []))


def step_summary(result: StepResult, share: float) -> dict:
    passed = result.goodput_fraction >= 0.95 and result.num_errors == 0  # RateSearch's criterion
    offered = result.offered_rps or 0.0
    return {"offered_rps": round(offered, 2), "mix_rps": round(offered / share, 2),
            "within_slo": round(result.goodput_fraction, 4), "errors": result.num_errors,
            "rejected": result.num_rejected, "p95_ms": round(result.p95_ms, 1) if result.p95_ms is not None else None,
            "passed": passed}


def text_bucket(router, text: str, pair: str | None) -> int:
    prepared = router.prepare([text], None, raw_pairs=None if pair is None else [pair])
    return prepared.chunks[0].chunk.bucket_len


def payload_by_bucket(payload: TextPayload | TensorPayload, plan: Sequence[GeneratedModel],
                      model: BucketedModelSpec, repository: Path) -> dict[str, TextPayload | TensorPayload]:
    """The payload's rows by the bucket model the router sends them to, as the model's own
    router code decides (the tokenizer in `repository` for a text model)."""
    if isinstance(payload, TensorPayload):
        from python_backends.tensor.router import TensorRouter

        tensor_router = TensorRouter(tensor_router_of(plan, model))
        chosen: dict[str, list[int]] = {}
        for index, request in enumerate(payload.requests):
            bucket = tensor_router.prepare(request).chunks[0].chunk.bucket_len
            chosen.setdefault(model.encoder_name(bucket), []).append(index)
        return {name: TensorPayload(tuple(payload.requests[i] for i in indices),
                                    tuple(payload.lengths[i] for i in indices) if payload.lengths else ())
                for name, indices in chosen.items()}
    from python_backends.common.tokenization import TextTokenizer
    from python_backends.embed.router import EmbedRouter

    router = EmbedRouter(router_of(plan, model),
                         TextTokenizer.from_file(repository / model.name / str(ROUTER_VERSIONS[0]) / "tokenizer.json"))
    pairs = payload.pair_texts or (None,) * len(payload.texts)
    rows: dict[str, list[tuple[str, str | None]]] = {}
    for text, pair in zip(payload.texts, pairs, strict=True):
        rows.setdefault(model.encoder_name(text_bucket(router, text, pair)), []).append((text, pair))
    return {name: TextPayload(tuple(t for t, _ in chosen_rows),
                              tuple(p for _, p in chosen_rows) if payload.pair_texts else ())
            for name, chosen_rows in rows.items()}


def models_beside(plan: Sequence[GeneratedModel],
                  other_plans: Sequence[Sequence[GeneratedModel]]) -> list[GeneratedModel]:
    """The models of `other_plans` (other bucket edges) that `plan` lacks, each once (the first
    plan's): their bucket models, and an express model where only other edges linger."""
    own = {generated.name for generated in plan}
    others: dict[str, GeneratedModel] = {}
    for other in other_plans:
        for generated in other:
            if generated.name not in own:
                others.setdefault(generated.name, generated)
    return list(others.values())


class PointSession:
    """One tritonserver serving one model of the spec, reloaded point by point (see the module)."""

    def __init__(self, spec: ServingSpec, model: BucketedModelSpec, profile: LatencyProfile, options: SearchOptions,
                 log: Callable[[str], None], edge_sets: Sequence[Sequence[int]] = ()):
        self.spec, self.model, self.profile, self.options, self.log = spec, model, profile, options, log
        self.edge_sets = [tuple(edges) for edges in edge_sets if edges]  # other edges its points may run
        self.server: TritonServer | None = None
        self.loaded: dict[str, bytes] = {}  # model -> the serialized config it is served with
        self.start_s = 0.0  # seconds the server took to start

    def __enter__(self) -> PointSession:
        started = time.perf_counter()
        plan = plan_with(self.spec, self.model, self.profile, {})
        setup = f"search/{self.model.name}"
        # The other edges' models are in the repository from the start, loaded when a point runs them.
        others = models_beside(plan, [plan_with(self.spec, with_edges(self.model, edges), self.profile, {})
                                      for edges in self.edge_sets])
        self.repository = build_repository(setup, [*plan, *others])
        user_repositories = build_user_repository(setup, plan)
        config = ServerConfig(model_repository=self.repository, extra_repositories=user_repositories,
                              http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), host="127.0.0.1",
                              model_control_mode=ModelControlMode.EXPLICIT,
                              load_models=tuple(generated.name for generated in plan))
        self.log(f"starting tritonserver on {self.repository} (explicit model control)")
        self.server = TritonServer(config, log_path=SEARCH_DIR / f"{self.model.name}.log")
        try:
            self.server.start()
            self.server.wait_ready()
        except BaseException:
            self.server.stop()
            raise
        self.control = ServerControl(self.server.http_url)
        self.loaded = {generated.name: served_config(generated).SerializeToString(deterministic=True)
                       for generated in plan}
        workload = workload_of(self.model)
        shares = bucket_shares(self.model, workload)
        smallest = min((share for share in shares.values() if share > 0), default=1.0)
        num_rows = max(self.options.num_rows, math.ceil(MIN_BUCKET_ROWS / smallest))
        self.rows_per_request = workload.rows_per_request if workload is not None else 1
        self.shares = shares
        self.payload = model_payload(self.model, workload, num_rows)
        self.bucket_payloads = payload_by_bucket(self.payload, plan, self.model, self.repository)
        self.start_s = time.perf_counter() - started
        self.log(f"  ready in {self.start_s:.1f} s")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def reload(self, plan: Sequence[GeneratedModel], buckets: Sequence[str] = ()) -> list[str]:
        """Reload the models whose config changed (bucket models first, the router last), then
        unload the bucket models loaded but not in `buckets` (those of other edges); the names
        reloaded."""
        changed = [generated for generated in plan
                   if served_config(generated).SerializeToString(deterministic=True) != self.loaded.get(generated.name)]
        changed.sort(key=lambda generated: generated.name == self.model.name)
        # A model the session did not start with (the express model of a point that lingers
        # where the derived configuration does not): into the repository first.
        missing = [generated for generated in changed
                   if generated.user_config is None and not (self.repository / generated.name).is_dir()]
        if missing:
            add_to_repository(self.repository, missing, plan)
        for generated in changed:
            config = served_config(generated)
            folder = (self.repository if generated.user_config is None
                      else self.server.config.extra_repositories[0]) / generated.name
            (folder / "config.pbtxt").write_text(generated.config_text())  # the repository says what is served
            try:
                self.control.load(generated.name, json_format.MessageToJson(config))
            except ControlError as err:
                raise ServerError(f"reloading {generated.name} with its point's config failed: {err}") from None
            if generated.knobs is not None:
                wanted = KnobSet.of(generated.knobs).as_served()
                served = knobs_served(self.control.model_config(generated.name))
                if served != wanted:
                    raise ServerError(f"{generated.name} serves {served.label()} after its reload, "
                                      f"not {wanted.label()}")
            self.loaded[generated.name] = config.SerializeToString(deterministic=True)
        if buckets:
            for name in sorted(set(self.loaded) & (self.all_buckets - set(buckets))):
                try:
                    self.control.unload(name)
                except ControlError as err:
                    raise ServerError(f"unloading {name} (a bucket of other edges) failed: {err}") from None
                del self.loaded[name]
        return [generated.name for generated in changed]

    @property
    def all_buckets(self) -> set[str]:
        """The bucket models of the model's own edges and of the session's other edges."""
        return {name for edges in ((), *self.edge_sets) for name in with_edges(self.model, edges).bucket_names}

    def measure(self, config: Config, bucket: str = JOINT, start_rps: float | None = None,
                edges: Sequence[int] = ()) -> Measured:
        """The goodput of `config` (bucket models not named run their derived knobs) with the full
        mix, or with `bucket`'s rows only offered at its share of the rate; with `edges` (one of
        the session's `edge_sets`), the model runs those bucket edges instead of its own."""
        assert self.server is not None, "enter the session first"
        edges = tuple(edges)
        if edges and edges not in self.edge_sets:
            raise ValueError(f"edges {edges} are not among the session's {self.edge_sets}")
        if edges and bucket != JOINT:
            raise ValueError("a point with other edges runs the full mix")
        started = time.perf_counter()
        model = with_edges(self.model, edges)
        reloaded = self.reload(plan_with(self.spec, model, self.profile, config), model.bucket_names)
        if reloaded:
            time.sleep(SETTLE_S)
        if bucket == JOINT:
            payload, share = self.payload, 1.0
        else:
            if bucket not in self.bucket_payloads:
                raise ValueError(f"no rows of {bucket} in the workload's payload")
            payload, share = self.bucket_payloads[bucket], self.shares[bucket]
        start = max(start_rps or self.options.start_rps, 1.0)
        self.log(f"  {config_label(config) or 'derived'}" + (f", edges {','.join(map(str, edges))}" if edges else "")
                 + (f" (reloaded {', '.join(reloaded)})" if reloaded else "")
                 + ("" if bucket == JOINT else f"; {bucket}'s rows only, offered at its share {share:.1%} of the rate"))
        target = LoadTarget(grpc_url=self.server.grpc_url, model=self.model.name, **payload_fields(payload),
                            rows_per_request=self.rows_per_request, slo_ms=self.model.slo_p95_ms,
                            http_url=self.server.http_url if self.options.protocol == "http" else None)
        options = GoodputOptions(step_s=self.options.step_s, start_rps=max(start * share, 0.5),
                                 max_steps=self.options.max_steps, num_texts=self.options.num_rows, ceiling_rows=0,
                                 protocol=self.options.protocol)
        goodput, steps, _ = asyncio.run(search_goodput(target, options, self.log))
        return Measured(goodput_rps=goodput / share, measure_s=time.perf_counter() - started,
                        steps=tuple(step_summary(step, share) for step in steps))


def measure_point(spec: ServingSpec, model: BucketedModelSpec, profile: LatencyProfile, config: Config,
                  bucket: str, options: SearchOptions, log: Callable[[str], None],
                  start_rps: float | None = None) -> Measured:
    """One point on a server of its own (started and stopped here; not counted in measure_s)."""
    with PointSession(spec, model, profile, options, log) as session:
        return session.measure(config, bucket, start_rps)


# ------------------------------------------------------------------ the search and tune runs


def measured_digest(profile: LatencyProfile) -> str:
    """A digest of what the profile measured (its tuned entries left out, which tune rewrites)."""
    data = {key: value for key, value in profile_to_dict(profile).items() if key != "tuned"}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def new_report(kind: str, spec: ServingSpec, model: BucketedModelSpec, profile: LatencyProfile,
               options: SearchOptions, settings: Mapping[str, Any], command: str) -> dict:
    """A search's or tune's report before its first point: what it measures and how."""
    return {
        "kind": kind,
        "model": model.name,
        "spec": str(spec.path),
        "spec_sha256": spec.sha256,
        "profile": str(profile.path),
        "profile_sha256": measured_digest(profile),
        "slo_ms": model.slo_p95_ms,
        "workload": workload_of(model).name if model.workload is not None else None,
        "criterion": "highest offered open-loop rate with >= 95% of requests within the SLO and no errors",
        "options": options.as_dict(),
        **settings,
        "command": command,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "server_start_s": [],
        "measure_s": 0.0,
        "points": [],
        "best": None,
    }


class ResumeError(ValueError):
    """An --out file that this run cannot resume; the message says why and what to do."""


def check_resumable(report: Mapping[str, Any], fresh: Mapping[str, Any], out: Path) -> None:
    """Raise ResumeError unless `report` (read from `out`) measured what `fresh` would."""
    for key, what in (("kind", "of another kind"), ("model", "of another model"), ("spec_sha256", "of another spec"),
                      ("profile_sha256", "on other profile measurements"), ("options", "with other options")):
        if report.get(key) != fresh.get(key):
            raise ResumeError(f"{out} holds a run {what} ({report.get(key)!r}; this run: {fresh.get(key)!r}); "
                              "pass --restart to measure from scratch, or another --out")


def load_report(out: Path) -> dict | None:
    if not out.is_file():
        return None
    try:
        return json.loads(out.read_text())
    except json.JSONDecodeError as err:
        raise ResumeError(f"{out} is not a search report ({err}); pass --restart to overwrite it") from None


def write_points(report: dict, points: Sequence[Point], best: Point | None, out: Path) -> None:
    """The report with every point so far, written to `out` (through a temporary file, so an
    interruption leaves the last complete one), and its plot beside it."""
    report["points"] = [point.to_dict() for point in points]
    report["measure_s"] = round(sum(point.measure_s for point in points), 1)
    report["best"] = best.to_dict() if best is not None else None
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".json.partial")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    partial.replace(out)
    plot_points(report, out.with_suffix(".png"))


PHASE_COLORS = {"bucket": "#6c8ebf", "edges": "#8e44ad", "joint": "#2e7d32", "derived": "#999999",
                "neighbour": "#6c8ebf", "confirm": "#f0a030"}


def plot_points(report: Mapping[str, Any], path: Path) -> None:
    """Goodput of every point in the order measured, coloured by phase, the best marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    points = report["points"]
    fig, ax = plt.subplots(figsize=(8, 4))
    for phase, color in PHASE_COLORS.items():
        xs = [i + 1 for i, p in enumerate(points) if p["phase"] == phase]
        if xs:
            label = {"bucket": "phase 1: one bucket at its share (as req/s of the mix)",
                     "edges": "other edges, their derived knobs, full mix",
                     "joint": "phase 2: joint, full mix"}.get(phase, phase)
            ax.plot(xs, [points[i - 1]["goodput_rps"] for i in xs], "o", color=color, label=label)
    best = report.get("best")
    if best is not None:
        index = next(i for i, p in enumerate(points) if p == best)
        ax.plot([index + 1], [best["goodput_rps"]], "*", color="red", markersize=16,
                label=f"best: {best['goodput_rps']:.1f} req/s")
    if any(p["goodput_rps"] > 0 for p in points):
        ax.set_yscale("log")  # one bucket alone reaches rates of the mix far above the joint points
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: f"{value:g}" if f"{value:g}"[0] in "25" else ""))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("point, in the order measured")
    ax.set_ylabel("goodput, req/s of the mix")
    ax.set_title(f"{report['kind']} {report['model']}: {len(points)} points, {report['measure_s'] / 60:.1f} min "
                 f"measuring, SLO p95 {report['slo_ms']:.0f} ms", fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass(frozen=True)
class Budget:
    """A run's time budget, from its start (the server's start included)."""

    started: float  # time.monotonic() at the start
    seconds: float  # the whole budget

    def left(self, now: float) -> float:
        return self.seconds - (now - self.started)

    def affords(self, now: float, points: Sequence[Point], share: float = 1.0) -> bool:
        """Whether another point fits in `share` of the budget, going by the points so far."""
        expected = statistics.mean(point.measure_s for point in points[-5:]) if points else 0.0
        return (now - self.started) + expected <= self.seconds * share


def run_search(spec: ServingSpec, model: BucketedModelSpec, profile: LatencyProfile, options: SearchOptions,
               budget_s: float, top_k: int, points_per_bucket: int, out: Path, restart: bool, command: str,
               log: Callable[[str], None]) -> dict:
    """The structured search of `model` within `budget_s`; resumes from `out` unless `restart`.
    Returns the report (also written to `out` after every point). ResumeError when `out` holds
    another run; ServerError when the server fails."""
    budget = Budget(time.monotonic(), budget_s)
    spaces = {space.model_name: space for space in bucket_spaces(spec, model, profile)}
    report = new_report("search", spec, model, profile, options,
                        {"budget_min": round(budget_s / 60, 2), "top_k": top_k, "points_per_bucket": points_per_bucket,
                         "hardware": hardware_report(detect_hardware(None))}, command)
    earlier: list[Point] = []
    previous = None if restart else load_report(out)
    if previous is not None:
        check_resumable(previous, report, out)
        earlier = [Point.from_dict(point) for point in previous["points"]]
        report["started_at"] = previous["started_at"]
        report["server_start_s"] = previous.get("server_start_s", [])
        log(f"resuming {out}: {len(earlier)} point(s) measured before are not measured again")
    edge_points: dict[tuple[int, ...], Config] = {}
    for edges in searchable_edges(model, profile):
        try:
            edge_points[edges] = derived_config(spec, with_edges(model, edges), profile)
        except InfeasibleSLO as err:  # the SLO out of reach with these edges: nothing to measure
            log(f"edges {','.join(map(str, edges))} left out: {err}")
    report["edge_sets"] = [list(edges) for edges in edge_points]
    search = StructuredSearch(list(spaces.values()), points_per_bucket, top_k, measured=earlier,
                              edge_points=edge_points)
    log(f"search {model.name}: {len(spaces)} bucket model(s), grids of "
        + ", ".join(f"{name} {len(grid)}" for name, grid in search.grids.items())
        + f" points; phase 1: {len(search.phase1)} point(s) at the buckets' shares, then "
        + (f"{len(edge_points)} other edge set(s) ({'; '.join(','.join(map(str, e)) for e in edge_points)}) "
           "with their derived knobs, then " if edge_points else "")
        + f"the joint top {top_k}; budget {budget_s / 60:.1f} min")
    if search.next_point() is None:
        log("every point of this search is measured already")
        write_points(report, search.points, search.best(), out)
        return report
    with PointSession(spec, model, profile, options, log, edge_sets=list(edge_points)) as session:
        report["server_start_s"] = [*report["server_start_s"], round(session.start_s, 1)]
        while True:
            now = time.monotonic()
            if search.phase1_open and not budget.affords(now, search.points[len(earlier):], PHASE1_BUDGET_SHARE):
                log("phase 1's share of the budget is spent: on to the joint configurations")
                search.end_phase1()
            proposal = search.next_point()
            if proposal is None:
                log("every point of the search is measured")
                break
            if not budget.affords(now, search.points[len(earlier):]):
                log(f"the budget is spent ({budget_s / 60:.1f} min)")
                break
            label = {"bucket": f"phase 1, {proposal.bucket}", "edges": "edges",
                     "joint": "phase 2, joint"}[proposal.phase]
            log(f"[{len(search.points) + 1}] {label}; {budget.left(now) / 60:.1f} min left")
            start = search_start_rps(proposal, search.points, spaces, options.start_rps)
            measured = session.measure(proposal.config, proposal.bucket, start, proposal.edges)
            point = search.record(proposal, measured.goodput_rps, measured.measure_s, measured.steps)
            log(f"  goodput {point.goodput_rps:.1f} req/s in {point.measure_s:.0f} s")
            write_points(report, search.points, search.best(), out)
    best = search.best()
    write_points(report, search.points, best, out)
    if best is not None:
        log(f"best: {best.goodput_rps:.1f} req/s, {config_label(best.config)}"
            + (f", edges {','.join(map(str, best.edges))}" if best.edges else ""))
    return report


def run_tune(spec: ServingSpec, model: BucketedModelSpec, profile: LatencyProfile, options: SearchOptions,
             budget_s: float, rounds: int, min_gain: float, out: Path, command: str,
             log: Callable[[str], None]) -> tuple[dict, TuneClimb]:
    """`TuneClimb` from the derived configuration within `budget_s`; the report (written to
    `out` after every point) and the climb (its incumbent is the winner)."""
    budget = Budget(time.monotonic(), budget_s)
    spaces = bucket_spaces(spec, model, profile)
    seed = derived_config(spec, model, profile)
    climb = TuneClimb(seed, spaces, rounds=rounds, min_gain=min_gain)
    report = new_report("tune", spec, model, profile, options,
                        {"budget_min": round(budget_s / 60, 2), "rounds": rounds, "min_gain": min_gain,
                         "hardware": hardware_report(detect_hardware(None)),
                         "derived": {name: knobs.as_dict() for name, knobs in seed.items()}}, command)
    log(f"tune {model.name} from the derived configuration: {config_label(seed)}; budget {budget_s / 60:.1f} min")
    with PointSession(spec, model, profile, options, log) as session:
        report["server_start_s"] = [round(session.start_s, 1)]
        while (proposal := climb.next_point()) is not None:
            now = time.monotonic()
            if not budget.affords(now, climb.points):
                log(f"the budget is spent ({budget_s / 60:.1f} min)")
                break
            what = {"derived": "the derived configuration", "confirm": "again, for the medians"}.get(
                proposal.phase, f"a neighbour in {proposal.bucket}")
            log(f"[{len(climb.points) + 1}] {what}; {budget.left(now) / 60:.1f} min left")
            measured = session.measure(proposal.config, JOINT, climb.start_rps(proposal, options.start_rps))
            point = climb.record(proposal, measured.goodput_rps, measured.measure_s, measured.steps)
            log(f"  goodput {point.goodput_rps:.1f} req/s in {point.measure_s:.0f} s")
            write_points(report, climb.points, None, out)
    report["winner"] = {name: knobs.as_dict() for name, knobs in climb.incumbent.items()}
    report["changed"] = climb.changed_knobs()
    report["derived_goodput_rps"] = climb.median(seed)
    report["tuned_goodput_rps"] = climb.median(climb.incumbent)
    report["rounds_measured"] = {"derived": climb.count(seed), "tuned": climb.count(climb.incumbent)}
    winner = next((point for point in reversed(climb.points) if point.config == climb.incumbent), None)
    write_points(report, climb.points, winner, out)
    return report, climb

