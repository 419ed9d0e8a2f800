"""The kit's command line and everything behind it: `python -m tools --help`.

Subpackages by layer; imports point down this list only (import-linter contracts in
pyproject.toml, run by `make lint`):

- `cli`: one thin module per verb (`python -m tools <verb>`): arguments, printing, exit codes.
- `bench`, `ops`, `batch`: the commands that do long work: benchmarks, load generation, sweeps
  and profiling (`bench`); canary rollouts (`ops`); the batch-inference API and workers (`batch`).
- `server`, `clients`, `repository`, `observe`: the server's lifecycle, the clients that call it,
  the model repository's files, and reading its metrics.
- `planning`: the numbers: knob derivation, capacity, autoscaling, rollout gates. No I/O.
- `spec`: the files the user writes or the kit records: serving spec, latency profiles, workloads.
- `paths`: where those files live.
"""
