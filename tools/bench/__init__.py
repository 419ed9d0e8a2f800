"""Measurements against a real tritonserver: open- and closed-loop load generation (`loadgen`),
sweeps (`sweep`), latency profiling (`profiler`), the benchmarks behind `results/*.json`
(`goodput`, `llm`, `overload`, `batch`) and the recorded metric series (`signals`). What they
share (the machine's description, a benchmark's model repository, the report files) is in
`harness`; no benchmark imports another. Their options and printing are in `tools.cli`."""
