"""Errors the backends raise; the `model.py` adapters map them to Triton status codes."""

# Starts every bad-input error of the `llm` model, so a caller that sees only the message (a
# BLS caller, whose errors all arrive as INTERNAL; a gRPC stream's error) can tell.
INVALID_REQUEST = "invalid request: "


class InvalidInput(ValueError):
    """The client sent something the model cannot serve (Triton INVALID_ARG, HTTP 400)."""
