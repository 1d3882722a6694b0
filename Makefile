# The two commands of the README. Each creates its own environment from nothing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
LINT   := $(PY) -m ruff check pypm_jax pallas_kernels hlo tests benchmarks
# One pytest worker per core (pytest-xdist); an idle worker steals queued tests. Models and
# compiled functions a file shares are cached per worker process (built at most once each).
PYTEST := $(PY) -m pytest -q -n auto --dist worksteal

.PHONY: demo test test-fast lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,models]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m pypm_jax.demo

# Lint and the whole suite, the Hypothesis properties at CI's budget (what CI runs: .ci/run).
test: $(STAMP)
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
