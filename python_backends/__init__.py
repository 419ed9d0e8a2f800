"""Logic of the Python backends served by Triton.

`model_repository/*/*/model.py` files import their adapter from `adapters`, the only code that
touches `triton_python_backend_utils`; everything below it is importable and testable without a
server. Layers (import-linter contract in pyproject.toml): `adapters` -> `embed`, `llm` ->
`common`. Nothing here imports `tools`.
"""
