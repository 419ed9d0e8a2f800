"""The structured search over batching knobs, the neighbourhood `tune` climbs, and the tuned
knobs gen-config writes over the derived ones.

A point is a set of knobs per bucket model (`KnobSet`: max_batch_size, preferred_batch_size,
max_queue_delay_us, instance_count) measured by its goodput: the highest offered open-loop
rate at which 95% of requests meet the SLO and none fail (`tools.bench.goodput`).

The search space of a bucket model (`bucket_grid`) does not depend on the derivation, so the
search is an independent baseline in the way Model Analyzer's is: delays from a fixed ladder
(`DELAY_LADDER_MS`), max_batch_size from the powers of two the profile measured, a preferred
size of none or a smaller power of two, instances from 1 to twice the device's lanes (and the
spec's cap). Points that cannot meet the SLO by the profile's c(b) are pruned (a full batch
alone over it, o + c(max_batch) > S, or a lone request that waits out the delay,
o + delay + c(1) > S), and so are duplicates (no delay or preferred size with batches of one;
a preferred size equal to max_batch_size behaves as none). A bucket's candidates are ordered by
what the profile predicts (`predicted_goodput_rps`), most promising first.

The structure (`StructuredSearch`, a generator with feedback): phase 1 measures each bucket
model alone at its traffic share (that bucket's rows only, offered at R x share, so its goodput
is in requests/s of the whole mix, R), round-robin over the buckets, and keeps each bucket's
`top_k`; phase 2 measures the joint configurations of the kept candidates (their cartesian
product, best first by what phase 1 predicts of them together) with the full mix. The best
joint point wins (`best_point`). Bucket models sharing the cores meet only in phase 2, among
the kept candidates: a per-bucket candidate that only wins jointly is missed. Between the
two phases, other bucket edges (`tools.planning.buckets.search_edge_sets`: fewer padded tokens,
less compute, a bucket fewer or more, powers of two) are measured with the full mix, each with
the knobs gen-config derives for them (edges no bucket model was profiled at are planned from
estimated curves): edges are tried with their derived knobs, not with a knob search of their own.

`TuneClimb` climbs from the derived configuration: each knob of one bucket model one step up
and down its ladder (`neighbours`), measured with the full mix; the best neighbour replaces
the incumbent only if, re-measured with it in rounds, its median beats the incumbent's by more
than the noise (`min_gain`). Buckets are visited in turn, largest share first, until a whole
round of them brings nothing.

Each point's rate search starts near the goodput expected of it (`search_start_rps`,
`TuneClimb.start_rps`), which saves the doubling steps up to it. `apply_tuned` writes a
profile's tuned entry (`tools.spec.profile.TunedModel`) over a bucket model's derived
`BatchingKnobs`, with the lines its config header says about it. Everything here is pure.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

from tools.planning.derivation import BatchingKnobs
from tools.spec.profile import TUNABLE_KNOBS, LatencyCurve, ProfileError, TunedModel

DELAY_LADDER_MS = (0, 2, 5, 10, 20, 40, 80)  # the searched queue delays (Model Analyzer lists none by default)
TUNE_DELAY_LADDER_MS = (*DELAY_LADDER_MS, 160)  # tune's steps: one more, for a derived delay past 80 ms
INSTANCES_PER_LANE = 2  # search up to this many instances per lane of the device: more only queue for the cores
PREDICTED_UTILIZATION = 0.8  # the ordering model's planned utilisation (the derivation's target too)
TIE_TOLERANCE = 0.05  # goodputs within 5% are a tie: the rate search itself stops within 10%
START_FRACTION = 0.9  # a rate search starts at this fraction of the goodput expected of its point
MIN_GAIN = 0.05  # tune keeps a neighbour only if its median goodput beats the incumbent's by more than this
JOINT = "joint"  # the bucket field of a point measured with the full mix
TRITON_NAMES = {"max_queue_delay_us": "max_queue_delay_microseconds"}  # knob -> its name in config.pbtxt


@dataclass(frozen=True, order=True)
class KnobSet:
    """The batching knobs a search or a tuning sets on one bucket model; the queue policy stays derived."""

    max_batch_size: int  # Triton max_batch_size
    preferred_batch_size: int  # dynamic_batching.preferred_batch_size; 1 writes none (batches up to max)
    max_queue_delay_us: int  # dynamic_batching.max_queue_delay_microseconds
    instance_count: int  # instance_group count

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.instance_count < 1 or self.max_queue_delay_us < 0:
            raise ValueError(f"knobs need max_batch_size >= 1, instance_count >= 1 and a delay >= 0, got {self}")
        if not 1 <= self.preferred_batch_size <= self.max_batch_size:
            raise ValueError(f"preferred_batch_size {self.preferred_batch_size} must be in 1..max_batch_size "
                             f"{self.max_batch_size}")

    @classmethod
    def of(cls, knobs: BatchingKnobs) -> KnobSet:
        """The tunable knobs of derived (or tuned) batching knobs."""
        return cls(**{knob: getattr(knobs, knob) for knob in TUNABLE_KNOBS})

    @classmethod
    def from_dict(cls, data: Mapping[str, int]) -> KnobSet:
        return cls(**{knob: int(data[knob]) for knob in TUNABLE_KNOBS})

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def as_served(self) -> KnobSet:
        """These knobs as Triton serves them back: a preferred size equal to max_batch_size is the
        batcher's own target, so a served config reads as naming none (the same batching)."""
        if self.preferred_batch_size == self.max_batch_size:
            return replace(self, preferred_batch_size=1)
        return self

    @property
    def target_batch(self) -> int:
        """The batch the batcher aims for: the preferred size, else max_batch_size."""
        return self.preferred_batch_size if self.preferred_batch_size > 1 else self.max_batch_size

    def label(self) -> str:
        """Short form for logs and plots: b<max>/p<preferred or ->/d<delay ms>/i<instances>."""
        preferred = str(self.preferred_batch_size) if self.preferred_batch_size > 1 else "-"
        return (f"b{self.max_batch_size}/p{preferred}/d{self.max_queue_delay_us / 1000:g}ms"
                f"/i{self.instance_count}")


