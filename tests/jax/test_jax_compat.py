"""The private JAX APIs the bridge relies on (``pypm_jax.jax._compat``) still work.

If one of these fails after a JAX upgrade, fix ``_compat.py`` (the only module that touches
JAX internals) rather than the callers.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pypm_jax.core.source import is_library_file
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


def test_user_frame_reads_raw_frames_as_jax_user_frames_does():
    """user_frame tests file names on the traceback's raw frames before computing a line;
    it picks the frame JAX's own iterator would."""
    import flax.linen as nn

    dense = nn.Dense(4)
    params = dense.init(jax.random.PRNGKey(0), jnp.ones((1, 3)))
    closed = _eqns(lambda p, x: jnp.tanh(dense.apply(p, x)), params, jnp.ones((1, 3)))
    for eqn in closed.jaxpr.eqns:
        tb = eqn.source_info.traceback
        codes, lastis = tb.raw_frames()  # the private API user_frame relies on
        assert len(codes) == len(lastis) > 0
        want = next(
            (f for f in _compat._frames(tb) if not is_library_file(f.file_name)),
            None,
        )
        got = _compat.user_frame(eqn.source_info)
        assert want is not None and got is not None
        assert (got.file, got.line) == (want.file_name, want.start_line)


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


def _emit_program(x, w):
    """A program of the primitives lowering re-emits most (elementwise ops with weak-typed
    literals, dot_general, reshape, reductions, transpose) under named scopes."""
    with jax.named_scope("block"):
        y = jnp.tanh(x @ w) * 0.5 + 1
        with jax.named_scope("inner"):
            z = jnp.reshape(y, (2, 6)).T
        return jnp.sum(jnp.exp(z - jnp.max(z, axis=0)), axis=0) / 3


def _retrace(closed, mode, outer_scope=None):
    """Trace ``closed``'s equations again: each bound as lowering binds it, or, where
    ``mode == "emit"`` and it qualifies, emitted as recorded."""
    jaxpr = closed.jaxpr

    def run(*args):
        emit = _compat.emitter() if mode == "emit" else None
        env = dict(zip(jaxpr.invars, args, strict=True))
        read = [lambda v: _compat.literal_value(v) if isinstance(v, _compat.Literal) else env[v]]
        emitted = 0
        for eqn in jaxpr.eqns:
            xs = [read[0](v) for v in eqn.invars]
            in_avals = tuple(v.aval for v in eqn.invars)
            out_avals = tuple(v.aval for v in eqn.outvars)
            ys = None
            if emit is not None and _compat.emittable(
                eqn.primitive, eqn.params, eqn.source_info, in_avals, out_avals
            ):
                ys = emit(eqn.primitive, xs, eqn.params, in_avals, out_avals,
                          eqn.source_info, eqn.ctx)  # fmt: skip
                emitted += ys is not None
            if ys is None:
                out = _compat.bind(eqn.primitive, xs, eqn.params, eqn.source_info, eqn.ctx)
                ys = out if eqn.primitive.multiple_results else [out]
            env.update(zip(eqn.outvars, ys, strict=True))
        counts.append(emitted)
        return [env[v] for v in jaxpr.outvars]

    counts: list[int] = []
    fn = run
    if outer_scope is not None:
        from jax.experimental.xla_metadata import set_xla_metadata

        def fn(*args):  # a caller's scope and XLA metadata, which binding joins with its own
            with jax.named_scope(outer_scope), set_xla_metadata(caller="yes"):
                return run(*args)

    traced = jax.jit(fn).trace(*(jnp.zeros(a.shape, a.dtype) for a in closed.in_avals))
    return traced, counts[0]


def _eqn_records(jaxpr):
    return [
        (
            str(e.primitive),
            e.params,
            [v.aval for v in e.invars],
            [v.aval for v in e.outvars],
            e.source_info.traceback,
            e.source_info.name_stack,
            e.ctx,
            e.effects,
        )
        for e in jaxpr.eqns
    ]


