"""The living corpus: model code maintained today (keras-hub, tunix, gemma, penzai, equinox,
attnax), built from tiny configs with random weights (never downloaded), and an independent
count of its attention and dense + activation sites.

Each builder takes a dtype name (``"float32"``, or ``"bfloat16"`` for the model each library
is also checked in) and returns ``(fn, args, description)``: ``fn(*args)`` is a pure function
of arrays (parameters first), like :mod:`pypm_testing.corpus`. Builders are cached per process.
The libraries come with the ``zoo`` extra (``make zoo``); :func:`has` says whether one is
importable.

The site counter reads the lifted program (:func:`count_sites`), not the rewrite report, so
the number of sites the rules cover is measured, not assumed: a site is covered when the
rewritten program no longer contains it.

``python -m pypm_testing.zoo`` (from ``tests/``) prints the coverage table; with ``--explain``
it also prints, per site left alone, its spelling and ``pm.explain``'s closest rule.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")  # before anything imports keras

import jax
import jax.numpy as jnp
import numpy as np

Model = tuple[Callable[..., Any], tuple[Any, ...], str]

BATCH, SEQ, VOCAB = 2, 8, 100
WINDOW = 4  # sliding-window size of the models that have one (shorter than SEQ)


def has(library: str) -> bool:
    """Is the zoo library ``library`` (a key of :data:`MODELS`) importable?"""
    return importlib.util.find_spec(LIBRARY_MODULE[library]) is not None


def _ids(seed: int) -> jax.Array:
    return jax.random.randint(jax.random.PRNGKey(seed), (BATCH, SEQ), 0, VOCAB, jnp.int32)


def _padding_mask() -> jax.Array:
    """All tokens valid except the last two of the last sequence."""
    return jnp.ones((BATCH, SEQ), jnp.int32).at[-1, -2:].set(0)


def _cast_floats(tree: Any, dtype: str) -> Any:
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def _dims(dtype: str, extra: str = "") -> str:
    return f"2 layers, batch {BATCH}, seq {SEQ}, {dtype}{extra}"


# ------------------------------------------------------------------------------ keras-hub


def _keras(backbone: Any, desc: str) -> Model:
    """A Keras backbone as ``fn(trainable, inputs)`` through ``stateless_call`` (the
    non-trainable variables are constants)."""
    trainable = [v.value for v in backbone.trainable_variables]
    fixed = [v.value for v in backbone.non_trainable_variables]
    inputs = {
        i.name: _padding_mask() if "mask" in i.name else _ids(len(i.name)) for i in backbone.inputs
    }
    if "segment_ids" in inputs:
        inputs["segment_ids"] = jnp.zeros((BATCH, SEQ), jnp.int32)

    def apply(trainable: Any, inputs: Any) -> Any:
        return backbone.stateless_call(trainable, fixed, inputs)[0]

    return apply, (trainable, inputs), f"keras_hub.models.{type(backbone).__name__} ({desc})"


def _keras_common(dtype: str) -> dict[str, Any]:
    import keras

    keras.utils.set_random_seed(0)
    return {"vocabulary_size": VOCAB, "num_layers": 2, "dtype": dtype}


@functools.cache
def keras_bert(dtype: str = "float32") -> Model:
    """BERT as its presets configure it (dropout 0.1: Keras MHA's non-fused path)."""
    import keras_hub

    b = keras_hub.models.BertBackbone(
        num_heads=2, hidden_dim=64, intermediate_dim=128, max_sequence_length=16, dropout=0.1,
        **_keras_common(dtype),
    )  # fmt: skip
    return _keras(b, _dims(dtype, ", dropout 0.1, padding mask"))


@functools.cache
def keras_gpt2(dtype: str = "float32") -> Model:
    import keras_hub

    b = keras_hub.models.GPT2Backbone(
        num_heads=2, hidden_dim=64, intermediate_dim=128, max_sequence_length=16, dropout=0.1,
        **_keras_common(dtype),
    )  # fmt: skip
    return _keras(b, _dims(dtype, ", dropout 0.1, causal + padding mask"))


@functools.cache
def keras_opt(dtype: str = "float32") -> Model:
    import keras_hub

    b = keras_hub.models.OPTBackbone(
        num_heads=2, hidden_dim=64, intermediate_dim=128, max_sequence_length=16, dropout=0.1,
        **_keras_common(dtype),
    )  # fmt: skip
    return _keras(b, _dims(dtype, ", dropout 0.1, causal + padding mask"))


@functools.cache
def keras_falcon(dtype: str = "float32") -> Model:
    import keras_hub

    b = keras_hub.models.FalconBackbone(
        num_attention_heads=2, hidden_dim=64, intermediate_dim=128, **_keras_common(dtype)
    )
    return _keras(b, _dims(dtype, ", ALiBi, causal + padding mask"))


@functools.cache
def keras_gemma2(dtype: str = "float32") -> Model:
    """Gemma 2 settings: logit soft-capping, alternating sliding-window layers, GQA."""
    import keras_hub

    b = keras_hub.models.GemmaBackbone(
        num_query_heads=2, num_key_value_heads=1, hidden_dim=64, intermediate_dim=128,
        head_dim=32, query_head_dim_normalize=True, use_post_ffw_norm=True,
        use_post_attention_norm=True, final_logit_soft_cap=30.0, attention_logit_soft_cap=50.0,
        use_sliding_window_attention=True, sliding_window_size=WINDOW, **_keras_common(dtype),
    )  # fmt: skip
    return _keras(b, _dims(dtype, ", Gemma 2: soft-caps, sliding window, MQA 2/1"))


@functools.cache
def keras_mixtral(dtype: str = "float32") -> Model:
    import keras_hub

    b = keras_hub.models.MixtralBackbone(
        num_query_heads=4, num_key_value_heads=2, hidden_dim=128, intermediate_dim=128,
        num_experts=4, top_k=2, sliding_window=WINDOW, **_keras_common(dtype),
    )  # fmt: skip
    return _keras(b, _dims(dtype, ", 4 experts top-2, GQA 4/2, sliding window"))


@functools.cache
def keras_llama3(dtype: str = "float32") -> Model:
    import keras_hub

    b = keras_hub.models.Llama3Backbone(
        num_query_heads=4, num_key_value_heads=2, hidden_dim=128, intermediate_dim=256,
        **_keras_common(dtype),
    )  # fmt: skip
    return _keras(b, _dims(dtype, ", GQA 4/2, RoPE"))


# ------------------------------------------------------------------------------ Flax NNX


def _nnx(module: Any, call: Callable[..., Any], args: tuple[Any, ...], dtype: str) -> Any:
    """``fn(params, *args)`` for an NNX module: ``call(module, *args)`` on the merged state
    (the rest of the state, RNG counters and the like, is a constant)."""
    from flax import nnx

    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def apply(params: Any, *args: Any) -> Any:
        return call(nnx.merge(graphdef, params, rest), *args)

    return apply, (_cast_floats(params, dtype), *args)


def _causal_mask() -> jax.Array:
    return jnp.broadcast_to(jnp.tril(jnp.ones((SEQ, SEQ), bool)), (BATCH, SEQ, SEQ))


def _tunix_call(model: Any, ids: Any, positions: Any, mask: Any) -> Any:
    return model(ids, positions, None, mask)[0]


def _tunix_args() -> tuple[Any, ...]:
    return _ids(40), jnp.broadcast_to(jnp.arange(SEQ), (BATCH, SEQ)), _causal_mask()


@functools.cache
def tunix_llama3(dtype: str = "float32") -> Model:
    from flax import nnx
    from tunix.models.llama3 import model as llama3

    cfg = llama3.ModelConfig(
        num_layers=2, vocab_size=VOCAB, embed_dim=128, hidden_dim=256, num_heads=4,
        head_dim=32, num_kv_heads=2, rope_theta=10_000, norm_eps=1e-5,
    )  # fmt: skip
    fn, args = _nnx(llama3.Llama3(cfg, rngs=nnx.Rngs(0)), _tunix_call, _tunix_args(), dtype)
    return fn, args, f"tunix Llama3 ({_dims(dtype, ', GQA 4/2, RoPE, causal mask')})"


@functools.cache
def tunix_gemma2(dtype: str = "float32") -> Model:
    from flax import nnx
    from tunix.models.gemma import model as gemma

    cfg = gemma.ModelConfig(
        num_layers=2, num_embed=VOCAB, embed_dim=128, hidden_dim=256, num_heads=4,
        head_dim=32, num_kv_heads=2, final_logit_softcap=30.0, use_post_attn_norm=True,
        use_post_ffw_norm=True, attn_logits_soft_cap=50.0, sliding_window_size=WINDOW,
        attention_types=(gemma.AttentionType.LOCAL_SLIDING, gemma.AttentionType.GLOBAL),
    )  # fmt: skip
    model = gemma.Gemma(cfg, rngs=nnx.Rngs(0))
    fn, args = _nnx(model, _tunix_call, _tunix_args(), dtype)
    desc = ", Gemma 2: soft-caps, sliding window, GQA 4/2"
    return fn, args, f"tunix Gemma 2 ({_dims(dtype, desc)})"


@functools.cache
def attnax_decoder(dtype: str = "float32") -> Model:
    """attnax's standard decoder-only stack (its STANDARD attention backend)."""
    from attnax.config import TransformerConfig
    from attnax.transformer import TransformerDecoder
    from flax import nnx

    cfg = TransformerConfig(
        vocab_size=VOCAB, d_model=64, num_heads=2, num_layers=2, d_ff=128, dropout_rate=0.1,
        max_len=16,
    )  # fmt: skip
    model = TransformerDecoder(nnx.Rngs(0), cfg)
    fn, args = _nnx(model, lambda m, ids: m(ids, deterministic=True), (_ids(41),), dtype)
    return fn, args, f"attnax TransformerDecoder ({_dims(dtype, ', dropout 0.1, causal')})"


# ------------------------------------------------------------------------ gemma, penzai, equinox


@functools.cache
def gemma_gm(dtype: str = "float32") -> Model:
    """``gm.nn.Transformer`` with a Gemma 2-like config (fused gate/up MLP einsum).

    Importing ``gemma.gm`` replaces ``flax.linen.Module.param`` for the whole process (to
    cast parameters while gemma initializes); other Flax models then fail to initialize
    (Hugging Face's ``param(name, lambda _, shape: ..., shape)``). The original is put back
    once the model is built: applying it needs no patch."""
    import flax.linen as nn

    flax_param = nn.Module.param
    try:
        return _gemma_gm(dtype)
    finally:
        nn.Module.param = flax_param


def _gemma_gm(dtype: str) -> Model:
    from gemma import gm
    from gemma.gm.nn import _modules

    cfg = gm.nn.config.TransformerConfig(
        num_embed=VOCAB, embed_dim=128, hidden_dim=256, num_heads=4, head_dim=32,
        num_kv_heads=2, final_logit_softcap=30.0, use_post_attn_norm=True,
        use_post_ffw_norm=True, attn_logits_soft_cap=50.0, sliding_window_size=WINDOW,
        attention_types=(_modules.AttentionType.LOCAL_SLIDING, _modules.AttentionType.GLOBAL),
    )  # fmt: skip
    model = gm.nn.Transformer(config=cfg, dtype=jnp.dtype(dtype))
    ids = _ids(42)
    params = _cast_floats(jax.jit(model.init)(jax.random.PRNGKey(0), ids), dtype)

    def apply(params: Any, ids: jax.Array) -> Any:
        return model.apply(params, ids).logits

    desc = ", Gemma 2: soft-caps, sliding window, GQA 4/2"
    return apply, (params, ids), f"gemma gm.nn.Transformer ({_dims(dtype, desc)})"


@functools.cache
def penzai_llama(dtype: str = "float32") -> Model:
    from penzai import pz
    from penzai.models.transformer.variants import llamalike_common

    cfg = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=2, query_head_multiplier=2, embedding_dim=128, projection_dim=32,
        mlp_hidden_dim=256, num_decoder_blocks=2, vocab_size=VOCAB, mlp_variant="swiglu",
        tie_embedder_and_logits=False, parameter_dtype=jnp.dtype(dtype),
        activation_dtype=jnp.dtype(dtype),
    )  # fmt: skip
    model = llamalike_common.build_llamalike_transformer(cfg, jax.random.PRNGKey(0))
    unbound, params = pz.unbind_params(model)
    params = tuple(p.freeze() for p in params)

    def apply(params: Any, ids: jax.Array) -> Any:
        bound = pz.bind_variables(unbound, params)
        return bound(pz.nx.wrap(ids).tag("batch", "seq")).unwrap("batch", "seq", "vocabulary")

    return apply, (params, _ids(43)), f"penzai llama ({_dims(dtype, ', GQA 4/2, causal')})"


