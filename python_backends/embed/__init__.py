"""The `embed` service: the router's request plan (`router`), length buckets (`buckets`), version
routing (`routing`), admission under overload (`admission`) and the bucket encoder (`encoder`)."""
