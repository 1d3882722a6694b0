"""The DSL's constructs and what they compile to (printed in the paper's notation)."""

import pypm_jax as pm
from pypm_jax.core.calculus import PGuard, show
from pypm_testing.paper_patterns import Add, MatMul, Relu, Tanh


@pm.op
def Split(x):
    return 2


@pm.op(attrs=("stride",), op_class="conv")
def Conv(x, w):
    return 1


@pm.op
def Cast(x):
    return 1


@pm.op(infer=lambda x: (x.shape, x.dtype), op_class="unary_pointwise")
def Exp(x):
    return 1


def L(name, shape=(4, 8), dtype="f32"):
    return pm.leaf(name, shape=shape, dtype=dtype)


def test_if_elif_else_paths_become_guarded_alternates(engine):
    @pm.pattern
    def ByRank(x):
        if x.rank == 2:
            return Relu(x)
        elif x.rank == 3:
            return Tanh(x)
        else:
            return Add(x, x)

    d = ByRank.definition
    assert show(d.body) == (
        "(Relu(x) ; guard(x.rank = 2) ‖ (Tanh(x) ; guard(¬x.rank = 2) ; guard(x.rank = 3) ‖ "
        "Add(x, x) ; guard(¬x.rank = 2) ; guard(¬x.rank = 3)))"
    )
    a2, a3, a1 = L("a2"), L("a3", shape=(1, 2, 3)), L("a1", shape=(5,))
    assert pm.match(ByRank, Relu(a2), engine=engine)["x"] is a2
    assert pm.match(ByRank, Relu(a3), engine=engine) is None
    assert pm.match(ByRank, Tanh(a3), engine=engine)["x"] is a3
    assert pm.match(ByRank, Add(a1, a1), engine=engine)["x"] is a1
    assert pm.match(ByRank, Add(a2, a2), engine=engine) is None


def test_guards_with_arithmetic_indexing_and_dtype_sets(engine):
    @pm.pattern
    def Square(x, y):
        assert x.shape[0] * 2 == x.shape[-1] and x.dtype in (pm.f32, pm.bf16)
        assert not (y.rank != 2)
        return MatMul(x, y)

    a = L("a", shape=(4, 8))
    b = L("b", shape=(8, 3), dtype="bf16")
    assert pm.match(Square, MatMul(a, b), engine=engine)["y"] is b
    assert pm.match(Square, MatMul(L("c", shape=(4, 9)), b), engine=engine) is None
    assert pm.match(Square, MatMul(L("d", dtype="i8"), b), engine=engine) is None


def test_chained_comparison_is_a_conjunction(engine):
    @pm.pattern
    def Mid(x):
        assert 1 < x.rank <= 3
        return Relu(x)

    assert pm.match(Mid, Relu(L("a", shape=(2, 2))), engine=engine) is not None
    assert pm.match(Mid, Relu(L("b", shape=(2,))), engine=engine) is None
    assert pm.match(Mid, Relu(L("c", shape=(1, 1, 1, 1))), engine=engine) is None


def test_guard_on_a_local_alias_names_the_subterm(engine):
    @pm.pattern
    def MMT(x, y):
        yt = Exp(y)
        assert yt.rank == 2
        return MatMul(x, yt)

    a, b = L("a"), L("b")
    assert Exp(b).shape == (4, 8)  # typed by the operator's infer function
    assert pm.match(MMT, MatMul(a, Exp(b)), engine=engine)["y"] is b
    assert pm.match(MMT, MatMul(a, Exp(L("c", shape=(2,)))), engine=engine) is None
    assert pm.match(MMT, MatMul(a, Tanh(b)), engine=engine) is None


def test_operator_attributes_in_patterns_and_rules(engine):
    @pm.pattern
    def Stride1(x, w):
        return Conv(x, w, stride=1)

    a, w = L("a"), L("w")
    assert pm.match(Stride1, Conv(a, w, stride=1), engine=engine)["w"] is w
    assert pm.match(Stride1, Conv(a, w, stride=2), engine=engine) is None

    @pm.pattern
    def AnyConv(x, w):
        c = Conv(x, w)
        assert c.stride > 1
        return c

    assert pm.match(AnyConv, Conv(a, w, stride=2), engine=engine) is not None
    assert pm.match(AnyConv, Conv(a, w, stride=1), engine=engine) is None


def test_multi_output_operators_and_local_operator_variables(engine):
    @pm.pattern
    def FirstHalf(x):
        lo, hi = Split(x)
        return Add(lo, hi)

    a = L("a")
    lo, hi = Split(a)
    assert pm.match(FirstHalf, Add(lo, hi), engine=engine)["x"] is a
    assert pm.match(FirstHalf, Add(hi, lo), engine=engine) is None

    @pm.pattern
    def AnyPair(x):
        F = pm.Op(1, 2)
        first, second = F(x)
        return Add(first, second)

    m = pm.match(AnyPair, Add(lo, hi), engine=engine)
    assert m["x"] is a


