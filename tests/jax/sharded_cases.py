"""Sharded programs on 8 host CPU devices, optimized and compared with ``jax.jit``.

Run as a script by ``test_jax_sharded.py`` in a subprocess (the device count is fixed when
JAX starts): ``python tests/jax/sharded_cases.py CASE...`` prints one JSON line per case with
what the test asserts. A case is ``model/mesh``: models ``mha`` (a linen attention block with
an MLP), ``gqa`` (a Llama-style block with grouped kv heads, causal, gated SiLU MLP),
``mha_causal`` (the linen block under a causal mask), ``window`` (Gemma 2's local layer:
soft-capped logits in a causal sliding window, an attention region), ``bert`` (Hugging Face FlaxBertModel,
one layer), ``llama`` (Hugging Face FlaxLlama, 2 kv heads), ``attnax`` (attnax's decoder,
from the living corpus; needs the ``zoo`` extra), ``region`` (an MLP of GEMM-epilogue
regions), ``pair`` (SwiGLU, the gated pair kernel), ``experts`` (MoE experts run densely),
``sinks`` (GPT-OSS attention sinks); meshes ``data`` (batch on ``data``), ``tensor`` (heads,
MLP columns and experts on ``model``), ``both``, ``seq`` (the inputs' sequence on
``model``, parameters replicated); on a 2 x 4 mesh; ``shard_map``
(``shard_map/vma``: with ``check_vma=True``). Options after
them: ``/gspmd`` partitions with GSPMD instead of Shardy (JAX's default); ``/xla`` runs the
kernels' plain-JAX reference (cheaper to compile) instead of the Pallas interpreter, inside
the same partitioned calls.
"""

from __future__ import annotations

import os
import sys

# 8 host devices; the compile options the suite sets (tests/conftest.py) come with XLA_FLAGS
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import functools  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import warnings  # noqa: E402
from typing import Any  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pypm_jax as pm  # noqa: E402

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute")
REDUCTIONS = ("all-reduce", "reduce-scatter")  # reported, not compared
COLUMN = {
    "query",
    "key",
    "value",
    "q_proj",
    "k_proj",
    "v_proj",
    "fc1",
    "gate",
    "up",
    "intermediate",
    "query_proj",
    "key_proj",
    "value_proj",
    "dense1",
    "gate_proj",
    "up_proj",
}
EXPERTS = {"experts_up", "experts_bias", "experts_down"}
ROW = {"out", "o_proj", "fc2", "down", "output", "output_proj", "dense2", "down_proj"}


def collectives(compiled_text: str, kinds: tuple[str, ...] = COLLECTIVES) -> dict[str, int]:
    """How many of each data-moving collective a compiled HLO module has."""
    return {k: len(re.findall(rf"= [^\n=]* {k}(-start)?\(", compiled_text)) for k in kinds}


class MLP(nn.Module):
    hidden: int
    gated: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.gated:
            h = nn.silu(nn.Dense(self.hidden, name="gate")(x)) * nn.Dense(self.hidden, name="up")(x)
            return nn.Dense(x.shape[-1], name="down")(h)
        return nn.Dense(x.shape[-1], name="fc2")(nn.gelu(nn.Dense(self.hidden, name="fc1")(x)))


class MHABlock(nn.Module):
    causal: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nn.make_causal_mask(x[..., 0]) if self.causal else None
        x = x + nn.MultiHeadDotProductAttention(num_heads=4, name="attention")(x, mask=mask)
        return x + MLP(256)(x)


