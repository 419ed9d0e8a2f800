"""What the load tests send a served model, and which model of the serving spec a name means.

`find_model` looks a model of the spec's [models] up by name (`ModelLookupError` lists them).
`model_payload` makes a model's requests from a workload's length mix:

- a text model's texts (`model_texts`), written with the model's own tokenizer: single texts,
  or, for a model that takes text pairs (a cross-encoder reranker), pairs whose row, special
  tokens included, has the length the mix draws, split between a short query and a longer
  passage (`split_pair_tokens`);
- a tensor model's tensors (`model_tensors`; an external model's as its config.pbtxt declares
  them, fixed-shape): each request `rows_per_request` rows of one
  length on the variable axis drawn from the mix (capped at the largest bucket, as gen-config's
  traffic shares cap it), random values of each input's declared type (`tools.bench.inputs`),
  and ones in an input of one value per position (a frame mask: a request's own positions are
  all real; padding is the router's). A fixed-shape model's requests are all alike, so a few
  distinct ones are cycled.

The workload's lengths are what gen-config derived the buckets' traffic from, so the rows land
in the buckets it planned for. `TextFactory` (`tools.spec.workload`) reads the tokenizer and
the corpus, `served_tensors` the ONNX graph, `served_external` the user's config.pbtxt; the
rest is pure.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from python_backends.embed.kinds import ModelKind
from python_backends.tensor.router import TensorSpec
from tools.bench.inputs import make_inputs
from tools.repository.graph import TensorInfo
from tools.repository.sources import TensorGraph, served_external, served_tensors, tokenizer_path
from tools.spec.serving import BucketedModelSpec, ServingSpec
from tools.spec.workload import SPECIAL_TOKENS, TextFactory, Workload

MIN_PAIR_MEMBER_TOKENS = 1  # a pair member keeps at least one token of text
QUERY_SHARE = 4  # a pair's query gets 1/QUERY_SHARE of its text tokens, the passage the rest
# Distinct requests of a fixed-shape model: they differ only in random values, which do not
# change what a request costs, so a few cycled stand for many (a 224x224 image is 600 kB a row).
NUM_FIXED_SHAPE_REQUESTS = 16


class ModelLookupError(ValueError):
    """The serving spec has no model of that name in [models]; the message lists the ones it has."""


def find_model(spec: ServingSpec, name: str) -> BucketedModelSpec:
    """The spec's model called `name` ([models.NAME]: a text encoder, a text classifier or a tensor model)."""
    for model in spec.models:
        if model.name == name:
            return model
    models = ", ".join(model.name for model in spec.models) or "none"
    if any(llm.name == name for llm in spec.llm_models):
        raise ModelLookupError(f"{spec.path}: {name!r} is a generative model ([llm_models.{name}]), not one of "
                               f"[models]; the spec's [models]: {models} (`bench llm` measures {name!r})")
    raise ModelLookupError(f"{spec.path}: no model {name!r}; the spec's [models]: {models}")


@dataclass(frozen=True)
class TextPayload:
    """The texts of a model's requests, one per row, and their pair partners when it takes pairs."""

    texts: tuple[str, ...]  # the rows' texts (a pair's query)
    pair_texts: tuple[str, ...] = ()  # each row's second text, same index; () = single texts

    def first_rows(self, num_rows: int) -> TextPayload:
        """The payload's first `num_rows` rows (what the ceiling runs)."""
        return TextPayload(self.texts[:num_rows], self.pair_texts[:num_rows])


@dataclass(frozen=True)
class TensorPayload:
    """The requests of a tensor model: each its inputs by name, batch axis first."""

    requests: tuple[Mapping[str, np.ndarray], ...] = field(compare=False)  # cycled in order by the load
    lengths: tuple[int, ...] = ()  # each request's length on the variable axis; () for a fixed-shape model

    @property
    def num_rows(self) -> int:
        return sum(_num_rows(request) for request in self.requests)

    def first_rows(self, num_rows: int) -> TensorPayload:
        """Requests from the first on, cycled, until they hold at least `num_rows` rows (at least
        one request): the ceiling's rows, which a fixed-shape model's few requests repeat."""
        if not self.requests:
            raise ValueError("a tensor payload needs at least one request")
        taken: list[int] = []
        rows = 0
        while rows < num_rows or not taken:
            index = len(taken) % len(self.requests)
            taken.append(index)
            rows += _num_rows(self.requests[index])
        return TensorPayload(tuple(self.requests[i] for i in taken),
                             tuple(self.lengths[i] for i in taken) if self.lengths else ())


def _num_rows(request: Mapping[str, np.ndarray]) -> int:
    return int(next(iter(request.values())).shape[0])