@pytest.mark.parametrize("outer_scope", [None, "caller"])
def test_emit_records_what_bind_records(outer_scope):
    """Emitting an equation (the fast path of lowering) records exactly what binding it
    records: primitive, params, types, traceback, name stack and context (under a caller's
    scope and XLA metadata too), effects; and the lowered HLO, source locations included, is
    the same.
    This is what makes a JAX upgrade that changes a staging rule (PLAIN_STAGING) fail."""
    x, w = jnp.ones((4, 3)), jnp.ones((3, 3))
    closed = _eqns(_emit_program, x, w)
    prims = {e.primitive.name for e in closed.jaxpr.eqns}
    assert _compat.PLAIN_STAGING <= prims and {"dot_general", "tanh"} <= prims

    bound, none = _retrace(closed, "bind", outer_scope)
    emitted, n = _retrace(closed, "emit", outer_scope)
    assert none == 0 and n >= len(closed.jaxpr.eqns) // 2, n  # most equations qualify
    assert str(emitted.jaxpr) == str(bound.jaxpr)
    assert _eqn_records(emitted.jaxpr.jaxpr) == _eqn_records(bound.jaxpr.jaxpr)
    hlo = [t.lower().as_text(debug_info=True) for t in (bound, emitted)]
    assert hlo[0] == hlo[1] and ("caller/block/inner" in hlo[0]) == (outer_scope is not None)
    assert ('caller = "yes"' in hlo[0]) == (outer_scope is not None)


def test_emit_leaves_out_what_binding_forwards():
    """An equation a forwarding rule drops (an identity broadcast, which a transformation
    may leave in a jaxpr though tracing never records one) is bound, not emitted: both
    ways forward its operand. Other broadcasts are emitted (PLAIN_STAGING)."""
    import jax.extend.core as jex

    closed = _eqns(lambda x: jnp.broadcast_to(x, (2, 3)) * 2.0, jnp.ones(3))
    jaxpr = closed.jaxpr
    bcast = next(e for e in jaxpr.eqns if e.primitive.name == "broadcast_in_dim")
    (x,) = jaxpr.invars
    y = _compat.Var(x.aval)
    params = dict(bcast.params, shape=(3,), broadcast_dimensions=(0,))
    ident = jex.new_jaxpr_eqn([x], [y], bcast.primitive, params, set(), bcast.source_info,
                              bcast.ctx)  # fmt: skip
    assert not _compat.emittable(bcast.primitive, params, bcast.source_info, [x.aval], [y.aval])
    assert _compat.emittable(
        bcast.primitive, bcast.params, bcast.source_info, [x.aval], [bcast.outvars[0].aval]
    )
    edited = jaxpr.replace(eqns=[ident, *jaxpr.eqns], outvars=[*jaxpr.outvars, y])
    closed = _compat.closed_jaxpr(edited, []) if hasattr(closed, "consts") else edited
    bound, _ = _retrace(closed, "bind")
    emitted, n = _retrace(closed, "emit")
    assert n == 1  # the real broadcast (the mul reads a literal: bound)
    assert str(emitted.jaxpr) == str(bound.jaxpr) and len(bound.jaxpr.eqns) == 2


