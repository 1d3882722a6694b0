"""Greedy, destructive, deterministic rewriting of a :class:`~pypm_jax.core.graph.Graph`.

The driver visits nodes in topological order (inputs first). At a node it tries the rules
in list order — only those whose pattern can be rooted at the node's operator and whose
branches' guards allow it, found with one dict lookup, and (where there are more than two)
whose pre-checks admit the node's signature, its inputs' operators and arities
(:class:`~pypm_jax.engine.index.ByInputs`) — and for each rule the solutions of
its pattern in the machine's order, and for each solution the rule's branches in order:
the first branch whose guard holds fires.
(The fast engine matches a rule of one guarded branch as its pattern with the guard joined
in, :func:`guarded_pattern`: same solutions, same order, but a match the guard refuses is
dropped inside the compiled matcher.) Firing builds the branch's result, makes every reader
of the matched root read it instead, and removes what became dead. Interior values that
something outside the match still reads stay alive; a rule with ``single_use=True`` only
fires when no interior value has such a reader -- except values computed from literals
alone, and values a caller declares cheap to share (``shareable``: the JAX layer's mask
plumbing, which several attention layers read).

A single-use rule's search leaves out the matches that single use would refuse whatever
else they cover: those covering a *doomed* value, one that something outside every match at
the root reads (a graph output, or a node the root does not read, directly or not, found
with ranks that grow along every edge) and that is neither computed from literals nor
``shareable``. The matcher skips the search below such a value (``MatchRun.forbid``, honoured
by the iterative machine, made as that machine starts), and does not start where the rule's
anchor lies only below such values (``anchored``). What fires, and which roots a refusal
blocks, stay those of the full search: a solution that would fire once something was left
out sends the rule's search round again in full; a search that left something out of a root
nothing blocked is decided by the full search before the graph next changes, unless that
change removes the root. The
match budget counts the steps of the search the driver runs, so leaving matches out can keep
within the budget a search that the full one would exceed, and the guards of left-out matches
are not evaluated (a guard function that raises only there is not reported).

After a rewrite only what is near the change is looked at again: the new nodes (next, before
the sweep goes on), the nodes whose inputs changed and their users up to the depth of the
deepest pattern, and roots that a single-use rule had to skip. The sweep itself never starts
over, so a graph where a few rewrites fire costs about one pass of matching.

A match that runs past ``match_budget`` machine steps at a node (default
:data:`MATCH_BUDGET`) is a ``RuntimeWarning`` naming the rule, its source line and the node;
that rule is skipped at that node for the rest of the run, and rewriting goes on.

A rule set that never settles (``A → B`` and ``B → A``) stops after ``max_iterations``
rewrites with a :class:`~pypm_jax.core.errors.RewriteLimitError` naming the rules of the cycle.

A result that cannot be built is a :class:`~pypm_jax.core.errors.RuleError` naming the rule and
its source line; with ``check_types`` (the JAX layer's setting) so is a replacement whose
shape, dtype or weak type (where the caller can tell) differs from the value it replaces,
where both are known. A run that raises leaves the graph exactly as it was.
"""

from __future__ import annotations

__all__ = [
    "RewriteRecord",
    "RewriteReport",
    "RewriteResult",
    "guarded_pattern",
    "printable",
    "rewrite",
    "rewrite_terms",
]

import dataclasses
import heapq
import itertools
import logging
import operator
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.calculus import (
    EAttr,
    ECall,
    EConst,
    EOpAttr,
    PAlt,
    PApp,
    Pattern,
    PatternDef,
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
    show_expr,
)
from ..core.errors import (
    GuardFunctionWarning,
    MatchBudgetError,
    PyPMError,
    RewriteLimitError,
    RuleError,
    SourceLoc,
)
from ..core.graph import NO_ATTRS, Graph, Node, Value, show_type
from ..core.terms import CONST, LEAF, Term
from ..lang.registry import collect_guard_failures
from ..semantics.guards import Undefined, bound_attr, bound_op_attr, eval_expr, guard_holds
from ..semantics.subst import FreshNames, unfold
from . import report as _report
from .analysis import _ByIdentity, _expr_names, admits, has_recursion, rule_anchor, rule_roots
from .compiled import _compiled
from .fast import CompiledPattern, Matcher, MatchRun, compile_guard
from .guard_code import _compiled_guards
from .index import ByInputs, signature
from .report import Built
from .select import ENGINES, default_engine

log = logging.getLogger("pypm_jax.rewrite")

# A run still going after PROGRESS_SECONDS logs its progress (INFO, logger
# "pypm_jax.rewrite"), and again every PROGRESS_SECONDS. The clock is read every
# _PROGRESS_STRIDE visits and every _PROGRESS_STEPS machine steps of a match.
PROGRESS_SECONDS = 5.0
_PROGRESS_STRIDE = 1024
_PROGRESS_STEPS = 16384

# Machine steps one rule's match may take at one node (``rewrite(match_budget=)``; None:
# unbounded). A match past it is given up with a warning (see the module docstring).
MATCH_BUDGET = 1_000_000


class _Default:
    """``rewrite(match_budget=)`` not given: MATCH_BUDGET as it is when rewrite runs."""


_DEFAULT = _Default()

# ----------------------------------------------------------------------------- the report


def printable(text: str) -> str:
    """``text`` with control characters, line and paragraph separators, lone surrogates and
    other unprintable characters escaped as Python writes them (``\\n``, ``\\ud800``): names
    are data, and a rule or operator name must not start a line of a printed report."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


@dataclass(frozen=True, slots=True)
class RewriteRecord:
    """One rewrite: which rule fired, at which node, replacing which nodes, from where."""

    rule: str
    pattern: str
    root: int  # id of the node whose value was replaced
    replaced: tuple[int, ...]  # ids of the nodes the match covered (root first)
    source: SourceLoc | None  # where the program wrote the root node
    module_path: str | None  # e.g. the Flax module of the root node
    op: str = ""  # the root node's operator
    created: tuple[int, ...] = ()  # ids of the nodes the rewrite added
    # the nodes the rewrite added (operator, attributes, type), for the report's kernel columns
    built: tuple[Built, ...] = dataclasses.field(default=(), compare=False)
    detail: str = ""  # what the built nodes' operators describe (``Operator.describe``)

    def __str__(self) -> str:
        where = f" at {self.source}" if self.source is not None else ""
        module = f" [{self.module_path}]" if self.module_path else ""
        detail = f": {self.detail}" if self.detail else ""
        return printable(
            f"{self.rule} ({self.pattern}) replaced %{self.root} {self.op}{where}{module}{detail}"
        )


class _Unfrozen:
    """A :class:`RewriteRecord`'s slots without the frozen dataclass's ``__setattr__``:
    ``_record`` fills one, then makes it the record it is (the same slots in the same
    order, so Python allows the ``__class__`` change)."""

    __slots__ = RewriteRecord.__slots__


def _record(
    rule: str,
    pattern: str,
    root: int,
    replaced: tuple[int, ...],
    source: SourceLoc | None,
    module_path: str | None,
    op: str,
    created: tuple[int, ...],
    built: tuple[Built, ...],
    detail: str,
) -> RewriteRecord:
    """``RewriteRecord(...)`` made at a fifth of the cost of the frozen dataclass's
    ``__init__`` (the driver makes one per rewrite): each slot set as on a plain object."""
    r = _Unfrozen()
    r.rule = rule
    r.pattern = pattern
    r.root = root
    r.replaced = replaced
    r.source = source
    r.module_path = module_path
    r.op = op
    r.created = created
    r.built = built
    r.detail = detail
    r.__class__ = RewriteRecord  # type: ignore[assignment]
    return r  # type: ignore[return-value]


def _built(op: Any, attrs: Any, type_text: str) -> Built:
    """``Built(op, attrs, type_text)`` without the named tuple's ``__new__`` call."""
    return tuple.__new__(Built, (op, attrs, type_text))


class RewriteReport(list[RewriteRecord]):
    """The rewrites in the order they fired.

    ``str()`` is a table at most 100 columns wide: rule, kernel, its shape/dtype and flags,
    the number of nodes replaced, the module path and the source line (see
    :mod:`pypm_jax.engine.report`), followed, for two rewrites or more, by :meth:`summary`.
    ``to_dict()`` is the same as plain data (``json.dumps`` takes it).
    """

    def counts(self) -> dict[str, int]:
        """How many times each rule fired, in order of first firing."""
        out: dict[str, int] = {}
        for r in self:
            out[r.rule] = out.get(r.rule, 0) + 1
        return out

    def rows(self) -> list[dict[str, Any]]:
        """One dict per rewrite: on (the index of the earlier rewrite whose result it
        rewrote, or None), rule, pattern, kernel, shape, flags, replaced (how many nodes), op
        (the root's operator), module, source (file relative to the working directory or its
        package, and line)."""
        return _report.rows(self)

    def summary(self) -> str:
        """The rewrites counted by kernel (with flags) and by module (layer numbers as ``*``)."""
        return _report.summary(self.rows(), printable)

    def to_dict(self) -> dict[str, Any]:
        """``{"rewrites": rows(), "by_kernel": {...}, "by_module": {...}}``."""
        rows = self.rows()
        by = _report.groups(rows)
        return {"rewrites": rows, "by_kernel": by["kernels"], "by_module": by["modules"]}

    def __str__(self) -> str:
        if not self:
            return "no rewrites"
        rows = self.rows()
        text = _report.table(rows, printable)
        return f"{text}\n\n{_report.summary(rows, printable)}" if len(rows) > 1 else text


