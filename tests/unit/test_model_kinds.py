"""Model kinds: the spec's text-encoder and text-classifier tables, what their bucket models run
(`sources.served_graph`), and the router's rows of each kind (prefixes, text pairs, labels,
per-kind drift of shadowed rows), through the fake `pb_utils`."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest

from python_backends.common.tokenization import TextTokenizer, longest_first
from python_backends.embed.kinds import ModelKind, labels_of
from python_backends.embed.pooling import Pooling
from python_backends.embed.router import EmbedRouter, RequestOptions, RouterConfig, parse_router_config
from python_backends.embed.routing import RoutingTable, write_routing_table
from tests.fakes.pb_utils import BlsCall, FakeTriton, InferenceResponse, Request, Tensor
from tests.unit.test_embed_service import answer, error_of, serve  # noqa: F401  (the fixture)
from tests.unit.test_gen_config import BASE, REPO
from tests.user_models import cross_encoder_dir, minilm_tokenizer, raw_sentence_encoder_onnx, sentence_encoder_dir
from tools.repository.sources import SourceError, served_graph, tokenizer_path
from tools.spec.serving import SpecError, parse_spec

SPEC = REPO / "serving.toml"
TOKENIZER = TextTokenizer.from_file(minilm_tokenizer())


def spec_with(**table):
    data = copy.deepcopy(BASE)
    data["models"]["embed"].update(table)
    for key in [key for key, value in table.items() if value is None]:
        del data["models"]["embed"][key]
    return parse_spec(data, SPEC)


def spec_error(**table) -> str:
    with pytest.raises(SpecError) as info:
        spec_with(**table)
    return str(info.value)


# --- the spec -----------------------------------------------------------------------------


def test_a_classifier_table_resolves_its_pairs_labels_and_graph_names():
    model = spec_with(kind="text-classifier", source="models/reranker.onnx", tokenizer="models/tokenizer.json",
                      pooling=None, normalize=None, pairs=True, labels=["irrelevant", "relevant"],
                      inputs={"token_types": "token_type_ids"}, output="logits").models[0]
    assert model.kind is ModelKind.TEXT_CLASSIFIER and model.pairs and model.token_types
    assert model.labels == ("irrelevant", "relevant")
    assert model.onnx_inputs == {"INPUT_IDS": "input_ids", "ATTENTION_MASK": "attention_mask",
                                 "TOKEN_TYPE_IDS": "token_type_ids"}
    assert model.sources == {1: "models/reranker.onnx"} and model.tokenizer == REPO / "models/tokenizer.json"
    assert model.encoder_prefix == "embed_"  # the default: the model's own name


def test_a_source_table_gives_each_version_its_own_file():
    model = spec_with(versions=[1, 2], source={"1": "a.onnx", "2": "b.onnx"}).models[0]
    assert model.sources == {1: "a.onnx", 2: "b.onnx"}


@pytest.mark.parametrize(("table", "message"), [
    ({"kind": "image"},
     r"kind must be one of \['text-encoder', 'text-classifier', 'tensor', 'external'\], got 'image'"),
    ({"source": None}, "missing 'source'"),
    ({"source": ""}, "source must name an ONNX file, a Hugging Face folder or package:<module>"),
    ({"source": {"one": "a.onnx"}}, "source: key 'one' is not a version number"),
    ({"versions": [1, 2], "source": {"1": "a.onnx"}}, r"source names no model for version\(s\) \[2\]"),
    ({"labels": ["a", "b"]}, "'labels' applies to kind 'text-classifier' only; this model is 'text-encoder'"),
    ({"kind": "text-classifier", "pooling": "mean", "normalize": None},
     "'pooling' applies to kind 'text-encoder' only; this model is 'text-classifier'"),
    ({"kind": "tensor", "pooling": None, "normalize": None, "max_text_bytes": None, "variable_axis": 0},
     "missing 'tolerance': a tensor model's rollouts compare"),
    ({"kind": "tensor", "pooling": None, "normalize": None, "max_text_bytes": None, "tolerance": 0.01},
     "buckets need a variable_axis: a tensor model without one has a single bucket model"),
    ({"kind": "tensor", "pooling": None, "normalize": None, "max_text_bytes": None, "tolerance": 0.01,
      "variable_axis": 0, "buckets": [4, 4]}, "buckets: bucket lengths must be distinct"),
    ({"kind": "tensor", "pooling": None, "normalize": None, "tolerance": 0.01, "variable_axis": 0},
     "'max_text_bytes' applies to kind 'text-encoder' and 'text-classifier' only"),
    ({"kind": "text-classifier", "pooling": None, "normalize": None, "pairs": True},
     r"pairs = true needs the graph's token type ids input \(\[inputs\] token_types\)"),
    ({"max_length": 20}, r"the largest bucket \(32\) is over max_length \(20\)"),
    ({"inputs": {"ids": "x", "mask": "x"}}, "inputs name one graph input twice"),
    ({"inputs": {"idz": "x"}}, "unknown key"),
])
def test_each_kind_rule_names_the_model(table, message):
    error = spec_error(**table)
    assert "[models.embed" in error
    assert re.search(message, error), error


def test_bucket_model_names_must_not_collide_across_models():
    data = copy.deepcopy(BASE)
    data["models"]["embed"]["encoder_prefix"] = "enc_"
    data["models"]["rerank"] = {**data["models"]["embed"]}
    with pytest.raises(SpecError, match="bucket model 'enc_16' is also a model of 'embed'"):
        parse_spec(data, SPEC)
    data["models"]["rerank"].pop("encoder_prefix")
    assert [m.bucket_names for m in parse_spec(data, SPEC).models] == [("enc_16", "enc_32"),
                                                                        ("rerank_16", "rerank_32")]


def test_the_express_model_name_is_reserved():
    # gen-config adds `<prefix>express` when a bucket lingers at peak: no other model may be called so.
    data = copy.deepcopy(BASE)
    data["models"]["embed_express"] = {**data["models"]["embed"], "encoder_prefix": "other_"}
    with pytest.raises(SpecError, match=r"\[models.embed\]: its express model 'embed_express' \(the bucket models' "
                                        r"twin without a linger\) is also a model of 'embed_express'"):
        parse_spec(data, SPEC)
    assert [m.express_name for m in parse_spec(copy.deepcopy(BASE), SPEC).models] == ["embed_express"]


# --- what the bucket models run -----------------------------------------------------------


@pytest.fixture(scope="module")
def user_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user-models")
    return {"encoder_dir": sentence_encoder_dir(folder), "raw_onnx": raw_sentence_encoder_onnx(folder),
            "cross_dir": cross_encoder_dir(folder)}


RAW_INPUTS = {"token_types": "token_type_ids"}


def test_a_raw_onnx_export_is_pooled_by_the_backend(user_models):
    model = spec_with(source=str(user_models["raw_onnx"]), tokenizer=str(minilm_tokenizer()), pooling="cls",
                      normalize=False, inputs=RAW_INPUTS).models[0]
    graph = served_graph(model)
    assert not graph.exported and graph.onnx_output == "last_hidden_state"
    assert graph.pooling is Pooling.CLS and graph.output_dim == 128
    assert tokenizer_path(model) == minilm_tokenizer()


@pytest.mark.parametrize(("table", "message"), [
    ({"pooling": "none", "normalize": False}, r"has one vector per token \[None, None, 128\]; set pooling"),
    ({"inputs": {}}, r"also takes inputs \['token_type_ids'\], which the spec's \[inputs\] does not map"),
    ({"inputs": {"ids": "ids", "token_types": "token_type_ids"}}, "ids"),
    ({"output": "pooler_output"}, "pooler_output"),
])
def test_a_graph_that_does_not_fit_the_spec_is_named(user_models, table, message):
    model = spec_with(source=str(user_models["raw_onnx"]), tokenizer=str(minilm_tokenizer()),
                      **{"pooling": "cls", "inputs": RAW_INPUTS, **table}).models[0]
    with pytest.raises(SourceError, match=message) as info:
        served_graph(model)
    assert str(info.value).startswith("[models.embed]: ")


def test_a_hugging_face_folder_is_exported_with_its_pooling_folded_in(user_models):
    model = spec_with(source=str(user_models["encoder_dir"]), pooling="mean", normalize=True).models[0]
    graph = served_graph(model)
    assert graph.exported and graph.onnx_output == "embedding" and graph.pooling is Pooling.NONE
    assert not graph.normalize and graph.output_dim == 128
    assert tokenizer_path(model) == user_models["encoder_dir"] / "tokenizer.json"
    classifier = spec_with(kind="text-classifier", source=str(user_models["cross_dir"]), pooling=None,
                           normalize=None, labels=["irrelevant", "relevant"]).models[0]
    assert served_graph(classifier).output_dim == 2 and served_graph(classifier).onnx_output == "logits"
    with pytest.raises(SourceError, match="3 labels for a graph with 2 logits"):
        served_graph(spec_with(kind="text-classifier", source=str(user_models["cross_dir"]), pooling=None,
                               normalize=None, labels=["a", "b", "c"]).models[0])


def test_sources_that_are_not_models_are_named(tmp_path):
    with pytest.raises(SourceError, match=r"neither an ONNX file nor a Hugging Face folder: .* does not exist"):
        served_graph(spec_with(source=str(tmp_path / "missing.onnx")).models[0])
    with pytest.raises(SourceError, match="the package module 'no_such_weights' is not installed"):
        served_graph(spec_with(source="package:no_such_weights").models[0])
    onnx_only = spec_with(source="model.onnx").models[0]
    with pytest.raises(SourceError, match=r"is an ONNX file; name its tokenizer\.json with `tokenizer`"):
        tokenizer_path(onnx_only)


# --- the router's rows of each kind ---------------------------------------------------------


def router(**changes) -> EmbedRouter:
    config = RouterConfig(bucket_lens=(16, 32), bucket_max_batch={16: 4, 32: 4}, **changes)
    return EmbedRouter(config, TOKENIZER)


def test_a_query_or_document_prefix_goes_before_each_text():
    plain = router().prepare(["a question"], None)
    prefixed = router(query_prefix="query: ", document_prefix="passage: ")
    query = prefixed.prepare(["a question"], None)
    document = prefixed.prepare(["a question"], None, RequestOptions(input_type="document"))
    assert query.token_counts[0] == plain.token_counts[0] + len(TOKENIZER.encode(["query:"])[0]) - 2
    assert TOKENIZER.encode(["query: a question"])[0] == query.chunks[0].input_ids[0, :query.token_counts[0]].tolist()
    assert TOKENIZER.encode(["passage: a question"])[0] == \
        document.chunks[0].input_ids[0, :document.token_counts[0]].tolist()


def test_input_type_must_be_query_or_document():
    from python_backends.common.errors import InvalidInput

    with pytest.raises(InvalidInput, match="parameter 'input_type' must be one of query, document, got 'passage'"):
        router().prepare(["text"], '{"input_type": "passage"}')


def test_pairs_are_one_row_with_token_types_telling_the_members_apart():
    pairs = router(kind=ModelKind.TEXT_CLASSIFIER, pairs=True, token_types=True)
    prepared = pairs.prepare(["what is triton"], None, raw_pairs=["an inference server"])
    (chunk,) = prepared.chunks
    n = prepared.token_counts[0]
    first, second = TOKENIZER.encode(["what is triton"])[0], TOKENIZER.encode(["an inference server"])[0]
    assert chunk.input_ids[0, :n].tolist() == first + second[1:]  # [CLS] a [SEP] b [SEP]
    assert chunk.tensors["TOKEN_TYPE_IDS"][0, :n].tolist() == [0] * len(first) + [1] * (len(second) - 1)
    assert not chunk.tensors["TOKEN_TYPE_IDS"][0, n:].any() and not chunk.attention_mask[0, n:].any()


def test_a_long_pair_is_cut_longer_member_first_or_refused():
    from python_backends.common.errors import InvalidInput

    pairs = router(kind=ModelKind.TEXT_CLASSIFIER, pairs=True, token_types=True)
    query, passage = "short query", " ".join(["hello"] * 80)
    prepared = pairs.prepare([query], None, raw_pairs=[passage])
    n = prepared.token_counts[0]
    assert n == 32 and prepared.num_truncated == 1
    ids = prepared.chunks[0].input_ids[0].tolist()
    assert ids[:len(TOKENIZER.encode([query])[0])] == TOKENIZER.encode([query])[0]  # the short member whole
    assert ids[n - 1] == TOKENIZER.encode([query])[0][-1]  # still closed by [SEP]
    with pytest.raises(InvalidInput, match="pair row 0 has 85 tokens; the limit is 32 and truncate=false"):
        pairs.prepare([query], '{"truncate": false}', raw_pairs=[passage])


def test_longest_first_cuts_the_longer_member_down_then_both():
    assert longest_first(10, 3, 8) == (5, 3)
    assert longest_first(3, 10, 8) == (3, 5)
    assert longest_first(6, 6, 8) == (4, 4)
    assert longest_first(2, 2, 8) == (2, 2)
    with pytest.raises(ValueError, match="room for at least one token of each text"):
        longest_first(5, 5, 1)


@pytest.mark.parametrize(("changes", "pairs", "message"), [
    ({}, ["b"], "this model takes single texts; it has no input TEXT_PAIR"),
    ({"kind": ModelKind.TEXT_CLASSIFIER, "pairs": True, "token_types": True}, ["b", "c"],
     "TEXT has 1 rows but TEXT_PAIR 2; send one pair per row"),
    ({"kind": ModelKind.TEXT_CLASSIFIER, "pairs": True, "token_types": True}, [" "],
     "TEXT_PAIR row 0 is empty"),
])
def test_bad_pairs_are_named(changes, pairs, message):
    from python_backends.common.errors import InvalidInput

    with pytest.raises(InvalidInput, match=message):
        router(**changes).prepare(["a"], None, raw_pairs=pairs)


def test_classifier_parameters_round_trip_through_the_config():
    from python_backends.embed.router import RouterParameters

    written = RouterParameters(bucket_lens=(16,), bucket_max_batch={16: 2}, kind=ModelKind.TEXT_CLASSIFIER,
                               token_types=True, pairs=True, labels=("no, not at all", "yes")).to_parameters()
    config = parse_router_config("rerank", written)
    assert (config.kind, config.pairs, config.token_types) == (ModelKind.TEXT_CLASSIFIER, True, True)
    assert config.labels == ("no, not at all", "yes") and config.output == "LOGITS"
    with pytest.raises(ValueError, match="unknown model kind 'image'"):
        parse_router_config("rerank", {**written, "kind": "image"})


def test_labels_name_each_rows_largest_logit():
    logits = np.array([[0.1, 2.0], [3.0, -1.0]], dtype=np.float32)
    assert labels_of(logits, ("no", "yes")).tolist() == [[b"yes"], [b"no"]]
    with pytest.raises(ValueError, match="do not match 3 label names"):
        labels_of(logits, ("a", "b", "c"))


# --- a classifier served through the fake Triton --------------------------------------------


def fake_classifier(call: BlsCall) -> InferenceResponse:
    """Two logits per row: (real tokens, version); version 2's top class differs on long rows."""
    mask = call.inputs["ATTENTION_MASK"]
    assert "TOKEN_TYPE_IDS" in call.inputs
    real = mask.sum(axis=1).astype(np.float32)
    logits = np.stack([real, np.full_like(real, 10.0 * call.model_version)], axis=1)
    return InferenceResponse(output_tensors=[Tensor("LOGITS", logits)])


