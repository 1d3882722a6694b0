"""Every error pypm-jax raises on purpose derives from :class:`PyPMError`."""

from __future__ import annotations

__all__ = [
    "PyPMError",
    "PatternDefinitionError",
    "FormatError",
    "RewriteLimitError",
    "RuleError",
    "GuardFunctionWarning",
    "MatchBudgetError",
    "SourceLoc",
]

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SourceLoc:
    """Where a pattern, rule, guard or graph node was written (file, line, source text)."""

    file: str
    line: int
    text: str = ""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


class PyPMError(Exception):
    """Base class of all pypm-jax errors."""


class PatternDefinitionError(PyPMError):
    """A pattern or rule that cannot be compiled; the message names file and line."""

    def __init__(self, message: str, loc: SourceLoc | None = None):
        self.loc = loc
        if loc is not None:
            text = f"\n    {loc.text.strip()}" if loc.text else ""
            message = f"{loc.file}:{loc.line}: {message}{text}"
        super().__init__(message)


class FormatError(PyPMError):
    """Serialized data that is malformed, truncated, of another version, or hostile."""


class RewriteLimitError(PyPMError):
    """Rewriting reached no fixpoint within the iteration limit."""

    def __init__(self, message: str, rules: tuple[str, ...] = ()):
        self.rules = rules
        super().__init__(message)


class RuleError(PyPMError):
    """A rule failed while rewriting: building its result raised, the result's type differs
    from the value it replaces, or a guard function raised. ``rule`` is the failing
    :class:`~pypm_jax.core.calculus.RuleDef`; the message names it and its source line."""

    def __init__(self, message: str, rule: object = None):
        self.rule = rule
        super().__init__(message)


class GuardFunctionWarning(UserWarning):
    """A function registered with ``@pm.guard_fn`` raised: the guard calling it does not
    hold (the paper's undefined guard), and the warning names the function, the exception
    and the rules whose guards call it."""


class MatchBudgetError(PyPMError):
    """A match ran past its step budget (``match_budget=``): the pattern explores more
    than the budget allows at that term. ``steps`` is the budget that was exceeded."""

    def __init__(self, message: str, steps: int = 0):
        self.steps = steps
        super().__init__(message)