@dataclass(frozen=True, slots=True)
class RewriteResult:
    graph: Graph
    report: RewriteReport
    visits: int = 0  # how many times a node was tried against the rules (revisits count)


# ------------------------------------------------------------------------ pattern reach


def _reach(p: Pattern, budget: list[int]) -> int | None:
    """How deep below its root a match of ``p`` can look (None: unbounded, recursive)."""
    budget[0] -= 1
    if budget[0] < 0:
        return None
    match p:
        case PVar():
            return 0
        case PConst():
            return 1
        case PApp(_, args, _) | PFunVar(_, args, _, _):
            depth = 0
            for a in args:
                r = _reach(a, budget)
                if r is None:
                    return None
                depth = max(depth, r)
            return depth + 1
        case PAlt(left, right):
            a, b = _reach(left, budget), _reach(right, budget)
            return None if a is None or b is None else max(a, b)
        case PGuard(pat, _) | PExists(_, pat, _):
            return _reach(pat, budget)
        case PConstr(pat, _, constraint):  # the constraint starts inside pat's region
            a, b = _reach(pat, budget), _reach(constraint, budget)
            return None if a is None or b is None else a + b
        case PMu():
            if has_recursion(p):
                return None  # recursive: a match can reach any depth
            try:
                return _reach(unfold(p, FreshNames()), budget)
            except TypeError:
                return None
    return None  # PCall: recursion


_reach_of = _ByIdentity(lambda pdef: _reach(pdef.body, [500]))  # once per definition


# ------------------------------------------------------------------ guards in the pattern


def _guarded(rule: RuleDef) -> PatternDef:
    """``rule``'s pattern with the guard of its one branch joined in as one more guard
    (checked once the pattern has matched): its solutions are exactly those of the pattern
    on which the rule fires, in the same order.

    The fast driver matches this instead of the bare pattern, so a match whose guard fails
    is given up inside the compiled matcher (which goes straight on to the pattern's next
    solution) rather than found, handed to the rule and re-enumerated from the start.
    Unchanged (the bare pattern) for a rule of several branches (``g1 or g2`` is undefined
    where ``g1`` is, though the second branch may fire), an unconditional one, or one whose
    guard reads a name that is not a parameter (the driver drops solutions that repeat an
    earlier one's parameters, which only commutes with a guard that reads parameters alone).
    """
    pdef = rule.pattern
    if len(rule.branches) != 1:
        return pdef
    guard = rule.branches[0].guard
    if isinstance(guard, EConst) and guard.value is True:
        return pdef
    names: set[str] = set()
    _expr_names(guard, names)
    if not names <= {p.name for p in pdef.params}:
        return pdef
    return PatternDef(pdef.name, pdef.params, PGuard(pdef.body, guard), pdef.loc, pdef.alt_locs)


guarded_pattern = _ByIdentity(_guarded)  # one per rule object, so compiled once


def _guards_read_params(rule: RuleDef) -> bool:
    """Do ``rule``'s branch guards read its pattern's parameters only?"""
    names: set[str] = set()
    for b in rule.branches:
        _expr_names(b.guard, names)
    return names <= {p.name for p in rule.pattern.params}


_reads_params = _ByIdentity(_guards_read_params)  # (asked once single use refused a match)


def _result_vars(rhs: Rhs) -> list[str]:
    """The variables a rule result reads (its ``RVar`` s)."""
    found: list[str] = []
    stack = [rhs]
    while stack:
        r = stack.pop()
        if type(r) is RVar:
            found.append(r.name)
        elif type(r) is RApp:
            stack.extend(r.args)
        elif type(r) is RTuple:
            stack.extend(r.items)
    return found


# ---------------------------------------------------------------------------- the driver


_CONST_DEPTH = 8  # how deep constant_only looks for literals
_AFTER_ALL = float("inf")  # a major after every node's


class _Candidates(dict):
    """``op -> `` the rules whose patterns can start at a value of ``op`` (an empty tuple:
    none), read from the matcher's index once per operator and run: the sweep asks for
    every node, and a hit here is one dict lookup in C."""

    __slots__ = ("table", "wild")

    def __init__(self, table: Any, wild: tuple):
        super().__init__()
        self.table, self.wild = table, wild

    def __missing__(self, op: Any) -> tuple:
        cands = self[op] = self.table.get(op, self.wild)
        return cands


# The sweep narrows a node's candidates by its signature (``ByInputs``) where they are more
# than this many: for one or two, making the key costs what it saves.
_NARROW_ABOVE = 2
_OUTSIDE_SEARCH = 64  # nodes ``outside`` visits at most
_ANCHOR_SEARCH = 256  # values ``anchored`` visits at most
# nodes ``unranked`` holds before they are checked (and let go): this many, or as many as the
# graph has nodes (so that a pass that never asks holds no more than the graph, and checks none)
_UNRANKED_LIMIT = 4096


def _interpreted_guard(g: Any) -> Any:
    return lambda theta, phi: guard_holds(g, theta, phi)


class _Prepared:
    """What a run needs of its rules that no graph changes, made once per rule list and
    engine (:func:`_prepared`): the root index and the index by signature (each filled as
    the operators and signatures it is asked about come), whether each compiled pattern
    checks its rule's one guard, how deep the patterns look, the branches' guards and
    result builders, the parameters, the compiled patterns and whether each resumes."""

    __slots__ = (
        "rules", "pdefs", "cands", "by_inputs", "checked", "reach", "branches", "params",
        "resumable", "compiled", "pending",
    )  # fmt: skip

    def __init__(self, rules: tuple[RuleDef, ...], fast: bool):
        self.rules = rules  # (held: the cache is keyed by their ids)
        # (the fast engine matches the rules' guards with their patterns; the reference
        # machine runs the paper's algorithm on the bare patterns)
        pdefs = self.pdefs = [guarded_pattern(r) if fast else r.pattern for r in rules]
        # (a rule is tried only where its pattern's root and one of its branches' guards
        # admit the node's operator)
        matcher = Matcher(pdefs, compiled=fast, narrow=[rule_roots(r) for r in rules])
        self.cands = _Candidates(matcher.table, matcher.wildcards)  # op -> candidates
        self.by_inputs = ByInputs(self.cands)
        # per rule: does its compiled pattern check the guard of its one branch already?
        self.checked = [p is not r.pattern for p, r in zip(pdefs, rules, strict=True)]
        reaches = [_reach_of(r.pattern) for r in rules]
        self.reach = None if None in reaches else max(reaches, default=0)
        guard = compile_guard if fast else _interpreted_guard
        # per rule: its (branch, guard, result builder) triples, in order
        self.branches = [
            tuple((b, guard(b.guard), _deferred_result(r, i)) for i, b in enumerate(r.branches))
            for r in rules
        ]
        self.params = [[(p.name, p.kind == "op") for p in r.pattern.params] for r in rules]
        self.resumable = [fast and cp.backend == "machine" for cp in matcher.compiled]
        self.compiled = matcher.compiled
        # the branches whose guard is compiled at its first evaluation (``compile_guard``):
        # each run made afterwards gets the compiled guard itself (``refresh``)
        self.pending = [
            (ri, bi)
            for ri, row in enumerate(self.branches)
            for bi, (b, holds, _) in enumerate(row)
            if fast and not _guard_compiled(b.guard, holds)
        ]

    def refresh(self) -> None:
        """Put in ``branches`` the guards compiled since (the pending ones' look-ups)."""
        still = []
        for ri, bi in self.pending:
            b, holds, build = self.branches[ri][bi]
            hit = _compiled_guards.entries.get(id(b.guard))
            if hit is not None and hit[0] is b.guard:
                row = list(self.branches[ri])
                row[bi] = (b, hit[1], build)
                self.branches[ri] = tuple(row)
            else:
                still.append((ri, bi))
        self.pending = still

    def current(self) -> bool:
        """Is each compiled pattern still the one ``compile_pattern`` gives (its cache may
        have been emptied since, or the backend chosen otherwise)?"""
        entries = _compiled.entries
        for p, cp in zip(self.pdefs, self.compiled, strict=True):
            hit = entries.get(id(p))
            if cp is not None and (hit is None or hit[1] is not cp):
                return False
        return True