@functools.cache
def equinox_mha(dtype: str = "float32") -> Model:
    """``eqx.nn.MultiheadAttention`` with a causal mask, vmapped over the batch."""
    import equinox as eqx

    mha = eqx.nn.MultiheadAttention(num_heads=2, query_size=64, key=jax.random.PRNGKey(0))
    params, static = eqx.partition(mha, eqx.is_array)
    mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))
    x = jax.random.normal(jax.random.PRNGKey(44), (BATCH, SEQ, 64), dtype)

    def apply(params: Any, x: jax.Array) -> Any:
        layer = eqx.combine(params, static)
        return jax.vmap(lambda x: layer(x, x, x, mask=mask))(x)

    desc = f"1 layer, batch {BATCH} (vmap), seq {SEQ}, {dtype}, causal mask"
    return apply, (_cast_floats(params, dtype), x), f"equinox MultiheadAttention ({desc})"


# Library -> model name -> builder. The library key is also the module :func:`has` imports.
MODELS: dict[str, dict[str, Callable[..., Model]]] = {
    "keras_hub": {
        "keras_bert": keras_bert,
        "keras_gpt2": keras_gpt2,
        "keras_opt": keras_opt,
        "keras_falcon": keras_falcon,
        "keras_gemma2": keras_gemma2,
        "keras_mixtral": keras_mixtral,
        "keras_llama3": keras_llama3,
    },
    "tunix": {"tunix_llama3": tunix_llama3, "tunix_gemma2": tunix_gemma2},
    "gemma": {"gemma_gm": gemma_gm},
    "penzai": {"penzai_llama": penzai_llama},
    "equinox": {"equinox_mha": equinox_mha},
    "attnax": {"attnax_decoder": attnax_decoder},
}
LIBRARY_MODULE = {lib: lib for lib in MODELS}
LIBRARY = {name: lib for lib, models in MODELS.items() for name in models}
BUILDERS = {name: b for models in MODELS.values() for name, b in models.items()}
# The model of each library also checked in bf16.
BF16 = ("keras_gemma2", "tunix_llama3", "gemma_gm", "penzai_llama", "equinox_mha", "attnax_decoder")


