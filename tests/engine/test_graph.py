"""The Graph: building, hash-consing, def-use, replacement with merging, DCE, printing, and
the API the rewrite driver uses (undoable changes, liveness, ids)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pypm_jax.core.dtypes import as_dtype
from pypm_jax.core.errors import PyPMError, SourceLoc
from pypm_jax.core.graph import Graph, Node, Value, show_type
from pypm_jax.core.terms import CONST, LEAF, Operator, Shape, const, leaf
from pypm_testing.engine import F1, F2, F32, G2, SPLIT, A, B

RNG = Operator("rng", 1, pure=False)


def test_from_terms_shares_structure_and_round_trips():
    t = G2(F1(A), F1(A))
    s0, s1 = SPLIT(B)
    g = Graph([t, G2(s0, s1), s1])
    assert [v.name for v in g.inputs] == ["a", "b"]
    assert len(g) == 4  # F1(a) once, G2, split (one node, two outputs), G2
    (out0, out1, out2) = g.outputs
    assert out0.inputs[0] is out0.inputs[1]
    assert out1.inputs[0].node is out1.inputs[1].node is out2.node
    assert g.to_terms() == [t, G2(s0, s1), s1]


def test_values_implement_the_term_interface():
    g = Graph([F1(A)])
    (v,) = g.outputs
    assert v.op is F1 and v.index == 0 and v.attrs == {}
    assert v.inputs == (g.inputs[0],) and isinstance(v.inputs, tuple)
    assert v.shape == (2, 3) and v.dtype is F32  # inferred by F1
    assert v.node.outputs == (v,) and isinstance(v.node, Node)
    assert g.inputs[0].op is LEAF and g.inputs[0].attrs["name"] == "a"


def test_add_node_hash_conses_pure_nodes_only():
    g = Graph()
    x = g.add_input("x", (4,), "f32")
    n1 = g.add_node(F1, [x])
    assert g.add_node(F1, [x]) is n1
    assert g.add_node(F1, [x], attrs={"k": 1}) is not n1
    assert g.add_node(F1, [x], out_types=[((5,), "f32")]) is not n1
    r1, r2 = g.add_node(RNG, [x]), g.add_node(RNG, [x])
    assert r1 is not r2
    assert g.add_const(2.0) is g.add_const(2.0)
    assert g.add_const(2.0).op is CONST and g.add_const(2.0).shape == ()
    assert len(g) == 6


def test_out_types_infer_or_unknown():
    g = Graph()
    x = g.add_input("x", (4, 2), "f32")
    assert (g.add_node(F1, [x]).outputs[0].shape) == (4, 2)  # op.infer
    unknown = Operator("u", 1)
    v = g.add_node(unknown, [x]).outputs[0]
    assert v.shape is None and v.dtype is None
    v = g.add_node(unknown, [x], out_types=[((3,), "i8")]).outputs[0]
    assert v.shape == (3,) and v.dtype.name == "i8"


def test_invalid_construction_is_reported():
    g = Graph()
    x = g.add_input("x")
    with pytest.raises(PyPMError):
        g.add_node(G2, [x])  # arity
    with pytest.raises(PyPMError):
        g.add_node(F1, [Graph().add_input("y")])  # a value of another graph
    with pytest.raises(PyPMError):
        g.add_input("x")
    with pytest.raises(PyPMError):
        g.add_node(SPLIT, [x], out_types=[(None, None)])


def test_users_and_replace_all_uses_merge_duplicates():
    g = Graph()
    x = g.add_input("x", (2,), "f32")
    a = g.add_node(F1, [x]).outputs[0]
    b = g.add_node(F2, [x]).outputs[0]
    ua = g.add_node(G2, [a, x]).outputs[0]
    ub = g.add_node(G2, [b, x]).outputs[0]
    top = g.add_node(G2, [ua, ub]).outputs[0]
    g.set_outputs([top])
    assert g.users(x) == [a.node, b.node, ua.node, ub.node]
    touched = g.replace_all_uses(b, a)  # ub becomes G2(a, x) == ua: merged into it
    assert not ub.node.alive and top.inputs == (ua, ua)
    assert ub.node not in touched and top.node in touched
    assert g.users(ua) == [top.node]
    assert g.dce() == 1 and not b.node.alive  # F2(x) is dead now
    assert [n.op for n in g.nodes()] == [F1, G2, G2]


def test_replace_outputs_and_dce_keeps_impure_nodes():
    g = Graph()
    x = g.add_input("x")
    a = g.add_node(F1, [x]).outputs[0]
    r = g.add_node(RNG, [x]).outputs[0]
    g.set_outputs([a])
    g.replace_all_uses(a, x)
    assert g.outputs == [x]
    assert g.dce() == 1  # F1 goes, the impure rng stays
    assert r.node.alive and g.nodes() == [r.node]


def test_topological_order_after_replacement_is_deterministic():
    def build() -> tuple[Graph, str]:
        g = Graph([G2(F1(A), F2(A))])
        out = g.outputs[0]
        late = g.add_node(F2, [g.add_node(F2, [g.inputs[0]]).outputs[0]]).outputs[0]
        g.replace_all_uses(out.inputs[0], late)  # the user now reads nodes made after it
        return g, str(g)

    g, text = build()
    order = g.nodes()
    pos = {n.id: i for i, n in enumerate(order)}
    for n in order:
        for v in n.inputs:
            if v.node.op is not LEAF:
                assert pos[v.node.id] < pos[n.id]
    assert build()[1] == text


def test_printing():
    g = Graph()
    x = g.add_input("x", (2, 3), "f32")
    c = g.add_const(0.5)
    m = g.add_node(G2, [x, c], loc=SourceLoc("model.py", 7, "y = x * 0.5"))
    s0, s1 = g.add_node(SPLIT, [m.outputs[0]]).outputs
    g.set_outputs([s1])
    assert str(g) == (
        "graph(x: f32[2,3]) {\n"
        "  %1 = const 0.5 : ?[]\n"
        "  %2 = g2(x, %1) : f32[2,3]  @ model.py:7\n"
        "  %3#0, %3#1 = split(%2) : f32[2,3], f32[2,3]\n"
        "  return %3#1\n"
        "}"
    )
    assert repr(s0) == "%3#0" and isinstance(s0, Value)


@pytest.mark.slow
def test_deep_graphs_need_no_recursion():
    t = A
    for _ in range(50_000):
        t = F1(t)
    g = Graph([t])
    assert len(g) == 50_000
    assert g.to_terms() == [t]
    g.replace_all_uses(g.outputs[0], g.inputs[0])
    assert g.dce() == 50_000 and len(g) == 0


def test_leaves_with_the_same_name_and_different_types_stay_apart():
    t = G2(leaf("p", shape=(2,)), leaf("p", shape=(3,)))
    g = Graph([t])
    assert len(g.inputs) == 2
    assert g.to_terms()[0].inputs[0] is leaf("p", shape=(2,))


def test_multi_output_types_and_impure_terms():
    s0, s1 = SPLIT(A)
    g = Graph([s1])
    node = g.outputs[0].node
    assert len(node.outputs) == 2 and node.outputs[0].shape == (2, 3)
    r1, r2 = RNG(A), RNG(A)
    g2 = Graph([G2(r1, r2)])
    assert len(g2) == 3  # two rng nodes, never merged
    assert g2.to_terms()[0].inputs[0] is not g2.to_terms()[0].inputs[1]
    assert const(2) is not None


def test_replace_all_uses_can_keep_readers():
    g = Graph([G2(A, B)])
    (old,) = g.outputs
    wrapped = g.add_node(F1, [old]).outputs[0]  # computed from old
    g.replace_all_uses(old, wrapped)  # the node of `new` keeps reading old: no cycle
    assert wrapped.inputs == (old,) and g.outputs == [wrapped]
    other = g.add_node(F2, [old]).outputs[0]
    top = g.add_node(F2, [other]).outputs[0]
    g.set_outputs([wrapped, top])
    g.replace_all_uses(old, top, keep=[other.node])
    assert other.inputs == (old,) and wrapped.inputs == (top,)
    assert [n.op for n in g.nodes()] == [G2, F2, F2, F1]


def test_big_attributes_print_short_and_clashing_leaf_names_get_unique_inputs():
    import numpy as np

    g = Graph()
    x = g.add_input("x", (1000,), "f32")
    c = g.add_const(np.arange(1000.0))
    g.set_outputs([g.add_node(G2, [x, c]).outputs[0]])
    assert max(len(line) for line in str(g).splitlines()) < 120
    t = G2(G2(leaf("p", shape=(2,)), leaf("p", shape=(3,))), leaf("p_1"))
    names = [v.name for v in Graph([t]).inputs]
    assert len(set(names)) == 3


def test_compact_renews_input_tuples_and_changes_nothing_visible():
    s0, s1 = SPLIT(B)
    g = Graph()
    a = g.add_input("a", (2, 3), F32)
    b = g.add_input("b", (2, 3), F32)
    f = g.add_node(F1, [a]).outputs[0]
    split = g.add_node(SPLIT, [b])
    g.set_outputs([g.add_node(G2, [f, split.outputs[1]]).outputs[0], split.outputs[0]])
    before = {v: v.inputs for v in g.values()}
    text, terms = str(g), g.to_terms()
    g.compact()
    for v, ins in before.items():
        assert v.inputs == ins and type(v.inputs) is tuple
        assert v.inputs is not ins  # a new tuple, laid out with the others
    assert split.outputs[0].inputs is split.outputs[1].inputs  # outputs share it still
    assert str(g) == text and g.to_terms() == terms
    g2 = g.add_node(G2, [f, split.outputs[1]])  # hash-consing still finds the node
    assert g2 is g.outputs[0].node
    assert Graph([G2(s0, s1)]).to_terms() == [G2(s0, s1)]  # Graph(terms) compacts too


# ------------------------------------------------------------- the rewrite driver's API


def _snapshot(g: Graph):
    """Everything a reader of the graph can see, by identity where it matters."""
    values = [v for n in g.nodes() for v in n.outputs] + g.inputs
    return (
        str(g),
        [(n, n.op, tuple(n.inputs), n.alive, n.outputs[0].inputs) for n in g.nodes()],
        [(v, g.users(v)) for v in values],
        g.outputs,
        g.inputs,
        len(g),
        g.next_id,
    )


def _diamond() -> tuple[Graph, Value, Value, Value]:
    g = Graph()
    x = g.add_input("x", (2,), "f32")
    a = g.add_node(F1, [x]).outputs[0]
    b = g.add_node(F2, [x]).outputs[0]
    top = g.add_node(G2, [a, b]).outputs[0]
    g.set_outputs([top])
    return g, x, a, top


def test_rollback_undoes_every_kind_of_change_exactly():
    g, x, a, top = _diamond()
    before = _snapshot(g)
    nodes = g.nodes()
    g.begin()
    assert g.recording
    y = g.add_input("y", (2,), "f32")
    fresh = g.add_node(F2, [y]).outputs[0]
    g.replace_all_uses(a, fresh)  # top reads fresh
    g.set_input(top.node, 1, x)
    assert g.remove_dead([a.node]) == [a.node]
    g.set_outputs([top, fresh])
    g.add_node(F1, [fresh])
    assert g.dce() == 2  # F2(x), now unread, and F1(fresh)
    g.nodes()  # (re-sorted: fresh is newer than top)
    g.rollback()
    assert not g.recording
    assert _snapshot(g) == before
    assert all(n.alive for n in nodes) and not fresh.node.alive
    assert g.add_node(F1, [x]) is a.node  # hash-consing finds the old nodes again
    assert g.add_node(G2, [a, g.add_node(F2, [x]).outputs[0]]) is top.node
    assert g.next_id == before[-1]
    with pytest.raises(PyPMError, match="live value"):
        g.add_node(F1, [y])  # an input made after begin is gone


def test_commit_keeps_the_changes_and_recording_is_one_at_a_time():
    g, x, a, top = _diamond()
    with pytest.raises(PyPMError, match="nothing to roll back"):
        g.rollback()
    with pytest.raises(PyPMError, match="nothing to commit"):
        g.commit()
    g.begin()
    with pytest.raises(PyPMError, match="already being recorded"):
        g.begin()
    g.replace_all_uses(a, x)
    g.commit()
    assert not g.recording and top.inputs[0] is x
    assert g.remove_dead([a.node]) == [a.node]


def test_set_input_keeps_the_order_of_the_inputs_readers_it_leaves_alone():
    g = Graph()
    x = g.add_input("x", (2,), "f32")
    y = g.add_input("y", (2,), "f32")
    first = g.add_node(G2, [x, y])
    second = g.add_node(G2, [y, x])
    g.set_input(first, 1, x)  # y -> x
    assert g.users(x) == [first, second]  # first still reads x first
    assert g.users(y) == [second]


def test_reading_liveness_and_membership():
    g, x, a, top = _diamond()
    other = Graph().add_input("x", (2,), "f32")
    assert x in g and a in g and a.node in g and top.node in g
    assert other not in g and other.node not in g and "x" not in g and None not in g
    assert g.is_read(a) and g.is_read(top) and not g.is_output(a) and g.is_output(top)
    g.replace_all_uses(a, x)
    assert not g.is_read(a) and a in g  # unread, not yet removed
    g.remove_dead([a.node])
    assert a not in g and a.node not in g and not a.node.alive
    g.set_outputs([x])
    assert g.is_output(x) and not g.is_output(top) and g.is_read(x)


def test_next_id_and_id_order():
    g, x, a, top = _diamond()
    assert g.id_ordered and g.next_id == top.node.id + 1
    mark = g.next_id
    late = g.add_node(F1, [a])
    assert late.id == mark and g.next_id == mark + 1 and g.id_ordered
    g.replace_all_uses(a, late.outputs[0], keep=[late])  # top reads a newer node now
    assert not g.id_ordered
    assert g.nodes().index(late) < g.nodes().index(top.node)


def test_metadata_reads_meta_without_making_it():
    g, x, a, top = _diamond()
    assert a.node.metadata == {} and a.node._meta is None
    with pytest.raises(TypeError):
        a.node.metadata["k"] = 1  # type: ignore[index]
    top.node.meta["module_path"] = "block_0"
    assert top.node.metadata["module_path"] == "block_0"
    copy = g.add_node(F1, [top], meta=top.node.metadata)
    assert copy.meta == {"module_path": "block_0"} and copy.meta is not top.node.meta


def test_a_location_given_as_a_function_is_found_once_when_first_read():
    g = Graph()
    x = g.add_input("x", (4,), "f32")
    here = SourceLoc("model.py", 3, "y = f(x)")
    calls = []

    def find():
        calls.append(1)
        return here

    node = g.add_node(F1, [x], loc=find)
    assert calls == []  # (a lifter locates no equation nobody asks about)
    assert node.loc is here and node.outputs[0].loc is here and node.loc is here
    assert calls == [1]
    assert g.add_node(G2, [x, x], loc=lambda: None).loc is None
    assert g.add_node(G2, [x, node.outputs[0]], loc=here).loc is here
    assert "@ model.py:3" in str(g)


def test_attribute_keys_are_freezes():
    """Hash-consing keys attributes by ``terms.freeze``; the graph's fast path for the values
    a lifted model's params hold gives the same keys."""
    import numpy as np

    from pypm_jax.core import graph
    from pypm_jax.core.terms import freeze

    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

    odd = Unhashable()
    values = [
        None, True, 3, 2.5, "s", (1, (2, 3), ()), ((1,), ((), ())), as_dtype("f32"),
        np.dtype("float32"), np.float32(1.5), np.arange(3), [1, [2]], {"a": (1, 2)},
        frozenset({1, 2}), odd, (odd, 1), Shape((2, 3)), F1,
    ]  # fmt: skip
    for v in values:
        assert graph._freeze_value(v) == freeze(v), v
    attrs = {"b": (1, 2), "a": None, "c": np.dtype("int8")}
    assert graph._freeze_attrs(attrs) == freeze(attrs)
    # a list or tuple of ints, strings, bools and None is frozen in one go: still as many
    # keys as values that differ in a type or a value, a list and a tuple alike
    differ = [(1, 2), (1.0, 2), (True, 2), (1, "2"), (None, 2), (1, 2, 3), ((1,), 2), (-0.0, 2),
              (0.0, 2), (), ((),), (None,), ("scalars", (int,), (1,))]  # fmt: skip
    keys = [freeze(v) for v in differ]
    assert len(set(keys)) == len(differ)
    assert [graph._freeze_value(v) for v in differ] == keys
    assert freeze([1, 2]) == freeze((1, 2)) == freeze(Shape((1, 2)))


