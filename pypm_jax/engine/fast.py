"""The fast matching engine: each pattern compiled once, patterns indexed by root operator.

It returns exactly what the reference machine (:mod:`pypm_jax.semantics.machine`) returns: the same
first solution, the same ``match_all`` order, the same θ and φ (fresh names included). It
gets there by running that machine ahead of time instead of at match time:

* **Generated code** (most patterns). The compiler executes the machine *symbolically*:
  the continuation is known statically, so every match action becomes a line of straight
  Python (``if t3.op is not MatMul: break``) and every alternate becomes a ``while True:``
  block that a failure leaves with ``break`` — which is exactly "pop the backtrack stack".
  Along each generated path it is statically known which variables are bound, so a binding
  is a Python local, a nonlinear check is ``is``, and backtracking undoes nothing. Calls to
  other patterns (non-recursive ``PMu``) are unfolded at compile time with
  :func:`pypm_jax.semantics.subst.unfold`; the fresh-name counter the machine keeps at run
  time becomes a local integer, so fresh names match the reference exactly. A definition
  with alternates of its own becomes a generator function (shared by the patterns that
  call it), and the caller writes what follows it once, in a ``for`` loop over its
  solutions; a definition that calls itself once, with nothing before the call that can
  match a term two ways, becomes a generator function that calls itself and hands the rest
  to the machine past 48 nested calls. Guards are inlined where "undefined" and "false"
  coincide (a conjunction of rank, dtype and constant comparisons at the top of a guard);
  anything else becomes a small function with the evaluation rules of
  :mod:`pypm_jax.semantics.guards`, generated at its first evaluation. Any other recursive
  sub-pattern becomes a ``for`` loop over the solutions of the iterative machine run from
  it (``_sub``): a failure after it resumes the machine, which is the reference machine's
  backtracking into the recursion. Both share one fresh-name counter, so names still
  match the reference. A constraint ``x <= q`` that every solution meets refuses as soon as
  ``x`` is bound to a term whose structure ``q`` cannot match (patterns that cannot raise).
* **An iterative machine** (patterns that are one recursive definition the generator
  cannot write, patterns loaded from shipped summaries, and ``pm.explain``'s observed
  runs): the paper's machine with a trail instead of copied substitutions,
  so backtracking costs the bindings it undoes, and an explicit continuation and stack, so
  a 100 000-deep chain never touches the Python stack. It never copies a μ-body: entering
  a definition makes an environment (parameters -> arguments, each ∃ -> its fresh name),
  so an unfolding costs what the match visits, not the body's size. It takes an optional
  observer (``pm.explain``'s tracer), compiled away where there is none.
* **A structural pre-check** in front of the machine: the operators and arities a match
  must have at its root and the four levels below (``x <= q`` constraints included),
  computed once per pattern; a term that fails it has no match, so the machine is not
  started.
* **Guards before the first choice**, also in front of the machine: the guards the
  machine checks on the root alone before it first branches or looks below the root (a
  constraint on the root whose definition is guards, such as the region rule's
  ``FedByGemm``), found by running the machine's first actions symbolically. They are
  evaluated in the machine's order; where one fails the machine is not started, and where
  all hold it takes them as held, so each is evaluated once. Worked out at a pattern's
  first match, for patterns loaded from summaries too.

:class:`Matcher` indexes many patterns by the operators their root can have, read from the
pattern (an application; an operator variable: any pure operator of its arity and output
count) and from op-class, name and operator guards on its root (``F.op_class == C``,
``F.name == "split"``); a value is only tried against the patterns its operator can start
(plus those whose root can be anything), and most values of a graph cost one dict lookup.

The engine's modules, one per concept: :mod:`.analysis` (static analyses of patterns),
:mod:`.guard_code` (guards as generated Python), :mod:`.codegen` (patterns as generated
Python), :mod:`.machine` (the iterative machine and its tabling), :mod:`.precheck` (the
structural pre-check), :mod:`.compiled` (compiled patterns, their summaries, the match
functions), :mod:`.index` (the root-operator index). This module is their public face.
"""

from __future__ import annotations

__all__ = [
    "CompiledPattern",
    "MatchRun",
    "Matcher",
    "compile_pattern",
    "match_first",
    "match_all",
    "solutions",
    "root_operators",
    "root_set",
    "admits",
    "show_roots",
    "compile_guard",
    "summary",
    "from_summary",
]

from .analysis import admits, root_operators, root_set, show_roots
from .compiled import (
    CompiledPattern,
    compile_pattern,
    from_summary,
    match_all,
    match_first,
    solutions,
    summary,
)
from .guard_code import compile_guard
from .index import Matcher
from .machine import MatchRun
