"""Where the kit's files live: the repository root and the default paths derived from it."""

from python_backends.common.paths import KIT_ROOT

REPO_ROOT = KIT_ROOT
DEFAULT_SPEC = REPO_ROOT / "serving.toml"
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
PROFILE_DIR = REPO_ROOT / "profiles"
RESULTS_DIR = REPO_ROOT / "results"
BUILD_DIR = REPO_ROOT / "build"