Config = dict[str, KnobSet]  # bucket model -> its knobs (those not named stay derived)


def config_key(config: Mapping[str, KnobSet]) -> str:
    """A configuration as a stable string (the identity of a point on resume)."""
    return ";".join(f"{name}={knobs.label()}" for name, knobs in sorted(config.items()))


def config_label(config: Mapping[str, KnobSet]) -> str:
    return ", ".join(f"{name} {knobs.label()}" for name, knobs in sorted(config.items()))


def point_key(phase: str, bucket: str, config: Mapping[str, KnobSet], edges: Sequence[int] = ()) -> str:
    """A point's identity on resume: phase, bucket, knobs, and the edges when not the model's own."""
    key = f"{phase}|{bucket}|{config_key(config)}"
    return key + f"|edges={','.join(map(str, edges))}" if edges else key


@dataclass(frozen=True)
class BucketSpace:
    """What the search knows of one bucket model before measuring it."""

    model_name: str  # the bucket model
    share: float  # its share of the rows (the workload's)
    curve: LatencyCurve  # its measured c(b)
    slo_p95_ms: float  # S
    overhead_ms: float  # o (p95)
    max_instances: int  # the spec's cap on instances
    lanes: int  # executions the device runs side by side at full speed
    rows_per_request: int = 1  # rows in one request of the mix

    @property
    def max_search_instances(self) -> int:
        return max(1, min(self.max_instances, INSTANCES_PER_LANE * self.lanes))

    def batch_ladder(self) -> list[int]:
        """Powers of two up to the largest batch the profile measured, a full batch within the SLO."""
        sizes = [2 ** i for i in range(int(math.log2(self.curve.max_measured)) + 1)]
        return [b for b in sizes if self.overhead_ms + self.curve.at(b) <= self.slo_p95_ms] or [1]

    def delay_ladder_us(self, ladder_ms: Sequence[int] = DELAY_LADDER_MS) -> list[int]:
        """Delays of the ladder that a lone request can wait out and still meet the SLO."""
        budget_ms = self.slo_p95_ms - self.overhead_ms - self.curve.at(1)
        return [int(ms * 1000) for ms in ladder_ms if ms <= budget_ms] or [0]

    def allows(self, knobs: KnobSet) -> bool:
        """Whether `knobs` can meet the SLO by the profile's c(b) (the grid's pruning rule)."""
        if knobs.max_batch_size > self.curve.max_measured or knobs.instance_count > self.max_instances:
            return False
        return (self.overhead_ms + self.curve.at(knobs.max_batch_size) <= self.slo_p95_ms and
                self.overhead_ms + knobs.max_queue_delay_us / 1000 + self.curve.at(1) <= self.slo_p95_ms)