def build(name: str, dtype: str = "float32") -> Model:
    return BUILDERS[name](dtype)


# ------------------------------------------------------------------------------ site counts
#
# Counted on the lifted graph (nested bodies included), independently of the rules:
# - an ATTENTION site is a dot_general one of whose operands is, through elementwise and
#   layout operations only, the ``exp`` of a softmax (an ``exp`` that a ``reduce_sum`` also
#   reads) whose scores come, through elementwise/layout operations and reductions, from a
#   dot_general of two activations (no weight operand: that tells scores from a router's
#   logits);
# - a DENSE + ACTIVATION site is a dot_general with a weight operand (a program input or
#   constant, through layout operations) whose value reaches an activation (tanh, logistic,
#   erf, max with 0) through elementwise and layout operations only.
# A site the rewritten program no longer contains is covered (its dot_general went into a
# kernel).

LAYOUT = frozenset(
    {"convert_element_type", "reshape", "transpose", "broadcast_in_dim", "squeeze",
     "expand_dims", "copy", "slice", "dynamic_slice", "rev", "reduce_precision"}
)  # fmt: skip
ELEMENTWISE = frozenset(
    {"add", "sub", "mul", "div", "neg", "max", "min", "select_n", "integer_pow", "square",
     "sqrt", "rsqrt", "tanh", "stop_gradient", "and", "or", "not", "lt", "le", "gt", "ge",
     "eq", "ne", "add_any", "concatenate", "pad"}
)  # fmt: skip
SCORE_PATH = ELEMENTWISE | LAYOUT | {"reduce_max", "reduce_sum", "exp"}
ACTIVATIONS = frozenset({"tanh", "logistic", "erf", "erfc"})
WALK = 14  # how many operations a path may cross


