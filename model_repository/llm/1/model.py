"""Triton entry point of `llm`; the adapter is `python_backends.adapters.llm_model`."""

from python_backends.adapters.llm_model import TritonPythonModel

__all__ = ["TritonPythonModel"]