def predicted_goodput_rps(knobs: KnobSet, space: BucketSpace) -> float:
    """What the profile predicts of `knobs` for the bucket alone, in requests/s of the whole mix.

    At its goodput a bucket runs batches of its target size b (the preferred size, else
    max_batch_size) on min(instances, lanes) lanes: b / c(b) rows/s each, planned at 80%
    busy. A request may wait for a batch ahead of its own, so when o + 2·c(b) > S only the
    part of a batch ahead that still fits counts. Instances beyond the lanes queue for the
    cores: 5% less each. Used to order the candidates, never as a result.
    """
    if space.share <= 0:
        return math.inf
    batch = knobs.target_batch
    compute = space.curve.at(batch)
    lanes = min(knobs.instance_count, space.lanes)
    rows_per_s = lanes * batch / compute * 1000.0 * PREDICTED_UTILIZATION
    rows_per_s *= max(0.0, 1.0 - 0.05 * max(0, knobs.instance_count - space.lanes))
    ahead_fits = (space.slo_p95_ms - space.overhead_ms - compute) / compute
    rows_per_s *= min(1.0, max(0.0, ahead_fits))
    return rows_per_s / (space.share * space.rows_per_request)


def _order_key(knobs: KnobSet, space: BucketSpace) -> tuple:
    # Predictions within 5% are a tie, broken towards less waiting and fewer, smaller parts. The
    # order does not depend on the share (it scales every prediction alike).
    predicted = predicted_goodput_rps(knobs, replace(space, share=1.0))
    band = math.floor(math.log(predicted) / math.log(1 + TIE_TOLERANCE)) if predicted > 0 else -math.inf
    return (-band, knobs.max_queue_delay_us, knobs.instance_count, knobs.max_batch_size, knobs.preferred_batch_size)


def bucket_grid(space: BucketSpace) -> list[KnobSet]:
    """Every candidate of one bucket model, pruned and ordered most promising first.

    After sorting by prediction, one candidate of each (target batch, instances) shape comes
    before a second of any: a budget that measures the first few sees different batch sizes
    and instance counts, not one shape at several delays.
    """
    candidates = []
    for max_batch in space.batch_ladder():
        preferred = [1] + [p for p in space.batch_ladder() if 1 < p < max_batch]
        delays = space.delay_ladder_us() if max_batch > 1 else [0]
        for pref, delay, instances in itertools.product(preferred, delays, range(1, space.max_search_instances + 1)):
            knobs = KnobSet(max_batch, pref, delay, instances)
            if space.allows(knobs):
                candidates.append(knobs)
    ordered = sorted(candidates, key=lambda k: _order_key(k, space))
    result: list[KnobSet] = []
    while ordered:
        seen: set[tuple[int, int]] = set()
        later = []
        for knobs in ordered:
            shape = (knobs.target_batch, knobs.instance_count)
            (later if shape in seen else result).append(knobs)
            seen.add(shape)
        ordered = later
    return result


# ------------------------------------------------------------------ points


