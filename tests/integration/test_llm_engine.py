"""The LLM engine on the real SmolLM2 weights, in process: in float32, greedy output is the
same as `transformers`' own `generate`, and the same alone as inside a full batch, with
chunked prefill and with preemption; in bfloat16 (the default on a CPU that multiplies it in
hardware, and on a GPU), its logits are the float32 ones within bfloat16's rounding."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from python_backends.llm.engine import ChatTokenizer, EngineConfig, LLMEngine, build_inputs
from python_backends.llm.model import GROUP_SPLIT_SLOTS
from python_backends.llm.scheduler import BatchingPolicy, FinishReason
from tests.integration.helpers import CHAT_QUESTIONS

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "model_repository" / "llm" / "1"
MAX_TOKENS = 24
# The last prompt is long enough to be prefilled in several chunks.
QUESTIONS = [*CHAT_QUESTIONS[:-1],
             "Why is the sky blue? Answer in detail, with the physics of Rayleigh scattering, the role of the "
             "wavelength of light, why sunsets are red, and why the sky is not violet even though violet light "
             "scatters even more than blue light does."]


@pytest.fixture(scope="module", autouse=True)
def built_model():
    subprocess.run([sys.executable, "-m", "tools", "build-models"], cwd=REPO, check=True)


def chat(question: str, **overrides):
    fields = {"text_input": None, "messages": json.dumps([{"role": "user", "content": question}]),
              "max_tokens": MAX_TOKENS, "temperature": None, "top_p": None, "seed": None, "stop": (),
              "stream": True, **overrides}
    return build_inputs(**fields)


def engine(**config) -> LLMEngine:
    """float32 unless asked: its greedy tokens do not depend on the batch a sequence is in
    (bfloat16 rounds each layer's output, and a near tie between two tokens can then go
    either way with the batch's shape)."""
    return LLMEngine.from_dir(MODEL_DIR, EngineConfig(**{"kv_cache_bytes": 64 << 20, "dtype": "float32", **config}))


def generate(llm: LLMEngine, requests: dict[str, object]) -> dict[str, tuple[str, list, FinishReason]]:
    """Run requests together to completion: request id -> (text, outputs, finish reason)."""
    for request_id, inputs in requests.items():
        prompt, params = llm.prepare(inputs)
        llm.add(request_id, prompt, params)
    outputs: dict[str, list] = {request_id: [] for request_id in requests}
    while llm.has_work:
        for output in llm.step():
            outputs[output.request_id].append(output)
    return {rid: ("".join(o.text_delta for o in outs), outs, outs[-1].finish_reason) for rid, outs in outputs.items()}


@pytest.fixture(scope="module")
def alone() -> dict[int, str]:
    llm = engine(prefix_caching=False)  # every prompt computed in full: the reference
    return {i: generate(llm, {"r": chat(q)})["r"][0] for i, q in enumerate(QUESTIONS)}


def test_prompts_served_from_the_prefix_cache_give_the_same_output(alone):
    llm = engine()
    # One after another: each reuses the chat template's system turn the first computed.
    one_by_one = {i: generate(llm, {"r": chat(q)})["r"][0] for i, q in enumerate(QUESTIONS)}
    after_system_turn = llm.stats().num_cached_prompt_tokens
    # Again, together: now whole prompts (all but their last block) come from the cache.
    together = generate(llm, {f"r{i}": chat(q) for i, q in enumerate(QUESTIONS)})
    assert one_by_one == alone
    assert {i: together[f"r{i}"][0] for i in range(len(QUESTIONS))} == alone
    assert after_system_turn >= 16 * (len(QUESTIONS) - 1)  # at least one block each after the first
    assert llm.stats().num_cached_prompt_tokens > after_system_turn + 16 * len(QUESTIONS)
    assert llm.scheduler.blocks.num_used == 0


def test_greedy_output_is_transformers_generate(alone):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    model = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32)
    llm = engine()
    for index in (0, 3, 7):
        prompt, params = llm.prepare(chat(QUESTIONS[index]))
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=list(params.stop_token_ids), pad_token_id=tokenizer.pad_token_id)
        expected = tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert alone[index] == expected, QUESTIONS[index]


