"""Triton adapter for a tensor model's router: `python_backends.embed.service` with the tensor
codec (`python_backends.tensor.codec`): the graph's own tensors in and out, bucketed along the
model's variable axis."""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from python_backends.embed.service import EmbedService
from python_backends.tensor.codec import tensor_codec


class TritonPythonModel:
    def initialize(self, args):
        self.service = EmbedService.from_args(pb_utils, args, make_codec=tensor_codec)

    def execute(self, requests):
        return self.service.execute(requests)  # None: each request is answered through its sender

    def finalize(self):
        self.service.finalize()
