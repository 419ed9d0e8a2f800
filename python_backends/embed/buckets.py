"""Length bucketing: which bucket a row goes to, how rows are padded, split and put back.

Every bucket is its own Triton model with a fixed sequence length, so only rows padded
to the same length ever share a batch. A row goes to the smallest bucket that holds it:
padding a 16-token row to 256 would make it pay 256-token compute.

All functions here are pure and work on plain Python / numpy data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Chunk:
    """One request to one bucket model: a slice of a client request's rows."""

    bucket_len: int  # sequence length of the bucket model this chunk goes to
    row_indices: tuple[int, ...]  # positions of these rows in the client request, ascending


def validate_buckets(bucket_lens: Sequence[int]) -> tuple[int, ...]:
    """Return the bucket lengths as a sorted tuple; raise ValueError when they are unusable."""
    if not bucket_lens:
        raise ValueError("at least one bucket length is required")
    for length in bucket_lens:
        if not isinstance(length, int) or isinstance(length, bool) or length < 2:
            raise ValueError(f"bucket lengths must be integers >= 2 (room for [CLS] and [SEP]), got {length!r}")
    ordered = tuple(sorted(bucket_lens))
    if len(set(ordered)) != len(ordered):
        raise ValueError(f"bucket lengths must be distinct, got {list(bucket_lens)}")
    return ordered


def choose_bucket(num_tokens: int, bucket_lens: Sequence[int]) -> int:
    """Smallest bucket length that holds `num_tokens`.

    `bucket_lens` must be sorted ascending (see `validate_buckets`). Rows longer than the
    largest bucket must be truncated (or rejected) before this is called.
    """
    if num_tokens < 1:
        raise ValueError(f"a row has at least one token, got {num_tokens}")
    for length in bucket_lens:
        if num_tokens <= length:
            return length
    raise ValueError(f"{num_tokens} tokens do not fit the largest bucket ({bucket_lens[-1]})")


def truncate_tokens(token_ids: Sequence[int], max_tokens: int, num_trailing: int = 1) -> list[int]:
    """Cut an encoded row to `max_tokens`, keeping the `num_trailing` special tokens that close it
    (the tokenizer's `special_layout`: 1 for BERT's [SEP], 0 where nothing closes a text).

    For a single BERT sequence `[CLS] t1 .. tn [SEP]` this gives `[CLS] t1 .. tk [SEP]`,
    exactly what the tokenizer's own truncation produces, without encoding twice.
    """
    if not 0 <= num_trailing < max_tokens:
        raise ValueError(f"max_tokens must leave room for a token besides the {num_trailing} closing "
                         f"special token(s), got max_tokens={max_tokens}")
    if len(token_ids) <= max_tokens:
        return list(token_ids)
    kept = max_tokens - num_trailing
    return [*token_ids[:kept], *token_ids[len(token_ids) - num_trailing:]]


def plan_chunks(
    row_lengths: Sequence[int],
    bucket_lens: Sequence[int],
    max_rows_per_chunk: int | Mapping[int, int],
) -> list[Chunk]:
    """Group a request's rows by bucket, in chunks no larger than each bucket model's batch limit.

    `max_rows_per_chunk` is one limit for all buckets or a limit per bucket length. Chunks
    come out ordered by bucket length, then by row position, so the plan is deterministic.
    Every row index appears in exactly one chunk.
    """
    rows_by_bucket: dict[int, list[int]] = {}
    for index, num_tokens in enumerate(row_lengths):
        rows_by_bucket.setdefault(choose_bucket(num_tokens, bucket_lens), []).append(index)
    chunks: list[Chunk] = []
    for bucket_len in sorted(rows_by_bucket):
        limit = max_rows_per_chunk if isinstance(max_rows_per_chunk, int) else max_rows_per_chunk[bucket_len]
        if limit < 1:
            raise ValueError(f"max_rows_per_chunk must be >= 1, got {limit} for bucket {bucket_len}")
        rows = rows_by_bucket[bucket_len]
        for start in range(0, len(rows), limit):
            chunks.append(Chunk(bucket_len, tuple(rows[start : start + limit])))
    return chunks


def pad_rows(rows: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token rows to `length`; return `(input_ids, attention_mask)`, both int64 [n, length]."""
    input_ids = np.full((len(rows), length), pad_id, dtype=np.int64)
    attention_mask = np.zeros((len(rows), length), dtype=np.int64)
    for i, row in enumerate(rows):
        if len(row) > length:
            raise ValueError(f"row {i} has {len(row)} tokens, more than the bucket length {length}")
        input_ids[i, : len(row)] = row
        attention_mask[i, : len(row)] = 1
    return input_ids, attention_mask


def reassemble(num_rows: int, chunks: Sequence[Chunk], outputs: Sequence[np.ndarray]) -> np.ndarray:
    """Put per-chunk outputs back in the client's row order.

    `outputs[k]` holds one output row per row of `chunks[k]`, in the same order. A request
    served by one chunk in its own order (most are) gets that chunk's output itself, not a copy.
    """
    if len(chunks) != len(outputs):
        raise ValueError(f"{len(chunks)} chunks but {len(outputs)} outputs")
    if not chunks:
        raise ValueError("nothing to reassemble")
    if len(chunks) == 1 and chunks[0].row_indices == tuple(range(num_rows)):
        output = np.asarray(outputs[0])
        if output.shape[0] != num_rows:
            raise ValueError(f"bucket {chunks[0].bucket_len} returned {output.shape[0]} rows for {num_rows}")
        return output
    first = np.asarray(outputs[0])
    result = np.empty((num_rows, *first.shape[1:]), dtype=first.dtype)
    filled = np.zeros(num_rows, dtype=bool)
    for chunk, output in zip(chunks, outputs, strict=False):
        output = np.asarray(output)
        if output.shape[0] != len(chunk.row_indices):
            raise ValueError(
                f"bucket {chunk.bucket_len} returned {output.shape[0]} rows for {len(chunk.row_indices)}"
            )
        index = np.asarray(chunk.row_indices, dtype=np.int64)
        if filled[index].any():
            raise ValueError(f"row assigned twice in bucket {chunk.bucket_len}")
        result[index] = output
        filled[index] = True
    if not filled.all():
        missing = np.flatnonzero(~filled).tolist()
        raise ValueError(f"rows {missing} have no output")
    return result
