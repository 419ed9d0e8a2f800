"""A tensor model's rows for the router's service: the graph's own input tensors in, its own
outputs back (`python_backends.embed.service` calls these methods; `TextCodec` is the text
kinds'). Outputs of a shadowed request are compared by their largest absolute difference."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from python_backends.common.drift import DriftMeasure
from python_backends.embed.router import PreparedRequest
from python_backends.tensor.router import (
    TensorRouter,
    TensorRouterConfig,
    num_padded_positions,
    parse_tensor_router_config,
)


class TensorCodec:
    """The service's view of a tensor model's requests and answers."""

    drift = DriftMeasure.ABS_DIFF

    def __init__(self, router: TensorRouter):
        self.router = router
        self.config = router.config
        self.output_names = router.config.output_names

    def prepare(self, pb, request, options) -> PreparedRequest:
        tensors = {}
        for name in (spec.name for spec in self.config.inputs):
            tensor = pb.get_input_tensor_by_name(request, name)
            if tensor is not None:
                tensors[name] = tensor.as_numpy()
        return self.router.prepare(tensors, options)

    def reassemble(self, prepared: PreparedRequest, chunk_outputs: list[dict[str, np.ndarray]]) -> dict:
        return self.router.reassemble(prepared, chunk_outputs)

    def answer(self, prepared: PreparedRequest, outputs: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
        return [(name, outputs[name]) for name in self.output_names]

    def compared(self, outputs: dict[str, np.ndarray]) -> np.ndarray:
        """Every output of a row side by side, so the drift is the largest difference in any of them."""
        rows = len(next(iter(outputs.values())))
        return np.concatenate([outputs[name].reshape(rows, -1).astype(np.float64) for name in self.output_names],
                              axis=1)

    @staticmethod
    def padded(prepared_chunk) -> int:
        return num_padded_positions(prepared_chunk.chunk)


def tensor_codec(model: str, parameters: Mapping[str, str], version_dir: Path) -> tuple[TensorRouterConfig,
                                                                                        TensorCodec]:
    """A tensor model's router config and codec, from its config parameters (no files needed)."""
    config = parse_tensor_router_config(model, parameters)
    return config, TensorCodec(TensorRouter(config))