@dataclass(frozen=True)
class Sites:
    """The site dot_general nodes of a program, by kind."""

    attention: tuple[Any, ...]
    dense: tuple[Any, ...]


def _graphs(prog: Any) -> Iterator[Any]:
    """The graph of a lifted program and of every nested body."""
    stack = [prog]
    while stack:
        p = stack.pop()
        yield p.graph
        stack.extend(body for _node, _name, body in p.nested())


def _name(node: Any) -> str:
    return node.op.name


def _is_input(node: Any) -> bool:
    return not node.inputs and _name(node) in ("leaf", "const")


def _is_weight(value: Any) -> bool:
    """Is ``value`` a program input or constant, maybe cast, reshaped or transposed?"""
    node = value.node
    for _ in range(WALK):
        if _is_input(node):
            return True
        if _name(node) not in LAYOUT:
            return False
        node = node.inputs[0].node
    return False


def _back(value: Any, through: frozenset[str], want: Callable[[Any], bool]) -> list[Any]:
    """Nodes satisfying ``want`` reached from ``value`` backwards, crossing only operations
    in ``through`` (at most WALK of them)."""
    found, seen, frontier = [], set(), [value.node]
    for _ in range(WALK):
        nxt = []
        for node in frontier:
            if id(node) in seen:
                continue
            seen.add(id(node))
            if want(node):
                found.append(node)
            elif _name(node) in through:
                nxt.extend(v.node for v in node.inputs)
        frontier = nxt
    return found


