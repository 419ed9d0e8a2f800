"""The vLLM backend's model folder from the spec (`tools.repository.vllm_backend`) and the
`vllm-config` command that writes it, with the commands and files docs/vllm.md shows."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from tests.doc_examples import REPO, blocks, run_shown, shown
from tools.cli import main
from tools.cli import vllm_config as command
from tools.repository import vllm_backend
from tools.repository.vllm_backend import VLLMConfigError, vllm_model, write_model_folder
from tools.spec.serving import LLMModelSpec, load_spec

# Every field of vLLM 0.5.5's `EngineArgs` and `AsyncEngineArgs` (vllm/engine/arg_utils.py of
# the 0.5.5 release, the vLLM of Triton's 24.10 vLLM container): the backend passes model.json
# to `AsyncEngineArgs(**...)`, so a key outside this list fails the model's load.
VLLM_0_5_5_ASYNC_ENGINE_ARGS = frozenset({
    "model", "served_model_name", "tokenizer", "skip_tokenizer_init", "tokenizer_mode", "trust_remote_code",
    "download_dir", "load_format", "dtype", "kv_cache_dtype", "quantization_param_path", "seed", "max_model_len",
    "worker_use_ray", "distributed_executor_backend", "pipeline_parallel_size", "tensor_parallel_size",
    "max_parallel_loading_workers", "block_size", "enable_prefix_caching", "disable_sliding_window",
    "use_v2_block_manager", "swap_space", "cpu_offload_gb", "gpu_memory_utilization", "max_num_batched_tokens",
    "max_num_seqs", "max_logprobs", "disable_log_stats", "revision", "code_revision", "rope_scaling", "rope_theta",
    "tokenizer_revision", "quantization", "enforce_eager", "max_context_len_to_capture", "max_seq_len_to_capture",
    "disable_custom_all_reduce", "tokenizer_pool_size", "tokenizer_pool_type", "tokenizer_pool_extra_config",
    "limit_mm_per_prompt", "enable_lora", "max_loras", "max_lora_rank", "enable_prompt_adapter",
    "max_prompt_adapters", "max_prompt_adapter_token", "fully_sharded_loras", "lora_extra_vocab_size",
    "long_lora_scaling_factors", "lora_dtype", "max_cpu_loras", "device", "num_scheduler_steps",
    "ray_workers_use_nsight", "num_gpu_blocks_override", "num_lookahead_slots", "model_loader_extra_config",
    "ignore_patterns", "preemption_mode", "scheduler_delay_factor", "enable_chunked_prefill",
    "guided_decoding_backend", "speculative_model", "speculative_model_quantization",
    "speculative_draft_tensor_parallel_size", "num_speculative_tokens", "speculative_max_model_len",
    "speculative_disable_by_batch_size", "ngram_prompt_lookup_max", "ngram_prompt_lookup_min",
    "spec_decoding_acceptance_method", "typical_acceptance_sampler_posterior_threshold",
    "typical_acceptance_sampler_posterior_alpha", "qlora_adapter_name_or_path",
    "disable_logprobs_during_spec_decoding", "otlp_traces_endpoint", "collect_detailed_traces",
    "engine_use_ray", "disable_log_requests",
})
# What the r24.10 backend's `auto_complete_config` declares (src/model.py): name, type, dims, optional.
BACKEND_INPUTS_24_10 = [("text_input", "TYPE_STRING", [1], False), ("stream", "TYPE_BOOL", [1], True),
                        ("sampling_parameters", "TYPE_STRING", [1], True),
                        ("exclude_input_in_output", "TYPE_BOOL", [1], True)]
BACKEND_OUTPUTS_24_10 = [("text_output", "TYPE_STRING", [-1])]

WEIGHTS = "/weights/SmolLM2-135M-Instruct"
GUIDE = REPO / "docs" / "vllm.md"

LLM_TABLE = """
[hardware.cpu]
max_instances = 1
intra_op_threads = 0

