"""The region and attention rules' cheap checks agree with the plans they stand in for.

``rules.beyond_linear`` (``FedByGemm``) turns a GEMM epilogue region's root away before the
pattern's recursion explores it, where every region there is one ``rules.gemm_region_plan``
leaves to XLA (a bare GEMM and linear steps: casts, a bias or residual add, a constant
scale). ``rules.attention_output`` (``OutputDot``) turns a ``dot_general`` away before the
attention patterns explore the softmax under it, where ``rules.attention_plan`` cannot read
it as an attention's output. Each must refuse only what its plan refuses (the same rewrites
everywhere); at the sites they exist for, they save the work they were added for, counted
in machine steps, never in seconds.
"""

from __future__ import annotations

import itertools
from unittest import mock

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pypm_jax as pm
from pypm_jax.core.graph import Graph
from pypm_jax.core.terms import term_attr
from pypm_jax.engine import compiled as _compiled
from pypm_jax.engine.fast import MatchRun, compile_pattern
from pypm_jax.engine.rewrite import guarded_pattern
from pypm_jax.jax.lift import lift
from pypm_jax.lang.frontend import as_rule_def
from pypm_jax.rules import _gemm_regions
from pypm_jax.rules._gemm_regions import beyond_linear, reads_gemm, region_plan
from pypm_jax.rules._plans import attention_output, attention_plan
from pypm_jax.rules.attention import ATTENTION_RULES, attention_bias
from pypm_jax.rules.attention_region import attention_region
from pypm_jax.rules.epilogue import PwRegion, gemm_epilogue_region
from pypm_jax.rules.gemm import GEMM_RULES
from pypm_jax.vocab import prims as P

M, K, N, E = 8, 16, 16, 2


@pm.pattern
def AnyRegion(r, y, x, w, u, o):
    """``GemmEpilogueRegion`` without ``rules.beyond_linear``: every region at ``r``."""
    assert reads_gemm(r.term)
    r <= PwRegion(y, x, w, u, o)
    return r


def _plans(theta: dict) -> list:
    """What ``gemm_epilogue_region``'s guards compute on one solution: the region alone
    and with its operand (the rule fires a branch only where one is not None)."""
    r, y, x, w = (theta[k] for k in "ryxw")
    args = (term_attr(x, "shape"), term_attr(w, "shape"))
    dtypes = (term_attr(x, "dtype"), term_attr(w, "dtype"), term_attr(y, "dtype"))
    out = [region_plan(r, y, None, *args, dtypes)]
    if theta.get("o") is not None:
        out.append(region_plan(r, y, theta["o"], *args, dtypes))
    return out


def _solutions(v) -> list[dict]:
    run = MatchRun(distinct=True)
    return [theta for theta, _, _ in compile_pattern(AnyRegion.definition).solutions(v, run)]


def _check_every_node(graph, monkeypatch, exact: bool = True) -> tuple[int, int]:
    """At each value: if ``beyond_linear`` refuses it, no region there has a plan; and
    (``exact``) where the regions' only refusal is their linearity, it refuses. Returns
    (roots with regions, roots refused)."""
    roots = refused = 0
    for node in graph.nodes():
        if len(node.outputs) != 1:
            continue
        v = node.outputs[0]
        sols = _solutions(v)
        if not sols:
            continue
        roots += 1
        planned = any(p is not None for s in sols for p in _plans(s))
        with monkeypatch.context() as m:  # region_plan with no linear refusal
            m.setattr(_gemm_regions, "_linear", lambda *_: False)
            unless_linear = any(p is not None for s in sols for p in _plans(s))
        verdict = beyond_linear(v)
        where = f"%{node.id} {node.op.name}"
        if planned:
            assert verdict, f"{where}: a region has a plan, yet beyond_linear refuses it"
        elif unless_linear and exact:
            assert not verdict, f"{where}: every region is linear, yet beyond_linear lets it in"
        refused += not verdict
    return roots, refused


def _args(seed: int, experts: bool = False):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    x = jax.random.normal(ks[0], (M, K))
    w = jax.random.normal(ks[1], (E, K, N) if experts else (K, N)) * 0.1
    return (
        x,
        w,
        jax.random.normal(ks[2], (N,)),  # b: a column
        jax.random.normal(ks[3], (M, N)),  # r: a full tile
        jax.random.normal(ks[4], (M,)),  # s: a row
        jax.random.normal(ks[5], ()),  # a: a scalar
    )


