"""The data every layer shares: operators and terms, the core calculus, element types,
computation graphs, errors and match results.

Internal layers: the public API is ``pypm_jax`` (``import pypm_jax as pm``).
"""
