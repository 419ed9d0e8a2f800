"""The profiler's own configs: what it loads on the server to measure c(b) and the router overhead."""

from __future__ import annotations

from dataclasses import replace

from python_backends.admission import ADMIT_ALL, AdmissionPolicy
from tools.profiler import probe_knobs, profiled_version, profiling_router_config
from tools.spec import load_spec


def test_the_overhead_probe_router_has_one_instance_and_admits_everything():
    spec = load_spec()
    model = spec.models[0]
    config = profiling_router_config(model, spec, {length: 8 for length in model.bucket_lens})
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
