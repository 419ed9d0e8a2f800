"""The `llm` models' config parameters (`LLMParameters`, `LLMInferParameters`: the schema
gen-config writes through and the backends read back) and the engine's limits (`EngineConfig`).

Free of torch, so the tools that write configs import it without the model code. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, ClassVar

from pydantic import PlainSerializer, PlainValidator

from python_backends.common.params import (
    AuthParameter,
    CountInt,
    Flag,
    ModelParameters,
    NonNegativeNumber,
    PositiveInt,
    PositiveNumber,
    TenantsParameter,
)
from python_backends.common.quotas import UNLIMITED
from python_backends.common.tenant_auth import AUTH_OFF
from python_backends.llm.kv_blocks import KVCacheSpec, num_blocks_for_budget
from python_backends.llm.scheduler import BatchingPolicy, SchedulerConfig

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
REQUIRED_FILES = ("model.safetensors", "config.json", "tokenizer.json")  # what build-models writes and the engine loads


@dataclass(frozen=True)
class EngineConfig:
    """One engine's limits, from the `llm` model's config parameters (written by gen-config)."""

    kv_cache_bytes: int  # memory the KV cache may use; the block pool is sized from it
    block_size: int = 16  # token slots per KV block
    max_num_seqs: int = 8  # sequences decoding together at most
    max_num_batched_tokens: int = 128  # tokens per step: prefill chunks plus decodes
    max_model_len: int = 2048  # context: prompt plus output tokens
    default_max_tokens: int = 128  # output tokens when a request does not say
    policy: BatchingPolicy = BatchingPolicy.CONTINUOUS  # continuous, or the static baseline
    num_threads: int = 0  # torch intra-op threads; 0: every core
    prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes already computed
    device: str = "auto"  # cpu, cuda (or cuda:N); auto: cuda where torch sees a GPU, else cpu
    dtype: str = "auto"  # float32, bfloat16 or float16; auto: float32 on CPU, bfloat16 on a GPU

    def __post_init__(self) -> None:
        for name in ("kv_cache_bytes", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")
        if self.device != "auto" and self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.device == "cpu" and self.dtype == "float16":
            raise ValueError("dtype float16 needs a GPU (CPU GEMMs in float16 are slow): use float32 or bfloat16")

    def scheduler_config(self, kv: KVCacheSpec) -> SchedulerConfig:
        return SchedulerConfig(num_blocks=num_blocks_for_budget(kv, self.kv_cache_bytes), block_size=self.block_size,
                               max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                               max_model_len=self.max_model_len, policy=self.policy,
                               prefix_caching=self.prefix_caching)


def _parse_policy(value: object) -> BatchingPolicy:
    return value if isinstance(value, BatchingPolicy) else BatchingPolicy.parse(str(value))


Batching = Annotated[BatchingPolicy, PlainValidator(_parse_policy),
                     PlainSerializer(lambda policy: policy.value, return_type=str)]
MIB = 1 << 20


class LLMParameters(ModelParameters):
    """The `llm` model's config.pbtxt parameters (gen-config writes them through this class)."""

    error_context: ClassVar[str] = "bad config parameters: "
    required_help: ClassVar[Mapping[str, str]] = {
        "kv_cache_mb": "missing parameter kv_cache_mb (the KV-cache memory budget)"}

    kv_cache_mb: PositiveNumber  # memory the KV cache may use, MiB
    batching: Batching = BatchingPolicy.CONTINUOUS  # continuous, or a static baseline
    block_size: PositiveInt = 16  # token slots per KV block
    max_num_seqs: PositiveInt = 8  # sequences decoding together at most
    max_num_batched_tokens: PositiveInt = 128  # tokens per step
    max_model_len: PositiveInt = 2048  # context: prompt plus output tokens
    default_max_tokens: PositiveInt = 128  # output tokens when a request does not say
    num_threads: CountInt = 0  # torch intra-op threads; 0: every core
    prefix_caching: Flag = True  # reuse the KV blocks of prompt prefixes already computed
    device: str = "auto"  # cpu, cuda[:N], or auto (cuda where torch sees a GPU)
    dtype: str = "auto"  # float32, bfloat16, float16, or auto (float32 on CPU, bfloat16 on a GPU)
    stream_hold_ms: NonNegativeNumber = 0.0  # while requests wait, a stream's tokens are held up to this long
    tenants: TenantsParameter = UNLIMITED  # each tenant's generated-token quota by tier
    tenant_auth: AuthParameter = AUTH_OFF  # how a request proves its tenant

    def engine_config(self) -> EngineConfig:
        return EngineConfig(kv_cache_bytes=int(self.kv_cache_mb * MIB), block_size=self.block_size,
                            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                            max_model_len=self.max_model_len, default_max_tokens=self.default_max_tokens,
                            policy=self.batching, num_threads=self.num_threads, prefix_caching=self.prefix_caching,
                            device=self.device, dtype=self.dtype)


def parse_engine_config(model_name: str, params: Mapping[str, str]) -> EngineConfig:
    """EngineConfig from the model config's string parameters; ValueError naming the model."""
    parameters = LLMParameters.from_parameters(model_name, params)
    try:
        return parameters.engine_config()
    except ValueError as err:
        raise ValueError(f"model '{model_name}': {LLMParameters.error_context}{err}") from None


class LLMInferParameters(ModelParameters):
    """`<llm>_infer`'s parameters: the model it forwards to, and how many requests at once."""

    target_model: str = "llm"  # the decoupled model that generates
    max_in_flight: PositiveInt = 64  # requests forwarded at once (worker threads)