def test_zeros_of_either_sign_are_not_one_constant():
    g = Graph()
    x = g.add_input("x", (4,), "f32")
    assert g.add_const(-0.0) is not g.add_const(0.0)
    assert g.add_const(-0.0) is g.add_const(-0.0) and g.add_const(0.0) is g.add_const(0.0)
    assert g.add_const(complex(1, -0.0)) is not g.add_const(complex(1, 0.0))
    assert g.add_node(G2, [x, g.add_const(-0.0)]) is not g.add_node(G2, [x, g.add_const(0.0)])
    assert g.add_const(2.0) is g.add_const(2.0) and g.add_const(2.0) is not g.add_const(2)
    assert g.add_node(F1, [x], attrs={"k": (0.0,)}) is not g.add_node(F1, [x], attrs={"k": (-0.0,)})
    assert const(-0.0) is not const(0.0) and const(-0.0) is const(-0.0)  # (terms: freeze)


def test_show_type():
    assert show_type(Shape((2, 3)), as_dtype("f32")) == "f32[2,3]"
    assert show_type(None, None) == "?[?]" and show_type(Shape(()), None) == "?[]"


def test_rollback_of_additions_only():
    g, x, a, top = _diamond()
    before = _snapshot(g)
    g.begin()
    g.add_node(F1, [top])
    g.add_const(3.0)
    g.rollback()
    assert _snapshot(g) == before
    assert g.add_const(3.0).node.id == before[-1]  # made anew, with the first free id


