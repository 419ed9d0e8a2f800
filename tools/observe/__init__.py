"""Reading what the server did: `/metrics` snapshots, windows and quantiles (`metrics`), why a
model is slow (`explain`) and the live view of every model (`top`)."""
