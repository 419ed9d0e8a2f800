"""The model kinds a length-bucketed router serves, and the tensors its bucket models take.

Every text model the kit serves has the same shape: a router model (named by the spec's
table) tokenizes each row and sends it to the bucket model of the smallest length that fits
(`<prefix><length>`), which runs the user's ONNX graph on a batch of one shape. What differs
by kind is what a row is and what comes back:

- `text-encoder`: a row is one text; the bucket answers one vector per row (`EMBEDDING`),
  pooled from the graph's per-token output when the graph does not pool itself.
- `text-classifier`: a row is one text or a text pair (cross-encoder rerankers); the bucket
  answers the graph's logits per row (`LOGITS`), and the router adds the label names
  (`LABEL`) when the spec gives them.
- `tensor`: any graph with a dynamic batch axis; a row is the graph's own input tensors, padded
  along one declared variable axis (an audio length, an image width) to the bucket's length,
  or passed as they are into one bucket model when the model has no such axis
  (`python_backends.tensor`).
- `external`: a model of the user's own Triton repository, on any backend; the tensor router
  checks its declared tensors and sends them to it as its one bucket model.

The bucket models' tensor names are the kit's own (the spec maps them to the graph's input
names), so the router, the profiler and gen-config agree without reading the graph. Pure.
"""

from __future__ import annotations

import enum

import numpy as np

from python_backends.common.drift import DriftMeasure

INPUT_IDS = "INPUT_IDS"
ATTENTION_MASK = "ATTENTION_MASK"
TOKEN_TYPE_IDS = "TOKEN_TYPE_IDS"


class ModelKind(enum.StrEnum):
    TEXT_ENCODER = "text-encoder"  # text -> one vector per row
    TEXT_CLASSIFIER = "text-classifier"  # text or text pair -> logits (and a label) per row
    TENSOR = "tensor"  # the graph's own tensors in and out, bucketed along one variable axis
    EXTERNAL = "external"  # a model of the user's own Triton repository: its config's tensors in and out

    @classmethod
    def parse(cls, name: str) -> ModelKind:
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"unknown model kind {name!r}; one of: {', '.join(k.value for k in cls)}") from None

    @property
    def is_text(self) -> bool:
        return self in (ModelKind.TEXT_ENCODER, ModelKind.TEXT_CLASSIFIER)

    @property
    def output(self) -> str:
        """A text model's bucket (and router) output tensor; a tensor model answers its graph's own."""
        if not self.is_text:
            raise ValueError(f"a {self.value} model answers its own outputs")
        return "EMBEDDING" if self is ModelKind.TEXT_ENCODER else "LOGITS"

    @property
    def drift(self) -> DriftMeasure:
        """How a canary's outputs are compared with the baseline's: cosine of embeddings, top-1
        agreement and largest logit difference of a classifier's logits, the largest absolute
        difference of a tensor or external model's outputs (within its declared tolerance)."""
        return {ModelKind.TEXT_ENCODER: DriftMeasure.COSINE, ModelKind.TEXT_CLASSIFIER: DriftMeasure.TOP1,
                ModelKind.TENSOR: DriftMeasure.ABS_DIFF, ModelKind.EXTERNAL: DriftMeasure.ABS_DIFF}[self]


def bucket_inputs(token_types: bool) -> tuple[str, ...]:
    """The bucket models' input tensors, each INT64 [bucket length]."""
    return (INPUT_IDS, ATTENTION_MASK, TOKEN_TYPE_IDS) if token_types else (INPUT_IDS, ATTENTION_MASK)


def labels_of(logits: np.ndarray, labels: tuple[str, ...]) -> np.ndarray:
    """The label name of each row's largest logit (BYTES [rows, 1]); a single-logit graph (a
    relevance score) has no argmax to name, so it needs no labels."""
    if logits.ndim != 2 or logits.shape[1] != len(labels):
        raise ValueError(f"logits of shape {list(logits.shape)} do not match {len(labels)} label names")
    names = np.array([label.encode("utf-8") for label in labels], dtype=object)
    return names[np.argmax(logits, axis=1)].reshape(-1, 1)
