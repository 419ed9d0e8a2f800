"""Logic of the Python backends served by Triton: tokenization, length bucketing, routing.

`model_repository/*/*/model.py` files are thin adapters over this package, so everything
here is importable and testable without a server.
"""
