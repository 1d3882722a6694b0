"""``attention_unsupported`` / ``gemm_unsupported``: why ``supports_*`` is False, in words,
and None exactly when it is True."""

from __future__ import annotations

import pytest

import pallas_kernels as pk

Q = (2, 16, 4, 64)


@pytest.mark.parametrize(
    ("args", "kw", "words"),
    [
        ((Q, Q, Q, "float32"), {}, None),
        (((2, 16, 4, 300), (2, 16, 4, 300), (2, 16, 4, 300), "float32"), {}, "head dim 300"),
        ((Q, Q, Q, "int8"), {}, "dtype 'int8' not supported"),
        ((Q, (2, 16, 3, 64), (2, 16, 3, 64), "float32"), {}, "multiple of kv heads"),
        ((Q, Q, Q, "float32"), {"mask_shape": (2, 4, 16, 15)}, "mask shape"),
    ],
)
def test_attention_unsupported_says_why(args, kw, words) -> None:
    why = pk.attention_unsupported(*args, **kw)
    assert (why is None) == pk.supports_attention(*args, **kw)
    assert why is None if words is None else words in why


@pytest.mark.parametrize(
    ("args", "kw", "words"),
    [
        (((8, 32), (32, 4), "float32"), {"bias_shape": (4,)}, None),
        (((8, 32), (16, 4), "float32"), {}, "contraction mismatch"),
        (((8, 32), (32, 4), "float64"), {}, "dtype"),
        (((8, 32), (32, 4), "float32"), {"bias_shape": (5,)}, "shape [N]"),
    ],
)
def test_gemm_unsupported_says_why(args, kw, words) -> None:
    why = pk.gemm_unsupported(*args, **kw)
    assert (why is None) == pk.supports_gemm(*args, **kw)
    assert why is None if words is None else words in why
