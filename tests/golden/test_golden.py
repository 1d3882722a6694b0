"""Printed forms that are contracts, compared with the golden files beside this module
(``PYPM_UPDATE_GOLDEN=1`` rewrites them): the core calculus of the paper's patterns (``show``),
a lifted jaxpr, a rewrite report with the rewritten graph, and explanations of a near miss.

The subjects are defined at the top of this module: their source lines are part of the
printed forms. A lifted node prints JAX's params, so the files hold for the pinned JAX.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import pypm_jax as pm
from pypm_jax.core.calculus import show, show_expr
from pypm_jax.jax import KernelInfo, lift, prims, register_describe, register_impl
from pypm_testing import paper_patterns as pp
from pypm_testing.golden import ROOT, assert_golden


@pm.pattern
def ScaledExp(x):
    return prims.exp(prims.div(x, 8.0))


@pm.op(op_class="kernel")
def GoldenScaledExp(x):
    return 1


register_impl(GoldenScaledExp, lambda x: jnp.exp(x * 0.125))


@pm.rule(ScaledExp)
def scaled_exp(x):
    assert x.dtype == pm.f32
    return GoldenScaledExp(x)


def program(w, x):
    y = jnp.exp(x @ w / 8.0)
    return jnp.tanh(y) + 1.0, jnp.exp(y / 8.0)


def lifted(dtype=jnp.float32):
    args = (jnp.ones((4, 3), dtype), jnp.ones((2, 4), dtype))
    return lift(jax.make_jaxpr(program)(*args)).graph


def relative(report):
    """The report with its sources relative to the repository root, so that the table's
    column widths do not depend on where the checkout lives."""
    root = str(ROOT) + "/"
    records = [
        dataclasses.replace(
            r, source=dataclasses.replace(r.source, file=r.source.file[len(root) :])
        )
        if r.source is not None and r.source.file.startswith(root)
        else r
        for r in report
    ]
    return type(report)(records)


# what the report's kernel columns say about the replacement (its describer)
register_describe(GoldenScaledExp, lambda attrs, t: KernelInfo("scaled_exp", t, ("1/8",)))

# ------------------------------------------------------------------------------ the tests

PAPER = ("MMxyT", "Half", "Gelu", "UnaryChain", "P", "PwSubgraph", "MatMulEpilogFixed")


def test_show_prints_the_core_calculus_of_the_papers_patterns():
    lines = []
    for name in PAPER:
        d = getattr(pp, name).definition
        params = ", ".join(p.name if p.kind == "term" else f"{p.name}: op" for p in d.params)
        lines += [f"{name}({params})  # {d.loc.file}:{d.loc.line}", f"  = {show(d.body)}"]
    rule = pp.cublasrule.definition
    lines.append(f"rule {rule.name} for {rule.pattern.name}  # {rule.loc.file}:{rule.loc.line}")
    for branch in rule.branches:
        lines.append(f"  when {show_expr(branch.guard)}: {branch.result.op.name}")
    assert_golden("show_paper_patterns", "\n".join(lines))


def test_a_lifted_jaxpr_prints_as_a_graph():
    assert_golden("lifted_graph", str(lifted()))


def test_a_rewrite_prints_its_report_and_the_rewritten_graph():
    g = lifted()
    result = pm.rewrite(g, [scaled_exp])
    assert result.report.counts() == {"scaled_exp": 2}
    assert_golden("rewrite_report", f"{relative(result.report)}\n\n{g}")


def test_explanations_print_the_deepest_partial_match_and_its_end():
    a = pm.leaf("a", shape=(2, 4), dtype=pm.f32)
    b = pm.leaf("b", shape=(3, 4), dtype=pm.f32)
    c = pm.leaf("c", shape=(4, 3), dtype=pm.f16)
    near_miss = pp.MatMul(a, pp.Trans(pp.Trans(b)))  # Trans has no shape rule: y.rank undefined
    wrong_rank = pp.MatMul(a, pp.Trans(pm.leaf("v", shape=(4,), dtype=pm.f32)))
    mixed = pp.MatMul(a, pp.Trans(c))
    texts = [
        str(pm.explain(pp.MMxyT, near_miss)),
        str(pm.explain(pp.MMxyT, wrong_rank)),
        str(pm.explain(pp.cublasrule, mixed)),
        str(pm.explain(scaled_exp, lifted(jnp.float16))),
    ]
    assert_golden("explanations", "\n\n".join(texts))
