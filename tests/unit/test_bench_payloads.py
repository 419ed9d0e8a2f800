"""What the load tests send a text model: the spec's model by name, single texts or text pairs
whose rows follow the workload's length mix."""

import pytest

from tools.bench.payloads import (
    ModelLookupError,
    TextPayload,
    find_model,
    model_factory,
    model_texts,
    pair_texts_for,
    split_pair_tokens,
    texts_for,
)
from tools.spec.serving import load_spec
from tools.spec.workload import TextFactory, load_workload


@pytest.fixture(scope="module")
def factory() -> TextFactory:
    return TextFactory()


def test_a_model_is_found_by_name_and_an_unknown_name_lists_the_specs_models():
    spec = load_spec()
    assert find_model(spec, "embed").name == "embed"
    with pytest.raises(ModelLookupError, match=r"serving.toml: no model 'rerank'; the spec's text models: embed$"):
        find_model(spec, "rerank")
    with pytest.raises(ModelLookupError, match=r"'llm' is a generative model \(\[llm_models.llm\]\), not a text "
                                               r"model; the spec's text models: embed \(`bench llm` measures 'llm'\)"):
        find_model(spec, "llm")


@pytest.mark.parametrize(("num_tokens", "expected"), [
    (103, (25, 75)),  # 100 text tokens: a quarter to the query
    (7, (1, 3)),  # a short row keeps a query token
    (5, (1, 1)),  # one token each, the least a pair holds
    (3, (1, 1)),  # shorter than that: still one each (the row comes out a little longer)
])
def test_a_pair_rows_tokens_are_split_between_a_short_query_and_a_longer_passage(num_tokens, expected):
    assert split_pair_tokens(num_tokens, num_pair_specials=3) == expected


def test_pairs_follow_the_workloads_length_mix_row_for_row(factory):
    workload = load_workload(find_model(load_spec(), "embed").workload)
    pairs = pair_texts_for(factory, workload, 50)
    assert len(pairs.texts) == len(pairs.pair_texts) == 50
    drawn = workload.sample_lengths(50)
    # BERT's [CLS] query [SEP] passage [SEP]: each row as long as the mix drew it.
    assert [len(factory.tokenizer.encode(q, p).ids) for q, p in zip(pairs.texts, pairs.pair_texts, strict=True)] == [
        max(n, 5) for n in drawn]
    assert pair_texts_for(factory, workload, 50) == pairs  # deterministic
    assert pair_texts_for(factory, workload, 50, seed=7) != pairs


def test_single_texts_are_the_workloads_texts_as_before(factory):
    embed = find_model(load_spec(), "embed")
    workload = load_workload(embed.workload)
    singles = texts_for(factory, workload, 30, pairs=False)
    assert singles == TextPayload(tuple(factory.texts_for(workload, 30)))
    assert model_texts(embed, workload, 30) == singles  # embed's own tokenizer is the factory's default
    assert model_factory(None).tokenizer.get_vocab_size() == factory.tokenizer.get_vocab_size()
