"""The LLM engine's pure parts: request validation, stop strings, sampling, config parsing."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from python_backends.common.errors import InvalidInput
from python_backends.llm.config import EngineConfig, parse_engine_config
from python_backends.llm.engine import ChatTokenizer, build_inputs, find_stop, inputs_from_arrays, sample, unsafe_suffix
from python_backends.llm.scheduler import BatchingPolicy, SamplingParams

CHAT = json.dumps([{"role": "user", "content": "hi"}])


def arrays(**values) -> dict[str, np.ndarray]:
    out = {}
    for name, value in values.items():
        if isinstance(value, str | bytes):
            out[name] = np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)
        elif isinstance(value, list):
            out[name] = np.array([v.encode() for v in value], dtype=np.object_)
        else:
            out[name] = np.array([value])
    return out


def test_tensors_become_generation_inputs():
    inputs = inputs_from_arrays(arrays(messages=CHAT, max_tokens=np.int32(5), temperature=np.float32(0.5),
                                       top_p=np.float32(0.9), seed=np.int64(3), stop=["\n", "END"], stream=True))
    assert inputs.messages == ({"role": "user", "content": "hi"},) and inputs.text_input is None
    assert (inputs.max_tokens, inputs.temperature, inputs.seed, inputs.stop, inputs.stream) == (
        5, 0.5, 3, ("\n", "END"), True)
    assert inputs.top_p == pytest.approx(0.9)
    defaults = inputs_from_arrays(arrays(text_input="Once upon a time"))
    assert (defaults.max_tokens, defaults.temperature, defaults.top_p, defaults.stream) == (None, 0.0, 1.0, False)


@pytest.mark.parametrize(("values", "message"), [
    ({}, "exactly one of text_input"),
    ({"text_input": "a", "messages": CHAT}, "exactly one of text_input"),
    ({"text_input": "   "}, "text_input is empty"),
    ({"text_input": b"\xff\xfe"}, "text_input is not valid UTF-8"),
    ({"messages": "not json"}, "messages is not valid JSON"),
    ({"messages": "[]"}, "non-empty JSON list"),
    ({"messages": '[{"role": "user"}]'}, r"messages\[0\] must be an object with string 'role' and 'content'"),
    ({"messages": '[{"role": "robot", "content": "x"}]'}, "must be system, user or assistant"),
    ({"text_input": "a", "max_tokens": np.int32(0)}, "max_tokens must be >= 1"),
    ({"text_input": "a", "temperature": np.float32(-1)}, r"temperature must be in \[0, 10\]"),
    ({"text_input": "a", "temperature": np.float32("nan")}, "temperature must be"),
    ({"text_input": "a", "top_p": np.float32(0)}, r"top_p must be in \(0, 1\]"),
    ({"text_input": "a", "stop": [""]}, "non-empty strings"),
    ({"text_input": "a", "stop": ["x"] * 9}, "at most 8"),
])
def test_bad_requests_are_refused_with_the_reason(values, message):
    with pytest.raises(InvalidInput, match=message):
        inputs_from_arrays(arrays(**values))


def test_two_prompts_in_one_tensor_are_refused():
    with pytest.raises(InvalidInput, match="text_input must hold exactly one string, got 2"):
        inputs_from_arrays({"text_input": np.array([b"a", b"b"], dtype=np.object_)})


def test_stop_strings_are_found_and_their_beginnings_held_back():
    assert find_stop("Hello END world", ("END", "world")) == 6
    assert find_stop("Hello", ("END",)) is None
    # "Hello EN" could still become "Hello END": hold back "EN" until the next token says.
    assert unsafe_suffix("Hello EN", ("END",)) == 2
    assert unsafe_suffix("Hello E", ("END", "Ex")) == 1
    assert unsafe_suffix("Hello", ("END",)) == 0
    assert unsafe_suffix("anything", ()) == 0


def test_greedy_takes_the_argmax_and_a_tiny_top_p_keeps_only_the_top_token():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample(logits, SamplingParams(max_tokens=1), None) == 1
    generator = torch.Generator().manual_seed(0)
    draws = {sample(logits, SamplingParams(max_tokens=1, temperature=1.0, top_p=1e-6), generator) for _ in range(20)}
    assert draws == {1}


def test_seeded_sampling_is_reproducible_and_top_p_bounds_the_choices():
    logits = torch.tensor([2.0, 1.9, 1.8, -5.0, -5.0])
    params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.7, seed=7)

    def draws(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return [sample(logits, params, generator) for _ in range(50)]

    assert draws(7) == draws(7)
    assert set(draws(7)) <= {0, 1, 2}  # the three tokens that reach 70% of the mass
    assert len(set(draws(7))) > 1


def test_engine_config_from_model_parameters():
    config = parse_engine_config("llm", {"kv_cache_mb": "1.5", "block_size": "8", "max_num_seqs": "4",
                                         "batching": "static"})
    assert config.kv_cache_bytes == int(1.5 * (1 << 20)) and config.block_size == 8
    assert config.max_num_seqs == 4 and config.policy is BatchingPolicy.STATIC
    assert config.max_num_batched_tokens == EngineConfig(kv_cache_bytes=1).max_num_batched_tokens  # default kept
    assert config.prefix_caching  # on unless the config turns it off
    assert not parse_engine_config("llm", {"kv_cache_mb": "1", "prefix_caching": "0"}).prefix_caching


@pytest.mark.parametrize(("params", "message"), [
    ({}, "missing parameter kv_cache_mb"),
    ({"kv_cache_mb": "lots"}, "parameter kv_cache_mb='lots' is not a number"),
    ({"kv_cache_mb": "64", "max_num_seqs": "0"}, "parameter max_num_seqs=0 must be >= 1"),
    ({"kv_cache_mb": "64", "block_size": "x"}, "parameter block_size='x' is not an integer"),
    ({"kv_cache_mb": "1e-9"}, "kv_cache_bytes must be >= 1, got 0"),
    ({"kv_cache_mb": "64", "batching": "eager"}, "unknown batching policy 'eager'"),
    ({"kv_cache_mb": "64", "prefix_caching": "yes"}, "prefix_caching must be 0 or 1, got 'yes'"),
])
def test_bad_engine_parameters_name_the_model(params, message):
    with pytest.raises(ValueError, match=f"model 'llm': bad config parameters: .*{message}"):
        parse_engine_config("llm", params)


def test_build_inputs_keeps_defaults_to_the_engine():
    inputs = build_inputs(text_input="x", messages=None, max_tokens=None, temperature=None, top_p=None, seed=None,
                          stop=(), stream=None)
    assert inputs.max_tokens is None and inputs.stream is False


def byte_level_tokenizer(folder):
    """A real byte-level BPE tokenizer (the kind of GPT-2, Llama 3, Qwen, SmolLM2) trained on a
    few lines, with special tokens, saved as a Hugging Face tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|end|>", "<|user|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["Grüße aus Köln, 東京 and naïve café ☕ text.", "The quick brown fox."] * 20,
                                  trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|end|>")
    fast.save_pretrained(str(folder))
    return fast


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    folder = tmp_path_factory.mktemp("byte-level")
    reference = byte_level_tokenizer(folder)
    return ChatTokenizer(folder), reference


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 399), max_size=40))
def test_the_engine_decodes_as_transformers_does_special_tokens_and_broken_bytes_too(byte_level, ids):
    engine_side, reference = byte_level
    assert engine_side.decode(ids) == reference.decode(ids, skip_special_tokens=True,
                                                       clean_up_tokenization_spaces=False)