class GQABlock(nn.Module):
    """Llama-style attention: 8 query heads sharing 4 kv heads, causal; gated MLP."""

    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, _ = x.shape
        q = nn.Dense(self.heads * self.head_dim, use_bias=False, name="q_proj")(x)
        k = nn.Dense(self.kv_heads * self.head_dim, use_bias=False, name="k_proj")(x)
        v = nn.Dense(self.kv_heads * self.head_dim, use_bias=False, name="v_proj")(x)
        q = q.reshape(b, s, self.heads, self.head_dim)
        k = k.reshape(b, s, self.kv_heads, self.head_dim)
        v = v.reshape(b, s, self.kv_heads, self.head_dim)
        rep = self.heads // self.kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(self.head_dim).astype(x.dtype)
        causal = jnp.tril(jnp.ones((s, s), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        x = x + nn.Dense(x.shape[-1], use_bias=False, name="o_proj")(o.reshape(b, s, -1))
        return x + MLP(256, gated=True)(x)


class WindowBlock(nn.Module):
    """Gemma 2's local layer: soft-capped logits, a causal sliding window of 8 keys (an
    attention region whose mask reads query positions, band (-7, 0)); gated MLP."""

    heads: int = 4
    head_dim: int = 32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, _ = x.shape
        q, k, v = (
            nn.Dense(self.heads * self.head_dim, use_bias=False, name=n)(x).reshape(
                b, s, self.heads, self.head_dim
            )
            for n in ("q_proj", "k_proj", "v_proj")
        )
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(float(self.head_dim))
        scores = jnp.tanh(scores / 30.0) * 30.0
        i = jnp.arange(s)
        window = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 8)
        scores = jnp.where(window, scores, jnp.finfo(scores.dtype).min)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        x = x + nn.Dense(x.shape[-1], use_bias=False, name="o_proj")(o.reshape(b, s, -1))
        return x + MLP(256, gated=True)(x)


class RegionMLP(nn.Module):
    """An MLP whose epilogues are GEMM-epilogue regions: a row operand (each token's RMS
    scale) on the column-parallel half, a full tile (the input, a gate) after the
    row-parallel half, whose contraction is split across the model axis."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        rs = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        h = jnp.tanh(nn.Dense(256, use_bias=False, name="fc1")(x) * rs)
        return jax.nn.sigmoid(nn.Dense(x.shape[-1], use_bias=False, name="fc2")(h)) * x


class PairMLP(nn.Module):
    """SwiGLU without biases: with ``gemm_rules(pairs=True)`` one kernel for both GEMMs."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        gate = jax.nn.silu(nn.Dense(256, use_bias=False, name="gate")(x))
        h = gate * nn.Dense(256, use_bias=False, name="up")(x)
        return nn.Dense(x.shape[-1], use_bias=False, name="down")(h)


class Experts(nn.Module):
    """MoE experts run densely (keras-hub's Mixtral spelling): every token through every
    expert, a per-expert bias and GELU fused (``gemm_fused_experts``); the expert axis is
    split on the model axis."""

    experts: int = 4

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        init = nn.initializers.lecun_normal()
        w_up = self.param("experts_up", init, (self.experts, d, 256))
        b_up = self.param("experts_bias", nn.initializers.normal(0.1), (self.experts, 256))
        w_down = self.param("experts_down", init, (self.experts, 256, d))
        h = jnp.einsum("th,ehm->etm", x.reshape(-1, d), w_up) + b_up[:, None, :]
        return jnp.einsum("etm,emh->th", jax.nn.gelu(h), w_down).reshape(x.shape)


class SinksBlock(nn.Module):
    """GPT-OSS attention: a per-head sink logit beside the causal logits (``sinks``)."""

    heads: int = 4
    head_dim: int = 32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, _ = x.shape
        q, k, v = (
            nn.Dense(self.heads * self.head_dim, use_bias=False, name=n)(x).reshape(
                b, s, self.heads, self.head_dim
            )
            for n in ("q_proj", "k_proj", "v_proj")
        )
        sinks = self.param("sinks", nn.initializers.normal(1.0), (self.heads,))
        causal = jnp.where(jnp.tril(jnp.ones((s, s), bool)), 0.0, jnp.finfo(x.dtype).min)
        w = jnp.einsum("bqhd,bkhd->bhqk", q, k) * self.head_dim**-0.5 + causal
        col = jnp.broadcast_to(sinks.reshape(1, -1, 1, 1), (b, self.heads, s, 1))
        p = jax.nn.softmax(jnp.concatenate([w, col], axis=-1), axis=-1)[..., :-1]
        o = jnp.einsum("bhqk,bkhd->bqhd", p, v)
        return x + nn.Dense(x.shape[-1], use_bias=False, name="o_proj")(o.reshape(b, s, -1))


def linen_model(module: nn.Module, seq: int = 8) -> tuple[Any, Any, Any]:
    x = jax.random.normal(jax.random.key(0), (2, seq, 128))
    params = jax.jit(module.init)(jax.random.key(1), x)  # one compile, not one per operation
    return module.apply, params, (x,)


def bert_model() -> tuple[Any, Any, Any]:
    from transformers import BertConfig, FlaxBertModel

    cfg = BertConfig(vocab_size=100, hidden_size=128, num_hidden_layers=1, num_attention_heads=4,
                     intermediate_size=256, max_position_embeddings=32)  # fmt: skip
    model = FlaxBertModel(cfg, seed=0, _do_init=False)
    # its random weights in one compiled call, not one compile per initializer operation
    init = jax.jit(model.init_weights, static_argnums=1)
    params = init(jax.random.PRNGKey(0), model.input_shape)
    ids = jax.random.randint(jax.random.key(2), (2, 8), 0, 100)
    mask = jnp.ones((2, 8), jnp.int32).at[-1, -3:].set(0)

    def apply(params: Any, ids: jax.Array, mask: jax.Array) -> Any:
        return model(ids, attention_mask=mask, params=params, train=False).last_hidden_state

    return apply, params, (ids, mask)


def hf_llama_model() -> tuple[Any, Any, Any]:
    """Hugging Face FlaxLlama: 8 query heads over 2 kv heads, fewer than the model axis."""
    from pypm_testing import corpus

    fn, (params, ids), _ = corpus.hf_llama(corpus.Size(hidden=256, heads=8, ffn=512, layers=1))
    return fn, params, (ids,)


def attnax_model() -> tuple[Any, Any, Any]:
    """attnax's standard decoder (living model code, Flax NNX): 4 heads of 32, so the
    heads split evenly over the model axis."""
    from attnax.config import TransformerConfig
    from attnax.transformer import TransformerDecoder
    from flax import nnx

    cfg = TransformerConfig(vocab_size=100, d_model=128, num_heads=4, num_layers=1, d_ff=256,
                            dropout_rate=0.1, max_len=16)  # fmt: skip
    graphdef, params, rest = nnx.split(TransformerDecoder(nnx.Rngs(0), cfg), nnx.Param, ...)

    def apply(params: Any, ids: jax.Array) -> Any:
        return nnx.merge(graphdef, params, rest)(ids, deterministic=True)

    return apply, params, (jax.random.randint(jax.random.key(4), (2, 8), 0, 100),)


LINEN = {"mha": MHABlock(), "gqa": GQABlock(), "mha_causal": MHABlock(causal=True),
         "window": WindowBlock(), "region": RegionMLP(), "pair": PairMLP(),
         "experts": Experts(), "sinks": SinksBlock()}  # fmt: skip
MODELS = {**{k: functools.partial(linen_model, m) for k, m in LINEN.items()},
          "bert": bert_model, "llama": hf_llama_model, "attnax": attnax_model}  # fmt: skip


@functools.cache
def built(model: str, seq: bool) -> tuple[Any, Any, Any]:
    """A model's function, parameters and inputs, built once per process (several cases
    share each; a case's shardings are applied to copies)."""
    return MODELS[model](**({"seq": 64} if seq else {}))


def _pair_rules() -> list[Any]:
    from pypm_jax import rules as R

    return R.canonical_rules() + R.attention_rules() + R.gemm_rules(pairs=True)


RULES = {"pair": _pair_rules}  # models optimized with other rules than the default ones


def param_spec(path: Any, leaf: Any, tensor: bool) -> P:
    """Megatron-style: q/k/v and first MLP layers split by columns, the others by rows;
    experts' weights by the expert axis, attention sinks by heads."""
    names = {str(getattr(p, "key", "")) for p in path}
    if not tensor or leaf.ndim == 0:
        return P()
    if names & EXPERTS or "sinks" in names:
        return P("model", *(None,) * (leaf.ndim - 1))
    kernel = "kernel" in names
    if names & COLUMN:
        if kernel:
            return P(None, "model", *(None,) * (leaf.ndim - 2))  # [E, H, D] or [E, F]
        return P("model", *(None,) * (leaf.ndim - 1))  # bias [H, D] or [F]
    if names & ROW and kernel:
        return P("model", *(None,) * (leaf.ndim - 1))  # [H, D, E] or [F, E]
    return P()


def _rel(got: Any, want: Any) -> float:
    """The largest difference relative to the largest magnitude (a parameter whose gradient
    is mathematically zero, like a key bias's, is compared at that scale)."""
    pairs = [(np.asarray(a), np.asarray(b)) for a, b in
             zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)]  # fmt: skip
    scale = max(float(np.max(np.abs(b))) for _, b in pairs)
    return max(float(np.max(np.abs(a - b))) for a, b in pairs) / scale


