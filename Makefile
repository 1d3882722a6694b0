# The two commands of the README. Each creates its own environment from nothing.
# `make test`/`make demo` run on the stable stack (Python 3.11, constraints/stable.txt);
# `make test-newest`/`make demo-newest` on the newest (Python 3.13, constraints/newest.txt).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# Python 3.13: on PATH, or the newest 3.13 pyenv has installed.
PYTHON_NEWEST ?= $(or $(lastword $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.13*/bin/python3.13)),python3.13)
VENV_NEWEST   ?= .venv-newest
PY_NEWEST     := $(VENV_NEWEST)/bin/python
STAMP_NEWEST  := $(VENV_NEWEST)/.installed-stamp
LINT   := $(PY) -m ruff check pypm_jax pallas_kernels hlo tests benchmarks
# One pytest worker per core (pytest-xdist); an idle worker steals queued tests. Models and
# compiled functions a file shares are cached per worker process (built at most once each).
PYTEST := $(PY) -m pytest -q -n auto --dist worksteal

.PHONY: demo demo-newest test test-fast test-newest lint bench clean

$(STAMP): pyproject.toml constraints/stable.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints/stable.txt -e ".[test,models]"
	touch $(STAMP)

$(STAMP_NEWEST): pyproject.toml constraints/newest.txt
	$(PYTHON_NEWEST) -m venv $(VENV_NEWEST)
	$(PY_NEWEST) -m pip install --quiet --upgrade pip
	$(PY_NEWEST) -m pip install --quiet -c constraints/newest.txt -e ".[test,models]"
	touch $(STAMP_NEWEST)

demo: $(STAMP)
	$(PY) -m pypm_jax.demo

demo-newest: $(STAMP_NEWEST)
	$(PY_NEWEST) -m pypm_jax.demo

# Lint and the whole suite, the Hypothesis properties at CI's budget (what CI runs: .ci/run).
test: $(STAMP)
	$(LINT)
	PYPM_HYPOTHESIS_PROFILE=ci $(PYTEST)

# The edit-test loop: lint and every test not marked slow, with small Hypothesis budgets.
test-fast: $(STAMP)
	$(LINT)
	PYPM_HYPOTHESIS_PROFILE=fast $(PYTEST) -m "not slow"

# The second stack: every test not marked slow (lift, lower, rules, kernels, hlo, the
# language and the engine; the demo's fallback model) with small Hypothesis budgets, and the
# demo itself. The slow tests (bulk fuzz, soak, long corpus runs) run on the stable stack.
test-newest: $(STAMP_NEWEST)
	PYPM_HYPOTHESIS_PROFILE=fast $(PY_NEWEST) -m pytest -q -n auto --dist worksteal -m "not slow"
	$(PY_NEWEST) -m pypm_jax.demo

lint: $(STAMP)
	$(LINT)

bench: $(STAMP)
	$(PY) benchmarks/matcher.py

clean:
	rm -rf $(VENV) $(VENV_NEWEST) .pytest_cache .hypothesis .ruff_cache