def test_emitter_declines_what_it_cannot_emit():
    closed = _eqns(lambda x: jnp.sin(x), jnp.ones(3, jnp.float32))
    (eqn,) = closed.jaxpr.eqns
    prim, params, si = eqn.primitive, eqn.params, eqn.source_info
    in_avals, out_avals = [eqn.invars[0].aval], [eqn.outvars[0].aval]
    assert _compat.emitter() is None  # eager: nothing is traced
    assert _compat.emittable(prim, params, si, in_avals, out_avals)
    no_traceback = type(si)(None, si.name_stack)  # (binding would take the current one)
    assert not _compat.emittable(prim, params, no_traceback, in_avals, out_avals)
    call = _eqns(lambda x: jax.jit(jnp.sin)(x), jnp.ones(3)).jaxpr.eqns[0]
    assert not _compat.emittable(call.primitive, call.params, call.source_info, in_avals, out_avals)
    seen = []

    def f(x, y):
        emit = _compat.emitter()
        seen.append(emit(prim, [y], params, in_avals, out_avals, si, eqn.ctx))  # f32[4]
        seen.append(emit(prim, [np.ones(3, np.float32)], params, in_avals, out_avals, si, eqn.ctx))
        (out,) = emit(prim, [x], params, in_avals, out_avals, si, eqn.ctx)
        return out

    traced = jax.jit(f).trace(jnp.ones(3, jnp.float32), jnp.ones(4, jnp.float32))
    assert seen == [None, None]  # another type, not a tracer: bind them instead
    assert [e.primitive.name for e in traced.jaxpr.eqns] == ["sin"]


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


def test_jax_version_is_a_supported_one():
    # the versions docs/JAX.md lists as verified; a new one needs a run of tests/jax and
    # tests/rules, then an entry here and there (jax 0.12.0.1 is 0.12.0 with a fixed wheel)
    assert _compat.JAX_VERSION[:3] in {(0, 10, 2), (0, 11, 2), (0, 12, 0)}, jax.__version__


def _control_eqns(x):
    w = jnp.arange(3.0)

    def f(x):
        y = jax.lax.scan(lambda c, a: (c + a * w[0], (c * a, a + 1.0)), x[0], x)[1][0]
        y = jax.lax.while_loop(lambda c: c[0] < w[2], lambda c: (c[0] + 1, c[1] * w), (0.0, y))
        return jax.lax.cond(y[1].sum() > 0, lambda a: a + w, lambda a: a - 1, y[1])

    return {e.primitive.name: e for e in _eqns(f, x).jaxpr.eqns}


# The raw params JAX gives control-flow equations, per supported version: a JAX that changes
# them again fails here first (then teach _compat.control_params the new form).
_RAW_CONTROL_PARAMS = {
    "scan": [
        {"reverse", "length", "jaxpr", "num_consts", "num_carry", "unroll"},  # jax 0.10.2
        {"reverse", "length", "jaxpr", "ft_in", "ft_out", "unroll"},  # jax 0.11.2, 0.12.0
    ],
    "while": [{"cond_jaxpr", "body_jaxpr", "cond_nconsts", "body_nconsts"}],
    "cond": [{"branches"}],
}  # fmt: skip


def test_control_params_are_version_independent():
    eqns = _control_eqns(jnp.ones(3))
    for name, known in _RAW_CONTROL_PARAMS.items():
        raw = set(eqns[name].params)
        assert raw in known, f"jax {jax.__version__} gives {name} params {sorted(raw)}"

    scan = _compat.control_params("scan", dict(eqns["scan"].params))
    assert set(scan) == set(_compat.CONTROL_PARAMS["scan"])
    # one closed-over const (w), one carry, two ys: the body takes consts, carry, xs
    assert (scan["num_consts"], scan["num_carry"], scan["length"]) == (1, 1, 3)
    assert scan["reverse"] is False and scan["unroll"] == 1
    body, consts = _compat.body_parts(scan["jaxpr"])
    n_in = scan["num_consts"] + scan["num_carry"] + 1
    assert len(body.invars) + len(consts) == n_in and len(eqns["scan"].invars) == n_in
    assert len(body.outvars) == len(eqns["scan"].outvars)

    wl = _compat.control_params("while", dict(eqns["while"].params))
    assert (wl["cond_nconsts"], wl["body_nconsts"]) == (1, 1)
    cd = _compat.control_params("cond", dict(eqns["cond"].params))
    assert len(cd["branches"]) == 2

    with pytest.raises(TypeError, match="unsupported scan params"):
        _compat.control_params("scan", {"jaxpr": scan["jaxpr"], "length": 3})
    with pytest.raises(KeyError):
        _compat.control_params("add", {})


