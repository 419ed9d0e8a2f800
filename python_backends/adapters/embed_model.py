"""Triton adapter for `embed`: hands Triton's requests to `python_backends.embed.service`.

The request pipeline (authentication, quota, admission, version routing, bucket lanes over
BLS, reassembly, shadowing, error mapping) lives in `EmbedService`, which takes this
module's `pb_utils` as a parameter so that unit tests drive it with a fake.
"""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from python_backends.embed.service import EmbedService


class TritonPythonModel:
    def initialize(self, args):
        self.service = EmbedService.from_args(pb_utils, args)

    def execute(self, requests):
        return self.service.execute(requests)  # None: each request is answered through its sender

    def finalize(self):
        self.service.finalize()
