"""The LLM engine's limits per hardware: the spec's values on a CPU; on a GPU, bfloat16 and a KV
budget, a sequence limit and a step size derived from the GPU's memory and the model's size."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from python_backends.llm.config import LLMParameters
from tools.planning.llm_limits import (
    GPU_MAX_NUM_SEQS,
    GPU_STEP_TOKENS,
    ChatShape,
    LLMCost,
    LLMLimitsError,
    gpu_limits,
    mean_context_tokens,
    mean_log_uniform,
)
from tools.repository.configs import chat_shapes, plan_llm_model
from tools.spec.profile import Hardware, load_profile
from tools.spec.serving import load_spec

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30
SMOLLM2 = LLMCost(num_parameters=134_515_008, num_layers=30, num_kv_heads=3, head_dim=64)
LLAMA_8B = LLMCost(num_parameters=8_030_261_248, num_layers=32, num_kv_heads=8, head_dim=128)


def test_a_small_model_on_an_h100_is_capped_by_the_sequence_limit_not_memory():
    limits = gpu_limits(SMOLLM2, 80 * GIB, mean_context=300, max_model_len=2048)
    assert (limits.device, limits.dtype) == ("cuda", "bfloat16")
    budget = 0.9 * 80 * GIB - 134_515_008 * 2 - 0.05 * 80 * GIB
    assert limits.kv_cache_mb == math.floor(budget / (1 << 20))
    assert limits.max_num_seqs == GPU_MAX_NUM_SEQS and limits.max_num_batched_tokens == GPU_STEP_TOKENS
    assert any("the cap" in reason for reason in limits.reasons)


def test_a_large_model_on_a_small_gpu_runs_as_many_sequences_as_its_kv_budget_holds():
    limits = gpu_limits(LLAMA_8B, 24 * GIB, mean_context=300, max_model_len=4096)
    per_token = 2 * 32 * 8 * 128 * 2
    budget = 0.9 * 24 * GIB - 8_030_261_248 * 2 - 0.05 * 24 * GIB
    assert limits.max_num_seqs == int(budget // per_token // 300) < GPU_MAX_NUM_SEQS
    assert limits.max_num_batched_tokens == GPU_STEP_TOKENS >= limits.max_num_seqs


def test_float32_where_the_spec_asks_costs_twice_the_memory():
    bf16 = gpu_limits(LLAMA_8B, 40 * GIB, mean_context=300, max_model_len=4096)
    fp32 = gpu_limits(LLAMA_8B, 80 * GIB, mean_context=300, max_model_len=4096, dtype="float32")
    assert fp32.dtype == "float32" and fp32.kv_cache_mb < 2 * bf16.kv_cache_mb + 1


def test_a_model_that_leaves_no_room_for_one_long_sequence_is_refused_with_the_figures():
    with pytest.raises(LLMLimitsError, match=r"16.0 GiB of GPU memory leaves 0.00 GiB .* after 14.96 GiB of weights"):
        gpu_limits(LLAMA_8B, 16 * GIB, mean_context=300, max_model_len=8192)


def test_mean_context_of_a_workload():
    assert mean_log_uniform(10, 10) == 10
    assert mean_log_uniform(12, 48) == pytest.approx(36 / math.log(4))
    short = ChatShape(share=3, prompt_words=10, max_tokens=(20, 20))
    long = ChatShape(share=1, prompt_words=100, max_tokens=(100, 100))
    assert mean_context_tokens([short, long]) == pytest.approx(0.75 * (14 + 32 + 20) + 0.25 * (140 + 32 + 100))
    # the chat workload the tools plan with: questions, essays and long-context questions
    assert 80 < mean_context_tokens(chat_shapes()) < 400


def gpu_profile():
    profile = load_profile(REPO / "profiles" / "cpu.json")
    hardware = Hardware(name="h100", kind="gpu", description="NVIDIA H100 80GB HBM3 + 16 x Intel Xeon", cpu_count=16,
                        gpu="NVIDIA H100 80GB HBM3", details={"gpu_memory_gb": 79.6})
    return dataclasses.replace(profile, hardware=hardware)


def engine_parameters(generated) -> LLMParameters:
    params = {key: value.string_value for key, value in generated.config.parameters.items()}
    return LLMParameters.from_parameters(generated.name, params)


def test_gen_config_on_a_gpu_profile_derives_the_engine_for_that_gpu():
    spec = load_spec(REPO / "serving.toml")
    (llm,) = spec.llm_models
    cpu = engine_parameters(plan_llm_model(llm, spec, load_profile(REPO / "profiles" / "cpu.json"))[0])
    assert (cpu.device, cpu.dtype, cpu.kv_cache_mb, cpu.max_num_seqs) == ("auto", "auto", llm.kv_cache_mb,
                                                                          llm.max_num_seqs)
    generated = plan_llm_model(llm, spec, gpu_profile(), REPO / "model_repository")[0]
    gpu = engine_parameters(generated)
    assert (gpu.device, gpu.dtype, gpu.max_num_seqs, gpu.max_num_batched_tokens) == ("cuda", "bfloat16", 256, 2048)
    assert gpu.kv_cache_mb > 60_000  # GiBs of KV cache in the GPU's memory, not the CPU's 384 MB
    assert any(line.startswith("On NVIDIA H100 80GB HBM3") for line in generated.header)


def test_a_gpu_profile_without_the_gpu_memory_is_refused():
    spec = load_spec(REPO / "serving.toml")
    profile = gpu_profile()
    profile = dataclasses.replace(profile, hardware=dataclasses.replace(profile.hardware, details={}))
    with pytest.raises(ValueError, match="must record gpu_memory_gb"):
        plan_llm_model(spec.llm_models[0], spec, profile, REPO / "model_repository")
