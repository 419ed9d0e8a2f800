"""The in-process engine benchmark for GPU nodes (`tools.bench.llm_device`), run on the CPU here
with a small random-weight chat model: its figures' arithmetic, and a whole short run."""

from __future__ import annotations

import json

import pytest

from tests.user_models import chat_llm_dir, short_answers_workload
from tools.bench.llm_device import DeviceOptions, Finished, LoopRecord, main, percentile, saturated_figures

CPU_LIMITS = ["--device", "cpu", "--dtype", "float32", "--kv-cache-mb", "4", "--max-num-seqs", "6",
              "--max-num-batched-tokens", "64"]


def test_saturated_figures_count_the_tokens_of_the_window_and_judge_the_requests_added_in_it():
    record = LoopRecord(steps=[(0.0, 0), (1.0, 50), (2.0, 120), (3.0, 200), (4.0, 260)],
                        finished=[Finished(0.5, 0.1, 0.01, 10), Finished(1.5, 0.2, 0.02, 20),
                                  Finished(2.5, 0.4, None, 1), Finished(3.5, 0.3, 0.03, 30)])
    figures = saturated_figures(record, start_s=1.0, end_s=3.0)
    assert figures["saturated_tokens_per_s"] == pytest.approx((200 - 50) / 2.0)
    assert figures["requests_judged"] == 2  # added at 1.5 and 2.5
    assert figures["ttft_p50_ms"] == 200.0 and figures["ttft_p95_ms"] == 400.0
    assert figures["tpot_p95_ms"] == 20.0 and figures["completion_tokens_mean"] == 10.5
    with pytest.raises(ValueError, match="no step"):
        saturated_figures(record, start_s=-1.0, end_s=3.0)


def test_percentile_is_the_nearest_rank():
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0
    assert percentile([3.0, 1.0, 2.0, 4.0], 95) == 4.0
    assert percentile([], 50) is None


def test_options_refuse_what_cannot_be_measured():
    for bad in ({"concurrency": 0}, {"saturate_s": 0.0}, {"saturate_warmup_s": -1.0}, {"light_requests": 0}):
        with pytest.raises(ValueError):
            DeviceOptions(**bad)


@pytest.mark.parametrize("weights", [[], ["--random-weights"]], ids=["the folder's weights", "random weights"])
def test_a_short_run_on_the_cpu_writes_every_figure(tmp_path, weights):
    out = tmp_path / "llm_device.json"
    # Short answers: requests added in the 2 s window finish in it.
    code = main(["--model-dir", str(chat_llm_dir(tmp_path)), *weights, *CPU_LIMITS,
                 "--workload", str(short_answers_workload(tmp_path)), "--saturate-seconds", "2",
                 "--saturate-warmup", "0.5", "--light-requests", "2", "--out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["hardware"]["device"].startswith("CPU") and report["model"]["dtype"] == "float32"
    assert report["model"]["weights"] == ("random" if weights else "the folder's")
    assert report["limits"]["max_num_seqs"] == 6 and report["saturated"]["concurrency"] == 6
    saturated = report["saturated"]
    assert saturated["saturated_tokens_per_s"] > 0 and saturated["requests_judged"] > 0
    assert 0 < saturated["ttft_p50_ms"] <= saturated["ttft_p95_ms"]
    assert report["light_load"]["requests"] == 2 and report["light_load"]["ttft_p50_ms"] > 0
    assert report["decode_limit_tokens_per_s"] > 0 and report["decode_limit"]["num_seqs"] == 6
    assert report["saturated_vs_decode_limit"] == pytest.approx(
        saturated["saturated_tokens_per_s"] / report["decode_limit_tokens_per_s"], abs=1e-3)


def test_a_cpu_run_without_the_spec_s_limits_and_a_gpu_run_without_a_gpu_are_refused(tmp_path, capsys):
    folder = chat_llm_dir(tmp_path)
    assert main(["--model-dir", str(folder), "--device", "cpu", "--out", str(tmp_path / "a.json")]) == 2
    assert "give --kv-cache-mb" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        assert main(["--model-dir", str(folder), "--out", str(tmp_path / "b.json")]) == 2
        assert "no GPU here" in capsys.readouterr().err


def test_the_decode_limit_makes_a_pool_that_holds_its_batch(tmp_path):
    from tools.bench.llm_device import decode_limit, load_model

    model = load_model(chat_llm_dir(tmp_path), "cpu", "float32", random_weights=True)  # a pool of one block
    found = decode_limit(model, num_seqs=3, context_tokens=40, block_size=16, num_steps=1)
    assert model.cache.num_blocks == 3 * 3 and found["decode_limit"]["num_seqs"] == 3
    assert found["decode_limit_tokens_per_s"] > 0


def test_the_decode_limit_of_several_bursts_is_their_median_step():
    from tools.bench.llm_device import decode_limit_summary

    found = decode_limit_summary(96, 129, [0.10, 0.12, 0.13, 0.20, 0.11, 0.14])
    assert found["decode_limit"]["steps"] == 6 and found["decode_limit"]["step_ms_median"] == 125.0
    assert found["decode_limit_tokens_per_s"] == round(96 / 0.125, 1)
    assert found["decode_limit"]["step_ms_min"] == 100.0
