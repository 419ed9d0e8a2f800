"""Triton adapter for a bucket encoder model (`encoder_<len>`); the logic lives in `python_backends.encoder`."""

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.encoder import OnnxEncoder, parse_encoder_config, split_rows


class TritonPythonModel:
    def initialize(self, args):
        config = parse_encoder_config(json.loads(args["model_config"]))
        version_dir = Path(args["model_repository"]) / args["model_version"]
        self.encoder = OnnxEncoder(version_dir / "model.onnx", config)

    def execute(self, requests):
        # Triton formed this batch from requests of one shape: stack, run once, split back.
        ids = [pb_utils.get_input_tensor_by_name(r, "INPUT_IDS").as_numpy() for r in requests]
        masks = [pb_utils.get_input_tensor_by_name(r, "ATTENTION_MASK").as_numpy() for r in requests]
        embedding = self.encoder.embed(np.concatenate(ids), np.concatenate(masks))
        return [
            pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("EMBEDDING", rows)])
            for rows in split_rows(embedding, [len(x) for x in ids])
        ]