def test_body_parts_of_every_body_param():
    closed = _eqns(lambda x: x + np.arange(100.0, dtype=np.float32), jnp.ones(100))
    jaxpr, consts = _compat.body_parts(closed)
    assert isinstance(jaxpr, _compat.Jaxpr) and len(consts) == len(jaxpr.constvars) == 1
    assert len(jaxpr.invars) == 1

    @jax.custom_jvp
    def cj(x):
        return jnp.sin(x)

    cj.defjvps(lambda g, ans, x: g * jnp.cos(x))

    def f(x):
        return jax.jit(jnp.cos)(x) + jax.checkpoint(jnp.sin)(x) + cj(x)

    eqns = {e.primitive.name: e for e in _eqns(f, jnp.ones(3)).jaxpr.eqns}
    for name, param in (("jit", "jaxpr"), ("remat2", "jaxpr"), ("custom_jvp_call", "call_jaxpr")):
        jaxpr, consts = _compat.body_parts(eqns[name].params[param])
        assert isinstance(jaxpr, _compat.Jaxpr), name
        assert len(jaxpr.invars) == len(eqns[name].invars) and not consts, name
    for body in _control_eqns(jnp.ones(3))["cond"].params["branches"]:
        assert isinstance(_compat.body_parts(body)[0], _compat.Jaxpr)
    with pytest.raises(TypeError, match="expected a jaxpr"):
        _compat.body_parts(object())


def test_versioned_params_bind_on_the_installed_jax():
    x = jnp.arange(6.0).reshape(2, 3)
    table = {"reduce_max": {"axes": (1,), "out_sharding": None},
             "reduce_min": {"axes": (1,), "out_sharding": None},
             "top_k": {"k": 2, "axis": 1, "is_stable": True}}  # fmt: skip
    raw = {e.primitive.name: set(e.params) for e in _eqns(
        lambda x: [jax.lax.reduce_max(x, (1,)), jax.lax.reduce_min(x, (1,)),
                   *jax.lax.top_k(x, 2)], x).jaxpr.eqns}  # fmt: skip
    for name, params in table.items():
        adapted = _compat.adapt_params(name, params)
        assert set(adapted) == raw[name] == set(params) - _compat.absent_params(name), name
        out = _compat.bind(_compat.primitive_by_name(name), [x], adapted)
        assert (out[0] if isinstance(out, list | tuple) else out).shape[0] == 2
    assert _compat.adapt_params("add", {}) == {}
    assert _compat.has_tracers([1, jnp.ones(1)]) is False


def test_vary_alike_matches_operands_in_a_shard_map_body():
    """Lifting drops ``pvary``; lowering a shard_map body re-inserts it through
    ``jax._src.core.auto_insert_reshard`` (the test of that private use)."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    seen = []

    def body(a, b):
        a2, b2 = _compat.vary_alike([a, b])
        seen.append((jax.typeof(a2).mat.varying, jax.typeof(b2).mat.varying))
        return jax.lax.dot_general(a2, b2, (((1,), (0,)), ((), ())))

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))
    out = f(jnp.ones((2, 3)), jnp.ones((3, 4)))
    assert seen == [(frozenset({"x"}), frozenset({"x"}))]
    np.testing.assert_allclose(out, 3.0)


def test_mesh_axes_reads_a_sharding_as_mesh_axes():
    """``sharding._to_xla_hlo_sharding`` and ``sharding_impls.parse_flatten_op_sharding``
    (the partitioning callbacks read operand shardings with them); the sub-axis case that
    returns None runs on 8 devices in test_jax_sharded.py."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    axes = _compat.mesh_axes(NamedSharding(mesh, P("data", None, "model")), mesh, 3)
    assert axes == ((), (), ())  # size-1 axes split nothing
    assert _compat.mesh_axes(NamedSharding(mesh, P()), mesh, 2) == ((), ())
