"""Triton adapter for `llm_infer`: the `llm` model through plain (unary) infer.

Triton's HTTP infer and gRPC ModelInfer do not serve decoupled models, so this
non-decoupled model forwards each request to `llm` over BLS (without streaming) and answers
with its single response. `execute` returns at once and each request is answered from a
worker thread through its response sender, so a long generation does not hold this
model's instance: requests reach the engine as they arrive and batch there.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.common.tenant_auth import AUTH_FAILED
from python_backends.llm.config import LLMInferParameters
from python_backends.llm.service import INPUT_NAMES, INVALID_REQUEST

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
OUTPUT_NAMES = ["text_output", "finish_reason", "prompt_tokens", "completion_tokens"]


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        parameters = LLMInferParameters.from_parameters(args["model_name"], params)
        self.target = parameters.target_model
        self.pool = ThreadPoolExecutor(max_workers=parameters.max_in_flight, thread_name_prefix="llm-infer")

    def execute(self, requests):
        for request in requests:
            inputs = [tensor for name in INPUT_NAMES if name != "stream"
                      if (tensor := pb_utils.get_input_tensor_by_name(request, name)) is not None]
            inputs.append(pb_utils.Tensor("stream", np.array([False])))
            # The request parameters (the tenant above all) travel with it to the engine.
            parameters = json.loads(request.parameters() or "{}")
            self.pool.submit(self._forward, request.get_response_sender(), inputs, parameters)
        return None

    def _forward(self, sender, inputs, parameters):
        try:
            bls = pb_utils.InferenceRequest(model_name=self.target, inputs=inputs,
                                            requested_output_names=OUTPUT_NAMES, parameters=parameters)
            answer = None
            for response in bls.exec(decoupled=True):
                if response.has_error() or response.output_tensors():
                    answer = response  # the one response with tensors, or the error
            if answer is None:
                answer = pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"{self.target} returned no response", pb_utils.TritonError.INTERNAL))
            elif answer.has_error():
                message = answer.error().message()
                # Over BLS every error arrives as INTERNAL: the message says what it was.
                code = (pb_utils.TritonError.INVALID_ARG if INVALID_REQUEST in message or AUTH_FAILED in message
                        else pb_utils.TritonError.UNAVAILABLE if "retry" in message else pb_utils.TritonError.INTERNAL)
                answer = pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
            else:
                answer = pb_utils.InferenceResponse(output_tensors=answer.output_tensors())
        except Exception as err:  # answer the client whatever happened
            answer = pb_utils.InferenceResponse(error=pb_utils.TritonError(
                f"{self.target}: {err}", pb_utils.TritonError.INTERNAL))
        sender.send(answer, flags=FINAL)

    def finalize(self):
        self.pool.shutdown(wait=True)