# ------------------------------------------------ undo, exactly, under random changes


def _raw(g: Graph):
    """:func:`_snapshot`, plus each value's raw reader record (list order with repeats, or
    the dict of counts in its order)."""
    values = [v for n in g.nodes() for v in n.outputs] + g.inputs
    readers = [
        (
            v,
            type(v.readers),
            list(v.readers.items()) if type(v.readers) is dict else list(v.readers),
        )
        for v in values
    ]
    return _snapshot(g), readers


def _found_by_hash_consing(g: Graph) -> list[tuple[Node, Node]]:
    """(node, what add_node returns for an equal node) for each live pure node."""
    pairs = []
    for n in g.nodes():
        if n.op.pure and n.op is not LEAF:
            types = [(v.shape, v.dtype) for v in n.outputs]
            pairs.append((n, g.add_node(n.op, list(n.inputs), n.attrs, types)))
    return pairs


def _descendants(g: Graph, node: Node) -> set[int]:
    seen, stack = {node.id}, [node]
    while stack:
        for v in stack.pop().outputs:
            for u in g.users(v):
                if u.id not in seen:
                    seen.add(u.id)
                    stack.append(u)
    return seen


def _random_change(g: Graph, rnd: random.Random, k: int) -> None:
    """One change of any kind the graph offers, on live values, never making a cycle."""
    nodes = g.nodes()
    values = g.inputs + [v for n in nodes for v in n.outputs]
    kind = rnd.choice(["add", "add", "replace", "replace", "swap", "set", "dead", "outs", "input"])
    if kind == "add":
        op = rnd.choice([F1, F2, G2, RNG])
        g.add_node(op, [rnd.choice(values) for _ in range(op.n_in)])
    elif kind == "replace" and nodes:
        old = rnd.choice([v for n in nodes for v in n.outputs])
        below = _descendants(g, old.node)
        g.replace_all_uses(old, rnd.choice([v for v in values if v.node.id not in below]))
    elif kind == "swap" and nodes:  # (the rewrite driver's step)
        old = rnd.choice([v for n in nodes for v in n.outputs])
        below = _descendants(g, old.node)
        g.swap(old, rnd.choice([v for v in values if v.node.id not in below]), ())
    elif kind == "set" and any(n.inputs for n in nodes):
        node = rnd.choice([n for n in nodes if n.inputs])
        below = _descendants(g, node)
        new = rnd.choice([v for v in values if v.node.id not in below])
        g.set_input(node, rnd.randrange(len(node.inputs)), new)
    elif kind == "dead" and nodes:
        g.remove_dead([rnd.choice(nodes)])
    elif kind == "outs":
        g.set_outputs([rnd.choice(values) for _ in range(rnd.randint(1, 3))])
    elif kind == "input":
        g.add_input(f"in{k}", (2, 3), "f32")


