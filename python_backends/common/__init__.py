"""Pieces every served model shares: errors, model-file checksums, buffered metrics, files shared
between a model's instances (`shared_table`), tokenization, tenant quotas, tenant authentication,
and the typed schema of model config parameters (`params`)."""
