"""Triton entry point of `embed`; the adapter is `python_backends.adapters.embed_model`."""

from python_backends.adapters.embed_model import TritonPythonModel

__all__ = ["TritonPythonModel"]