def _wide_graph() -> Graph:
    """A small graph with a value read by more nodes than a reader list holds (a dict of
    readers), nodes that would be equal if their inputs were, a value read twice by one
    node, and an impure node."""
    g = Graph()
    x = g.add_input("x", (2, 3), "f32")
    c = g.add_const(1.0, (2, 3), "f32")
    a = g.add_node(F1, [x]).outputs[0]
    b = g.add_node(F2, [x]).outputs[0]
    outs = [g.add_node(G2, [a, c]).outputs[0], g.add_node(G2, [b, c]).outputs[0]]
    for _ in range(20):  # c read by 22 distinct G2 nodes
        outs.append(g.add_node(G2, [outs[-1], c]).outputs[0])
    sq = g.add_node(G2, [outs[3], outs[3]]).outputs[0]
    rng = g.add_node(RNG, [sq]).outputs[0]
    g.set_outputs([outs[-1], rng, g.add_node(F1, [b]).outputs[0]])
    return g


@settings(max_examples=80)
@given(st.integers(0, 2**32), st.integers(1, 16))
def test_rollback_restores_reader_records_and_hash_consing_exactly(seed, n):
    g = _wide_graph()
    before = _raw(g)
    found = _found_by_hash_consing(g)
    assert all(a is b for a, b in found)
    rnd = random.Random(seed)
    g.begin()
    for k in range(n):
        _random_change(g, rnd, k)
    g.rollback()
    assert _raw(g) == before
    assert _found_by_hash_consing(g) == found