def run_case(case: str) -> dict[str, Any]:
    model, *options = case.split("/")
    jax.config.update("jax_use_shardy_partitioner", "gspmd" not in options)
    os.environ["PYPM_KERNEL_IMPL"] = "xla" if "xla" in options else "interpret"
    if model == "shard_map":
        return shard_map_case(check_vma="vma" in options, name=case)
    if model == "vmap":
        return vmap_case()
    if model == "counter":
        return counter_case()
    mesh_kind = options[0]
    # split 4 ways, a sequence of 64 gives each device one 16-row block of the kernels in
    # the interpreter: with a causal mask the later devices' blocks skip keys by position
    fn, params, inputs = built(model, mesh_kind == "seq")
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    tensor = mesh_kind in ("tensor", "both")
    batch = {"data": P("data"), "both": P("data"), "seq": P(None, "model")}.get(mesh_kind, P())
    params = jax.tree_util.tree_map_with_path(
        lambda p, a: jax.device_put(a, NamedSharding(mesh, param_spec(p, a, tensor))), params
    )
    inputs = tuple(jax.device_put(a, NamedSharding(mesh, batch)) for a in inputs)
    args = (params, *inputs)

    def loss(f: Any) -> Any:
        return jax.grad(lambda p, *xs: jnp.sum(jnp.sin(f(p, *xs))))

    opt = pm.optimize(fn, rules=RULES[model]() if model in RULES else None)
    programs = {
        "jit": jax.jit(fn), "opt": jax.jit(opt),
        "jit_grad": jax.jit(loss(fn)), "opt_grad": jax.jit(loss(opt)),
    }  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the original program fails the case
        compiled = {k: p.lower(*args).compile() for k, p in programs.items()}
        want, got = compiled["jit"](*args), compiled["opt"](*args)
        g_want, g_got = compiled["jit_grad"](*args), compiled["opt_grad"](*args)
        rules = sorted({r.rule for r in opt.report(*args)})

    return {
        "case": case,
        "rules": rules,
        "out_rel": _rel(got, want),
        "grad_rel": _rel(g_got, g_want),
        "out_sharding": got.sharding.is_equivalent_to(want.sharding, got.ndim),
        "grad_sharding": all(
            a.sharding.is_equivalent_to(b.sharding, a.ndim)
            for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want), strict=True)
        ),  # fmt: skip
        **{k: collectives(c.as_text()) for k, c in compiled.items()},
        "reductions": {k: collectives(c.as_text(), REDUCTIONS) for k, c in compiled.items()},
    }


