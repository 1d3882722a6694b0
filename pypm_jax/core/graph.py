"""Computation graphs: the one mutable program representation every frontend lifts into.

A :class:`Graph` holds :class:`Node` s (an operator applied to input values, with attributes,
a source location and free-form metadata) and their output :class:`Value` s. A value offers
the read-only *term interface* the matchers use (``op``, ``inputs``, ``index``, ``attrs``,
``shape``, ``dtype``), so patterns match graph values exactly as they match hash-consed
terms:

* pure nodes are hash-consed — adding an operator that is already applied to the same inputs
  with the same attributes and types returns the existing node — so "the same value" is
  object identity, as for terms, and nonlinear patterns mean what they mean on terms;
* :meth:`Graph.replace_all_uses` keeps that invariant: a user that becomes equal to another
  node is merged into it (and so on upwards), never left as a duplicate;
* nodes of an impure operator (``op.pure == False``) are never merged, and never removed as
  dead code (they may have effects).

Ids are per-graph counters and every order here is derived from creation order and input
order, never from hashing, so building the same program twice gives the same graph.
"""

from __future__ import annotations

__all__ = ["Graph", "NO_ATTRS", "Node", "Value", "node_type", "show_type"]

import itertools
from collections.abc import Callable, Container, Hashable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

from .dtypes import DType, as_dtype
from .errors import PyPMError, SourceLoc
from .terms import CONST, LEAF, Operator, Shape, Term, freeze, frozen_scalars, make_term

TypeSpec = tuple[Shape | None, DType | None]
# A node's source location, or a function finding it when it is first asked for (Node.loc)
Loc = SourceLoc | Callable[[], SourceLoc | None] | None


_shapes: dict[tuple, Shape] = {}  # interned: a model has few distinct shapes


def _shape(s: Any) -> Shape | None:
    if s is None or type(s) is Shape:
        return s
    try:
        key = tuple(int(d) for d in s)
    except TypeError:  # symbolic dimensions: keep them as they are
        return Shape(s)
    shape = _shapes.get(key)
    if shape is None:
        if len(_shapes) > 100_000:
            _shapes.clear()
        shape = _shapes[key] = Shape(key)
    return shape


def _type(spec: Any) -> TypeSpec:
    return node_type(*spec)


def node_type(shape: Any, dtype: Any) -> TypeSpec:
    """A ``(shape, dtype)`` in the form nodes keep it (an interned :class:`Shape`, a
    :class:`DType`): what :meth:`Graph.add_unchecked` takes, and :meth:`Graph.add_node`
    passes on as is."""
    return _shape(shape), as_dtype(dtype)


_type_lists: dict[tuple[TypeSpec, ...], tuple[TypeSpec, ...]] = {}


def _intern_types(types: Sequence[TypeSpec]) -> tuple[TypeSpec, ...]:
    """One shared tuple per distinct list of output types (they repeat all over a model)."""
    t = tuple(types)
    shared = _type_lists.get(t)
    if shared is None:
        if len(_type_lists) > 100_000:
            _type_lists.clear()
        shared = _type_lists[t] = t
    return shared


# The attributes of the many nodes that have none: one shared, read-only mapping.
NO_ATTRS: Mapping[str, Any] = MappingProxyType({})


def show_type(shape: Shape | None, dtype: DType | None) -> str:
    """A type as graphs and reports print it: ``f32[2,3]``, ``?`` for what is unknown."""
    key = (shape, dtype)
    try:
        return _type_texts[key]
    except KeyError:
        pass
    except TypeError:  # (a symbolic dimension that does not hash)
        key = None
    d = "?" if dtype is None else dtype.name
    s = "[?]" if shape is None else "[" + ",".join(str(x) for x in shape) + "]"
    text = d + s
    if key is not None:
        if len(_type_texts) > 100_000:
            _type_texts.clear()
        _type_texts[key] = text
    return text


_type_texts: dict[tuple[Any, Any], str] = {}  # (types repeat all over a model)


def _freeze_attrs(attrs: Mapping[str, Any]) -> tuple:
    """``freeze(attrs)`` (the attributes' part of a hash-consing key), with the common
    values (strings, integers, None) frozen inline."""
    if len(attrs) == 1:
        ((k, v),) = attrs.items()
        t = type(v)
        if t is str or t is int or t is bool or v is None:
            return ((k, (t.__name__, v)),)
        return ((k, _freeze_value(v)),)
    items = []
    for k, v in attrs.items():
        t = type(v)
        if t is str or t is int or t is bool or v is None:
            items.append((k, (t.__name__, v)))
        else:
            items.append((k, _freeze_value(v)))
    items.sort()
    return tuple(items)


def _freeze_value(v: Any) -> Any:
    """``freeze(v)``; tuples and the objects that are no container (dtypes, shardings, enum
    members: the params of a lifted model's equations) without its type tests."""
    t = type(v)
    if t is str or t is int or t is bool or v is None:
        return (t.__name__, v)
    if t is float or t is complex:
        return freeze(v)  # (the sign of a zero kept)
    if t is tuple:
        found = frozen_scalars(v)
        return tuple([_freeze_value(x) for x in v]) if found is None else found
    plain = _PLAIN.get(t)
    if plain is None:
        if len(_PLAIN) > 4096:
            _PLAIN.clear()
        plain = _PLAIN[t] = not issubclass(t, _CONTAINERS)
    if not plain:
        return freeze(v)
    try:
        hash(v)
    except TypeError:
        return ("id", id(v))
    return (t.__name__, v)


