"""The partitioning declarations of replacement operators (``pypm_jax.vocab.partitioning``)
and what lowering makes of them (``pypm_jax.jax.partition``).

What the factors of a declaration become -- the dimensions kept splittable, the Shardy rule,
the mesh axes each factor takes from the operands' shardings -- checked without devices; the
partitioned programs themselves run on 8 devices in ``test_jax_sharded.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from jax.experimental.custom_partitioning import CompoundFactor
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import pypm_jax as pm
from pypm_jax.jax import Partitioning, register_partitioning
from pypm_jax.jax import partition as pt
from pypm_jax.vocab import partitioning

# GQA attention in BSHD: 8 query heads over 4 kv heads; a bias broadcast over the batch
ATTN = Partitioning(
    inputs=(
        ("b", None, ("g", "r"), None),
        ("b", None, "g", None),
        ("b", ("g", "r"), None, None),
    ),
    output=("b", None, ("g", "r"), None),
)
ATTN_SHAPES = [(2, 8, 8, 32), (2, 8, 4, 32), (1, 8, 8, 8)]
MESH = SimpleNamespace(shape={"data": 2, "model": 4})


def test_site_keeps_splittable_dims_and_sizes_factors():
    site = pt._site(ATTN, ATTN_SHAPES, (2, 8, 8, 32))
    assert site.sizes == {"b": 2, "g": 4, "r": 2}
    assert site.dims[0] == ("b", None, ("g", "r"), None)
    assert site.dims[2] == (None, ("g", "r"), None, None)  # size-1 batch of the bias: whole
    assert site.summed == frozenset()


def test_site_rejects_a_declaration_that_does_not_fit():
    with pytest.raises(ValueError, match="does not fit"):
        pt._site(ATTN, ATTN_SHAPES[:2], (2, 8, 8, 32))
    with pytest.raises(ValueError, match="factor 'b' has sizes 2 and 3"):
        pt._site(ATTN, [(2, 8, 8, 32), (3, 8, 4, 32), (1, 8, 8, 8)], (2, 8, 8, 32))


def test_a_contraction_splits_only_with_partial_and_finish():
    dims = (("m", "k"), ("k", "n"), ("n",))
    plain = pt._site(Partitioning(dims, ("m", "n")), [(4, 8), (8, 6), (6,)], (4, 6))
    assert plain.dims == (("m", None), (None, "n"), ("n",)) and plain.summed == frozenset()
    split = Partitioning(dims, ("m", "n"), partial=lambda *a: 0, finish=lambda *a: 0)
    site = pt._site(split, [(4, 8), (8, 6), (6,)], (4, 6))
    assert site.dims == dims and site.summed == frozenset({"k"})


def test_shardy_rule_names_factors_and_replicates_whole_dims():
    rule = pt._sharding_rule(pt._site(ATTN, ATTN_SHAPES, (2, 8, 8, 32)))
    q, k, bias = rule.operand_mappings
    assert q[0] == k[0] == "f0" and isinstance(q[2], CompoundFactor) and q[2][0] == k[2]
    (out,) = rule.result_mappings
    whole = {q[1], q[3], k[1], k[3], bias[0], *bias[2:], out[1], out[3]}
    assert set(rule.need_replication_factors) == whole and len(whole) == 9
    assert out[0] == q[0] and out[2] == q[2]
    # with as many query heads as kv heads the compound is the kv factor alone
    mha = pt._site(ATTN, [(2, 8, 4, 32), (2, 8, 4, 32), (1, 8, 4, 8)], (2, 8, 4, 32))
    q, k, _ = pt._sharding_rule(mha).operand_mappings
    assert q[2] == k[2] == "f1"


def test_factors_take_the_axes_of_the_first_operand_split_along_them():
    site = pt._site(ATTN, ATTN_SHAPES, (2, 8, 8, 32))
    specs = [((), (), ("model",), ()), (("data",), (), ("model",), ()), ((), (), (), ())]
    assert pt._assign(site, MESH, specs) == {"g": ("model",), "b": ("data",)}
    # 8 query heads over 2 kv heads split over 4 devices: the kv factor takes the axis,
    # shared (two devices per kv head); over 3 query heads per kv head it cannot
    small = pt._site(ATTN, [(2, 8, 8, 32), (2, 8, 2, 32), (1, 8, 8, 8)], (2, 8, 8, 32))
    assert pt._assign(small, MESH, specs) == {"g": ("model",), "b": ("data",)}
    odd = pt._site(ATTN, [(2, 8, 6, 32), (2, 8, 2, 32), (1, 8, 6, 8)], (2, 8, 6, 32))
    assert pt._assign(odd, MESH, [((), (), ("model",), ()), *specs[1:]]) == {"b": ("data",)}
    # an axis already used by another factor is not used twice
    both = [(("data",), (), ("data",), ()), ((), (), (), ()), ((), (), (), ())]
    assert pt._assign(site, MESH, both) == {"b": ("data",)}


def test_axes_split_into_a_major_part():
    assert pt._major_part([4], 2) == (0, 2)  # model (4) -> model.major (2) x model.minor (2)
    assert pt._major_part([2, 4], 2) == (1, 0)  # (data, model) -> data | model
    assert pt._major_part([2, 4], 4) == (1, 2)  # data x model.major | model.minor
    assert pt._major_part([3, 4], 2) is None  # no even cut gives 2 devices


def test_the_finest_mesh_cuts_axes_into_prime_sub_axes():
    mesh = pt._finest(Mesh(np.arange(24).reshape(2, 12), ("data", "model")))
    assert dict(mesh.shape) == {"data": 2, "model.0": 2, "model.1": 2, "model.2": 3}
    assert mesh.devices.ravel().tolist() == list(range(24))  # the same devices, in order


def test_a_shared_factor_splits_its_dims_by_the_major_sub_axes():
    """2 kv heads, 8 query heads on a model axis of 4 (``model.0`` x ``model.1``): the kv
    heads split by ``model.0`` (each device holds the kv head of its query heads), the
    query heads by both; the kv operands' gradients sum over ``model.1``."""
    mesh = pt._finest(Mesh(np.arange(8).reshape(2, 4), ("data", "model")))
    site = pt._site(ATTN, [(2, 8, 8, 32), (2, 8, 2, 32), (1, 8, 8, 8)], (2, 8, 8, 32))
    fine = ("model.0", "model.1")
    specs = [(("data",), (), fine, ()), ((), (), (), ()), ((), (), (), ())]
    assert pt._assign(site, mesh, specs) == {"b": ("data",), "g": fine}
    layout = pt._Layout(mesh, {"b": ("data",), "g": fine}, {"g": ("model.0",)})
    assert pt._named(layout, site.dims[1]).spec == P("data", None, "model.0", None)
    assert pt._named(layout, site.dims[0]).spec == P("data", None, fine, None)
    assert pt._missing_axes(site, site.dims[1], layout) == ("model.1",)
    assert pt._missing_axes(site, site.dims[0], layout) == ()


