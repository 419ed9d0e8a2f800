"""The continuous-batching LLM engine: the scheduler (`scheduler`), the KV-cache block manager
(`kv_blocks`), the paged model (`model`), the engine that steps them (`engine`), the models'
config parameters (`config`) and the request path in front of the engine (`service`)."""