# (engine, the rules' ids) -> what runs of those rules share; a few rule lists in a process
_PREPARED: dict[tuple[bool, tuple[int, ...]], _Prepared] = {}
_PREPARED_LIMIT = 16
_SIGNATURES_LIMIT = 1 << 16  # signatures one entry's index keeps before it starts afresh


def _prepared(rules: tuple[RuleDef, ...], fast: bool) -> _Prepared:
    """:class:`_Prepared` for ``rules``, made once per rule list: ``pm.optimize`` rewrites
    every signature it traces with the same rules, and the tables fill as they are read."""
    key = (fast, tuple(map(id, rules)))
    found = _PREPARED.get(key)
    if found is None or len(found.by_inputs) > _SIGNATURES_LIMIT or not found.current():
        if len(_PREPARED) >= _PREPARED_LIMIT:
            _PREPARED.clear()
        found = _PREPARED[key] = _Prepared(rules, fast)
    elif found.pending:
        found.refresh()
    return found


def _guard_compiled(g: Any, holds: Any) -> bool:
    """Is ``holds`` (``compile_guard(g)``) the guard's compiled function already?"""
    hit = _compiled_guards.entries.get(id(g))
    return hit is not None and hit[0] is g and hit[1] is holds


class _Driver:
    """One rewriting run: the sweep, the revisit queue and the report."""

    def __init__(
        self,
        graph: Graph,
        rules: tuple[RuleDef, ...],
        engine: str,
        limit: int,
        shareable: Callable[[Node], bool] | None = None,
        check_types: bool = False,
        weak_type: Callable[[Value], bool | None] | None = None,
        match_budget: int | None = MATCH_BUDGET,
    ):
        self.g = graph
        self.shareable = shareable
        self.check_types_on = check_types
        self.weak_type = weak_type
        self.rules = rules
        self.fast = engine == "fast"
        self.engine = engine
        # what the run needs of its rules alone: made once per rule list (``_prepared``)
        prep = _prepared(rules, self.fast)
        self.cands = prep.cands  # op -> candidates
        self.by_inputs = prep.by_inputs  # a node's signature -> the candidates it may pass
        self.checked = prep.checked
        self.reach = prep.reach
        # after a rewrite, the deepest level of users (0: the changed nodes themselves)
        # whose users are revisited too
        self.last_level = _AFTER_ALL if self.reach is None else self.reach - 1
        self.limit = limit
        # per rewrite: (rule, root node, covered node ids, new nodes alive once it fired,
        # module path); the report's records are made from these at the end of the run
        self.records: list[tuple[RuleDef, Node, tuple[int, ...], list[Node], Any]] = []
        self.heap: list[tuple[int, int, int, Node]] = []
        self.minor = itertools.count(1)
        self.blocked: dict[int, Node] = {}  # roots a single-use rule skipped
        self.idle: dict[int, Node] = {}  # roots x rewritten to f(x), read by f(x) only (wake)
        self.const_memo: dict[int, bool] = {}  # node id -> computed from literals alone
        self.new_rank: dict[int, tuple[int, int]] = {}  # node made by this run -> rank
        self.queued: set[int] = set()
        self.changed = False  # did the latest rewrite that fired change the graph?
        self.branches = prep.branches
        self.params = prep.params
        # the fast matcher's steps per (rule, node), with the budget and progress callback
        self.mrun = MatchRun(
            match_budget, distinct=True, every=_PROGRESS_STEPS, on_check=self.progress
        )
        self.over_budget: set[tuple[int, int]] = set()  # (rule, node id) given up
        # per rule: does its matcher go on from its first solution to the rest (the machine
        # runs one enumeration; generated code finds the first solution more cheaply alone)
        self.resumable = prep.resumable
        self.compiled = prep.compiled
        # per rule: does its search leave out doomed matches (``doomed``) from now on? Single-
        # use rules whose guards read parameters only (``_reads_params``: a left-out match's
        # guard is that of the match with its parameters the search goes on to, if any), once
        # single use has refused one of their matches (a search that leaves nothing out pays
        # for the predicate and gains nothing)
        self.armed = [False] * len(rules)
        # per armed rule: what its machine does when it starts (``start``)
        self.start_of: list[Callable[[Value], bool] | None] = [None] * len(rules)
        self.here: Any = None  # the sweep's node's ``doomed`` (None: not made yet)
        self.rule_index = {id(r): i for i, r in enumerate(rules)}
        # roots where such a search left something out and nothing blocked them: whether the
        # full search would have is decided before the graph next changes (``decide``)
        self.undecided: dict[int, tuple[Node, list[int]]] = {}
        # do the ranks (``rank``) still grow along every edge? (then a reader ranked after a
        # root is no node of any match there: :meth:`doomed`) Checked when asked
        # (:meth:`ranks_hold`) on the nodes whose inputs rewrites made since (``unranked``)
        self.ranks_ok = True
        self.unranked: list[Node] = []
        self.unranked_limit = max(_UNRANKED_LIMIT, len(graph))
        self.pos = 0
        self.started = self.last_log = time.monotonic()

    def progress(self) -> None:
        """Log progress if PROGRESS_SECONDS passed since the last line (or the start)."""
        now = time.monotonic()
        if now - self.last_log >= PROGRESS_SECONDS:
            self.last_log = now
            log.info(
                "rewriting: %d of %d nodes swept, %d revisits queued, %d rewrites, %.0f s",
                self.pos, len(self.order), len(self.heap), len(self.records), now - self.started,
            )  # fmt: skip

    def give_up(self, ri: int, v: Value, exc: MatchBudgetError) -> None:
        """A match of rule ``ri`` at ``v`` ran past its budget: warn, skip it there."""
        node = v.node
        self.over_budget.add((ri, node.id))
        rule = self.rules[ri]
        where = f" ({rule.loc})" if rule.loc is not None else ""
        at = f" at {node.loc}" if node.loc is not None else ""
        warnings.warn(
            f"rule {rule.name}{where}: matching its pattern at %{node.id} {node.op.name}{at} "
            f"ran past {exc.steps} machine steps; the rule is skipped at that node "
            "(raise match_budget= to search further)",
            RuntimeWarning,
            stacklevel=2,
        )

    def first(self, ri: int, cp: CompiledPattern, v: Value) -> tuple | None:
        """``cp``'s first solution at ``v`` within the budget (None past it: warned)."""
        if self.over_budget and (ri, v.node.id) in self.over_budget:
            return None
        self.mrun.steps = 0
        try:
            return cp._first(v, self.mrun)
        except MatchBudgetError as exc:
            self.give_up(ri, v, exc)
            return None

    # -- the sweep
    #
    # Nodes present at the start are swept in topological order; position ``pos`` is the
    # next one. Each node has a rank (major, minor): an original node's major is its place
    # in the sweep (its id, when ids already follow the order), a node made by a rewrite
    # takes the major of the node it replaced and a minor from a counter, so it is visited
    # right after, before the sweep moves on. Revisits go through a heap ordered by rank.

    def run(self) -> None:
        g = self.g
        order = g.nodes()
        self.mark0 = g.next_id  # ids from here on are made by this run
        self.rank_of = None if g.id_ordered else {n.id: i for i, n in enumerate(order)}
        cands_of = self.cands
        if not cands_of.wild:
            # the sweep skips nodes no pattern can start at (one pass here is cheaper than
            # asking at each step); their op never changes, so the skip stays right
            order = [n for n in order if cands_of[n.op]]
        self.order = order
        # the sweep's nodes' majors (original nodes: their ids, or their places in the
        # order), and past the last one a major after every rank
        ids = [n.id for n in order]
        self.majors = majors = ids if self.rank_of is None else list(map(self.rank_of.get, ids))
        majors.append(_AFTER_ALL)
        heap, queued = self.heap, self.queued
        n_order = len(order)
        slow, is_read, try_rule = not self.fast, g.is_read, self.try_rule
        resumable, armed, start_of = self.resumable, self.armed, self.start_of
        visits = pos = 0
        sweep = majors[0]  # the sweep's next major
        next_check = _PROGRESS_STRIDE
        mrun, over = self.mrun, self.over_budget
        by_inputs = self.by_inputs
        while True:
            if heap and heap[0][0] < sweep:
                node = heapq.heappop(heap)[3]
                queued.discard(node.id)
            elif pos < n_order:
                node = order[pos]
                pos += 1
                sweep = majors[pos]
            else:
                break
            if not node.alive:
                continue
            cands = cands_of[node.op]
            if not cands:
                continue
            visits += 1
            self.pos = pos
            if visits >= next_check:
                next_check += _PROGRESS_STRIDE
                self.progress()
            outs = node.outputs
            if slow or len(outs) > 1:
                self.visit(node, cands, pos)
                continue
            # the common case, inlined: a single-output node, the compiled patterns
            v = outs[0]
            if len(cands) > _NARROW_ABOVE:  # (those whose pre-checks admit its signature)
                cands = by_inputs[signature(v)]
            self.here = None  # (``doomed`` at v: made when an armed rule's machine starts)
            for ri, _, cp in cands:
                if over and (ri, node.id) in over:
                    continue
                mrun.steps = 0
                if armed[ri]:
                    mrun.on_start = start_of[ri]
                try:
                    if resumable[ri]:  # (the machine: its first solution, and the rest)
                        rest = cp._all(v, mrun)
                        first = next(rest, None)
                    else:
                        rest = None
                        first = cp._first(v, mrun)
                except MatchBudgetError as exc:
                    mrun.forbid = mrun.on_start = None
                    self.give_up(ri, v, exc)
                    doomed = self.here
                    if doomed and doomed.hits[0]:
                        self.left_out(ri, node, doomed)
                    continue
                mrun.on_start = None  # (the machine clears it; generated code does not read it)
                if first is not None:
                    if not is_read(v):
                        break  # nothing reads it: nothing to rewrite (asked only now, as
                        # reading a value's users is one more object to fetch per node)
                    if try_rule(ri, cp, v, first, pos, rest):
                        mrun.forbid = None
                        break
                mrun.forbid = None
                doomed = self.here
                if doomed and doomed.hits[0]:
                    self.left_out(ri, node, doomed)
        self.visits = visits

    def arm(self, ri: int) -> None:
        """Rule ``ri``'s searches leave doomed matches out from now on (``armed``): its
        machine, where it starts, calls :meth:`start` with the rule's anchor
        (:func:`~pypm_jax.engine.analysis.rule_anchor`)."""
        self.armed[ri] = True
        if self.start_of[ri] is None:
            anchor = rule_anchor(self.rules[ri])
            roots = None if anchor is None else anchor[1]
            self.start_of[ri] = lambda t: self.start(t, roots)

    def start(self, root: Value, roots: Any) -> bool:
        """What an armed rule's machine does as it starts at ``root``, the sweep's value:
        leave out the matches that cover a value doomed there (``mrun.forbid``; the
        predicate is made once per node, at the first such start, and kept in ``here``);
        False where the rule's anchor (``roots``) says that no match is kept there
        (:meth:`anchored`)."""
        doomed = self.here
        if doomed is None:
            doomed = self.here = (self.g.is_read(root) and self.doomed(root)) or False
        if not doomed:
            return True
        self.mrun.forbid = doomed
        return roots is None or self.anchored(root, roots, doomed)

    def anchored(self, root: Value, roots: Any, doomed: Any) -> bool:
        """May a search at ``root`` that leaves out the matches covering a value ``doomed``
        holds for keep a match? The rule's anchor variable is bound in every match that
        fires or that single use refuses with a branch guard holding, as an operand of an
        application of ``roots``; a match covers that application's term and a path of terms
        from the root down to it, none doomed in a match that is kept. False (the search is not run, as
        if it left a match out: ``left_out``) where no term of ``roots`` is reached from the
        root through values that are not doomed; True where one is, or past
        ``_ANCHOR_SEARCH`` values (not known)."""
        hits = doomed.hits
        before = hits[0]  # (the walk's own questions count as nothing left out)
        stack, seen = [root], {id(root)}
        while stack:
            node = stack.pop().node
            ins = node.inputs
            if admits(roots, node.op, len(ins)) or len(seen) > _ANCHOR_SEARCH:
                hits[0] = before
                return True
            for i in ins:
                if id(i) not in seen:
                    seen.add(id(i))
                    if not doomed(i):
                        stack.append(i)
        hits[0] = before + 1  # (the search would leave a match out, or find none)
        return False

    def left_out(self, ri: int, node: Node, doomed: Any) -> None:
        """Rule ``ri``'s search at ``node`` left out doomed matches and fired nothing: unless
        the node is blocked already, whether the full search would have blocked it is
        decided later (:meth:`decide`)."""
        doomed.hits[0] = 0
        if node.id not in self.blocked:
            self.undecided.setdefault(node.id, (node, []))[1].append(ri)

    def major(self, node: Node) -> int:
        new = self.new_rank.get(node.id)
        if new is not None:
            return new[0]
        return node.id if self.rank_of is None else self.rank_of[node.id]

    def pending(self, node: Node, pos: int) -> bool:
        """Will the sweep or the queue still visit ``node``?"""
        if node.id in self.queued:
            return True
        if node.id >= self.mark0:
            return False
        return self.major(node) >= self.majors[pos]

    def push(self, node: Node, pos: int) -> None:
        """Queue ``node`` for a (re)visit unless the sweep or the queue will reach it."""
        if not node.alive or self.pending(node, pos):
            return
        self.queued.add(node.id)
        major, minor = self.new_rank.get(node.id) or (self.major(node), 0)
        heapq.heappush(self.heap, (major, minor, node.id, node))

    def visit(self, node: Node, cands: tuple, pos: int) -> None:
        g = self.g
        fast = self.fast
        for v in node.outputs:
            if not node.alive:
                return
            if not g.is_read(v):
                continue  # nothing reads it: nothing to rewrite
            for ri, pdef, cp in cands:
                if fast:
                    first = self.first(ri, cp, v)
                    if first is None:
                        continue
                    fired = self.try_rule(ri, cp, v, first, pos)
                else:
                    fired = self.try_reference(ri, pdef, v, pos)
                if fired:
                    if not self.changed:
                        break  # a rule matched and left the graph as it was: next output
                    if node.alive and len(node.outputs) > 1:
                        self.push(node, pos)
                    return

    def try_rule(
        self,
        ri: int,
        cp: CompiledPattern,
        v: Value,
        first: tuple,
        pos: int,
        rest: Iterator[tuple] | None = None,
    ) -> bool:
        """The rule's branches on each solution of ``cp`` (the rule's guarded pattern; the
        first solution is ``first``), in order, repeated parameters dropped: the first
        branch whose guard holds fires (unless single use refuses that match; then the next
        solution is tried). ``rest``: the solutions after ``first``, where the matcher that
        found it can go on (the machine); else they are found again from the start."""
        theta, phi, struct = first
        mrun = self.mrun
        if mrun.forbid is not None and mrun.forbid.hits[0]:  # (matches left out: see below)
            if self.fire_branch(ri, v, first, pos, probe=True):
                mrun.forbid = None
                return self.try_all(ri, cp, v, pos)
        elif self.checked[ri]:  # (``fire_branch``, inline: the matcher checked the guard)
            branch, _, build = self.branches[ri][0]
            if self.fire(self.rules[ri], v, theta, phi, branch, build, struct, pos):
                return True
        elif self.fire_branch(ri, v, first, pos):
            return True
        if cp.unique:
            mrun.forbid = None
            return False
        params = self.params[ri]
        seen = {tuple(id((phi if op else theta).get(name)) for name, op in params)}
        single = self.rules[ri].single_use and self.fast
        try:
            if mrun.forbid is None and single and v.node.id in self.blocked:
                mrun.forbid = self.doomed(v)  # (see below)
            if rest is None:
                mrun.steps = 0
                rest = cp.solutions(v, mrun)
                if mrun.forbid is None:
                    next(rest, None)  # the first solution again (else its key skips it)
            for sol in rest:
                theta, phi, _ = sol
                key = tuple(id((phi if op else theta).get(name)) for name, op in params)
                if key in seen:
                    continue
                seen.add(key)
                if mrun.forbid is not None and mrun.forbid.hits[0]:
                    if self.fire_branch(ri, v, sol, pos, probe=True):
                        mrun.forbid = None
                        return self.try_all(ri, cp, v, pos)
                    continue
                if self.fire_branch(ri, v, sol, pos):
                    return True
                if single and v.node.id in self.blocked:
                    mrun.forbid = self.doomed(v)  # (read by the machine from its next step)
        except MatchBudgetError as exc:  # (nothing fired: a firing ends the search)
            self.give_up(ri, v, exc)
        finally:
            mrun.forbid = None
        return False

    # Leaving out doomed matches. A match at a root that covers a *doomed* value
    # (:meth:`doomed`) is one single use refuses, so no such match fires; the search goes on
    # without them (``MatchRun.forbid``). What else a refusal does, the search must still do:
    #
    # * once a match was left out, a solution that would fire is not fired: a search
    #   without the doomed matches is not the full sequence with some solutions taken out
    #   (the driver drops a solution whose parameters repeat an earlier one's, and the
    #   earlier one may have been left out), so the rule's search runs again in full
    #   (:meth:`try_all`), and fires what that fires (until one is left out, the search is
    #   the full one: its solutions fire as usual);
    # * a refusal of a match whose branch guard holds blocks the root (it is revisited once
    #   something is removed). Once the root is blocked, leaving out more changes nothing:
    #   every rule leaves doomed matches out after a refusal there. A single-use rule whose
    #   guards read its parameters only (``_reads_params``) leaves them out from the start, once
    #   single use has refused one of its matches in the run (``armed``): a match it keeps
    #   blocks the root as the full search's match with its parameters would (their guards
    #   agree); where it left some out and the root is not blocked, the full search decides
    #   (:meth:`decide`), once, before the graph next changes, unless that change removes
    #   the root.

    def try_all(self, ri: int, cp: CompiledPattern, v: Value, pos: int) -> bool:
        """``try_rule`` from the start, nothing left out: every solution in order, repeated
        parameters dropped, until one fires."""
        params = self.params[ri]
        seen: set[tuple] = set()
        mrun = self.mrun
        mrun.steps = 0
        try:
            for sol in cp.solutions(v, mrun):
                theta, phi, _ = sol
                key = tuple(id((phi if op else theta).get(name)) for name, op in params)
                if key in seen:
                    continue
                seen.add(key)
                if self.fire_branch(ri, v, sol, pos):
                    return True
        except MatchBudgetError as exc:
            self.give_up(ri, v, exc)
        return False

    def decide(self, rule: RuleDef, root: Value, covered: dict[int, Node], theta: dict,
               branch: RuleBranch) -> None:  # fmt: skip
        """Before ``rule`` fires at ``root`` (covering ``covered``, θ ``theta``) and the graph
        changes: for each undecided root, does the full search of the rules that left
        matches out there block it? Not asked of a root the firing removes."""
        undecided, self.undecided = self.undecided, {}
        for nid, (node, ris) in undecided.items():
            if not node.alive or nid in self.blocked:
                continue
            if self.removed_by(node, rule, root, covered, theta, branch):
                continue
            v = node.outputs[0]
            for ri in ris:
                if self.blocks(ri, v):
                    break

    def blocks(self, ri: int, v: Value) -> bool:
        """Does rule ``ri``'s full search at ``v`` (nothing left out, nothing fired) reach a
        match whose branch guard holds and that single use refuses? Then ``v``'s node is
        blocked."""
        node = v.node
        params = self.params[ri]
        run = MatchRun(self.mrun.budget, distinct=True, every=_PROGRESS_STEPS,
                       on_check=self.progress)  # fmt: skip
        seen: set[tuple] = set()
        try:
            for sol in self.compiled[ri].solutions(v, run):
                theta, phi, struct = sol
                key = tuple(id((phi if op else theta).get(name)) for name, op in params)
                if key in seen:
                    continue
                seen.add(key)
                for _, holds, _ in self.branches[ri]:
                    if self.checked[ri] or holds(theta, phi):
                        if not self.unshared(v, self.covered(v, struct)):
                            self.blocked[node.id] = node
                            return True
                        break
        except MatchBudgetError as exc:
            if (ri, node.id) not in self.over_budget:  # (else warned already)
                self.give_up(ri, v, exc)
        return False

    def removed_by(self, node: Node, rule: RuleDef, root: Value, covered: dict[int, Node],
                   theta: dict, branch: RuleBranch) -> bool:  # fmt: skip
        """Does firing ``rule``'s ``branch`` at ``root`` remove ``node`` for sure? Yes where
        the rule is single-use, the node an interior one of its match, pure, neither
        computed from literals nor ``shareable`` (so only nodes of the match read it, and
        only such nodes can stay alive with outside readers), the match's nodes all pure
        (dead code removal removes them), and no value the result reads is computed from the
        node (``_result_vars``; searched through nodes ranked after it)."""
        rnode = root.node
        if (
            not rule.single_use
            or node is rnode
            or node.id not in covered
            or len(rnode.outputs) != 1
            or not self.ranks_hold()
            or self.constant_only(node)
            or (self.shareable is not None and self.shareable(node))
            or not all(n.op.pure for n in covered.values())
        ):
            return False
        rank = self.rank
        mine = rank(node)
        if mine is None:
            return False
        stack = [
            v.node for name in _result_vars(branch.result) if type(v := theta.get(name)) is Value
        ]
        seen: set[int] = set()
        while stack:
            n = stack.pop()
            if n is node:
                return False
            if n.id in seen:
                continue
            seen.add(n.id)
            theirs = rank(n)
            if theirs is None or len(seen) > _OUTSIDE_SEARCH:
                return False
            if theirs > mine:
                stack.extend(v.node for v in n.inputs)
        return True

    def rank(self, node: Node) -> tuple[int, int] | None:
        """The node's place in an order in which, while ``ranks_ok``, every node comes after
        the nodes it reads: an original node's (major, 0), a node a rewrite made its (major,
        minor) (see the sweep); nodes that read nothing first. None: not known."""
        if not node.inputs:
            return (-1, 0)
        made = self.new_rank.get(node.id)
        if made is not None:
            return made
        nid = node.id
        if nid >= self.mark0:
            return None
        return (nid, 0) if self.rank_of is None else (self.rank_of[nid], 0)

    def ranks_hold(self) -> bool:
        """Do the ranks grow along every edge of the graph now (``ranks_ok``)? The edges
        of the run's first graph do; every edge a rewrite made is an input of a node it
        created or rewired (``unranked``, checked here, live ones as they are now). Once
        false it stays false (a conservative answer)."""
        unranked = self.unranked
        if unranked:
            self.unranked = []
            if self.ranks_ok:
                self.ranks_ok = self.ranks_grow(unranked)
        return self.ranks_ok

    def ranks_grow(self, nodes: Iterable[Node]) -> bool:
        """Does each live node of ``nodes`` rank after every node it reads?"""
        rank = self.rank
        for n in nodes:
            if not n.alive:
                continue
            mine = rank(n)
            if mine is None:
                return False
            for v in n.inputs:
                theirs = rank(v.node)
                if theirs is None or not theirs < mine:
                    return False
        return True

    def doomed(self, root: Value) -> Callable[[Value], bool] | None:
        """A predicate on values: does every match at ``root`` that covers this value have
        single use refuse it? True of a value whose node is not the root's, not a graph
        input, a literal or computed from literals alone (``constant_only``), not
        ``shareable``, and has an output that is a graph output or is read by a node that
        the root does not read, directly or not (:meth:`outside`). A match covers the root
        and values it reads, so such an output has a reader outside every match there, and
        nothing makes it cheap to share. None where the ranks cannot tell (``ranks_ok`` is
        false: a rewrite made a node read one ranked after it)."""
        if not self.ranks_hold():
            return None
        rnode = root.node
        top = self.rank(rnode)
        if top is None:
            return None
        g, shareable = self.g, self.shareable
        memo: dict[int, bool] = {}
        away: dict[int, bool] = {}  # reader node id -> outside (the root does not read it)
        hits = [0]  # how often it held since the driver last looked (``left_out``)

        def doomed(t: Value) -> bool:
            n = t.node
            hit = memo.get(n.id)
            if hit is not None:
                if hit:
                    hits[0] += 1
                return hit
            out = False
            if n is not rnode and n.op is not CONST and n.inputs:
                for w in n.outputs:
                    escapes = g.is_output(w)
                    if not escapes:
                        for u in g.users(w):
                            if u is rnode:
                                continue
                            far = away.get(u.id)
                            if far is None:
                                far = away[u.id] = self.outside(u, rnode, top)
                            if far:
                                escapes = True
                                break
                    if escapes:
                        out = not self.constant_only(n) and (shareable is None or not shareable(n))
                        break
            memo[n.id] = out
            if out:
                hits[0] += 1
            return out

        doomed.hits = hits  # type: ignore[attr-defined]
        return doomed

    def outside(self, u: Node, rnode: Node, top: tuple[int, int]) -> bool:
        """Is ``u`` (not ``rnode``) a node ``rnode`` does not read, directly or not? Ranks
        grow along every edge (``ranks_ok``), so a node ranked after the root is one, and
        otherwise the nodes reading ``u`` are searched, those ranked before the root only
        (a path from ``u`` to the root runs through such nodes), at most
        ``_OUTSIDE_SEARCH`` of them (past that: False, not known)."""
        rank = self.rank
        mine = rank(u)
        if mine is None:
            return False
        if mine > top:
            return True
        users = self.g.users
        stack, seen = [u], {u.id}
        while stack:
            x = stack.pop()
            for w in x.outputs:
                for y in users(w):
                    if y is rnode:
                        return False
                    if y.id in seen:
                        continue
                    theirs = rank(y)
                    if theirs is None or len(seen) >= _OUTSIDE_SEARCH:
                        return False
                    if theirs < top:
                        seen.add(y.id)
                        stack.append(y)
        return True

    def fire_branch(self, ri: int, v: Value, sol: tuple, pos: int, probe: bool = False) -> bool:
        """Fire the rule's first branch whose guard holds on the solution ``sol``; False
        when none holds or single use refuses the match. ``probe``: only say whether it
        would fire (a guard holds and single use lets the match through), changing nothing."""
        theta, phi, struct = sol
        for branch, holds, build in self.branches[ri]:
            if self.checked[ri] or holds(theta, phi):  # (the matcher checked it: once is enough)
                if probe:
                    if not self.rules[ri].single_use or self.unshared(v, self.covered(v, struct)):
                        return True
                    self.blocked[v.node.id] = v.node  # (as ``fire`` does)
                    return False
                return self.fire(self.rules[ri], v, theta, phi, branch, build, struct, pos)
        return False

    def try_reference(self, ri: int, pdef: Any, v: Value, pos: int) -> bool:
        """``try_rule`` with the reference machine's solutions and interpreted guards."""
        rule = self.rules[ri]
        for theta, phi, struct in self.reference_solutions(pdef, v):
            for branch, holds, build in self.branches[ri]:
                if holds(theta, phi):
                    if self.fire(rule, v, theta, phi, branch, build, struct, pos):
                        return True
                    break
        return False

    def reference_solutions(self, pdef: Any, v: Value) -> Iterator[tuple]:
        """The reference machine's solutions, repeated parameters dropped, each with the
        terms it covered."""
        from ..semantics import machine as _reference  # (engine="reference" only)

        for m, covered in _reference.match_all_covered(pdef, v):
            yield m.theta, m.phi, covered

    # -- firing

    def region(self, root: Value, struct: tuple) -> list[Node]:
        """The nodes a match covers: the root's and those its applications matched."""
        return list(self.covered(root, struct).values())

    def covered(self, root: Value, struct: tuple) -> dict[int, Node]:
        """:meth:`region` by node id, in the same order."""
        rnode = root.node
        nodes = {rnode.id: rnode}
        for v in struct:
            n = v.node
            if n.op is LEAF and not n.inputs:
                continue  # a graph input is never replaced
            if n.id not in nodes:
                nodes[n.id] = n
        return nodes

    def constant_only(self, node: Node, depth: int = 0) -> bool:
        """Is ``node`` a literal, or pure and computed from literals alone?

        Such nodes (a broadcast fill value, an all-ones head mask) are shared by every match
        that reads them; keeping them alive costs nothing, so they never block single use.
        Constant expressions are small: the search gives up (answers no) below
        ``_CONST_DEPTH`` levels and stops at the first input read from the program, so it
        never walks the whole model upstream of a match. Memoized until the next rewrite.
        """
        memo = self.const_memo
        hit = memo.get(node.id)
        if hit is not None:
            return hit
        op = node.op
        if op is CONST:
            return True
        if op is LEAF or not op.pure or depth >= _CONST_DEPTH:
            return False
        if not node.inputs:
            return True  # pure and reads nothing: a constant too (an iota)
        ins = [v.node for v in node.inputs]
        if any(n.op is LEAF for n in ins):
            result = False
        else:
            result = all(self.constant_only(n, depth + 1) for n in ins)
        if result or depth == 0:  # a "no" found deeper may be the depth limit speaking
            memo[node.id] = result
        return result

    def cheap_to_share(self, node: Node, inside: set[int]) -> bool:
        """Is ``node``, with every ancestor of it inside the match, a literal, computed from
        literals alone, or ``shareable``? Then the readers outside keep only such nodes alive:
        nothing the replacement computes again is computed twice."""
        shareable = self.shareable
        stack, seen = [node], set()
        while stack:
            n = stack.pop()
            if n.id in seen:
                continue
            seen.add(n.id)
            if n.op is CONST or self.constant_only(n):
                continue
            if shareable is None or not shareable(n):
                return False
            stack.extend(v.node for v in n.inputs if v.node.id in inside)
        return True

    def single_use_ok(self, root: Value, region: list[Node]) -> bool:
        """Does nothing outside the match read an interior value (other than literals, what
        is computed from literals alone, and ``shareable`` plumbing, which sharing costs
        nothing)?"""
        return self.unshared(root, {n.id: n for n in region})

    def unshared(self, root: Value, inside: dict[int, Node]) -> bool:
        """:meth:`single_use_ok` of the region ``inside`` (by node id)."""
        g = self.g
        for n in inside.values():
            if n.op is CONST:
                continue  # a literal: shared freely
            for v in n.outputs:
                if v is root:
                    continue
                escapes = g.is_output(v)
                if not escapes:
                    for u in v.readers:  # (a loop, not any(): this runs per matched value)
                        if u.id not in inside:
                            escapes = True
                            break
                if escapes:
                    if not self.cheap_to_share(n, inside):
                        return False
                    break
        return True

    def fire(
        self,
        rule: RuleDef,
        root: Value,
        theta: dict[str, Any],
        phi: dict[str, Any],
        branch: RuleBranch,
        build: Callable[..., Any],
        struct: tuple,
        pos: int,
    ) -> bool:
        """Fire ``branch`` of ``rule`` on the match (θ, φ) at ``root`` (``struct``: the
        values its applications covered; ``build``: the branch's compiled result)."""
        g = self.g
        rnode = root.node
        rid = rnode.id
        covered = {rid: rnode}  # (``covered``, inline)
        for v in struct:
            n = v.node
            if n.op is LEAF and not n.inputs:
                continue  # a graph input is never replaced
            nid = n.id
            if nid not in covered:
                covered[nid] = n
        if rule.single_use and not self.unshared(root, covered):
            self.blocked[rid] = rnode
            i = self.rule_index.get(id(rule))
            if i is not None and self.fast and _reads_params(rule):
                self.arm(i)
            return False
        records = self.records
        if len(records) >= self.limit:
            raise self.limit_error(rule, rnode)
        if self.undecided:
            self.decide(rule, root, covered, theta, branch)
        mark = g.next_id  # nodes with ids from here on are new
        built: dict[int, Node] = {}  # every node the result consists of, new or not
        meta = rnode.metadata
        try:
            result = build(g, theta, phi, root, [rnode.loc, meta or None, built])
        except Exception as exc:
            raise rule_error(
                rule, f"its result for %{rid} {rnode.op.name} cannot be built: "
                f"{type(exc).__name__}: {exc}"
            ) from exc  # fmt: skip
        # (a value, or for a tuple result (replaced value, replacement) per output)
        pairs = None if type(result) is Value else result
        if self.check_types_on:
            self.check_types(rule, [(root, result)] if pairs is None else pairs)
        self.changed = False
        if pairs is None:
            if result is root:
                return True  # the result is the root itself: nothing to do
            # (the result's own nodes keep reading the root: x → f(x))
            swapped = g.swap(root, result, built.values())
            if swapped is None:
                # x → f(x) where only f(x) itself reads x: the graph is the same; a rewrite
                # that changes nothing is no rewrite (and must not show in the report)
                g.remove_dead([n for i, n in built.items() if i >= mark])
                self.idle[rid] = rnode  # until something else reads x again
                return True
            touched, removed = swapped
        else:
            for old, new in pairs:
                if old is not new:
                    break
            else:
                return True
            touched = []
            outputs_changed = False
            for old, new in pairs:  # the result's own nodes keep reading the root (x → f(x))
                if old is new:
                    continue
                outputs_changed = outputs_changed or g.is_output(old)
                touched += g.replace_all_uses(old, new, keep=built.values())
            if not touched and not outputs_changed:
                g.remove_dead([n for i, n in built.items() if i >= mark])  # (as above)
                self.idle[rid] = rnode
                return True
            removed = g.remove_dead((rnode,))
        self.changed = True
        if self.const_memo:
            self.const_memo.clear()  # inputs changed somewhere: recompute on demand
        # what the report needs, as it is now (the records are made at the end of the run):
        # the new nodes alive once it fired
        if len(built) == 1:  # (one node, the common case: the loop below, in short)
            (n,) = built.values()
            created = live = [n] if n.id >= mark else []
            if created and not n.alive:
                live = []
        else:
            created = []
            live = []
            for i, n in built.items():
                if i >= mark:
                    created.append(n)
                    if n.alive:
                        live.append(n)
        module_path = meta.get("module_path") if meta else None
        records.append((rule, rnode, tuple(covered), live, module_path))
        if created:
            # the new nodes: visited next (by rank), before the sweep goes on (``push``,
            # inline: nothing has queued a node this rewrite made)
            new_rank = self.new_rank
            rank = new_rank.get(rid)  # (``major``, inline)
            if rank is not None:
                major = rank[0]
            else:
                major = rid if self.rank_of is None else self.rank_of[rid]
            cands_of, minor, queued, heap = self.cands, self.minor, self.queued, self.heap
            for n in created:
                nid = n.id
                m = next(minor)
                new_rank[nid] = (major, m)
                if cands_of[n.op] and n.alive:  # (else no rule can start at it)
                    queued.add(nid)
                    heapq.heappush(heap, (major, m, nid, n))
        if self.ranks_ok:  # (the edges this rewrite made: the new nodes' and the touched')
            unranked = self.unranked
            unranked += created
            unranked += touched
            if len(unranked) > self.unranked_limit:
                self.ranks_hold()
        if touched:
            self.requeue(touched, pos)
        if rnode.alive:  # x → f(x): x lives on, read by f(x) only
            self.idle[rid] = rnode
        if self.idle:
            self.wake(created, [(root, result)] if pairs is None else pairs, pos)
        if removed and self.blocked:
            blocked, self.blocked = list(self.blocked.values()), {}
            for n in blocked:
                self.push(n, pos)
        return True

    def make_report(self) -> RewriteReport:
        """The run's records as :class:`RewriteRecord` s, in firing order."""
        report = RewriteReport()
        append = report.append
        texts: dict[tuple, str] = {}  # (shape, dtype) -> its printed type (``show_type``)
        for rule, rnode, covered, live, module_path in self.records:
            if len(live) == 1:  # (the common case: one node, no lists)
                (n,) = live
                ids: Any = (n.id,)
                kernels: Any = ()
                outs = n.outputs
                if outs:
                    out = outs[0]
                    key = (out.shape, out.dtype)
                    text = texts.get(key)
                    if text is None:
                        text = texts[key] = show_type(out.shape, out.dtype)
                    kernels = (_built(n.op, n.attrs, text),)
                described = n.op.describe is not None
            else:
                ids, kernels, described = [], [], False
                for n in live:
                    ids.append(n.id)
                    outs = n.outputs
                    if outs:
                        out = outs[0]
                        kernels.append(_built(n.op, n.attrs, show_type(out.shape, out.dtype)))
                    if n.op.describe is not None:
                        described = True
                ids, kernels = tuple(ids), tuple(kernels)
            append(
                _record(
                    rule.name, rule.pattern.name, rnode.id, covered, rnode.loc, module_path,
                    rnode.op.name, ids, kernels, _detail(live) if described else "",
                )
            )  # fmt: skip
        return report

    def check_types(self, rule: RuleDef, pairs: list[tuple[Value, Value]]) -> None:
        """Each replacement has the type of the value it replaces, where both are known."""
        weak_type = self.weak_type
        for old, new in pairs:
            if old is new:
                continue
            why = None
            if old.shape is not None and new.shape is not None:
                if tuple(old.shape) != tuple(new.shape):
                    why = "shape"
            if why is None and old.dtype is not None and new.dtype is not None:
                if old.dtype is not new.dtype:
                    why = "dtype"
            if why is None and weak_type is not None:
                a, b = weak_type(old), weak_type(new)
                if a is not None and b is not None and a != b:
                    why = f"weak type ({'weak' if b else 'strong'} for {'weak' if a else 'strong'})"
            if why is not None:
                op = old.node.op.name
                raise rule_error(
                    rule, f"its result {show_type(new.shape, new.dtype)} replaces {old.name} "
                    f"{op} : {show_type(old.shape, old.dtype)}, of another {why}"
                )  # fmt: skip

    def wake(self, created: Iterable[Node], pairs: list[tuple[Value, Value]], pos: int) -> None:
        """Revisit the idle roots (rewritten ``x → f(x)``, so that only ``f(x)`` reads ``x``)
        that this rewrite gave a new reader: rewriting them again changes the graph now."""
        idle = self.idle
        read = [v for n in created for v in n.inputs] + [new for _, new in pairs]
        for v in read:  # (every value has a node; a graph input's is a leaf)
            if v.node.id in idle:
                self.push(idle.pop(v.node.id), pos)

    def requeue(self, touched: list[Node], pos: int) -> None:
        """Revisit nodes whose inputs changed and their users as deep as patterns look
        (a node no rule can start at is not queued: the walk goes on through it)."""
        last = self.last_level
        queued, rank_of, mark0, heap = self.queued, self.rank_of, self.mark0, self.heap
        cands_of = self.cands
        # an original node at or after the sweep's position: the sweep will get there, and
        # to its users after it (``pending``, inline)
        sweep = self.majors[pos]
        frontier = touched
        seen: set[int] = set()
        level = 0
        while frontier:
            nxt: list[Node] = []
            for n in frontier:
                nid = n.id
                if nid in seen:
                    continue
                seen.add(nid)
                if nid in queued or not n.alive:
                    continue
                if nid < mark0:  # (``push``, inline)
                    major = nid if rank_of is None else rank_of[nid]
                    if major >= sweep:
                        continue
                    if cands_of[n.op]:
                        heapq.heappush(heap, (major, 0, nid, n))
                        queued.add(nid)
                elif cands_of[n.op]:
                    rank = self.new_rank.get(nid) or (self.major(n), 0)
                    heapq.heappush(heap, (rank[0], rank[1], nid, n))
                    queued.add(nid)
                if level < last:
                    for v in n.outputs:
                        nxt.extend(v.readers)  # (each reader once: ``seen`` drops repeats)
            frontier = nxt
            level += 1

    def limit_error(self, rule: RuleDef, rnode: Node) -> RewriteLimitError:
        """Name the rules of the cycle: those along the lineage of the node being rewritten
        (each rewrite of a node that an earlier rewrite created), else the latest ones."""
        names = {rule.name}
        records = self.records
        # node made by this run -> its record (a node alive now was alive once the rewrite
        # that made it fired, so it is among that record's new nodes)
        made_by = {n.id: i for i, record in enumerate(records) for n in record[3]}
        index, steps = made_by.get(rnode.id), 0
        while index is not None and steps < 256:
            names.add(records[index][0].name)
            index, steps = made_by.get(records[index][1].id), steps + 1
        if steps < 2:
            names.update(r[0].name for r in self.records[-256:])
        ordered = tuple(r.name for r in self.rules if r.name in names)
        return RewriteLimitError(
            f"rewriting reached no fixpoint within {self.limit} rewrites (last at %{rnode.id} "
            f"{rnode.op.name}); the rules that keep firing: {', '.join(ordered)}",
            ordered,
        )