@settings(max_examples=40)
@given(st.integers(0, 2**32), st.integers(1, 16))
def test_recording_changes_nothing_the_changes_do(seed, n):
    """The same changes, recorded and committed or made plainly, give the same graph, and
    hash-consing finds the same nodes in it."""
    seen = []
    for record in (False, True):
        g = _wide_graph()
        rnd = random.Random(seed)
        if record:
            g.begin()
        for k in range(n):
            _random_change(g, rnd, k)
        if record:
            g.commit()
        found = [(a.id, b.id) for a, b in _found_by_hash_consing(g)]
        seen.append((str(g), [(n.id, [v.name for v in n.inputs]) for n in g.nodes()], found))
    assert seen[0] == seen[1]


def test_hash_consing_forgets_removed_and_changed_nodes():
    g = Graph()
    x = g.add_input("x", (2, 3), "f32")
    y = g.add_input("y", (2, 3), "f32")
    a = g.add_node(F1, [x])
    b = g.add_node(G2, [a.outputs[0], x])
    g.set_outputs([b.outputs[0]])
    g.set_input(b, 1, y)  # b = g2(a, y) now: g2(a, x) is another node
    b2 = g.add_node(G2, [a.outputs[0], x])
    assert b2 is not b and b2.alive
    assert g.add_node(G2, [a.outputs[0], y]) is b  # found under its new inputs
    g.set_outputs([a.outputs[0]])
    assert g.remove_dead([b, b2]) == [b, b2] and not b.alive
    a2 = g.add_node(G2, [a.outputs[0], y])
    assert a2 is not b and a2.alive and a2.inputs == [a.outputs[0], y]


