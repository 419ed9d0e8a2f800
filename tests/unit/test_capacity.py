"""capacity: replicas from demand, batch latency and batch size; the formula shown with its numbers."""

import argparse
import json

import pytest

from tools.cli import capacity
from tools.planning.capacity import Demand, best, candidates, plan
from tools.spec.profile import LatencyCurve


def test_replicas_follow_the_formula_and_round_up():
    # R = 600,000 / 60 = 10,000 rows/s; T = 2 x 32 / 0.012 s = 5,333.3 rows/s; 10,000 / (5,333.3 x 0.7) = 2.68
    result = plan(Demand(600_000), batch=32, latency_ms=12.0, instances=2)
    assert result.rows_per_s_per_replica == pytest.approx(5333.33, rel=1e-4)
    assert result.replicas == 3
    assert result.utilization_at_replicas == pytest.approx(10_000 / (3 * 5333.33), rel=1e-4)
    assert result.formula(Demand(600_000)) == (
        "replicas = ceil(R / (T x u)) = ceil(10,000.0 rows/s / (2 x 32 rows / 0.0120 s x 0.70)) = ceil(2.68) = 3")


def test_an_exact_fit_does_not_round_up_and_a_tiny_demand_needs_one():
    # T x u = 1 x 10 / 0.01 x 0.5 = 500 rows/s: exactly 1,000 rows/s needs 2.
    assert plan(Demand(60_000, utilization=0.5), batch=10, latency_ms=10.0).replicas == 2
    assert plan(Demand(1), batch=1, latency_ms=10.0).replicas == 1


def test_headroom_and_rows_per_request_raise_the_count():
    loose = plan(Demand(600_000, utilization=1.0), batch=32, latency_ms=12.0, instances=2)
    tight = plan(Demand(600_000, utilization=0.5), batch=32, latency_ms=12.0, instances=2)
    wide = plan(Demand(600_000, rows_per_request=4, utilization=1.0), batch=32, latency_ms=12.0, instances=2)
    assert (loose.replicas, tight.replicas, wide.replicas) == (2, 4, 8)


def test_cost_per_million_requests():
    result = plan(Demand(600_000), batch=32, latency_ms=12.0, instances=2, gpu_hour_usd=3.0)
    # 3 replicas x $3/h over 36M requests per hour
    assert result.cost_per_million_usd == pytest.approx(3 * 3.0 / 36_000_000 * 1e6)


def test_a_batch_too_slow_for_the_slo_is_refused_with_the_batch_time_that_fits():
    with pytest.raises(ValueError, match=r"batch 64 cannot meet the SLO: o \+ 2 x X = 5.0 \+ 2 x 120.0 = 245.0 ms "
                                         r"> 200 ms.*at most 97.5 ms"):
        plan(Demand(6000, slo_p95_ms=200.0, overhead_ms=5.0), batch=64, latency_ms=120.0)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(requests_per_min=0), "requests per minute must be > 0, got 0"),
    (dict(requests_per_min=10, utilization=1.5), r"utilization must be in \(0, 1\], got 1.5"),
    (dict(requests_per_min=10, rows_per_request=0), "rows per request must be > 0"),
    (dict(requests_per_min=10, slo_p95_ms=-1), "the SLO must be > 0 ms"),
])
def test_bad_demand_names_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Demand(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(batch=0, latency_ms=1.0), "batch size must be >= 1"),
    (dict(batch=1, latency_ms=0.0), "batch latency must be > 0 ms"),
    (dict(batch=1, latency_ms=1.0, instances=0), "instances per replica must be >= 1"),
])
def test_bad_plan_inputs_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan(Demand(10), **kwargs)


CURVE = LatencyCurve({1: 10.0, 2: 12.0, 4: 16.0, 8: 40.0, 16: 120.0})


def test_the_best_batch_needs_fewest_replicas_and_ties_go_to_the_smaller_batch():
    table = candidates(Demand(30_000, slo_p95_ms=200.0, overhead_ms=5.0), CURVE)
    refused = [entry for entry in table if isinstance(entry, str)]
    assert refused and refused[0].startswith("batch 16 cannot meet the SLO")  # 5 + 2 x 120 > 200
    chosen = best(table)
    # 500 rows/s: batch 4 gives 250 rows/s -> ceil(500 / 175) = 3; batch 8 gives 200 -> 4; batch 2: 166.7 -> 5
    assert (chosen.batch, chosen.replicas) == (4, 3)


def test_no_usable_batch_is_an_error():
    with pytest.raises(ValueError, match="no measured batch size meets the SLO"):
        best(candidates(Demand(100, slo_p95_ms=15.0), CURVE))


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    capacity.add_arguments(parser)
    return capacity.run(parser.parse_args(list(argv)))


def test_cli_prints_the_formula_with_its_numbers(capsys):
    assert run_cli("--rpm", "600000", "--latency-ms", "12", "--batch", "32", "--instances", "2",
                   "--gpu-hour-cost", "3") == 0
    out = capsys.readouterr().out
    assert "R = 10,000.0 rows/s" in out
    assert "T = instances x Y / X = 2 x 32 rows / 12.0 ms = 5,333.3 rows/s" in out
    assert "= ceil(2.68) = 3" in out
    assert "$0.25 per million requests" in out


def test_cli_with_the_committed_profile_picks_a_batch_and_shows_the_table(capsys):
    assert run_cli("--rpm", "6000", "--profile", "profiles/cpu.json", "--model", "encoder_64", "--json") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["plan"]["replicas"] >= 1
    assert result["demand"]["slo_p95_ms"] == 200.0  # from serving.toml
    sizes = [c["batch"] for c in result["candidates"] if isinstance(c, dict)]
    assert result["plan"]["batch"] in sizes


def test_cli_errors_are_messages_not_tracebacks(capsys):
    assert run_cli("--rpm", "10") == 2
    assert "give --latency-ms and --batch" in capsys.readouterr().err
    assert run_cli("--rpm", "10", "--profile", "profiles/cpu.json", "--model", "encoder_64", "--batch", "512") == 1
    assert "batch 512 was not measured" in capsys.readouterr().err
    assert run_cli("--rpm", "10", "--profile", "profiles/cpu.json") == 1
    assert "--profile needs --model" in capsys.readouterr().err
    assert run_cli("--rpm", "-5", "--latency-ms", "1", "--batch", "1") == 1
    assert "requests per minute must be > 0" in capsys.readouterr().err


def test_cli_replay_plans_at_the_recorded_batches_and_at_the_preferred_size(capsys):
    recording = "tests/data/metrics/steady.jsonl.gz"
    assert run_cli("--replay", recording, "--model", "encoder_16", "--rpm", "30000") == 0
    out = capsys.readouterr().out
    assert "encoder_16 in tests/data/metrics/steady.jsonl.gz" in out and "as the recording shows them" in out
    assert "at the preferred batch of 4" in out
    assert run_cli("--replay", recording, "--model", "encoder_16", "--json") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["as_formed"]["replicas"] == 1  # the rate it carried fits the replica that carried it
    assert run_cli("--replay", recording) == 1
    assert "--replay needs --model" in capsys.readouterr().err
    assert run_cli("--replay", recording, "--model", "llm") == 1
    assert "shows no traffic at llm" in capsys.readouterr().err
