"""Triton-facing adapters: imported only inside the Python backend stub (they need pb_utils)."""
