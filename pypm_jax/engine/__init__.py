"""Matching and rewriting: the fast engine, the switch between it and the paper's machine,
the rewrite driver, explanations and reports.

Internal layers: the public API is ``pypm_jax`` (``import pypm_jax as pm``).
"""
