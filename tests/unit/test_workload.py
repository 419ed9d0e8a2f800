"""Workload files and exact-length text generation."""

import random

import pytest

from tools.spec.workload import TextFactory, load_workload, parse_workload

BUCKETS = (16, 32, 64, 128, 256)


@pytest.fixture(scope="module")
def factory():
    return TextFactory()


def test_default_mix_is_mostly_short_with_a_tail_to_256():
    workload = load_workload()
    shares = workload.bucket_shares(BUCKETS)
    assert shares[16] == pytest.approx(0.50)
    assert shares[256] == pytest.approx(0.04)
    assert sum(shares.values()) == pytest.approx(1.0)
    lengths = workload.sample_lengths(5000)
    assert 250 <= max(lengths) <= 256 and min(lengths) >= 4
    assert sum(n <= 16 for n in lengths) / len(lengths) == pytest.approx(0.5, abs=0.03)


def test_shares_split_bands_that_straddle_a_bucket_edge():
    workload = parse_workload({"lengths": [{"min_tokens": 9, "max_tokens": 24, "weight": 1}]})
    assert workload.bucket_shares([16, 32]) == pytest.approx({16: 0.5, 32: 0.5})
    # Rows beyond the largest bucket are truncated into it.
    assert workload.bucket_shares([8, 16]) == pytest.approx({8: 0.0, 16: 1.0})


def test_samples_are_reproducible():
    workload = load_workload()
    assert workload.sample_lengths(50) == workload.sample_lengths(50)
    assert workload.sample_lengths(50, seed=1) != workload.sample_lengths(50, seed=2)


def test_texts_have_exactly_the_requested_token_count(factory):
    rng = random.Random(3)
    for num_tokens in (3, 4, 16, 17, 100, 255, 256, 400):
        assert factory.count(factory.text(num_tokens, rng)) == num_tokens


def test_texts_for_follow_the_mix(factory):
    workload = load_workload()
    texts = factory.texts_for(workload, 200)
    assert [factory.count(t) for t in texts] == workload.sample_lengths(200)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "at least one"),
        ({"lengths": [{"min_tokens": 4, "max_tokens": 8}]}, "needs min_tokens, max_tokens, weight"),
        ({"lengths": [{"min_tokens": 2, "max_tokens": 8, "weight": 1}]}, "3 <= min_tokens"),
        ({"lengths": [{"min_tokens": 9, "max_tokens": 8, "weight": 1}]}, "min_tokens <= max_tokens"),
        ({"lengths": [{"min_tokens": 4, "max_tokens": 8, "weight": 0}]}, "weight must be > 0"),
        ({"lengths": [{"min_tokens": 4, "max_tokens": 8, "weight": 1}], "rows_per_request": 0}, "rows_per_request"),
    ],
)
def test_workload_errors(data, message):
    with pytest.raises(ValueError, match=message):
        parse_workload(data, "w.toml")


def test_text_rejects_impossible_length(factory):
    with pytest.raises(ValueError, match="at least 3 tokens"):
        factory.text(2, random.Random(0))
