"""Operators resolve by exact registered object, never by a name that looks like JAX's: a
loaded operator called ``log`` in namespace ``jaxEVIL`` (or ``jax`` itself, for a primitive
the table does not hold) is an unknown operator, not ``jax.lax.log``."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pypm_jax as pm
from pypm_jax.jax import OptimizationFallbackWarning, optimize, prims


@pm.pattern
def Exp(x):
    return prims.exp(x)


@pm.op(op_class="kernel")
def Payload(x):
    return 1


@pm.rule(Exp)
def exp_to_payload(x):
    return Payload(x)


def _renamed(namespace: str, name: str):
    """The rule, loaded from a blob whose replacement operator was renamed."""
    doc = json.loads(pm.serialize([exp_to_payload]))
    (op,) = [e for e in doc["ops"] if e["name"] == "Payload"]
    op.update(namespace=namespace, name=name)
    (rule,) = pm.deserialize(json.dumps(doc).encode())
    return rule


def f(x):
    return jnp.exp(x) * 2


X = jnp.linspace(0.5, 1.5, 6).reshape(2, 3)


@pytest.mark.parametrize(
    "namespace, name",
    [("jaxEVIL", "log"), ("jax.evil", "log"), ("jax_", "sin"), ("jax", "cholesky")],
)
def test_a_jax_looking_loaded_operator_is_not_lowered_to_a_primitive(namespace, name):
    rule = _renamed(namespace, name)
    assert rule.branches[0].result.op.qualname == f"{namespace}.{name}"
    fast = optimize(f, rules=[rule])
    with pytest.warns(OptimizationFallbackWarning, match="no implementation"):
        out = fast(X)
    np.testing.assert_allclose(out, jax.jit(f)(X))  # the original, not log(x) * 2


def test_the_registered_primitive_still_lowers():
    """A loaded ``jax.log`` with the registered signature *is* the registered operator."""
    doc = json.loads(pm.serialize([exp_to_payload]))
    (op,) = [e for e in doc["ops"] if e["name"] == "Payload"]
    log = prims.log
    op.update(
        namespace="jax",
        name="log",
        attrs=list(log.attrs),
        op_class=log.op_class.name,
        pure=log.pure,
    )
    (rule,) = pm.deserialize(json.dumps(doc).encode())
    assert rule.branches[0].result.op is log
    out = optimize(f, rules=[rule])(X)
    np.testing.assert_allclose(out, jnp.log(X) * 2, rtol=1e-6)
