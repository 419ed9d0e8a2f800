"""Where the kit's files live: the checkout (code, workloads, results) and the serving home,
the folder holding what a deployment owns: `serving.toml`, `model_repository/`, `profiles/`
and `rollouts/`. The home is the checkout unless `KIT_HOME` names another folder, so a platform
team can keep its specs and repositories apart from the kit's code (and a test can work in a
scratch folder)."""

import os
from pathlib import Path

from python_backends.common.paths import KIT_ROOT

REPO_ROOT = KIT_ROOT
SERVING_HOME = Path(os.environ["KIT_HOME"]).resolve() if os.environ.get("KIT_HOME") else REPO_ROOT
DEFAULT_SPEC = SERVING_HOME / "serving.toml"
DEFAULT_MODEL_REPOSITORY = SERVING_HOME / "model_repository"
PROFILE_DIR = SERVING_HOME / "profiles"
ROLLOUT_RECORDS = SERVING_HOME / "rollouts"
RESULTS_DIR = REPO_ROOT / "results"
BUILD_DIR = REPO_ROOT / "build"
CHAT_WORKLOAD = REPO_ROOT / "loadtest" / "workloads" / "llm_chat.toml"  # the LLM workload the tools plan and bench with
