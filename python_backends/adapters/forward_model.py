"""Triton adapter of a benchmark instrument: the least a Python model in front of another does.

`bench goodput` serves it on its linger-free server to measure what the Python backend itself
costs on the machine, beside the router: each request's input tensors go over one blocking
BLS call to the model and version its parameters name (`forward_to`, `forward_version`) and
that model's outputs come back as they are, answered on the execute thread. No checks, no
tokenizing, no worker threads: the router's overhead less this one's is what the router's own
work costs.
"""

from __future__ import annotations

import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {name: value["string_value"] for name, value in config.get("parameters", {}).items()}
        self.target = parameters["forward_to"]
        self.version = int(parameters["forward_version"])
        self.outputs = [output["name"] for output in config["output"]]

    def execute(self, requests):
        responses = []
        for request in requests:
            answer = pb_utils.InferenceRequest(model_name=self.target, model_version=self.version,
                                               inputs=request.inputs(),
                                               requested_output_names=self.outputs).exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse(error=answer.error()))
            else:
                responses.append(pb_utils.InferenceResponse(output_tensors=answer.output_tensors()))
        return responses
