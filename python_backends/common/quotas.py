"""Tenant tiers and quotas: which tier a tenant is in, and whether it may send one more request.

The policy (`TenantPolicy`, `take`) is pure: plain data and an explicit clock. Quotas are
token buckets, one per tenant, refilled at the tier's rate up to its burst. A tenant over
its quota is refused at once (the caller answers a retryable "over quota" error with the
time until a token is back), so a flooding tenant costs the server almost nothing and
cannot take the instances, queues or cores the other tenants need.

The router runs as many processes as it has instances, and a quota must hold across all of
them: `SharedBuckets` keeps the buckets in a `SharedTable`, one memory-mapped file under an
exclusive file lock (a few microseconds per request). The LLM engine is one process and uses `LocalBuckets`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from python_backends.common.shared_table import SharedTable

MAX_TENANT_LEN = 64
TENANT_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
OTHER_TENANTS = "other"  # metric label of tenants the spec does not name (keeps label sets bounded)


@dataclass(frozen=True)
class TierPolicy:
    """What every tenant of one tier gets."""

    name: str
    priority: int  # Triton priority level of the router queue; 1 is served first
    requests_per_s: float  # sustained requests per second per tenant; 0: no limit
    burst: float  # requests a tenant may send at once after being idle (bucket size)
    llm_tokens_per_s: float = 0.0  # generated tokens per second per tenant on the LLM; 0: no limit
    llm_token_burst: float = 0.0  # generated tokens a tenant may take at once

    def verify(self) -> None:
        if self.priority < 1:
            raise ValueError(f"tier {self.name!r}: priority must be >= 1, got {self.priority}")
        for key in ("requests_per_s", "burst", "llm_tokens_per_s", "llm_token_burst"):
            value = getattr(self, key)
            if not value >= 0 or value == float("inf"):
                raise ValueError(f"tier {self.name!r}: {key} must be a finite number >= 0, got {value!r}")
        if self.requests_per_s > 0 and self.burst < 1:
            raise ValueError(f"tier {self.name!r}: burst must be >= 1 when requests_per_s is set, got {self.burst}")
        if self.llm_tokens_per_s > 0 and self.llm_token_burst < 1:
            raise ValueError(f"tier {self.name!r}: llm_token_burst must be >= 1 when llm_tokens_per_s is set")


@dataclass(frozen=True)
class TenantPolicy:
    """Tiers, which named tenant is in which, and the tier of everyone else."""

    tiers: Mapping[str, TierPolicy]  # by name
    default_tier: str  # tier of a tenant the spec does not name (and of requests naming none)
    members: Mapping[str, str] = field(default_factory=dict)  # tenant id -> tier name

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ValueError("at least one tenant tier is needed")
        for tier in self.tiers.values():
            tier.verify()
        if self.default_tier not in self.tiers:
            raise ValueError(f"default tier {self.default_tier!r} is not one of the tiers {sorted(self.tiers)}")
        for tenant, tier in self.members.items():
            if not TENANT_PATTERN.match(tenant):
                raise ValueError(f"tenant id {tenant!r} must be 1-64 letters, digits, '.', '_' or '-'")
            if tier not in self.tiers:
                raise ValueError(f"tenant {tenant!r} is in tier {tier!r}, which is not one of {sorted(self.tiers)}")

    def tier_of(self, tenant: str) -> TierPolicy:
        return self.tiers[self.members.get(tenant, self.default_tier)]

    def metric_label(self, tenant: str) -> str:
        """The tenant's own id when the spec names it, else one shared label."""
        return tenant if tenant in self.members else OTHER_TENANTS

    def to_json(self) -> str:
        return json.dumps({
            "default_tier": self.default_tier,
            "members": dict(sorted(self.members.items())),
            "tiers": {name: {"priority": t.priority, "requests_per_s": t.requests_per_s, "burst": t.burst,
                             "llm_tokens_per_s": t.llm_tokens_per_s, "llm_token_burst": t.llm_token_burst}
                      for name, t in sorted(self.tiers.items())},
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TenantPolicy:
        try:
            data = json.loads(text)
            tiers = {name: TierPolicy(name=name, priority=int(t["priority"]),
                                      requests_per_s=float(t.get("requests_per_s", 0)),
                                      burst=float(t.get("burst", 0)),
                                      llm_tokens_per_s=float(t.get("llm_tokens_per_s", 0)),
                                      llm_token_burst=float(t.get("llm_token_burst", 0)))
                     for name, t in data["tiers"].items()}
            return cls(tiers=tiers, default_tier=str(data["default_tier"]), members=dict(data.get("members", {})))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"tenant policy is not valid: {err}") from None


UNLIMITED = TenantPolicy(tiers={"standard": TierPolicy("standard", 1, 0.0, 0.0)}, default_tier="standard")


@dataclass(frozen=True)
class BucketState:
    """One tenant's token bucket."""

    tokens: float  # tokens in the bucket at `updated_s`
    updated_s: float  # monotonic clock of the last refill


def take(state: BucketState | None, cost: float, rate_per_s: float, burst: float,
         now_s: float) -> tuple[BucketState, float]:
    """Try to take `cost` tokens. Returns the new state and the wait: 0.0 when taken, else the
    seconds until the bucket holds `cost` (nothing is taken then). A new tenant starts full."""
    if state is None:
        tokens = burst
    else:
        elapsed_s = max(0.0, now_s - state.updated_s)  # a clock never runs backwards here
        tokens = min(burst, state.tokens + elapsed_s * rate_per_s)
    if tokens >= cost:
        return BucketState(tokens - cost, now_s), 0.0
    return BucketState(tokens, now_s), (cost - tokens) / rate_per_s


def charge(state: BucketState | None, cost: float, rate_per_s: float, burst: float,
           now_s: float) -> BucketState:
    """Take `cost` tokens whatever the level (the bucket may go negative): for work already done,
    such as tokens generated, which later admissions then wait to pay back."""
    refilled, _ = take(state, 0.0, rate_per_s, burst, now_s)
    return BucketState(min(burst, refilled.tokens - cost), now_s)  # a refund (cost < 0) never overfills it


@dataclass(frozen=True)
class QuotaDecision:
    """Whether a tenant's request may go ahead."""

    allowed: bool
    retry_after_s: float  # when refused: seconds until the tenant has quota again
    tier: TierPolicy
    unit: str = "requests"  # what the quota counts: "requests", or "generated tokens" (LLM)
    cost: float = 1.0  # what this request takes from the bucket

    def message(self, tenant: str) -> str:
        if self.unit == "requests":
            rate, burst = self.tier.requests_per_s, self.tier.burst
        else:
            rate, burst = self.tier.llm_tokens_per_s, self.tier.llm_token_burst
        return (f"tenant '{tenant}' is over its quota of {rate:g} {self.unit}/s (tier {self.tier.name}, "
                f"burst {burst:g}; this request needs {self.cost:g}); retry after {self.retry_after_s:.3f} s")


class LocalBuckets:
    """Token buckets of one process (its threads may share them)."""

    def __init__(self) -> None:
        self._states: dict[str, BucketState] = {}
        self._lock = threading.Lock()

    def take(self, key: str, cost: float, rate_per_s: float, burst: float, now_s: float) -> float:
        with self._lock:
            state, wait_s = take(self._states.get(key), cost, rate_per_s, burst, now_s)
            self._states[key] = state
            return wait_s

    def charge(self, key: str, cost: float, rate_per_s: float, burst: float, now_s: float) -> None:
        with self._lock:
            self._states[key] = charge(self._states.get(key), cost, rate_per_s, burst, now_s)


@functools.lru_cache(maxsize=4096)  # a tenant's key is hashed once, not on every request
def _key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") or 1


# A row of the shared table: key hash (0 = empty), tokens, updated (monotonic seconds).
BUCKET_FIELDS = (("key", "<u8"), ("tokens", "<f8"), ("updated_s", "<f8"))


class SharedBuckets:
    """Token buckets shared by every process that opens the same file (an open-addressing
    hash table of `num_slots` tenants in a `SharedTable`, updated under its lock).

    When every slot is taken, a new tenant gets the slot its hash lands on, sharing it with
    that tenant: the table is sized far beyond the tenants one server sees, and a shared
    bucket errs towards refusing rather than towards letting a flood through.
    """

    def __init__(self, path: Path, num_slots: int = 4096):
        self.table = SharedTable(path, num_slots, BUCKET_FIELDS)
        self.path = self.table.path
        self.num_slots = num_slots
        # Column views, made once: a view per request would cost more than the update itself.
        self._keys, self._tokens, self._updated = (self.table.rows[name] for name, _ in BUCKET_FIELDS)
        # Key hash -> its slot, once the slot holds that key: no process ever clears a slot,
        # so the probe is made once per tenant, not once per request.
        self._slots: dict[int, int] = {}

    def _slot_of(self, key_hash: int) -> int:
        """The key's slot, or the first empty one on its probe path, or (table full) the slot
        its hash lands on, whose bucket it then shares."""
        keys = self._keys
        start = key_hash % self.num_slots
        for probe in range(self.num_slots):
            slot = (start + probe) % self.num_slots
            if int(keys[slot]) in (0, key_hash):
                return slot
        return start

    def _update(self, key: str, step) -> float:
        key_hash = _key_hash(key)
        with self.table.locked():
            slot = self._slots.get(key_hash)
            if slot is None:
                slot = self._slot_of(key_hash)
            stored = int(self._keys[slot])
            # An empty slot starts a full bucket; a shared one (full table) keeps its owner's
            # hash and level, so neither tenant is handed a fresh bucket.
            state = None if stored == 0 else BucketState(float(self._tokens[slot]), float(self._updated[slot]))
            new_state, wait_s = step(state)
            self._keys[slot] = stored or key_hash
            self._tokens[slot] = new_state.tokens
            self._updated[slot] = new_state.updated_s
            if (stored or key_hash) == key_hash:
                self._slots[key_hash] = slot
            return wait_s

    def take(self, key: str, cost: float, rate_per_s: float, burst: float, now_s: float) -> float:
        return self._update(key, lambda state: take(state, cost, rate_per_s, burst, now_s))

    def charge(self, key: str, cost: float, rate_per_s: float, burst: float, now_s: float) -> None:
        self._update(key, lambda state: (charge(state, cost, rate_per_s, burst, now_s), 0.0))

    def close(self) -> None:
        del self._keys, self._tokens, self._updated  # views of the map: dropped before it closes
        self.table.close()


def admit(policy: TenantPolicy, buckets: LocalBuckets | SharedBuckets, tenant: str, now_s: float) -> QuotaDecision:
    """One request of `tenant`: within its tier's requests/s quota or not."""
    tier = policy.tier_of(tenant)
    if tier.requests_per_s <= 0:
        return QuotaDecision(True, 0.0, tier)
    wait_s = buckets.take(f"req:{tenant}", 1.0, tier.requests_per_s, tier.burst, now_s)
    return QuotaDecision(wait_s == 0.0, wait_s, tier)


def token_cost(tier: TierPolicy, max_tokens: int) -> float:
    """What an LLM request reserves: its `max_tokens`, at most the burst (a request larger
    than the burst would never fit; it takes the whole bucket instead)."""
    return float(min(max_tokens, tier.llm_token_burst))


def admit_tokens(policy: TenantPolicy, buckets: LocalBuckets | SharedBuckets, tenant: str, max_tokens: int,
                 now_s: float) -> QuotaDecision:
    """An LLM request of `tenant` reserves `token_cost` generated tokens from its bucket; what it
    does not generate is given back by `refund_tokens` when it finishes."""
    tier = policy.tier_of(tenant)
    if tier.llm_tokens_per_s <= 0:
        return QuotaDecision(True, 0.0, tier, "generated tokens", 0.0)
    cost = token_cost(tier, max_tokens)
    wait_s = buckets.take(f"tok:{tenant}", cost, tier.llm_tokens_per_s, tier.llm_token_burst, now_s)
    return QuotaDecision(wait_s == 0.0, wait_s, tier, "generated tokens", cost)


def refund_tokens(policy: TenantPolicy, buckets: LocalBuckets | SharedBuckets, tenant: str, reserved: float,
                  generated: int, now_s: float) -> None:
    """Give back the part of a reservation the request did not generate (never more than the bucket holds)."""
    tier = policy.tier_of(tenant)
    unused = reserved - min(float(generated), reserved)
    if tier.llm_tokens_per_s > 0 and unused > 0:
        buckets.charge(f"tok:{tenant}", -unused, tier.llm_tokens_per_s, tier.llm_token_burst, now_s)


def parse_tenant_claim(params: Mapping[str, object]) -> str | None:
    """The tenant a request names (`tenant` parameter, or a `tenant` header the server forwards
    under the header's own spelling), or None when it names none. ValueError says what is
    wrong with a bad one. A claim only: with tenant authentication on, a token must prove it."""
    names = [key for key in params if key.lower() == "tenant"]
    if not names:
        return None
    tenant = params[names[0]]
    if not isinstance(tenant, str) or not tenant or len(tenant) > MAX_TENANT_LEN:
        raise ValueError(f"parameter 'tenant' must be a non-empty string of at most {MAX_TENANT_LEN} chars")
    if not TENANT_PATTERN.fullmatch(tenant):  # ASCII only: str.isalnum() would let any script's letters in
        raise ValueError("parameter 'tenant' may contain only letters, digits, '-', '_' and '.'")
    return tenant


def parse_tenant(params: Mapping[str, object]) -> str:
    """The tenant a request names, trusted as sent (tenant authentication off); `default` when it names none."""
    return parse_tenant_claim(params) or "default"