def rule_error(rule: RuleDef, what: str) -> RuleError:
    """``rule name (file:line): what`` as the error that disables the rule."""
    where = f" ({rule.loc})" if rule.loc is not None else ""
    return RuleError(f"rule {rule.name}{where}: {what}", rule)


# A branch's result compiled once into closures: ``build(g, theta, phi, replaces, cx)``
# returns the value the result denotes, adding its nodes to ``g``; ``cx`` is the firing's
# context: ``[loc, meta, built]`` (where the root was written, the root's metadata to copy,
# and every node the result consists of, new or not, by id). ``replaces`` is the value it
# stands in for (its type fills in what the new value's own type leaves unknown).
_Build = Callable[[Graph, dict, dict, Value | None, list], Value]


def _compile_attr(e: Any) -> Callable[[dict, dict], Any]:
    """``eval_expr(e, θ, φ)`` as a function of (θ, φ), direct for the common expressions (a
    literal, an attribute of a bound value or operator)."""
    match e:
        case EConst(value):
            return lambda theta, phi: value
        case EOpAttr(var, attr):
            return lambda theta, phi: bound_op_attr(phi, var, attr)
        case EAttr(var, attr):
            return lambda theta, phi: bound_attr(theta, var, attr)
    return lambda theta, phi: eval_expr(e, theta, phi)