def test_stale_hash_consing_entries_are_dropped_and_live_nodes_still_found():
    g = Graph()
    x = g.add_input("x", (2, 3), "f32")
    y = g.add_input("y", (2, 3), "f32")
    nodes = [g.add_node(G2, [x, g.add_const(float(i), (2, 3), "f32")]) for i in range(3000)]
    g.set_outputs([n.outputs[0] for n in nodes])
    for n in nodes:  # each change leaves the node's old entry stale
        g.set_input(n, 0, y)
    g.set_outputs([n.outputs[0] for n in nodes[::2]])
    g.remove_dead(nodes[1::2])  # and so does each removal (of a node and its constant)
    assert len(g._cse) < 2 * len(g)  # purged: about one entry per live node
    for n in nodes[::2]:
        assert g.add_node(G2, [y, n.inputs[1]]) is n
        assert g.add_node(G2, [x, n.inputs[1]]) is not n


def _by_id(g: Graph) -> tuple:
    """What a reader of ``g`` sees, by ids and names: for comparing two graphs built alike
    (the nodes in order with their inputs, every value's raw reader record, the outputs,
    and what hash-consing finds)."""
    nodes = [(n.id, n.op.name, [v.name for v in n.inputs], n.alive) for n in g.nodes()]
    readers = []
    for v in g.inputs + g.values():
        users = v.readers
        if type(users) is dict:
            readers.append((v.name, [(u.id, count) for u, count in users.items()]))
        else:
            readers.append((v.name, [u.id for u in users]))
    found = [(a.id, b.id) for a, b in _found_by_hash_consing(g)]
    return str(g), nodes, readers, [v.name for v in g.outputs], g.next_id, found


