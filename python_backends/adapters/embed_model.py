"""Triton adapter for `embed`: tensors in, BLS calls to the bucket models, tensors out.

All decisions (validation, tokenization, bucket choice, padding, reassembly) live in
`python_backends.embed` and `python_backends.buckets`.
"""

import asyncio
import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from python_backends.buckets import reassemble
from python_backends.embed import (
    BUCKET_COUNTERS,
    ROUTER_COUNTERS,
    EmbedRouter,
    is_scheduler_rejection,
    parse_router_config,
)
from python_backends.errors import InvalidInput
from python_backends.tokenization import TextTokenizer


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        config = parse_router_config(args["model_name"], params)
        version_dir = Path(args["model_repository"]) / args["model_version"]
        self.router = EmbedRouter(config, TextTokenizer.from_file(version_dir / "tokenizer.json"))
        # A MetricFamily must outlive its Metrics: keep the families on the instance.
        self.metric_families = {
            name: pb_utils.MetricFamily(name=name, description=text, kind=pb_utils.MetricFamily.COUNTER)
            for name, text in ROUTER_COUNTERS.items()
        }
        model = args["model_name"]
        self.truncated = self.metric_families["embed_truncated_rows_total"].Metric(labels={"model": model})
        self.bucket_metrics = {
            length: tuple(
                self.metric_families[name].Metric(labels={"model": model, "bucket": str(length)})
                for name in BUCKET_COUNTERS
            )
            for length in config.bucket_lens
        }

    def _bucket_error(self, model_name, error):
        code = error.code()
        if is_scheduler_rejection(error.message()) or not pb_utils.is_model_ready(model_name):
            # Rejected by the bucket's queue policy, or the bucket is not loaded: the server
            # is busy or changing, not broken; tell the client to retry.
            code = pb_utils.TritonError.UNAVAILABLE
        return pb_utils.InferenceResponse(
            error=pb_utils.TritonError(f"bucket model {model_name}: {error.message()}", code)
        )

    async def execute(self, requests):
        return list(await asyncio.gather(*(self._serve(request) for request in requests)))

    async def _serve(self, request):
        try:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            prepared = self.router.prepare(text.reshape(-1).tolist(), request.parameters())
        except InvalidInput as err:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(err), pb_utils.TritonError.INVALID_ARG))
        responses = [None] * len(prepared.chunks)

        async def run_lane(lane):
            for index in lane:
                chunk = prepared.chunks[index]
                responses[index] = await pb_utils.InferenceRequest(
                    model_name=chunk.model_name,
                    inputs=[
                        pb_utils.Tensor("INPUT_IDS", chunk.input_ids),
                        pb_utils.Tensor("ATTENTION_MASK", chunk.attention_mask),
                    ],
                    requested_output_names=["EMBEDDING"],
                ).async_exec()
                if responses[index].has_error():
                    return

        await asyncio.gather(*(run_lane(lane) for lane in prepared.lanes()))
        # A lane stops at its first failed chunk (later ones stay None); report that failure.
        for chunk, response in zip(prepared.chunks, responses, strict=True):
            if response is not None and response.has_error():
                return self._bucket_error(chunk.model_name, response.error())
        outputs = [pb_utils.get_output_tensor_by_name(r, "EMBEDDING").as_numpy() for r in responses]
        for chunk in prepared.chunks:
            rows, real, padded = self.bucket_metrics[chunk.chunk.bucket_len]
            rows.increment(len(chunk.chunk.row_indices))
            real.increment(chunk.num_real_tokens)
            padded.increment(chunk.input_ids.size)
        if prepared.num_truncated:
            self.truncated.increment(prepared.num_truncated)
        embedding = reassemble(len(prepared.token_counts), prepared.chunk_plan, outputs)
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor("EMBEDDING", embedding),
                pb_utils.Tensor("TOKENS", prepared.token_counts.reshape(-1, 1)),
            ]
        )
