"""The continuous-batching LLM engine: the scheduler (`scheduler`), the KV-cache block manager
(`kv_blocks`), the paged model (`model`) and the engine that steps them (`engine`)."""
