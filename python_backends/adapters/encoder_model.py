"""Triton adapter for a bucket model (`<prefix><len>`); the logic lives in `python_backends.embed.encoder`."""

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.common.artifacts import verify_artifacts
from python_backends.common.cpu_priority import lower_priority
from python_backends.embed.encoder import OnnxEncoder, batch_rows_metric, parse_encoder_config, split_rows


class TritonPythonModel:
    def initialize(self, args):
        config = parse_encoder_config(json.loads(args["model_config"]))
        # Before the session: loading a model (a reload after a crash, a canary version) must not
        # take the cores from the instances serving; threads made later inherit the nice value.
        lower_priority(config.cpu_nice)
        version_dir = Path(args["model_repository"]) / args["model_version"]
        verify_artifacts(version_dir, args["model_name"], required=["model.onnx"])
        self.encoder = OnnxEncoder(version_dir / "model.onnx", config)
        # A MetricFamily must outlive its Metrics: keep it on the instance.
        self.batch_family, self.batch_rows = batch_rows_metric(pb_utils, args["model_name"], args["model_version"],
                                                               config.max_batch_size)

    def execute(self, requests):
        # Triton formed this batch from requests of one shape: stack, run once, split back.
        config = self.encoder.config
        tensors = {name: [pb_utils.get_input_tensor_by_name(r, name).as_numpy() for r in requests]
                   for name in config.inputs}
        output = self.encoder.run({name: np.concatenate(parts) for name, parts in tensors.items()})
        self.batch_rows.observe(float(output.shape[0]))
        return [
            pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(config.output, rows)])
            for rows in split_rows(output, [len(x) for x in tensors[config.inputs[0]]])
        ]
