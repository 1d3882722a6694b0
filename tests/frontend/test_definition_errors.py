"""Bad patterns and rules raise PatternDefinitionError naming the file and offending line."""

import pytest

import pypm_jax as pm
from pypm_testing.paper_patterns import Add, MatMul, Relu, Tanh

HERE = __file__


def line_of(marker: str) -> int:
    with open(HERE) as f:
        for i, text in enumerate(f, 1):
            if marker in text and "line_of(" not in text:
                return i
    raise AssertionError(marker)


def expect_error(p, marker: str, fragment: str):
    with pytest.raises(pm.PatternDefinitionError) as info:
        p.definition
    err = info.value
    assert err.loc is not None
    assert err.loc.file == HERE
    assert err.loc.line == line_of(marker), str(err)
    assert f"{HERE}:{line_of(marker)}" in str(err)
    assert fragment in str(err)


def test_loop_over_symbolic_values():
    @pm.pattern
    def Loop(x):
        for d in x.shape:  # MARK-loop
            assert d > 0
        return Relu(x)

    expect_error(Loop, "MARK-loop", "cannot loop over a symbolic value")


def test_while_loop_is_rejected():
    @pm.pattern
    def W(x):
        while x.rank > 2:  # MARK-while
            pass
        return Relu(x)

    expect_error(W, "MARK-while", "`while` loops")


def test_call_to_unknown_function():
    def helper(t):
        return t

    @pm.pattern
    def Unknown(x):
        return Relu(helper(x))  # MARK-unknown

    expect_error(Unknown, "MARK-unknown", "unknown function")


def test_print_is_a_side_effect_call():
    @pm.pattern
    def Printing(x):
        print(x)  # MARK-print
        return Relu(x)

    expect_error(Printing, "MARK-print", "unknown function")


def test_attribute_assignment_is_a_side_effect():
    box = type("Box", (), {})()

    @pm.pattern
    def Mutating(x):
        box.seen = x  # MARK-setattr
        return Relu(x)

    expect_error(Mutating, "MARK-setattr", "side effects")


def test_global_statement_is_rejected():
    @pm.pattern
    def G(x):
        global COUNTER  # MARK-global
        return Relu(x)

    expect_error(G, "MARK-global", "`global`")


def test_recursion_that_consumes_nothing():
    @pm.pattern
    def Loopy(x):
        return Loopy(x)  # MARK-rec

    @pm.pattern
    def Loopy(x):  # noqa: F811
        return Relu(x)

    with pytest.raises(pm.PatternDefinitionError, match="without consuming"):
        Loopy.definition


def test_recursion_through_a_match_constraint_without_application():
    @pm.pattern
    def C(x):
        y = pm.var()
        x <= C(y)
        return x

    @pm.pattern
    def C(x):  # noqa: F811
        return Relu(x)

    with pytest.raises(pm.PatternDefinitionError, match="without consuming"):
        C.definition


def test_recursion_through_a_match_constraint_on_a_subterm(engine):
    """``y <= Relu(x); x <= C(w)``: x is bound under the application, so C(...) consumes it
    (rules/causal.py's patterns need this to read the operand's shape in a guard)."""

    @pm.pattern
    def C(w):
        x, y = pm.var(), pm.var()
        y <= Relu(x)
        x <= C(w)
        return y

    @pm.pattern
    def C(w):  # noqa: F811
        return Relu(w)

    a = pm.leaf("a", shape=(2,), dtype="f32")
    m = pm.match(C, Relu(Relu(Relu(a))), engine=engine)
    assert m is not None and m["w"] is a
    assert pm.match(C, MatMul(a, a), engine=engine) is None


def test_recursion_through_a_sub_pattern_that_binds_under_an_application(engine):
    """``t <= C(w); return Pointwise(t)``, where ``Pointwise(t)`` is ``F(t)`` with a guard
    on F: t is bound under Pointwise's application, so C(...) consumes it, and the guard
    turns other operators away before C explores their operands (rules/epilogue.py and
    rules/attention_region.py are written so)."""

    @pm.pattern
    def Pointwise(t):
        f = pm.Op(1, 1)
        assert f.name == "Relu"
        return f(t)

    @pm.pattern
    def C(w):
        t = pm.var()
        t <= C(w)
        return Pointwise(t)

    @pm.pattern
    def C(w):  # noqa: F811
        return MatMul(w, w)

    a = pm.leaf("a", shape=(2, 2), dtype="f32")
    m = pm.match(C, Relu(Relu(MatMul(a, a))), engine=engine)
    assert m is not None and m["w"] is a
    assert pm.match(C, Tanh(MatMul(a, a)), engine=engine) is None
    # the format's closedness check (the same binds_below) takes it back
    (loaded,) = pm.deserialize(pm.serialize([C.definition]), ops=[MatMul])
    assert loaded.name == "C"


