"""The core language and engine import nothing from JAX (DESIGN.md)."""

import subprocess
import sys

CORE = [
    "pypm_jax",
    "pypm_jax.core.calculus",
    "pypm_jax.core.terms",
    "pypm_jax.lang.frontend",
    "pypm_jax.semantics.guards",
    "pypm_jax.semantics.subst",
    "pypm_jax.semantics.machine",
    "pypm_jax.semantics.declarative",
    "pypm_jax.engine.fast",
    "pypm_jax.core.graph",
    "pypm_jax.engine.rewrite",
    "pypm_jax.engine.explain",
    "pypm_jax.format",
]


def test_core_modules_do_not_import_jax():
    code = (
        "import importlib, sys\n"
        f"for name in {CORE!r}:\n"
        "    importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"core modules imported: {out.stdout.strip()}"
