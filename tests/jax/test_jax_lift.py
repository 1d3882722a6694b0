"""Lifting and lowering: sources, module paths, constants, opaque nodes, regions, bodies."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pypm_jax as pm
from pypm_jax.core.terms import CONST
from pypm_jax.jax import (
    LoweringError,
    lift,
    lower,
    optimize,
    prims,
    register_impl,
    rewrite_nested,
)
from pypm_testing import corpus
from pypm_testing.corpus import has_transformers, hf_bert, linen_mha, linen_scan

HERE = os.path.abspath(__file__)
CORPUS = os.path.abspath(corpus.__file__)

# ------------------------------------------------------------------------------ rules


@pm.pattern
def DivBy8(x):
    return prims.div(x, 8.0)


@pm.rule(DivBy8)
def div8_to_mul(x):
    return prims.mul(x, 0.125)


@pm.op(op_class="kernel")
def TestRelu(x):
    return 1


register_impl(TestRelu, lambda x: jnp.maximum(x, 0.0))


@pm.pattern
def MaxZero(x):
    return prims.max(x, 0.0)


@pm.rule(MaxZero)
def max_to_relu_kernel(x):
    return TestRelu(x)


@pm.op(op_class="kernel")
def TestExpm1(x):
    return 1


register_impl(TestExpm1, lambda x: jnp.expm1(x))


@pm.pattern
def ExpMinus1(x):
    return prims.sub(prims.exp(x), 1.0)


@pm.rule(ExpMinus1)
def expm1_kernel(x):
    return TestExpm1(x)


@pm.pattern
def AnyUnary(x, f):
    return f(x)


@pm.op
def Marked(x):
    return 1


register_impl(Marked, lambda x: x)


@pm.rule(AnyUnary)
def mark_any_unary(x, f):
    return Marked(x)


def _run(fn, *args, rules=()):
    closed = jax.make_jaxpr(fn)(*args)
    prog = lift(closed)
    report = rewrite_nested(prog, list(rules)).report
    return prog, report, jax.jit(lower(prog))


def test_lowering_takes_the_kernel_table_it_is_given():
    """``lower(prog, impls)`` computes kernel nodes with ``impls`` (default: the table
    ``register_impl`` fills), in nested bodies too, and refuses one the table lacks."""
    x = jnp.linspace(-1.0, 1.0, 4)
    prog, report, _ = _run(lambda v: jnp.maximum(v, 0.0), x, rules=[max_to_relu_kernel])
    assert [r.rule for r in report] == ["max_to_relu_kernel"]
    np.testing.assert_allclose(lower(prog)(x)[0], jnp.maximum(x, 0.0))
    np.testing.assert_allclose(lower(prog, {TestRelu: lambda v: -v})(x)[0], -x)
    with pytest.raises(LoweringError, match="no implementation for .*TestRelu"):
        lower(prog, {})

    def scanned(v):
        return jax.lax.scan(lambda c, vi: (c, jnp.maximum(vi, 0.0)), 0.0, v)[1]

    prog, report, _ = _run(scanned, x, rules=[max_to_relu_kernel])
    assert [r.rule for r in report] == ["max_to_relu_kernel"]  # inside the scan body
    np.testing.assert_allclose(lower(prog, {TestRelu: lambda v: -v})(x)[0], -x)
    with pytest.raises(LoweringError, match="no implementation for .*TestRelu"):
        lower(prog, {})


def _jaxpr_prims(fn, *args):
    names = set()

    def walk(j):
        for e in j.eqns:
            names.add(e.primitive.name)
            for v in e.params.values():
                for sub in v if isinstance(v, tuple) else (v,):
                    if hasattr(sub, "eqns"):
                        walk(sub)
                    elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        walk(sub.jaxpr)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return names


# ------------------------------------------------------------------------------ sources


def test_nodes_carry_the_users_source_line():
    def f(x):
        y = jnp.exp(x)  # the line below is the one reported
        return jnp.tanh(y) / 8.0

    prog = lift(jax.make_jaxpr(f)(jnp.ones(3)))
    by_op = {n.op.name: n for n in prog.graph.nodes()}
    line = f.__code__.co_firstlineno
    assert by_op["exp"].loc.file == HERE and by_op["exp"].loc.line == line + 1
    assert by_op["tanh"].loc.line == line + 2 and "jnp.tanh" in by_op["tanh"].loc.text


def test_source_lines_are_found_when_asked_for(monkeypatch):
    """Lifting walks no traceback: a node's line is found when something reads it (a
    report, an error), once, and is the line lifting would have found."""
    from pypm_jax.jax import _compat

    found = []
    user_frame = _compat.user_frame
    monkeypatch.setattr(_compat, "user_frame", lambda si: found.append(si) or user_frame(si))

    def f(x):
        return jnp.tanh(jnp.exp(x))

    prog = lift(jax.make_jaxpr(f)(jnp.ones(3)))
    assert found == []
    tanh = next(n for n in prog.graph.nodes() if n.op.name == "tanh")
    assert tanh.loc.line == f.__code__.co_firstlineno + 1 and tanh.loc is tanh.loc
    assert len(found) == 1


def test_inlined_library_calls_report_the_call_site():
    def f(x):
        return jax.nn.relu(x) + jnp.cumsum(x)

    prog = lift(jax.make_jaxpr(f)(jnp.ones(3)))
    line = f.__code__.co_firstlineno + 1
    for n in prog.graph.nodes():
        if n.op is not CONST:
            assert n.loc is not None and n.loc.file == HERE and n.loc.line == line, n


def test_flax_linen_nodes_carry_user_lines_and_module_paths():
    apply, inputs, _ = linen_mha(False)
    prog = lift(jax.make_jaxpr(apply)(*inputs))
    dots = [n for n in prog.graph.nodes() if n.op is prims.dot_general]
    assert len(dots) == 6
    assert all(n.loc.file == CORPUS for n in dots)  # not flax/linen/*.py
    paths = {n.meta["module_path"] for n in dots}
    assert {"Attn/attention/query", "Attn/attention/key", "Attn/attention/value"} <= paths
    assert "Attn/attention/out" in paths
    assert not any("->" in p for p in paths)  # einsum scopes are not modules


def test_scan_bodies_carry_module_paths():
    apply, inputs, _ = linen_scan(False)
    prog = lift(jax.make_jaxpr(apply)(*inputs))
    (scan,) = [n for n in prog.graph.nodes() if n.op.name == "scan"]
    body = scan.attrs["jaxpr"]
    paths = {n.meta["module_path"] for n in body.graph.nodes() if n.op is prims.dot_general}
    assert "Stack/layers/fc1" in paths and "Stack/layers/fc2" in paths
    assert all(n.loc.file == CORPUS for n in body.graph.nodes() if n.op is not CONST)


@pytest.mark.skipif(not has_transformers(), reason="transformers is not installed")
def test_hf_nodes_point_into_the_modeling_file():
    apply, inputs, _ = hf_bert()
    prog = lift(jax.make_jaxpr(apply)(*inputs))
    dots = [n for n in prog.graph.nodes() if n.op is prims.dot_general]
    assert all(n.loc.file.endswith("modeling_flax_bert.py") for n in dots)
    paths = {n.meta["module_path"] for n in dots}
    assert "FlaxBertModule/encoder/layer/0/attention/self/query" in paths


def _lowered_both_ways(monkeypatch, prog, *args):
    """The HLO (with source locations) of ``prog`` lowered with its equations re-emitted as
    recorded (lowering's fast path) and with every one bound again (the reference)."""
    import sys

    texts = []
    for reemit in (False, True):
        monkeypatch.setattr(sys.modules["pypm_jax.jax.lower"], "REEMIT", reemit)
        texts.append(jax.jit(lower(prog)).lower(*args).as_text(debug_info=True))
    return texts


def test_lowering_keeps_source_lines_and_module_paths(monkeypatch):
    """Re-emitting the equations a rewrite left alone gives the HLO binding each again
    gives, with each operation's source line and Flax module path in its metadata."""
    apply, inputs, _ = linen_mha(False)
    flat = jax.tree_util.tree_leaves(inputs)
    prog = lift(jax.make_jaxpr(lambda *xs: apply(*jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(inputs), xs)))(*flat))  # fmt: skip
    reference, fast = _lowered_both_ways(monkeypatch, prog, *flat)
    assert fast == reference
    assert CORPUS in fast and "Attn/attention/query/dot_general" in fast

    def f(x):
        with jax.named_scope("block"):
            y = jnp.exp(x) / 8.0  # rewritten: a rule-built mul with this line
            return jnp.tanh(y) + jnp.sin(x)

    x = jnp.linspace(0.0, 1.0, 8)
    prog, report, _ = _run(f, x, rules=[div8_to_mul])
    assert [r.rule for r in report] == ["div8_to_mul"]
    reference, fast = _lowered_both_ways(monkeypatch, prog, x)
    assert fast == reference
    line = f.__code__.co_firstlineno
    for op in ("exp", "mul", "tanh", "sin"):  # (mul: built by the rule, with div's line)
        assert f'/block/{op}"' in fast, op
    assert f'"{HERE}":{line + 2}:' in fast and f'"{HERE}":{line + 3}:' in fast


