"""Triton adapter for a bucket model of a `tensor` model (`<prefix><len>` or `<prefix>fixed`);
the logic lives in `python_backends.tensor.bucket`."""

import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from python_backends.common.artifacts import verify_artifacts
from python_backends.common.cpu_priority import lower_priority
from python_backends.embed.encoder import batch_rows_metric
from python_backends.tensor.bucket import OnnxTensorModel, parse_tensor_bucket_config


class TritonPythonModel:
    def initialize(self, args):
        config = parse_tensor_bucket_config(json.loads(args["model_config"]))
        # Before the session: loading a model (a reload after a crash, a canary version) must not
        # take the cores from the instances serving; threads made later inherit the nice value.
        lower_priority(config.cpu_nice)
        version_dir = Path(args["model_repository"]) / args["model_version"]
        verify_artifacts(version_dir, args["model_name"], required=["model.onnx"])
        self.model = OnnxTensorModel(version_dir / "model.onnx", config)
        # A MetricFamily must outlive its Metrics: keep it on the instance.
        self.batch_family, self.batch_rows = batch_rows_metric(pb_utils, args["model_name"], args["model_version"],
                                                               config.max_batch_size)

    def execute(self, requests):
        # Triton formed this batch from requests of one shape: stack, run once, split back.
        names = self.model.config.input_names
        inputs = [{name: pb_utils.get_input_tensor_by_name(r, name).as_numpy() for name in names} for r in requests]
        answers = self.model.run_requests(inputs)
        self.batch_rows.observe(float(sum(len(tensors[names[0]]) for tensors in inputs)))
        return [pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(name, array) for name, array in answer.items()])
                for answer in answers]
