"""The portable format: operators, patterns and rules as canonical, versioned JSON bytes.

The schema is documented in ``docs/FORMAT.md``; this module is its only implementation.

Why it looks the way it does:

* **Flat tables, never nested JSON.** Every pattern, expression and replacement node is one
  entry of a table and names its children by integer index into *earlier* entries. Deep
  patterns therefore never nest in JSON (no recursion when reading or writing), the indices
  can never form a cycle, and equal sub-structures are stored once (the writer hash-conses
  entries, so equal inputs give identical bytes whatever their sharing in memory).
* **Loading never executes code.** Operators and guard functions are resolved by name among
  those the loading process already has (``ops=``, then ``_registry``); nothing named in a
  blob is imported, evaluated or unpickled. An operator the process does not know is
  recreated from its signature, without registering it anywhere.
* **Every defect is a FormatError.** The reader validates each entry against the schema as it
  decodes it, then checks what the schema cannot express (arity, scoping, recursion that
  consumes structure, expanded size); a last-resort wrapper turns anything unexpected into a
  FormatError too, so nothing else ever escapes :func:`deserialize`.
"""

from __future__ import annotations

__all__ = [
    "serialize",
    "deserialize",
    "FORMAT",
    "VERSION",
    "MINOR",
    "MAX_BLOB_BYTES",
    "MAX_ENTRIES",
    "MAX_EXPANDED",
    "MAX_VALUE_DEPTH",
    "MAX_OPERANDS",
    "MAX_INT_BITS",
    "MAX_STRING",
    "MAX_LITERAL_ITEMS",
    "MAX_EXPR_DEPTH",
    "MAX_EXPONENT",
]

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from .core.calculus import (
    EAnd,
    EAttr,
    EBin,
    ECall,
    ECmp,
    EConst,
    EIndex,
    ENot,
    EOpAttr,
    EOr,
    ETuple,
    EUnary,
    Expr,
    GuardFn,
    PAlt,
    PApp,
    Param,
    PatternDef,
    PCall,
    PConst,
    PConstr,
    PExists,
    PFunVar,
    PGuard,
    PMu,
    PVar,
    RApp,
    RConst,
    Rhs,
    RTuple,
    RuleBranch,
    RuleDef,
    RVar,
    binds_below,
    expr_children,
)
from .core.dtypes import DTYPES, DType
from .core.errors import FormatError, SourceLoc
from .core.terms import OpClass, Operator
from .lang import registry as _registry
from .semantics.guards import MAX_EXPONENT, power_problem

FORMAT = "pypm"
VERSION = 1  # the major version: a reader refuses every other one
MINOR = 1  # additions an older reader of the same major may safely ignore
# minor 1: the optional top-level key "guard_locs" (where each condition of a rule branch
# was written; RuleBranch.guard_locs)

MAX_BLOB_BYTES = 64 * 1024 * 1024
MAX_ENTRIES = 1_000_000  # per table, and per list inside an entry
MAX_EXPANDED = 4_000_000  # pattern/expression/replacement nodes, shared ones counted per use
MAX_VALUE_DEPTH = 64  # nesting of tuple literals (CPython hashes nested tuples recursively, in C)
# What one loaded item may ask of the process that matches it: graph nodes are allocated per
# output, guards compute with literals, so none of these may be unbounded.
MAX_OPERANDS = 65_536  # n_in and n_out of an operator, n_out and index of an operator variable
MAX_INT_BITS = 1024  # every integer in a blob (literals included), in bits
MAX_STRING = 65_536  # every string in a blob (names, literals, source lines), in characters
MAX_LITERAL_ITEMS = 65_536  # elements of a tuple literal, shared entries counted at each use
MAX_EXPR_DEPTH = 100  # nesting of a guard expression (patterns may nest without limit)

Item = Operator | PatternDef | RuleDef

# ------------------------------------------------------------------------------ the schema
#
# A field is (name, type); the JSON key is the dataclass attribute's name. Types:
#   ("ref", T)   index of an entry of table T     ("ref?", T)  the same, or null
#   ("refs", T)  list of such indices             ("refs?", T) list of indices or nulls
#   NAME non-empty string, NAT int >= 0, OPT_POS null or int >= 1, BOOL, ("enum", choices),
#   PARAMS, ARGS, RATTRS, BRANCHES: the small inline records described in docs/FORMAT.md.

NAME = ("name",)
NAT = ("nat",)
OPT_POS = ("pos?",)
BOOL = ("bool",)
PARAMS = ("params",)
ARGS = ("args",)
RATTRS = ("rattrs",)
BRANCHES = ("branches",)
KIND = ("enum", ("term", "op"))
VALUE = ("ref", "values")
EXPR = ("ref", "exprs")
EXPRS = ("refs", "exprs")
PAT = ("ref", "patterns")
PATS = ("refs", "patterns")
RHSS = ("refs", "rhs")
OP = ("ref", "ops")
LOC = ("ref?", "locs")

_BIN_OPS = ("+", "-", "*", "/", "//", "%", "**")
_UNARY_OPS = ("-", "+")
_CMP_OPS = ("==", "!=", "<", "<=", ">", ">=", "in", "not in")

Fields = tuple[tuple[str, tuple[Any, ...]], ...]

_EXPR_KINDS: dict[str, tuple[type, Fields]] = {
    "const": (EConst, (("value", VALUE),)),
    "attr": (EAttr, (("var", NAME), ("attr", NAME))),
    "op_attr": (EOpAttr, (("var", NAME), ("attr", NAME))),
    "index": (EIndex, (("base", EXPR), ("index", EXPR))),
    "bin": (EBin, (("op", ("enum", _BIN_OPS)), ("left", EXPR), ("right", EXPR))),
    "unary": (EUnary, (("op", ("enum", _UNARY_OPS)), ("operand", EXPR))),
    "cmp": (ECmp, (("op", ("enum", _CMP_OPS)), ("left", EXPR), ("right", EXPR))),
    "and": (EAnd, (("items", EXPRS),)),
    "or": (EOr, (("items", EXPRS),)),
    "not": (ENot, (("operand", EXPR),)),
    "call": (ECall, (("fn", ("ref", "guard_fns")), ("args", EXPRS))),
    "tuple": (ETuple, (("items", EXPRS),)),
}
_PATTERN_KINDS: dict[str, tuple[type, Fields]] = {
    "var": (PVar, (("name", NAME),)),
    "app": (PApp, (("op", OP), ("args", PATS), ("index", NAT))),
    "const": (PConst, (("value", VALUE),)),
    "alt": (PAlt, (("left", PAT), ("right", PAT))),
    "guard": (PGuard, (("pat", PAT), ("guard", EXPR), ("loc", LOC))),
    "exists": (PExists, (("var", NAME), ("body", PAT), ("kind", KIND))),
    "constr": (PConstr, (("pat", PAT), ("var", NAME), ("constraint", PAT), ("loc", LOC))),
    "fun_var": (PFunVar, (("var", NAME), ("args", PATS), ("index", NAT), ("n_out", OPT_POS))),
    "mu": (PMu, (("name", NAME), ("params", PARAMS), ("args", ARGS), ("body", PAT))),
    "call": (PCall, (("name", NAME), ("args", ARGS))),
}
_RHS_KINDS: dict[str, tuple[type, Fields]] = {
    "var": (RVar, (("name", NAME),)),
    "const": (RConst, (("value", VALUE),)),
    "app": (RApp, (("op", OP), ("args", RHSS), ("attrs", RATTRS), ("index", NAT))),
    "tuple": (RTuple, (("items", RHSS),)),
}
_DEF_FIELDS: Fields = (
    ("name", NAME),
    ("params", PARAMS),
    ("body", PAT),
    ("loc", LOC),
    ("alt_locs", ("refs?", "locs")),
)
_RULE_FIELDS: Fields = (
    ("name", NAME),
    ("pattern", ("ref", "defs")),
    ("branches", BRANCHES),
    ("single_use", BOOL),
    ("loc", LOC),
)
_OP_KEYS = ("attrs", "n_in", "n_out", "name", "namespace", "op_class", "pure")
_LOC_KEYS = ("file", "line", "text")