[llm_models.chat]
versions = [1]
batching = "{batching}"
kv_cache_mb = 64
block_size = 16
max_num_seqs = 8
max_num_batched_tokens = 64
max_model_len = 512
default_max_tokens = 32
ttft_p95_ms = 1000
tpot_p95_ms = 400
threads = 0
"""


def llm(**changes) -> LLMModelSpec:
    """The spec's `llm` model as serving.toml has it, with `changes`."""
    model = LLMModelSpec(name="llm", versions=(1,), batching="continuous", kv_cache_mb=384, block_size=16,
                         max_num_seqs=96, max_num_batched_tokens=256, max_model_len=2048, default_max_tokens=128,
                         ttft_p95_ms=1000, tpot_p95_ms=400, threads=0)
    return replace(model, **changes)


# --- the pure generator -----------------------------------------------------------------------


def test_the_engine_runs_under_the_specs_limits():
    args = vllm_model(llm(), WEIGHTS, 0.8).engine_args
    assert args["model"] == WEIGHTS
    assert (args["max_num_seqs"], args["max_num_batched_tokens"], args["max_model_len"], args["block_size"]) == \
        (96, 256, 2048, 16)
    assert args["gpu_memory_utilization"] == 0.8
    assert args["preemption_mode"] == "recompute"
    assert args["disable_log_stats"] is False  # the vllm:* metrics come from the engine's stats


def test_the_spec_served_is_the_one_in_serving_toml():
    (model,) = [m for m in load_spec(REPO / "serving.toml").llm_models if m.name == "llm"]
    assert vllm_model(model, WEIGHTS).engine_args == vllm_model(llm(), WEIGHTS).engine_args


@pytest.mark.parametrize("changes", [{}, {"max_num_batched_tokens": 4096}, {"dtype": "float16"}])
def test_every_key_is_an_async_engine_arg_of_vllm_0_5_5(changes):
    assert set(vllm_model(llm(**changes), WEIGHTS).engine_args) <= VLLM_0_5_5_ASYNC_ENGINE_ARGS


@pytest.mark.parametrize(("dtype", "written"), [("auto", "bfloat16"), ("bfloat16", "bfloat16"),
                                                ("float16", "float16"), ("float32", "float32")])
def test_dtype_auto_is_bfloat16_as_on_the_kits_gpu_engine(dtype, written):
    assert vllm_model(llm(dtype=dtype), WEIGHTS).engine_args["dtype"] == written


def test_a_step_budget_under_the_context_chunks_prefills_without_prefix_caching():
    folder = vllm_model(llm(max_num_batched_tokens=256, max_model_len=2048), WEIGHTS)
    assert folder.engine_args["enable_chunked_prefill"] is True
    assert folder.engine_args["enable_prefix_caching"] is False  # vLLM 0.5.5 raises on both at once
    assert any(note.startswith("prefix caching off") and "256" in note and "2048" in note for note in folder.notes)


@pytest.mark.parametrize("budget", [2048, 4096])
def test_a_step_budget_that_holds_a_whole_prompt_keeps_prefix_caching(budget):
    folder = vllm_model(llm(max_num_batched_tokens=budget, max_model_len=2048), WEIGHTS)
    assert folder.engine_args["enable_chunked_prefill"] is False
    assert folder.engine_args["enable_prefix_caching"] is True
    assert any(note.startswith("prefills are not chunked") for note in folder.notes)


def test_the_notes_say_what_the_vllm_model_does_differently():
    notes = "\n".join(vllm_model(llm(kv_cache_mb=384, default_max_tokens=128), WEIGHTS, 0.5).notes)
    assert "0.5 of the GPU's memory" in notes and "384 MB" in notes
    assert "vLLM's 16 tokens, not the spec's 128" in notes
    assert "no tenant authentication, token quotas" in notes


def test_of_several_versions_the_newest_is_served():
    folder = vllm_model(llm(versions=(1, 3, 2)), WEIGHTS)
    assert folder.version == 3
    assert list(folder.config.version_policy.specific.versions) == [3]
    assert set(folder.files()) == {"config.pbtxt", "3/model.json"}
    assert any("serves version 3 only of versions 1, 3, 2" in note for note in folder.notes)