# what freeze looks into (anything else is itself, or its id when unhashable)
_CONTAINERS = (np.ndarray, np.generic, list, tuple, Mapping, set, frozenset)
_PLAIN: dict[type, bool] = {}  # type -> is it none of those


# A value's readers: a list (one entry per use) while there are few, a dict node -> number of
# uses once there are many (a constant read all over a model), so that forgetting a reader
# stays cheap without a dict's memory on every value.
_FEW_USERS = 16


def _use(v: Value, node: Node, journal: _Journal | None) -> None:
    """``node`` reads ``v`` once more (logged in ``journal``, if any, as undo needs: a reader
    list turned into a dict, or a dict's first change in the run, is kept whole)."""
    users = v.readers
    if type(users) is list:
        if len(users) >= _FEW_USERS:
            counts: dict[Node, int] = {}
            for n in users:
                counts[n] = counts.get(n, 0) + 1
            counts[node] = counts.get(node, 0) + 1
            v.readers = counts
            if journal is not None:
                journal.log.append((_READERS, v, users))
                journal.kept.add(v)
        else:
            users.append(node)
    else:
        if journal is not None and v not in journal.kept:
            journal.log.append((_READERS, v, users.copy()))
            journal.kept.add(v)
        users[node] = users.get(node, 0) + 1


def _unuse(v: Value, node: Node, journal: _Journal | None) -> int:
    """``node`` reads ``v`` once less; returns where it was in ``v``'s reader list (-1 for a
    dict of readers: the journal keeps the dict whole)."""
    users = v.readers
    if type(users) is list:
        i = users.index(node)
        del users[i]
        return i
    if journal is not None and v not in journal.kept:
        journal.log.append((_READERS, v, users.copy()))
        journal.kept.add(v)
    n = users[node]
    if n == 1:
        del users[node]
    else:
        users[node] = n - 1
    return -1


def _readers(v: Value) -> list[Node]:
    """Each node reading ``v`` once, in the order they started to."""
    users = v.readers
    return list(dict.fromkeys(users)) if type(users) is list else list(users)


def _new_values(
    node: Node, op: Operator, inputs: tuple[Value, ...], attrs: Mapping[str, Any], types: Any
) -> list[Value]:
    """A new node's output values, one per (shape, dtype) of ``types``."""
    outs = []
    for i, (shape, dtype) in enumerate(types):
        v = object.__new__(Value)
        v.op = op
        v.inputs = inputs
        v.index = i
        v.attrs = attrs
        v.shape = shape
        v.dtype = dtype
        v.node = node
        v.readers = []
        outs.append(v)
    return outs


def _short(value: Any, width: int = 60) -> str:
    """``repr`` for printing a graph, cut short (attributes may hold whole arrays)."""
    text = repr(value).replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


class Value:
    """One output of a node, or a graph input: what patterns are matched against.

    Identity is equality. ``inputs`` is the producing node's inputs as a tuple; ``attrs`` is
    the node's attribute dict; ``node.loc`` is where the program wrote it. Who reads it:
    :meth:`Graph.users`, :meth:`Graph.is_read`; ``readers`` is the raw collection those read
    (the live nodes reading it, a list with one entry per use or, once there are many, a
    dict node -> uses; see ``_use``): read-only outside the graph, for a caller's hot loop
    (the rewrite driver's) that iterates it without a copy.
    """

    __slots__ = ("op", "inputs", "index", "attrs", "shape", "dtype", "node", "readers")

    op: Operator
    inputs: tuple[Value, ...]
    index: int
    attrs: Mapping[str, Any]  # read-only (shared by the outputs of a node)
    shape: Shape | None
    dtype: DType | None
    node: Node

    @property
    def loc(self) -> SourceLoc | None:
        return self.node.loc

    @property
    def name(self) -> str:
        """How the value prints: an input's name, ``%<node id>`` (``#i`` for multi-output)."""
        node = self.node
        if node.op is LEAF and not node.inputs:
            return str(node.attrs.get("name"))
        return f"%{node.id}" if len(node.outputs) == 1 else f"%{node.id}#{self.index}"

    def __repr__(self) -> str:
        return self.name


class Node:
    """An operator applied to values. Change a graph only through :class:`Graph` methods.

    ``alive`` is False once the node is removed from its graph (dead code, merged into an
    equal node): a reference to it may outlive that.
    """

    __slots__ = (
        "op",
        "inputs",
        "attrs",
        "outputs",
        "_loc",
        "_meta",
        "id",
        "_graph",
        "_key",
        "alive",
    )

    op: Operator
    inputs: list[Value]
    attrs: Mapping[str, Any]  # a dict, or one shared empty mapping; never mutate
    outputs: tuple[Value, ...]
    id: int
    alive: bool  # read-only

    @property
    def loc(self) -> SourceLoc | None:
        """Where the program wrote the node. A builder may give a function finding it
        instead (a lifter: most nodes' locations are never asked for), called once, here."""
        loc = self._loc
        if loc is None or type(loc) is SourceLoc:
            return loc
        loc = self._loc = loc()
        return loc

    @loc.setter
    def loc(self, value: Loc) -> None:
        self._loc = value

    @property
    def meta(self) -> dict[str, Any]:
        """Free-form data about the node (the JAX lifter keeps the equation and the Flax
        module path here); made on first use, as most nodes of a big graph have none."""
        meta = self._meta
        if meta is None:
            meta = self._meta = {}
        return meta

    @meta.setter
    def meta(self, value: dict[str, Any]) -> None:
        self._meta = value

    @property
    def graph(self) -> Graph:
        """The graph the node was made in (it may have been removed since: ``alive``)."""
        return self._graph

    @property
    def metadata(self) -> Mapping[str, Any]:
        """``meta`` to read, without making a dict for a node that has none (a rewrite
        copies the replaced node's onto the nodes it builds, and reads its module path)."""
        meta = self._meta
        return NO_ATTRS if meta is None else meta

    def __repr__(self) -> str:
        outs = ", ".join(v.name for v in self.outputs)
        ins = ", ".join(v.name for v in self.inputs)
        return f"<Node {outs} = {self.op.name}({ins})>"