# Tables in the order they are written and read; an entry refers only to earlier tables and
# to earlier entries of its own table.
TABLES = ("ops", "guard_fns", "locs", "values", "exprs", "patterns", "rhs", "defs", "rules")
_KINDED = {"exprs": _EXPR_KINDS, "patterns": _PATTERN_KINDS, "rhs": _RHS_KINDS}
_SINGLE = {"defs": (PatternDef, _DEF_FIELDS), "rules": (RuleDef, _RULE_FIELDS)}
_KIND_OF: dict[str, dict[type, tuple[str, Fields]]] = {
    table: {cls: (kind, fields) for kind, (cls, fields) in kinds.items()}
    for table, kinds in _KINDED.items()
}
# Per node table, per kind (None for the unkinded tables): an entry's keys, and as a set.
_ENTRY_KEYS: dict[str, dict[str | None, tuple[tuple[str, ...], frozenset[str]]]] = {
    table: {
        k: (keys, frozenset(keys))
        for k, keys in (
            ((k, ("k", *(name for name, _ in fields))) for k, (_, fields) in _KINDED[table].items())
            if table in _KINDED
            else [(None, tuple(name for name, _ in _SINGLE[table][1]))]
        )
    }
    for table in ("exprs", "patterns", "rhs", "defs", "rules")
}

# How _Reader._read_table decodes an entry of a node table, per table and kind (None for the
# unkinded tables): (class, keys, keys as a set, steps, sized, deep, locally checked). A step
# (field name, how, table, field type) takes the field's value when ``how`` accepts it as it
# is -- an index into an earlier table (_REF) or entry (_OWN), a non-empty string (_NAME), an
# integer >= 0 (_NAT), a list of indices (_REFS, _OWN_REFS) -- and hands anything else to
# _Reader._get, which decodes it or refuses it with its message (_GET: always). ``sized``:
# the fields that add to the entry's expanded size; ``deep``: those that add to an
# expression's depth.
_GET, _REF, _OWN, _NAME, _NAT, _REFS, _OWN_REFS = range(7)
_SIZED = ("exprs", "patterns", "rhs")


def _step(table: str, name: str, ftype: tuple[Any, ...]) -> tuple[str, int, Any, Any]:
    tag = ftype[0]
    if tag in ("ref", "refs"):
        own = ftype[1] == table
        how = (_OWN if own else _REF) if tag == "ref" else (_OWN_REFS if own else _REFS)
        return (name, how, ftype[1], ftype)
    return (name, {"name": _NAME, "nat": _NAT}.get(tag, _GET), None, ftype)


def _plan(table: str, k: str | None, cls: type, fields: Fields) -> tuple[Any, ...]:
    keys, keyset = _ENTRY_KEYS[table][k]
    steps = tuple(_step(table, name, ftype) for name, ftype in fields)
    sized = tuple(
        (name, ftype[0], ftype[1] if ftype[0] != "rattrs" else "exprs")
        for name, ftype in fields
        if (ftype[0] in ("ref", "refs") and ftype[1] in _SIZED) or ftype[0] == "rattrs"
    )
    deep = tuple((name, ftype == EXPRS) for name, ftype in fields if ftype in (EXPR, EXPRS))
    return (cls, keys, keyset, steps, sized, deep, cls in _LOCALLY_CHECKED)


_ITEM_TABLES = {"op": "ops", "pattern": "defs", "rule": "rules"}
_KEYSETS: dict[tuple[str, ...], frozenset[str]] = {}  # _Reader._record's key tuples, as sets
_WHAT = {
    "ops": "an operator",
    "guard_fns": "a guard function",
    "locs": "a source location",
    "values": "a literal",
    "exprs": "an expression",
    "patterns": "a pattern",
    "rhs": "a rule result",
    "defs": "a pattern definition",
    "rules": "a rule",
}


def _short(value: Any, limit: int = 60) -> str:
    """A bounded description for messages: never the repr of a (possibly huge or deep)
    structure, which could itself fail."""
    if value is None or type(value) in (str, bool, int, float):
        try:
            text = repr(value)
        except ValueError:  # an int too long to print
            text = f"<int of {value.bit_length()} bits>"
    elif type(value) in (tuple, list, dict):
        text = f"<{type(value).__name__} of {len(value)} items>"
    else:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_kind(raw: Any) -> str:
    if raw is None:
        return "null"
    return {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
    }.get(type(raw), type(raw).__name__)


def _key(value: Any) -> Any:
    """A hashable key for a JSON value that tells apart what JSON tells apart (1, 1.0,
    true, -0.0 and 0.0 are four keys)."""
    t = type(value)
    if t is list:
        return (list, *(v if type(v) is int else _key(v) for v in value))
    if t is dict:  # a writer's entry: keys in a fixed order per kind
        return (
            dict,
            *((k, v if type(v) is int or type(v) is str else _key(v)) for k, v in value.items()),
        )
    if t is float or t is bool:
        return (t, repr(value))
    return value


def _canonical(doc: Any) -> str:
    return json.dumps(
        doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    )


# ------------------------------------------------------------------------------- writing


