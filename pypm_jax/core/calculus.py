"""The core calculus (CorePyPM) as immutable data, printed in the paper's notation.

Grammar (appendix, "Grammar of Terms and Patterns"), with the paper's names:

    p ::= x                        PVar
        | f(p1, ..., pn)           PApp      (index selects one output of a multi-output op)
        | c                        PConst    (a literal: a 0-ary function symbol)
        | p ‖ p'                   PAlt
        | p ; guard(g)             PGuard
        | ∃x. p                    PExists   (kind "op" for local operator variables)
        | p ; (x ≈ p')             PConstr   (match constraint ``x <= p'``)
        | F(p1, ..., pn)           PFunVar   (operator-variable application)
        | μP(x1..xn)[y1..yn]. p    PMu       (recursive pattern, instantiated at y1..yn)
        | P(y1, ..., yn)           PCall     (the recursive reference inside a μ body)

Guards and expressions share one union ``Expr``; a guard is an expression whose value must be
``True``. Variable names chosen by the machine for fresh copies of bound variables contain
``#`` and so never clash with names users write.
"""

from __future__ import annotations

__all__ = [
    "Pattern",
    "PVar",
    "PApp",
    "PConst",
    "PAlt",
    "PGuard",
    "PExists",
    "PConstr",
    "PFunVar",
    "PMu",
    "PCall",
    "Expr",
    "EConst",
    "EAttr",
    "EOpAttr",
    "EIndex",
    "EBin",
    "EUnary",
    "ECmp",
    "EAnd",
    "EOr",
    "ENot",
    "ECall",
    "ETuple",
    "Arg",
    "Param",
    "PatternDef",
    "RuleDef",
    "RuleBranch",
    "Rhs",
    "RVar",
    "RApp",
    "RConst",
    "RTuple",
    "GuardFn",
    "show",
    "show_expr",
    "children",
    "expr_children",
    "binds_below",
    "alts",
]

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from .errors import SourceLoc
from .terms import Operator

# ------------------------------------------------------------------ equality and hashing


class _Node:
    """Structural equality and hashing for expressions, patterns and results, as the
    dataclass methods define them (fields with ``compare=False`` ignored), but computed with
    an explicit work list: a 10,000-deep pattern compares and hashes like a shallow one, and
    a hash is computed once per node and cached."""

    __slots__ = ("_hash",)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not type(self):
            return NotImplemented
        return _equal(self, other)

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:
            return _hash_node(self)


_COMPARED: dict[type, tuple[str, ...]] = {}


def _compared(cls: type) -> tuple[str, ...]:
    names = _COMPARED.get(cls)
    if names is None:
        names = _COMPARED[cls] = tuple(f.name for f in fields(cls) if f.compare)
    return names


def _equal(a: _Node, b: _Node) -> bool:
    todo: list[tuple[Any, Any]] = [(a, b)]
    seen: set[tuple[int, int]] = set()  # node pairs already compared (shared sub-patterns)
    while todo:
        x, y = todo.pop()
        if x is y:
            continue
        if isinstance(x, _Node) or isinstance(y, _Node):
            if type(x) is not type(y):
                return False
            hx, hy = getattr(x, "_hash", None), getattr(y, "_hash", None)
            if hx is not None and hy is not None and hx != hy:
                return False
            if (id(x), id(y)) in seen:
                continue
            seen.add((id(x), id(y)))
            todo.extend((getattr(x, f), getattr(y, f)) for f in reversed(_compared(type(x))))
        elif type(x) is tuple and type(y) is tuple:
            if len(x) != len(y):
                return False
            todo.extend(zip(reversed(x), reversed(y), strict=True))
        elif not x == y:
            return False
    return True


def _sub_nodes(value: Any) -> list[_Node]:
    """The nodes a field value holds: itself, or those in a (nested) tuple."""
    if isinstance(value, _Node):
        return [value]
    if type(value) is not tuple:
        return []
    out: list[_Node] = []
    todo = [value]
    while todo:
        for v in todo.pop():
            if isinstance(v, _Node):
                out.append(v)
            elif type(v) is tuple:
                todo.append(v)
    return out


