"""Gated pairs in one kernel: ``act(x @ w1 (+ b1)) * (x @ w2)`` (GLU, SwiGLU, GeGLU).

With ``gemm_rules(pairs=True)`` the rule ``gemm_epilogue_pair`` rewrites the activation's
region kernel, which reads the second GEMM as a full tile, into one
``GemmPairRegion`` computing both GEMMs (``pallas_kernels.gemm_fused_pair``). Kernels run in
the Pallas interpreter; values (f32: 1e-5 relative) and gradients equal the original's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pypm_jax import rules as R
from pypm_jax.rules import GemmPairRegion
from pypm_testing.rules import TOL, kernel_nodes, rel_close, rewrite, vjps_close

B, S, H, F = 2, 8, 64, 128


def _rules():
    return R.canonical_rules() + R.attention_rules() + R.gemm_rules(pairs=True)


def _args(seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(k[0], (B, S, H))
    w1, w2 = (jax.random.normal(k[i], (H, F)) / 8 for i in (1, 2))
    return x, w1, w2, jax.random.normal(k[3], (F,))


def swiglu(x, w1, w2, b):
    return jax.nn.silu(x @ w1) * (x @ w2)


def geglu_bias(x, w1, w2, b):  # a bias on the activation's GEMM
    return jax.nn.gelu(x @ w1 + b) * (x @ w2)


def glu_stored_nk(x, w1, w2, b):  # weights stored [N, K] (Flax-style .T)
    return jax.nn.sigmoid(x @ w1.T.T) * jnp.einsum("bsh,fh->bsf", x, w2.T)


def fused_gate_up(x, w1, w2, b):  # one [H, 2F] projection cut in two (canonical_sliced_dot)
    h = x @ jnp.concatenate([w1, w2], axis=1)
    return jax.nn.silu(h[..., :F]) * h[..., F:]


CASES = [swiglu, geglu_bias, glu_stored_nk, fused_gate_up]


@pytest.mark.parametrize("fn", CASES, ids=lambda f: f.__name__)
def test_gated_pair_is_one_kernel_with_equal_values_and_gradients(fn):
    args = _args()
    fast, got, report = rewrite(fn, args, _rules())
    assert report.counts().get("gemm_epilogue_pair") == 1, str(report)
    nodes = kernel_nodes(fast, args)
    graph = fast.lifted(*args).graph
    pairs = [n for n in graph.nodes() if n.op is GemmPairRegion]
    assert len(pairs) == 1 and len(nodes) == 0, str(report)  # kernel_nodes: the others
    assert not [n for n in graph.nodes() if n.op.name == "dot_general"], str(report)
    want = jax.jit(fn)(*args)
    rel_close(want, got, fn.__name__, tol=TOL["float32"])
    vjps_close(fn, fast, args, want, fn.__name__, seed=7)


def test_pairs_it_cannot_fuse_are_left_as_two_kernels():
    """Another x, the second GEMM also read elsewhere, or the pair the other way round (the
    second GEMM the region's base, the activation's kernel its operand): two kernels (and
    ``default_rules()`` never pairs)."""
    x, w1, w2, b = _args()
    x2 = x + 1.0

    def other_x(x, w1, w2, x2):
        return jax.nn.silu(x @ w1) * (x2 @ w2)

    def read_twice(x, w1, w2, b):
        up = x @ w2
        return jax.nn.silu(x @ w1) * up, up

    def up_first(x, w1, w2, b):
        return (x @ w2) * jax.nn.gelu(x @ w1 + b)

    cases = ((other_x, (x, w1, w2, x2)), (read_twice, (x, w1, w2, b)), (up_first, (x, w1, w2, b)))
    for fn, args in cases:
        fast, got, report = rewrite(fn, args, _rules())
        assert "gemm_epilogue_pair" not in report.counts(), f"{fn.__name__}: {report}"
        rel_close(jax.jit(fn)(*args), got, fn.__name__)
    fast, got, report = rewrite(swiglu, (x, w1, w2, b))
    assert "gemm_epilogue_pair" not in report.counts(), str(report)
