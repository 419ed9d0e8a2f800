"""What the load tests send a served text model, and which model of the serving spec a name means.

`find_model` looks a bucketed text model up by name (`ModelLookupError` lists the spec's
models). `model_texts` writes the texts of a model's requests from a workload's length mix
with the model's own tokenizer: single texts, or, for a model that takes text pairs (a
cross-encoder reranker), pairs whose row, special tokens included, has the length the mix
draws, split between a short query and a longer passage (`split_pair_tokens`). The workload's
lengths are what gen-config derived the buckets' traffic from, so the pairs land in the
buckets it planned for. `TextFactory` (`tools.spec.workload`) reads the tokenizer and the
corpus; the rest is pure.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tools.repository.sources import tokenizer_path
from tools.spec.serving import BucketedModelSpec, ServingSpec
from tools.spec.workload import SPECIAL_TOKENS, TextFactory, Workload

MIN_PAIR_MEMBER_TOKENS = 1  # a pair member keeps at least one token of text
QUERY_SHARE = 4  # a pair's query gets 1/QUERY_SHARE of its text tokens, the passage the rest


class ModelLookupError(ValueError):
    """The serving spec has no text model of that name; the message lists the ones it has."""


def find_model(spec: ServingSpec, name: str) -> BucketedModelSpec:
    """The spec's bucketed text model called `name`."""
    for model in spec.models:
        if model.name == name:
            return model
    text_models = ", ".join(model.name for model in spec.models) or "none"
    if any(llm.name == name for llm in spec.llm_models):
        raise ModelLookupError(f"{spec.path}: {name!r} is a generative model ([llm_models.{name}]), not a text "
                               f"model; the spec's text models: {text_models} (`bench llm` measures {name!r})")
    raise ModelLookupError(f"{spec.path}: no model {name!r}; the spec's text models: {text_models}")


@dataclass(frozen=True)
class TextPayload:
    """The texts of a model's requests, one per row, and their pair partners when it takes pairs."""

    texts: tuple[str, ...]  # the rows' texts (a pair's query)
    pair_texts: tuple[str, ...] = ()  # each row's second text, same index; () = single texts


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

