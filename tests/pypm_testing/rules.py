"""Shared checks of the rule-library tests: rewrite, count, compare numerically; the corpus's
expected sites and the check that kernels really run as Pallas calls."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pypm_jax as pm
from pypm_jax.jax import _compat, optimize
from pypm_jax.jax.report import OptimizationFallbackWarning
from pypm_jax.rules import (
    FlashAttention,
    FlashAttentionSinks,
    GemmEpilogue,
    GemmRegion,
    default_rules,
)
from pypm_testing import corpus

# Output tolerances (relative to the largest magnitude of each output, plus elementwise):
# f32 programs match to 1e-5; bf16 programs differ by bf16 rounding of intermediates the
# original rounds and the kernels keep in f32.
TOL = {"float32": (1e-5, 1e-5), "bfloat16": (3e-2, 3e-2), "float16": (1e-2, 1e-2)}


def rel_close(want: Any, got: Any, what: str, tol: tuple[float, float] | None = None) -> None:
    la, lb = jax.tree.leaves(want), jax.tree.leaves(got)
    assert jax.tree.structure(want) == jax.tree.structure(got), what
    for a, b in zip(la, lb, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {b.shape} {b.dtype}"
        if not jnp.issubdtype(a.dtype, jnp.floating):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=what)
            continue
        rtol, atol = tol or TOL.get(str(a.dtype), (1e-5, 1e-5))
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = float(np.max(np.abs(a64))) if a64.size else 0.0
        np.testing.assert_allclose(b64, a64, rtol=rtol, atol=atol * max(scale, 1e-30), err_msg=what)


def loss(out: Any) -> Any:
    leaves = [x for x in jax.tree.leaves(out) if jnp.issubdtype(x.dtype, jnp.floating)]
    return sum(jnp.mean(x.astype(jnp.float32) ** 2) for x in leaves)


def grads_close(fn: Any, fast: Any, args: tuple[Any, ...], what: str, rtol: float = 2e-3) -> Any:
    """jax.grad of a loss w.r.t. the first argument matches: elementwise to ``rtol`` of the
    value or of the largest gradient (gradients that should be 0, like a key bias's, are
    rounding noise on both sides); so do the outputs computed on the way. Returns the
    original's outputs (one compiled program per side computes outputs and gradients)."""
    first, rest = args[0], args[1:]

    def value_and_grad(f: Any) -> Any:
        def value(p: Any) -> Any:
            out = f(p, *rest)
            return loss(out), out

        return jax.jit(jax.value_and_grad(value, has_aux=True))(first)

    (_, want_out), want = value_and_grad(fn)
    (_, got_out), got = value_and_grad(fast)
    rel_close(want_out, got_out, f"{what}: outputs under grad")
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(want)]
    scale = max((float(np.max(np.abs(x))) for x in leaves if x.size), default=0.0)
    for a, b in zip(leaves, jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(
            np.asarray(b, np.float64), a, rtol=rtol, atol=rtol * scale, err_msg=f"{what}: grads"
        )
    return want_out


def vjps_close(fn: Any, fast: Any, args: tuple[Any, ...], want: Any, what: str, seed: int) -> None:
    """The gradients of ``vdot(f(*args), cot)`` for every argument (``cot`` a random
    cotangent of ``want``'s shape, from ``seed``) match at float32's tolerance."""
    cot = jax.random.normal(jax.random.PRNGKey(seed), want.shape)
    argnums = tuple(range(len(args)))

    def vjp_of(f: Any) -> Any:
        return jax.jit(jax.grad(lambda *a: jnp.vdot(f(*a), cot), argnums=argnums))

    rel_close(vjp_of(fn)(*args), vjp_of(fast)(*args), f"{what}: gradients", tol=TOL["float32"])


def rewrite(fn: Any, args: tuple[Any, ...], rules: Any = None) -> tuple[Any, Any, Any]:
    """(optimized fn, its output, its report); a fallback to the original is an error."""
    fast = optimize(fn, rules=default_rules() if rules is None else rules)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OptimizationFallbackWarning)
        got = fast(*args)
    report = fast.report(*args)
    assert report.fallback is None, report.fallback
    return fast, got, report


def check(
    fn: Any,
    args: tuple[Any, ...],
    counts: dict[str, int],
    *,
    what: str = "",
    grad: bool = False,
    tol: tuple[float, float] | None = None,
    rules: Any = None,
) -> Any:
    """Rewrite ``fn``: the report fires exactly ``counts``, outputs (and gradients) match.
    With ``grad``, the original's outputs come from its gradient program (one compile)."""
    fast, got, report = rewrite(fn, args, rules)
    assert report.counts() == counts, f"{what}\n{report}"
    if grad:
        want = grads_close(fn, fast, args, what or "gradients")
    else:
        want = jax.jit(fn)(*args)
    rel_close(want, got, what or "outputs", tol)
    return fast