def shard_map_case(check_vma: bool = False, name: str = "shard_map") -> dict[str, Any]:
    """Attention and a GEMM epilogue inside a ``shard_map`` body (per device); with
    ``check_vma`` (``shard_map``'s default), the kernels declare how their results vary
    across the mesh."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))

    def body(x: Any, wq: Any, wk: Any, wv: Any, w1: Any, b1: Any) -> Any:
        b, s, _ = x.shape
        q, k, v = ((x @ w).reshape(b, s, -1, 32) for w in (wq, wk, wv))
        o = jax.nn.dot_product_attention(q, k, v).reshape(b, s, -1)
        return jax.nn.gelu(o @ w1 + b1)

    fn = jax.shard_map(body, mesh=mesh, out_specs=P("data", "model"), check_vma=check_vma,
                       in_specs=(P("data"), *(P(None, "model"),) * 3, P(), P()))  # fmt: skip
    ks = jax.random.split(jax.random.key(3), 6)
    args = (jax.random.normal(ks[0], (4, 8, 64)),
            *(0.1 * jax.random.normal(k, (64, 128)) for k in ks[1:4]),
            0.1 * jax.random.normal(ks[4], (32, 48)), jax.random.normal(ks[5], (48,)))  # fmt: skip
    opt = pm.optimize(fn)
    grad = lambda f: jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 4, 5))  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want, got = jax.jit(fn)(*args), opt(*args)
        g_want, g_got = jax.jit(grad(fn))(*args), jax.jit(grad(opt))(*args)
        rules = sorted({r.rule for r in opt.report(*args)})
    return {
        "case": name,
        "rules": rules,
        "out_rel": _rel(got, want),
        "grad_rel": _rel(g_got, g_want),
        "out_sharding": got.sharding.is_equivalent_to(want.sharding, got.ndim),
    }


def counter_case() -> dict[str, Any]:
    """What :func:`collectives` counts in a program that must gather (a sharded input
    returned replicated): the counts the other cases compare can be nonzero."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("data", "model")))
    gather = jax.jit(lambda x: x + 1, out_shardings=NamedSharding(mesh, P()))
    return {"case": "counter", "gather": collectives(gather.lower(x).compile().as_text())}