def test_the_config_declares_what_the_24_10_backend_does():
    config = vllm_model(llm(name="chat"), WEIGHTS).config
    assert (config.name, config.backend, config.max_batch_size) == ("chat", "vllm", 0)
    assert config.model_transaction_policy.decoupled
    assert [(t.name, mc.DataType.Name(t.data_type), list(t.dims), t.optional) for t in config.input] == \
        BACKEND_INPUTS_24_10
    assert [(t.name, mc.DataType.Name(t.data_type), list(t.dims)) for t in config.output] == BACKEND_OUTPUTS_24_10
    assert [(g.count, g.kind) for g in config.instance_group] == [(1, mc.ModelInstanceGroup.KIND_MODEL)]
    assert config.parameters["REPORT_CUSTOM_METRICS"].string_value == "yes"


def test_the_config_text_round_trips_under_its_header():
    folder = vllm_model(llm(), WEIGHTS)
    text = folder.config_text(("made here", "", "for there"))
    assert text.startswith("# made here\n#\n# for there\n")
    assert text_format.Parse(text, mc.ModelConfig()) == folder.config
    assert json.loads(folder.model_json()) == folder.engine_args


@pytest.mark.parametrize(("changes", "path", "fraction", "says"), [
    ({"batching": "static"}, WEIGHTS, 0.9, "batching = 'static': vLLM batches continuously only"),
    ({"batching": "static_retiring"}, WEIGHTS, 0.9, "batching = 'static_retiring'"),
    ({"device": "cpu"}, WEIGHTS, 0.9, 'device = "cpu": the vLLM container serves on GPUs'),
    ({"block_size": 24}, WEIGHTS, 0.9, "block_size = 24: vLLM 0.5.5 takes one of 8, 16, 32, 128"),
    ({}, "/weights/smollm2.Q4_1.gguf", 0.9, "model /weights/smollm2.Q4_1.gguf is a GGUF file"),
    ({}, "/weights/SMOLLM2.GGUF", 0.9, "is a GGUF file"),
    ({}, " ", 0.9, "the model path is empty"),
    ({}, WEIGHTS, 0.0, "gpu_memory_utilization = 0: a fraction of the GPU's memory, within (0, 1]"),
    ({}, WEIGHTS, 1.5, "gpu_memory_utilization = 1.5"),
])
def test_a_spec_vllm_cannot_serve_is_refused_with_the_offending_value(changes, path, fraction, says):
    with pytest.raises(VLLMConfigError, match=r"^\[llm_models\.llm\] cannot be served by Triton's vLLM backend: ") \
            as refused:
        vllm_model(llm(**changes), path, fraction)
    assert says in str(refused.value)


def test_every_problem_is_named_at_once():
    with pytest.raises(VLLMConfigError) as refused:
        vllm_model(llm(batching="static", device="cpu", block_size=12), "m.gguf", 2.0)
    message = str(refused.value)
    for problem in ("batching = 'static'", 'device = "cpu"', "block_size = 12", "model m.gguf is a GGUF file",
                    "gpu_memory_utilization = 2"):
        assert problem in message


def test_a_device_of_auto_or_cuda_is_served():
    for device in ("auto", "cuda"):
        assert vllm_model(llm(device=device), WEIGHTS).engine_args["model"] == WEIGHTS


# --- writing the folder -----------------------------------------------------------------------


def test_a_new_folder_is_written_whole(tmp_path):
    folder = vllm_model(llm(), WEIGHTS)
    written = write_model_folder(tmp_path / "repo", folder, ("header",))
    assert written == [tmp_path / "repo/llm/config.pbtxt", tmp_path / "repo/llm/1/model.json"]
    assert (tmp_path / "repo/llm/config.pbtxt").read_text() == folder.config_text(("header",))
    assert json.loads((tmp_path / "repo/llm/1/model.json").read_text()) == folder.engine_args
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["llm"]  # no staging folder left