class _Writer:
    """Builds the tables. Entries are hash-consed (by :func:`_key`), so structurally equal
    sub-structures share one entry and the output depends only on the structure."""

    def __init__(self) -> None:
        self.tables: dict[str, list[Any]] = {t: [] for t in TABLES}
        self._by_key: dict[str, dict[Any, int]] = {t: {} for t in TABLES}
        self._by_id: dict[str, dict[int, int]] = {t: {} for t in TABLES}
        self._keep: list[Any] = []  # keeps every indexed object alive, so ids stay unique
        self.ops: dict[str, Operator] = {}
        self.guard_locs: list[list[list[int | None]]] = []  # per rules entry (minor 1)

    def index(self, table: str, root: Any) -> int:
        """The index of ``root``'s entry in ``table``, writing it (children first) if new."""
        by_id = self._by_id
        stack: list[tuple[str, Any, bool]] = [(table, root, False)]
        while stack:
            t, obj, ready = stack.pop()
            if id(obj) in by_id[t]:
                continue
            if not ready:
                stack.append((t, obj, True))
                for ct, child in reversed(self._children(t, obj)):
                    if id(child) not in by_id[ct]:
                        stack.append((ct, child, False))
                continue
            entry, key = self._entry(t, obj)
            if t == "rules":  # the rule's guard_locs live outside its entry (minor 1)
                locs = self._guard_locs_of(obj)
                key = (key, _key(locs))
            idx = self._by_key[t].get(key)
            if idx is None:
                idx = len(self.tables[t])
                self.tables[t].append(entry)
                self._by_key[t][key] = idx
                if t == "rules":
                    self.guard_locs.append(locs)
            by_id[t][id(obj)] = idx
            self._keep.append(obj)
        return by_id[table][id(root)]

    def _guard_locs_of(self, rule: RuleDef) -> list[list[int | None]]:
        by_id = self._by_id["locs"]
        return [
            [None if loc is None else by_id[id(loc)] for loc in b.guard_locs] for b in rule.branches
        ]

    # --- children: what must be written before an entry (also checks container shapes) ---

    def _children(self, table: str, obj: Any) -> list[tuple[str, Any]]:
        if table in ("ops", "guard_fns", "locs"):
            return []
        if table == "values":
            if type(obj) is tuple:
                return [("values", v) for v in obj]
            if isinstance(obj, Operator):
                return [("ops", obj)]
            return []
        plan = _WRITE_PLANS[table].get(type(obj))
        if plan is None:
            self._fields_of(table, obj)  # raises: not of this table
        _, owner, steps = plan
        out: list[tuple[str, Any]] = []
        for name, tag, sub, ftype in steps:
            value = getattr(obj, name)
            if tag == "ref":
                out.append((sub, value))
            elif tag == "refs" and type(value) is tuple:
                out.extend([(sub, v) for v in value])
            elif tag not in _SCALAR_TAGS:
                out.extend(_field_children(owner, name, ftype, value))
        return out

    def _fields_of(self, table: str, obj: Any) -> tuple[type, Fields]:
        if table in _SINGLE:
            cls, fields = _SINGLE[table]
            if type(obj) is not cls:
                raise FormatError(
                    f"cannot serialize: expected {_WHAT[table]}, got {type(obj).__name__}"
                )
            return cls, fields
        found = _KIND_OF[table].get(type(obj))
        if found is None:
            raise FormatError(f"cannot serialize: expected {_WHAT[table]}, got {_short(obj)}")
        return type(obj), found[1]

    # --- entries ---

    def _entry(self, table: str, obj: Any) -> tuple[Any, Any]:
        """The entry of ``obj`` and its hash-consing key: two entries of a table have equal
        keys exactly when they are equal as JSON (1, 1.0 and true apart)."""
        if table == "ops":
            entry = self._op_entry(obj)
        elif table == "guard_fns":
            entry = self._guard_fn_entry(obj)
        elif table == "locs":
            entry = self._loc_entry(obj)
        elif table == "values":
            entry = self._value_entry(obj)
        else:
            return self._node_entry(table, obj)
        return entry, _key(entry)

    def _node_entry(self, table: str, obj: Any) -> tuple[dict[str, Any], tuple[Any, ...]]:
        """An entry of a node table, and as its key the kind and the fields' values (each
        field's JSON type is fixed by the schema; lists and records by :func:`_key`)."""
        plan = _WRITE_PLANS[table].get(type(obj))
        if plan is None:
            self._fields_of(table, obj)  # raises: not of this table
        kind, owner, steps = plan
        ids = self._by_id
        entry: dict[str, Any] = {}
        key: list[Any] = [kind]
        if kind is not None:
            entry["k"] = kind
        for name, tag, sub, ftype in steps:
            value = getattr(obj, name)
            if tag == "ref":
                v = entry[name] = ids[sub][id(value)]
                key.append(v)
            elif tag == "refs":
                of = ids[sub]
                v = entry[name] = [of[id(x)] for x in value]
                key.append(tuple(v))
            elif tag == "name" and type(value) is str and value:
                entry[name] = value
                key.append(value)
            else:
                v = entry[name] = self._put(owner, name, ftype, value)
                key.append(v if type(v) is int or type(v) is str or v is None else _key(v))
        return entry, tuple(key)

    def _op_entry(self, op: Any) -> dict[str, Any]:
        if not isinstance(op, Operator):
            raise FormatError(f"cannot serialize: expected an operator, got {_short(op)}")
        bad = _op_signature_problem(op)
        if bad:
            raise FormatError(f"cannot serialize operator {_short(op.name)}: {bad}")
        other = self.ops.get(op.qualname)
        if other is not None and other is not op:
            raise FormatError(
                f"cannot serialize: two different operators are named {op.qualname!r}; "
                "a blob names each operator once"
            )
        self.ops[op.qualname] = op
        return {
            "name": op.name,
            "namespace": op.namespace,
            "n_in": op.n_in,
            "n_out": op.n_out,
            "attrs": list(op.attrs),
            "op_class": None if op.op_class is None else op.op_class.name,
            "pure": op.pure,
        }

    @staticmethod
    def _guard_fn_entry(fn: Any) -> str:
        if not isinstance(fn, GuardFn) or type(fn.name) is not str or not fn.name:
            raise FormatError(f"cannot serialize: expected a guard function, got {_short(fn)}")
        if fn.name not in _registry.GUARD_FNS:
            raise FormatError(
                f"cannot serialize: guard function {fn.name!r} is not registered "
                "(register it with @pm.guard_fn so a loading process can find it by name)"
            )
        return fn.name

    @staticmethod
    def _loc_entry(loc: Any) -> dict[str, Any]:
        if (
            type(loc) is not SourceLoc
            or type(loc.file) is not str
            or type(loc.line) is not int
            or type(loc.text) is not str
        ):
            raise FormatError(f"cannot serialize: not a valid source location: {_short(loc)}")
        return {"file": loc.file, "line": loc.line, "text": loc.text}

    def _value_entry(self, v: Any) -> dict[str, Any]:
        if v is None:
            return {"k": "none"}
        t = type(v)
        if t is bool:
            return {"k": "bool", "v": v}
        if t is int:
            return {"k": "int", "v": v}
        if t is float:
            if math.isnan(v):
                return {"k": "float", "v": "nan"}
            if math.isinf(v):
                return {"k": "float", "v": "inf" if v > 0 else "-inf"}
            return {"k": "float", "v": v}
        if t is str:
            return {"k": "str", "v": v}
        if t is DType and DTYPES.get(v.name) is v:
            return {"k": "dtype", "v": v.name}
        if t is OpClass:
            return {"k": "opclass", "v": v.name}
        if isinstance(v, Operator):
            return {"k": "op", "v": self._by_id["ops"][id(v)]}
        if t is tuple:
            return {"k": "tuple", "items": [self._by_id["values"][id(x)] for x in v]}
        raise FormatError(
            f"cannot serialize a literal of type {t.__name__} ({_short(v)}): literals are "
            "int, float, bool, str, None, dtypes, op classes, operators and tuples of these"
        )

    def _put(self, owner: str, name: str, ftype: tuple[Any, ...], value: Any) -> Any:
        tag = ftype[0]
        ids = self._by_id
        if tag == "ref":
            return ids[ftype[1]][id(value)]
        if tag == "ref?":
            return None if value is None else ids[ftype[1]][id(value)]
        if tag == "refs":
            return [ids[ftype[1]][id(v)] for v in value]
        if tag == "refs?":
            return [None if v is None else ids[ftype[1]][id(v)] for v in value]
        if tag == "args":
            return [a if type(a) is str else ids["ops"][id(a)] for a in value]
        if tag == "params":
            return [{"name": p.name, "kind": p.kind} for p in value]
        if tag == "rattrs":
            return [{"name": n, "value": ids["exprs"][id(e)]} for n, e in value]
        if tag == "branches":
            return [
                {
                    "guard": ids["exprs"][id(b.guard)],
                    "result": ids["rhs"][id(b.result)],
                    "loc": None if b.loc is None else ids["locs"][id(b.loc)],
                }
                for b in value
            ]
        problem = _scalar_problem(ftype, value)
        if problem:
            raise FormatError(f"cannot serialize {owner}.{name}: {problem}")
        return value


# Per node table, per class: (kind or None, class name, its fields as (name, type's tag, table
# referred to or None, type)), for _Writer._children and _Writer._node_entry.
_WRITE_PLANS: dict[str, dict[type, tuple[str | None, str, tuple[Any, ...]]]] = {
    table: {
        cls: (
            kind if table in _KINDED else None,
            cls.__name__,
            tuple(
                (name, ft[0], ft[1] if ft[0] in ("ref", "ref?", "refs", "refs?") else None, ft)
                for name, ft in fields
            ),
        )
        for kind, (cls, fields) in (
            _KINDED[table].items() if table in _KINDED else [(None, _SINGLE[table])]
        )
    }
    for table in ("exprs", "patterns", "rhs", "defs", "rules")
}
_SCALAR_TAGS = frozenset({"name", "nat", "pos?", "bool", "enum"})


def _field_children(
    owner: str, name: str, ftype: tuple[Any, ...], value: Any
) -> list[tuple[str, Any]]:
    """The objects a field refers to, after checking its container shape."""
    tag = ftype[0]

    def fail(expected: str) -> FormatError:
        return FormatError(
            f"cannot serialize {owner}.{name}: expected {expected}, got {_short(value)}"
        )

    if tag == "ref":
        return [(ftype[1], value)]
    if tag == "ref?":
        return [] if value is None else [(ftype[1], value)]
    if tag in ("refs", "refs?"):
        if type(value) is not tuple:
            raise fail("a tuple")
        return [(ftype[1], v) for v in value if not (tag == "refs?" and v is None)]
    if tag == "args":
        if type(value) is not tuple or not all(
            (type(a) is str and a) or isinstance(a, Operator) for a in value
        ):
            raise fail("a tuple of variable names and operators")
        return [("ops", a) for a in value if isinstance(a, Operator)]
    if tag == "params":
        if type(value) is not tuple or not all(
            type(p) is Param and type(p.name) is str and p.name and p.kind in ("term", "op")
            for p in value
        ):
            raise fail("a tuple of Param(name, 'term' | 'op')")
        return []
    if tag == "rattrs":
        if type(value) is not tuple or not all(
            type(a) is tuple and len(a) == 2 and type(a[0]) is str and a[0] for a in value
        ):
            raise fail("a tuple of (attribute name, expression) pairs")
        return [("exprs", e) for _, e in value]
    if tag == "branches":
        if type(value) is not tuple or not all(type(b) is RuleBranch for b in value):
            raise fail("a tuple of RuleBranch")
        out: list[tuple[str, Any]] = []
        for b in value:
            out += [("exprs", b.guard), ("rhs", b.result)]
            if b.loc is not None:
                out.append(("locs", b.loc))
            if type(b.guard_locs) is not tuple:
                raise fail("RuleBranch.guard_locs as a tuple")
            out += [("locs", loc) for loc in b.guard_locs if loc is not None]
        return out
    return []


def _scalar_problem(ftype: tuple[Any, ...], value: Any) -> str | None:
    """Why ``value`` is not of scalar field type ``ftype`` (None if it is)."""
    tag = ftype[0]
    if tag == "name":
        return None if type(value) is str and value else "expected a non-empty string"
    if tag == "nat":
        return None if type(value) is int and value >= 0 else "expected an integer >= 0"
    if tag == "pos?":
        if value is None or (type(value) is int and value >= 1):
            return None
        return "expected null or an integer >= 1"
    if tag == "bool":
        return None if type(value) is bool else "expected a boolean"
    if tag == "enum":
        if type(value) is str and value in ftype[1]:
            return None
        return f"expected one of {', '.join(map(repr, ftype[1]))}"
    raise AssertionError(f"unknown field type {ftype!r}")  # a bug in the schema tables