def _compile_value(rule: RuleDef, rhs: Rhs) -> _Build:
    match rhs:
        case RVar(name):

            def var(g: Graph, theta: dict, phi: dict, replaces: Value | None, cx: list) -> Value:
                v = theta.get(name)
                if type(v) is not Value or v not in g:
                    raise PyPMError(
                        f"rule {rule.name}: its result uses {name}, which is not a value "
                        "the match bound in this graph"
                    )
                return v

            return var
        case RConst(value):

            def const(g: Graph, theta: dict, phi: dict, replaces: Value | None, cx: list) -> Value:
                return g.add_const(value, dtype=None if replaces is None else replaces.dtype)

            return const
        case RApp(op, args, attrs, index):
            fns = tuple(_compile_value(rule, a) for a in args)
            # arguments that are variables of the match (the common case): read directly
            names = tuple(a.name for a in args) if all(type(a) is RVar for a in args) else None
            # (``tuple(map(theta.get, names))``, in one call; it raises KeyError for a name θ
            # lacks; one name: the value alone)
            bound = operator.itemgetter(*names) if names else None
            one = bound is not None and len(names) == 1
            infer, n_out = op.infer, op.n_out
            evals = tuple((name, e, _compile_attr(e)) for name, e in attrs)
            arity = (
                f"{op.name} takes {op.n_in} inputs, got {len(args)}"
                if op.n_in is not None and len(args) != op.n_in
                else None
            )

            def app(g: Graph, theta: dict, phi: dict, replaces: Value | None, cx: list) -> Value:
                if bound is not None:
                    try:
                        ins = (bound(theta),) if one else bound(theta)
                        live = True
                    except KeyError:  # (a name θ lacks: its ``var`` raises below)
                        live = False
                    if not live or not g.all_live(ins):
                        for f in fns:  # (the first bad one raises, naming it)
                            f(g, theta, phi, None, cx)
                        ins = tuple(map(theta.get, names))
                elif names is not None:
                    ins = ()
                else:
                    ins = tuple([f(g, theta, phi, None, cx) for f in fns])  # (live values of g)
                if evals:
                    values: Mapping[str, Any] = {}
                    for name, e, value_of in evals:
                        try:
                            values[name] = value_of(theta, phi)
                        except Undefined as exc:
                            raise PyPMError(
                                f"rule {rule.name}: attribute {name} = {show_expr(e)} has no "
                                f"value for this match ({exc})"
                            ) from None
                else:
                    values = NO_ATTRS
                if infer is None and n_out == 1 and replaces is not None:
                    types = ((replaces.shape, replaces.dtype),)  # (what follows, in short)
                else:
                    inferred = g.infer_types(op, ins, values)
                    if replaces is not None:
                        shape, dtype = inferred[index]
                        inferred[index] = (
                            replaces.shape if shape is None else shape,
                            replaces.dtype if dtype is None else dtype,
                        )
                    if arity is None and len(inferred) != n_out:
                        raise PyPMError(
                            f"{op.name} has {n_out} outputs, got {len(inferred)} output types"
                        )
                    types = tuple(inferred)
                if arity is not None:
                    raise PyPMError(arity)
                # (``g.add_node``, its arguments checked here: a dict of the node's own)
                node = g.add_unchecked(op, ins, values, types, cx[0], cx[1])
                built = cx[2]
                if node.id not in built:
                    built[node.id] = node
                return node.outputs[index]

            return app
        case RTuple():

            def nested(g: Graph, theta: dict, phi: dict, replaces: Value | None, cx: list) -> Value:
                raise PyPMError(f"rule {rule.name}: a tuple result is only allowed whole")

            return nested
    raise TypeError(f"not a rule result: {rhs!r}")