@dataclass(frozen=True)
class Point:
    """One measured configuration."""

    phase: str  # "bucket" (search phase 1), "edges", "joint" (phase 2), "derived", "neighbour", "confirm" (tune)
    bucket: str  # the bucket model measured alone (phase 1), or JOINT for the full mix
    config: Config  # bucket model -> knobs; bucket models not named ran their derived knobs
    goodput_rps: float  # requests/s of the whole mix (phase 1: the bucket's rate over its share)
    measure_s: float  # seconds this point took: reloading, warm-up, the rate search
    steps: tuple[dict, ...] = ()  # the rate search's steps: offered_rps, within_slo, errors, p95_ms, passed
    edges: tuple[int, ...] = ()  # the bucket edges it ran; (): the model's own

    @property
    def key(self) -> str:
        return point_key(self.phase, self.bucket, self.config, self.edges)

    @property
    def full_mix(self) -> bool:
        return self.bucket == JOINT

    def to_dict(self) -> dict:
        return {"phase": self.phase, "bucket": self.bucket,
                "config": {name: knobs.as_dict() for name, knobs in sorted(self.config.items())},
                "edges": list(self.edges) or None, "label": config_label(self.config),
                "goodput_rps": round(self.goodput_rps, 2), "measure_s": round(self.measure_s, 1),
                "steps": list(self.steps)}

    @classmethod
    def from_dict(cls, data: Mapping) -> Point:
        return cls(phase=str(data["phase"]), bucket=str(data["bucket"]),
                   config={name: KnobSet.from_dict(knobs) for name, knobs in data["config"].items()},
                   goodput_rps=float(data["goodput_rps"]), measure_s=float(data["measure_s"]),
                   steps=tuple(data.get("steps", ())), edges=tuple(int(e) for e in data.get("edges") or ()))


def merge_points(old: Iterable[Point], new: Iterable[Point]) -> list[Point]:
    """The points of a resumed run: the earlier ones, then the new ones not measured before."""
    merged: dict[str, Point] = {}
    for point in (*old, *new):
        merged.setdefault(point.key, point)
    return list(merged.values())


def _size_key(point: Point) -> tuple:
    knobs = point.config.values()
    return (bool(point.edges), sum(k.instance_count for k in knobs), sum(k.max_queue_delay_us for k in knobs),
            sum(k.max_batch_size for k in knobs), sum(k.preferred_batch_size for k in knobs), point.measure_s)


def best_point(points: Iterable[Point], tolerance: float = TIE_TOLERANCE) -> Point | None:
    """The point with the highest goodput; points within `tolerance` of it are a tie, broken
    towards the model's own edges, fewer instances, shorter delays, smaller batches, then less
    measuring. None if none."""
    points = list(points)
    if not points:
        return None
    top = max(point.goodput_rps for point in points)
    tied = [point for point in points if point.goodput_rps >= top * (1 - tolerance)]
    return min(tied, key=_size_key)


# ------------------------------------------------------------------ the structured search


@dataclass(frozen=True)
class Proposal:
    """A point to measure next."""

    phase: str  # as Point.phase
    bucket: str  # a bucket model (phase 1) or JOINT
    config: Config  # the knobs to measure
    edges: tuple[int, ...] = ()  # the bucket edges to run; (): the model's own

    @property
    def key(self) -> str:
        return point_key(self.phase, self.bucket, self.config, self.edges)


def joint_predicted_rps(goodputs: Sequence[float]) -> float:
    """What bucket goodputs measured alone predict of them together: alone, bucket b fills the
    device at R_b, so at R it takes R / R_b of it; together they fit while the sum is <= 1."""
    if any(g <= 0 for g in goodputs):
        return 0.0
    return 1.0 / sum(1.0 / g for g in goodputs)


