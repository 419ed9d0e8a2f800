"""Pieces every served model shares: errors, model-file checksums, buffered metrics, files shared
between a model's instances, tokenization, tenant quotas and tenant authentication."""