# ------------------------------------------------------------------------------ constants


def test_literals_and_splats_are_scalar_consts():
    big = np.full((4, 4), 2.0, np.float32)

    def f(x):
        return (x / 8.0) * big + jnp.asarray(np.arange(4, dtype=np.float32))

    prog = lift(jax.make_jaxpr(f)(jnp.ones((4, 4))))
    consts = [n for n in prog.graph.nodes() if n.op is CONST]
    values = [n.attrs["value"] for n in consts]
    scalars = [v for v in values if not isinstance(v, np.ndarray)]
    assert 8.0 in scalars and 2.0 in scalars  # the splat array became the scalar 2.0
    splat = next(
        n
        for n in consts
        if n.attrs["value"] is not None
        and type(n.attrs["value"]) is float
        and n.attrs["value"] == 2.0
    )
    assert splat.outputs[0].shape == (4, 4) and type(splat.attrs["value"]) is float
    assert any(isinstance(v, np.ndarray) for v in values)  # a small non-splat array


def test_literal_zeros_keep_their_sign():
    """``x * -0.0`` and ``x * 0.0`` are two nodes (hash-consing keys a zero's sign), so the
    lowered program divides by -0.0 where the model does."""

    def f(x):
        return 1.0 / (x * 0.0 + 1.0), 1.0 / (x * -0.0)

    x = jnp.ones(2)
    prog = lift(jax.make_jaxpr(f)(x))
    zeros = [n.attrs["value"] for n in prog.graph.nodes() if n.op is CONST]
    assert sorted(np.copysign(1.0, z) for z in zeros if z == 0.0) == [-1.0, 1.0]
    for got, want in zip(lower(prog)(x), f(x), strict=True):
        np.testing.assert_array_equal(got, want)  # (-inf, not inf)


def test_large_constants_are_fed_as_inputs():
    w = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)

    def f(x):
        return x @ w

    x = jnp.ones((2, 64))
    prog, _, run = _run(f, x)
    assert len(prog.hoisted) == 1 and prog.hoisted[0][0].shape == (64, 64)
    np.testing.assert_array_equal(run(x)[0], f(x))


def test_div_by_literal_matches_a_pattern():
    def f(x):
        return jnp.exp(x) / 8.0

    x = jnp.arange(6.0).reshape(2, 3)
    prog, report, run = _run(f, x, rules=[div8_to_mul])
    assert [r.rule for r in report] == ["div8_to_mul"]
    assert report[0].source.file == HERE
    assert any(n.op is prims.mul for n in prog.graph.nodes())
    np.testing.assert_allclose(run(x)[0], f(x), rtol=1e-6)


def test_rule_built_jax_ops_take_their_literals_dtype_from_use():
    def f(x):
        return x / 8.0

    x = jnp.arange(6.0, dtype=jnp.bfloat16)
    _, report, run = _run(f, x, rules=[div8_to_mul])
    assert len(report) == 1
    out = run(x)[0]
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(f(x), np.float32))


# ------------------------------------------------------------------------------ opaque


def test_effects_are_kept_and_never_merged(capfd):
    def f(x):
        jax.debug.print("first {}", x[0])
        jax.debug.print("first {}", x[0])
        a = jax.random.normal(jax.random.key(0), (3,))
        b = jax.random.normal(jax.random.key(0), (3,))
        return x + a - b

    x = jnp.ones(3)
    prog, _, run = _run(f, x)
    nodes = prog.graph.nodes()
    prints = [n for n in nodes if n.op.name == "debug_print"]
    assert len(prints) == 2 and all(not n.op.pure for n in prints)
    assert prints[0].op.op_class.name == "opaque"
    seeds = [n for n in nodes if n.op.name == "random_bits"]
    assert len(seeds) == 2  # equal random draws are not merged
    out = run(x)[0]
    jax.effects_barrier()
    assert capfd.readouterr().out.count("first 1.0") == 2
    np.testing.assert_allclose(out, f(x), rtol=1e-6)


def test_dead_code_is_not_lifted_but_effects_are(capfd):
    """What no output reads is not the program (Hugging Face's ``init_cache`` traces a whole
    model call whose outputs it drops): not lifted, so never rewritten or reported. An
    effect nothing reads is kept."""

    def f(x, w):
        unused = jnp.tanh(x @ w)  # noqa: F841
        jax.debug.print("kept {}", x[0])
        return x + 1.0

    x, w = jnp.ones(3), jnp.ones((3, 3))
    prog, _, run = _run(f, x, w)
    names = [n.op.name for n in prog.graph.nodes()]
    assert "tanh" not in names and "dot_general" not in names, names
    assert names.count("debug_print") == 1
    assert len(prog.inputs) == 2  # the inputs stay, read or not
    np.testing.assert_allclose(run(x, w)[0], f(x, w))
    jax.effects_barrier()
    assert "kept 1.0" in capfd.readouterr().out


def test_effects_inside_jitted_calls_do_not_hide_the_rest_of_the_body(capfd):
    @jax.jit
    def inner(a):
        jax.debug.print("inner {}", a[0])
        return jnp.exp(a) / 8.0

    def f(x):
        return inner(x) + 1.0

    x = jnp.ones(3)
    prog, report, run = _run(f, x, rules=[div8_to_mul])
    assert [r.rule for r in report] == ["div8_to_mul"]
    np.testing.assert_allclose(run(x)[0], f(x), rtol=1e-6)
    jax.effects_barrier()
    assert "inner 1.0" in capfd.readouterr().out


def test_unknown_primitives_become_opaque_and_lower_with_their_params():
    def host_square(a):
        return np.asarray(a) ** 2

    def f(x):
        y = jax.pure_callback(host_square, jax.ShapeDtypeStruct(x.shape, x.dtype), x * 2)
        return y + 1

    x = jnp.arange(5.0)
    prog, _, run = _run(f, x)
    (cb,) = [n for n in prog.graph.nodes() if n.op.name == "pure_callback"]
    assert not cb.op.pure and cb.op.op_class.name == "opaque" and cb.op.namespace == "jax.opaque"
    assert cb.loc.file == HERE
    np.testing.assert_allclose(run(x)[0], f(x))


def test_kept_whole_table_ops_match_only_when_named():
    @pm.pattern
    def Barrier(x):
        return prims.optimization_barrier(x)

    @pm.rule(Barrier)
    def drop_barrier(x):
        return x

    def f(x):
        return lax.optimization_barrier(x * 2.0)

    prog, report, _ = _run(f, jnp.ones(3))
    (barrier,) = [n for n in prog.graph.nodes() if n.op is prims.optimization_barrier]
    assert not barrier.op.pure
    _, report, _ = _run(f, jnp.ones(3), rules=[drop_barrier])
    assert [r.rule for r in report] == ["drop_barrier"]  # named explicitly: the user's call


def test_opaque_nodes_are_never_matched_by_operator_variables():
    """Operator variables must not match through an opaque (effectful/unknown) node."""

    def f(x):
        y = lax.optimization_barrier(x)
        jax.debug.print("{}", y)
        return y

    _, report, _ = _run(f, jnp.ones(3), rules=[mark_any_unary])
    fired_on = [r.op for r in report]
    assert "debug_print" not in fired_on and "optimization_barrier" not in fired_on


# ------------------------------------------------------------------------------ regions


def test_intact_custom_jvp_is_reemitted_with_its_rule():
    def f(x):
        return jnp.sum(jax.nn.relu(x) * 3.0) / 8.0

    x = jnp.zeros(4)  # relu's custom rule: d relu(0) = 0, where d max(x, 0) at 0 = 0.5
    prog, report, run = _run(f, x, rules=[div8_to_mul])
    assert len(report) == 1
    assert "custom_jvp_call" in _jaxpr_prims(lower(prog), x)
    np.testing.assert_array_equal(jax.grad(lambda x: run(x)[0])(x), jax.grad(f)(x))


def test_region_with_a_replaced_input_is_still_reemitted():
    def f(x):
        return jnp.sum(jax.nn.relu(jnp.exp(x) - 1.0))

    x = jnp.zeros(4)
    prog, report, run = _run(f, x, rules=[expm1_kernel])
    assert [r.rule for r in report] == ["expm1_kernel"]
    assert "custom_jvp_call" in _jaxpr_prims(lower(prog), x)
    np.testing.assert_array_equal(jax.grad(lambda x: run(x)[0])(x), jax.grad(f)(x))


def test_rewrite_inside_a_region_inlines_it():
    def f(x):
        return jax.nn.relu(x) * 2.0

    x = jnp.linspace(-1.0, 1.0, 7)
    prog, report, run = _run(f, x, rules=[max_to_relu_kernel])
    assert [r.rule for r in report] == ["max_to_relu_kernel"]
    assert "custom_jvp_call" not in _jaxpr_prims(lower(prog), x)
    np.testing.assert_allclose(run(x)[0], f(x))


def test_custom_vjp_keeps_its_backward_rule():
    @jax.custom_vjp
    def g(x):
        return jnp.sin(x)

    g.defvjp(lambda x: (jnp.sin(x), x), lambda r, ct: (3.0 * ct * jnp.cos(r),))

    def f(x):
        return jnp.sum(g(x) / 8.0)

    x = jnp.linspace(0.0, 1.0, 5)
    prog, report, run = _run(f, x, rules=[div8_to_mul])
    assert len(report) == 1
    np.testing.assert_allclose(jax.grad(lambda x: run(x)[0])(x), jax.grad(f)(x), rtol=1e-6)


def test_intact_remat_is_reemitted():
    def f(x):
        return jnp.sum(jax.checkpoint(lambda a: jnp.sin(a) ** 2)(x) / 8.0)

    x = jnp.linspace(0.0, 1.0, 5)
    prog, report, run = _run(f, x, rules=[div8_to_mul])
    assert len(report) == 1 and "remat2" in _jaxpr_prims(lower(prog), x)
    np.testing.assert_allclose(jax.grad(lambda x: run(x)[0])(x), jax.grad(f)(x), rtol=1e-6)


# ------------------------------------------------------------------------------ bodies


def test_rules_rewrite_inside_scan_while_and_cond_bodies():
    def f(xs, c):
        def step(carry, x):
            return carry + x / 8.0, jnp.exp(x) / 8.0

        carry, ys = lax.scan(step, c, xs)
        n, w = lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] / 8.0), (0, carry))
        z = lax.cond(w.sum() > 0, lambda a: a / 8.0, lambda a: a * 2.0, w)
        return ys, z

    xs = jnp.linspace(0.0, 1.0, 12).reshape(4, 3)
    c = jnp.ones(3)
    prog, report, run = _run(f, xs, c, rules=[div8_to_mul])
    assert [r.rule for r in report] == ["div8_to_mul"] * 4
    assert {r.source.file for r in report} == {HERE}
    got, want = run(xs, c), jax.tree.leaves(f(xs, c))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    for node, _, body in prog.nested():
        assert not any(n.op is prims.div for n in body.graph.nodes()), node


def test_gradients_through_rewritten_scan():
    def f(xs, c):
        carry, ys = lax.scan(lambda cr, x: (jnp.tanh(cr * x) / 8.0, cr), c, xs)
        return jnp.sum(carry) + jnp.sum(ys)

    xs = jnp.linspace(0.0, 1.0, 12).reshape(4, 3)
    c = jnp.ones(3)
    fast = optimize(f, rules=[div8_to_mul])
    assert len(fast.report(xs, c)) == 1
    np.testing.assert_allclose(jax.grad(fast)(xs, c), jax.grad(f)(xs, c), rtol=1e-5)


@pytest.mark.slow
def test_deep_graphs_lower_without_recursion():
    def f(x):
        for _ in range(3000):
            x = jnp.sin(x)
        return x

    x = jnp.ones(2)
    closed = jax.make_jaxpr(f)(x)
    out = lower(lift(closed))(x)[0]
    np.testing.assert_allclose(out, jax.jit(f)(x), rtol=1e-6)


def test_lift_jaxpr_takes_open_jaxprs_with_or_without_consts():
    from pypm_jax.jax import _compat
    from pypm_jax.jax.lift import lift_jaxpr

    w = np.arange(100.0, dtype=np.float32)
    x = jnp.linspace(0.0, 1.0, 100)
    jaxpr, consts = _compat.body_parts(jax.make_jaxpr(lambda x: x + w)(x))
    with_consts = lift_jaxpr(jaxpr, consts)  # constvars bound to the consts given
    assert len(with_consts.inputs) == 1
    np.testing.assert_allclose(lower(with_consts)(x)[0], x + w)
    as_inputs = lift_jaxpr(_compat.convert_constvars(jaxpr))  # constvars as leading inputs
    assert len(as_inputs.inputs) == 2
    np.testing.assert_allclose(lower(as_inputs)(w, x)[0], x + w)