# BERT's dense layers and their neighbours: linear regions (left to XLA) and regions with a
# plan, on bare GEMMs and on the kernel nodes the dense + activation rules build
PROGRAMS = {
    "bias": lambda x, w, b, r, s, a: x @ w + b,
    "bias then residual": lambda x, w, b, r, s, a: (x @ w + b) + r,
    "scaled bias and residual": lambda x, w, b, r, s, a: (x @ w + b) * 0.5 + r,
    "divided, cast": lambda x, w, b, r, s, a: ((x @ w) / 8.0).astype(jnp.bfloat16),
    "residual first": lambda x, w, b, r, s, a: r + x @ w,
    "exact gelu": lambda x, w, b, r, s, a: jax.nn.gelu(x @ w + b, approximate=False),
    "tanh gelu": lambda x, w, b, r, s, a: jax.nn.gelu(x @ w + b),
    "relu": lambda x, w, b, r, s, a: jax.nn.relu(x @ w + b),
    "gelu, then a residual": lambda x, w, b, r, s, a: jax.nn.gelu(x @ w + b) + r,
    "relu, then a scale": lambda x, w, b, r, s, a: jax.nn.relu(x @ w + b) * 0.5,
    "per-row scale": lambda x, w, b, r, s, a: (x @ w) * s[:, None],
    "per-row add": lambda x, w, b, r, s, a: (x @ w) + s[:, None],
    "scalar operand": lambda x, w, b, r, s, a: (x @ w) * a + b,
    "plus a literal": lambda x, w, b, r, s, a: (x @ w) + 1.0,
    "twice the GEMM": lambda x, w, b, r, s, a: (x @ w) + (x @ w) * 2.0,
    "clip": lambda x, w, b, r, s, a: jnp.clip(x @ w + b, -1.0, 1.0),
    "where": lambda x, w, b, r, s, a: jnp.where(x @ w > 0, x @ w, 0.0) + r,
}
# a linear region whose operand is computed from another input: the walk cannot tell that
# operand from a step (the pattern can: an operand is read by the GEMM's own operator), so
# it lets the root in, and the rule's guard refuses the regions there as before
CONSERVATIVE = {"bias of a tanh": lambda x, w, b, r, s, a: x @ w + jnp.tanh(r)}

EXPERTS = {
    "experts": lambda x, w: jnp.einsum("th,ehm->etm", x, w),
    "experts, per-expert bias": lambda x, w: jnp.einsum("th,ehm->etm", x, w) + w[:, 0:1, :],
    "experts, silu": lambda x, w: jax.nn.silu(jnp.einsum("th,ehm->etm", x, w)),
}


@pytest.mark.parametrize("name", [*PROGRAMS, *CONSERVATIVE])
@pytest.mark.parametrize("kernels", [False, True], ids=["bare", "after the dense rules"])
def test_beyond_linear_refuses_only_regions_without_a_plan(name, kernels, monkeypatch):
    fn = PROGRAMS.get(name) or CONSERVATIVE[name]
    prog = lift(jax.make_jaxpr(fn)(*_args(0)))
    if kernels:  # GemmEpilogue nodes below the regions
        pm.rewrite(prog.graph, [as_rule_def(r) for r in GEMM_RULES])
    roots, _ = _check_every_node(prog.graph, monkeypatch, exact=name in PROGRAMS)
    assert roots or kernels, "no region root: the program tests nothing"


@pytest.mark.parametrize("name", list(EXPERTS))
def test_beyond_linear_on_experts(name, monkeypatch):
    x, w, *_ = _args(1, experts=True)
    prog = lift(jax.make_jaxpr(EXPERTS[name])(x, w))
    _check_every_node(prog.graph, monkeypatch)


# a chain of pointwise steps over x @ w: each step reads the chain and maybe an operand
_STEPS = {
    "bias": lambda h, o: h + o["b"],
    "residual": lambda h, o: o["r"] + h,
    "row": lambda h, o: h + o["s"][:, None],
    "row scale": lambda h, o: h * o["s"][:, None],
    "scalar": lambda h, o: h * o["a"],
    "half": lambda h, o: h * 0.5,
    "half first": lambda h, o: 0.5 * h,
    "by 8": lambda h, o: h / 8.0,
    "8 by": lambda h, o: 8.0 / h,
    "plus 1": lambda h, o: h + 1.0,
    "minus": lambda h, o: h - o["r"],
    "neg": lambda h, o: -h,
    "tanh": lambda h, o: jnp.tanh(h),
    "relu": lambda h, o: jax.nn.relu(h),
    "bf16 and back": lambda h, o: h.astype(jnp.bfloat16).astype(jnp.float32),
    "square": lambda h, o: h * h,
}