def test_recursion_through_a_sub_pattern_that_returns_its_argument():
    @pm.pattern
    def Same(t):
        return t

    @pm.pattern
    def C(w):
        t = pm.var()
        t <= C(w)
        return Same(t)  # MARK-same (t is the very term: nothing consumed)

    @pm.pattern
    def C(w):  # noqa: F811
        return Relu(w)

    with pytest.raises(pm.PatternDefinitionError, match="without consuming"):
        C.definition


def test_recursion_through_a_match_constraint_on_a_parameter():
    @pm.pattern
    def C(w):
        y = pm.var()
        w <= C(y)  # MARK-param (w is bound by the caller: maybe to this very term)
        return Relu(y)

    @pm.pattern
    def C(w):  # noqa: F811
        return Relu(w)

    with pytest.raises(pm.PatternDefinitionError, match="without consuming"):
        C.definition


def test_symbolic_truth_value_outside_if_and_assert():
    @pm.pattern
    def Truthy(x):
        r = [1][0] if True else 0
        s = bool(x.rank == r)  # MARK-bool
        return Relu(x) if s else Relu(x)

    expect_error(Truthy, "MARK-bool", "unknown function")


def test_parameter_used_as_term_and_operator():
    @pm.pattern
    def Both(x, f):
        return Add(f(x), f)  # MARK-both

    with pytest.raises(pm.PatternDefinitionError, match="both as a term and as an operator"):
        Both.definition


def test_alternates_must_agree_on_parameters():
    @pm.pattern
    def Alt(x):
        return Relu(x)

    @pm.pattern
    def Alt(x, y):  # noqa: F811  MARK-params
        return MatMul(x, y)

    expect_error(Alt, "MARK-params", "has parameters")


def test_wrong_arity():
    @pm.pattern
    def Arity(x):
        return MatMul(x)  # MARK-arity

    expect_error(Arity, "MARK-arity", "takes 2 inputs")


def test_guard_on_alias_outside_the_pattern():
    @pm.pattern
    def Dangling(x):
        t = Relu(x)
        assert t.rank == 2  # MARK-alias
        return MatMul(x, x)

    with pytest.raises(pm.PatternDefinitionError, match="not part of the returned pattern"):
        Dangling.definition


def test_constraint_left_side_must_be_a_variable():
    @pm.pattern
    def BadConstraint(x):
        Relu(x) <= Relu(x)  # MARK-constraint
        return x

    expect_error(BadConstraint, "MARK-constraint", "must be a pattern variable")


def test_rule_parameters_must_be_pattern_parameters():
    @pm.pattern
    def R(x):
        return Relu(x)

    @pm.rule(R)
    def bad(z):
        return z

    with pytest.raises(pm.PatternDefinitionError, match="not parameters of pattern R"):
        bad.definition


def test_op_must_return_an_output_count():
    with pytest.raises(pm.PatternDefinitionError, match="positive int"):

        @pm.op
        def Broken(x):
            return "one"


def test_var_outside_a_pattern_body():
    with pytest.raises(pm.PatternDefinitionError, match="inside @pattern"):
        pm.var()


def test_unbound_local_variable():
    @pm.pattern
    def Unused(x):
        y = pm.var()  # noqa: F841  MARK-unused
        return Relu(x)

    expect_error(Unused, "MARK-unused", "never bound")


def test_two_guard_functions_under_one_name_is_an_error():
    @pm.guard_fn("tests.one_name_for_two")
    def first(x):
        return True

    first_again = pm.guard_fn("tests.one_name_for_two")(first)  # the same function: fine
    assert first_again is first

    def second(x):
        return False

    with pytest.raises(ValueError, match="tests.one_name_for_two.*is taken by .*first"):
        pm.guard_fn("tests.one_name_for_two")(second)
