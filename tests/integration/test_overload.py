"""Overload, tenant isolation and crash recovery against the real server: the short form of
`python -m tools bench overload` (its own tritonserver, explicit mode, supervisor on).

Load figures on a shared 2-core machine move between runs, so the latency assertions leave
room (the benchmark's figures are in docs/benchmarks.md); the counts of lost, failed and unserved
requests are exact.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import REPO

SLOW_MACHINE_GOODPUT_RPS = 96.0  # bench goodput's slo_bucketed on 2 vCPU, 2026-11-22 (the slower day)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("overload") / "overload.json"
    subprocess.run([sys.executable, "-m", "tools", "build-models"], cwd=REPO, check=True)
    # A fixed flood, not 3x whatever results/goodput.json holds: that file is written on
    # whichever machine last ran the benchmark, and the same 2 vCPU have measured 96 req/s
    # on one day and 160 on another. 3 x 96 is 3x goodput on the slow kind of machine CI
    # may get, and still well past goodput on the fast kind.
    run = subprocess.run([sys.executable, "-m", "tools", "bench", "overload", "--quick", "--goodput-rps",
                          str(SLOW_MACHINE_GOODPUT_RPS), "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text())


def test_at_three_times_goodput_every_request_is_answered_and_the_admitted_ones_stay_near_the_slo(report):
    overload = report["overload"]
    assert overload["offered_rps"] == pytest.approx(3 * overload["goodput_rps"])
    assert overload["lost"] == 0 and overload["failed_other"] == 0, overload["error_samples"]
    assert overload["ok"] + overload["rejected"] == overload["offered"]
    assert overload["rejected"] > 0  # turned away, not queued
    assert overload["ok"] >= overload["goodput_rps"] * overload["duration_s"] * 0.5  # still serving at volume
    assert overload["admitted_p95_ms"] <= 1.5 * overload["slo_ms"], overload  # unbounded queues give seconds
    assert overload["server_ready_after"] and report["server_healthy_at_end"]
    # Where the admitted requests' time went, and whose CPU the phase was.
    parts = overload["wait_breakdown"]
    assert parts["router_queue_ms"] is not None and parts["router_ms"] > 0 and parts["buckets"], parts
    assert parts["unseen_ms"] == pytest.approx(parts["client_mean_ms"] - parts["router_queue_ms"] - parts["router_ms"],
                                               abs=0.1)
    assert 0 < overload["cpu"]["load_generator_share"] < 1 and 0 < overload["cpu"]["server_share"] <= 1
    assert overload["cpu"]["load_generator_within_bound"] == (
        overload["cpu"]["load_generator_share"] <= overload["cpu"]["load_generator_max_share"])


def test_at_ten_times_goodput_every_request_is_still_answered_and_most_are_turned_away(report):
    flood = report["overload_10x"]
    assert flood["offered_rps"] == pytest.approx(10 * flood["goodput_rps"])
    assert flood["lost"] == 0 and flood["failed_other"] == 0, flood["error_samples"]
    assert flood["ok"] + flood["rejected"] == flood["offered"]
    assert flood["rejected"] > flood["ok"]
    assert flood["server_ready_after"] and "load_generator_share" in flood["cpu"]


def test_a_request_stamped_as_already_late_is_refused_retryably_and_cheaply(report):
    refusals = report["refusals"]
    assert refusals["rejected"] == refusals["offered"] > 0  # X-Request-Start reached the router through Triton
    assert refusals["lost"] == 0 and refusals["failed_other"] == 0
    assert any("too long to meet the latency SLO; retry after" in sample for sample in refusals["error_samples"])
    assert refusals["server_cpu_ms_per_refusal"] is not None and refusals["server_cpu_ms_per_refusal"] >= 0


def test_a_flooding_tenant_is_turned_away_while_the_premium_tenant_is_never_rejected(report):
    b, a = report["isolation"]["b"], report["isolation"]["a"]
    slo_ms = report["isolation"]["slo_ms"]
    assert b["rejected_with_flood"] == 0, b["with_flood"]["error_samples"]
    assert b["p95_ms_with_flood"] <= slo_ms
    assert a["rejected"] > a["ok"] and a["rejected_over_quota"] > 0
    assert a["ok"] + a["rejected"] == a["summary"]["offered"]


def test_a_killed_instance_is_reloaded_and_retrying_clients_see_no_failure(report):
    crash = report["crash"]
    for phase in ("without_retries", "with_retries"):
        assert crash[phase]["supervisor"]["ok"], crash[phase]["supervisor"]
        assert crash[phase]["seconds_to_recover"] < 20
        assert crash[phase]["lost"] == 0 and crash[phase]["failed_other"] == 0, crash[phase]["error_samples"]
    assert crash["without_retries"]["failed_by_crash"] > 0  # the kill really hit requests
    assert crash["with_retries"]["failed"] <= crash["without_retries"]["failed"]
    assert crash["with_retries"]["failed_by_crash"] == 0, crash["with_retries"]["error_samples"]
