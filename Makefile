# Everything runs from a local virtualenv that these targets create and fill.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PORT ?= 8080

.PHONY: demo test check lint typecheck bench install simulate clean test-tools coverage

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/gateway demo --port $(PORT)

simulate: $(STAMP)
	$(BIN)/gateway simulate --config config/demo.yaml

# Programs some tests drive: promtool/prometheus (metrics, rules), dnsmasq (DNS discovery),
# redis-server (shared ledger), vLLM's CPU build in its own virtualenv and the tiny models it
# serves (the real-vLLM tier).
# Where they cannot be installed those tests skip with the reason; with CI=true they must install.
test-tools: $(STAMP)
	./scripts/install-test-tools.sh
	./scripts/install-vllm.sh
	$(BIN)/python -m tests.support.real_models

# mypy runs beside the main tier (scripts/test-all.sh): its result fails the target.
test: $(STAMP) test-tools
	$(BIN)/ruff check kvgateway tests bench
	$(BIN)/lint-imports
	BIN=$(BIN) ./scripts/test-all.sh

# The loop a developer runs every minute: lint, the import contracts and the fast tier
# (unit tests not marked slow; tests/integration is the slow tier). `make test` runs all.
check: $(STAMP)
	$(BIN)/ruff check kvgateway tests bench
	$(BIN)/lint-imports
	$(BIN)/pytest -n 2 -q -m "not slow and not real_vllm"

# Line coverage of kvgateway over the main tier (in-process code; gateways and nodes a
# test starts as processes are not traced). Prints the total and writes coverage.json.
coverage: $(STAMP)
	$(BIN)/pytest -n 3 -q -m "not real_vllm and not timing" --cov=kvgateway \
		--cov-report=term:skip-covered --cov-report=json:coverage.json

lint: $(STAMP)
	$(BIN)/ruff check kvgateway tests bench
	$(BIN)/ruff format --check kvgateway tests bench
	$(BIN)/lint-imports
	$(BIN)/mypy

typecheck: $(STAMP)
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python -m bench.run_all

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