class StructuredSearch:
    """Phase 1 per bucket at its share, then other bucket edges with their derived knobs
    (`edge_points`: edges -> the knobs gen-config derives for them), then the joint
    configurations of each bucket's best `top_k`; a generator with feedback: `next_point()`
    proposes, `record()` takes the result.

    Points measured by an earlier run (`measured`) are not proposed again. A bucket with no
    share of the traffic is not measured: its first candidate goes into phase 2 as is.
    """

    def __init__(self, spaces: Sequence[BucketSpace], points_per_bucket: int, top_k: int,
                 measured: Iterable[Point] = (), edge_points: Mapping[tuple[int, ...], Config] | None = None):
        if points_per_bucket < 1 or top_k < 1:
            raise ValueError(f"need points_per_bucket >= 1 and top_k >= 1, got {points_per_bucket}, {top_k}")
        if not spaces:
            raise ValueError("a search needs at least one bucket model")
        self.spaces = {space.model_name: space for space in spaces}
        self.top_k = top_k
        self.grids = {name: bucket_grid(space) for name, space in self.spaces.items()}
        empty = [name for name, grid in self.grids.items() if not grid]
        if empty:
            overhead = min(self.spaces[name].overhead_ms for name in empty)
            slo_ms = self.spaces[empty[0]].slo_p95_ms
            raise ValueError(f"no configuration of {', '.join(empty)} can meet the {slo_ms:g} ms p95 SLO by the "
                             f"profile: the router overhead {overhead:.1f} ms plus one row's "
                             "latency is over it; profile again if that overhead looks wrong, or raise the SLO")
        self.points: list[Point] = list(measured)
        self.phase1_open = True
        # The buckets measured alone; one bucket carries the whole mix, so it is measured jointly.
        self.measured_alone = [name for name, space in sorted(self.spaces.items(), key=lambda item: -item[1].share)
                               if space.share > 0 and len(self.spaces) > 1]
        self.phase1 = self._round_robin({name: self.grids[name][:points_per_bucket] for name in self.measured_alone})
        self.edge_proposals = [Proposal("edges", JOINT, dict(config), tuple(edges))
                               for edges, config in (edge_points or {}).items()]

    @staticmethod
    def _round_robin(candidates: Mapping[str, list[KnobSet]]) -> list[Proposal]:
        order = []
        for row in itertools.zip_longest(*candidates.values()):
            order += [Proposal("bucket", name, {name: knobs}) for name, knobs in zip(candidates, row, strict=True)
                      if knobs is not None]
        return order

    @property
    def measured_keys(self) -> set[str]:
        return {point.key for point in self.points}

    def end_phase1(self) -> None:
        """Stop proposing phase-1 points (its share of the budget is spent)."""
        self.phase1_open = False

    def kept(self) -> dict[str, list[tuple[KnobSet, float]]]:
        """Each bucket's best `top_k` candidates of phase 1 with their goodput (inf: not measured alone)."""
        kept = {}
        for name in self.spaces:
            ranked = sorted((point for point in self.points if point.phase == "bucket" and point.bucket == name),
                            key=lambda point: (-point.goodput_rps, _size_key(point)))
            # Not measured alone (no share of the traffic, or the budget ended first): the
            # candidate the profile predicts best, which leaves the others to rank the joint points.
            kept[name] = ([(point.config[name], point.goodput_rps) for point in ranked[:self.top_k]]
                          or [(self.grids[name][0], math.inf)])
        return kept

    def phase2(self) -> list[Proposal]:
        """The joint configurations of the kept candidates, best first by `joint_predicted_rps`
        (ties: the better-ranked candidates first). A single bucket model's grid is its phase 2."""
        if len(self.spaces) == 1:
            (name,) = self.spaces
            return [Proposal("joint", JOINT, {name: knobs}) for knobs in self.grids[name]]
        kept = self.kept()
        names = list(kept)
        combos = []
        for ranks in itertools.product(*(range(len(kept[name])) for name in names)):
            goodputs = [kept[name][rank][1] for name, rank in zip(names, ranks, strict=True)]
            finite = [g for g in goodputs if math.isfinite(g)]
            combos.append((-joint_predicted_rps(finite) if finite else 0.0, sum(ranks), ranks))
        combos.sort()
        return [Proposal("joint", JOINT, {name: kept[name][rank][0] for name, rank in zip(names, ranks, strict=True)})
                for _, _, ranks in combos]

    def next_point(self) -> Proposal | None:
        done = self.measured_keys
        if self.phase1_open:
            for proposal in self.phase1:
                if proposal.key not in done:
                    return proposal
            self.phase1_open = False
        for proposal in (*self.edge_proposals, *self.phase2()):
            if proposal.key not in done:
                return proposal
        return None

    def record(self, proposal: Proposal, goodput_rps: float, measure_s: float, steps: Sequence[dict] = ()) -> Point:
        point = Point(proposal.phase, proposal.bucket, dict(proposal.config), goodput_rps, measure_s, tuple(steps),
                      proposal.edges)
        self.points.append(point)
        return point

    def best(self) -> Point | None:
        """The best point measured with the full mix."""
        return best_point(point for point in self.points if point.full_mix)


