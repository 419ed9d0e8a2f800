"""From a graph's per-token output to one vector per row: pooling and L2 normalisation.

A sentence encoder exported as is (Hugging Face `last_hidden_state`, shape [rows, tokens,
width]) leaves the pooling to whoever serves it; the model card says which: the mask-weighted
mean over real tokens (sentence-transformers' usual), the first token (`cls`, BERT-style
classifiers and BGE), or the last real token (`last`, decoder-based embedders whose padding
may sit on either side). A graph that already pools gives [rows, width]: `none`.
Pure numpy: arrays in, arrays out.
"""

from __future__ import annotations

import enum

import numpy as np


class Pooling(enum.StrEnum):
    NONE = "none"  # the graph pooled already: [rows, width] passes through
    MEAN = "mean"  # mean over the tokens the attention mask marks as real
    CLS = "cls"  # the first token's vector
    LAST = "last"  # the last real token's vector (by the mask, whichever side is padded)

    @classmethod
    def parse(cls, name: str) -> Pooling:
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"unknown pooling {name!r}; one of: {', '.join(p.value for p in cls)}") from None


def pool(hidden: np.ndarray, attention_mask: np.ndarray, how: Pooling) -> np.ndarray:
    """One float32 vector per row of `hidden` ([rows, tokens, width], or [rows, width] for NONE)."""
    if how is Pooling.NONE:
        if hidden.ndim != 2:
            raise ValueError(f"pooling 'none' needs a pooled output [rows, width], got shape {list(hidden.shape)}")
        return hidden.astype(np.float32, copy=False)
    if hidden.ndim != 3:
        raise ValueError(f"pooling {how.value!r} needs a per-token output [rows, tokens, width], "
                         f"got shape {list(hidden.shape)}")
    if attention_mask.shape != hidden.shape[:2]:
        raise ValueError(f"attention mask {list(attention_mask.shape)} does not match the output's "
                         f"rows and tokens {list(hidden.shape[:2])}")
    # A row whose mask is all zeros (only a warm-up batch sends one) pools as sentence-transformers
    # pools it: the mean's divisor is clamped (a zero vector), `last` takes the last position.
    mask = attention_mask.astype(bool)
    if how is Pooling.CLS:
        return hidden[:, 0, :].astype(np.float32)
    if how is Pooling.LAST:
        num_tokens = mask.shape[1]
        last = num_tokens - 1 - np.argmax(mask[:, ::-1], axis=1)  # index of each row's last real token
        return hidden[np.arange(hidden.shape[0]), last, :].astype(np.float32)
    weights = mask.astype(np.float32)[:, :, None]
    return ((hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)).astype(np.float32)


def l2_normalise(vectors: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """Each row scaled to unit length (a zero row stays zero), as torch's F.normalize does."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, eps)).astype(np.float32)


def pad_axis(array: np.ndarray, axis: int, length: int, pad_value: float | int) -> np.ndarray:
    """`array` padded with `pad_value` at the end of `axis` to `length` (a variable axis of a
    tensor model, bucketed as token length is: an audio length, an image width)."""
    have = array.shape[axis]
    if have > length:
        raise ValueError(f"axis {axis} has length {have}, over the bucket's {length}")
    if have == length:
        return array
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, length - have)
    return np.pad(array, widths, mode="constant", constant_values=pad_value)
