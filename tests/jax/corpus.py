"""A corpus of real models from small configs with random weights (never downloaded).

Each builder returns ``(apply_fn, example_inputs, description)``: ``apply_fn(*example_inputs)``
is a pure function of arrays (parameters first) returning a pytree of arrays, suitable for
``pm.optimize``/``jax.jit``/``jax.grad``. Builders are cached: a model is built once per test
session. Reused by the rule library's tests (``from tests.jax.corpus import ...``, or
``import corpus`` with ``tests/jax`` on the path).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Model = tuple[Callable[..., Any], tuple[Any, ...], str]

BATCH, SEQ, HIDDEN, HEADS, FFN, LAYERS = 2, 8, 32, 4, 64, 2


def _key(i: int) -> jax.Array:
    return jax.random.PRNGKey(i)


def _ids(seed: int, shape: tuple[int, ...] = (BATCH, SEQ), vocab: int = 100) -> jax.Array:
    return jax.random.randint(_key(seed), shape, 0, vocab, dtype=jnp.int32)


def random_like(tree: Any, seed: int = 0, scale: float = 0.05) -> Any:
    """Random weights of the shapes of ``tree`` (e.g. from ``jax.eval_shape(init, ...)``).

    Filled with numpy, so building a model compiles nothing (initializers would).
    """
    rng = np.random.default_rng(seed)

    def fill(s: Any) -> Any:
        if jnp.issubdtype(s.dtype, jnp.floating):
            return jnp.asarray(rng.normal(0.0, scale, s.shape), s.dtype)
        return jnp.zeros(s.shape, s.dtype)

    return jax.tree.map(fill, tree)


def _hf(cls: Any, config: Any, input_shape: tuple[int, ...]) -> tuple[Any, Any]:
    """A Hugging Face Flax model with random weights."""
    model = cls(config, seed=0, _do_init=False)
    shapes = jax.eval_shape(functools.partial(model.init_weights, input_shape=input_shape), _key(0))
    return model, random_like(shapes)


# ------------------------------------------------------------------------ Hugging Face


@functools.cache
def hf_bert() -> Model:
    from transformers import BertConfig, FlaxBertModel

    cfg = BertConfig(
        vocab_size=100,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        max_position_embeddings=32,
    )
    model, params = _hf(FlaxBertModel, cfg, (BATCH, SEQ))
    mask = jnp.ones((BATCH, SEQ), jnp.int32).at[1, -3:].set(0)

    def apply(params: Any, ids: jax.Array, mask: jax.Array) -> Any:
        return model(ids, attention_mask=mask, params=params, train=False).to_tuple()

    return apply, (params, _ids(1), mask), "FlaxBertModel (2 layers, hidden 32, padding mask)"


@functools.cache
def hf_gpt2() -> Model:
    from transformers import FlaxGPT2Model, GPT2Config

    cfg = GPT2Config(vocab_size=100, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=32)
    model, params = _hf(FlaxGPT2Model, cfg, (BATCH, SEQ))

    def apply(params: Any, ids: jax.Array) -> Any:
        return model(ids, params=params, train=False).last_hidden_state

    return apply, (params, _ids(2)), "FlaxGPT2Model (2 layers, hidden 32, causal)"


@functools.cache
def hf_llama() -> Model:
    from transformers import FlaxLlamaModel, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=100,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        intermediate_size=FFN,
        max_position_embeddings=32,
    )
    model, params = _hf(FlaxLlamaModel, cfg, (BATCH, SEQ))

    def apply(params: Any, ids: jax.Array) -> Any:
        return model(ids, params=params, train=False).last_hidden_state

    return apply, (params, _ids(3)), "FlaxLlamaModel (2 layers, hidden 32, GQA 4/2, RoPE)"


@functools.cache
def hf_vit() -> Model:
    from transformers import FlaxViTModel, ViTConfig

    cfg = ViTConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        image_size=16,
        patch_size=4,
        num_channels=3,
    )
    model, params = _hf(FlaxViTModel, cfg, (BATCH, 16, 16, 3))
    pixels = jax.random.normal(_key(4), (BATCH, 3, 16, 16), jnp.float32)  # NCHW, as HF takes

    def apply(params: Any, pixels: jax.Array) -> Any:
        return model(pixels, params=params, train=False).to_tuple()

    return apply, (params, pixels), "FlaxViTModel (2 layers, hidden 32, 16x16 images, patch 4)"


@functools.cache
def hf_bart() -> Model:
    from transformers import BartConfig, FlaxBartModel

    cfg = BartConfig(
        vocab_size=100,
        d_model=HIDDEN,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN,
        max_position_embeddings=32,
    )
    model, params = _hf(FlaxBartModel, cfg, (BATCH, SEQ))

    def apply(params: Any, ids: jax.Array, dec_ids: jax.Array) -> Any:
        out = model(ids, decoder_input_ids=dec_ids, params=params, train=False)
        return out.last_hidden_state, out.encoder_last_hidden_state

    return apply, (params, _ids(5), _ids(6)), "FlaxBartModel (2+2 layers, hidden 32)"


@functools.cache
def hf_distilbert() -> Model:
    from transformers import DistilBertConfig, FlaxDistilBertModel

    cfg = DistilBertConfig(
        vocab_size=100, dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, hidden_dim=FFN,
        max_position_embeddings=32,
    )  # fmt: skip
    model, params = _hf(FlaxDistilBertModel, cfg, (BATCH, SEQ))

    def apply(params: Any, ids: jax.Array) -> Any:
        return model(ids, params=params, train=False).last_hidden_state

    return apply, (params, _ids(7)), "FlaxDistilBertModel (2 layers, dim 32)"


# ------------------------------------------------------------------------ Flax linen / nnx


def _x(seed: int = 8) -> jax.Array:
    return jax.random.normal(_key(seed), (BATCH, SEQ, HIDDEN), jnp.float32)


@functools.cache
def linen_mha(masked: bool = False) -> Model:
    import flax.linen as nn

    class Attn(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
            return nn.MultiHeadDotProductAttention(num_heads=HEADS, name="attention")(
                x, x, mask=mask
            )

    model = Attn()
    x = _x()
    mask = nn.make_causal_mask(jnp.ones((BATCH, SEQ))) if masked else None
    variables = random_like(jax.eval_shape(model.init, _key(9), x, mask), 9)
    what = "causal mask" if masked else "no mask"
    if masked:
        return model.apply, (variables, x, mask), f"linen.MultiHeadDotProductAttention ({what})"
    return model.apply, (variables, x), f"linen.MultiHeadDotProductAttention ({what})"


@functools.cache
def nnx_mha(masked: bool = False) -> Model:
    from flax import nnx

    module = nnx.MultiHeadAttention(
        num_heads=HEADS, in_features=HIDDEN, decode=False, rngs=nnx.Rngs(10)
    )
    graphdef, state = nnx.split(module)
    x = _x(11)
    what = "causal mask" if masked else "no mask"

    if masked:
        mask = nnx.make_causal_mask(jnp.ones((BATCH, SEQ)))

        def apply_masked(state: Any, x: jax.Array, mask: jax.Array) -> jax.Array:
            return nnx.merge(graphdef, state)(x, mask=mask)

        return apply_masked, (state, x, mask), f"nnx.MultiHeadAttention ({what})"

    def apply(state: Any, x: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, state)(x)

    return apply, (state, x), f"nnx.MultiHeadAttention ({what})"


def _block_cls() -> Any:
    import flax.linen as nn

    class Block(nn.Module):
        """A pre-LN transformer block, scanned over layers."""

        @nn.compact
        def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
            y = nn.LayerNorm(name="ln1")(x)
            y = nn.MultiHeadDotProductAttention(num_heads=HEADS, name="attention")(y)
            x = x + y
            y = nn.Dense(FFN, name="fc1")(nn.LayerNorm(name="ln2")(x))
            y = nn.gelu(y)
            x = x + nn.Dense(HIDDEN, name="fc2")(y)
            return x, None

    return Block


@functools.cache
def linen_scan(remat: bool = False) -> Model:
    import flax.linen as nn

    block = _block_cls()
    if remat:
        block = nn.remat(block)

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            layers = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=LAYERS,
            )
            x, _ = layers(name="layers")(x, None)
            return nn.Dense(HIDDEN, name="head")(x)

    model = Stack()
    x = _x(12)
    variables = random_like(jax.eval_shape(model.init, _key(13), x), 13)
    what = "scan over remat blocks" if remat else "scan over layers"
    return model.apply, (variables, x), f"linen transformer ({what})"


HF_MODELS: dict[str, Callable[[], Model]] = {
    "bert": hf_bert,
    "gpt2": hf_gpt2,
    "llama": hf_llama,
    "vit": hf_vit,
    "bart": hf_bart,
    "distilbert": hf_distilbert,
}

FLAX_MODELS: dict[str, Callable[[], Model]] = {
    "linen_mha": lambda: linen_mha(False),
    "linen_mha_masked": lambda: linen_mha(True),
    "nnx_mha": lambda: nnx_mha(False),
    "nnx_mha_masked": lambda: nnx_mha(True),
    "linen_scan": lambda: linen_scan(False),
    "linen_scan_remat": lambda: linen_scan(True),
}

ALL_MODELS: dict[str, Callable[[], Model]] = {**FLAX_MODELS, **HF_MODELS}


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True