def test_register_partitioning_checks_its_arguments():
    @pm.op
    def Kernel(x):  # noqa: N802
        return 1

    with pytest.raises(TypeError, match="needs a pm operator"):
        register_partitioning("Kernel", lambda *s: None)
    with pytest.raises(TypeError, match="must be callable"):
        register_partitioning(Kernel, 3)
    decl = register_partitioning(Kernel)(lambda shape: Partitioning(((None,),), (None,)))
    assert partitioning.partitioning_for(Kernel) is decl
    partitioning.PARTITIONINGS.pop(Kernel)


# attention in BSHD with the query sequence ``s`` split, its first index the kernel's offset
SEQ = Partitioning(
    inputs=(("b", "s", ("g", "r"), None), ("b", None, "g", None), ("b", ("g", "r"), "s", None)),
    output=("b", "s", ("g", "r"), None),
    offset="s",
)


def test_a_split_query_sequence_leaves_the_keys_whole_and_sums_their_gradients():
    site = pt._site(SEQ, [(2, 8, 4, 32), (2, 8, 4, 32), (1, 1, 8, 8)], (2, 8, 4, 32))
    assert site.dims[2] == (None, None, "s", None)  # a bias broadcast over batch and heads
    specs = [((), ("model",), (), ()), ((), ("model",), (), ()), ((), (), (), ())]
    axes = pt._assign(site, MESH, specs)
    assert axes == {"s": ("model",)}  # the keys' split is not theirs to keep
    layout = pt._Layout(Mesh(np.arange(8).reshape(2, 4), ("data", "model")), axes, {})
    assert pt._named(layout, site.dims[1]).spec == P(None, None, None, None)
    assert pt._named(layout, site.dims[2]).spec == P(None, None, "model", None)
    # every block of the queries adds to the keys' and the bias's gradients
    assert pt._missing_axes(site, site.dims[1], layout) == ("model",)
    assert pt._missing_axes(site, site.dims[2], layout) == ()


def test_the_offset_is_the_first_index_of_each_devices_block():
    import jax
    import jax.numpy as jnp

    site = pt._site(SEQ, [(2, 16, 4, 32), (2, 16, 4, 32), (1, 1, 16, 16)], (2, 16, 4, 32))
    layout = pt._Layout(MESH, {"s": ("data", "model")}, {})  # 16 rows on 8 devices

    def offset(_: object) -> object:
        return pt._offset_kw(site, layout)["offset"]

    inner = jax.vmap(offset, axis_name="model")
    got = jax.vmap(inner, axis_name="data")(jnp.zeros((2, 4)))
    assert got.tolist() == [[0, 2, 4, 6], [8, 10, 12, 14]]  # data major, blocks of 2
    assert pt._offset_kw(site, pt._Layout(MESH, {}, {})) == {}  # unsplit: no offset