def test_an_existing_folder_is_left_alone_without_force(tmp_path):
    (tmp_path / "llm/1").mkdir(parents=True)
    (tmp_path / "llm/1/model.json").write_text("{}")
    refusal = re.escape("llm exists; --force replaces its config.pbtxt and 1/model.json")
    with pytest.raises(VLLMConfigError, match=refusal):
        write_model_folder(tmp_path, vllm_model(llm(), WEIGHTS))
    assert (tmp_path / "llm/1/model.json").read_text() == "{}"
    assert not (tmp_path / "llm/config.pbtxt").exists()


def test_force_replaces_the_two_files_and_keeps_the_rest(tmp_path):
    (tmp_path / "llm/1").mkdir(parents=True)
    (tmp_path / "llm/1/model.json").write_text("{}")
    (tmp_path / "llm/config.pbtxt").write_text("old")
    (tmp_path / "llm/1/multi_lora.json").write_text("{}")
    folder = vllm_model(llm(), WEIGHTS)
    write_model_folder(tmp_path, folder, force=True)
    assert json.loads((tmp_path / "llm/1/model.json").read_text()) == folder.engine_args
    assert (tmp_path / "llm/config.pbtxt").read_text() == folder.config_text()
    assert (tmp_path / "llm/1/multi_lora.json").read_text() == "{}"
    assert sorted(p.name for p in (tmp_path / "llm").rglob("*")) == ["1", "config.pbtxt", "model.json",
                                                                     "multi_lora.json"]


def test_a_file_in_the_folders_place_is_refused(tmp_path):
    (tmp_path / "llm").write_text("not a folder")
    with pytest.raises(VLLMConfigError, match="exists and is not a folder"):
        write_model_folder(tmp_path, vllm_model(llm(), WEIGHTS), force=True)


def test_a_write_that_fails_leaves_no_half_folder(tmp_path, monkeypatch):
    def fail(self, target):
        raise OSError("disk full")

    monkeypatch.setattr(vllm_backend.Path, "rename", fail)
    with pytest.raises(OSError, match="disk full"):
        write_model_folder(tmp_path, vllm_model(llm(), WEIGHTS))
    assert list(tmp_path.iterdir()) == []


# --- the command ------------------------------------------------------------------------------