@settings(max_examples=40, deadline=None)
@given(chain=st.lists(st.sampled_from(sorted(_STEPS)), min_size=1, max_size=4))
def test_beyond_linear_on_generated_chains(chain, monkeypatch_module):
    x, w, b, r, s, a = _args(2)
    ops = {"b": b, "r": r, "s": s, "a": a}

    def fn(x, w, ops):
        h = x @ w
        for step in chain:
            h = _STEPS[step](h, ops)
        return h

    prog = lift(jax.make_jaxpr(fn)(x, w, ops))
    _check_every_node(prog.graph, monkeypatch_module)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as m:
        yield m


def _steps_at(rule, v) -> int:
    """Machine steps of every solution of ``rule``'s pattern (its guard joined in, as the
    rewrite driver matches it) at ``v``: the driver's work there, at most."""
    run = MatchRun(distinct=True)
    for _ in compile_pattern(guarded_pattern(as_rule_def(rule))).solutions(v, run):
        pass
    return run.steps


def test_a_linear_region_fails_at_its_root():
    """BERT's bias adds (72 on BERT-base): before, the region pattern found every region
    there and the rule's guard refused each one."""
    prog = lift(jax.make_jaxpr(PROGRAMS["scaled bias and residual"])(*_args(0)))
    for node in prog.graph.nodes():
        assert _steps_at(gemm_epilogue_region, node.outputs[0]) <= 20, node.op.name  # (310-479)


# --------------------------------------------------------------------------- attention


@settings(max_examples=300, deadline=None)
@given(
    lens=st.tuples(*[st.integers(0, 2)] * 4),
    axes=st.lists(st.integers(0, 3), min_size=8, max_size=8),
    rank=st.integers(2, 5),
)
def test_attention_output_is_necessary_for_a_plan(lens, axes, rank):
    """Wherever ``attention_plan`` plans an output ``dot_general``, ``attention_output``
    holds (so the check refuses no attention the rules rewrite); the plan's other
    arguments are an attention's."""
    it = iter(axes)
    dn_parts = [tuple(next(it) for _ in range(n)) for n in lens]
    o_dn = ((dn_parts[0], dn_parts[1]), (dn_parts[2], dn_parts[3]))
    sizes = (1, 2, 8, 4, 3)[:rank]
    shapes = ((1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4))
    scores = ((((3,), (3,)), ((0, 1), (0, 1))), (1, 2, 8, 8), (3,))
    for o_shape in itertools.permutations(sizes):
        plan = attention_plan(shapes, ("float32",) * 3, scores, (o_dn, o_shape, "float32"))
        if plan is not None:
            assert attention_output(o_dn, len(o_shape)), (o_dn, o_shape)


def _head_masked_attention():
    """Hugging Face BERT's attention with its all-ones head mask
    (``einsum("...hqk,h->...hqk", p, head_mask)``)."""

    def fn(q, k, v, bias):
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) + bias
        head_mask = jnp.ones((2,))
        p = jnp.einsum("...hqk,h->...hqk", jax.nn.softmax(scores, axis=-1), head_mask)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    qkv = jax.random.normal(jax.random.key(0), (2, 8, 2, 4))
    return lift(jax.make_jaxpr(fn)(qkv, qkv, qkv, jnp.zeros((2, 1, 1, 8))))


@pytest.mark.parametrize("rule", [*ATTENTION_RULES, attention_region], ids=lambda r: r.name)
def test_the_head_mask_einsum_is_no_attention_output(rule):
    """At the head-mask einsum (a ``dot_general`` contracting nothing), the attention
    patterns used to match the whole softmax and its logits under it, then the plan
    refused them; now they stop at the ``dot_general``. The attention is still
    rewritten (by ``attention_bias``)."""
    prog = _head_masked_attention()
    (head_mask_dot,) = [
        n for n in prog.graph.nodes()
        if n.op.name == "dot_general" and not n.attrs["dimension_numbers"][0][0]
    ]  # fmt: skip
    assert _steps_at(rule, head_mask_dot.outputs[0]) <= 60  # (444 for attention_bias before)
    report = pm.rewrite(prog.graph, [as_rule_def(r) for r in ATTENTION_RULES]).report
    assert report.counts() == {"attention_bias": 1}, str(report)


