"""Reading what the server did: `/metrics` snapshots, windows and quantiles (`metrics`), why a
model is slow (`explain`), the live view of every model (`top`) and what a window says to the
planners (`scaling`). The commands that drive them live in `tools/cli`."""