def _compile_result(rule: RuleDef, rhs: Rhs) -> Callable[..., Any]:
    """``result(g, theta, phi, root, cx)``: for a tuple result, (replaced value,
    replacement) per output of the root's node; else the root's replacement alone."""
    if isinstance(rhs, RTuple):
        fns = tuple(_compile_value(rule, r) for r in rhs.items)

        def pairs(g: Graph, theta: dict, phi: dict, root: Value, cx: list) -> list:
            outs = root.node.outputs
            if len(fns) != len(outs):
                raise PyPMError(
                    f"rule {rule.name}: a result of {len(fns)} values replaces a node of "
                    f"{len(outs)} outputs"
                )
            return [(o, f(g, theta, phi, o, cx)) for o, f in zip(outs, fns, strict=True)]

        return pairs
    return _compile_value(rule, rhs)


# per rule: its branches' results, compiled
_results = _ByIdentity(lambda rule: tuple(_compile_result(rule, b.result) for b in rule.branches))


def _deferred_result(rule: RuleDef, i: int) -> Callable[..., Any]:
    """Branch ``i``'s result of ``rule`` (:func:`_compile_result`), compiled when first built:
    most rules never fire in a given program; kept once compiled, for the runs of the
    rule list that holds it (:func:`_prepared`)."""
    compiled: Callable[..., Any] | None = None

    def build(g: Graph, theta: dict, phi: dict, root: Value, cx: list) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = _results(rule)[i]
        return compiled(g, theta, phi, root, cx)

    return build


