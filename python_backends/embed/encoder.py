"""A bucket encoder: all-MiniLM-L6-v2 in ONNX Runtime at one fixed sequence length.

The ONNX graph (made by `python -m tools build-models`) already mean-pools over real
tokens and L2-normalises, so the backend only stacks the batch Triton formed, runs it
once, and splits the result back per request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from python_backends.common.params import CountInt, Flag, ModelParameters, NameList

ONNX_INPUTS = ("input_ids", "attention_mask")
ONNX_OUTPUT = "embedding"
DEFAULT_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")
# Rows in each batch Triton formed (label model): the batch sizes a bucket really runs at,
# which Triton's own counters give only as a mean (inference_count / execution_count).
BATCH_ROWS_HISTOGRAM = ("embed_bucket_batch_rows", "Rows in each batch Triton formed for a bucket model")


@dataclass(frozen=True)
class EncoderConfig:
    """Settings of one bucket encoder model, from its config.pbtxt."""

    model_name: str  # Triton model name, for error messages
    seq_len: int  # the bucket length: dims of INPUT_IDS / ATTENTION_MASK
    max_batch_size: int  # Triton's batch limit for this bucket
    intra_op_threads: int = 0  # ONNX Runtime intra-op threads; 0 lets ONNX Runtime choose
    providers: tuple[str, ...] = DEFAULT_PROVIDERS  # wanted execution providers, in order of preference
    allow_spinning: bool = True  # idle ONNX Runtime threads spin-wait (fast, but burns shared cores)


class EncoderParameters(ModelParameters):
    """A bucket encoder's config.pbtxt parameters (gen-config writes them through this class)."""

    intra_op_threads: CountInt = 0  # ONNX Runtime intra-op threads; 0 lets ONNX Runtime choose
    allow_spinning: Flag = True  # idle ONNX Runtime threads spin-wait
    execution_providers: NameList = ()  # wanted execution providers in order; empty: DEFAULT_PROVIDERS


def parse_encoder_config(model_config: Mapping[str, Any]) -> EncoderConfig:
    """Validate the parsed config.pbtxt (Triton's JSON form); errors name the model."""
    name = model_config.get("name", "?")
    inputs = {tensor["name"]: tensor for tensor in model_config.get("input", [])}
    for required in ("INPUT_IDS", "ATTENTION_MASK"):
        if required not in inputs:
            raise ValueError(f"model '{name}': config has no input {required}")
    dims = [int(d) for d in inputs["INPUT_IDS"].get("dims", [])]
    mask_dims = [int(d) for d in inputs["ATTENTION_MASK"].get("dims", [])]
    if len(dims) != 1 or dims[0] < 2:
        raise ValueError(f"model '{name}': INPUT_IDS dims must be one fixed length >= 2, got {dims}")
    if mask_dims != dims:
        raise ValueError(f"model '{name}': ATTENTION_MASK dims {mask_dims} differ from INPUT_IDS dims {dims}")
    max_batch_size = int(model_config.get("max_batch_size", 0))
    if max_batch_size < 1:
        raise ValueError(f"model '{name}': max_batch_size must be >= 1 so Triton can batch it")
    params = {key: value.get("string_value", "") for key, value in model_config.get("parameters", {}).items()}
    parameters = EncoderParameters.from_parameters(name, params)
    return EncoderConfig(
        model_name=name,
        seq_len=dims[0],
        max_batch_size=max_batch_size,
        intra_op_threads=parameters.intra_op_threads,
        providers=parameters.execution_providers or DEFAULT_PROVIDERS,
        allow_spinning=parameters.allow_spinning,
    )


def batch_rows_buckets(max_batch_size: int) -> list[float]:
    """Histogram edges for formed batch sizes: powers of two below `max_batch_size`, then
    the limit itself, so a full batch lands in a bucket of its own."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    edges = [float(1 << i) for i in range(max_batch_size.bit_length()) if (1 << i) < max_batch_size]
    return [*edges, float(max_batch_size)]


def pick_providers(wanted: Sequence[str], available: Sequence[str]) -> list[str]:
    """The wanted providers this ONNX Runtime build has, in the wanted order; CPU as last resort."""
    chosen = [provider for provider in wanted if provider in available]
    if "CPUExecutionProvider" not in chosen:
        chosen.append("CPUExecutionProvider")
    return chosen


def split_rows(stacked: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    """Split a batch output back into one array per request, `sizes[i]` rows each."""
    if sum(sizes) != stacked.shape[0]:
        raise ValueError(f"batch has {stacked.shape[0]} rows but requests sum to {sum(sizes)}")
    return np.split(stacked, np.cumsum(sizes)[:-1].tolist()) if sizes else []


class OnnxEncoder:
    """Runs the exported sentence-embedding graph."""

    def __init__(self, onnx_path: str | Path, config: EncoderConfig):
        import onnxruntime as ort  # imported here so the pure helpers above load without it

        onnx_path = Path(onnx_path)
        if not onnx_path.is_file():
            raise FileNotFoundError(
                f"model '{config.model_name}': {onnx_path} not found; run `python -m tools build-models`"
            )
        options = ort.SessionOptions()
        if config.intra_op_threads:
            options.intra_op_num_threads = config.intra_op_threads
        if not config.allow_spinning:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = pick_providers(config.providers, ort.get_available_providers())
        self.session = ort.InferenceSession(str(onnx_path), options, providers=providers)
        self.providers = self.session.get_providers()
        self.config = config

    def embed(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """FP32 [rows, 384] unit-length embeddings of a padded batch."""
        (embedding,) = self.session.run(
            [ONNX_OUTPUT],
            {"input_ids": input_ids.astype(np.int64, copy=False),
             "attention_mask": attention_mask.astype(np.int64, copy=False)},
        )
        return embedding.astype(np.float32, copy=False)
