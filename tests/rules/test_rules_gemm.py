"""Dense + bias + activation spellings, each rewritten to one fused GEMM-epilogue kernel."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

import pypm_jax as pm
from pypm_jax.rules import gemm_rules
from pypm_jax.testing import assert_equivalent
from pypm_testing.rules import check, kernel_nodes

K, N = 64, 32


def operands(seed=0, dtype=jnp.float32, x_shape=(2, 8, K)):
    kx, kw, kb = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(kx, x_shape, dtype)
    w = (jax.random.normal(kw, (K, N), dtype) / 8).astype(dtype)
    b = jax.random.normal(kb, (N,), dtype)
    return x, w, b


def _gelu_textbook(y):
    return 0.5 * y * (1.0 + jax.lax.erf(y / math.sqrt(2.0)))


def _gelu_new(y):  # GPT-2 / BERT "gelu_new" as written out in many ports
    return 0.5 * y * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * y**3)))


def _gelu_bloom(y):  # transformers' bloom_gelu_forward: sqrt(2/pi) rounded, x*x inside
    return y * 0.5 * (1.0 + jnp.tanh(0.79788456 * y * (1 + 0.044715 * y * y)))


def _quick_gelu_hf(y):  # transformers.modeling_flax_utils.quick_gelu (CLIP's hidden_act)
    return pytest.importorskip("transformers.modeling_flax_utils").quick_gelu(y)


def _gelu_bloom_far(y):  # the same shape with a constant that is not sqrt(2/pi)
    return y * 0.5 * (1.0 + jnp.tanh(0.7978 * y * (1 + 0.044715 * y * y)))


ACTIVATIONS = {
    "jax.nn.relu": (jax.nn.relu, "relu"),
    "jnp.maximum": (lambda y: jnp.maximum(0.0, y), "relu"),
    "jax.nn.gelu(approximate=True)": (jax.nn.gelu, "gelu_tanh"),
    "gelu_new written out": (_gelu_new, "gelu_tanh"),
    "BLOOM's gelu": (_gelu_bloom, "gelu_tanh"),
    "jax.nn.gelu(approximate=False)": (lambda y: jax.nn.gelu(y, approximate=False), "gelu"),
    "gelu with erf written out": (_gelu_textbook, "gelu"),
    "jax.nn.silu": (jax.nn.silu, "silu"),
    "y * sigmoid(y)": (lambda y: jax.nn.sigmoid(y) * y, "silu"),
    "y / (1 + exp(-y))": (lambda y: y / (1.0 + jnp.exp(-y)), "silu"),
    "jax.nn.sigmoid": (jax.nn.sigmoid, "sigmoid"),
    "jnp.tanh": (jnp.tanh, "tanh"),
    "transformers' quick_gelu": (_quick_gelu_hf, "quick_gelu"),
    "quick gelu, scale on the right": (lambda y: jax.nn.sigmoid(y * 1.702) * y, "quick_gelu"),
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_dense_bias_activation(name):
    act, kind = ACTIVATIONS[name]

    def dense(x, w, b):
        return act(x @ w + b)

    args = operands()
    fast = check(dense, args, {"gemm_epilogue": 1}, what=name)
    (node,) = kernel_nodes(fast, args)
    plan = node.attrs["plan"]
    assert plan.activation == kind and plan.bias and not plan.transpose_w


def test_bloom_gelu_needs_sqrt_2_over_pi_to_seven_digits():
    """Not the kernel's tanh GELU: the region rule fuses it with its own constant."""

    def dense(x, w, b):
        return _gelu_bloom_far(x @ w + b)

    check(dense, operands(), {"gemm_epilogue_region": 1}, what="tanh GELU with 0.7978")


def test_quick_gelu_needs_its_scale():
    """``y * sigmoid(1.7 y)`` is neither quick GELU nor SiLU: fused as written, a region."""

    def dense(x, w, b):
        y = x @ w + b
        return y * jax.nn.sigmoid(1.7 * y)

    fast = check(dense, operands(), {"gemm_epilogue_region": 1}, what="y * sigmoid(1.7 y)")
    (record,) = fast.report(*operands())
    assert "logistic(1.7" in record.detail


@pytest.mark.slow
def test_flax_dense_gelu_gradients():
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(K)(nn.gelu(nn.Dense(N)(x)))

    model = MLP()
    x = operands()[0]
    params = model.init(jax.random.PRNGKey(1), x)
    report = assert_equivalent(pm.optimize(model.apply), params, x)
    assert report.counts() == {"gemm_epilogue": 1}


def test_no_bias_weight_stored_transposed():
    def dense(x, w):
        return jax.nn.silu(jnp.einsum("bsk,nk->bsn", x, w))

    x, w, _ = operands()
    args = (x, w.T)
    fast = pm.optimize(dense)
    assert assert_equivalent(fast, *args).counts() == {"gemm_epilogue_no_bias": 1}
    (node,) = kernel_nodes(fast, args)
    assert node.attrs["plan"].transpose_w and not node.attrs["plan"].bias


def test_bias_first_and_matrix_input():
    def dense(x, w, b):
        return jnp.tanh(b[None, :] + x @ w)

    check(dense, operands(x_shape=(16, K)), {"gemm_epilogue": 1})


def test_llama_style_gated_mlp():
    """``silu(x @ w_gate) * (x @ w_up)``: the gate is a dense + activation site; the product
    with the up projection then joins the gate's kernel as a region reading a full tile."""

    def mlp(x, wg, wu):
        return jax.nn.silu(x @ wg) * (x @ wu)

    x, w, _ = operands()
    counts = {"gemm_epilogue_no_bias": 1, "gemm_epilogue_region": 1}
    check(mlp, (x, w, w * 0.5), counts, grad=True)


def test_linear_rule_is_opt_in():
    def dense(x, w, b):
        return x @ w + b

    args = operands()
    check(dense, args, {})
    check(dense, args, {"gemm_epilogue_linear": 1}, rules=gemm_rules(linear=True), grad=True)


def test_bf16_dense_gelu():
    def dense(x, w, b):
        return jax.nn.gelu(x @ w + b)

    check(dense, operands(dtype=jnp.bfloat16), {"gemm_epilogue": 1})