def test_an_offset_names_a_result_factor_of_a_declaration_without_partial():
    with pytest.raises(ValueError, match="offset 'k' must be a factor of the result"):
        Partitioning((("m", "k"),), ("m",), offset="k")
    with pytest.raises(ValueError, match="without partial/finish"):
        Partitioning((("m", "k"),), ("m",), partial=abs, finish=abs, offset="m")


# ------------------------------------------------------ the standard rules' kernel operators


def _inserted_ops() -> set:
    """Every operator a result term of a standard rule (default and opt-in) builds."""
    import dataclasses

    from pypm_jax import rules as R
    from pypm_jax.core.terms import Operator

    rules = R.standard_rules() + list(R.PAIR_RULES) + list(R.GEMM_LINEAR_RULES)
    found: set = set()

    def walk(x: object) -> None:
        if isinstance(x, Operator):
            found.add(x)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))
        elif isinstance(x, tuple | list):
            for y in x:
                walk(y)

    for rule in rules:
        for branch in rule.definition.branches:
            walk(branch.result)
    return found


def test_every_kernel_operator_the_rules_insert_declares_its_partitioning():
    """A kernel operator without a declaration runs replicated on a mesh (XLA gathers its
    operands): each one a standard rule builds has one, except the operand packs, which
    lowering flattens into the kernel call that reads them."""
    from pypm_jax.vocab.impls import impl_for
    from pypm_jax.vocab.primitives import is_table_op

    kernels = {op for op in _inserted_ops() if not is_table_op(op)}
    names = {op.name for op in kernels}
    assert {"FlashAttention", "FlashAttentionSinks", "AttentionRegion", "GemmEpilogue",
            "GemmRegion", "GemmPairRegion"} <= names  # fmt: skip
    for op in kernels:
        assert impl_for(op) is not None, op.name
        if op.op_class is not None and op.op_class.name == "pack":
            continue
        assert partitioning.partitioning_for(op) is not None, (
            f"{op.name} has no partitioning declaration"
        )


# ------------------------------------------------------------- GEMM-epilogue regions

from pypm_jax.rules import _kernels as K  # noqa: E402
from pypm_jax.rules._gemm_regions import GemmRegionPlan  # noqa: E402
from pypm_jax.rules._region import step  # noqa: E402

# tanh(acc * row + col) * full + scalar over a [2, 8, 24] result of x [2, 8, 16] @ w
REGION = (
    step("mul", (("acc",), ("in", 0))),
    step("add", (("step", 0), ("in", 1))),
    step("tanh", (("step", 1),)),
    step("mul", (("step", 2), ("in", 2))),
    step("add", (("step", 3), ("in", 3))),
)
KINDS = ("row", "col", "full", "scalar")


def _region_plan(**kw: object) -> GemmRegionPlan:
    base = dict(transpose_w=False, k=16, n=24, dtype="float32", out_shape=(2, 8, 24),
                out_dtype="float32", operands=KINDS, xla_fuses=False)  # fmt: skip
    return GemmRegionPlan(**{**base, **kw})


def _region_args(seed: int = 0, experts: int = 0) -> tuple:
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(size=shape).astype(np.float32)

    lead = (experts,) if experts else ()
    ops = (
        normal(*lead, 2, 8, 1),  # a row
        normal(24),  # a column (rank 1: aligned from the right)
        normal(*lead, 2, 8, 24),  # a full tile
        normal(1, 1, 1),  # a scalar
    )
    return normal(2, 8, 16), normal(*lead, 16, 24) / 4, ops


def test_a_region_splits_rows_columns_and_each_operand_along_its_dims():
    plan = _region_plan()
    x, w, ops = _region_args()
    spec = K.gemm_region_partitioning(
        x.shape, w.shape, *(o.shape for o in ops), region=REGION, plan=plan
    )
    assert spec.output == ("m0", "m1", "n")
    assert spec.inputs == (
        ("m0", "m1", "k"),
        ("k", "n"),
        ("m0", "m1", None),  # a row: by the rows, whole along the columns
        ("n",),  # a column: by the columns
        ("m0", "m1", "n"),  # a full tile: by both
        (None, None, None),  # a scalar: whole
    )
    site = pt._site(spec, [x.shape, w.shape, *(o.shape for o in ops)], (2, 8, 24))
    assert site.summed == frozenset({"k"})  # a split contraction sums before the region
    stored_nk = K.gemm_region_partitioning(
        x.shape, (24, 16), (), region=REGION, plan=_region_plan(transpose_w=True, operands=())
    )
    assert stored_nk.inputs == (("m0", "m1", "k"), ("n", "k"), ())  # no pack: the literal 0


