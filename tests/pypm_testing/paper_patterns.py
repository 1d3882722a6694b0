"""The examples of the paper's figures, written in the DSL exactly as printed (modulo
Python syntax: the paper's ``&&``/``||`` are ``and``/``or``, ``@op Trans(x)`` is a ``def``).

Where a figure is inconsistent as printed, the corrected version sits beside it and a
comment explains the correction.
"""

import pypm_jax as pm

# --- Figure "cuBLAS Pattern Example" ----------------------------------------------------


@pm.op
def MatMul(x, y):
    return 1


@pm.op
def Trans(x):
    return 1


@pm.op
def cublasMM_xyT_f32(x, y):
    return 1


@pm.op
def cublasMM_xyT_i8(x, y):
    return 1


@pm.pattern
def MMxyT(x, y):
    assert x.shape.rank == 2
    assert y.shape.rank == 2
    yt = Trans(y)
    return MatMul(x, yt)


@pm.rule(MMxyT)
def cublasrule(x, y):
    assert (x.eltType == pm.f32 and y.eltType == pm.f32) or (
        x.eltType == pm.i8 and y.eltType == pm.i8
    )
    if x.eltType == pm.f32 and y.eltType == pm.f32:
        return cublasMM_xyT_f32(x, y)
    elif x.eltType == pm.i8 and y.eltType == pm.i8:
        return cublasMM_xyT_i8(x, y)


# --- Figure "Alternate GELU Pattern" ----------------------------------------------------


@pm.op
def Div(x, y):
    return 1


@pm.op
def Mul(x, y):
    return 1


@pm.op
def Plus(x, y):
    return 1


@pm.op
def Erf(x):
    return 1


@pm.pattern
def Half(x):
    return Div(x, 2)


@pm.pattern
def Half(x):  # noqa: F811 — a second definition is an alternate
    return Mul(x, 0.5)


SQRT2 = 1.4142135623730951  # the figure's "1.41..."


@pm.pattern
def Gelu(x):
    return Mul(Half(x), Plus(1, Erf(Div(x, SQRT2))))


# --- Figure "Recursive Unary Function Pattern" ------------------------------------------


@pm.pattern
def UnaryChain(x, f):
    return f(UnaryChain(x, f))


@pm.pattern
def UnaryChain(x, f):  # noqa: F811
    return f(x)


# --- Figure "Recursive Pattern with Local Variables and Match Constraints" --------------


@pm.pattern
def P(x, f, g):
    y = pm.var()
    x <= f(P(y, f, g))
    return x


@pm.pattern
def P(x, f, g):  # noqa: F811
    y = pm.var()
    z = pm.var()
    x <= g(P(y, f, g), P(z, f, g))
    return x


@pm.pattern
def P(x, f, g):  # noqa: F811
    return x


# --- Figure "Matrix Multiplication Epilog Patterns" -------------------------------------
# As printed. Two inconsistencies:
#  1. `MatMulEpilog` lacks its `@pattern` decorator (added here).
#  2. `PwSubgraph(x)` binds x to the ROOT of the pointwise chain (x <= UnaryOp(...);
#     return x), so `x <= PwSubgraph(MatMul(a, b))` demands that the chain's root be the
#     MatMul itself: only a bare MatMul with an empty epilogue matches, never
#     Relu(MatMul(a, b)). The corrected patterns below parametrize the chain by its bottom
#     (the producer) instead, so the MatMul sits under the pointwise operators.


@pm.pattern
def PwSubgraph(x):
    UnaryOp = pm.Op(1, 1)
    assert UnaryOp.op_class == pm.opclass("unary_pointwise")
    y = pm.var()
    x <= UnaryOp(PwSubgraph(y))
    return x


@pm.pattern
def PwSubgraph(x):  # noqa: F811
    return x


@pm.pattern
def MatMulEpilog(x):
    a = pm.var()
    b = pm.var()
    x <= PwSubgraph(MatMul(a, b))
    return x


# Corrected: PwChain(y) matches UnaryOp1(UnaryOp2(...(y))) with one or more pointwise ops
# (each level has its own local operator variable), and the epilogue pattern puts the MatMul
# at the bottom.


@pm.pattern
def PwChain(y):
    UnaryOp = pm.Op(1, 1)
    assert UnaryOp.op_class == pm.opclass("unary_pointwise")
    return UnaryOp(PwChain(y))


@pm.pattern
def PwChain(y):  # noqa: F811
    UnaryOp = pm.Op(1, 1)
    assert UnaryOp.op_class == pm.opclass("unary_pointwise")
    return UnaryOp(y)


@pm.pattern
def MatMulEpilogFixed(x):
    a = pm.var()
    b = pm.var()
    x <= PwChain(MatMul(a, b))
    return x


@pm.op(op_class="unary_pointwise")
def Relu(x):
    return 1


@pm.op(op_class="unary_pointwise")
def Tanh(x):
    return 1


@pm.op
def Neg(x):  # deliberately without the unary_pointwise class
    return 1


@pm.op
def Add(x, y):
    return 1
