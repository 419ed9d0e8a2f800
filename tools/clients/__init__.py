"""Clients of the running server: retry classification for embed calls (`retrying`), the streaming
LLM client (`llm`), the lean HTTP load client (`http_infer`), TLS settings (`tls`) and tenant
tokens attached to requests (`tenant_token`)."""
