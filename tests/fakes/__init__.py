"""Fakes for the unit tests: only of `triton_python_backend_utils` (the real parts run everywhere else)."""
