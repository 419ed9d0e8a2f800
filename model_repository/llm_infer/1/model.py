"""Triton entry point of `llm_infer`; the adapter is `python_backends.adapters.llm_infer_model`."""

from python_backends.adapters.llm_infer_model import TritonPythonModel

__all__ = ["TritonPythonModel"]
