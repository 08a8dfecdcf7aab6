# Two entry points for a fresh machine (see README):
#   make demo  - set up and run the main job on the embedded default (no Kafka)
#   make test  - set up and run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: setup demo lint test test-fast bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/panagg demo --events 1000000 --output out/releases

# ruff, configured in pyproject.toml ([tool.ruff]): pycodestyle and pyflakes at 100 columns;
# then mypy on the DP core (aggregator/*.py, [tool.mypy]: ~15 s cold, as on CI's fresh machine)
lint: $(STAMP)
	$(BIN)/ruff check aggregator consumers state_store tests bench examples docs/upstream
	$(BIN)/ruff format --check aggregator consumers state_store tests bench examples docs/upstream
	$(BIN)/mypy

# pytest exits 5 when it collects nothing: that is a failure here, said out loud.
# lint first: a style violation fails the suite (and CI) with ruff's message, before any test.
# Three workers (pytest-xdist): the tests on a real broker run in two lanes, one test at a time
# on each of two workers with its own broker (tests/conftest.py, pytest_collection_modifyitems),
# the rest on the third; the broker tests mostly wait, so three share the two cores. (A new
# group's join that once stalled a lane for good is a kafka-python bug: compat.finish_join.)
test: $(STAMP) lint
	@$(BIN)/python -m pytest -q -n 3 --dist loadgroup --durations=30; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5) - failing" >&2; exit 1; fi; \
	exit $$rc

# the fast lane: no broker, no fault matrix, no test marked slow (tests/conftest.py marks
# every broker test, and every test tests/durations.tsv measured over tests/durations.py's
# SLOW_S); linted too, since ruff takes about a second
test-fast: $(STAMP) lint
	@$(BIN)/python -m pytest -q -x -n 2 --ignore=tests/integration --ignore=tests/chaos \
	  -m "not broker and not slow" -p no:cacheprovider; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-fast: pytest collected no tests (exit 5)" >&2; exit 1; fi; \
	exit $$rc

bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python -m bench.service.speed
	$(BIN)/python -m bench.accuracy.accuracy
	$(BIN)/python -m bench.accuracy.estimators
	$(BIN)/python -m bench.accuracy.accuracy_report
	$(BIN)/python -m bench.accuracy.largedomain
	$(BIN)/python -m bench.service.e2e
	$(BIN)/python -m bench.service.group --all

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache .mypy_cache
