"""Batch inference: clients submit many items at once, workers send them to tritonserver in batches.

`policy` holds the decisions (validation, retries, batch formation, batch status) as pure functions
over plain data; `store` is the durable SQLite queue that the API process and the workers share.
"""
