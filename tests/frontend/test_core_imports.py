"""The core language and engine import nothing from JAX (DESIGN.md)."""

import subprocess
import sys

CORE = [
    "pypm_jax",
    "pypm_jax._calculus",
    "pypm_jax._terms",
    "pypm_jax._frontend",
    "pypm_jax._guards",
    "pypm_jax._subst",
    "pypm_jax._machine",
    "pypm_jax._declarative",
    "pypm_jax._fast",
    "pypm_jax._graph",
    "pypm_jax._rewrite",
    "pypm_jax._explain",
    "pypm_jax._format",
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
