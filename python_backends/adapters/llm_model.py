"""Triton adapter for `llm`: a decoupled model whose requests feed one continuous-batching engine.

The request path (authentication, validation, tokenization, the tenant's token quota) and
the responses the engine loop streams back live in `python_backends.llm.service`, which
takes this module's `pb_utils` as a parameter so that unit tests drive it with a fake.
"""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from python_backends.llm.service import INPUT_NAMES, INVALID_REQUEST, LLMService

__all__ = ["INPUT_NAMES", "INVALID_REQUEST", "TritonPythonModel"]


class TritonPythonModel:
    def initialize(self, args):
        self.service = LLMService.from_args(pb_utils, args)

    def execute(self, requests):
        return self.service.execute(requests)  # None: the engine loop answers through each sender

    def finalize(self):
        self.service.finalize(drain_timeout_s=30.0)
