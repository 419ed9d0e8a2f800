"""Batch inference: clients submit many items at once, workers send them to tritonserver in batches.

`policy` holds the decisions (validation, retries, batch formation, batch status) as pure functions
over plain data; `store_base` is the durable queue's contract, `sql_store` its tables and
transactions in SQLAlchemy Core, kept by `store` (a SQLite file, the processes of one machine) or
`pg_store` (PostgreSQL, workers on several machines), which `engines.open_store` picks from the
`--db` value; `pg_server` starts a local PostgreSQL. `api` is the REST front, `worker` the loop
that sends claimed items to tritonserver (`triton_calls`), and `service` runs them as processes
for the `batch` command.
"""
