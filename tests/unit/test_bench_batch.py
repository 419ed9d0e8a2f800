"""The batch benchmark's summary line: each setup against direct calls, and the target."""

from tools.bench.batch import summary


def test_summary_compares_every_setup_with_direct_calls():
    line = summary({"direct": 100.0, "batch_api": 85.04, "batch_api_postgres": 70.0})
    assert line == ("direct 100.0 items/s; batch_api 85.0 items/s (85% of direct), "
                    "batch_api_postgres 70.0 items/s (70% of direct); target 80%")