def search_start_rps(proposal: Proposal, points: Sequence[Point], spaces: Mapping[str, BucketSpace],
                     default: float) -> float:
    """Where a point's rate search starts: near the goodput expected of it, which saves the
    doubling steps up to it. A bucket's next point starts from that bucket's best so far (the
    rate to beat, alike for its candidates); its first, from what the profile predicts scaled by
    how far the measured points fell from their predictions; a joint point from the best joint
    one, else from what the buckets' phase-1 goodputs predict together; else `default`."""
    same = [point.goodput_rps for point in points if point.bucket == proposal.bucket and point.goodput_rps > 0]
    if same:
        return max(same) * START_FRACTION
    alone = [point for point in points if point.phase == "bucket" and point.goodput_rps > 0]
    if proposal.bucket != JOINT and alone:
        ratios = [point.goodput_rps / predicted_goodput_rps(point.config[point.bucket], spaces[point.bucket])
                  for point in alone]
        guess = predicted_goodput_rps(proposal.config[proposal.bucket], spaces[proposal.bucket])
        return guess * statistics.median(ratios) * START_FRACTION
    if proposal.bucket == JOINT and alone:
        best = {}
        for point in alone:
            best[point.bucket] = max(best.get(point.bucket, 0.0), point.goodput_rps)
        return joint_predicted_rps(list(best.values())) * START_FRACTION
    return default


# ------------------------------------------------------------------ tune's neighbourhood


def _steps(ladder: Sequence[int], value: int) -> list[int]:
    """The ladder's values just below and just above `value` (which need not be on it)."""
    below = [v for v in ladder if v < value]
    above = [v for v in ladder if v > value]
    return ([below[-1]] if below else []) + ([above[0]] if above else [])


def neighbours(config: Mapping[str, KnobSet], space: BucketSpace) -> list[Config]:
    """`config` with one knob of `space`'s bucket model one step up or down its ladder: max
    and preferred batch on the powers of two, the delay on `TUNE_DELAY_LADDER_MS`, instances
    +-1. Steps the SLO rules out (`BucketSpace.allows`) or that break preferred <= max are left out."""
    name = space.model_name
    knobs = config[name]
    batches = space.batch_ladder()
    options: list[KnobSet] = []
    for size in _steps(batches, knobs.max_batch_size):
        if knobs.preferred_batch_size < size or knobs.preferred_batch_size == 1:
            options.append(replace(knobs, max_batch_size=size))
    for size in _steps([1] + [b for b in batches if 1 < b < knobs.max_batch_size], knobs.preferred_batch_size):
        options.append(replace(knobs, preferred_batch_size=size))
    if knobs.max_batch_size > 1:
        for delay in _steps(space.delay_ladder_us(TUNE_DELAY_LADDER_MS), knobs.max_queue_delay_us):
            options.append(replace(knobs, max_queue_delay_us=delay))
    for count in (knobs.instance_count - 1, knobs.instance_count + 1):
        if 1 <= count <= space.max_instances:
            options.append(replace(knobs, instance_count=count))
    return [{**config, name: option} for option in dict.fromkeys(options) if space.allows(option)]