def _hash_key(value: Any) -> Any:
    """A field value with every node in it replaced by its (already computed) hash."""
    if isinstance(value, _Node):
        return value._hash
    if type(value) is tuple:
        return tuple(_hash_key(v) for v in value)  # nests only as deep as a literal
    return value


def _hash_node(root: _Node) -> int:
    """Hash ``root`` and every node under it that has no hash yet, children first."""
    stack: list[_Node] = [root]
    while stack:
        node = stack[-1]
        if hasattr(node, "_hash"):
            stack.pop()
            continue
        names = _compared(type(node))
        pending = [
            c for f in names for c in _sub_nodes(getattr(node, f)) if not hasattr(c, "_hash")
        ]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        h = hash((type(node), *(_hash_key(getattr(node, f)) for f in names)))
        object.__setattr__(node, "_hash", h)
    return root._hash


# --------------------------------------------------------------------------- expressions


@dataclass(frozen=True, slots=True, eq=False)
class EConst(_Node):
    value: Any  # int, float, bool, str, DType, OpClass, Operator, tuple, None


@dataclass(frozen=True, slots=True, eq=False)
class EAttr(_Node):
    """``x.α``: attribute α of the term bound to variable x."""

    var: str
    attr: str


@dataclass(frozen=True, slots=True, eq=False)
class EOpAttr(_Node):
    """``F.α``: attribute of the operator bound to operator variable F (``op_class``, ``name``)."""

    var: str
    attr: str


@dataclass(frozen=True, slots=True, eq=False)
class EIndex(_Node):
    base: Expr
    index: Expr


@dataclass(frozen=True, slots=True, eq=False)
class EBin(_Node):
    op: Literal["+", "-", "*", "/", "//", "%", "**"]
    left: Expr
    right: Expr


@dataclass(frozen=True, slots=True, eq=False)
class EUnary(_Node):
    op: Literal["-", "+"]
    operand: Expr


@dataclass(frozen=True, slots=True, eq=False)
class ECmp(_Node):
    op: Literal["==", "!=", "<", "<=", ">", ">=", "in", "not in"]
    left: Expr
    right: Expr


@dataclass(frozen=True, slots=True, eq=False)
class EAnd(_Node):
    items: tuple[Expr, ...]


@dataclass(frozen=True, slots=True, eq=False)
class EOr(_Node):
    items: tuple[Expr, ...]


@dataclass(frozen=True, slots=True, eq=False)
class ENot(_Node):
    operand: Expr


@dataclass(frozen=True, slots=True, eq=False)
class ETuple(_Node):
    items: tuple[Expr, ...]


@dataclass(frozen=True, slots=True)
class GuardFn:
    """A pure function guards may call, known by name (``len``, ``min``, kernel predicates).

    Guards stay data: a serialized guard names the function; loading resolves the name among
    functions registered in the loading process and never runs code from the blob.
    """

    name: str
    fn: Any = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True, eq=False)
class ECall(_Node):
    fn: GuardFn
    args: tuple[Expr, ...]


Expr = EConst | EAttr | EOpAttr | EIndex | EBin | EUnary | ECmp | EAnd | EOr | ENot | ECall | ETuple


def expr_children(e: Expr) -> tuple[Expr, ...]:
    """The sub-expressions of ``e``, left to right: the one place that knows each
    expression's children (a walker that only visits them needs nothing else)."""
    match e:
        case EConst() | EAttr() | EOpAttr():
            return ()
        case EIndex(base, index):
            return (base, index)
        case EBin(_, left, right) | ECmp(_, left, right):
            return (left, right)
        case EUnary(_, operand) | ENot(operand):
            return (operand,)
        case EAnd(items) | EOr(items) | ETuple(items) | ECall(_, items):
            return items
    raise TypeError(f"not an expression: {e!r}")


# ------------------------------------------------------------------------------ patterns


@dataclass(frozen=True, slots=True, eq=False)
class PVar(_Node):
    name: str


