"""The PyPM language: the Python-embedded frontend, symbolically executed into the core
calculus, and the name tables it fills.

Internal layers: the public API is ``pypm_jax`` (``import pypm_jax as pm``).
"""
