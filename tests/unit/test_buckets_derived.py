"""Bucket edges derived from a workload's length distribution: the exact optimisation against
brute force, the padded-token and compute objectives, curves interpolated at lengths that were
not profiled, and the line `gen-config --explain` prints."""

from __future__ import annotations

import itertools
import random

import pytest

from tests.unit.test_gen_config import REPO
from tests.unit.test_spec_schema import SPEC, with_changes
from tools.cli import main
from tools.planning.buckets import (
    MAX_SEARCH_EDGE_SETS,
    compare_edges,
    compute_edges,
    compute_row_cost,
    edge_sets,
    explain_line,
    powers_of_two,
    search_edge_sets,
)
from tools.spec.buckets import (
    DEFAULT_BUCKET_COUNT,
    bucket_shares,
    candidate_edges,
    derived_edges,
    expected_cost,
    last_edge,
    optimal_edges,
    padded_length,
)
from tools.spec.profile import LatencyCurve, curve_at_length, load_profile
from tools.spec.serving import parse_spec
from tools.spec.workload import load_workload, parse_workload

POWERS = (16, 32, 64, 128, 256)
EMBED_MIX = load_workload(REPO / "loadtest" / "workloads" / "embed_mix.toml")
# Most texts a few tokens, a large share near 256, none between.
BIMODAL = parse_workload({"name": "bimodal", "lengths": [{"min_tokens": 4, "max_tokens": 12, "weight": 0.7},
                                                         {"min_tokens": 200, "max_tokens": 256, "weight": 0.3}]})
CPU_PROFILE = load_profile(REPO / "profiles" / "cpu.json")
CPU_CURVES = CPU_PROFILE.curves_by_length(f"encoder_{length}" for length in POWERS)


# --- the length distribution ------------------------------------------------------------------


def test_lengths_are_uniform_within_a_band_and_overlapping_bands_add_up():
    workload = parse_workload({"lengths": [{"min_tokens": 3, "max_tokens": 6, "weight": 1},
                                           {"min_tokens": 5, "max_tokens": 6, "weight": 1}]})
    assert workload.length_probabilities() == pytest.approx({3: 0.125, 4: 0.125, 5: 0.375, 6: 0.375})
    assert workload.longest == 6
    probabilities = EMBED_MIX.length_probabilities()
    assert sum(probabilities.values()) == pytest.approx(1.0)
    assert (min(probabilities), max(probabilities)) == (4, 256)
    # The same shares as the workload's own bucket_shares.
    assert bucket_shares(probabilities, POWERS) == pytest.approx(EMBED_MIX.bucket_shares(POWERS))


def test_padded_length_counts_each_row_at_its_bucket_and_truncates_past_the_last():
    probabilities = {3: 0.5, 10: 0.25, 40: 0.25}
    assert padded_length(probabilities, (8, 16)) == pytest.approx(0.5 * 8 + 0.5 * 16)
    assert expected_cost(probabilities, (8, 16), row_cost=lambda edge: edge ** 2) == pytest.approx(32 + 128)
    assert padded_length(EMBED_MIX.length_probabilities(), POWERS) == pytest.approx(44.8)


# --- the optimisation -------------------------------------------------------------------------


def brute_force(probabilities, max_buckets, last, edges_below, row_cost=float):
    """The least cost over every set of at most `max_buckets` edges drawn from `edges_below`,
    ending at `last`."""
    return min(expected_cost(probabilities, (*chosen, last), row_cost)
               for count in range(max_buckets) for chosen in itertools.combinations(edges_below, count))


def random_distribution(rng: random.Random, longest: int) -> dict[int, float]:
    lengths = rng.sample(range(1, longest + 1), rng.randint(1, 12))
    weights = [rng.random() for _ in lengths]
    return {length: weight / sum(weights) for length, weight in sorted(zip(lengths, weights, strict=True))}


@pytest.mark.parametrize("seed", range(12))
def test_the_edges_are_the_exact_optimum_of_every_set_of_edges(seed):
    rng = random.Random(seed)
    probabilities = random_distribution(rng, 64)
    align, max_buckets = rng.choice((1, 4, 8)), rng.randint(1, 4)
    last = last_edge(max(probabilities), align)
    edges = optimal_edges(probabilities, max_buckets, last, align)
    # Against every edge on the alignment, not only the candidates the optimisation considers.
    aligned = [edge for edge in range(align, last, align)]
    assert padded_length(probabilities, edges) == pytest.approx(brute_force(probabilities, max_buckets, last, aligned))
    assert list(edges) == sorted(set(edges)) and edges[-1] == last and len(edges) <= max_buckets
    assert all(edge % align == 0 for edge in edges)
    assert all(share > 0 for share in bucket_shares(probabilities, edges).values())  # no bucket without rows