# ------------------------------------------------------------------------------ the API


def _detail(nodes: Iterable[Node]) -> str:
    """What the operators of a rewrite's new nodes (those alive once it fired) say about
    them (``Operator.describe``); a describe that fails says so rather than failing the
    rewrite."""
    texts = []
    for n in nodes:
        fn = getattr(n.op, "describe", None)
        if fn is None:
            continue
        try:
            texts.append(str(fn(**n.attrs)))
        except Exception as exc:  # a report line must not stop a rewrite
            texts.append(f"<{n.op.name}: describe raised {type(exc).__name__}>")
    return "; ".join(texts)


def rewrite(
    graph: Graph,
    rules: Sequence[RuleDef],
    *,
    max_iterations: int | None = None,
    engine: str | None = None,
    shareable: Callable[[Node], bool] | None = None,
    check_types: bool = False,
    weak_type: Callable[[Value], bool | None] | None = None,
    match_budget: int | None | _Default = _DEFAULT,
) -> RewriteResult:
    """Rewrite ``graph`` in place, greedily, to a fixpoint; see the module docstring.

    ``max_iterations`` bounds the number of rewrites (default: four per node plus 1000);
    ``engine`` picks the matcher ("fast" or "reference"; default: ``PYPM_ENGINE``);
    ``shareable(node)`` says an interior node of a match that something outside also reads
    costs nothing to keep (with its ancestors in the match), so it does not stop a
    ``single_use`` rule (default: only literals and what is computed from them);
    ``match_budget`` bounds the machine steps of one rule's match at one node (default
    :data:`MATCH_BUDGET`; None: unbounded): past it the rule is skipped at that node with a
    ``RuntimeWarning`` (the fast engine; the reference machine has no budget).
    ``check_types`` makes a replacement of another shape or dtype than the value it replaces
    (both known) a :class:`~pypm_jax.core.errors.RuleError`; ``weak_type(value)`` tells a value's
    weak type (None: unknown) for that check. When rewriting raises (:class:`~pypm_jax.core.errors.RuleError`,
    :class:`~pypm_jax.core.errors.RewriteLimitError`, ...) the graph is left as it was.
    """
    if not isinstance(graph, Graph):
        raise TypeError(f"rewrite() takes a Graph, got {type(graph).__name__}")
    rules = tuple(rules)
    for r in rules:
        if not isinstance(r, RuleDef):
            raise TypeError(f"rewrite() takes RuleDefs, got {r!r}")
    engine = engine or default_engine()
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: expected one of {ENGINES}")
    limit = 4 * len(graph) + 1000 if max_iterations is None else max_iterations
    budget = MATCH_BUDGET if isinstance(match_budget, _Default) else match_budget
    driver = _Driver(graph, rules, engine, limit, shareable, check_types, weak_type, budget)
    with collect_guard_failures() as failures:
        if graph.recording:  # (inside a caller's undoable change: theirs to undo)
            driver.run()
        else:
            graph.begin()
            try:
                driver.run()
            except BaseException:
                graph.rollback()
                raise
            graph.commit()
    if failures:
        _warn_guard_failures(rules, failures)
    return RewriteResult(graph, driver.make_report(), driver.visits)