def test_pattern_call_with_a_complex_argument(engine):
    @pm.pattern
    def Twice(x, f):
        return f(f(x))

    @pm.pattern
    def TwiceOverMatMul(a, b):
        return Twice(MatMul(a, b), Relu)

    a, b = L("a"), L("b")
    assert pm.match(TwiceOverMatMul, Relu(Relu(MatMul(a, b))), engine=engine)["b"] is b
    assert pm.match(TwiceOverMatMul, Tanh(Tanh(MatMul(a, b))), engine=engine) is None


def test_operator_variable_attributes(engine):
    @pm.pattern
    def Pointwise(x, f):
        assert f.op_class == pm.opclass("unary_pointwise")
        return f(x)

    a = L("a")
    assert pm.match(Pointwise, Relu(a), engine=engine)["f"] is Relu
    assert pm.match(Pointwise, Cast(a), engine=engine) is None


def test_guard_functions_are_named_data(engine):
    @pm.guard_fn("tests.is_even")
    def is_even(n):
        return n % 2 == 0

    @pm.pattern
    def Even(x):
        assert is_even(x.shape[0])
        return Relu(x)

    assert "tests.is_even(x.shape[0])" in show(Even.definition.body)
    assert pm.match(Even, Relu(L("a", shape=(4, 1))), engine=engine) is not None
    assert pm.match(Even, Relu(L("b", shape=(3, 1))), engine=engine) is None


def test_asserts_keep_their_source_text():
    @pm.pattern
    def G(x):
        assert x.rank == 2  # the text
        return Relu(x)

    body = G.definition.body
    assert isinstance(body, PGuard)
    assert body.loc.text == "assert x.rank == 2  # the text"
    assert body.loc.file == __file__


def test_rule_branches_attributes_and_constants():
    @pm.pattern
    def R(x):
        return Relu(x)

    @pm.rule(R, single_use=True)
    def to_conv(x):
        assert x.rank >= 2
        if x.shape[0] == 1:
            return Conv(x, x, stride=x.shape[1])
        return Add(x, 0.0)

    d = to_conv.definition
    assert d.single_use and d.name == "to_conv"
    assert [b.result.op for b in d.branches] == [Conv, Add]
    conv = d.branches[0].result
    assert conv.attrs[0][0] == "stride"
    assert d.branches[1].result.args[1].value == 0.0


def test_infeasible_paths_are_dropped():
    @pm.pattern
    def OnlyOne(x):
        if x.rank == 2:
            return Relu(x)
        assert False
        return Tanh(x)

    assert show(OnlyOne.definition.body) == "Relu(x) ; guard(x.rank = 2)"


def test_operator_parameter_attributes_inside_arithmetic(engine):
    @pm.pattern
    def Unary(x, f):
        assert f.n_in + 1 == 2
        return f(x)

    a = L("a")
    assert pm.match(Unary, Relu(a), engine=engine)["f"] is Relu


def test_operator_variable_name_in_rule_guards():
    @pm.pattern
    def Chain(x, f):
        return f(f(x))

    @pm.rule(Chain)
    def collapse(x, f):
        assert f.name == "Relu"
        return Relu(x)

    a = L("a")
    result = pm.rewrite(pm.Graph([Relu(Relu(a))]), [collapse])
    assert (
        result.graph.outputs[0].op is Relu and result.graph.outputs[0].inputs[0].op.name == "leaf"
    )
    untouched = pm.rewrite(pm.Graph([Tanh(Tanh(a))]), [collapse])
    assert untouched.report == [] or len(untouched.report) == 0


def test_constraints_are_checked_once_their_variable_is_bound(engine):
    @pm.pattern
    def Nested(x):
        y = pm.var()
        z = pm.var()
        t = Exp(y)
        assert t.rank == 2
        y <= Exp(z)  # y is bound only by the alias constraint on t
        x <= Relu(t)
        return x

    a = L("a")
    term = Relu(Exp(Exp(a)))
    m = pm.match(Nested, term, engine=engine)
    assert m is not None and m["x"] is term


def test_operator_variables_never_bind_opaque_operators(engine):
    @pm.op(pure=False)
    def Effect(x):
        return 1

    @pm.pattern
    def AnyUnary(x, f):
        return f(x)

    @pm.pattern
    def Named(x):
        return Effect(x)

    a = L("a")
    assert pm.match(AnyUnary, Effect(a), engine=engine) is None
    assert pm.match(AnyUnary, Relu(a), engine=engine)["f"] is Relu
    assert pm.match(Named, Effect(a), engine=engine)["x"] is a  # named explicitly: fine