@pytest.mark.parametrize("seed", range(6))
def test_any_row_cost_is_minimised_exactly_over_the_candidates(seed):
    rng = random.Random(100 + seed)
    probabilities = random_distribution(rng, 48)
    last = last_edge(max(probabilities), 4)
    noisy = {edge: rng.uniform(0.5, 2.0) * edge for edge in range(1, last + 1)}  # not monotone in the edge
    edges = optimal_edges(probabilities, 3, last, 4, row_cost=noisy.__getitem__)
    best = brute_force(probabilities, 3, last, candidate_edges(probabilities, last, 4)[:-1], noisy.__getitem__)
    assert expected_cost(probabilities, edges, noisy.__getitem__) == pytest.approx(best)


def test_fewer_edges_come_back_when_the_lengths_allow_fewer():
    probabilities = {5: 0.5, 12: 0.5}
    assert optimal_edges(probabilities, 5, last=16) == (8, 16)
    assert optimal_edges(probabilities, 1, last=16) == (16,)
    assert optimal_edges({3: 1.0}, 4, last=8) == (8,)


def test_the_last_edge_is_the_longest_length_on_the_alignment_capped_by_max_length():
    assert last_edge(250) == 256 and last_edge(256) == 256 and last_edge(250, align=1) == 250
    assert last_edge(250, max_length=100) == 100
    edges = derived_edges(EMBED_MIX, 3, max_length=100)
    assert edges[-1] == 100  # rows past it are truncated into it
    assert bucket_shares(EMBED_MIX.length_probabilities(), edges)[100] == pytest.approx(1 - EMBED_MIX.share_at_most(
        edges[-2]))


@pytest.mark.parametrize(("call", "message"), [
    (lambda: optimal_edges({4: 1.0}, 0, 8), "needs at least one bucket, got 0"),
    (lambda: optimal_edges({}, 2, 8), "needs a length distribution"),
    (lambda: last_edge(0), "needs longest >= 1 and align >= 1, got 0 and 8"),
    (lambda: last_edge(10, align=0), "needs longest >= 1 and align >= 1"),
])
def test_impossible_derivations_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_on_embed_mix_the_powers_of_two_are_the_optimum_and_on_a_bimodal_mix_they_pad_10_percent_more():
    # embed_mix's bands end on powers of two, so they are its best five edges too.
    assert derived_edges(EMBED_MIX) == POWERS and DEFAULT_BUCKET_COUNT == 5
    bimodal = BIMODAL.length_probabilities()
    derived = derived_edges(BIMODAL)
    assert derived == (8, 16, 216, 232, 256)
    assert padded_length(bimodal, POWERS) == pytest.approx(88.0)
    assert padded_length(bimodal, derived) == pytest.approx(79.29, abs=0.01)


# --- curves at lengths that were not profiled ---------------------------------------------------


def test_a_curve_between_two_measured_lengths_is_linear_in_length_per_batch_size_both_measured():
    at_24 = curve_at_length(CPU_CURVES, 24)  # halfway between encoder_16 and encoder_32
    assert at_24.compute_ms[1] == pytest.approx((6.673 + 11.029) / 2)
    assert at_24.compute_ms[16] == pytest.approx((69.728 + 134.547) / 2)
    assert at_24.sizes == [1, 2, 4, 8, 16]  # encoder_32 measured no batch of 32
    at_160 = curve_at_length(CPU_CURVES, 160)  # a quarter of the way from 128 to 256
    assert at_160.compute_ms == pytest.approx({1: 37.054 + (77.776 - 37.054) / 4, 2: 72.958 + (156.391 - 72.958) / 4})
    assert curve_at_length(CPU_CURVES, 64) is CPU_CURVES[64]


def test_a_curve_past_the_longest_scales_with_length_and_below_the_shortest_is_the_shortests():
    assert curve_at_length(CPU_CURVES, 512).compute_ms == pytest.approx({1: 2 * 77.776, 2: 2 * 156.391})
    assert curve_at_length(CPU_CURVES, 8) is CPU_CURVES[16]


def test_an_estimate_is_never_below_the_shortest_measured_times():
    noisy = {16: LatencyCurve({1: 10.0, 2: 18.0}), 32: LatencyCurve({1: 8.0, 2: 20.0})}  # 32 measured faster
    assert curve_at_length(noisy, 24).compute_ms == {1: 10.0, 2: 19.0}


def test_interpolation_needs_measured_lengths():
    with pytest.raises(ValueError, match="needs curves at lengths >= 1"):
        curve_at_length({}, 16)
    with pytest.raises(ValueError, match="needs curves at lengths >= 1"):
        curve_at_length({0: LatencyCurve({1: 1.0})}, 16)
    assert CPU_PROFILE.curves_by_length(["encoder_16", "not_measured"]) == {16: CPU_CURVES[16]}


# --- the objective by compute ---------------------------------------------------------------------


def test_a_rows_compute_is_the_curves_per_row_time_at_its_bucket():
    per_row_at_1 = compute_row_cost(CPU_CURVES)
    assert per_row_at_1(16) == pytest.approx(6.673) and per_row_at_1(24) == pytest.approx((6.673 + 11.029) / 2)
    per_row_at_8 = compute_row_cost(CPU_CURVES, batch_size=8)
    assert per_row_at_8(64) == pytest.approx(134.201 / 8)
    assert per_row_at_8(256) == pytest.approx(156.391 / 2)  # encoder_256 measured batches of 2 at most
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        compute_row_cost(CPU_CURVES, batch_size=0)