def test_bfloat16_logits_are_the_float32_ones_within_its_rounding():
    """A prompt's prefill and one decode step in bfloat16 (packed for oneDNN on a CPU) against
    transformers' own forward in float32: bfloat16 keeps 8 bits of mantissa, so logits of
    about 20 are 0.125 apart, and 30 layers of rounding move them by up to 0.7 (transformers'
    own bfloat16 forward, sdpa or eager, was 0.27-0.57 from float32 on these prompts, the
    engine 0.24-0.69); a wrong computation is off by whole units."""
    import torch
    from transformers import AutoModelForCausalLM

    from python_backends.llm.model import PagedCausalLM, StepSequence

    reference = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32)
    model = PagedCausalLM.from_dir(MODEL_DIR, num_blocks=64, block_size=16, dtype=torch.bfloat16, device="cpu")
    tokenizer = ChatTokenizer(MODEL_DIR)
    for index in (0, 3, 7):
        prompt = tokenizer.encode(chat(QUESTIONS[index]))
        blocks = list(range(-(-(len(prompt) + 1) // 16)))
        with torch.inference_mode():
            expected = reference(torch.tensor([prompt])).logits[0, -1].float()
            token = int(expected.argmax())
            expected_next = reference(torch.tensor([[*prompt, token]])).logits[0, -1].float()
        prefilled = model.step([StepSequence(prompt, 0, blocks, True)])[0]
        decoded = model.step([StepSequence([token], len(prompt), blocks, True)])[0]
        torch.testing.assert_close(prefilled, expected, rtol=0, atol=1.0)
        torch.testing.assert_close(decoded, expected_next, rtol=0, atol=1.0)


@pytest.mark.parametrize("split_slots", [GROUP_SPLIT_SLOTS, 0, 1 << 20], ids=["default", "one_per_group", "one_group"])
def test_full_batch_with_chunked_prefill_matches_each_request_alone(alone, split_slots):
    llm = engine(max_num_seqs=8, max_num_batched_tokens=32)  # the long prompt takes several chunks
    llm.model.group_split_slots = split_slots  # decodes attend in padded groups of any split: same tokens
    results = generate(llm, {f"r{i}": chat(q) for i, q in enumerate(QUESTIONS)})
    assert {i: results[f"r{i}"][0] for i in range(len(QUESTIONS))} == alone
    assert llm.scheduler.blocks.num_used == 0
    assert llm.stats().num_generated_tokens == sum(r[1][-1].num_output_tokens for r in results.values())


@pytest.mark.parametrize("policy", [BatchingPolicy.STATIC, BatchingPolicy.STATIC_RETIRING])
def test_static_batches_give_each_request_its_output_alone(alone, policy):
    # Under `static`, members that finished early keep recomputing their last token in every
    # step until the batch ends: those padding rows must not change anyone's tokens.
    # Every other request asks for 8 tokens fewer, so it finishes first and pads the batch.
    llm = engine(max_num_seqs=8, policy=policy)
    results = generate(llm, {f"r{i}": chat(q, max_tokens=MAX_TOKENS - 8 * (i % 2)) for i, q in enumerate(QUESTIONS)})
    for i, text in alone.items():
        if i % 2 == 0:
            assert results[f"r{i}"][0] == text, QUESTIONS[i]
        else:  # the same greedy tokens, fewer of them
            assert text.startswith(results[f"r{i}"][0]), QUESTIONS[i]
    assert llm.scheduler.blocks.num_used == 0 and not llm.scheduler.padding


def test_preempted_sequences_recompute_to_the_same_output(alone):
    # 12 blocks of 16 tokens cannot hold 8 sequences of ~40-150 tokens: the youngest are
    # evicted and recomputed, and still produce exactly what they produce alone.
    per_block = 2 * 30 * 3 * 64 * 4 * 16
    llm = engine(kv_cache_bytes=12 * per_block, max_num_seqs=8)
    results = generate(llm, {f"r{i}": chat(q) for i, q in enumerate(QUESTIONS)})
    assert llm.scheduler.num_preemptions > 0
    assert {i: results[f"r{i}"][0] for i in range(len(QUESTIONS))} == alone
    assert llm.scheduler.blocks.num_used == 0


def test_stop_string_cuts_the_text_and_finishes_with_stop(alone):
    text = alone[3]  # "Here are three fruits ..."
    stop = text.split()[3]
    result = generate(engine(), {"r": chat(QUESTIONS[3], stop=(stop,))})["r"]
    assert result[0] == text[:text.index(stop)]
    assert result[2] is FinishReason.STOP


def test_seeded_sampling_repeats_and_streams_deltas():
    llm = engine()
    first = generate(llm, {"a": chat(QUESTIONS[1], temperature=0.9, top_p=0.95, seed=11)})["a"]
    again = generate(llm, {"b": chat(QUESTIONS[1], temperature=0.9, top_p=0.95, seed=11)})["b"]
    assert first[0] == again[0]
    assert len(first[1]) > 3  # one output per text delta
    assert first[1][-1].ttft_s is not None and first[1][-1].ttft_s > 0


def test_a_prompt_beyond_the_context_is_refused():
    from python_backends.common.errors import InvalidInput

    llm = engine(max_model_len=64)
    with pytest.raises(InvalidInput, match="the context holds 64"):
        llm.prepare(chat("word " * 100))
    with pytest.raises(InvalidInput, match="exceeds the context of 64 tokens"):
        llm.prepare(chat("hi", max_tokens=60))
