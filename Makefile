# Two commands: `make run` (the main job) and `make test`. Both bootstrap .venv by themselves.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The CPU build of torch where there is no NVIDIA driver: pip finds torch==2.13.0+cpu on these
# machines' local wheel store; a bare `pip install torch` would pull a multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0
TORCH_GPU ?= torch>=2.11,<2.15
PYTEST_ARGS ?=
# pytest workers (pytest-xdist): the Ray tests share one worker (tests/conftest.py); 0 = one process
PYTEST_WORKERS ?= 2

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
# No RAY_AUTH_MODE here: every local Ray that moectl starts (demo, serve, bench) makes its own
# token and binds to 127.0.0.1 (deploy/local_ray.py); the tests' shared session Ray runs without
# a token on its own (tests/conftest.py).
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: run test lint format venv clean bench vllm-env

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "GPU found: installing $(TORCH_GPU)"; $(PY) -m pip install -q "$(TORCH_GPU)"; \
	else \
		echo "no GPU: installing the CPU build $(TORCH_CPU)"; $(PY) -m pip install -q "$(TORCH_CPU)"; \
		$(PY) -c "import sys, torch; sys.exit('torch %s is a CUDA build on a CPU-only machine' % torch.__version__ if torch.version.cuda else 0)"; \
	fi
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/moectl demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	@$(MAKE) --no-print-directory vllm-env || echo "make: no vLLM venv (reason above); the vLLM connector tests will skip"
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# vLLM's own venv, cached under ~/.cache/moe-orchestrator by the hash of deploy/requirements-vllm.txt
# (see deploy/vllm_env.py); prints its python.
vllm-env: $(STAMP)
	$(PY) -m deploy.vllm_env ensure

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