def _is_scores(node: Any) -> bool:
    return _name(node) == "dot_general" and not any(_is_weight(v) for v in node.inputs)


def _is_softmax_exp(graph: Any, node: Any) -> bool:
    """An ``exp`` that a ``reduce_sum`` reads, of scores (see above)."""
    if _name(node) != "exp":
        return False
    readers = list(graph.users(node.outputs[0]))
    readers += [r for u in readers if _name(u) in LAYOUT for r in graph.users(u.outputs[0])]
    if not any(_name(r) == "reduce_sum" for r in readers):
        return False
    return bool(_back(node.inputs[0], SCORE_PATH, _is_scores))


def _is_attention(graph: Any, dot: Any) -> bool:
    through = ELEMENTWISE | LAYOUT
    want = functools.partial(_is_softmax_exp, graph)
    return any(_back(v, through, want) for v in dot.inputs)


def _is_activation(node: Any) -> bool:
    """tanh, logistic, erf(c), or ``max`` with a constant 0 (relu)."""
    if _name(node) in ACTIVATIONS:
        return True
    if _name(node) != "max":
        return False
    return any(_is_input(v.node) and _zero(v.node) for v in node.inputs)


def _zero(node: Any) -> bool:
    value = node.attrs.get("value")
    return value is not None and bool(np.all(np.asarray(value) == 0))


def _is_dense(node: Any) -> bool:
    return _name(node) == "dot_general" and any(_is_weight(v) for v in node.inputs)


def count_sites(prog: Any) -> Sites:
    """The attention and dense + activation sites of a lifted program (see above)."""
    attention, dense = [], {}
    for graph in _graphs(prog):
        for node in graph.nodes():
            if _name(node) == "dot_general" and _is_attention(graph, node):
                attention.append(node)
            elif _is_activation(node):
                inputs = [v for v in node.inputs if not _is_input(v.node)]
                through = (ELEMENTWISE - {"tanh"}) | LAYOUT
                for v in inputs:
                    for d in _back(v, through, _is_dense):
                        dense.setdefault(id(d), d)
    return Sites(tuple(attention), tuple(dense.values()))


@dataclass(frozen=True)
class Coverage:
    """A model's sites before and after ``pm.optimize``'s default rules."""

    attention: int  # sites in the original program
    dense: int
    attention_left: int  # sites the rewritten program still has
    dense_left: int
    fired: dict[str, int]  # the report's counts
    left: Sites  # the sites left, in the rewritten program

    @property
    def attention_covered(self) -> int:
        return self.attention - self.attention_left

    @property
    def dense_covered(self) -> int:
        return self.dense - self.dense_left


