"""Triton adapter for a bucket encoder model (`encoder_<len>`); the logic lives in `python_backends.embed.encoder`."""

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.common.artifacts import verify_artifacts
from python_backends.embed.encoder import (
    BATCH_ROWS_HISTOGRAM,
    OnnxEncoder,
    batch_rows_buckets,
    parse_encoder_config,
    split_rows,
)


class TritonPythonModel:
    def initialize(self, args):
        config = parse_encoder_config(json.loads(args["model_config"]))
        version_dir = Path(args["model_repository"]) / args["model_version"]
        verify_artifacts(version_dir, args["model_name"], required=["model.onnx"])
        self.encoder = OnnxEncoder(version_dir / "model.onnx", config)
        # A MetricFamily must outlive its Metrics: keep it on the instance.
        name, text = BATCH_ROWS_HISTOGRAM
        self.batch_family = pb_utils.MetricFamily(name=name, description=text, kind=pb_utils.MetricFamily.HISTOGRAM)
        self.batch_rows = self.batch_family.Metric(
            labels={"model": args["model_name"], "version": args["model_version"]},
            buckets=batch_rows_buckets(config.max_batch_size))

    def execute(self, requests):
        # Triton formed this batch from requests of one shape: stack, run once, split back.
        ids = [pb_utils.get_input_tensor_by_name(r, "INPUT_IDS").as_numpy() for r in requests]
        masks = [pb_utils.get_input_tensor_by_name(r, "ATTENTION_MASK").as_numpy() for r in requests]
        embedding = self.encoder.embed(np.concatenate(ids), np.concatenate(masks))
        self.batch_rows.observe(float(embedding.shape[0]))
        return [
            pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("EMBEDDING", rows)])
            for rows in split_rows(embedding, [len(x) for x in ids])
        ]
