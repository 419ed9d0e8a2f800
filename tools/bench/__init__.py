"""Measurements against a real tritonserver: open- and closed-loop load generation (`loadgen`),
sweeps (`sweep`), latency profiling (`profiler`), the benchmarks behind `results/*.json`
(`goodput`, `llm`, `overload`, `batch`) and the recorded metric series (`signals`)."""
