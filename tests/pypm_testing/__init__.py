"""The test suite's shared helpers, one importable package (``tests/`` is on the path, see
``pythonpath`` in pyproject.toml): ``from pypm_testing.engine import F1`` or
``from pypm_testing import corpus``.

- ``strategies``, ``paper``: terms, core patterns and Hypothesis strategies for the matchers;
- ``engine``: operators, terms and strategies of the graph/rewrite tests;
- ``format_gen``, ``format_samples``: random and hand-built items for the portable format;
- ``paper_patterns``: the paper's figures written in the DSL;
- ``corpus``: real models at small sizes (also used by ``benchmarks/e2e.py``);
- ``rules``, ``hlo``, ``kernels``: checks of the rule library, the StableHLO frontend and the
  Pallas kernels;
- ``golden``: golden-file comparison of printed forms (``PYPM_UPDATE_GOLDEN=1`` rewrites);
- ``budget``: the Hypothesis profiles and per-profile example counts.
"""
