"""The numbers behind every decision, as pure functions over plain data: batching knobs and
admission derived from the SLO and a latency curve (`derivation`), replicas for a demand
(`capacity`), autoscaling decisions (`autoscale`), canary rollout gates (`rollout`), and parsed
metric samples with the one histogram quantile (`samples`). No I/O and no clock read inside:
callers pass measurements and `now` in, and the unit tests drive them."""