@settings(max_examples=80)
@given(st.integers(0, 2**32), st.integers(0, 8), st.booleans(), st.booleans())
def test_swap_is_replace_all_uses_then_remove_dead(seed, n, wrap, record):
    """``Graph.swap`` (the rewrite driver's step) changes a graph exactly as
    ``replace_all_uses`` and then ``remove_dead`` of the old value's node do, and returns
    None, changing nothing, exactly when nothing but the kept readers reads the old value
    and it is no output."""
    seen = []
    for swap in (False, True):
        g = _wide_graph()
        rnd = random.Random(seed)
        for k in range(n):
            _random_change(g, rnd, k)
        if record:
            g.begin()
        nodes = g.nodes()
        old = rnd.choice([v for n in nodes for v in n.outputs])
        if wrap:  # x -> f(x): the result reads the value it replaces, and keeps reading it
            new = g.add_node(F1, [old]).outputs[0]
        else:
            below = _descendants(g, old.node)
            new = rnd.choice([v for v in g.inputs + g.values() if v.node.id not in below])
        keep = [new.node]
        if swap:
            result = g.swap(old, new, keep)
            out = None if result is None else [[n.id for n in ns] for ns in result]
        elif g.is_output(old) or any(u not in keep for u in g.users(old)):
            touched = g.replace_all_uses(old, new, keep=keep)
            out = [[n.id for n in touched], [n.id for n in g.remove_dead([old.node])]]
        else:
            out = None  # (nothing to replace: the graph stays as it is)
        if record:
            g.commit()
        _check_readers(g)
        seen.append((out, _by_id(g)))
    assert seen[0] == seen[1]


