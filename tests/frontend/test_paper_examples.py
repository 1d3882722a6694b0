"""Every example of the paper's figures, run (tests/pypm_testing/paper_patterns.py)."""

import pypm_jax as pm
from pypm_jax.core.calculus import show
from pypm_testing import paper_patterns as pp


def L(name, shape=(4, 8), dtype="f32"):
    return pm.leaf(name, shape=shape, dtype=dtype)


# --- cuBLAS ---------------------------------------------------------------------------


def test_mmxyt_compiles_to_guarded_core_pattern():
    d = pp.MMxyT.definition
    assert [(p.name, p.kind) for p in d.params] == [("x", "term"), ("y", "term")]
    assert show(d.body) == "MatMul(x, Trans(y)) ; guard(x.rank = 2) ; guard(y.rank = 2)"
    # each assert keeps the line it was written on
    guard_texts = []
    body = d.body
    while hasattr(body, "guard"):
        guard_texts.append(body.loc.text)
        body = body.pat
    assert sorted(guard_texts) == ["assert x.shape.rank == 2", "assert y.shape.rank == 2"]


def test_mmxyt_matches_only_rank2_xyT(engine):
    a, b = L("a"), L("b")
    m = pm.match(pp.MMxyT, pp.MatMul(a, pp.Trans(b)), engine=engine)
    assert m is not None and m["x"] is a and m["y"] is b
    assert pm.match(pp.MMxyT, pp.MatMul(a, b), engine=engine) is None
    a3 = L("a3", shape=(2, 4, 8))
    assert pm.match(pp.MMxyT, pp.MatMul(a3, pp.Trans(b)), engine=engine) is None


def test_cublas_rule_has_one_branch_per_feasible_path():
    branches = pp.cublasrule.definition.branches
    assert [b.result.op for b in branches] == [pp.cublasMM_xyT_f32, pp.cublasMM_xyT_i8]


def _rewrite_root(term, rules):
    result = pm.rewrite(pm.Graph([term]), rules)
    (out,) = result.graph.outputs
    return out, result.report


def test_cublas_rule_picks_kernel_by_element_type():
    for dtype, kernel in (("f32", pp.cublasMM_xyT_f32), ("i8", pp.cublasMM_xyT_i8)):
        a, b = L("a", dtype=dtype), L("b", dtype=dtype)
        out, report = _rewrite_root(pp.MatMul(a, pp.Trans(b)), [pp.cublasrule])
        assert out.op is kernel
        assert [v.op.name for v in out.inputs] == ["leaf", "leaf"]
        assert [v.attrs["name"] for v in out.inputs] == ["a", "b"]
        assert [r.rule for r in report] == ["cublasrule"]


def test_cublas_rule_does_not_fire_on_mixed_types():
    a, b = L("a", dtype="f32"), L("b", dtype="i8")
    out, report = _rewrite_root(pp.MatMul(a, pp.Trans(b)), [pp.cublasrule])
    assert out.op is pp.MatMul and report == []


# --- GELU alternates ------------------------------------------------------------------


def _gelu(x, half):
    return pp.Mul(half, pp.Plus(pm.const(1), pp.Erf(pp.Div(x, pm.const(pp.SQRT2)))))


def test_half_alternates_in_definition_order():
    assert show(pp.Half.definition.body) == "(Div(x, 2) ‖ Mul(x, 0.5))"


def test_gelu_matches_both_spellings(engine):
    a = L("a")
    for half in (pp.Div(a, pm.const(2)), pp.Mul(a, pm.const(0.5))):
        m = pm.match(pp.Gelu, _gelu(a, half), engine=engine)
        assert m is not None and m["x"] is a


def test_gelu_literal_matches_f32_rounded_constant(engine):
    a = L("a")
    rounded = pm.const(1.4142135, dtype="f32")  # what an f32 program holds
    t = pp.Mul(pp.Div(a, pm.const(2)), pp.Plus(pm.const(1), pp.Erf(pp.Div(a, rounded))))
    assert pm.match(pp.Gelu, t, engine=engine)["x"] is a


def test_gelu_is_nonlinear_in_x(engine):
    a, b = L("a"), L("b")
    assert pm.match(pp.Gelu, _gelu(b, pp.Div(a, pm.const(2))), engine=engine) is None


# --- UnaryChain -----------------------------------------------------------------------


def test_unary_chain_binds_the_longest_chain_first(engine):
    a = L("a")
    t = pp.Relu(pp.Relu(pp.Relu(a)))
    m = pm.match(pp.UnaryChain, t, engine=engine)
    assert m["x"] is a and m["f"] is pp.Relu
    xs = [m["x"] for m in pm.match_all(pp.UnaryChain, t, engine=engine)]
    assert xs == [a, pp.Relu(a), pp.Relu(pp.Relu(a))]


def test_unary_chain_operator_variable_is_consistent(engine):
    a = L("a")
    m = pm.match(pp.UnaryChain, pp.Relu(pp.Tanh(a)), engine=engine)
    assert m["f"] is pp.Relu and m["x"] is pp.Tanh(a)


# --- P(x, f, g) -----------------------------------------------------------------------


def test_p_binds_the_root_of_a_unary_binary_tree(engine):
    a, b = L("a"), L("b")
    t = pp.Add(pp.Relu(a), b)
    m = pm.match(pp.P, t, engine=engine)
    assert m["x"] is t and m["g"] is pp.Add and m["f"] is pp.Relu


def test_p_unary_tower(engine):
    a = L("a")
    t = pp.Neg(pp.Neg(a))
    m = pm.match(pp.P, t, engine=engine)
    assert m["x"] is t and m["f"] is pp.Neg and m["g"] is None


# --- epilogue -------------------------------------------------------------------------


def test_epilogue_as_printed_only_matches_a_bare_matmul(engine):
    a, b = L("a"), L("b")
    mm = pp.MatMul(a, b)
    assert pm.match(pp.MatMulEpilog, mm, engine=engine)["x"] is mm
    assert pm.match(pp.MatMulEpilog, pp.Relu(mm), engine=engine) is None


def test_epilogue_corrected_matches_pointwise_chains_over_matmul(engine):
    a, b = L("a"), L("b")
    mm = pp.MatMul(a, b)
    t = pp.Relu(pp.Tanh(mm))
    assert pm.match(pp.MatMulEpilogFixed, t, engine=engine)["x"] is t
    assert pm.match(pp.MatMulEpilogFixed, pp.Relu(mm), engine=engine)["x"] is pp.Relu(mm)
    assert pm.match(pp.MatMulEpilogFixed, pp.Neg(mm), engine=engine) is None  # not pointwise
    assert pm.match(pp.MatMulEpilogFixed, mm, engine=engine) is None  # no epilogue