def test_edges_by_compute_are_the_optimum_of_compute_and_pad_no_less_than_by_tokens():
    probabilities = EMBED_MIX.length_probabilities()
    by_compute = compute_edges(probabilities, 3, 256, CPU_CURVES)
    by_tokens = optimal_edges(probabilities, 3, 256)
    cost = compute_row_cost(CPU_CURVES)
    assert expected_cost(probabilities, by_compute, cost) <= expected_cost(probabilities, by_tokens, cost) + 1e-9
    assert padded_length(probabilities, by_compute) >= padded_length(probabilities, by_tokens) - 1e-9
    assert by_compute[-1] == 256 and len(by_compute) == 3


def test_a_search_gets_one_edge_set_per_bucket_count_that_changes_them():
    sets = edge_sets(parse_workload({"lengths": [{"min_tokens": 3, "max_tokens": 20, "weight": 1}]}), [1, 2, 3, 4])
    assert sets == {1: (24,), 2: (16, 24), 3: (8, 16, 24)}  # a fourth bucket has no lengths to split
    assert edge_sets(EMBED_MIX, [5])[5] == POWERS


def test_a_search_tries_other_edges_ending_where_the_models_own_end():
    sets = search_edge_sets(EMBED_MIX, POWERS, CPU_CURVES)
    probabilities = EMBED_MIX.length_probabilities()
    assert POWERS not in sets and len(sets) == len(set(sets)) <= MAX_SEARCH_EDGE_SETS
    assert all(edges[-1] == 256 for edges in sets)
    # embed_mix: with 5 buckets both the fewest padded tokens and the least compute at full
    # batches are its own powers of two, so what is left is a bucket fewer and one more.
    assert compute_edges(probabilities, 5, 256, CPU_CURVES, batch_size=32) == POWERS
    assert sets == [optimal_edges(probabilities, 4, 256), optimal_edges(probabilities, 6, 256)]
    assert sets == [(24, 64, 128, 256), (8, 16, 32, 64, 128, 256)]  # as docs/tuning.md says
    bimodal = search_edge_sets(BIMODAL, POWERS, CPU_CURVES)
    assert bimodal[0] == derived_edges(BIMODAL, 5) and POWERS not in bimodal and len(bimodal) == MAX_SEARCH_EDGE_SETS
    assert bimodal[1] == compute_edges(BIMODAL.length_probabilities(), 5, 256, CPU_CURVES, batch_size=32)
    assert search_edge_sets(EMBED_MIX, (16, 64, 128), CPU_CURVES, limit=1)[0][-1] == 128  # capped at its last
    with pytest.raises(ValueError, match="no bucket edges"):
        search_edge_sets(EMBED_MIX, (), CPU_CURVES)


# --- the explanation ------------------------------------------------------------------------------


def test_a_listed_models_edges_are_compared_with_those_derived_for_its_workload():
    spec = parse_spec(with_changes(models__embed__buckets=[16, 64, 256], models__embed__workload=str(
        REPO / "loadtest" / "workloads" / "embed_mix.toml")), SPEC)
    line = explain_line(compare_edges(spec.models[0], EMBED_MIX))
    assert line == ("embed: edges 16,64,256: 63.0 padded tokens/row, rows 50/38/12%; derived for embed_mix "
                    "(3 buckets) 32,104,256: 60.6 padded tokens/row, rows 75/18/7%"), line


def test_a_derived_models_edges_are_compared_with_powers_of_two(tmp_path):
    workload = tmp_path / "bimodal.toml"
    workload.write_text('name = "bimodal"\n[[lengths]]\nmin_tokens = 4\nmax_tokens = 12\nweight = 0.7\n'
                        "[[lengths]]\nmin_tokens = 200\nmax_tokens = 256\nweight = 0.3\n")
    spec = parse_spec(with_changes(models__embed__buckets="derived", models__embed__workload=str(workload)), SPEC)
    model = spec.models[0]
    assert model.bucket_lens == (8, 16, 216, 232, 256) and model.bucket_count == 5
    assert explain_line(compare_edges(model, BIMODAL)) == (
        "embed: edges derived for bimodal (5 buckets) 8,16,216,232,256: 79.3 padded tokens/row, rows 39/31/9/8/13%; "
        "powers of two 16,32,64,128,256: 88.0 padded tokens/row, rows 70/0/0/0/30%")
    assert powers_of_two(256) == POWERS and powers_of_two(100) == (16, 32, 64, 100) and powers_of_two(8) == (8,)


def test_gen_config_explain_prints_the_edges_of_every_bucketed_model(capsys):
    assert main(["gen-config", "--explain"]) == 0
    out = capsys.readouterr().out
    assert ("bucket edges (each model's workload; rows: share per bucket)\n  embed: edges derived for embed_mix "
            "(5 buckets) 16,32,64,128,256: 44.8 padded tokens/row, rows 50/25/13/8/4%; powers of two "
            "16,32,64,128,256: 44.8 padded tokens/row, rows 50/25/13/8/4%") in out
