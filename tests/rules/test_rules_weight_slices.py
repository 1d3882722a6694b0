"""Fused gate/up projections: a static slice of one ``dot_general`` along the weight's axes.

gemma's ``gm.nn`` MLP computes one einsum to ``[..., 2, F]`` (weight ``[2, H, F]``) and
indexes it into gate and up; other code multiplies by ``[H, 2F]`` and cuts the last axis in
two. The canonical rules ``canonical_sliced_dot*`` / ``canonical_squeezed_dot*`` (and
``canonical_swapped_dot`` for the einsum's weight-first output order) rewrite each half to
the ``dot_general`` of the sliced weight, so the GEMM rules fire on both halves: the
activation's GEMM and the product as a region reading the other half. Kernels run in the
Pallas interpreter; values (f32: 1e-5 relative) and gradients equal the original's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pypm_jax.rules._weight_slices import squeezed_permutation
from pypm_testing.rules import TOL, rel_close, rewrite, vjps_close

B, S, H, F = 2, 8, 64, 128


def _args(w_shape, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 2)
    return jax.random.normal(k[0], (B, S, H)), jax.random.normal(k[1], w_shape) / 8


def gate_up_leading(x, w):  # w [2, H, F]; the einsum's weight-first output order
    h = jnp.einsum("bsd,tdf->tbsf", x, w)
    return jax.nn.gelu(h[0]) * h[1]


def gate_up_middle(x, w):  # gemma gm.nn: "...F,NHF->...NH", then h[..., 0, :]
    h = jnp.einsum("bsd,tdf->bstf", x, w)
    return jax.nn.gelu(h[..., 0, :]) * h[..., 1, :]


def gate_up_stacked(x, w):  # w [H, 2, F] (stacked on a middle axis of the weight)
    h = jnp.einsum("bsd,dtf->tbsf", x, w)
    return jax.nn.gelu(h[0]) * h[1]


def gate_up_halves(x, w):  # w [H, 2F]: two halves of the last axis
    h = x @ w
    return jax.nn.silu(h[..., :F]) * h[..., F:]


def gate_up_split(x, w):  # w [H, 2F]: jnp.split into two halves
    gate, up = jnp.split(x @ w, 2, axis=-1)
    return jax.nn.silu(gate) * up


CASES = {
    "[2,H,F] index, tbsf": (gate_up_leading, (2, H, F)),
    "[2,H,F] index, bstf": (gate_up_middle, (2, H, F)),
    "[H,2,F] index, tbsf": (gate_up_stacked, (H, 2, F)),
    "[H,2F] halves": (gate_up_halves, (H, 2 * F)),
    "[H,2F] jnp.split": (gate_up_split, (H, 2 * F)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fused_gate_up_is_two_gemm_kernels_with_equal_values_and_gradients(name):
    fn, w_shape = CASES[name]
    args = _args(w_shape)
    fast, got, report = rewrite(fn, args)
    counts = report.counts()
    assert counts.get("gemm_epilogue_no_bias") == 1, str(report)
    assert counts.get("gemm_epilogue_region") == 1, str(report)
    canonical = {r.rule for r in report.canonical}
    assert canonical & {"canonical_sliced_dot", "canonical_sliced_dot_t", "canonical_split_dot"}
    graph = fast.lifted(*args).graph
    # the up half stays XLA's GEMM (the region reads it as a full tile); the full one is gone
    dots = [n for n in graph.nodes() if n.op.name == "dot_general"]
    assert [d.outputs[0].shape for d in dots] == [(B, S, F)], str(report)
    want = jax.jit(fn)(*args)
    rel_close(want, got, name, tol=TOL["float32"])
    vjps_close(fn, fast, args, want, name, seed=7)


def test_slices_of_rows_or_dynamic_slices_are_left_alone():
    """A slice of x's (row) axes, a dynamic slice, and a result also read whole keep their
    ``dot_general``: slicing the weight would not compute them, or would compute twice."""
    x, w = _args((H, 2 * F))

    def rows(x, w):
        return jax.nn.silu((x @ w)[:, :4])

    def dynamic(x, w, i):
        h = x @ w
        return jax.nn.silu(jax.lax.dynamic_slice_in_dim(h, i, F, axis=-1))

    def read_whole(x, w):
        h = x @ w
        return jax.nn.silu(h[..., :F]) * h[..., F:], h

    def three_ways(x, w):  # a split in three is not taken (two halves are)
        a, b, c = jnp.split(x @ w, [64, 192], axis=-1)
        return jax.nn.silu(a) * c

    cases = [(rows, (x, w)), (dynamic, (x, w, jnp.int32(F))), (read_whole, (x, w))]
    for fn, args in [*cases, (three_ways, (x, w))]:
        fast, got, report = rewrite(fn, args)
        assert not report.canonical, f"{fn.__name__}: {report}"
        graph = fast.lifted(*args).graph
        assert [n for n in graph.nodes() if n.op.name == "dot_general"], fn.__name__
        rel_close(jax.jit(fn)(*args), got, fn.__name__)


def test_squeezed_permutation():
    # transpose (0, 2, 3, 1) then squeeze axis 0 == squeeze axis 0 then transpose (1, 2, 0)
    assert squeezed_permutation((0, 2, 3, 1), (0,)) == (1, 2, 0)
    assert squeezed_permutation((2, 0, 1), (1,)) == (1, 0)
