# vllm-kvevict: one command per job. Every target sets up .venv first (a no-op when up to date).
VENV    ?= .venv
PY      := $(VENV)/bin/python
PORT    ?= 8000
# Server defaults for `make serve`: eviction on with a small budget on the bundled test model.
KVEVICT ?= {"kvevict": {"policy": "streamingllm", "budget": 256}}

.PHONY: setup model serve test clean-venv

setup:
	@bash scripts/setup.sh

model: setup
	@$(PY) -m vllm_kvevict.testing.models smollm2

serve: setup
	@bash scripts/serve.sh --port $(PORT) --additional-config '$(KVEVICT)'

test: setup
	@$(PY) -m pytest $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
