"""Errors the backends raise; the `model.py` adapters map them to Triton status codes."""


class InvalidInput(ValueError):
    """The client sent something the model cannot serve (Triton INVALID_ARG, HTTP 400)."""
