# The two commands of the README. Each creates its own environment from nothing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
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

.PHONY: demo test test-fast lint bench zoo clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,models]"
	touch $(STAMP)

$(ZOO_STAMP): $(STAMP) Makefile
	$(PY) -m pip install --quiet -e ".[test,models,zoo]"
	$(PY) -m pip install --quiet --no-deps $(ZOO_NO_DEPS)
	touch $(ZOO_STAMP)

zoo: $(ZOO_STAMP)

demo: $(STAMP)
	$(PY) -m pypm_jax.demo

# Lint and the whole suite, the zoo included, the Hypothesis properties at CI's budget (what
# CI runs: .ci/run).
test: $(ZOO_STAMP)
	$(LINT)
	PYPM_HYPOTHESIS_PROFILE=ci $(PYTEST)

# The edit-test loop: lint and every test not marked slow, with small Hypothesis budgets.
test-fast: $(STAMP)
	$(LINT)
	PYPM_HYPOTHESIS_PROFILE=fast $(PYTEST) -m "not slow"

lint: $(STAMP)
	$(LINT)

bench: $(STAMP)
	$(PY) benchmarks/matcher.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache
