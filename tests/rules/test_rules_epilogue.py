"""GEMM epilogue regions: hand-written epilogues, each in two forms, fused by the region rule.

Every spelling of the table runs as its own GEMM site of one program (one trace, one
compile per form, kernels in the Pallas interpreter): the rewritten program must compute
each site's value with a ``GemmRegion`` kernel whose region the report shows, keep no
``dot_general``, and equal the original in values (f32: 1e-5 relative) and gradients.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pypm_jax as pm
from pypm_jax.rules import GemmRegion, default_rules, gemm_epilogue_region
from pypm_jax.rules._gemm_regions import GemmRegionPlan
from pypm_jax.rules._kernels import FUSE_ENV, gemm_impl
from pypm_jax.rules._region import describe
from pypm_testing.rules import kernel_nodes, pallas_calls, rel_close, rewrite

M, K, N = 8, 16, 16
GELU_C = math.sqrt(2.0 / math.pi)


def _gelu_times_1_5(h):  # 1.5 * tanh-GELU with the 0.5 folded in: no activation rule's
    return 0.75 * h * (1.0 + jnp.tanh(GELU_C * (h + 0.044715 * h**3)))


def _selu(h):
    return 1.0507009873554805 * jnp.where(h > 0, h, 1.6732632423543772 * jnp.expm1(h))


# name -> (form A, form B); each takes (h, ops) with h = x @ w (+ b) and ops the operands:
# r a residual [M, N], s a per-row [M], g a per-column [N], a a scalar (0-d array).
SPELLINGS = {
    "softplus": (lambda h, o: jax.nn.softplus(h), lambda h, o: jnp.log1p(jnp.exp(h))),
    "mish": (
        lambda h, o: h * jnp.tanh(jax.nn.softplus(h)),
        lambda h, o: jnp.tanh(jnp.log1p(jnp.exp(h))) * h,
    ),
    "squared relu": (
        lambda h, o: jax.nn.relu(h) ** 2,
        lambda h, o: jnp.square(jnp.maximum(h, 0.0)),
    ),
    "clip": (
        lambda h, o: jnp.clip(h, -1.0, 1.0),
        lambda h, o: jnp.minimum(jnp.maximum(h, -1.0), 1.0),
    ),
    "gelu times a scale": (lambda h, o: jax.nn.gelu(h) * 1.5, lambda h, o: _gelu_times_1_5(h)),
    "silu plus a residual": (
        lambda h, o: jax.nn.silu(h) + o["r"],
        lambda h, o: o["r"] + h * jax.nn.sigmoid(h),
    ),
    "per-row scale": (
        lambda h, o: jnp.tanh(h) * o["s"][:, None],
        lambda h, o: o["s"][:, None] * jnp.tanh(h),
    ),
    "per-column scale": (
        lambda h, o: jax.nn.relu(h) * o["g"],
        lambda h, o: o["g"] * jnp.maximum(h, 0.0),
    ),
    "scalar operand": (
        lambda h, o: jax.nn.sigmoid(h) * o["a"],
        lambda h, o: o["a"] / (1.0 + jnp.exp(-h)),
    ),
    "leaky relu": (
        lambda h, o: jax.nn.leaky_relu(h, 0.1),
        lambda h, o: jnp.where(h > 0, h, 0.1 * h),
    ),
    "elu": (lambda h, o: jax.nn.elu(h), lambda h, o: jnp.where(h > 0, h, jnp.expm1(h))),
    "hard swish": (
        lambda h, o: jax.nn.hard_swish(h),
        lambda h, o: h * jnp.clip(h + 3.0, 0.0, 6.0) / 6.0,
    ),
    "soft-capping": (
        lambda h, o: jnp.tanh(h / 30.0) * 30.0,
        lambda h, o: 30.0 * jnp.tanh(h * (1.0 / 30.0)),
    ),
    "log-sigmoid": (lambda h, o: jax.nn.log_sigmoid(h), lambda h, o: -jax.nn.softplus(-h)),
    "selu": (lambda h, o: jax.nn.selu(h), lambda h, o: _selu(h)),
    "exp of minus": (lambda h, o: jnp.exp(-h), lambda h, o: 1.0 / jnp.exp(h)),
    "residual then relu": (
        lambda h, o: jax.nn.relu(h + o["r"]),
        lambda h, o: jnp.maximum(o["r"] + h, 0.0),
    ),
}
NAMES = list(SPELLINGS)
# every other site has a bias (both kinds of dense), but not the one adding a residual first:
# a rewrite takes one new operand, and a bias alone on a GEMM is XLA's (see RULES.md)
BIASED = frozenset(NAMES[::2]) - {"residual then relu"}


def _program(form: int):
    def sites(x, ws, bs, ops):
        out = {}
        for i, name in enumerate(NAMES):
            h = x @ ws[i] + bs[i] if name in BIASED else x @ ws[i]
            out[name] = SPELLINGS[name][form](h, ops)
        return out

    return sites


def _args(seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 8)
    n = len(NAMES)
    x = jax.random.normal(k[0], (M, K))
    ws = jax.random.normal(k[1], (n, K, N)) / 2
    bs = jax.random.normal(k[2], (n, N))
    ops = {
        "r": jax.random.normal(k[3], (M, N)),
        "s": jax.random.normal(k[4], (M,)),
        "g": jax.random.normal(k[5], (N,)),
        "a": jax.random.normal(k[6], ()),
    }
    return x, ws, bs, ops


def _producers(fast, args):
    prog = fast.lifted(*args)
    outs = dict(zip(sorted(NAMES), prog.graph.outputs, strict=True))  # a dict: sorted keys
    return prog.graph, {name: v.node for name, v in outs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("form", [0, 1], ids=["form A", "form B"])
def test_every_spelling_is_one_region_kernel_with_equal_values_and_gradients(form):
    fn = _program(form)
    args = _args()
    fast, got, report = rewrite(fn, args)
    graph, producers = _producers(fast, args)
    assert not [n for n in graph.nodes() if n.op.name == "dot_general"], str(report)
    details = {r.detail for r in report if r.rule == "gemm_epilogue_region"}
    for name, node in producers.items():
        assert node.op is GemmRegion, f"{name}: {node.op.name}\n{report}"
        assert describe(node.attrs["region"]) in details, name
    want = jax.jit(fn)(*args)
    for name in NAMES:
        rel_close(want[name], got[name], name)
    cot = {name: jax.random.normal(jax.random.PRNGKey(i), (M, N)) for i, name in enumerate(NAMES)}

    def loss(f):
        return lambda *a: sum(jnp.vdot(f(*a)[n], cot[n]) for n in NAMES)

    g_want = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2, 3)))(*args)
    g_got = jax.jit(jax.grad(loss(fast), argnums=(0, 1, 2, 3)))(*args)
    rel_close(g_want, g_got, "gradients", tol=(1e-5, 1e-5))


def test_the_papers_matmul_epilog_as_the_standard_rule():
    """``MatMulEpilog``: a MatMul followed by a chain of unary pointwise operators (the
    paper's figure, corrected in tests/pypm_testing/paper_patterns.py) is one region."""

    def epilog(x, w):
        return jnp.exp(jnp.tanh(jnp.sin(x @ w)))

    x, ws, _, _ = _args(1)
    fast, got, report = rewrite(epilog, (x, ws[0]), rules=[gemm_epilogue_region])
    assert report.counts() == {"gemm_epilogue_region": 3}  # grown one operator at a time
    assert report[-1].detail == "exp(tanh(sin(acc)))"
    rel_close(jax.jit(epilog)(x, ws[0]), got, "MatMulEpilog")
    (node,) = kernel_nodes(fast, (x, ws[0]))
    assert isinstance(node.attrs["plan"], GemmRegionPlan) and node.attrs["plan"].operands == ()


def test_bf16_round_trip_inside_the_region():
    """Casting to bf16 and back inside an epilogue: the region rounds where the program did
    (bf16 tolerance: the kernel's f32 accumulator may round the other way at a tie)."""

    def dense(x, w):
        return jnp.tanh((x @ w).astype(jnp.bfloat16)).astype(jnp.float32)

    x, ws, _, _ = _args(2)
    fast, got, report = rewrite(dense, (x, ws[0]))
    assert report.counts() == {"gemm_epilogue_region": 2}, str(report)  # then the cast back
    assert report[-1].detail == "float32(tanh(bfloat16(acc)))"
    rel_close(jax.jit(dense)(x, ws[0]), got, "bf16 round trip", tol=(1e-2, 1e-2))


def test_bare_bias_and_residual_adds_stay_with_xla():
    """A GEMM plus a bias, a residual or a constant scale is what XLA folds into its own
    GEMM: no region (``gemm_epilogue_linear`` is the opt-in rule for bias adds)."""

    def linear(x, w, b, r):
        return (x @ w + b) * 0.5 + r

    x, ws, bs, ops = _args(3)
    _, _, report = rewrite(linear, (x, ws[0], bs[0], ops["r"]))
    assert report.counts() == {}, str(report)


@pytest.mark.parametrize(
    ("what", "fn", "stopper", "why"),
    [
        # lgamma has no kernel lowering: the region ends before it
        (
            "an operator without a lowering",
            lambda h, t: jax.lax.lgamma(jnp.tanh(h)),
            "lgamma",
            "rules.reads_gemm(r.term) is false",
        ),
        # a per-batch bias [B, 1, N] of a [B, S, N] result: no tile of it lines up
        (
            "an operand the kernel cannot tile",
            lambda h, t: jnp.tanh(h) * t,
            "mul",
            "rules.gemm_region_plan(…) = None, r.term = %",
        ),
    ],
)
def test_a_region_stops_where_the_kernel_cannot_go(what, fn, stopper, why):
    """The fused part is a whole region (values equal); the rest stays as written, and
    ``pm.explain`` on the stopping node names the check that refused it."""
    x = jax.random.normal(jax.random.PRNGKey(4), (2, 4, K))
    w = _args(4)[1][0]
    t = jax.random.normal(jax.random.PRNGKey(5), (2, 1, N))

    def dense(x, w, t):
        return fn(x @ w, t)

    fast, got, report = rewrite(dense, (x, w, t))
    rel_close(jax.jit(dense)(x, w, t), got, what)
    graph = fast.lifted(x, w, t).graph
    (out,) = graph.outputs
    assert out.node.op.name == stopper, f"{what}\n{report}"
    assert any(n.op is GemmRegion or n.op.name == "GemmEpilogue" for n in graph.nodes())
    text = str(pm.explain(gemm_epilogue_region, out))
    assert why in text, text


def test_fuse_policy(monkeypatch):
    """``never`` runs XLA's GEMM; ``auto`` leaves the epilogues XLA fuses itself to XLA on a
    GPU unless a kernel implementation is asked for; ``always`` never does."""
    import pallas_kernels._dispatch as dsp

    monkeypatch.delenv("PYPM_KERNEL_IMPL", raising=False)
    monkeypatch.setattr(dsp, "on_gpu", lambda: True)
    for policy, fused, want in [
        ("auto", True, "xla"),
        ("auto", False, None),
        ("always", True, None),
        ("never", False, "xla"),
    ]:
        monkeypatch.setenv(FUSE_ENV, policy)
        assert gemm_impl(fused) == want, (policy, fused)
    monkeypatch.setenv(FUSE_ENV, "auto")
    monkeypatch.setenv("PYPM_KERNEL_IMPL", "pallas")
    assert gemm_impl(True) is None  # an explicit kernel request wins over auto
    monkeypatch.setattr(dsp, "on_gpu", lambda: False)
    monkeypatch.delenv("PYPM_KERNEL_IMPL")
    assert gemm_impl(True) is None  # on a CPU the kernels' auto choice is the reference
    monkeypatch.setenv(FUSE_ENV, "sometimes")
    with pytest.raises(ValueError, match="PYPM_GEMM_FUSE"):
        gemm_impl(True)


def test_fuse_never_runs_no_kernel_and_computes_the_same(monkeypatch):
    def dense(x, w, b):
        return jax.nn.softplus(x @ w + b) * 2.0

    x, ws, bs, _ = _args(6)
    args = (x, ws[0], bs[0])
    monkeypatch.setenv(FUSE_ENV, "never")
    fast, got, report = rewrite(dense, args)
    assert report.counts() == {"gemm_epilogue_region": 2}  # the rewrite is the same...
    assert not pallas_calls(fast, args)  # ...but XLA runs it
    rel_close(jax.jit(dense)(*args), got, "fuse=never")


def test_default_rules_end_with_the_region_rule():
    names = [r.name for r in default_rules()]
    assert names[-1] == "gemm_epilogue_region"
    assert names.index("gemm_epilogue") < names.index("gemm_epilogue_region")


def test_gemm_region_plan_records_operand_kinds():
    def dense(x, w, r, s, g, a):
        return ((jnp.tanh(x @ w) + r) * s[:, None] + g) * a

    x, ws, _, o = _args(7)
    args = (x, ws[0], o["r"], o["s"], o["g"], o["a"])
    fast, got, report = rewrite(dense, args)
    (node,) = kernel_nodes(fast, args)
    assert node.attrs["plan"].operands == ("full", "row", "col", "scalar"), str(report)
    assert describe(node.attrs["region"]) == "(((tanh(acc) + in0) * in1) + in2) * in3"
    rel_close(jax.jit(dense)(*args), got, "four operands")
    np.testing.assert_array_equal(np.asarray(node.attrs["plan"].out_shape), (M, N))
