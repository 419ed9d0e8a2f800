"""An OpenAI-compatible HTTP front for the kit's LLM models (`python -m tools llm-api`)."""