def _check_readers(g: Graph) -> None:
    """Each value's reader record holds exactly the live nodes that read it, each as often
    as it reads it."""
    reads: dict[int, Counter] = {id(v): Counter() for v in g.inputs + g.values()}
    for n in g.nodes():
        for v in n.inputs:
            reads[id(v)][n.id] += 1
    for v in g.inputs + g.values():
        users = v.readers
        pairs = users.items() if type(users) is dict else Counter(users).items()
        assert Counter({u.id: c for u, c in pairs}) == reads[id(v)], v.name


@settings(max_examples=80)
@given(st.integers(0, 2**32), st.integers(1, 24))
def test_reader_records_follow_every_change(seed, n):
    g = _wide_graph()
    rnd = random.Random(seed)
    for k in range(n):
        _random_change(g, rnd, k)
        _check_readers(g)


def _below(v: Value, seen: dict[int, tuple]) -> tuple:
    """What ``v`` is computed from and how many nodes read each value below it, as a nested
    tuple (a fact ``Graph.memo`` may keep)."""
    known = seen.get(id(v))
    if known is None:
        readers = len(v.node.graph.users(v))
        below = tuple(_below(i, seen) for i in v.inputs)
        known = seen[id(v)] = (v.op.name, v.index, readers, below)
    return known


@settings(max_examples=80)
@given(st.integers(0, 2**32), st.integers(1, 12), st.booleans())
def test_a_memo_holds_only_facts_still_true(seed, n, record):
    """Facts kept in ``Graph.memo`` about what values are computed from (and who reads the
    values below them) stay true through every kind of change (and a rollback): the memo is
    emptied when they could change."""
    g = _wide_graph()
    rnd = random.Random(seed)
    if record:
        g.begin()
    for k in range(n):
        memo = g.memo("below")
        for node in g.nodes():
            for v in node.outputs:
                _below(v, memo)
        _random_change(g, rnd, k)
        if record and rnd.random() < 0.2:
            g.rollback()
            g.begin()
        live = {id(v): v for node in g.nodes() for v in node.outputs} | {id(v): v for v in g.inputs}
        for key, fact in g.memo("below").items():
            assert key in live and _below(live[key], {}) == fact
    if record:
        g.commit()


def test_a_memo_is_kept_while_nothing_below_a_value_changes():
    g, x, a, top = _diamond()
    memo = g.memo("below")
    memo[id(top)] = "fact"
    assert g.memo("below") is memo and g.memo("other") is not memo
    g.add_const(1.0)  # a node that reads nothing changes nothing below any value
    g.set_outputs([top, a])
    assert g.memo("below") is memo
    g.add_node(F1, [top])  # top gains a reader (a fact may read who reads a value)
    assert g.memo("below") == {}
    g.memo("below")[id(top)] = "fact"
    g.set_input(top.node, 1, x)  # top's inputs change
    assert g.memo("below") == {}
    g.memo("below")[id(top)] = "fact"
    g.remove_dead([g.add_node(F2, [top])])  # a removed node's id may be reused
    assert g.memo("below") == {}
    g.begin()
    g.memo("below")[id(top)] = "fact"
    g.add_node(F2, [top])
    g.rollback()
    assert g.memo("below") == {}
