"""Whose line is it? The one answer for every place that shows a user's file:line.

A file belongs to a library, not to the user, when it lies in JAX, jaxlib, Flax, optax, chex
or this project (``pypm_jax``, ``pallas_kernels``, ``hlo``): lifted nodes, rewrite reports and
warnings point past those to the model's (or test's) own line. The JAX bridge adds JAX's own
notion (the standard library) where it walks a JAX traceback.
"""

from __future__ import annotations

import importlib.util
import linecache
import os
import sys

from .errors import SourceLoc

__all__ = ["LIBRARY_PACKAGES", "is_library_file", "source_loc", "user_stacklevel"]

LIBRARY_PACKAGES = ("jax", "jaxlib", "flax", "optax", "chex", "pypm_jax", "pallas_kernels", "hlo")


def _package_dir(module_name: str) -> str | None:
    """Where an installed package lives, found without importing it (importing flax alone
    would cost a user's first ``optimize`` call ~0.15 s)."""
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    path = spec.origin if spec is not None else None
    return os.path.dirname(path) + os.sep if path else None


_LIBRARY_PREFIXES = tuple(d for d in map(_package_dir, LIBRARY_PACKAGES) if d is not None)


def is_library_file(file_name: str) -> bool:
    """Whether ``file_name`` lies in one of :data:`LIBRARY_PACKAGES`."""
    return file_name.startswith(_LIBRARY_PREFIXES)


# (file, line) -> its SourceLoc: the nodes of one model line share it, and linecache would
# return the same text anyway
_LOCS: dict[tuple[str, int], SourceLoc] = {}


def source_loc(file_name: str, line: int) -> SourceLoc:
    """The :class:`SourceLoc` of ``file_name:line`` with the line's text, cached."""
    key = (file_name, line)
    loc = _LOCS.get(key)
    if loc is None:
        text = linecache.getline(file_name, line).strip()
        if len(_LOCS) >= 4096:
            _LOCS.clear()
        loc = _LOCS[key] = SourceLoc(file_name, line, text)
    return loc


def user_stacklevel() -> int:
    """The ``stacklevel`` (for ``warnings.warn`` called by this function's caller) of the
    innermost frame outside the libraries and Python's frozen modules."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None:
        name = frame.f_code.co_filename
        if not is_library_file(name) and not name.startswith("<"):
            return level
        frame = frame.f_back
        level += 1
    return 1
