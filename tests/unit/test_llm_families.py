"""The engine serves the decoder families users run, through `transformers`' own model
definitions and the kit's paged attention: small random-weight models of each architecture
(fixed seeds, real configs) give, token for token, what `transformers`' `generate` gives on the
same weights and prompts: alone, in a batch of mixed lengths, prefilled in chunks, and
preempted and recomputed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from python_backends.llm.config import EngineConfig
from python_backends.llm.engine import LLMEngine
from python_backends.llm.scheduler import SamplingParams
from tests.user_models import LLM_VOCAB as VOCAB
from tests.user_models import save_word_tokenizer

MAX_TOKENS = 12
BLOCK = 16
WINDOW = 16  # the sliding window of the models that have one: shorter than every long prompt
PROMPT_LENGTHS = (5, 23, 41, 70)  # one block, several, and a prompt several chunks long
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.2,
             bos_token_id=2, eos_token_id=[1, 3], pad_token_id=0)


def llama3():
    from transformers import LlamaConfig

    # Llama 3.2's rope scaling; an original context shorter than the prompts, so it matters
    return LlamaConfig(**SMALL, rope_theta=500000.0, tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})


def qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(**SMALL)  # query/key/value biases


def qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(**SMALL)  # query and key norms


def mistral():
    from transformers import MistralConfig

    return MistralConfig(**SMALL, sliding_window=WINDOW)


def gemma2():
    from transformers import Gemma2Config

    # sliding-window and global layers, attention and final logit soft-capping, its own norms
    return Gemma2Config(**SMALL, sliding_window=WINDOW, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
                        final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh",
                        tie_word_embeddings=False)


def gemma3():
    from transformers import Gemma3TextConfig

    # local layers with their own rope base, a global one; query/key norms
    return Gemma3TextConfig(**{**SMALL, "num_hidden_layers": 3}, sliding_window=WINDOW, query_pre_attn_scalar=16,
                            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                            rope_local_base_freq=10000.0, rope_theta=1000000.0, tie_word_embeddings=False)


FAMILIES = {"llama3": llama3, "qwen2": qwen2, "qwen3": qwen3, "mistral": mistral, "gemma2": gemma2,
            "gemma3": gemma3}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, Path, dict[int, list[int]], dict[int, list[int]]]:
    """(name, model folder, prompt length -> transformers' greedy output tokens: stopping at
    the model's EOS tokens, and MAX_TOKENS of them whatever they are)."""
    from transformers import AutoModelForCausalLM

    name = request.param
    folder = tmp_path_factory.mktemp(name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[name](), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    model.save_pretrained(str(folder))
    save_word_tokenizer(folder)
    expected, full = {}, {}
    for length in PROMPT_LENGTHS:
        ids = torch.tensor([prompt(length)])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=[1, 3], pad_token_id=0)
            expected[length] = [t for t in out[0, length:].tolist() if t != 0]
            model.generation_config.eos_token_id = None
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
            model.generation_config.eos_token_id = [1, 3]
            full[length] = out[0, length:].tolist()
    return name, folder, expected, full


def prompt(length: int) -> list[int]:
    generator = torch.Generator().manual_seed(length)
    return torch.randint(4, VOCAB, (length,), generator=generator).tolist()


def engine(folder: Path, **config) -> LLMEngine:
    """In float32, as the reference computes: token-for-token equality is float32's promise
    (bfloat16 rounds each layer, and a near tie can go either way with the batch)."""
    return LLMEngine.from_dir(folder, EngineConfig(**{"kv_cache_bytes": 8 << 20, "block_size": BLOCK,
                                                      "max_model_len": 256, "device": "cpu", "dtype": "float32",
                                                      **config}))


def run(llm: LLMEngine, lengths, eos: bool = True) -> dict[int, list[int]]:
    """Greedy, together, to completion: prompt length -> output tokens (MAX_TOKENS of them
    without `eos`)."""
    seqs = {}
    for length in lengths:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                stop_token_ids=llm.tokenizer.stop_token_ids if eos else ())
        llm.add(f"r{length}", prompt(length), params)
        seqs[length] = llm.scheduler.sequence(f"r{length}")
    while llm.has_work:
        llm.step()
    assert llm.scheduler.blocks.num_used == 0
    return {length: list(seq.output_token_ids) for length, seq in seqs.items()}


def test_the_stop_tokens_are_every_eos_the_model_names(family):
    _, folder, _, _ = family
    assert engine(folder).tokenizer.stop_token_ids == (1, 3)  # the tokenizer's and the config's list


def test_each_prompt_alone_is_transformers_generate(family):
    _, folder, expected, full = family
    llm = engine(folder, prefix_caching=False)
    for length in PROMPT_LENGTHS:
        assert run(llm, [length]) == {length: expected[length]}
        assert run(llm, [length], eos=False) == {length: full[length]}


def test_a_batch_of_mixed_lengths_prefilled_in_chunks_is_transformers_generate(family):
    _, folder, expected, full = family
    llm = engine(folder, max_num_seqs=4, max_num_batched_tokens=BLOCK)  # the long prompts take several chunks
    assert run(llm, PROMPT_LENGTHS) == expected
    assert run(llm, PROMPT_LENGTHS, eos=False) == full  # again, from the prefix cache


def test_preempted_sequences_recompute_to_transformers_generate(family):
    name, folder, _, full = family
    llm = engine(folder)
    per_block = llm.model.kv_bytes_per_token * BLOCK
    # 7 blocks: the three shorter prompts fit (6 blocks) but cannot all grow their 12 tokens
    llm = engine(folder, kv_cache_bytes=7 * per_block, max_num_seqs=4, prefix_caching=False)
    assert run(llm, PROMPT_LENGTHS, eos=False) == full
    assert llm.scheduler.num_preemptions > 0, name
