"""Batch inference: clients submit many items at once, workers send them to tritonserver in batches.

`policy` holds the decisions (validation, retries, batch formation, batch status) as pure functions
over plain data; `store_base` is the durable queue's contract, kept by `store` (a SQLite file, the
processes of one machine) or `pg_store` (PostgreSQL, workers on several machines), which
`engines.open_store` picks from the `--db` value; `pg_server` starts a local PostgreSQL.
"""
