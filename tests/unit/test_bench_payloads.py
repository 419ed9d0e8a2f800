"""What the load tests send a model: the spec's model by name, single texts or text pairs whose
rows follow the workload's length mix, or a tensor model's tensors of lengths from the mix."""

import dataclasses

import numpy as np
import pytest

from python_backends.embed.kinds import ModelKind
from python_backends.tensor.router import TensorSpec
from tools.bench.payloads import (
    NUM_FIXED_SHAPE_REQUESTS,
    ModelLookupError,
    TensorPayload,
    TextPayload,
    find_model,
    is_position_input,
    model_factory,
    model_payload,
    model_texts,
    pair_texts_for,
    request_lengths,
    split_pair_tokens,
    tensor_request,
    tensors_for,
    texts_for,
)
from tools.repository.sources import TensorGraph
from tools.spec.serving import load_spec
from tools.spec.workload import TextFactory, load_workload, parse_workload

# The suite's audio model (tests.user_models.audio_conv_onnx): frames of 40 features and a frame
# mask, bucketed by the frame count; and a fixed-shape image model.
FEATURES = TensorSpec("features", "TYPE_FP32", (-1, 40), 0.0)
FRAME_MASK = TensorSpec("frame_mask", "TYPE_FP32", (-1,), 0.0)
AUDIO = TensorGraph((FEATURES, FRAME_MASK), (TensorSpec("logits", "TYPE_FP32", (8,)),))
IMAGE = TensorGraph((TensorSpec("pixel_values", "TYPE_FP32", (3, 8, 8)),), (TensorSpec("logits", "TYPE_FP32", (10,)),))
FRAMES = parse_workload({"name": "frames", "rows_per_request": 2, "seed": 3,
                         "lengths": [{"min_tokens": 5, "max_tokens": 16, "weight": 0.5},
                                     {"min_tokens": 17, "max_tokens": 100, "weight": 0.5}]}, source="frames.toml")


@pytest.fixture(scope="module")
def factory() -> TextFactory:
    return TextFactory()


def test_a_model_is_found_by_name_and_an_unknown_name_lists_the_specs_models():
    spec = load_spec()
    assert find_model(spec, "embed").name == "embed"
    with pytest.raises(ModelLookupError, match=r"serving.toml: no model 'rerank'; the spec's \[models\]: embed$"):
        find_model(spec, "rerank")
    with pytest.raises(ModelLookupError, match=r"'llm' is a generative model \(\[llm_models.llm\]\), not one of "
                                               r"\[models\]; the spec's \[models\]: embed \(`bench llm` measures "
                                               r"'llm'\)"):
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


# --------------------------------------------------------------------------- tensor models


def tensor_model(variable_axis: int | None, bucket_lens: tuple[int, ...]):
    """embed's spec entry made a tensor model (what tensors_for reads of it: name, axis, buckets)."""
    return dataclasses.replace(find_model(load_spec(), "embed"), name="audio", kind=ModelKind.TENSOR,
                               variable_axis=variable_axis, bucket_lens=bucket_lens, encoder_prefix="audio_")


def test_lengths_follow_the_mix_capped_at_the_largest_bucket():
    drawn = FRAMES.sample_lengths(200)
    assert request_lengths(FRAMES, 200, 64) == [min(n, 64) for n in drawn]
    assert max(drawn) > 64 and max(request_lengths(FRAMES, 200, 64)) == 64


def test_a_mask_of_one_value_per_position_is_all_ones_the_features_are_random():
    assert is_position_input(FRAME_MASK, 0) and not is_position_input(FEATURES, 0)
    assert not is_position_input(FRAME_MASK, None)
    request = tensor_request(AUDIO.inputs, 0, 3, 12, np.random.default_rng(0))
    assert request["features"].shape == (3, 12, 40) and request["features"].dtype == np.float32
    assert request["features"].std() > 0.5  # standard normal values
    assert request["frame_mask"].shape == (3, 12) and request["frame_mask"].dtype == np.float32
    assert (request["frame_mask"] == 1).all()


def test_a_variable_axis_models_requests_are_rows_of_one_drawn_length():
    model = tensor_model(0, (16, 64))
    payload = tensors_for(AUDIO, model, FRAMES, 40)
    assert len(payload.requests) == 20 and payload.num_rows == 40  # two rows a request
    assert list(payload.lengths) == request_lengths(FRAMES, 20, 64)
    for request, length in zip(payload.requests, payload.lengths, strict=True):
        assert request["features"].shape == (2, length, 40) and request["frame_mask"].shape == (2, length)
    again = tensors_for(AUDIO, model, FRAMES, 40)  # deterministic
    np.testing.assert_array_equal(again.requests[5]["features"], payload.requests[5]["features"])
    with pytest.raises(ValueError, match=r"\[models.audio\] is bucketed by its variable axis 0: its requests need "
                                         "a workload"):
        tensors_for(AUDIO, model, None, 40)


def test_a_fixed_shape_model_cycles_a_few_alike_requests_without_a_workload():
    model = tensor_model(None, (0,))
    payload = tensors_for(IMAGE, model, None, 300)
    assert len(payload.requests) == NUM_FIXED_SHAPE_REQUESTS and payload.lengths == ()
    assert all(request["pixel_values"].shape == (1, 3, 8, 8) for request in payload.requests)
    assert len(tensors_for(IMAGE, model, None, 5).requests) == 5
    assert tensors_for(IMAGE, model, FRAMES, 8).requests[0]["pixel_values"].shape == (2, 3, 8, 8)  # its rows a request


def test_the_first_rows_cycle_the_requests_until_they_hold_enough():
    payload = tensors_for(IMAGE, tensor_model(None, (0,)), FRAMES, 6)  # 3 requests of 2 rows
    first = payload.first_rows(9)
    assert first.num_rows == 10 and len(first.requests) == 5
    assert first.requests[3] is payload.requests[0]  # round again from the first
    assert payload.first_rows(0).num_rows == 2  # at least one request
    audio = tensors_for(AUDIO, tensor_model(0, (16, 64)), FRAMES, 20)
    assert audio.first_rows(4).lengths == audio.lengths[:2]
    with pytest.raises(ValueError, match="at least one request"):
        TensorPayload(()).first_rows(1)


def test_the_payload_is_texts_for_a_text_model_and_a_text_model_needs_a_workload():
    embed = find_model(load_spec(), "embed")
    workload = load_workload(embed.workload)
    assert model_payload(embed, workload, 20) == model_texts(embed, workload, 20)
    assert model_payload(embed, workload, 20).first_rows(5) == TextPayload(model_texts(embed, workload, 20).texts[:5])
    with pytest.raises(ValueError, match=r"\[models.embed\]: a text model's texts need a workload"):
        model_payload(embed, None, 20)