@dataclass(frozen=True, slots=True, eq=False)
class PApp(_Node):
    op: Operator
    args: tuple[Pattern, ...]
    index: int = 0


@dataclass(frozen=True, slots=True, eq=False)
class PConst(_Node):
    value: Any


@dataclass(frozen=True, slots=True, eq=False)
class PAlt(_Node):
    left: Pattern
    right: Pattern


@dataclass(frozen=True, slots=True, eq=False)
class PGuard(_Node):
    pat: Pattern
    guard: Expr
    loc: SourceLoc | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True, eq=False)
class PExists(_Node):
    var: str
    body: Pattern
    kind: Literal["term", "op"] = "term"


@dataclass(frozen=True, slots=True, eq=False)
class PConstr(_Node):
    """``p ; (x ≈ p')``: after p matched, the term bound to x must match p'."""

    pat: Pattern
    var: str
    constraint: Pattern
    loc: SourceLoc | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True, eq=False)
class PFunVar(_Node):
    """``F(p1..pn)``: any operator with n inputs (and ``n_out`` outputs, if given)."""

    var: str
    args: tuple[Pattern, ...]
    index: int = 0
    n_out: int | None = None


# An argument of a recursive instantiation: a (term or operator) variable name, or a
# concrete operator passed for an operator parameter.
Arg = str | Operator


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    kind: Literal["term", "op"] = "term"


@dataclass(frozen=True, slots=True, eq=False)
class PMu(_Node):
    """``μP(x1..xn)[y1..yn]. body`` — the definition P instantiated at y1..yn."""

    name: str
    params: tuple[Param, ...]
    args: tuple[Arg, ...]
    body: Pattern


@dataclass(frozen=True, slots=True, eq=False)
class PCall(_Node):
    """``P(y1..yn)``: a reference to the enclosing μ-bound pattern P."""

    name: str
    args: tuple[Arg, ...]


Pattern = PVar | PApp | PConst | PAlt | PGuard | PExists | PConstr | PFunVar | PMu | PCall


def children(p: Pattern, *, into_mu: bool = True) -> tuple[Pattern, ...]:
    """The sub-patterns of ``p``, in the order the machine matches them (a definition's body
    only with ``into_mu``): the one place that knows each construct's children."""
    match p:
        case PApp(_, args, _) | PFunVar(_, args, _, _):
            return args
        case PAlt(left, right):
            return (left, right)
        case PGuard(pat, _) | PExists(_, pat, _):
            return (pat,)
        case PConstr(pat, _, constraint):
            return (pat, constraint)
        case PMu(_, _, _, body):
            return (body,) if into_mu else ()
    return ()


# One question binds_below asks: does every match of a pattern bind (or check) a variable,
# strictly under an application or anywhere? Answers are keyed by the pattern's id.
_Question = tuple[Pattern, str, bool]


def binds_below(p: Pattern, var: str, memo: dict[Any, bool] | None = None) -> bool:
    """Does every match of ``p`` against a term t bind (or check) the term variable ``var`` to
    a *proper* subterm of t -- somewhere under an operator application of ``p``?

    Then a match constraint ``p ; (var ≈ q)`` matches q against a proper subterm, so a
    recursive reference in q consumes structure just as one under an application does
    (``y <= f(x); x <= P()``). A variable bound outside ``p`` and checked under an
    application of ``p`` counts: the check demands it equal that subterm. A definition
    instantiated with ``var`` as an argument binds it where its body binds that parameter.
    Conservative: False where unsure (recursive references, which may or may not bind
    their arguments).

    Each question (sub-pattern, variable, below) is answered once, with an explicit stack,
    so the cost is linear in the sub-patterns times the variables asked about, whatever the
    depth (the plain recursive definition is exponential in chained constraints). Calls on
    sub-patterns of one pattern, alive meanwhile, may share ``memo``.
    """
    memo = {} if memo is None else memo
    stack: list[_Question] = [(p, var, True)]
    while stack:
        q = stack[-1]
        key = (id(q[0]), q[1], q[2])
        if key in memo:
            stack.pop()
            continue
        answer = _binds(q, memo)
        if isinstance(answer, bool):
            memo[key] = answer
            stack.pop()
        else:
            stack.append(answer)
    return memo[(id(p), var, True)]


def _binds(q: _Question, memo: dict[Any, bool]) -> bool | _Question:
    """Does every match of the pattern bind (or check) the variable -- strictly under an
    application of the pattern if ``below``, anywhere (the root included) otherwise? The
    answer, or the first sub-question it needs that ``memo`` does not answer yet."""
    p, var, below = q

    def ask(sub: Pattern, v: str, b: bool) -> bool | _Question:
        known = memo.get((id(sub), v, b))
        return (sub, v, b) if known is None else known

    match p:
        case PVar(x):
            return not below and x == var
        case PApp(_, args, _) | PFunVar(_, args, _, _):
            for a in args:
                answer = ask(a, var, False)
                if answer is not False:
                    return answer
            return False
        case PAlt(left, right):
            answer = ask(left, var, below)
            return answer if answer is not True else ask(right, var, below)
        case PGuard(pat, _):
            return ask(pat, var, below)
        case PExists(x, pat, kind):
            return not (x == var and kind == "term") and ask(pat, var, below)
        case PConstr(pat, x, c):
            # c matches x's term: what c binds below it is below too. The (small) constraint
            # is asked first: only if c binds var does x's place in pat matter.
            if below:
                answer = ask(c, var, True)
                if answer is not False:
                    return answer
            answer = ask(c, var, False)
            if answer is True:
                answer = ask(pat, x, below)
            if answer is not False:
                return answer
            return ask(pat, var, below)
        case PMu(_, params, args, body):
            # a definition instantiated with var as an argument binds var wherever its body
            # binds that parameter (``UnaryOp(t)`` whose body is ``f(t)``: below). Its own
            # recursive references (``PCall``) stay unsure.
            for param, arg in zip(params, args, strict=True):
                if arg == var and param.kind == "term":
                    answer = ask(body, param.name, below)
                    if answer is not False:
                        return answer
            return False
    return False


def alts(p: Pattern) -> list[Pattern]:
    """The alternates of a right-nested ``PAlt`` chain, in order."""
    out = []
    while isinstance(p, PAlt):
        out.append(p.left)
        p = p.right
    out.append(p)
    return out


# ------------------------------------------------------------------- definitions and rules


@dataclass(frozen=True, slots=True)
class PatternDef:
    """A named pattern: parameters and a closed core pattern (free variables = parameters).

    ``body`` is ``PMu(name, params, params, alternates)`` when the pattern is recursive or
    calls other patterns, else the alternates themselves.
    """

    name: str
    params: tuple[Param, ...]
    body: Pattern
    loc: SourceLoc | None = field(default=None, compare=False)
    alt_locs: tuple[SourceLoc | None, ...] = field(default=(), compare=False)


@dataclass(frozen=True, slots=True, eq=False)
class RVar(_Node):
    name: str


@dataclass(frozen=True, slots=True, eq=False)
class RConst(_Node):
    value: Any


@dataclass(frozen=True, slots=True, eq=False)
class RApp(_Node):
    """A replacement node: ``op(args...)`` with attribute values given as expressions."""

    op: Operator
    args: tuple[Rhs, ...]
    attrs: tuple[tuple[str, Expr], ...] = ()
    index: int = 0


@dataclass(frozen=True, slots=True, eq=False)
class RTuple(_Node):
    items: tuple[Rhs, ...]


Rhs = RVar | RConst | RApp | RTuple


@dataclass(frozen=True, slots=True)
class RuleBranch:
    """One path through a rule body: its condition (asserts and branch tests) and result.

    ``guard_locs`` says where each condition was written (the ``assert`` or ``if`` line), so
    an explanation can point at the one that failed: one location for a guard that is a
    single condition, one per item when the guard is the conjunction ``EAnd`` of several,
    none for an unconditional branch (or one loaded from a blob that predates them).
    """

    guard: Expr
    result: Rhs
    loc: SourceLoc | None = field(default=None, compare=False)
    guard_locs: tuple[SourceLoc | None, ...] = field(default=(), compare=False)


@dataclass(frozen=True, slots=True)
class RuleDef:
    name: str
    pattern: PatternDef
    branches: tuple[RuleBranch, ...]
    single_use: bool = False
    loc: SourceLoc | None = field(default=None, compare=False)


# ------------------------------------------------------------------------------ printing

_PREC = {
    "or": 1,
    "and": 2,
    "not": 3,
    "cmp": 4,
    "+": 5,
    "-": 5,
    "*": 6,
    "/": 6,
    "//": 6,
    "%": 6,
    "**": 7,
}


def show_expr(e: Expr) -> str:
    """An expression in (Python-like) guard notation: ``x.rank == 2 ∧ y.dtype == f32``."""
    match e:
        case EConst(value):
            return repr(value)
        case EAttr(var, attr) | EOpAttr(var, attr):
            return f"{var}.{attr}"
        case EIndex(base, index):
            return f"{show_expr(base)}[{show_expr(index)}]"
        case EBin(op, left, right):
            return f"({show_expr(left)} {op} {show_expr(right)})"
        case EUnary(op, operand):
            return f"{op}{show_expr(operand)}"
        case ECmp(op, left, right):
            return f"{show_expr(left)} {'=' if op == '==' else op} {show_expr(right)}"
        case EAnd(items):
            return "(" + " ∧ ".join(show_expr(i) for i in items) + ")"
        case EOr(items):
            return "(" + " ∨ ".join(show_expr(i) for i in items) + ")"
        case ENot(operand):
            return f"¬{show_expr(operand)}"
        case ECall(fn, args):
            return f"{fn.name}({', '.join(show_expr(a) for a in args)})"
        case ETuple(items):
            inner = ", ".join(show_expr(i) for i in items)
            return f"({inner}{',' if len(items) == 1 else ''})"
    raise TypeError(f"not an expression: {e!r}")


def _show_arg(a: Arg) -> str:
    return a if isinstance(a, str) else a.name


def show(p: Pattern, width: int | None = None) -> str:
    """A pattern in the paper's notation; with ``width``, only its first ``width + 1``
    characters, rendered in O(width). A loop, not a recursion: a pattern 10 000 levels deep
    is shown like a shallow one."""
    out: list[str] = []
    size = 0
    todo: list[Pattern | str] = [p]
    while todo and (width is None or size <= width):
        q = todo.pop()
        if isinstance(q, str):
            out.append(q)
            size += len(q)
        else:
            todo.extend(reversed(_show_parts(q)))
    text = "".join(out)
    return text if width is None else text[: width + 1]


def _show_parts(p: Pattern) -> list[Pattern | str]:
    """``p``'s printed form as text and sub-patterns still to print, in order."""
    match p:
        case PVar(name):
            return [name]
        case PApp(op, args, index):
            return [f"{op.name}(", *_joined(args), f"){f'#{index}' if op.n_out > 1 else ''}"]
        case PConst(value):
            return [repr(value)]
        case PAlt(left, right):
            return ["(", left, " ‖ ", right, ")"]
        case PGuard(pat, guard):
            return [pat, f" ; guard({show_expr(guard)})"]
        case PExists(var, body, _):
            return [f"∃{var}. ", body]
        case PConstr(pat, var, constraint):
            return [pat, f" ; ({var} ≈ ", constraint, ")"]
        case PFunVar(var, args, index, _):
            return [f"{var}(", *_joined(args), f"){f'#{index}' if index else ''}"]
        case PMu(name, params, args, body):
            ps = ", ".join(x.name for x in params)
            ys = ", ".join(_show_arg(a) for a in args)
            return [f"μ{name}({ps})[{ys}]. ", body]
        case PCall(name, args):
            return [f"{name}({', '.join(_show_arg(a) for a in args)})"]
    raise TypeError(f"not a pattern: {p!r}")


def _joined(args: tuple[Pattern, ...]) -> list[Pattern | str]:
    parts: list[Pattern | str] = []
    for i, a in enumerate(args):
        if i:
            parts.append(", ")
        parts.append(a)
    return parts