def _warn_guard_failures(rules: Sequence[RuleDef], failures: list[tuple[str, Exception]]) -> None:
    """One warning per guard function that raised, naming the rules whose guards call it."""
    first: dict[str, Exception] = {}
    for name, exc in failures:
        first.setdefault(name, exc)
    for name, exc in first.items():
        users = [r for r in rules if name in _guard_fns_of(r)]
        named = (
            ", ".join(f"{r.name} ({r.loc})" if r.loc is not None else r.name for r in users) or "?"
        )
        warnings.warn(
            printable(
                f"guard function {name} raised {type(exc).__name__}: {exc}; the guard calling "
                f"it does not hold, in rule(s) {named}"
            ),
            GuardFunctionWarning,
            stacklevel=3,
        )


def _guard_fns_of_rule(rule: RuleDef) -> frozenset[str]:
    """The names of the guard functions ``rule``'s pattern and guards call."""
    names: set[str] = set()
    stack: list[Any] = [rule.pattern.body, *(b.guard for b in rule.branches)]
    seen: set[int] = set()
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, ECall):
            names.add(x.fn.name)
        if isinstance(x, tuple):
            stack.extend(x)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            stack.extend(getattr(x, f.name) for f in dataclasses.fields(x))
    return frozenset(names)


_guard_fns_of = _ByIdentity(_guard_fns_of_rule)


def rewrite_terms(
    terms: Iterable[Term], rules: Sequence[RuleDef], **options: Any
) -> tuple[list[Term], RewriteReport]:
    """Rewrite the graph of some terms; returns the rewritten terms and the report."""
    g = Graph(list(terms))
    result = rewrite(g, rules, **options)
    return result.graph.to_terms(), result.report