def _machine_steps(rule, v, deep: bool = True) -> tuple[int, int]:
    """(solutions, machine steps) of ``rule``'s guarded pattern at ``v`` on the machine, as
    ``pm.optimize`` runs the shipped rules; ``deep=False``: without the deep pre-check."""
    pdef = guarded_pattern(as_rule_def(rule))
    with mock.patch.object(
        _compiled, "_deep_prefilter", _compiled._deep_prefilter if deep else (lambda body: None)
    ):
        cp = _compiled.CompiledPattern(pdef, backend="machine")
    run = MatchRun(distinct=True)
    return len(list(cp.solutions(v, run))), run.steps


@pytest.mark.parametrize("rule", ATTENTION_RULES, ids=lambda r: r.name)
def test_attention_spellings_that_do_not_apply_stop_before_the_softmax(rule):
    """BERT's attention (a padding bias, the head-mask einsum): at its output the patterns
    of the other spellings (a scale on the scores, a mask, none) used to match the softmax
    and the probabilities' einsum first, then refuse the logits below (~200 machine steps
    each here, ~430 on BERT-base); the deep pre-check refuses the logits before the
    machine starts."""
    prog = _head_masked_attention()
    (out,) = [
        n.outputs[0] for n in prog.graph.nodes()
        if n.op.name == "dot_general" and _machine_steps(attention_bias, n.outputs[0])[0]
    ]  # fmt: skip
    found, steps = _machine_steps(rule, out)
    if rule is attention_bias:
        assert found == 1 and steps > 0
        return
    assert (found, steps) == (0, 0)
    if not rule.name.startswith("attention_dpa"):  # (their root is another operator)
        assert _machine_steps(rule, out, deep=False)[1] >= 150


# ``rules.reads_gemm`` remembers, in its graph's memo, the values its walk surely stops at
# with False (``_ends_false``): it must answer as the walk alone does, on graphs of steps,
# GEMMs, reductions, literals and inputs read by several nodes, and after the graph changes.
_UNARY = (P.exp, P.neg)
_BINARY = (P.add, P.mul, P.sub)
_DENSE = {"dimension_numbers": (((1,), (0,)), ((), ())), "precision": None}


def _walk_alone(v) -> bool:
    with mock.patch.object(_gemm_regions, "_ends_false", lambda *a: False):
        return reads_gemm(v)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_reads_gemm_remembers_only_what_its_walk_finds(data):
    g = Graph()
    x = g.add_input("x", (M, K), "f32")
    w = g.add_input("w", (K, N), "f32")
    values = [g.add_input("b", (M, N), "f32")]
    for _ in range(data.draw(st.integers(1, 14), label="nodes")):
        kind = data.draw(st.sampled_from(("unary", "binary", "gemm", "reduce", "literal")))
        if kind == "gemm":
            op, ins, attrs = P.dot_general, [x, w], _DENSE
        elif kind == "literal":
            values.append(g.add_const(data.draw(st.sampled_from((0.5, 2.0)))))
            continue
        elif kind == "reduce":  # (not a step: the walk stops there with False)
            src = data.draw(st.sampled_from(values))
            r = g.add_node(P.reduce_sum, [src], {"axes": (1,)}, out_types=[((M,), "f32")])
            op, ins = P.broadcast_in_dim, [r.outputs[0]]
            attrs = {"shape": (M, N), "broadcast_dimensions": (0,), "sharding": None}
        elif kind == "unary":
            op, ins, attrs = (
                data.draw(st.sampled_from(_UNARY)),
                [data.draw(st.sampled_from(values))],
                {},
            )
        else:
            op = data.draw(st.sampled_from(_BINARY))
            ins, attrs = [data.draw(st.sampled_from(values)) for _ in range(2)], {}
        values.append(g.add_node(op, ins, attrs, out_types=[((M, N), "f32")]).outputs[0])
    for _ in range(data.draw(st.integers(1, 3), label="rounds")):
        for v in data.draw(st.permutations(values)):  # (asked in any order: the memo fills)
            if v.node.alive:
                assert reads_gemm(v) == _walk_alone(v)
        old, new = (data.draw(st.sampled_from(values)) for _ in range(2))
        if old.node.alive and new.node.alive and old is not new and old.node.inputs:
            g.replace_all_uses(old, new)  # (the memo is emptied: facts below may change)