@dataclass
class TuneClimb:
    """Hill-climbing from the derived configuration; a generator with feedback like the search.

    The seed is measured first. Then, bucket by bucket (largest share first), every neighbour
    of the incumbent in that bucket is measured once; if the best beats the incumbent by more
    than `min_gain`, both are measured again until each has `rounds` results, and the
    neighbour replaces the incumbent only if its median still beats the incumbent's median by
    more than `min_gain` (one lucky rate search wins nothing). After a replacement the same
    bucket is climbed again; the climb ends when every bucket in a row brought nothing.
    """

    seed: Config  # the derived configuration, every bucket model
    spaces: Sequence[BucketSpace]
    rounds: int = 3  # results per configuration behind a replacement
    min_gain: float = MIN_GAIN  # relative gain a median must show over the incumbent's
    incumbent: Config = field(init=False)
    samples: dict[str, list[float]] = field(init=False, default_factory=dict)  # config_key -> goodputs
    points: list[Point] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        self.incumbent = dict(self.seed)
        self.order = sorted(self.spaces, key=lambda space: -space.share)
        self.bucket_index = 0
        self.unimproved = 0
        self.candidate: Config | None = None

    def median(self, config: Mapping[str, KnobSet]) -> float:
        values = self.samples.get(config_key(config), [])
        return float(statistics.median(values)) if values else 0.0

    def count(self, config: Mapping[str, KnobSet]) -> int:
        return len(self.samples.get(config_key(config), []))

    def next_point(self) -> Proposal | None:
        if not self.count(self.seed):
            return Proposal("derived", JOINT, dict(self.seed))
        if self.candidate is not None:  # confirming: the one with fewer results next, the incumbent first
            if self.count(self.incumbent) < self.rounds and \
                    self.count(self.incumbent) <= self.count(self.candidate):
                return Proposal("confirm", JOINT, dict(self.incumbent))
            if self.count(self.candidate) < self.rounds:
                return Proposal("confirm", JOINT, dict(self.candidate))
            self._decide()
            return self.next_point()
        if self.unimproved >= len(self.order):
            return None
        space = self.order[self.bucket_index]
        for config in neighbours(self.incumbent, space):
            if not self.count(config):
                return Proposal("neighbour", space.model_name, config)
        best = max(neighbours(self.incumbent, space), key=self.median, default=None)
        if best is not None and self.median(best) > self.median(self.incumbent) * (1 + self.min_gain):
            self.candidate = best
        else:
            self._next_bucket()
        return self.next_point()

    def _decide(self) -> None:
        assert self.candidate is not None
        if self.median(self.candidate) > self.median(self.incumbent) * (1 + self.min_gain):
            self.incumbent, self.unimproved = self.candidate, 0  # climb the same bucket again from here
        else:
            self._next_bucket()
        self.candidate = None

    def _next_bucket(self) -> None:
        self.unimproved += 1
        self.bucket_index = (self.bucket_index + 1) % len(self.order)

    def start_rps(self, proposal: Proposal, default: float) -> float:
        """Where a point's rate search starts: the seed's at `default`; a neighbour's near the
        incumbent's median, so that every neighbour of one incumbent starts alike; a
        confirmation near the better of the two medians, so that both start alike."""
        if proposal.phase == "derived" or not self.count(self.incumbent):
            return default
        level = self.median(self.incumbent)
        if proposal.phase == "confirm" and self.candidate is not None:
            level = max(level, self.median(self.candidate))
        return level * START_FRACTION if level > 0 else default

    def record(self, proposal: Proposal, goodput_rps: float, measure_s: float, steps: Sequence[dict] = ()) -> Point:
        self.samples.setdefault(config_key(proposal.config), []).append(goodput_rps)
        point = Point(proposal.phase, proposal.bucket, dict(proposal.config), goodput_rps, measure_s, tuple(steps))
        self.points.append(point)
        return point

    def tuned_entry(self, command: str, tuned_at: str, slo_p95_ms: float) -> TunedModel | None:
        """The profile's tuned entry for the climb's winner; None when the derived configuration held."""
        changed = self.changed_knobs()
        if not changed:
            return None
        return TunedModel(knobs=changed, tuned_at=tuned_at, command=command, slo_p95_ms=slo_p95_ms,
                          derived_goodput_rps=self.median(self.seed), tuned_goodput_rps=self.median(self.incumbent),
                          rounds=min(self.count(self.seed), self.count(self.incumbent)))

    def changed_knobs(self) -> dict[str, dict[str, int]]:
        """The incumbent's knobs that differ from the seed, by bucket model: the tuned entry."""
        changed = {}
        for name, knobs in self.incumbent.items():
            diff = {knob: value for knob, value in knobs.as_dict().items() if value != getattr(self.seed[name], knob)}
            if diff:
                changed[name] = diff
        return changed


# ------------------------------------------------------------------ tuned knobs in gen-config


