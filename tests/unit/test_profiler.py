"""The profiler's own configs (what it loads on the server to measure c(b) and the router
overhead) and the name it gives a profile."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from python_backends.embed.admission import ADMIT_ALL, AdmissionPolicy
from tools.bench.harness import profile_name_for_gpu
from tools.bench.loadgen import MIN_P95_SAMPLES
from tools.bench.profiler import probe_knobs, probe_rows, profiled_version, profiling_router_config
from tools.cli.profile import add_arguments
from tools.repository.sources import served_graph
from tools.spec.serving import load_spec


def test_the_overhead_probe_router_has_one_instance_and_admits_everything():
    spec = load_spec()
    model = spec.models[0]
    config = profiling_router_config(model, spec, {length: 8 for length in model.bucket_lens}, served_graph(model))
    assert config.name == model.name
    assert [group.count for group in config.instance_group] == [1]
    assert config.parameters["max_concurrent_requests"].string_value == "1"  # one request at a time
    admission = AdmissionPolicy.from_json(config.parameters["admission"].string_value)
    assert admission == ADMIT_ALL
    assert config.dynamic_batching.default_queue_policy.max_queue_size == 0  # unbounded: nothing refused
    assert "16:8" in config.parameters["bucket_max_batch"].string_value  # the probes' batch limits


def test_bucket_probes_batch_nothing_on_their_own():
    knobs = probe_knobs("encoder_16", 32)
    assert (knobs.max_batch_size, knobs.preferred_batch_size, knobs.max_queue_delay_us) == (32, 1, 0)
    assert knobs.instance_count == 1 and knobs.max_queue_size == 0


def test_the_profile_measures_the_version_that_serves_most_traffic():
    model = load_spec().models[0]
    assert profiled_version(model) == 1  # serving.toml: traffic = { 1 = 100 }
    assert profiled_version(replace(model, traffic={1: 10.0, 2: 90.0})) == 2
    assert profiled_version(replace(model, traffic={1: 50.0, 2: 50.0})) == 1
    assert profiled_version(replace(model, versions=(3, 4), traffic={})) == 3


@pytest.mark.parametrize(("gpu", "name"), [
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A100 80GB PCIe", "a100"),
    ("Tesla V100-SXM2-16GB", "v100"),
    ("Tesla T4", "t4"),
    ("NVIDIA L4", "l4"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("NVIDIA RTX A6000", "rtxa6000"),
    ("Quadro RTX 8000", "rtx8000"),
])
def test_a_gpu_profile_is_named_for_the_gpu_model_without_memory_or_form_factor(gpu, name):
    assert profile_name_for_gpu(gpu) == name


def test_a_gpu_name_with_no_model_word_gives_the_generic_name():
    assert profile_name_for_gpu("") == "gpu"
    assert profile_name_for_gpu("NVIDIA") == "gpu"
    assert profile_name_for_gpu("  ") == "gpu"


def test_probe_rows_are_full_length_ids_the_tokenizer_can_make():
    import numpy as np

    rows = probe_rows(np.random.default_rng(0), 4, 16, vocab=500, token_types=True)
    assert sorted(rows) == ["ATTENTION_MASK", "INPUT_IDS", "TOKEN_TYPE_IDS"]
    assert rows["INPUT_IDS"].shape == (4, 16) and rows["INPUT_IDS"].max() < 500
    assert rows["ATTENTION_MASK"].all() and not rows["TOKEN_TYPE_IDS"].any()
    assert "TOKEN_TYPE_IDS" not in probe_rows(np.random.default_rng(0), 1, 8, vocab=30522, token_types=False)


def test_profile_refuses_an_overhead_of_too_few_requests_for_a_p95():
    # Of 10 requests the p95 is mostly the slowest: one late answer would decide the config.
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    assert parser.parse_args(["--overhead-requests", str(MIN_P95_SAMPLES)]).overhead_requests == 20
    with pytest.raises(argparse.ArgumentError, match=r"must be >= 20 \(a p95 of fewer requests is mostly"):
        parser.parse_args(["--overhead-requests", "10"])
