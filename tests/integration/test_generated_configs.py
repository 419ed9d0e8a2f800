"""Configs generated from a profile load into tritonserver with exactly the derived knobs."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from tools.repository.configs import plan_all
from tools.server.triton_server import ServerConfig, TritonServer, free_port
from tools.spec.profile import load_profile
from tools.spec.serving import load_spec

from .conftest import EXIT_TIMEOUT_S

REPO = Path(__file__).resolve().parents[2]
SMALL_PROFILE = REPO / "tests" / "data" / "small_profile.json"


def test_served_configs_hold_the_derived_values(tmp_path):
    repository = tmp_path / "repo"
    # Model files are hard-linked, not copied; configs are regenerated from the small profile.
    shutil.copytree(REPO / "model_repository", repository, copy_function=os.link,
                    ignore=shutil.ignore_patterns("config.pbtxt", "__pycache__"))
    result = subprocess.run([sys.executable, "-m", "tools", "gen-config", f"--model-repository={repository}",
                             f"--profile={SMALL_PROFILE}"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    plan = {m.name: m for m in plan_all(load_spec(REPO / "serving.toml"), load_profile(SMALL_PROFILE))}
    for folder in repository.iterdir():  # a model the small profile plans none of (the express model) is not served
        if folder.is_dir() and folder.name not in plan:
            shutil.rmtree(folder)

    config = ServerConfig(model_repository=repository, http_port=free_port(), grpc_port=free_port(),
                          metrics_port=free_port(), host="127.0.0.1",
                          exit_timeout_s=EXIT_TIMEOUT_S)
    # The client is closed before the server stops (an open connection would hold the
    # stopping server for its whole exit timeout).
    with TritonServer(config, log_path=tmp_path / "server.log") as server, \
            contextlib.closing(httpclient.InferenceServerClient(server.http_url)) as client:
        for name, model in plan.items():
            served = client.get_model_config(name)
            assert served["max_batch_size"] == model.config.max_batch_size, name
            assert served["instance_group"][0]["count"] == model.config.instance_group[0].count, name
            if model.adapter in ("llm_model", "llm_infer_model"):  # the engine batches; no Triton batcher
                assert "dynamic_batching" not in served, name
                decoupled = served.get("model_transaction_policy", {}).get("decoupled", False)
                assert decoupled == (model.adapter == "llm_model"), name
                continue
            if model.knobs is None:
                assert served["parameters"]["bucket_max_batch"]["string_value"] == \
                    model.config.parameters["bucket_max_batch"].string_value
                assert served["dynamic_batching"]["priority_levels"] == model.config.dynamic_batching.priority_levels
                served_policy = served["dynamic_batching"]["default_queue_policy"]
                assert int(served_policy["max_queue_size"]) == \
                    model.config.dynamic_batching.default_queue_policy.max_queue_size > 0
                assert served["parameters"]["admission"]["string_value"] == \
                    model.config.parameters["admission"].string_value
                continue
            knobs = model.knobs
            batching = served["dynamic_batching"]
            assert int(batching["max_queue_delay_microseconds"]) == knobs.max_queue_delay_us, name
            policy = batching["default_queue_policy"]
            assert policy["timeout_action"] == "REJECT"
            assert int(policy.get("default_timeout_microseconds", 0)) == knobs.default_timeout_us, name
            assert int(policy["max_queue_size"]) == knobs.max_queue_size, name
            expected_preferred = [knobs.preferred_batch_size] if knobs.preferred_batch_size > 1 else []
            assert [int(b) for b in batching.get("preferred_batch_size", [])] == expected_preferred, name

        # And the generated repository serves: a request that spans every bucket.
        texts = [" ".join(["word"] * n) for n in (5, 25, 50, 100, 200)]
        tensor = httpclient.InferInput("TEXT", [len(texts), 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=object))
        response = client.infer("embed", [tensor])
        assert response.as_numpy("TOKENS").ravel().tolist() == [7, 27, 52, 102, 202]