class Graph:
    """A DAG of nodes with inputs and outputs; see the module docstring.

    ``Graph([t1, t2])`` builds the graph of hash-consed terms (their leaves become inputs, in
    first-use order); ``Graph()`` starts empty for :meth:`add_input` / :meth:`add_node`.

    Changes can be made undoable: after :meth:`begin`, :meth:`rollback` restores the graph as
    it was (every node, reader, input, output and id, as far as a reader of the graph can
    tell) and :meth:`commit` keeps what changed. A rewrite that fails halfway uses it.
    """

    def __init__(self, outputs: Iterable[Any] | None = None):
        self._inputs: list[Value] = []
        self._input_names: dict[str, Value] = {}
        self._outputs: list[Value] = []  # replaced, never changed in place (see _Journal)
        self._output_ids: frozenset[int] = frozenset()  # id() of each output
        self._nodes: dict[int, Node] = {}  # live non-input nodes; topological when _topo_ok
        # Hash-consing: (signature, inputs) -> the node, where a signature (an int) stands
        # for an operator, attributes and output types (``_sigs``), so that re-keying a node
        # whose inputs changed hashes its inputs and an int, not its attributes again. An
        # entry holds only if its node is alive and still has that key (``node._key``):
        # removing a node or changing its inputs leaves its old entry stale, not deleted, and
        # ``_stale`` counts those; ``_purge`` drops them once they are many.
        self._cse: dict[tuple[int, tuple[Value, ...]], Node] = {}
        self._sigs: dict[tuple, tuple[int, tuple[TypeSpec, ...]]] = {}  # -> (it, the types)
        self._sig_ids = itertools.count()
        self._stale = 0
        self._next_id = 0
        self._topo_ok = True
        self._id_ordered = True  # node ids increase along the topological order
        self._journal: _Journal | None = None  # while changes are recorded (begin)
        self._log: list[tuple] | None = None  # the journal's log (read on every change)
        # memo(key)'s dicts; None again whenever a value's inputs change or a node goes
        self._memos: dict[Hashable, dict[int, Any]] | None = None
        if outputs is not None:
            self.set_outputs(self._from_terms(list(outputs)))
            self.compact()

    def memo(self, key: Hashable) -> dict[int, Any]:
        """A dict for a caller's facts about this graph's values that depend only on what
        each value is computed from (its operator, attributes and inputs, transitively) and
        on which nodes read the values below it, keyed by ``id(value)``: one per ``key`` (a
        kind of fact), kept while the graph does not change that, emptied when it does (a
        value's inputs change, a node reading values is added, a node is removed and its id
        may be reused, a rollback). A guard function that walks down from a term keeps what
        it learnt here across the terms a rewrite pass asks about, rather than walking
        again from each."""
        memos = self._memos
        if memos is None:
            memos = self._memos = {}
        found = memos.get(key)
        if found is None:
            found = memos[key] = {}
        return found

    # ----------------------------------------------------------------------- building

    @property
    def inputs(self) -> list[Value]:
        return list(self._inputs)

    @property
    def outputs(self) -> list[Value]:
        return list(self._outputs)

    def _new_node(
        self,
        op: Operator,
        inputs: tuple[Value, ...],
        attrs: Mapping[str, Any],
        types: Sequence[TypeSpec],
        loc: Loc,
        meta: dict[str, Any] | None,
        key: Any,
    ) -> Node:
        if inputs:
            self._memos = None  # (values gain readers)
        node = object.__new__(Node)
        node.op, node.inputs, node.attrs = op, list(inputs), attrs
        node._loc, node._meta = loc, dict(meta) if meta else None
        node.id = self._next_id
        self._next_id += 1
        node._graph, node._key, node.alive = self, key, True
        if len(types) == 1:  # (one output: no loop)
            ((shape, dtype),) = types
            v = object.__new__(Value)
            v.op, v.inputs, v.index, v.attrs = op, inputs, 0, attrs
            v.shape, v.dtype, v.node, v.readers = shape, dtype, node, []
            node.outputs = (v,)
        else:
            node.outputs = tuple(_new_values(node, op, inputs, attrs, types))
        for v in inputs:
            users = v.readers
            if type(users) is list and len(users) < _FEW_USERS:
                users.append(node)  # (_use, inline: the common case)
            else:
                _use(v, node, self._journal)
        log = self._log
        if log is not None:  # (after the reads it makes: undone before what they logged)
            log.append((_NEW, node))
        return node

    def add_input(self, name: str, shape: Any = None, dtype: Any = None) -> Value:
        """A new graph input (a leaf ``name`` of the given type)."""
        if not isinstance(name, str) or not name:
            raise TypeError("a graph input needs a non-empty name")
        if name in self._input_names:
            raise PyPMError(f"graph already has an input named {name!r}")
        node = self._new_node(
            LEAF, (), {"name": name}, [(_shape(shape), as_dtype(dtype))], None, None, None
        )
        v = node.outputs[0]
        self._inputs.append(v)
        self._input_names[name] = v
        return v

    def infer_types(
        self, op: Operator, inputs: Sequence[Value], attrs: Mapping[str, Any]
    ) -> list[TypeSpec]:
        """Output types of ``op`` on ``inputs``: ``op.infer`` if set, else unknown."""
        if op.infer is None:
            return [(None, None)] * op.n_out
        inferred = op.infer(*inputs, **attrs)
        specs = list(inferred) if op.n_out > 1 else [inferred]
        return [_type(s) for s in specs]

    def add_node(
        self,
        op: Operator,
        inputs: Sequence[Value],
        attrs: Mapping[str, Any] | None = None,
        out_types: Sequence[tuple[Any, Any]] | None = None,
        loc: Loc = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Node:
        """``op(inputs)``; for a pure ``op``, the existing equal node if there is one.

        ``out_types``: one ``(shape, dtype)`` per output (default: :meth:`infer_types`);
        ``loc``: where the program wrote it (or a function finding that, called when
        ``node.loc`` is first read); ``meta``: copied into the node's ``meta``.
        """
        if type(op) is not Operator and not isinstance(op, Operator):
            raise TypeError(f"not an operator: {op!r}")
        ins = tuple(inputs)
        for v in ins:
            if type(v) is not Value or v.node._graph is not self or not v.node.alive:
                raise PyPMError(f"{op.name}: input {v!r} is not a live value of this graph")
        attrs = dict(attrs) if attrs else NO_ATTRS
        if out_types is None:
            types = self.infer_types(op, ins, attrs)
        else:
            types = []
            for shape, dtype in out_types:
                if (shape is None or type(shape) is Shape) and (
                    dtype is None or type(dtype) is DType
                ):
                    types.append((shape, dtype))  # (as given: already normalized)
                else:
                    types.append(_type((shape, dtype)))
        if op.n_in is not None and len(ins) != op.n_in:
            raise PyPMError(f"{op.name} takes {op.n_in} inputs, got {len(ins)}")
        if len(types) != op.n_out:
            raise PyPMError(f"{op.name} has {op.n_out} outputs, got {len(types)} output types")
        return self.add_unchecked(op, ins, attrs, tuple(types), loc, meta)

    def add_unchecked(
        self,
        op: Operator,
        ins: tuple[Value, ...],
        attrs: Mapping[str, Any],
        t: tuple[TypeSpec, ...],
        loc: Loc,
        meta: Mapping[str, Any] | None,
    ) -> Node:
        """:meth:`add_node` once its arguments are checked: ``ins`` live values of this
        graph, as many as ``op`` takes; ``attrs`` a dict of the node's own or ``NO_ATTRS``;
        ``t`` one normalized type per output. The rewrite driver builds results with it."""
        key = None
        if op.pure:
            sig_key = (op, _freeze_attrs(attrs) if attrs else (), t)
            sigs = self._sigs
            found = sigs.get(sig_key)
            if found is None:
                types = _type_lists.get(t) or _intern_types(t)
                found = sigs[sig_key] = (next(self._sig_ids), types)
            sig, types = found
            key = (sig, ins)
            found = self._cse.get(key)
            if found is not None:
                if found.alive and found._key == key:
                    return found
            else:
                found = _MISSING
        else:
            types = _type_lists.get(t) or _intern_types(t)
        node = self._new_node(op, ins, attrs, types, loc, meta, key)  # (it copies meta)
        if key is not None:
            log = self._log
            if log is not None:
                log.append((_CSE, key, found))
            self._cse[key] = node
        self._nodes[node.id] = node
        return node

    def all_live(self, values: Iterable[Any]) -> bool:
        """Is every one of ``values`` a live value of this graph?"""
        for v in values:
            if type(v) is not Value or v.node._graph is not self or not v.node.alive:
                return False
        return True

    def add_const(self, value: Any, shape: Any = None, dtype: Any = None) -> Value:
        """A literal (hash-consed like every pure node); scalars get shape ``()``."""
        if shape is None:
            shape = np.shape(value)
        node = self.add_node(CONST, (), {"value": value}, [(shape, dtype)])
        return node.outputs[0]

    def set_outputs(self, values: Iterable[Value]) -> None:
        values = list(values)
        for v in values:
            if not isinstance(v, Value) or v.node._graph is not self or not v.node.alive:
                raise PyPMError(f"output {v!r} is not a live value of this graph")
        self._outputs = values
        self._output_ids = frozenset(map(id, values))

    def _from_terms(self, terms: list[Any]) -> list[Value]:
        """Values for hash-consed terms, sharing structure; no recursion per depth."""
        order: list[Any] = []  # post-order: inputs before users
        seen: set[int] = set()
        keep: list[Any] = []  # keep terms alive while their ids are in `seen`
        for root in terms:
            if not isinstance(root, Term):
                raise TypeError(f"Graph([...]) takes terms, got {root!r}")
            if id(root) in seen:
                continue
            stack = [(root, False)]
            while stack:
                t, done = stack.pop()
                if done:
                    order.append(t)
                    continue
                if id(t) in seen:
                    continue
                seen.add(id(t))
                keep.append(t)
                stack.append((t, True))
                for x in reversed(t.inputs):
                    if id(x) not in seen:
                        stack.append((x, False))
        # Outputs of one multi-output application are separate terms; group them back.
        groups: dict[Any, list[dict[int, Any]]] = {}
        group_of: dict[int, tuple[Any, int]] = {}
        for t in order:
            if t.op.n_out == 1:
                continue
            key = (t.op, tuple(id(x) for x in t.inputs), freeze(t.attrs))
            slots = groups.setdefault(key, [])
            i = next((j for j, slot in enumerate(slots) if t.index not in slot), len(slots))
            if i == len(slots):
                slots.append({})
            slots[i][t.index] = t
            group_of[id(t)] = (key, i)
        made: dict[tuple[Any, int], Node] = {}
        value_of: dict[int, Value] = {}
        for t in order:
            if t.op is LEAF and not t.inputs:
                name = str(t.attrs.get("name"))
                v = self._input_names.get(name)
                if v is None or v.shape != t.shape or v.dtype is not t.dtype:
                    unique, k = name, 1
                    while unique in self._input_names:  # same name, another type
                        unique, k = f"{name}_{k}", k + 1
                    v = self.add_input(unique, t.shape, t.dtype)
            elif t.op is CONST and not t.inputs:
                v = self.add_const(t.attrs["value"], t.shape, t.dtype)
            elif t.op.n_out == 1:
                ins = [value_of[id(x)] for x in t.inputs]
                node = self.add_node(t.op, ins, t.attrs, [(t.shape, t.dtype)], t.loc)
                v = node.outputs[0]
            else:
                gk = group_of[id(t)]
                node = made.get(gk)
                if node is None:
                    sibs = groups[gk[0]][gk[1]]
                    ins = [value_of[id(x)] for x in t.inputs]
                    unseen = self.infer_types(t.op, ins, t.attrs)  # outputs no term uses
                    types = [
                        (sibs[i].shape, sibs[i].dtype) if i in sibs else unseen[i]
                        for i in range(t.op.n_out)
                    ]
                    node = self.add_node(t.op, ins, t.attrs, types, t.loc)
                    made[gk] = node
                v = node.outputs[t.index]
            value_of[id(t)] = v
        return [value_of[id(t)] for t in terms]

    # ---------------------------------------------------------------------- reading

    def __len__(self) -> int:
        return len(self._nodes)

    def nodes(self) -> list[Node]:
        """Live nodes (inputs excluded) in a deterministic topological order."""
        if not self._topo_ok:
            self._retopo()
        return list(self._nodes.values())

    def compact(self) -> None:
        """Lay the values' input tuples out in memory in :meth:`nodes` order; changes nothing
        a reader can see. Frontends call it once a graph is built.

        A matcher's pass reads every value's ``inputs`` tuple. CPython puts a new tuple in
        whatever slot its allocator freed last, and a frontend frees many temporaries of
        that size, so a built graph's tuples lie scattered: on a graph bigger than the CPU
        caches nearly every one is a cache miss (~0.1 µs per node, a third of matching;
        ``benchmarks/matcher.py``). Re-made here in one go, with the old ones kept alive
        until the end so that none of their slots is reused, they are consecutive and a
        pass reads them as one stream.
        """
        old: list[Any] = []
        nodes = self.nodes()
        for node in nodes:
            outs = node.outputs
            ins = outs[0].inputs if outs else ()
            if ins:
                old.append(ins)
                ins = tuple(list(ins))  # a new tuple (tuple() of a tuple is itself)
                for v in outs:
                    v.inputs = ins
        del old

    def values(self) -> list[Value]:
        """Every output of every node, in :meth:`nodes` order."""
        return [v for n in self.nodes() for v in n.outputs]

    def users(self, value: Value) -> list[Node]:
        """The live nodes that read ``value``, each once, in the order they started to."""
        users = value.readers
        if type(users) is list and len(users) < 2:
            return list(users)  # (the common case: nothing to deduplicate)
        return _readers(value)

    def is_output(self, value: Value) -> bool:
        return id(value) in self._output_ids  # (outputs are alive: their ids are theirs)

    def is_read(self, value: Value) -> bool:
        """Does a node or the graph's outputs read ``value``? (Else it is dead code.)"""
        return bool(value.readers) or id(value) in self._output_ids

    def __contains__(self, item: object) -> bool:
        """Is ``item`` a live node or value (an input included) of this graph?"""
        node = item.node if type(item) is Value else item
        return type(node) is Node and node._graph is self and node.alive

    @property
    def next_id(self) -> int:
        """The id the next new node gets: nodes with ids from here on are newer."""
        return self._next_id

    @property
    def id_ordered(self) -> bool:
        """Do node ids increase along :meth:`nodes` order? Then comparing two nodes' ids
        compares their places in it (true until a replacement makes a node read a newer one)."""
        if not self._topo_ok:
            self._retopo()
        return self._id_ordered

    def _retopo(self) -> None:
        """Re-sort nodes: creation order where it is topological, else inputs first."""
        journal = self._journal
        if journal is not None and journal.order is None:
            journal.order = list(self._nodes.values())
        done: set[int] = set()
        active: set[int] = set()
        order: list[Node] = []
        for start in list(self._nodes.values()):
            if start.id in done:
                continue
            stack = [(start, 0)]
            active.add(start.id)
            while stack:
                node, i = stack.pop()
                if i < len(node.inputs):
                    stack.append((node, i + 1))
                    p = node.inputs[i].node
                    if p.id in done or p.id not in self._nodes:
                        continue
                    if p.id in active:
                        raise PyPMError(f"the graph has a cycle through {p!r}")
                    active.add(p.id)
                    stack.append((p, 0))
                else:
                    active.discard(node.id)
                    done.add(node.id)
                    order.append(node)
        self._nodes = {n.id: n for n in order}
        self._topo_ok = True
        self._id_ordered = all(a.id < b.id for a, b in itertools.pairwise(order))

    # --------------------------------------------------------------------- changing

    def set_input(self, node: Node, i: int, value: Value) -> list[Node]:
        """Make ``node`` read ``value`` at input ``i``; returns the nodes changed (merges)."""
        if value not in self or type(value) is not Value:
            raise PyPMError(f"{value!r} is not a live value of this graph")
        new_inputs = list(node.inputs)
        new_inputs[i] = value
        pending: list[tuple[Value, Value]] = []
        self._set_inputs(node, new_inputs, pending)
        return [node, *self._replace(pending)] if pending else [node]

    def _set_inputs(
        self, node: Node, new_inputs: list[Value], pending: list[tuple[Value, Value]]
    ) -> None:
        """``node`` reads ``new_inputs`` (as many as now, in a list no one else holds); a
        node it becomes equal to (hash-consing) is added to ``pending`` as a replacement to
        make. Inputs that stay keep their readers as they are (order included)."""
        old_inputs = node.inputs
        log = self._log
        where: list[int] | None = None if log is None else []
        for a, b in zip(old_inputs, new_inputs, strict=True):
            if a is b:
                continue
            users = a.readers
            if type(users) is list:
                i = users.index(node)  # (_unuse, inline: the common case)
                del users[i]
            else:
                i = _unuse(a, node, self._journal)
            users = b.readers
            if type(users) is list and len(users) < _FEW_USERS:
                users.append(node)  # (_use, inline)
            else:
                _use(b, node, self._journal)
            if where is not None:
                where.append(i)
        outs = node.outputs
        key = node._key
        if log is not None:
            log.append((_SETIN, node, old_inputs, key, outs[0].inputs if outs else (), where))
        ins = tuple(new_inputs)
        node.inputs = new_inputs  # (never changed in place: the journal keeps the old list)
        for v in outs:
            v.inputs = ins
        self._topo_ok = False
        self._memos = None
        if key is None:
            return
        # (the entry under the old key goes stale: see _valid)
        self._stale += 1
        key = node._key = (key[0], ins)
        cse = self._cse
        other = cse.get(key)
        if other is None:
            cse[key] = node
            if log is not None:
                log.append((_CSE, key, _MISSING))
        elif other is not node:
            if other.alive and other._key == key:  # now equal to a live node: merge into it
                pending.extend(zip(outs, other.outputs, strict=True))
            else:
                cse[key] = node
                if log is not None:
                    log.append((_CSE, key, other))

    def replace_all_uses(self, old: Value, new: Value, *, keep: Iterable[Node] = ()) -> list[Node]:
        """Every reader of ``old`` (nodes and graph outputs) reads ``new`` instead.

        Readers in ``keep`` go on reading ``old``: when ``new`` is computed from ``old``
        (a rewrite ``x → f(x)``), its own nodes must, or the graph would get a cycle; the
        node of ``new`` itself is always kept. Returns the nodes whose inputs changed, in
        order, including users of nodes that became duplicates of existing ones and were
        merged into them.
        """
        if type(new) is not Value or new.node._graph is not self or not new.node.alive:
            raise PyPMError(f"{new!r} is not a live value of this graph")
        kept = set(keep)  # (nodes hash by identity)
        kept.add(new.node)
        return self._replace([(old, new)], kept)

    def _replace(self, work: list[tuple[Value, Value]], kept: Container[Node] = ()) -> list[Node]:
        touched: list[Node] = []
        merged: list[Node] = []
        log, journal, cse = self._log, self._journal, self._cse
        stale = 0
        i = 0
        while i < len(work):
            old, new = work[i]
            i += 1
            if old is new:
                continue
            if id(old) in self._output_ids:  # (a new list: a journal keeps the old one)
                self._outputs = [new if v is old else v for v in self._outputs]
                self._output_ids = frozenset(map(id, self._outputs))
            users = old.readers
            if type(users) is list:  # (a copy: the loop changes it)
                readers = users.copy() if len(users) < 2 else list(dict.fromkeys(users))
                olds = users  # (a list stays a list: ``_unuse``)
            else:
                readers = list(users)
                olds = None
            first = i == 1
            for node in readers:
                if not node.alive or (first and node in kept):
                    continue
                # node reads new wherever it read old (``_set_inputs``, inline)
                old_inputs = node.inputs
                ins = old_inputs.copy()
                where = []
                while True:
                    ins[ins.index(old)] = new
                    if olds is not None:
                        k = olds.index(node)  # (_unuse, inline: the common case)
                        del olds[k]
                    else:
                        k = _unuse(old, node, journal)
                    users = new.readers
                    if type(users) is list and len(users) < _FEW_USERS:
                        users.append(node)  # (_use, inline)
                    else:
                        _use(new, node, journal)
                    where.append(k)
                    if old not in ins:
                        break  # (else it reads old more than once)
                outs = node.outputs
                key = node._key
                t = tuple(ins)
                if log is not None:
                    log.append(
                        (_SETIN, node, old_inputs, key, outs[0].inputs if outs else (), where)
                    )
                node.inputs = ins  # (never changed in place: the journal keeps the old list)
                for v in outs:
                    v.inputs = t
                touched.append(node)
                if key is None:
                    continue
                # (the entry under the old key goes stale: see _valid)
                stale += 1
                key = node._key = (key[0], t)
                other = cse.get(key)
                if other is None:
                    cse[key] = node
                    if log is not None:
                        log.append((_CSE, key, _MISSING))
                elif other is not node:
                    if other.alive and other._key == key:  # now equal to a live node: merge
                        if not outs:
                            continue  # (nothing to merge)
                        work.extend(zip(outs, other.outputs, strict=True))
                        merged.append(node)
                        # the node it merged into gains readers (and may be one a caller is
                        # replacing right now): report it, so a rewrite driver revisits it
                        touched.append(other)
                    else:
                        cse[key] = node
                        if log is not None:
                            log.append((_CSE, key, other))
        if touched:
            self._topo_ok = False
            self._memos = None
            self._stale += stale
        if not merged:
            return touched
        for node in merged:
            if node.alive and not any(v.readers for v in node.outputs):
                if not any(id(v) in self._output_ids for v in node.outputs):
                    self._remove(node)
        return [n for n in touched if n.alive]

    def swap(
        self, old: Value, new: Value, keep: Iterable[Node]
    ) -> tuple[list[Node], list[Node]] | None:
        """One step of the rewrite driver: :meth:`replace_all_uses` ``(old, new, keep=keep)``
        and, if that changed the graph, :meth:`remove_dead` of ``old``'s node. Returns the
        nodes whose inputs changed and the nodes removed, or None when nothing but ``keep``
        and ``new``'s node reads ``old`` and it is no output: then nothing changed."""
        kept = (new.node, *keep)  # (a few nodes: a tuple is searched faster than a set is made)
        output = id(old) in self._output_ids
        touched = self._replace([(old, new)], kept)
        if not touched and not output:
            return None  # (nothing changed: ``_replace`` skipped every reader)
        return touched, self.remove_dead((old.node,))

    def _remove(self, node: Node) -> None:
        journal = self._journal
        if journal is not None and journal.order is None:
            journal.order = list(self._nodes.values())
        node.alive = False
        self._memos = None
        self._nodes.pop(node.id, None)
        if node._key is not None:
            self._stale += 1  # (its entry in the hash-consing table goes stale: Graph._cse)
        where: list[int] | None = None if journal is None else []
        for v in node.inputs:
            users = v.readers
            if type(users) is list:
                i = users.index(node)  # (_unuse, inline)
                del users[i]
            else:
                i = _unuse(v, node, journal)
            if where is not None:
                where.append(i)
        if where is not None:
            journal.log.append((_REMOVE, node, where))

    def remove_dead(self, nodes: Iterable[Node]) -> list[Node]:
        """Remove the given nodes if nothing reads them, then their inputs likewise.

        The incremental dead-code elimination of the rewrite driver: cost proportional to
        what is removed. Graph inputs and impure nodes stay. Returns the removed nodes in
        removal order.
        """
        outs, live = self._output_ids, self._nodes
        stack = list(nodes)
        stack.reverse()
        removed: list[Node] = []
        while stack:
            node = stack.pop()
            op = node.op
            if not node.alive or not op.pure or (op is LEAF and node.id not in live):
                continue  # (dead, impure, or a graph input)
            for v in node.outputs:
                if v.readers or id(v) in outs:
                    break
            else:
                self._remove(node)
                removed.append(node)
                for v in reversed(node.inputs):
                    if not v.readers:  # (an input something else reads stays)
                        stack.append(v.node)
        if self._stale > _STALE_MIN and self._journal is None:
            self._purge()
        return removed

    def _purge(self) -> None:
        """Drop the hash-consing table's stale entries once they are many (see Graph._cse)."""
        if self._stale > max(_STALE_MIN, len(self._cse) // 2):
            self._cse = cse = {k: n for k, n in self._cse.items() if n.alive and n._key == k}
            used = {k[0] for k in cse}  # (and the signatures no live node has)
            self._sigs = {k: sig for k, sig in self._sigs.items() if sig[0] in used}
            self._stale = 0

    def dce(self) -> int:
        """Remove every pure node whose outputs nothing reads; returns how many."""
        live: set[int] = set()
        stack = [v.node for v in self._outputs]
        stack += [n for n in self._nodes.values() if not n.op.pure]
        while stack:
            node = stack.pop()
            if node.id in live:
                continue
            live.add(node.id)
            stack.extend(v.node for v in node.inputs)
        dead = [n for n in self._nodes.values() if n.id not in live]
        for node in dead:
            self._remove(node)
        return len(dead)

    # ------------------------------------------------------------------- undoing

    @property
    def recording(self) -> bool:
        """Are changes being recorded (between :meth:`begin` and :meth:`commit` or
        :meth:`rollback`)?"""
        return self._journal is not None

    def begin(self) -> None:
        """Record every change from now on, so that :meth:`rollback` can undo them.

        Costs nothing up front but a copy of the node order at the first removal, and the
        purge of the hash-consing table's stale entries where the changes made before left
        many (a commit leaves them: a graph rewritten once never pays for it); per
        change, one tuple in a log (what undoing it needs: the node's old inputs, where it
        was in a reader list) -- and a copy of a value's readers, once, where a value has
        too many to list (a dict of readers). Changes are recorded one run at a time: a
        second ``begin`` before ``commit`` or ``rollback`` is a
        :class:`~pypm_jax.core.errors.PyPMError`.
        """
        if self._journal is not None:
            raise PyPMError("changes to this graph are already being recorded")
        self._purge()
        self._journal = _Journal(self)
        self._log = self._journal.log

    def commit(self) -> None:
        """Keep the changes made since :meth:`begin`; stop recording."""
        if self._journal is None:
            raise PyPMError("nothing to commit: no change was being recorded")
        self._journal = self._log = None

    def rollback(self) -> None:
        """Restore the graph as it was at :meth:`begin` and stop recording: the nodes made
        since are dead (nothing reads them), the nodes changed or removed read what they
        read then, ids start where they did."""
        journal, self._journal, self._log = self._journal, None, None
        if journal is None:
            raise PyPMError("nothing to roll back: no change was being recorded")
        self._memos = None
        journal.restore(self)

    # ------------------------------------------------------------------- conversion

    def to_terms(self) -> list[Term]:
        """The outputs as hash-consed terms (for tests: compare graphs by term identity)."""
        term_of: dict[int, Any] = {}
        for v in self._inputs:
            term_of[id(v)] = make_term(
                LEAF, (), attrs={"name": v.attrs["name"]}, shape=v.shape, dtype=v.dtype
            )
        for node in self.nodes():
            ins = tuple(term_of[id(v)] for v in node.inputs)
            for v in node.outputs:
                term_of[id(v)] = make_term(
                    node.op, ins, index=v.index, attrs=node.attrs, shape=v.shape, dtype=v.dtype
                )
        return [term_of[id(v)] for v in self._outputs]

    def __str__(self) -> str:
        ins = ", ".join(f"{v.name}: {show_type(v.shape, v.dtype)}" for v in self._inputs)
        lines = [f"graph({ins}) {{"]
        for node in self.nodes():
            lhs = ", ".join(v.name for v in node.outputs)
            if node.op is CONST:
                rhs = f"const {_short(node.attrs.get('value'))}"
            else:
                args = ", ".join(v.name for v in node.inputs)
                attrs = "".join(f", {k}={_short(val)}" for k, val in node.attrs.items())
                rhs = f"{node.op.name}({args}{attrs})"
            types = ", ".join(show_type(v.shape, v.dtype) for v in node.outputs)
            where = f"  @ {node.loc}" if node.loc is not None else ""
            lines.append(f"  {lhs} = {rhs} : {types}{where}")
        lines.append("  return " + ", ".join(v.name for v in self._outputs))
        lines.append("}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Graph: {len(self._inputs)} inputs, {len(self._nodes)} nodes>"


_MISSING = object()  # (a hash-consing key that had no entry)
_STALE_MIN = 4096  # stale hash-consing entries kept before a purge is considered

# What a journal's log records, one tuple per change, undone in reverse order:
_NEW = 0  # (_NEW, node): made, reading its inputs (each appended to their reader lists)
# (_SETIN, node, inputs, key, value inputs, where): the node's inputs before a change, and
# for each input it changed, where the node was in the old input's reader list
_SETIN = 1
_REMOVE = 3  # (_REMOVE, node, where): removed; where it was in each input's reader list
_CSE = 4  # (_CSE, key, entry): the hash-consing table's entry for key before a change
_READERS = 5  # (_READERS, value, readers): a value's readers before its dict first changed


class _Journal:
    """What a graph was before a run of changes (see :meth:`Graph.begin`).

    Nothing is copied up front: the graph's input list only grows and its output list is
    replaced, never changed in place, so their lengths and the old list suffice; the node
    order is copied at the first removal. Every other change appends one tuple to ``log``
    saying what undoing it needs (see ``_NEW`` and the other kinds); a reader list changes
    by one entry at a known place, so it is logged as that place, except a dict of readers
    (a value many nodes read), which is copied whole at its first change (``kept``).
    """

    __slots__ = ("n_inputs", "outputs", "next_id", "topo", "order", "log", "kept")

    def __init__(self, g: Graph):
        self.n_inputs = len(g._inputs)
        self.outputs = (g._outputs, g._output_ids)
        self.next_id = g._next_id
        self.topo = (g._topo_ok, g._id_ordered)
        self.order: list[Node] | None = None  # the node order, once something is removed
        self.log: list[tuple] = []
        self.kept: set[Value] = set()  # values whose readers the log holds whole

    def restore(self, g: Graph) -> None:
        cse = g._cse
        for entry in reversed(self.log):
            kind = entry[0]
            if kind == _CSE:
                _, key, old = entry
                if old is _MISSING:
                    cse.pop(key, None)
                else:
                    cse[key] = old
            elif kind == _NEW:
                node = entry[1]
                node.alive = False
                for v in reversed(node.inputs):
                    users = v.readers
                    if type(users) is list:  # (else it is restored whole, later)
                        users.pop()
            elif kind == _SETIN:
                _, node, inputs, key, vins, where = entry
                moved = [(a, b) for a, b in zip(inputs, node.inputs, strict=True) if a is not b]
                for (a, b), i in zip(reversed(moved), reversed(where), strict=True):
                    users = b.readers
                    if type(users) is list:  # (else it is restored whole, later)
                        users.pop()
                    users = a.readers
                    if type(users) is list:
                        users.insert(i, node)
                node.inputs, node._key = inputs, key
                for v in node.outputs:
                    v.inputs = vins
            elif kind == _REMOVE:
                _, node, where = entry
                node.alive = True
                for v, i in zip(reversed(node.inputs), reversed(where), strict=True):
                    users = v.readers
                    if type(users) is list:
                        users.insert(i, node)
            else:  # _READERS
                entry[1].readers = entry[2]
        for v in g._inputs[self.n_inputs :]:
            del g._input_names[v.attrs["name"]]
        del g._inputs[self.n_inputs :]
        g._outputs, g._output_ids = self.outputs
        next_id = self.next_id
        if self.order is not None:
            g._nodes = {n.id: n for n in self.order if n.id < next_id}
        else:  # only additions: the nodes made since come last
            for i in range(next_id, g._next_id):
                g._nodes.pop(i, None)
        g._next_id = next_id
        g._topo_ok, g._id_ordered = self.topo
