"""Source-to-source rewriting of pattern and rule bodies before symbolic execution.

The paper's frontend "replaces builtin Python operations with special versions that can be
intercepted". We rewrite the function's AST so that:

* ``assert g``                 → ``__pm__.assert_(g, LINE)``
* ``x <= p`` (a statement)     → ``__pm__.constrain(x, p, LINE)``
* ``if t:`` / ``a if t else b`` → ``if __pm__.branch(t, LINE):`` (every path is explored)
* ``a and b``, ``a or b``       → ``__pm__.and_(LINE, lambda: a, lambda: b)`` (and ``or_``)
* ``not a``                    → ``__pm__.not_(a, LINE)``; ``a in b`` → ``__pm__.in_(...)``
* ``a < b < c``                → a conjunction of single comparisons
* ``f(args)``                  → ``__pm__.call(f, LINE)(args)`` (unknown callees are errors)
* ``name = value``             → ``name = __pm__.named(value, "name")`` (names for var())

Statements with side effects or no symbolic meaning (``global``, ``import``, ``while``,
``try``, ``with``, attribute or item assignment, ``del``, nested definitions) are rejected
with a PatternDefinitionError naming the file and line.
"""

from __future__ import annotations

__all__ = ["transform_function"]

import ast
import inspect
import textwrap
from types import CodeType, FunctionType
from typing import Any

from ..core.errors import PatternDefinitionError, SourceLoc

RT = "__pm__"

_REJECT = {
    ast.Global: "`global` statements",
    ast.Nonlocal: "`nonlocal` statements",
    ast.Import: "imports",
    ast.ImportFrom: "imports",
    ast.While: "`while` loops",
    ast.Try: "`try` statements",
    ast.With: "`with` statements",
    ast.AsyncWith: "`async with` statements",
    ast.AsyncFor: "`async for` loops",
    ast.Delete: "`del` statements",
    ast.Raise: "`raise` statements",
    ast.FunctionDef: "nested function definitions",
    ast.AsyncFunctionDef: "nested function definitions",
    ast.ClassDef: "class definitions",
    ast.Yield: "`yield`",
    ast.YieldFrom: "`yield from`",
    ast.Await: "`await`",
    ast.NamedExpr: "assignment expressions (`:=`)",
}


# Nodes with nothing inside to rewrite or reject (a Name's only child is its context).
_LEAVES = frozenset(
    {ast.Name, ast.Constant, ast.Load, ast.Store, ast.Del}
    | set(ast.operator.__subclasses__())
    | set(ast.cmpop.__subclasses__())
    | set(ast.unaryop.__subclasses__())
    | set(ast.boolop.__subclasses__())
)


def _rt(attr: str) -> ast.expr:
    return ast.Attribute(value=ast.Name(id=RT, ctx=ast.Load()), attr=attr, ctx=ast.Load())


def _call(attr: str, *args: ast.expr) -> ast.Call:
    return ast.Call(func=_rt(attr), args=list(args), keywords=[])


def _lambda(body: ast.expr) -> ast.Lambda:
    noargs = ast.arguments(
        posonlyargs=[],
        args=[],
        vararg=None,
        kwonlyargs=[],
        kw_defaults=[],
        kwarg=None,
        defaults=[],
    )
    return ast.Lambda(args=noargs, body=body)


_POSITION = ("lineno", "col_offset", "end_lineno", "end_col_offset")


def _located(new: ast.AST, anchor: ast.AST) -> Any:
    """``new`` with the nodes this module built (those without a position) placed at
    ``anchor``: what ``ast.fix_missing_locations`` would give them, since each sits under a
    node at ``anchor``'s position, without walking the whole function again."""
    values = [getattr(anchor, a) for a in _POSITION]
    stack = [new]
    while stack:
        node = stack.pop()
        if "lineno" in node._attributes:
            if hasattr(node, "lineno"):
                continue  # the user's code (or already placed): positions of its own
            for a, v in zip(_POSITION, values, strict=True):
                setattr(node, a, v)
        stack.extend(ast.iter_child_nodes(node))
    return new


class _Transformer(ast.NodeTransformer):
    def __init__(self, file: str, lines: list[str]):
        self.file = file
        self.lines = lines

    def _error(self, node: ast.AST, what: str) -> PatternDefinitionError:
        line = getattr(node, "lineno", 0)
        text = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        return PatternDefinitionError(
            f"{what} are not supported in pattern and rule bodies", SourceLoc(self.file, line, text)
        )

    def visit(self, node: ast.AST) -> Any:
        if type(node) in _LEAVES:
            return node
        return super().visit(node)

    def generic_visit(self, node: ast.AST) -> Any:
        what = _REJECT.get(type(node))  # (the parser makes no subclasses)
        if what is not None:
            raise self._error(node, what)
        return super().generic_visit(node)

    def _line(self, node: ast.AST) -> ast.Constant:
        return ast.Constant(getattr(node, "lineno", 0))

    # statements -------------------------------------------------------------------
    def visit_Assert(self, node: ast.Assert) -> ast.stmt:
        test = self.visit(node.test)
        stmt = ast.Expr(_call("assert_", test, self._line(node)))
        return _located(stmt, node)

    def visit_Expr(self, node: ast.Expr) -> ast.stmt:
        v = node.value
        if isinstance(v, ast.Compare) and len(v.ops) == 1 and isinstance(v.ops[0], ast.LtE):
            left = self.visit(v.left)
            right = self.visit(v.comparators[0])
            return _located(ast.Expr(_call("constrain", left, right, self._line(node))), node)
        return self.generic_visit(node)

    def visit_If(self, node: ast.If) -> ast.stmt:
        node.test = _located(_call("branch", self.visit(node.test), self._line(node)), node)
        node.body = [self.visit(s) for s in node.body]
        node.orelse = [self.visit(s) for s in node.orelse]
        return node

    def visit_Assign(self, node: ast.Assign) -> ast.stmt:
        for target in node.targets:
            self._check_target(target)
        node.value = self.visit(node.value)
        if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            named = _call("named", node.value, ast.Constant(node.targets[0].id))
            node.value = _located(named, node.value)
        return node

    def visit_AugAssign(self, node: ast.AugAssign) -> ast.stmt:
        self._check_target(node.target)
        return self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.stmt:
        self._check_target(node.target)
        node.annotation = _located(ast.Constant(None), node)
        if node.value is not None:
            node.value = self.visit(node.value)
        return node

    def _check_target(self, target: ast.expr) -> None:
        if isinstance(target, ast.Attribute | ast.Subscript):
            raise self._error(target, "assignments to attributes or items (side effects)")
        if isinstance(target, ast.Tuple | ast.List):
            for t in target.elts:
                self._check_target(t)

    # expressions ------------------------------------------------------------------
    def visit_IfExp(self, node: ast.IfExp) -> ast.expr:
        test = _call("branch", self.visit(node.test), self._line(node))
        return _located(
            ast.IfExp(test=test, body=self.visit(node.body), orelse=self.visit(node.orelse)), node
        )

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.expr:
        fn = "and_" if isinstance(node.op, ast.And) else "or_"
        thunks = [_lambda(self.visit(v)) for v in node.values]
        return _located(_call(fn, self._line(node), *thunks), node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.expr:
        if isinstance(node.op, ast.Not):
            return _located(_call("not_", self.visit(node.operand), self._line(node)), node)
        return self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> ast.expr:
        left = self.visit(node.left)
        comparators = [self.visit(c) for c in node.comparators]
        parts: list[ast.expr] = []
        for op, right in zip(node.ops, comparators, strict=True):
            if isinstance(op, ast.In | ast.NotIn | ast.Is | ast.IsNot):
                name = {ast.In: "in_", ast.NotIn: "not_in", ast.Is: "is_", ast.IsNot: "is_not"}[
                    type(op)
                ]
                parts.append(_call(name, left, right))
            else:
                parts.append(ast.Compare(left=left, ops=[op], comparators=[right]))
            left = right
        if len(parts) == 1:
            return _located(parts[0], node)
        return _located(_call("and_", self._line(node), *[_lambda(p) for p in parts]), node)

    def visit_Call(self, node: ast.Call) -> ast.expr:
        func = self.visit(node.func)
        node.func = _located(_call("call", func, self._line(node)), node.func)
        node.args = [self.visit(a) for a in node.args]
        node.keywords = [self.visit(k) for k in node.keywords]
        return node

    def visit_Lambda(self, node: ast.Lambda) -> Any:
        raise self._error(node, "lambdas")


def _code_objects(code: CodeType) -> set[CodeType]:
    found = {code}
    for const in code.co_consts:
        if isinstance(const, CodeType):
            found |= _code_objects(const)
    return found


def _source_lines(fn: FunctionType) -> tuple[list[str], int]:
    """``inspect.getsourcelines(fn)``, with the end of the definition read from a parse of
    its file (once per file) instead of tokenizing the file from the definition on."""
    lines, start = inspect.findsource(inspect.unwrap(fn))
    end = _definition_ends(lines).get(start + 1)
    block = lines[start:end] if end is not None else inspect.getblock(lines[start:])
    return block, start + 1


_ENDS: dict[int, tuple[list[str], dict[int, int]]] = {}


def _definition_ends(lines: list[str]) -> dict[int, int]:
    """First line (its first decorator's) -> last line of each function defined in a file's
    source; cached per source object (``linecache`` keeps one list per file version)."""
    hit = _ENDS.get(id(lines))
    if hit is not None and hit[0] is lines:
        return hit[1]
    ends: dict[int, int] = {}
    try:
        stack: list[Any] = list(ast.parse("".join(lines)).body)
    except (SyntaxError, ValueError):
        stack = []
    while stack:  # statements only: definitions cannot hide inside expressions
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno:
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            ends[first] = node.end_lineno
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            stack.extend(getattr(node, field, ()))
    if len(_ENDS) >= 64:
        _ENDS.clear()
    _ENDS[id(lines)] = (lines, ends)
    return ends


def transform_function(
    fn: FunctionType, runtime: Any
) -> tuple[FunctionType, set[CodeType], SourceLoc, list[str]]:
    """Rewrite ``fn``'s body; return the new function, its code objects, its location and the
    source lines of its file (for error messages and guard texts)."""
    try:
        source_lines, first_line = _source_lines(fn)
    except (OSError, TypeError) as exc:
        raise PatternDefinitionError(
            f"cannot read the source of {fn.__qualname__}: patterns must be defined in a file "
            f"({exc})"
        ) from None
    file = inspect.getsourcefile(fn) or fn.__code__.co_filename
    try:
        all_lines = (
            inspect.getsourcelines(inspect.getmodule(fn))[0] if inspect.getmodule(fn) else []
        )
    except (OSError, TypeError):
        all_lines = []
    if not all_lines:
        all_lines = [""] * (first_line - 1) + source_lines
    # blank lines in front put every node at its line in the file
    tree = ast.parse("\n" * (first_line - 1) + textwrap.dedent("".join(source_lines)))
    fdef = tree.body[0]
    if not isinstance(fdef, ast.FunctionDef):
        raise PatternDefinitionError(f"{fn.__qualname__} is not a plain function definition")
    fdef.decorator_list = []
    args = fdef.args
    if args.vararg or args.kwarg or args.kwonlyargs or args.posonlyargs:
        raise PatternDefinitionError(
            "patterns and rules take plain positional parameters only",
            SourceLoc(file, fdef.lineno, all_lines[fdef.lineno - 1] if all_lines else ""),
        )
    transformer = _Transformer(file, all_lines)
    fdef.body = [transformer.visit(s) for s in fdef.body]  # (new nodes placed as built)
    code = compile(tree, file, "exec")
    namespace: dict[str, Any] = dict(fn.__globals__)
    if fn.__closure__:
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__, strict=True):
            try:
                namespace[name] = cell.cell_contents
            except ValueError:  # a cell not filled yet
                pass
    namespace[RT] = runtime
    missing = object()
    shadowed = namespace.get(fdef.name, missing)
    exec(code, namespace)  # noqa: S102 — our own rewritten copy of the user's function
    new_fn = namespace.pop(fdef.name)
    if shadowed is not missing:  # the body may refer to its own name (recursion)
        namespace[fdef.name] = shadowed
    loc = SourceLoc(file, fdef.lineno, all_lines[fdef.lineno - 1] if all_lines else "")
    return new_fn, _code_objects(new_fn.__code__), loc, all_lines
