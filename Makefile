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

# The living corpus (tests/zoo): the `zoo` extra, then the packages whose declared
# dependencies are heavy and unused by their model code, without those dependencies.
# About 1.5 GB beside the 0.95 GB of the base environment, 1.3 GB of it tensorflow-cpu
# (gemma's gm.nn imports kauldron.typing, which imports tensorflow).
ZOO_STAMP   := $(VENV)/.zoo-stamp
ZOO_NO_DEPS := keras-hub==0.32.0 google-tunix==0.1.7 gemma==3.3.0 kauldron==1.4.2

.PHONY: demo demo-newest test test-fast test-newest lint bench zoo clean

$(STAMP): pyproject.toml constraints/stable.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints/stable.txt -e ".[test,models]"
	touch $(STAMP)

$(ZOO_STAMP): $(STAMP) Makefile
	$(PY) -m pip install --quiet -c constraints/stable.txt -e ".[test,models,zoo]"
	$(PY) -m pip install --quiet --no-deps $(ZOO_NO_DEPS)
	touch $(ZOO_STAMP)

zoo: $(ZOO_STAMP)

$(STAMP_NEWEST): pyproject.toml constraints/newest.txt
	$(PYTHON_NEWEST) -m venv $(VENV_NEWEST)
	$(PY_NEWEST) -m pip install --quiet --upgrade pip
	$(PY_NEWEST) -m pip install --quiet -c constraints/newest.txt -e ".[test,models]"
	touch $(STAMP_NEWEST)

demo: $(STAMP)
	$(PY) -m pypm_jax.demo

demo-newest: $(STAMP_NEWEST)
	$(PY_NEWEST) -m pypm_jax.demo

# Lint and the whole suite, the zoo included, the Hypothesis properties at CI's budget (what
# CI runs: .ci/run).
test: $(ZOO_STAMP)
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
