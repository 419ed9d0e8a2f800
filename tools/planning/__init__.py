"""The numbers behind every decision, as pure functions over plain data: batching knobs and
admission derived from the SLO and a latency curve (`derivation`), replicas for a demand
(`capacity`), autoscaling decisions (`autoscale`) and canary rollout gates (`rollout`). No I/O and
no clock read inside: callers pass measurements and `now` in, and the unit tests drive them."""