def kernel_nodes(fast: Any, args: tuple[Any, ...]) -> list[Any]:
    """The kernel nodes of the rewritten program (outer graph and nested bodies)."""
    prog = fast.lifted(*args)
    out, stack = [], [prog.graph]
    while stack:
        g = stack.pop()
        for n in g.nodes():
            if n.op in (FlashAttention, FlashAttentionSinks, GemmEpilogue, GemmRegion):
                out.append(n)
            for value in n.attrs.values():
                items = value if isinstance(value, tuple) else (value,)
                stack.extend(
                    b.graph for b in items if hasattr(b, "graph") and hasattr(b, "hoisted")
                )
    return out


def driver_counts_shared_constants(chain: bool = False) -> bool:
    """Does ``single_use=True`` refuse matches whose constants are shared elsewhere?

    The graph hash-conses pure nodes, so one literal ``0.5`` serves every GELU of a model
    and one ``convert(broadcast(1.0))`` head mask every BERT layer. Counting such values as
    interior values with outside users blocks every rule matching them after the first.
    ``chain=False`` asks about a shared literal, ``chain=True`` about a shared node computed
    from literals only.
    """

    @pm.op
    def _Mul(x, y):
        return 1

    @pm.op
    def _Neg(x):
        return 1

    @pm.op
    def _Fused(x):
        return 1

    @pm.pattern
    def _Half(x):
        return _Mul(x, _Neg(-0.5)) if chain else _Mul(x, 0.5)

    @pm.rule(_Half, single_use=True)
    def _half(x):
        return _Fused(x)

    a = pm.leaf("a", shape=(2,), dtype="f32")
    b = pm.leaf("b", shape=(2,), dtype="f32")
    half = _Neg(-0.5) if chain else 0.5
    g = pm.Graph([_Mul(a, half), _Neg(_Mul(b, half))])
    return pm.rewrite(g, [_half]).report.counts().get("_half", 0) != 2


# ------------------------------------------------------------------------------ the corpus

# Sites per corpus model (pypm_testing/corpus.py, 2 layers each) -- the same on CPU
# (test_rules_corpus.py) and GPU (test_rules_corpus_gpu.py). BERT and ViT return the pooler
# too (dense + tanh). BART: encoder self, decoder self and cross attention per layer.
# A decoder's self-attention is rewritten twice: attention_bias, then attention_causal_bias
# (its bias provably hides the keys above the diagonal: the kernel may skip those blocks).
# Llama's MLP gate is a dense + SiLU without bias. A scanned stack has one layer body,
# rewritten once for all layers.
CORPUS_SITES: dict[str, dict[str, int]] = {
    "bert": {"attention_bias": 2, "gemm_epilogue": 3},
    "gpt2": {"attention_bias": 2, "attention_causal_bias": 2, "gemm_epilogue": 2},
    "llama": {
        "attention_bias": 2,
        "attention_causal_bias": 2,
        "gemm_epilogue_no_bias": 2,
        "gemm_epilogue_region": 2,  # the product with the up projection, in the gate's kernel
    },
    "vit": {"attention": 2, "gemm_epilogue": 3},
    "bart": {"attention_bias": 6, "attention_causal_bias": 2, "gemm_epilogue": 4},
    "distilbert": {"attention_bias": 2, "gemm_epilogue": 2},
    "linen_mha": {"attention": 1},
    "linen_mha_masked": {"attention_mask": 1},
    "nnx_mha": {"attention_dpa": 1},
    "nnx_mha_masked": {"attention_dpa_mask": 1},
    "linen_scan": {"attention": 1, "gemm_epilogue": 1},
    "linen_scan_remat": {"attention": 1, "gemm_epilogue": 1},
}
CORPUS_HF = frozenset(corpus.HF_MODELS)
# The wider corpus (``corpus.MORE_HF_MODELS``): every site, at test_rules_corpus.SMALL.
# CLIP's MLP is a dense + quick GELU (``h * sigmoid(1.702 h)``).
MORE_SITES: dict[str, dict[str, int]] = {
    "roberta": {"attention_bias": 2, "gemm_epilogue": 2},
    "electra": {"attention_bias": 2, "gemm_epilogue": 2},
    "albert": {"attention_bias": 2, "gemm_epilogue": 2},
    "gpt_neo": {"attention_bias": 2, "attention_causal_bias": 2, "gemm_epilogue": 2},
    "gptj": {"attention_bias": 2, "attention_causal_bias": 2, "gemm_epilogue": 2},
    "bloom": {"attention_bias": 2, "attention_causal_bias": 2, "gemm_epilogue": 2},
    "clip_text": {"attention_bias": 2, "attention_causal_bias": 2, "gemm_epilogue": 2},
    "mbart": {"attention_bias": 3, "attention_causal_bias": 1, "gemm_epilogue": 2},
    "whisper": {
        "attention": 2,
        "attention_bias": 1,
        "attention_causal_bias": 1,
        "gemm_epilogue": 2,
    },
    "beit": {"attention_bias": 2, "gemm_epilogue": 2},
    "mistral": {
        "attention_bias": 2,
        "attention_causal_bias": 2,
        "gemm_epilogue_no_bias": 2,
        "gemm_epilogue_region": 2,
    },
    "gemma": {
        "attention_bias": 2,
        "attention_causal_bias": 2,
        "gemm_epilogue_no_bias": 2,
        "gemm_epilogue_region": 2,
    },
    "opt": {"attention_bias": 2, "attention_causal_bias": 2, "gemm_epilogue": 2},
}
CORPUS_BF16 = ("bert", "llama", "linen_mha_masked", "nnx_mha")  # the models also checked in bf16

