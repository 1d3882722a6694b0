"""The paper's semantics: guard evaluation, unfolding, the small-step machine and the
declarative checker.

Internal layers: the public API is ``pypm_jax`` (``import pypm_jax as pm``).
"""
