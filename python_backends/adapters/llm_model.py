"""Triton adapter for `llm`: a decoupled model whose requests feed one continuous-batching engine.

The request path (authentication, validation, tokenization, the tenant's token quota) and
the responses the engine loop streams back live in `python_backends.llm.service`, which
takes this module's `pb_utils` as a parameter so that unit tests drive it with a fake.
"""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from python_backends.llm.service import INPUT_NAMES, INVALID_REQUEST, LLMService

__all__ = ["INPUT_NAMES", "INVALID_REQUEST", "TritonPythonModel"]

DRAIN_TIMEOUT_S = 20.0  # how long an unload lets in-flight generations finish


class TritonPythonModel:
    def initialize(self, args):
        self.service = LLMService.from_args(pb_utils, args)

    def execute(self, requests):
        return self.service.execute(requests)  # None: the engine loop answers through each sender

    def finalize(self):
        # Shorter than tritonserver's default 30 s exit timeout: a drain that lasts as long as
        # the server waits would leave the model loaded when the server gives up, and the
        # server would exit with an error instead of stopping cleanly.
        self.service.finalize(drain_timeout_s=DRAIN_TIMEOUT_S)
