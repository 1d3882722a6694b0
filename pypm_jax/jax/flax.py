"""Flax helpers: optimizing linen modules and nnx modules.

Linen needs nothing special: ``pm.optimize(model.apply)`` works, since ``apply`` is a pure
function of pytrees (``fast(variables, x)``). :func:`optimize_module` only saves writing the
``method=``/``mutable=`` plumbing.

nnx modules are stateful objects, so :func:`nnx_optimize` wraps one: each call splits the
module into its graph definition (static: part of the cache key) and its state (a pytree
argument), runs the optimized pure function ``merge → call → split``, and writes the new state
back (``nnx.update``), like ``nnx.jit`` does. State changes made by the call (RNG counters,
batch statistics) therefore persist. The wrapper is an nnx module holding the wrapped one, so
``nnx.grad``/``nnx.value_and_grad`` of a loss of the wrapper differentiate through the
optimized program.
"""

from __future__ import annotations

__all__ = ["optimize_module", "nnx_optimize", "NNXOptimized"]

from collections.abc import Sequence
from typing import Any

from flax import nnx

from .optimize import Optimized, optimize
from .report import OptimizeReport


def optimize_module(
    module: Any,
    *,
    method: str = "__call__",
    mutable: Any = False,
    rules: Sequence[Any] | None = None,
    verify: bool = False,
    **rewrite_options: Any,
) -> Optimized:
    """``fast(variables, *args, **kwargs)`` = ``module.apply(variables, *args, ...)``, optimized.

    ``method`` names the module method to apply; ``mutable`` is passed to ``apply`` (with
    mutable collections the result is ``(out, updated_variables)``, as with ``apply``).
    ``rules``, ``verify`` and the other options (``default_rules`` among them) are
    :func:`~pypm_jax.jax.optimize.optimize`'s.
    """

    def apply(variables: Any, *args: Any, **kwargs: Any) -> Any:
        return module.apply(variables, *args, method=method, mutable=mutable, **kwargs)

    apply.__name__ = apply.__qualname__ = f"{type(module).__name__}.{method}"
    return optimize(apply, rules=rules, verify=verify, **rewrite_options)


class NNXOptimized(nnx.Module):
    """An nnx module whose ``method`` runs through :func:`pm.optimize`; see the module doc.

    It is an nnx module itself, holding the wrapped one as ``self.module``, so nnx
    transforms see through it: ``nnx.grad(loss)(fast)`` and ``nnx.value_and_grad``
    differentiate the wrapped module's parameters (``grads["module"]``). The optimized
    function is a static attribute: the copies nnx transforms make share its cache.
    """

    def __init__(
        self,
        module: Any,
        *,
        method: str = "__call__",
        rules: Sequence[Any] | None = None,
        verify: bool = False,
        **rewrite_options: Any,
    ):
        self.module = module
        self.method = method

        def pure(graphdef: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
            m = nnx.merge(graphdef, state)
            out = getattr(m, method)(*args, **kwargs)
            return out, nnx.state(m)

        pure.__name__ = pure.__qualname__ = f"{type(module).__name__}.{method}"
        self.optimized = optimize(
            pure, rules=rules, static_argnums=(0,), verify=verify, **rewrite_options
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        graphdef, state = nnx.split(self.module)
        out, new_state = self.optimized(graphdef, state, *args, **kwargs)
        nnx.update(self.module, new_state)
        return out

    def report(self, *args: Any, **kwargs: Any) -> OptimizeReport:
        """The rewrites for this call signature (see :meth:`Optimized.report`)."""
        graphdef, state = nnx.split(self.module)
        return self.optimized.report(graphdef, state, *args, **kwargs)

    def missed(self, *args: Any, **kwargs: Any) -> Any:
        """The sites no rule rewrote, and why (see :meth:`Optimized.missed`)."""
        graphdef, state = nnx.split(self.module)
        return self.optimized.missed(graphdef, state, *args, **kwargs)


def nnx_optimize(
    module: Any,
    *,
    method: str = "__call__",
    rules: Sequence[Any] | None = None,
    verify: bool = False,
    **rewrite_options: Any,
) -> NNXOptimized:
    """Optimize an nnx module's ``method`` (default ``__call__``): ``fast = nnx_optimize(m);
    fast(x)``; the module's state is read on every call and written back after it. The
    options are :func:`~pypm_jax.jax.optimize.optimize`'s, as for :func:`optimize_module`."""
    return NNXOptimized(module, method=method, rules=rules, verify=verify, **rewrite_options)