def lifted_original(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """The lifted program of ``fn`` at ``args``, not rewritten."""
    from pypm_jax.jax.lift import lift

    return lift(jax.make_jaxpr(fn)(*args))


def coverage(fn: Callable[..., Any], args: tuple[Any, ...], fast: Any = None) -> Coverage:
    """Count the sites of ``fn`` and of its rewrite (``fast``, default ``pm.optimize(fn)``)."""
    import pypm_jax as pm

    fast = fast if fast is not None else pm.optimize(fn)
    before = count_sites(lifted_original(fn, args))
    after = count_sites(fast.lifted(*args))
    return Coverage(
        len(before.attention), len(before.dense), len(after.attention), len(after.dense),
        dict(fast.report(*args).counts()), after,
    )  # fmt: skip


# ------------------------------------------------------------------------------ the printer


def _excerpt(graph: Any, dot: Any, limit: int = 24) -> list[str]:
    """The operations between a site's dot_general and the dot_generals feeding it."""
    nodes = {id(dot): dot}
    for v in dot.inputs:
        for n in _back_all(v):
            nodes[id(n)] = n
    shown = sorted(nodes.values(), key=lambda n: n.id)[-limit:]
    return [_show(n) for n in shown]


def _back_all(value: Any) -> list[Any]:
    out: list[Any] = []
    _back(value, SCORE_PATH | {"logistic", "erf"}, lambda n: out.append(n) and False)
    return [n for n in out if not _is_input(n)]


def _show(node: Any) -> str:
    shape = ",".join(map(str, node.outputs[0].shape or ()))
    args = ", ".join(v.name for v in node.inputs)
    return f"%{node.id} = {_name(node)}({args}) : {node.outputs[0].dtype}[{shape}]"


def _candidates(graph: Any, node: Any, depth: int = 4) -> list[Any]:
    """``node``'s value and the values after it through layout/elementwise operations."""
    out, frontier = [], [node]
    for _ in range(depth):
        out.extend(n.outputs[0] for n in frontier)
        frontier = [u for n in frontier for u in graph.users(n.outputs[0])]
        frontier = [u for u in frontier if _name(u) in ELEMENTWISE | LAYOUT | ACTIVATIONS]
    return out


def closest_rule(graph: Any, node: Any, prefix: str) -> Any:
    """``pm.explain``'s attempt that got furthest at (or just after) ``node``, over the
    default rules whose names start with ``prefix``."""
    import pypm_jax as pm
    from pypm_jax.rules import default_rules

    best, key = None, None
    for rule in default_rules():
        if not rule.name.startswith(prefix):
            continue
        for value in _candidates(graph, node):
            a = pm.explain(rule, value).best
            k = (a.matched, a.pattern_match is not None, a.depth)
            if key is None or k > key:
                best, key = a, k
    return best


def _graph_of(node: Any) -> Any:
    return node._graph


def _short_paths(text: str) -> str:
    """Paths into installed packages from the package name on (``keras/src/...``)."""
    return re.sub(r"/\S*/site-packages/", "", text)


def explain_left(cov: Coverage) -> list[str]:
    """Per site left: where, its spelling, and the closest rule's explanation (a site
    spelled like one before it, with the same failure, is only named)."""
    lines, seen = [], set()
    for kind, nodes, prefix in (
        ("attention", cov.left.attention, "attention"),
        ("dense", cov.left.dense, "gemm"),
    ):
        for node in nodes:
            graph = _graph_of(node)
            excerpt = _excerpt(graph, node)
            attempt = closest_rule(graph, node, prefix)
            text = _short_paths(str(attempt)) if attempt is not None else "(no rule)"
            key = kind + re.sub(r"%\d+", "%", text.splitlines()[-1])
            lines.append(f"- {kind} site at {_short_paths(str(node.loc))}")
            if key in seen:
                lines[-1] += ": spelled as the one above, same failure"
                continue
            seen.add(key)
            lines += ["      " + line for line in excerpt]
            lines += ["    " + line for line in text.splitlines()]
    return lines


def table(names: list[str] | None = None, explain: bool = False) -> str:
    """The coverage table (markdown) of the zoo models that are installed."""
    rows = ["| library | model | attention covered/sites | dense+act covered/sites | rules fired |"]
    rows.append("|---|---|---|---|---|")
    notes = []
    for name in names or list(BUILDERS):
        if not has(LIBRARY[name]):
            continue
        fn, args, desc = build(name)
        cov = coverage(fn, args)
        fired = ", ".join(f"{n} {r}" for r, n in sorted(cov.fired.items())) or "-"
        rows.append(
            f"| {LIBRARY[name]} | `{name}`: {desc} | {cov.attention_covered}/{cov.attention} "
            f"| {cov.dense_covered}/{cov.dense} | {fired} |"
        )
        if explain:
            notes += [f"\n### {name}", *explain_left(cov)]
    return "\n".join(rows + notes)


if __name__ == "__main__":
    import sys

    flags = [a for a in sys.argv[1:] if a.startswith("--")]
    print(table([a for a in sys.argv[1:] if a not in flags] or None, "--explain" in flags))