def _op_signature_problem(op: Operator) -> str | None:
    if type(op.name) is not str or not op.name:
        return "its name must be a non-empty string"
    if type(op.namespace) is not str:
        return "its namespace must be a string"
    if op.n_in is not None and (type(op.n_in) is not int or op.n_in < 0):
        return "n_in must be null or an integer >= 0"
    if type(op.n_out) is not int or op.n_out < 1:
        return "n_out must be an integer >= 1"
    if max(op.n_in or 0, op.n_out) > MAX_OPERANDS:
        return f"n_in and n_out are limited to {MAX_OPERANDS} (MAX_OPERANDS)"
    if type(op.attrs) is not tuple or not all(type(a) is str for a in op.attrs):
        return "attrs must be a tuple of strings"
    if op.op_class is not None and type(op.op_class) is not OpClass:
        return "op_class must be an OpClass or None"
    if type(op.pure) is not bool:
        return "pure must be a boolean"
    return None


def serialize(items: Iterable[Item]) -> bytes:
    """Portable, canonical bytes for operators, pattern definitions and rules (in order).

    Equal inputs give identical bytes. Raises :class:`FormatError` for anything the format
    cannot represent (a literal of another type, an unregistered guard function, two
    operators with one qualified name) and for definitions that :func:`deserialize` would
    refuse (not closed, non-consuming recursion, arity mismatches): a blob that serializes
    also loads.
    """
    if isinstance(items, Operator | PatternDef | RuleDef | str | bytes):
        raise FormatError("serialize takes a sequence of operators, patterns and rules")
    try:
        seq = list(items)
    except TypeError:
        raise FormatError(
            f"serialize takes a sequence of operators, patterns and rules, got "
            f"{type(items).__name__}"
        ) from None
    writer = _Writer()
    out: list[dict[str, Any]] = []
    for n, item in enumerate(seq):
        if isinstance(item, Operator):
            out.append({"k": "op", "i": writer.index("ops", item)})
        elif type(item) is PatternDef:
            out.append({"k": "pattern", "i": writer.index("defs", item)})
        elif type(item) is RuleDef:
            out.append({"k": "rule", "i": writer.index("rules", item)})
        else:
            raise FormatError(
                f"cannot serialize item {n}: expected an Operator, PatternDef or RuleDef, "
                f"got {type(item).__name__}"
            )
    doc: dict[str, Any] = {"format": FORMAT, "version": VERSION, "minor": MINOR, "items": out}
    doc.update(writer.tables)
    doc["guard_locs"] = writer.guard_locs
    try:
        blob = _canonical(doc).encode("ascii")
    except (ValueError, RecursionError) as exc:  # e.g. an int with too many digits
        raise FormatError(f"cannot serialize: {exc}") from None
    if len(blob) > MAX_BLOB_BYTES:
        raise FormatError(f"cannot serialize: {len(blob)} bytes exceeds {MAX_BLOB_BYTES}")
    try:
        deserialize(blob, ops=list(writer.ops.values()))
    except FormatError as exc:
        raise FormatError(f"cannot serialize: the blob would not load: {exc}") from None
    return blob


# ------------------------------------------------------------------------------- reading


def _object_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise FormatError(f"duplicate key {_short(key)} in a JSON object")
            seen.add(key)
    return obj


def _reject_constant(name: str) -> Any:
    raise FormatError(f"{name} is not JSON (non-finite floats are written as strings)")


def _parse(blob: Any, checked: bool = True) -> Any:
    if isinstance(blob, memoryview):
        if blob.nbytes > MAX_BLOB_BYTES:
            raise FormatError(f"blob of {blob.nbytes} bytes exceeds the limit of {MAX_BLOB_BYTES}")
        blob = blob.tobytes()
    elif isinstance(blob, bytearray):
        blob = bytes(blob)
    if not isinstance(blob, bytes):
        raise FormatError(f"a pypm blob is bytes, got {type(blob).__name__}")
    if len(blob) > MAX_BLOB_BYTES:
        raise FormatError(f"blob of {len(blob)} bytes exceeds the limit of {MAX_BLOB_BYTES}")
    if not blob:
        raise FormatError("empty blob")
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        doc = json.loads(text, object_pairs_hook=_object_hook, parse_constant=_reject_constant)
    except RecursionError:
        raise FormatError("not a pypm blob: JSON nested too deeply (the format is flat)") from None
    except ValueError as exc:  # JSONDecodeError, or an integer with too many digits
        raise FormatError(f"not valid JSON (truncated or corrupt?): {exc}") from None
    if checked and type(doc) is dict:
        for key, value in doc.items():
            _check_scalars(key, [value])
    return doc


def _check_scalars(key: str, value: Any) -> None:
    """Every string and integer under the top-level ``key`` is within :data:`MAX_STRING`
    characters and :data:`MAX_INT_BITS` bits. (Object keys are never kept: every object
    must have exactly the keys of its kind.)"""
    todo = [value]
    while todo:
        x = todo.pop()
        for v in x.values() if type(x) is dict else x:
            t = type(v)
            if t is str:
                if len(v) > MAX_STRING:
                    raise FormatError(
                        f"{_short(key)}: a string of {len(v)} characters exceeds the limit of "
                        f"{MAX_STRING} (MAX_STRING)"
                    )
            elif t is int:
                if v.bit_length() > MAX_INT_BITS:
                    raise FormatError(
                        f"{_short(key)}: an integer of {v.bit_length()} bits exceeds the limit "
                        f"of {MAX_INT_BITS} (MAX_INT_BITS)"
                    )
            elif t is list or t is dict:
                todo.append(v)


