"""The kit's root: the folder holding `python_backends/`, `tools/` and `serving.toml`.

The one repository-root constant of the kit. It lives at the bottom layer so the backends (which
never import `tools`) and the tools (`tools.paths`) read the same value. A relative keys file is
found from here, not from a model's folder, so a copied or relocated model repository (the
benchmarks build their own) still reads the same keys.
"""

from pathlib import Path

KIT_ROOT = Path(__file__).resolve().parents[2]