def _split_k(spec: Partitioning, x, w, *rest):  # noqa: ANN001, ANN202
    """``finish`` of the accumulators of the contraction's two halves, summed (what two
    devices holding half of K each compute, with XLA's all-reduce between)."""
    import jax

    halves = [
        spec.partial(x[..., :8], w[..., :8, :] if w.ndim == 3 else w[:8], *rest),
        spec.partial(x[..., 8:], w[..., 8:, :] if w.ndim == 3 else w[8:], *rest),
    ]
    acc = jax.tree.map(lambda a, b: a + b, *halves)
    return spec.finish(acc, x, w, *rest)


def test_a_region_with_a_split_contraction_equals_the_kernel_call():
    plan = _region_plan()
    x, w, ops = _region_args()
    spec = K.gemm_region_partitioning(
        x.shape, w.shape, *(o.shape for o in ops), region=REGION, plan=plan
    )
    want = K.gemm_region_impl(x, w, ops, region=REGION, plan=plan)
    np.testing.assert_allclose(_split_k(spec, x, w, *ops), want, rtol=1e-5, atol=1e-6)


def test_experts_split_the_expert_axis_and_columns():
    e = 3
    kinds = ("ecol", "full")
    region = (step("add", (("acc",), ("in", 0))), step("mul", (("step", 0), ("in", 1))))
    plan = _region_plan(out_shape=(e, 2, 8, 24), operands=kinds, experts=e)
    x, w, (_, _, full, _) = _region_args(experts=e)
    ecol = np.random.default_rng(0).normal(size=(e, 1, 1, 24)).astype(np.float32)
    ops = (ecol, full)
    spec = K.gemm_region_partitioning(
        x.shape, w.shape, *(o.shape for o in ops), region=region, plan=plan
    )
    assert spec.output == ("e", "m0", "m1", "n")
    assert spec.inputs == (
        ("m0", "m1", "k"),  # every expert reads all of x
        ("e", "k", "n"),
        ("e", None, None, "n"),  # a bias per expert
        ("e", "m0", "m1", "n"),
    )
    want = K.gemm_region_impl(x, w, ops, region=region, plan=plan)
    np.testing.assert_allclose(_split_k(spec, x, w, *ops), want, rtol=1e-5, atol=1e-6)


def test_a_gated_pair_splits_both_weights_columns_alike():
    import jax

    region = (  # silu(acc) * pair + col
        step("logistic", (("acc",),)),
        step("mul", (("acc",), ("step", 0))),
        step("mul", (("step", 1), ("in", 1))),
        step("add", (("step", 2), ("in", 0))),
    )
    plan = _region_plan(operands=("col", "pair"), pair_at=1, transpose_w2=True)
    x, w, (_, col, _, _) = _region_args()
    w2t = _region_args(seed=9)[1].T  # stored [N, K]
    spec = K.gemm_pair_region_partitioning(
        x.shape, w.shape, w2t.shape, col.shape, region=region, plan=plan
    )
    assert spec.inputs == (("m0", "m1", "k"), ("k", "n"), ("n", "k"), ("n",))
    assert spec.output == ("m0", "m1", "n")
    want = K.gemm_pair_region_impl(x, w, w2t, (col,), region=region, plan=plan)
    halves = [
        spec.partial(x[..., :8], w[:8], w2t[:, :8], col),
        spec.partial(x[..., 8:], w[8:], w2t[:, 8:], col),
    ]
    acc = jax.tree.map(lambda a, b: a + b, *halves)
    np.testing.assert_allclose(spec.finish(acc, x, w, w2t, col), want, rtol=1e-5, atol=1e-6)


def test_attention_sinks_split_with_the_query_heads():
    from pypm_jax.rules._plans import AttentionPlan

    ident = (0, 1, 2, 3)
    plan = AttentionPlan(layout="BHSD", q_operand=0, perm_q=ident, perm_k=ident,
                         perm_v=ident, perm_scores=ident, perm_out=ident, scale_input=0,
                         bias=1, mask=False, kernel_shapes=(), dtype="float32",
                         out_shape=(2, 4, 8, 32), out_dtype="float32", sinks=True)  # fmt: skip
    qkv = (2, 4, 8, 32)
    spec = K.flash_attention_sinks_partitioning(
        qkv, qkv, qkv, (1, 1, 8, 8), (), (), (4,), plan=plan
    )
    assert spec.inputs[-1] == (("g", "r"),)  # one logit per query head
    assert spec.inputs[0] == ("b", ("g", "r"), "s", None) and spec.offset == "s"
    site = pt._site(spec, [qkv, qkv, qkv, (1, 1, 8, 8), (), (), (4,)], qkv)
    assert site.dims[-1] == (("g", "r"),)