class _Budget:
    """How many expanded nodes the closedness checks may still visit (DAG bombs)."""

    __slots__ = ("left",)

    def __init__(self, n: int) -> None:
        self.left = n

    def spend(self, owner: str, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise FormatError(
                f"{owner}: the definitions expand to more than {MAX_EXPANDED} nodes "
                "(shared entries counted at each use); refusing the blob as too large"
            )


class _Reader:
    def __init__(self, ops: Any, checked: bool = True) -> None:
        self.by_qual, self.by_name = _user_ops(ops)
        # False: the blob's bytes are ones a checked reader accepted (_deserialize_pinned):
        # what is a function of those bytes alone is not checked again
        self.checked = checked
        self.t: dict[str, list[Any]] = {t: [] for t in TABLES}
        # expanded (tree) size of each entry, capped: shared entries count at every use
        self.size: dict[str, list[int]] = {t: [] for t in ("exprs", "patterns", "rhs")}
        self.body_index: list[int] = []  # the body of each definition
        self.branch_index: list[tuple[int, int]] = []  # guard and result of each rule branch
        self.value_depth: list[int] = []  # nesting depth of each literal
        self.value_size: list[int] = []  # expanded size of each literal
        self.expr_depth: list[int] = []  # nesting depth of each expression
        # where the reader is, for messages: a place, and the entry's index in it (or None);
        # the loops set the index alone, and the text is formatted only for a message
        self.at = "the blob"
        self.i: int | None = None

    @property
    def where(self) -> str:
        return self.at if self.i is None else f"{self.at}[{self.i}]"

    @where.setter
    def where(self, place: str) -> None:
        self.at, self.i = place, None

    def fail(self, message: str) -> FormatError:
        return FormatError(f"{self.where}: {message}")

    def release(self) -> None:
        """Drop everything read so far, even while a traceback keeps this reader alive."""
        for table in self.t.values():
            table.clear()

    # --- top level ---

    def read(self, blob: Any) -> list[Item]:
        doc = _parse(blob, self.checked)
        self._header(doc)
        self._read_ops(self._list(doc, "ops"))
        self._read_guard_fns(self._list(doc, "guard_fns"))
        self._read_locs(self._list(doc, "locs"))
        self._read_values(self._list(doc, "values"))
        for table in ("exprs", "patterns", "rhs", "defs", "rules"):
            self._read_table(table, self._list(doc, table))
        if "guard_locs" in doc:  # optional (minor >= 1; _header refuses it before)
            self._read_guard_locs(self._list(doc, "guard_locs"))
        self.where = "the blob"
        if self.checked:
            self._check_definitions()
        items: list[Item] = []
        for n, raw in enumerate(self._list(doc, "items")):
            self.at, self.i = "items", n
            entry = self._record(raw, ("i", "k"))
            k = entry["k"]
            if type(k) is not str or k not in _ITEM_TABLES:
                raise self.fail(f"unknown item kind {_short(k)}; expected op, pattern or rule")
            items.append(self._ref(entry["i"], _ITEM_TABLES[k], None, "i"))
        return items

    def _check_definitions(self) -> None:
        """The definitions' expanded size is bounded, and each is closed (its variables
        bound, recursion under an application, results using the pattern's parameters)."""
        size = self.size
        total = sum(size["patterns"][d] for d in self.body_index)
        total += sum(size["exprs"][g] + size["rhs"][r] for g, r in self.branch_index)
        if total > MAX_EXPANDED:
            raise self.fail(
                f"the definitions expand to more than {MAX_EXPANDED} nodes (shared entries "
                "counted at each use); refusing the blob as too large"
            )
        budget = _Budget(MAX_EXPANDED)  # a second line of defence: the walks count, too
        needs = _Needs(budget)  # shared by the walks: the tables' entries are alive meanwhile
        for i, d in enumerate(self.t["defs"]):
            self.at, self.i = "defs", i
            _check_pattern_def(d, f"pattern {_short(d.name)} (defs[{i}])", budget, needs)
        for i, r in enumerate(self.t["rules"]):
            self.at, self.i = "rules", i
            _check_rule(r, f"rule {_short(r.name)} (rules[{i}])", budget, needs)
        self.where = "the blob"

    def _header(self, doc: Any) -> None:
        if type(doc) is not dict:
            raise FormatError(f"not a pypm blob: the top level is {_json_kind(doc)}, not an object")
        if doc.get("format") != FORMAT:
            raise FormatError('not a pypm blob: the header lacks "format": "pypm"')
        version = doc.get("version")
        if type(version) is not int:
            raise FormatError(f"malformed header: version is {_json_kind(version)}, not an integer")
        if version != VERSION:
            raise FormatError(
                f"unsupported pypm format version {_short(version)}: this reader reads "
                f"version {VERSION}"
            )
        minor = doc.get("minor")
        if type(minor) is not int or minor < 0:
            raise FormatError(f"malformed header: minor is {_short(minor)}, not an integer >= 0")
        known = {"format", "version", "minor", "items", *TABLES}
        if minor >= 1:
            known.add("guard_locs")
        unknown = sorted(k for k in doc if k not in known)
        if unknown and minor <= MINOR:
            raise FormatError(
                f"unknown top-level key(s) {', '.join(map(_short, unknown[:5]))} in a "
                f"version {VERSION}.{minor} blob"
            )

    def _list(self, doc: dict[str, Any], key: str) -> list[Any]:
        if key not in doc:
            raise FormatError(f"malformed blob (truncated?): the top-level key {key!r} is missing")
        value = doc[key]
        if type(value) is not list:
            raise FormatError(f"{key}: expected an array, got {_json_kind(value)}")
        if len(value) > MAX_ENTRIES:
            raise FormatError(f"{key}: {len(value)} entries exceed the limit of {MAX_ENTRIES}")
        return value

    def _record(self, raw: Any, keys: tuple[str, ...]) -> dict[str, Any]:
        """``raw`` as an object with exactly ``keys``."""
        keyset = _KEYSETS.get(keys)
        if keyset is None:
            keyset = _KEYSETS[keys] = frozenset(keys)
        if type(raw) is dict and raw.keys() == keyset:
            return raw
        if type(raw) is not dict:
            raise self.fail(f"expected an object, got {_json_kind(raw)}")
        if len(raw) != len(keys) or any(k not in raw for k in keys):
            missing = [k for k in keys if k not in raw]
            extra = sorted(k for k in raw if k not in keys)
            parts = []
            if missing:
                parts.append("missing " + ", ".join(map(repr, missing)))
            if extra:
                parts.append("unexpected " + ", ".join(_short(k) for k in extra[:5]))
            raise self.fail("; ".join(parts))
        return raw

    def _ref(self, raw: Any, table: str, own: str | None, key: str, own_i: int = 0) -> Any:
        """The entry of ``table`` that index ``raw`` names; only earlier entries if own table."""
        if type(raw) is not int:
            raise self.fail(f"{key}: expected an index into {table}, got {_json_kind(raw)}")
        limit = own_i if table == own else len(self.t[table])
        if not 0 <= raw < limit:
            if table == own:
                raise self.fail(
                    f"{key}: index {_short(raw)} is not an earlier entry of {table} "
                    "(entries refer only to earlier ones)"
                )
            raise self.fail(f"{key}: index {_short(raw)} out of range ({table} has {limit})")
        return self.t[table][raw]

    def _read_guard_locs(self, rows: list[Any]) -> None:
        """``guard_locs`` (minor 1): per rule, per branch, where each condition was written."""
        rules = self.t["rules"]
        if len(rows) != len(rules):
            raise FormatError(
                f"guard_locs: {len(rows)} entries for {len(rules)} rules (one per rule)"
            )
        for i, raw in enumerate(rows):
            self.at, self.i = "guard_locs", i
            r = rules[i]
            per_branch = self._bounded_list(raw, "guard_locs")
            if len(per_branch) != len(r.branches):
                raise self.fail(
                    f"{len(per_branch)} lists for the {len(r.branches)} branches of the rule"
                )
            branches = []
            for b, locs in zip(r.branches, per_branch, strict=True):
                locs = self._bounded_list(locs, "guard_locs")
                guard_locs = tuple(
                    None if x is None else self._ref(x, "locs", None, "guard_locs") for x in locs
                )
                branches.append(RuleBranch(b.guard, b.result, b.loc, guard_locs))
            rules[i] = RuleDef(r.name, r.pattern, tuple(branches), r.single_use, r.loc)

    def _bounded_list(self, raw: Any, key: str) -> list[Any]:
        if type(raw) is not list:
            raise self.fail(f"{key}: expected an array, got {_json_kind(raw)}")
        if len(raw) > MAX_ENTRIES:
            raise self.fail(f"{key}: {len(raw)} elements exceed the limit of {MAX_ENTRIES}")
        return raw

    # --- leaf tables ---

    def _read_ops(self, rows: list[Any]) -> None:
        seen: set[str] = set()
        for i, raw in enumerate(rows):
            self.at, self.i = "ops", i
            e = self._record(raw, _OP_KEYS)
            name, ns, n_in, n_out = e["name"], e["namespace"], e["n_in"], e["n_out"]
            attrs, op_class, pure = e["attrs"], e["op_class"], e["pure"]
            if type(name) is not str or not name:
                raise self.fail("name: expected a non-empty string")
            if type(ns) is not str:
                raise self.fail("namespace: expected a string")
            if n_in is not None and (type(n_in) is not int or n_in < 0):
                raise self.fail("n_in: expected null or an integer >= 0")
            if type(n_out) is not int or n_out < 1:
                raise self.fail("n_out: expected an integer >= 1")
            if max(n_in or 0, n_out) > MAX_OPERANDS:
                raise self.fail(
                    f"n_in and n_out are limited to {MAX_OPERANDS} (MAX_OPERANDS), got "
                    f"n_in={n_in}, n_out={n_out}"
                )
            attrs = self._bounded_list(attrs, "attrs")
            if not all(type(a) is str for a in attrs):
                raise self.fail("attrs: expected an array of strings")
            if op_class is not None and (type(op_class) is not str or not op_class):
                raise self.fail("op_class: expected null or a non-empty string")
            if type(pure) is not bool:
                raise self.fail("pure: expected a boolean")
            qualname = f"{ns}.{name}" if ns else name
            if qualname in seen:
                raise self.fail(f"operator {qualname!r} is declared twice")
            seen.add(qualname)
            sig = {
                "n_in": n_in,
                "n_out": n_out,
                "attrs": tuple(attrs),
                "op_class": op_class,
                "pure": pure,
            }
            self.t["ops"].append(self._resolve_op(qualname, name, ns, sig))

    def _resolve_op(self, qualname: str, name: str, ns: str, sig: dict[str, Any]) -> Operator:
        source = "passed in ops="
        op = self.by_qual.get(qualname) or self.by_name.get(name)
        if op is None:
            source = "registered in this process"
            op = _registry.OPS.get(qualname)
        if op is None:
            return Operator(
                name,
                sig["n_in"],
                sig["n_out"],
                attrs=sig["attrs"],
                op_class=sig["op_class"],
                namespace=ns,
                pure=sig["pure"],
            )
        if not isinstance(op, Operator):
            raise self.fail(f"the object {source} for {qualname!r} is not an Operator")
        mine = {
            "n_in": op.n_in,
            "n_out": op.n_out,
            "attrs": op.attrs,
            "op_class": None if op.op_class is None else getattr(op.op_class, "name", op.op_class),
            "pure": op.pure,
        }
        for key, value in sig.items():
            if mine[key] != value or type(mine[key]) is not type(value):
                raise self.fail(
                    f"operator {qualname!r}: the blob declares {key}={value!r}, but the "
                    f"operator {source} has {key}={mine[key]!r}"
                )
        return op

    def _read_guard_fns(self, rows: list[Any]) -> None:
        for i, name in enumerate(rows):
            self.at, self.i = "guard_fns", i
            if type(name) is not str or not name:
                raise self.fail(f"expected a guard function name, got {_json_kind(name)}")
            fn = _registry.GUARD_FNS.get(name)
            if not isinstance(fn, GuardFn):
                raise self.fail(f"guard function {_short(name)} is not registered in this process")
            self.t["guard_fns"].append(fn)

    def _read_locs(self, rows: list[Any]) -> None:
        for i, raw in enumerate(rows):
            self.at, self.i = "locs", i
            e = self._record(raw, _LOC_KEYS)
            if type(e["file"]) is not str or type(e["line"]) is not int:
                raise self.fail("expected a string file and an integer line")
            if type(e["text"]) is not str:
                raise self.fail("text: expected a string")
            self.t["locs"].append(SourceLoc(e["file"], e["line"], e["text"]))

    def _read_values(self, rows: list[Any]) -> None:
        out = self.t["values"]
        for i, raw in enumerate(rows):
            self.at, self.i = "values", i
            if type(raw) is not dict:
                raise self.fail(f"expected an object, got {_json_kind(raw)}")
            k = raw.get("k")
            if k == "tuple":
                e = self._record(raw, ("items", "k"))
                items = self._bounded_list(e["items"], "items")
                out.append(tuple(self._ref(x, "values", "values", "items", i) for x in items))
                depth = 1 + max((self.value_depth[x] for x in items), default=0)
                size = 1 + sum(self.value_size[x] for x in items)
                if depth > MAX_VALUE_DEPTH:
                    raise self.fail(f"a tuple literal nested deeper than {MAX_VALUE_DEPTH}")
                if size > MAX_LITERAL_ITEMS:
                    raise self.fail(
                        f"a tuple literal expands to more than {MAX_LITERAL_ITEMS} elements "
                        "(MAX_LITERAL_ITEMS)"
                    )
                self.value_depth.append(depth)
                self.value_size.append(size)
                continue
            self.value_depth.append(0)
            self.value_size.append(1)
            if k == "none":
                self._record(raw, ("k",))
                out.append(None)
                continue
            if type(k) is not str or k not in (
                "bool",
                "int",
                "float",
                "str",
                "dtype",
                "opclass",
                "op",
            ):
                raise self.fail(f"unknown literal kind {_short(k)}")
            v = self._record(raw, ("k", "v"))["v"]
            out.append(self._literal(k, v))

    def _literal(self, k: str, v: Any) -> Any:
        if k == "bool" and type(v) is bool:
            return v
        if k == "int" and type(v) is int:
            return v
        if k == "float":
            if type(v) is float:
                return v
            special = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
            if type(v) is str and v in special:
                return special[v]
        if k == "str" and type(v) is str:
            return v
        if k == "dtype" and type(v) is str:
            dt = DTYPES.get(v)
            if dt is None:
                raise self.fail(f"unknown element type {_short(v)}")
            return dt
        if k == "opclass" and type(v) is str and v:
            return OpClass(v)
        if k == "op":
            return self._ref(v, "ops", "values", "v")
        raise self.fail(f"a {k} literal cannot hold {_json_kind(v)}")

    # --- node tables ---

    def _read_table(self, table: str, rows: list[Any]) -> None:
        out = self.t[table]
        plans = _PLANS[table]
        kinded = table in _KINDED
        get = self._get
        tables = self.t
        checked = self.checked
        sizes = self.size
        size = sizes.get(table)
        depth = self.expr_depth if table == "exprs" else None
        if rows:
            self.at = table
        for i, raw in enumerate(rows):
            self.i = i
            if kinded:
                if type(raw) is not dict:
                    raise self.fail(f"expected an object, got {_json_kind(raw)}")
                k = raw.get("k")
                plan = plans.get(k) if type(k) is str else None
                if plan is None:
                    what = _WHAT[table].split(" ", 1)[1]
                    raise self.fail(f"unknown {what} kind {_short(k)}")
            else:
                plan = plans[None]
            cls, keys, keyset, steps, sized, deep, local = plan
            e = raw if type(raw) is dict and raw.keys() == keyset else self._record(raw, keys)
            # the fields in the dataclass's order (tests/format/test_validation.py checks);
            # what a step accepts as it is is taken here, anything else is decoded (or
            # refused, with its message) by _get
            args = []
            for name, how, sub, ftype in steps:
                v = e[name]
                if how == _REF or how == _OWN:
                    if type(v) is int:
                        t = tables[sub]
                        if 0 <= v < (i if how == _OWN else len(t)):
                            args.append(t[v])
                            continue
                elif how == _NAME:
                    if type(v) is str and v:
                        args.append(v)
                        continue
                elif how == _NAT:
                    if type(v) is int and v >= 0:
                        args.append(v)
                        continue
                elif how != _GET and type(v) is list and len(v) <= MAX_ENTRIES:
                    t = tables[sub]
                    limit = i if how == _OWN_REFS else len(t)
                    got = []
                    for x in v:
                        if type(x) is not int or not 0 <= x < limit:
                            break
                        got.append(t[x])
                    else:
                        args.append(tuple(got))
                        continue
                args.append(get(ftype, v, name, table, i))
            obj = cls(*args)
            out.append(obj)
            if not checked:
                continue
            if local:
                self._check_local(obj)
            # the indices are valid now: account for the depth and the expanded size
            if depth is not None:
                below = 0
                for name, many in deep:
                    if many:
                        for x in e[name]:
                            if depth[x] > below:
                                below = depth[x]
                    elif depth[e[name]] > below:
                        below = depth[e[name]]
                if below + 1 > MAX_EXPR_DEPTH:
                    raise self.fail(
                        f"a guard expression nested deeper than {MAX_EXPR_DEPTH} (MAX_EXPR_DEPTH)"
                    )
                depth.append(below + 1)
            if size is not None:
                n = 1
                for name, tag, sub in sized:
                    v = e[name]
                    if tag == "ref":
                        n += sizes[sub][v]
                    elif tag == "refs":
                        of = sizes[sub]
                        for x in v:
                            n += of[x]
                    else:  # rattrs
                        of = sizes[sub]
                        for a in v:
                            n += of[a["value"]]
                size.append(min(n, MAX_EXPANDED + 1))
            elif table == "defs":
                self.body_index.append(e["body"])
            else:
                self.branch_index.extend((b["guard"], b["result"]) for b in e["branches"])

    def _get(self, ftype: tuple[Any, ...], raw: Any, key: str, table: str, i: int) -> Any:
        tag = ftype[0]
        if tag == "ref":
            return self._ref(raw, ftype[1], table, key, i)
        if tag == "ref?":
            return None if raw is None else self._ref(raw, ftype[1], table, key, i)
        if tag == "refs":
            return tuple(
                self._ref(x, ftype[1], table, key, i) for x in self._bounded_list(raw, key)
            )
        if tag == "refs?":
            return tuple(
                None if x is None else self._ref(x, ftype[1], table, key, i)
                for x in self._bounded_list(raw, key)
            )
        if tag == "args":
            return tuple(
                x if type(x) is str and x else self._ref(x, "ops", table, key, i)
                for x in self._bounded_list(raw, key)
            )
        if tag == "params":
            out = []
            for p in self._bounded_list(raw, key):
                p = self._record(p, ("kind", "name"))
                if type(p["name"]) is not str or not p["name"]:
                    raise self.fail(f"{key}: a parameter name must be a non-empty string")
                if type(p["kind"]) is not str or p["kind"] not in ("term", "op"):
                    raise self.fail(f"{key}: a parameter kind is 'term' or 'op'")
                out.append(Param(p["name"], p["kind"]))
            return tuple(out)
        if tag == "rattrs":
            out = []
            for a in self._bounded_list(raw, key):
                a = self._record(a, ("name", "value"))
                if type(a["name"]) is not str or not a["name"]:
                    raise self.fail(f"{key}: an attribute name must be a non-empty string")
                out.append((a["name"], self._ref(a["value"], "exprs", table, key, i)))
            return tuple(out)
        if tag == "branches":
            out = []
            for b in self._bounded_list(raw, key):
                b = self._record(b, ("guard", "loc", "result"))
                out.append(
                    RuleBranch(
                        self._ref(b["guard"], "exprs", table, key, i),
                        self._ref(b["result"], "rhs", table, key, i),
                        None if b["loc"] is None else self._ref(b["loc"], "locs", table, key, i),
                    )
                )
            return tuple(out)
        problem = _scalar_problem(ftype, raw)
        if problem:
            raise self.fail(f"{key}: {problem}, got {_json_kind(raw)}")
        return raw

    def _check_local(self, obj: Any) -> None:
        """What one entry must satisfy beyond its field types (arity, distinct names), for
        the classes of :data:`_LOCALLY_CHECKED`."""
        match obj:
            case PApp(op, args, index) | RApp(op, args, _, index):
                if op.n_in is not None and len(args) != op.n_in:
                    raise self.fail(f"{op.name} takes {op.n_in} inputs, got {len(args)}")
                if index >= op.n_out:
                    raise self.fail(f"{op.name} has {op.n_out} output(s), no output {index}")
                if isinstance(obj, RApp):
                    names = [n for n, _ in obj.attrs]
                    if len(set(names)) != len(names):
                        raise self.fail(f"an attribute of {op.name} is given twice")
                    unknown = [n for n in names if n not in op.attrs]
                    if unknown:
                        raise self.fail(f"{op.name} has no attribute {_short(unknown[0])}")
            case PFunVar(_, _, index, n_out):
                if max(index + 1, n_out or 0) > MAX_OPERANDS:
                    raise self.fail(
                        f"an operator variable's outputs are limited to {MAX_OPERANDS} "
                        "(MAX_OPERANDS)"
                    )
                if n_out is not None and index >= n_out:
                    raise self.fail(
                        f"output {index} of an operator variable with {n_out} output(s)"
                    )
            case EBin("**", _, right):
                problem = power_problem(right)
                if problem:
                    raise self.fail(problem)
            case PMu(name, params, args, _):
                if len(args) != len(params):
                    raise self.fail(
                        f"μ{_short(name)} has {len(params)} parameter(s) but {len(args)} argument(s)"
                    )
                _check_distinct(params, self.fail)
            case PatternDef(_, params):
                _check_distinct(params, self.fail)


# The entry classes _Reader._check_local has something to check for.
_LOCALLY_CHECKED = frozenset({PApp, RApp, PFunVar, EBin, PMu, PatternDef})
_PLANS: dict[str, dict[str | None, tuple[Any, ...]]] = {
    **{
        table: {k: _plan(table, k, cls, fields) for k, (cls, fields) in kinds.items()}
        for table, kinds in _KINDED.items()
    },
    **{table: {None: _plan(table, None, *_SINGLE[table])} for table in _SINGLE},
}


def _check_distinct(params: tuple[Param, ...], fail: Any) -> None:
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        raise fail("parameter names must be distinct")


# ------------------------------------------------------------------ scoping and recursion


class _Needs:
    """What each sub-structure needs of the scope it is checked in, worked out once per
    object: the variables it reads, as ``("term", x)``, ``("op", F)`` or ``("any", x)`` (a
    guard's read, which a binder of either kind satisfies); None for a pattern holding a
    recursive reference (or a defect inside a μ), whose checks depend on more than the scope.

    Definitions share sub-structures (the writer stores equal ones once), so walking each
    definition's expanded tree visits a shared part at every use; the walks below skip a
    part whose needs the scope meets -- the walk would find nothing wrong in it and leave the
    scope as it found it -- and walk the rest as before, so a defect is reported exactly as
    the full walk reports it. The objects must stay alive while this is used (keyed by id).
    """

    __slots__ = ("memo", "budget")

    def __init__(self, budget: _Budget | None = None) -> None:
        self.memo: dict[int, frozenset[tuple[str, str]] | None] = {}
        self.budget = _Budget(MAX_EXPANDED) if budget is None else budget

    @staticmethod
    def met(needs: frozenset[tuple[str, str]], frame: Mapping[tuple[str, str], int]) -> bool:
        for kind, name in needs:
            if kind == "any":
                if ("term", name) not in frame and ("op", name) not in frame:
                    return False
            elif (kind, name) not in frame:
                return False
        return True

    def of(self, root: Any) -> frozenset[tuple[str, str]] | None:
        """The needs of a pattern, expression or rule result (children first, no recursion)."""
        memo = self.memo
        found = memo.get(id(root), False)
        if found is not False:
            return found
        parts, combine = self._parts, self._combine
        # (x, None): x to visit; (x, its parts): x to combine, its parts visited
        stack: list[tuple[Any, tuple[Any, ...] | None]] = [(root, None)]
        while stack:
            x, kids = stack.pop()
            if id(x) in memo:
                continue
            if kids is None:
                kids = parts(x)
                if kids is None:  # a recursive reference
                    memo[id(x)] = None
                    continue
                if kids:
                    stack.append((x, kids))
                    stack.extend([(k, None) for k in kids if id(k) not in memo])
                    continue
            memo[id(x)] = None  # (while a μ is checked on its own, it is walked)
            memo[id(x)] = combine(x, kids)
        return memo[id(root)]

    @staticmethod
    def _parts(x: Any) -> tuple[Any, ...] | None:
        t = type(x)  # the common classes first, by identity
        if t is PApp:
            return x.args
        if t is PVar or t is EConst or t is EAttr:
            return ()
        if t is PGuard:
            return (x.pat, x.guard)
        if t is PExists:
            return (x.body,)
        if t is PConstr:
            return (x.pat, x.constraint)
        if t is ECmp or t is EBin:
            return (x.left, x.right)
        match x:
            case PCall():
                return None
            case PMu(_, _, _, body):
                return (body,)
            case PGuard(pat, guard):
                return (pat, guard)
            case PVar() | PConst() | RVar() | RConst():
                return ()
            case PApp(_, args) | PFunVar(_, args):
                return args
            case PAlt(left, right):
                return (left, right)
            case PExists(_, body):
                return (body,)
            case PConstr(pat, _, constraint):
                return (pat, constraint)
            case RApp(_, args, attrs):
                return (*args, *(value for _, value in attrs))
            case RTuple(items):
                return items
        return expr_children(x)  # TypeError for anything else: the caller's walk reports it

    def _combine(self, x: Any, kids: tuple[Any, ...]) -> frozenset[tuple[str, str]] | None:
        memo = self.memo
        if type(x) in _NEEDS_KIDS:  # it needs what its parts need
            if not kids:
                return _NO_NEEDS
            first = memo[id(kids[0])]
            if first is None or len(kids) == 1:
                return first
            union = set(first)
            for k in kids[1:]:
                sub = memo[id(k)]
                if sub is None:
                    return None
                union |= sub
            return frozenset(union)
        if type(x) is PMu:  # its body is checked in a scope of its own: its parameters
            body = memo[id(kids[0])]
            if body is None:
                # recursive: check it once on its own, with what its arguments name bound;
                # it fails where it holds a defect or calls an enclosing μ (then the walks
                # of the definitions holding it go through it)
                reads = tuple(
                    Param(a, p.kind)
                    for p, a in zip(x.params, x.args, strict=True)
                    if not isinstance(a, Operator)
                )
                try:
                    _check_pattern_def(PatternDef(x.name, reads, x), "μ", self.budget, self)
                except FormatError:
                    return None
            elif not self.met(body, {(p.kind, p.name): 1 for p in x.params}):
                return None
            needs = set()
            for p, a in zip(x.params, x.args, strict=True):
                if isinstance(a, Operator):
                    if p.kind != "op":
                        return None
                else:
                    needs.add((p.kind, a))
            return frozenset(needs)
        needs: set[tuple[str, str]] = set()
        for k in kids:
            sub = memo[id(k)]
            if sub is None:
                return None
            needs |= sub
        match x:
            case PVar(name) | RVar(name):
                needs.add(("term", name))
            case PFunVar(var):
                needs.add(("op", var))
            case PConstr(_, var):
                needs.add(("term", var))
            case PExists(var, _, kind):
                needs.discard((kind, var))
                needs.discard(("any", var))
            case EAttr(var) | EOpAttr(var):
                needs.add(("any", var))
        return frozenset(needs)


# The classes whose needs are their parts' needs: they bind and read no variable themselves.
_NEEDS_KIDS = frozenset(
    {PApp, PConst, PAlt, PGuard, RConst, RApp, RTuple, EConst, EIndex, EBin, EUnary, ECmp}
    | {EAnd, EOr, ENot, ECall, ETuple}
)
_NO_NEEDS: frozenset[tuple[str, str]] = frozenset()


def _check_pattern_def(
    d: PatternDef, owner: str, budget: _Budget, needs: _Needs | None = None
) -> None:
    """A definition must be closed: free variables are its parameters (of the right kind),
    ``P(..)`` only inside ``μP`` and under an operator application, μ bodies closed. (A
    part whose ``needs`` the scope meets is not walked: it holds no defect.)"""
    needs = _Needs(budget) if needs is None else needs

    def fail(message: str) -> FormatError:
        return FormatError(f"{owner}: {message}")

    frames: list[dict[tuple[str, str], int]] = [{(p.kind, p.name): 1 for p in d.params}]
    mus: dict[str, list[tuple[tuple[Param, ...], int]]] = {}
    apps = 0
    below: dict[Any, bool] = {}  # binds_below's answers, shared by the constraints of d

    def need(kind: str, name: str, what: str) -> None:
        if (kind, name) not in frames[-1]:
            raise fail(f"{what} {_short(name)} is not bound (the definition is not closed)")

    def check_args(name: str, params: tuple[Param, ...], args: tuple[Any, ...]) -> None:
        for p, a in zip(params, args, strict=True):
            if isinstance(a, Operator):
                if p.kind != "op":
                    raise fail(f"{name}: operator {a.name} passed for term parameter {p.name}")
            else:
                need(p.kind, a, f"{'operator' if p.kind == 'op' else 'term'} variable")

    stack: list[Any] = [d.body]
    while stack:
        item = stack.pop()
        if type(item) is tuple:  # a scope marker: leave a binder
            tag = item[0]
            if tag == "unbind":
                frame = frames[-1]
                frame[item[1]] -= 1
                if not frame[item[1]]:
                    del frame[item[1]]
            elif tag == "mu":
                frames.pop()
                mus[item[1]].pop()
            elif tag == "enter":  # a constraint on a proper subterm: as under an application
                apps += 1
            else:  # "app"
                apps -= 1
            continue
        try:
            wants = needs.of(item)
        except TypeError:  # not a pattern: the walk says so
            wants = None
        if wants is not None and needs.met(wants, frames[-1]):
            continue
        budget.spend(owner)
        match item:
            case PVar(name):
                need("term", name, "term variable")
            case PConst():
                pass
            case PApp(_, args):
                stack.append(("app",))
                stack.extend(reversed(args))
                apps += 1
            case PFunVar(var, args):
                need("op", var, "operator variable")
                stack.append(("app",))
                stack.extend(reversed(args))
                apps += 1
            case PAlt(left, right):
                stack += [right, left]
            case PGuard(pat, guard):
                _check_expr(guard, frames[-1], owner, budget, needs)
                stack.append(pat)
            case PExists(var, body, kind):
                key = (kind, var)
                frames[-1][key] = frames[-1].get(key, 0) + 1
                stack += [("unbind", key), body]
            case PConstr(pat, var, constraint):
                need("term", var, "term variable")
                known = len(below)
                consumes = binds_below(pat, var, below)
                budget.spend(owner, len(below) - known)
                if consumes:  # the constraint matches a proper subterm
                    stack += [("app",), constraint, ("enter",), pat]
                else:
                    stack += [constraint, pat]
            case PMu(name, params, args, body):
                check_args(f"μ{name}", params, args)
                frames.append({(p.kind, p.name): 1 for p in params})
                mus.setdefault(name, []).append((params, apps))
                stack += [("mu", name), body]
            case PCall(name, args):
                defs = mus.get(name)
                if not defs:
                    raise fail(f"recursive reference {_short(name)}(...) outside μ{_short(name)}")
                params, apps_at_mu = defs[-1]
                if apps <= apps_at_mu:
                    raise fail(
                        f"{_short(name)} reaches itself without consuming an operator "
                        "application (the recursion would not terminate)"
                    )
                if len(args) != len(params):
                    raise fail(
                        f"{_short(name)} takes {len(params)} argument(s), called with {len(args)}"
                    )
                check_args(name, params, args)
            case _:  # unreachable: decoding builds only calculus patterns
                raise fail(f"not a pattern: {type(item).__name__}")


def _check_expr(
    e: Expr,
    frame: Mapping[tuple[str, str], int],
    owner: str,
    budget: _Budget,
    needs: _Needs | None = None,
) -> None:
    """Every variable a guard reads must be in scope (of either kind: reading a term
    attribute of an operator variable is merely undefined, as in ``_guards``)."""
    if needs is not None:
        try:
            wants = needs.of(e)
        except TypeError:  # not an expression: the walk says so
            wants = None
        if wants is not None and needs.met(wants, frame):
            return
    stack: list[Expr] = [e]
    while stack:
        x = stack.pop()
        budget.spend(owner)
        match x:
            case EAttr(var) | EOpAttr(var):
                if ("term", var) not in frame and ("op", var) not in frame:
                    raise FormatError(
                        f"{owner}: a guard reads {_short(var)}, which is not bound "
                        "(the definition is not closed)"
                    )
        try:
            stack.extend(reversed(expr_children(x)))
        except TypeError:  # unreachable: decoding builds only calculus expressions
            raise FormatError(f"{owner}: not an expression: {type(x).__name__}") from None


def _check_rule(r: RuleDef, owner: str, budget: _Budget, needs: _Needs | None = None) -> None:
    """A rule's guards and results may use only its pattern's parameters."""
    needs = _Needs(budget) if needs is None else needs
    frame = {(p.kind, p.name): 1 for p in r.pattern.params}
    for b in r.branches:
        _check_expr(b.guard, frame, owner, budget, needs)
        try:
            wants = needs.of(b.result)
        except TypeError:  # not a rule result: the walk says so
            wants = None
        if wants is not None and needs.met(wants, frame):
            continue
        stack: list[Rhs] = [b.result]
        while stack:
            x = stack.pop()
            budget.spend(owner)
            match x:
                case RVar(name):
                    if ("term", name) not in frame:
                        raise FormatError(
                            f"{owner}: the result uses {_short(name)}, which is not a term "
                            "parameter of its pattern"
                        )
                case RConst():
                    pass
                case RApp(_, args, attrs):
                    for _, value in attrs:
                        _check_expr(value, frame, owner, budget, needs)
                    stack.extend(reversed(args))
                case RTuple(items):
                    stack.extend(reversed(items))
                case _:
                    raise FormatError(f"{owner}: not a rule result: {type(x).__name__}")


def _user_ops(ops: Any) -> tuple[dict[str, Operator], dict[str, Operator]]:
    """Index the ``ops=`` argument by qualified name and by (unambiguous) plain name."""
    if ops is None:
        return {}, {}
    if isinstance(ops, Mapping):
        by_key: dict[str, Operator] = {}
        for key, op in ops.items():
            if not isinstance(op, Operator):
                raise FormatError(f"ops[{_short(key)}] is not an Operator")
            if type(key) is str:
                by_key[key] = op
        return by_key, by_key
    if isinstance(ops, str | bytes) or not isinstance(ops, Iterable):
        raise FormatError("ops= takes a mapping from names to operators, or operators")
    by_qual: dict[str, Operator] = {}
    by_name: dict[str, Operator] = {}
    ambiguous: set[str] = set()
    for op in ops:
        if not isinstance(op, Operator):
            raise FormatError(f"ops= holds {_short(op)}, which is not an Operator")
        by_qual[op.qualname] = op
        if op.name in by_name and by_name[op.name] is not op:
            ambiguous.add(op.name)
        by_name[op.name] = op
    for name in ambiguous:
        del by_name[name]
    return by_qual, by_name


def deserialize(
    blob: bytes, *, ops: Mapping[str, Operator] | Iterable[Operator] | None = None
) -> list[Item]:
    """The items :func:`serialize` wrote, in order, with equal structure.

    Operators resolve by name: first in ``ops`` (a mapping keyed by qualified or plain name,
    or operators), then in the process registry by qualified name; a found operator must have
    the blob's signature. Unknown operators are recreated from their signature (and not
    registered). Guard functions must be registered in this process. Never executes code
    from the blob; raises :class:`FormatError` — and only that — for anything wrong with it.
    """
    return _read(blob, ops, True)[0]


def _deserialize_pinned(blob: bytes) -> tuple[list[Item], dict[str, Operator]]:
    """:func:`deserialize` of bytes known to be exactly ones it accepted: a blob whose
    digest is pinned in code (the standard rules' shipped data, see
    :mod:`pypm_jax.rules._prebuilt`; any other bytes there are read by :func:`deserialize`).
    The same items, without the checks whose verdict is a function of the blob's bytes
    (scalar limits, expanded sizes and depths, arities, closedness): they held when the
    bytes were pinned. What depends on this process -- operators resolve, with the blob's
    signatures, and guard functions are registered -- is checked as by :func:`deserialize`,
    and anything wrong still raises :class:`FormatError` only. Also returns the operators
    the blob names, by qualified name."""
    items, reader = _read(blob, None, False)
    return items, {op.qualname: op for op in reader.t["ops"]}


def _read(blob: Any, ops: Any, checked: bool) -> tuple[list[Item], _Reader]:
    reader: _Reader | None = None
    loaded = False
    try:
        reader = _Reader(ops, checked)
        items = reader.read(blob)
        loaded = True
        return items, reader
    except FormatError:
        raise
    except RecursionError:
        raise FormatError("malformed pypm blob: nested too deeply") from None
    except MemoryError:
        raise FormatError("pypm blob too large to load in memory") from None
    except Exception as exc:  # the safety net; the checks above should have caught it
        where = reader.where if reader is not None else "the blob"
        raise FormatError(
            f"malformed pypm blob at {where}: {type(exc).__name__}: {_short(str(exc), 200)}"
        ) from exc
    finally:
        if not loaded and reader is not None:
            reader.release()  # what a refused blob made (op classes, ...) goes now
