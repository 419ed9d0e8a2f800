"""The derivation benchmark's figures and its report section (pure parts)."""

import pytest

from tools.bench.derivation import remaining_budget_s, summarize
from tools.bench.report import render_derivation


def figures(derived, tuned, best, derived_s=120.0, search_s=3600.0):
    return summarize({"derived": derived, "tuned": tuned, "search_best": best}, derived_s, 900.0, search_s, 40)


def test_medians_ratios_and_met_targets():
    entry = figures([100, 110, 104], [112, 108, 110], [108, 104, 106])
    assert entry["derived_goodput_rps"] == 104 and entry["tuned_goodput_rps"] == 110
    assert entry["search_best_goodput_rps"] == 106
    assert entry["derived_vs_search_best"] == pytest.approx(104 / 106, abs=1e-3)
    assert entry["derived_measure_share"] == pytest.approx(120 / 3600, abs=1e-3)
    assert entry["search_points"] == 40 and entry["search_measure_s"] == 3600.0
    assert entry["rounds_spread"] == pytest.approx(10 / 104, abs=1e-3)  # derived's rounds spread widest
    assert all(entry["targets"].values())


def test_targets_fail_when_the_derivation_loses_or_measures_too_long():
    losing = figures([80, 82, 81], [100, 100, 100], [100, 101, 100])
    assert not losing["targets"]["derived_within_95pct_of_search_best"]
    slow = figures([100] * 3, [100] * 3, [100] * 3, derived_s=400.0)
    assert not slow["targets"]["derived_measuring_within_10pct"]
    assert slow["targets"]["derived_within_95pct_of_search_best"]


def test_tuned_is_level_with_the_best_within_the_rounds_spread():
    level = figures([100, 100, 100], [95, 96, 97], [100, 90, 104])  # best's spread 14%: 96 counts as level
    assert level["targets"]["tuned_level_with_search_best"]
    behind = figures([100] * 3, [80] * 3, [100, 101, 100])
    assert not behind["targets"]["tuned_level_with_search_best"]


def test_report_section_without_and_with_a_result():
    assert "python -m tools bench derivation" in render_derivation(None, "../results/")
    result = {"models": {"embed": {**figures([100, 110, 104], [112, 108, 110], [108, 104, 106]),
                                   "search_best_edges": [24, 64, 128, 256]}},
              "options": {"rounds": 3}, "measured_at": "2026-11-26T00:00:00Z", "command": "python -m tools bench "
              "derivation", "hardware": {"description": "2 x AMD EPYC", "cpu_count": 2, "gpu": None}}
    text = render_derivation(result, "../results/")
    assert "| `embed` | 104.0 | 110.0 | 106.0 | 24,64,128,256 | **98%** |" in text
    assert "2.0 / 15.0 / 60.0 (40 points)" in text and "met: derived within 95pct of search best" in text


def test_a_resumed_search_keeps_only_the_budget_its_earlier_points_left():
    earlier = {"points": [{"measure_s": 600.0}, {"measure_s": 900.0}], "server_start_s": [8.0, 7.0]}
    assert remaining_budget_s(3600.0, earlier) == pytest.approx(3600.0 - 1515.0)
    assert remaining_budget_s(3600.0, {"points": [{"measure_s": 4000.0}]}) == 0.0
    assert remaining_budget_s(3600.0, None) == 3600.0


def test_models_measured_apart_keep_the_machine_and_time_of_their_own_run():
    from tools.bench.derivation import merge_models

    older = {"hardware": {"description": "2 x AMD EPYC", "cpu_count": 2, "gpu": None},
             "measured_at": "2026-11-26T00:00:00Z", "command": "python -m tools bench derivation",
             "options": {"rounds": 3}, "models": {"embed": {"derived_goodput_rps": 119.0},
                                                   "audio": {"derived_goodput_rps": 1.0}}}
    now = {"audio": {"hardware": {"description": "2 x Intel Xeon", "cpu_count": 2, "gpu": None},
                     "measured_at": "2026-11-27T00:00:00Z", "command": "python -m tools bench derivation --model audio",
                     "options": {"rounds": 3}, "derived_goodput_rps": 240.0}}
    models = merge_models(older, now)
    assert models["audio"] == now["audio"]  # measured again: the new run's entry only
    assert models["embed"]["hardware"]["description"] == "2 x AMD EPYC"
    assert models["embed"]["measured_at"] == "2026-11-26T00:00:00Z" and models["embed"]["derived_goodput_rps"] == 119.0
    assert merge_models(None, now) == now
    text = render_derivation({**older, "hardware": now["audio"]["hardware"], "measured_at": now["audio"]["measured_at"],
                              "models": {"embed": {**figures([100, 110, 104], [112, 108, 110], [108, 104, 106]),
                                                   **models["embed"]},
                                         "audio": {**figures([100, 110, 104], [112, 108, 110], [108, 104, 106]),
                                                   **models["audio"]}}}, "../results/")
    assert "- `embed`: medians of 3 final rounds, measured 2026-11-26T00:00:00Z on 2 x AMD EPYC, 2 vCPU" in text
    assert "- `audio`: medians of 3 final rounds, measured 2026-11-27T00:00:00Z on 2 x Intel Xeon, 2 vCPU" in text
