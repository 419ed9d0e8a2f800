"""The `embed` service: the router's request plan (`router`), length buckets (`buckets`), version
routing (`routing`), admission under overload (`admission`), the bucket encoder (`encoder`), and
the request pipeline that runs them (`service`, with its metrics in `metrics`)."""