def vmap_case() -> dict[str, Any]:
    """``jax.vmap`` of an optimized attention, the mapped axis sharded: the vmapped kernel
    call is partitioned along it too."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))

    def attend(q: Any, k: Any, v: Any) -> Any:
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(32.0)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    spec = NamedSharding(mesh, P("model", "data"))
    args = [jax.device_put(jax.random.normal(jax.random.key(i), (4, 2, 8, 4, 32)), spec)
            for i in range(3)]  # fmt: skip
    opt = pm.optimize(attend)
    loss = lambda f: jax.grad(lambda *a: jnp.sum(jnp.sin(jax.vmap(f)(*a))), (0, 1, 2))  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fwd = {k: jax.jit(jax.vmap(f)).lower(*args).compile() for k, f in
               (("jit", attend), ("opt", opt))}  # fmt: skip
        want, got = fwd["jit"](*args), fwd["opt"](*args)
        g_want, g_got = jax.jit(loss(attend))(*args), jax.jit(loss(opt))(*args)
        rules = sorted({r.rule for r in opt.report(*(a[0] for a in args))})
    return {
        "case": "vmap",
        "rules": rules,
        "out_rel": _rel(got, want),
        "grad_rel": _rel(g_got, g_want),
        "out_sharding": got.sharding.is_equivalent_to(want.sharding, got.ndim),
        **{k: collectives(c.as_text()) for k, c in fwd.items()},
    }


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(json.dumps(run_case(name)), flush=True)
