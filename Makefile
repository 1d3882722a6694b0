# The two commands of the README. Each creates its own environment from nothing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,models]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m pypm_jax.demo

test: $(STAMP)
	$(PY) -m ruff check pypm_jax pallas_kernels hlo tests benchmarks
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/matcher.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache
