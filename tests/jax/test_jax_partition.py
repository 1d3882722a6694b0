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