def split_pair_tokens(num_tokens: int, num_pair_specials: int) -> tuple[int, int]:
    """(query, passage) text tokens of a pair row of `num_tokens` tokens, the pair's special
    tokens included: a quarter to the query, the rest to the passage (a reranker scores short
    queries against long passages; only the row's total decides its bucket and its cost). A
    row too short for both members gets one token each."""
    text_tokens = max(num_tokens - num_pair_specials, 2 * MIN_PAIR_MEMBER_TOKENS)
    query = max(MIN_PAIR_MEMBER_TOKENS, text_tokens // QUERY_SHARE)
    return query, text_tokens - query


def pair_texts_for(factory: TextFactory, workload: Workload, count: int,
                   seed: int | None = None) -> TextPayload:
    """`count` text pairs whose rows follow the workload's length mix (deterministic)."""
    specials = factory.tokenizer.num_special_tokens_to_add(True)
    rng = random.Random((workload.seed if seed is None else seed) + 1)
    queries, passages = [], []
    for num_tokens in workload.sample_lengths(count, seed):
        query, passage = split_pair_tokens(num_tokens, specials)
        # TextFactory counts a single text's special tokens in its length: ask for them on top.
        queries.append(factory.text(query + SPECIAL_TOKENS, rng))
        passages.append(factory.text(passage + SPECIAL_TOKENS, rng))
    return TextPayload(tuple(queries), tuple(passages))


def texts_for(factory: TextFactory, workload: Workload, count: int, pairs: bool) -> TextPayload:
    """`count` rows from the workload's mix: text pairs when `pairs`, else single texts."""
    if pairs:
        return pair_texts_for(factory, workload, count)
    return TextPayload(tuple(factory.texts_for(workload, count)))


def model_factory(model: BucketedModelSpec | None) -> TextFactory:
    """Texts counted in the model's tokens (`tools.repository.sources.tokenizer_path`); for a
    model the spec does not have, in the built-in MiniLM tokenizer's."""
    return TextFactory(tokenizer_path(model) if model is not None else None)


def model_texts(model: BucketedModelSpec, workload: Workload, count: int) -> TextPayload:
    """`count` rows for `model` from the workload's mix: pairs for a model that takes them."""
    return texts_for(model_factory(model), workload, count, model.pairs)



def request_lengths(workload: Workload, count: int, max_length: int, seed: int | None = None) -> list[int]:
    """`count` lengths on a tensor model's variable axis from the workload's mix (its token
    counts read as positions), each capped at the largest bucket `max_length`: a longer one is
    counted into the largest bucket by gen-config's traffic shares, and the router refuses
    what no bucket holds."""
    return [min(length, max_length) for length in workload.sample_lengths(count, seed)]


def is_position_input(spec: TensorSpec, axis: int | None) -> bool:
    """Whether an input holds one value per position of the variable axis and nothing else (a
    frame mask, a position marker): it gets ones, every position of a request being real."""
    return spec.has_axis(axis) and len(spec.dims) == 1


def tensor_request(inputs: Sequence[TensorSpec], axis: int | None, num_rows: int, length: int | None,
                   rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One request of `num_rows` rows, `length` positions on the variable axis `axis` (None for a
    fixed-shape model): random values of each input's type (`make_inputs`), ones in position inputs."""
    infos = [TensorInfo(spec.name, mc.DataType.Value(spec.data_type),
                        (None, *(None if size == -1 else size for size in spec.dims))) for spec in inputs]
    sizes = {axis + 1: length} if axis is not None and length is not None else None
    request = make_inputs(infos, num_rows, axis_sizes=sizes, seed=rng)
    for spec in inputs:
        if is_position_input(spec, axis):
            request[spec.name] = np.ones_like(request[spec.name])
    return request


def tensors_for(tensors: TensorGraph, model: BucketedModelSpec, workload: Workload | None,
                num_rows: int) -> TensorPayload:
    """Requests of about `num_rows` rows in all, `rows_per_request` each (1 without a workload),
    of lengths from the workload's mix; a fixed-shape model's NUM_FIXED_SHAPE_REQUESTS at most
    (deterministic: seeded by the workload)."""
    rows = workload.rows_per_request if workload is not None else 1
    count = max(1, num_rows // rows)
    rng = np.random.default_rng(workload.seed if workload is not None else 0)
    axis = model.variable_axis
    if axis is None:
        return TensorPayload(tuple(tensor_request(tensors.inputs, None, rows, None, rng)
                                   for _ in range(min(count, NUM_FIXED_SHAPE_REQUESTS))))
    if workload is None:
        raise ValueError(f"[models.{model.name}] is bucketed by its variable axis {axis}: its requests need a "
                         "workload of lengths")
    lengths = request_lengths(workload, count, model.bucket_lens[-1])
    return TensorPayload(tuple(tensor_request(tensors.inputs, axis, rows, length, rng) for length in lengths),
                         tuple(lengths))


def model_tensors(model: BucketedModelSpec, workload: Workload | None, num_rows: int) -> TensorPayload:
    """A tensor model's requests, its inputs read from its graph (`served_tensors`), or an
    external model's from its config.pbtxt (`served_external`); SourceError when they do not
    fit the spec."""
    tensors = served_external(model).tensors if model.kind is ModelKind.EXTERNAL else served_tensors(model)
    return tensors_for(tensors, model, workload, num_rows)


def model_payload(model: BucketedModelSpec, workload: Workload | None, num_rows: int) -> TextPayload | TensorPayload:
    """What the load sends `model`, about `num_rows` rows: texts (or pairs) for a text model,
    tensors for a tensor or an external model."""
    if model.kind.is_text:
        if workload is None:
            raise ValueError(f"[models.{model.name}]: a text model's texts need a workload of lengths")
        return model_texts(model, workload, num_rows)
    return model_tensors(model, workload, num_rows)