def cli(capsys, *args):
    code = main(["vllm-config", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_writes_the_folder_and_prints_the_notes(tmp_path, capsys):
    code, out, err = cli(capsys, "llm", "--out", str(tmp_path), "--model-path", WEIGHTS,
                         "--gpu-memory-utilization", "0.6")
    assert (code, err) == (0, "")
    assert f"wrote {tmp_path}/llm/config.pbtxt\nwrote {tmp_path}/llm/1/model.json\n" in out
    assert "note: KV cache: what is left of 0.6 of the GPU's memory" in out
    model_json = json.loads((tmp_path / "llm/1/model.json").read_text())
    assert (model_json["model"], model_json["gpu_memory_utilization"]) == (WEIGHTS, 0.6)
    config = (tmp_path / "llm/config.pbtxt").read_text()
    assert re.match(r"# Generated by `python -m tools vllm-config llm` from serving.toml \(sha256 [0-9a-f]{16}\)",
                    config)
    assert "nvcr.io/nvidia/tritonserver:24.10-vllm-python-py3 (vLLM 0.5.5)" in config


def test_without_a_model_path_the_converted_folder_on_this_machine_is_named(tmp_path, capsys, monkeypatch):
    repository = tmp_path / "model_repository"
    monkeypatch.setattr(command, "DEFAULT_MODEL_REPOSITORY", repository)
    code, out, _ = cli(capsys, "llm", "--out", str(tmp_path / "out"))
    assert code == 0
    assert json.loads((tmp_path / "out/llm/1/model.json").read_text())["model"] == str(repository / "llm/1")
    assert f"note: model.json names {repository / 'llm/1'} (not there yet: `python -m tools build-models` " \
           "makes it), a path on this machine; --model-path sets the one on the GPU node" in out


def test_a_source_folder_is_the_default_model_path(tmp_path):
    source = tmp_path / "Qwen2.5-0.5B-Instruct"
    assert command.default_model_path(llm(source=source)) == source
    assert command.default_model_path(llm(source=tmp_path / "q.gguf")).parts[-2:] == ("llm", "1")
    assert command.default_model_path(llm(versions=(1, 2))).parts[-2:] == ("llm", "2")


def test_a_refused_spec_writes_nothing(tmp_path, capsys):
    spec = tmp_path / "serving.toml"
    spec.write_text(LLM_TABLE.format(batching="static"))
    code, out, err = cli(capsys, "chat", "--out", str(tmp_path / "out"), "--spec", str(spec), "--model-path", WEIGHTS)
    assert (code, out) == (2, "")
    assert err.startswith("error: [llm_models.chat] cannot be served by Triton's vLLM backend: batching = 'static'")
    assert not (tmp_path / "out").exists()


def test_a_name_that_is_no_llm_of_the_spec_is_refused(tmp_path, capsys):
    code, _, err = cli(capsys, "embed", "--out", str(tmp_path))
    assert code == 2
    assert "'embed' is a bucketed model of " in err and "; its LLMs ([llm_models]): llm" in err
    code, _, err = cli(capsys, "nope", "--out", str(tmp_path))
    assert code == 2 and "'nope' is not a model of " in err
    assert list(tmp_path.iterdir()) == []


def test_a_spec_that_does_not_load_is_an_error(tmp_path, capsys):
    code, _, err = cli(capsys, "llm", "--out", str(tmp_path), "--spec", str(tmp_path / "missing.toml"))
    assert code == 2 and "not found" in err


def test_the_command_refuses_an_existing_folder_unless_forced(tmp_path, capsys):
    assert cli(capsys, "llm", "--out", str(tmp_path), "--model-path", WEIGHTS)[0] == 0
    code, out, err = cli(capsys, "llm", "--out", str(tmp_path), "--model-path", "/elsewhere")
    assert (code, out) == (2, "")
    assert "exists; --force replaces" in err
    assert json.loads((tmp_path / "llm/1/model.json").read_text())["model"] == WEIGHTS
    assert cli(capsys, "llm", "--out", str(tmp_path), "--model-path", "/elsewhere", "--force")[0] == 0
    assert json.loads((tmp_path / "llm/1/model.json").read_text())["model"] == "/elsewhere"


@pytest.mark.parametrize("fraction", ["0", "1.5", "-0.1"])
def test_the_fraction_is_checked_where_it_is_declared(tmp_path, capsys, fraction):
    with pytest.raises(SystemExit) as exited:
        main(["vllm-config", "llm", "--out", str(tmp_path), "--gpu-memory-utilization", fraction])
    assert exited.value.code == 2
    assert "must be within (0, 1]" in capsys.readouterr().err


# --- the guide --------------------------------------------------------------------------------


def _guide_block(language: str) -> str:
    (block,) = [b for b in blocks((GUIDE,)) if b.language == language and b.body.startswith(
        "{" if language == "json" else "name:")]
    return block.body


def test_the_guides_commands_write_the_files_it_shows(tmp_path):
    first = run_shown(shown("docs/vllm.md", "python -m tools vllm-config llm --out vllm_repository --model-path "
                                            "/weights/SmolLM2-135M-Instruct"), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    folder = tmp_path / "vllm_repository/llm"
    assert json.loads((folder / "1/model.json").read_text()) == json.loads(_guide_block("json"))
    config = "".join(line for line in (folder / "config.pbtxt").read_text().splitlines(keepends=True)
                     if not line.startswith("#"))
    assert config.strip() == _guide_block("text").strip()
    again = run_shown(shown("docs/vllm.md", "python -m tools vllm-config llm --out vllm_repository --model-path "
                                            "/weights/SmolLM2-135M-Instruct --gpu-memory-utilization 0.45 --force"),
                      cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert json.loads((folder / "1/model.json").read_text())["gpu_memory_utilization"] == 0.45
