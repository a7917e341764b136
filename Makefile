# vllm-kvevict: one command per job. Every target sets up .venv first (a no-op when up to date).
VENV    ?= .venv
PY      := $(VENV)/bin/python
PORT    ?= 8000
HOST    ?= 127.0.0.1
# Server defaults for `make serve`: eviction on with a small budget on the bundled test model.
KVEVICT ?= {"kvevict": {"policy": "streamingllm", "budget": 256}}

.PHONY: setup model serve test clean-venv

setup:
	@bash scripts/setup.sh

model: setup
	@$(PY) -m vllm_kvevict.testing.models smollm2

serve: setup
	@bash scripts/serve.sh --host $(HOST) --port $(PORT) --additional-config '$(KVEVICT)'

# pytest's exit code 5 (no tests collected) counts as a failure.
test: setup
	@$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

clean-venv:
	rm -rf $(VENV)