def knob_name(knob: str) -> str:
    """A knob as config.pbtxt names it."""
    return TRITON_NAMES.get(knob, knob)


def apply_tuned(knobs: BatchingKnobs, tuned: TunedModel | None, model_name: str, slo_p95_ms: float,
                curve: LatencyCurve, bucket_models: Iterable[str]) -> tuple[BatchingKnobs, tuple[str, ...]]:
    """A bucket model's knobs with its model's tuned entry written over the derived ones, and
    the lines its config header says about it (none without an entry).

    The entry applies while the spec's SLO is the one it was tuned for; otherwise the derived
    knobs stay, with a warning. The queue policy stays derived, but its queue holds at least a
    full batch. ProfileError when the entry names a bucket model the spec does not serve, or
    asks for a preferred size the profile did not measure or above max_batch_size.
    """
    if tuned is None:
        return knobs, ()
    unknown = sorted(set(tuned.knobs) - set(bucket_models))
    if unknown:
        raise ProfileError(f"the profile's tuned knobs of {model_name} name {unknown}, which {model_name} does not "
                           f"serve (its bucket models: {sorted(bucket_models)}); run `python -m tools tune "
                           f"{model_name} --reset` or tune it again")
    what = f"tuned by `{tuned.command}` on {tuned.tuned_at[:10]}"
    if tuned.slo_p95_ms != slo_p95_ms:
        warning = (f"{knobs.model_name}: the knobs {what} were for SLO {tuned.slo_p95_ms:g} ms, the spec's is "
                   f"{slo_p95_ms:g} ms: the derived knobs are written; run `python -m tools tune {model_name}` "
                   f"again, or `--reset`")
        return replace(knobs, warnings=(*knobs.warnings, warning)), ()
    values = tuned.knobs.get(knobs.model_name, {})
    merged = {knob: values.get(knob, getattr(knobs, knob)) for knob in TUNABLE_KNOBS}
    if merged["preferred_batch_size"] > merged["max_batch_size"] or \
            merged["preferred_batch_size"] > curve.max_measured:
        raise ProfileError(f"the profile's tuned knobs of {knobs.model_name}: preferred_batch_size "
                           f"{merged['preferred_batch_size']} is above max_batch_size {merged['max_batch_size']} or "
                           f"the largest batch measured ({curve.max_measured}); run `python -m tools tune "
                           f"{model_name} --reset`")
    changes = {knob: (getattr(knobs, knob), value) for knob, value in merged.items() if value != getattr(knobs, knob)}
    reasons = dict(knobs.reasons)
    for knob, (derived, value) in changes.items():
        reasons[knob_name(knob)] = f"tuned: {value} instead of the derived {derived}: {reasons[knob_name(knob)]}"
    tuned_knobs = replace(knobs, **{knob: value for knob, (_, value) in changes.items()}, reasons=reasons,
                          max_queue_size=max(knobs.max_queue_size, merged["max_batch_size"]))
    changed = ", ".join(f"{knob_name(knob)} {derived} -> {value}" for knob, (derived, value) in changes.items())
    line = (f"{what}: {changed or 'the derived knobs kept'}; the model's goodput "
            f"{tuned.derived_goodput_rps:.1f} -> {tuned.tuned_goodput_rps:.1f} req/s (medians of {tuned.rounds} "
            f"round{'s' if tuned.rounds > 1 else ''}); derived values in the reasons above")
    return tuned_knobs, (line,)


def with_config(tuned: Mapping[str, TunedModel], model_name: str, slo_p95_ms: float,
                config: Mapping[str, KnobSet], label: str) -> dict[str, TunedModel]:
    """A profile's tuned entries with `model_name`'s set to `config` (every knob of each bucket
    model named): how the search and tune measure a point through gen-config's own path."""
    entry = TunedModel(knobs={name: knobs.as_dict() for name, knobs in config.items()}, tuned_at="", command=label,
                       slo_p95_ms=slo_p95_ms, derived_goodput_rps=0.0, tuned_goodput_rps=0.0, rounds=1)
    return {**{name: t for name, t in tuned.items() if name != model_name}, **({model_name: entry} if config else {})}