def pair_request(firsts, seconds, **parameters):
    rows = {"TEXT": np.array([t.encode() for t in firsts], dtype=np.object_).reshape(-1, 1),
            "TEXT_PAIR": np.array([t.encode() for t in seconds], dtype=np.object_).reshape(-1, 1)}
    return Request(rows, parameters)


CLASSIFIER = {"kind": ModelKind.TEXT_CLASSIFIER, "pairs": True, "token_types": True, "labels": ("other", "match")}


def test_a_classifier_answers_logits_and_labels_and_gates_on_top1_agreement(serve, tmp_path):  # noqa: F811
    fake = FakeTriton(bls=fake_classifier)
    write_routing_table(tmp_path / "routing.json",
                        RoutingTable({1: 0.0, 2: 1.0}, candidate=2, baseline=1, shadow_rate=1.0, generation=1))
    service = serve(fake, **CLASSIFIER)
    passages = ["a passage", " ".join(["hello"] * 12), " ".join(["hello"] * 25)]
    response = answer(service, pair_request(["q one"] * 3, passages))
    logits = response.output("LOGITS")
    assert logits.shape == (3, 2) and logits[:, 1].tolist() == [20.0, 20.0, 20.0]  # version 2 served
    assert response.output("LABEL").reshape(-1).tolist() == [b"match", b"match", b"other"]  # 31 real tokens > 20
    service.finalize()  # waits for the shadow on version 1
    agreement = fake.metric("embed_shadow_top1_agreement", baseline="1", candidate="2").observations
    differences = fake.metric("embed_shadow_max_logit_diff", baseline="1", candidate="2").observations
    # v1's second logit is 10: the 18-token row's top class flips to "other"; the others agree.
    assert agreement == [1.0, 0.0, 1.0]
    assert differences == [10.0, 10.0, 10.0]


def test_a_classifier_without_pairs_refuses_a_pair(serve):  # noqa: F811
    service = serve(FakeTriton(bls=fake_classifier), kind=ModelKind.TEXT_CLASSIFIER, token_types=True)
    _, message = error_of(answer(service, pair_request(["q"], ["p"])))
    assert "has no input TEXT_PAIR" in message