# The graph hash-conses constants (one 0.5 for every GELU of a model; one all-ones head
# mask, ``convert(broadcast(1.0))`` sliced per layer, for every BERT layer). A driver whose
# single_use check counts them as interior values read outside the match rewrites only the
# first site of each kind; these models wait for it to ignore constants there.
SHARES_LITERALS = frozenset({"bert", "gpt2", "vit", "bart", "distilbert"})
SHARES_CONSTANT_NODES = frozenset({"bert"})


@functools.cache
def _driver_strict() -> tuple[bool, bool]:
    return driver_counts_shared_constants(), driver_counts_shared_constants(chain=True)


def corpus_params(names: Any, slow: Any = ()) -> list[Any]:
    """pytest params for corpus models, strict-xfail where the driver is known to miss sites,
    marked slow for the models in ``slow``."""
    strict_literals, strict_nodes = _driver_strict()
    out = []
    for n in names:
        strict = (n in SHARES_LITERALS and strict_literals) or (
            n in SHARES_CONSTANT_NODES and strict_nodes
        )
        marks = [pytest.mark.slow] if n in slow else []
        if strict:
            marks.append(
                pytest.mark.xfail(
                    strict,
                    reason="rewrite driver: single_use counts shared constants as interior values",
                    strict=True,
                )
            )
        out.append(pytest.param(n, marks=marks) if marks else n)
    return out


def build_corpus_model(name: str, size: corpus.Size) -> tuple[Any, tuple[Any, ...], str]:
    """``corpus.ALL_MODELS[name]`` (or ``MORE_HF_MODELS[name]``) at ``size``; skips Hugging
    Face models without transformers."""
    if (name in CORPUS_HF or name in MORE_SITES) and not corpus.has_transformers():
        pytest.skip("transformers is not installed")
    return {**corpus.ALL_MODELS, **corpus.MORE_HF_MODELS}[name](size)


# ------------------------------------------------------------------------------ kernel calls

# The custom-call targets a Pallas kernel lowered through Triton becomes in StableHLO (the
# name depends on the jaxlib version).
TRITON_CALL_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")


def pallas_calls(fn: Any, args: tuple[Any, ...]) -> list[dict[str, Any]]:
    """The params of every ``pallas_call`` in ``fn``'s jaxpr, nested bodies included."""
    found: list[dict[str, Any]] = []
    stack = [_compat.body_parts(jax.make_jaxpr(fn)(*args))[0]]
    while stack:
        for eqn in stack.pop().eqns:
            if eqn.primitive.name == "pallas_call":
                found.append(dict(eqn.params))
                continue  # the kernel body is not a program to search
            for value in eqn.params.values():
                for item in value if isinstance(value, tuple | list) else (value,):
                    if isinstance(item, _compat.Jaxpr | _compat.ClosedJaxpr):
                        stack.append(_compat.body_parts(item)[0])
    return found


def assert_kernels_run_as(fast: Any, args: tuple[Any, ...], impl: str) -> None:
    """Every kernel node of the rewritten program is a ``pallas_call`` run as ``impl``:
    ``"pallas"`` (Triton-lowered: a Triton custom call in the HLO, none interpreted) or
    ``"interpret"`` (the Pallas interpreter: no Triton call)."""
    calls = pallas_calls(fast, args)
    n_kernels = len(kernel_nodes(fast, args))
    assert n_kernels and len(calls) == n_kernels, (len(calls), n_kernels)
    interpreted = [c.get("name") for c in calls if c.get("interpret")]
    hlo = jax.jit(fast).lower(*args).as_text()
    triton = sum(hlo.count(t) for t in TRITON_CALL_TARGETS)
    if impl == "pallas":
        assert not interpreted, f"interpreted kernels: {interpreted}"
        assert triton >= 1, "no Triton custom call in the lowered program"
    else:
        assert len(interpreted) == n_kernels and triton == 0, (interpreted, triton)
