"""The private JAX APIs the bridge relies on (``pypm_jax.jax._compat``) still work.

If one of these fails after a JAX upgrade, fix ``_compat.py`` (the only module that touches
JAX internals) rather than the callers.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from pypm_jax.jax import _compat

HERE = os.path.abspath(__file__)


def _eqns(fn, *args):
    return jax.make_jaxpr(fn)(*args)


def test_jaxpr_classes():
    closed = _eqns(lambda x: x * 2.0 + 1.0, jnp.ones(3))
    assert isinstance(closed, _compat.ClosedJaxpr)
    assert isinstance(closed.jaxpr, _compat.Jaxpr)
    eqn = closed.jaxpr.eqns[0]
    assert isinstance(eqn, _compat.JaxprEqn) and isinstance(eqn.primitive, _compat.Primitive)
    assert isinstance(eqn.invars[0], _compat.Var)
    lit = eqn.invars[1]
    assert isinstance(lit, _compat.Literal)
    assert float(_compat.literal_value(lit)) == 2.0
    assert hasattr(eqn, "ctx") and hasattr(eqn.ctx, "manager") and hasattr(eqn, "effects")


def test_primitives_by_name():
    for name in ("dot_general", "exp", "scatter-add", "jit", "custom_jvp_call", "scan", "while"):
        prim = _compat.primitive_by_name(name)
        assert prim is not None and prim.name == name, name


def test_bind_plain_and_call_primitives():
    closed = _eqns(lambda x: jax.jit(jnp.sin)(x) * 2.0, jnp.ones(3))
    call, mul = closed.jaxpr.eqns
    assert call.primitive.name == "jit"
    x = jnp.linspace(0.0, 1.0, 3)
    (y,) = _compat.bind(call.primitive, [x], dict(call.params), call.source_info, call.ctx)
    np.testing.assert_allclose(y, jnp.sin(x))
    z = _compat.bind(mul.primitive, [y, np.float32(2.0)], dict(mul.params))
    np.testing.assert_allclose(z, jnp.sin(x) * 2.0)


def test_user_frames_skip_jax_and_flax():
    import flax.linen as nn

    closed = _eqns(lambda x: jnp.tanh(x), jnp.ones(3))
    loc = _compat.user_frame(closed.jaxpr.eqns[0].source_info)
    assert loc is not None and loc.file == HERE and "jnp.tanh" in loc.text

    dense = nn.Dense(4)
    params = dense.init(jax.random.PRNGKey(0), jnp.ones((1, 3)))
    closed = _eqns(lambda p, x: dense.apply(p, x), params, jnp.ones((1, 3)))
    locs = [_compat.user_frame(e.source_info) for e in closed.jaxpr.eqns]
    assert all(loc is not None and loc.file == HERE for loc in locs)


def test_name_stacks():
    def f(x):
        with jax.named_scope("outer"):
            with jax.named_scope("inner"):
                return jnp.exp(x)

    closed = _eqns(f, jnp.ones(3))
    si = closed.jaxpr.eqns[0].source_info
    stack = _compat.name_stack(si)
    assert _compat.name_stack_scopes(stack) == ("outer", "inner")
    joined = _compat.join_name_stacks(stack, stack)
    assert _compat.name_stack_scopes(joined) == ("outer", "inner", "outer", "inner")
    moved = _compat.with_name_stack(si, joined)
    assert _compat.name_stack_scopes(moved.name_stack)[-1] == "inner"

    # re-tracing under source_context keeps the source line and the scopes
    def g(x):
        with _compat.source_context(si):
            return jnp.sin(x)

    eqn = _eqns(g, jnp.ones(3)).jaxpr.eqns[0]
    assert _compat.name_stack_scopes(eqn.source_info.name_stack) == ("outer", "inner")
    assert _compat.user_frame(eqn.source_info).line == f.__code__.co_firstlineno + 3

    # transforms are not scopes
    grad_eqns = _eqns(jax.grad(lambda x: jnp.sum(f(x))), jnp.ones(3)).jaxpr.eqns
    for e in grad_eqns:
        scopes = _compat.name_stack_scopes(e.source_info.name_stack)
        assert all("(" not in s for s in scopes), scopes


def test_constvars_and_extended_dtypes():
    w = np.arange(100.0, dtype=np.float32)
    closed = _eqns(lambda x: x + w, jnp.ones(100))
    assert len(closed.jaxpr.constvars) == 1
    converted = _compat.convert_constvars(closed.jaxpr)
    assert len(converted.invars) == 2 and not converted.constvars
    fn = _compat.jaxpr_as_fun(_compat.closed_jaxpr(converted, []))
    np.testing.assert_allclose(fn(w, jnp.ones(100))[0], w + 1)

    key = jax.random.key(0)
    assert _compat.is_extended_dtype(jax.typeof(key).dtype)
    assert not _compat.is_extended_dtype(jnp.float32)
    seen = []
    jax.jit(lambda x: seen.append(_compat.is_tracer(x)) or x)(1.0)
    assert seen == [True] and not _compat.is_tracer(jnp.ones(1))
