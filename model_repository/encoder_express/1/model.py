"""Triton entry point of `encoder_express`; the adapter is `python_backends.adapters.encoder_model`."""

from python_backends.adapters.encoder_model import TritonPythonModel

__all__ = ["TritonPythonModel"]
