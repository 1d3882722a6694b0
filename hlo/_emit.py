"""``emit``: the StableHLO module with every site the rules find replaced by its kernel.

``find`` rewrites the lifted graph; ``emit`` carries the rewrites back into (a copy of) the
module. Each replacement node is a kernel with an implementation registered by
``pypm_jax.jax.register_impl`` (the standard rules' ``FlashAttention`` and
``GemmEpilogue``): the implementation is lowered by JAX for the kernel's input types (its
literal inputs and the plan baked in) and added to the module as a private function, the
site's root value is replaced by a ``func.call`` of it placed before the root op (with the
root op's location), and the ops only the site used are erased. The result is StableHLO text
that parses, verifies, and runs like the original (``hlo.execute``).

Sites are emitted wherever the rules find them: in the entry function, inside ``while`` /
``case`` bodies (the call is placed in the region body; a value the kernel reads from a block
around the region is read there directly, as the region's other ops read it), and inside
private functions the lifter inlined (``closed_call``, an inner ``jax.jit``, ``jnp.where``):
the call is inlined in the module too, at that call only, so the site's ops are values of the
block that holds the call. Each distinct kernel (operator, plan, literal inputs, input types)
is one private function, called from every site it replaces. A rule that rewrites a kernel an
earlier site made (``attention_causal_bias`` refining an ``attention_bias`` kernel's plan) is
part of that site: the kernel emitted is the last one. A site that cannot be emitted (a
rule whose replacement is not a kernel, a kernel reading the result of such a rewrite, a
kernel JAX cannot lower) is reported in ``skipped`` with the reason, and the module keeps it
as it is.
"""

from __future__ import annotations

__all__ = ["Emitted", "emit"]

from dataclasses import dataclass, field
from typing import Any

import numpy as np

import pypm_jax as pm
from pypm_jax import FormatError, RewriteRecord

from . import _editor, _snapshot
from ._find import NORMALIZE_RULES, SiteReport, _children
from ._lift import SMALL_CONST_ELEMENTS, Path, _entry, _is_const, _Lifter, call_scope
from ._ops import TABLE

# Ops erased when nothing reads them any more (no effects; calls: if their callee is pure).
_PURE = (frozenset(TABLE) - {"stablehlo.optimization_barrier"}) | {
    "stablehlo.constant",
    "stablehlo.reduce",
    "stablehlo.compare",
    "chlo.broadcast_compare",
}


# Ops whose region bodies kernels are called from: control flow, whose bodies are code like a
# function's (a ``reduce``/``sort``/``scatter`` body is a scalar computation XLA applies).
_BODIES = frozenset({"stablehlo.while", "stablehlo.case", "stablehlo.if"})


@dataclass(eq=False)
class Emitted:
    """``text``: the rewritten module (StableHLO, with locations); ``report``: every site
    found (as :func:`hlo.find` reports them); ``emitted``: the sites replaced in ``text``;
    ``skipped``: the others, each with the reason."""

    text: str
    report: SiteReport
    emitted: list[RewriteRecord] = field(default_factory=list)
    skipped: list[tuple[RewriteRecord, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{len(self.emitted)} of {len(self.report)} sites emitted"]
        lines += [f"  skipped {r.rule} at {r.source}: {why}" for r, why in self.skipped]
        return "\n".join(lines)


def emit(
    module: Any,
    rules: Any = None,
    *,
    function: str | None = None,
    normalize: bool = True,
    **options: Any,
) -> Emitted:
    """Rewrite ``module`` (anything :func:`hlo.lift` takes; never changed itself) with
    ``rules`` (default: the standard library) and return the new module's text."""
    snapshot, editor = _editor.load_for_editing(module, small=SMALL_CONST_ELEMENTS)
    fn = _entry(snapshot, function)
    lifter = _Lifter(snapshot, track=True)
    graph = lifter.function(fn)
    if rules is None:
        from pypm_jax.rules import default_rules

        rules = default_rules()
    rules = list(rules)
    report = SiteReport()
    report.graph = graph
    result = Emitted("", report)
    emitter = _Emitter(snapshot, fn, lifter, editor)
    pending = [graph]
    while pending:  # the entry function, then region bodies, in find's order
        g = pending.pop()
        if normalize:
            report.normalized.extend(pm.rewrite(g, NORMALIZE_RULES, **options).report)
        before = {n.id: n for n in g.nodes()}
        records = pm.rewrite(g, rules, **options).report
        alive = {n.id: n for n in g.nodes()}
        heads: dict[int, RewriteRecord] = {}  # a node a site made -> that site's first record
        outcome: dict[int, str | None] = {}  # id(first record) -> why it was not emitted
        for i, record in enumerate(records):
            report.append(record)
            head = heads.get(record.root)
            if head is None:  # a site of the program's own ops
                head = record
                outcome[id(head)] = emitter.site(_chain(records, i), before, alive)
            heads.update(dict.fromkeys(record.created, head))
            why = outcome[id(head)]
            if why is not None and head is not record:
                why = f"it rewrote the kernel of the {head.rule} site, which was not emitted: {why}"
            if why is None:
                result.emitted.append(record)
            else:
                result.skipped.append((record, why))
        pending.extend(reversed(list(_children(g))))
    if result.emitted or editor.inlined:
        editor.erase_dead(fn.name, lambda name: name in _PURE)
    result.text = editor.text()
    return result


def _chain(records: list[RewriteRecord], i: int) -> list[RewriteRecord]:
    """Record ``i`` and the later records that rewrote the node it made, in turn (a rule
    that refines a kernel, like ``attention_causal_bias`` setting the plan's
    ``mask_is_causal``, or one that grows it, like ``gemm_epilogue_region`` absorbing the
    operators after it): one site, whose kernel is the last one's."""
    chain = [records[i]]
    for later in records[i + 1 :]:
        made = chain[-1].created
        if later.root in made or any(n in made for n in later.replaced):
            chain.append(later)
    return chain


class _Skip(Exception):
    """A site that cannot be emitted, and why."""


class _Emitter:
    """Carries sites of the lifted graphs into the module being edited.

    A graph value stands for an MLIR value of some block: the entry function's body, a
    region body, or the body of a private function the lifter inlined at a call. Values of
    the first two kinds are in the module as they are; for the last, the call is inlined in
    the module too (once, on first need, through every call on the way), so the value's copy
    is in the block that holds the call, where the other values of the same graph are."""

    def __init__(
        self, mod: _snapshot.Module, fn: _snapshot.Func, lifter: _Lifter, editor: _editor.Editor
    ) -> None:
        self.mod = mod
        self.fn = fn
        self.lifter = lifter
        self.editor = editor
        self.made: dict[Any, int] = {}  # kernel outputs: graph value -> the call's value
        self.replaced: dict[int, int] = {}  # a replaced value -> the call replacing it
        self.inlined: dict[Path, tuple[dict[int, int], dict[Any, int]]] = {}
        self.kernels: dict[Any, str] = {}  # kernel signature -> its private function
        self.defined: dict[Any, frozenset[int]] = {}
        self.owners: dict[_snapshot.Block, _snapshot.Op] = {}  # region body -> its op
        pending = [f.body for f in mod.funcs.values()]
        while pending:
            for op in pending.pop().ops:
                for region in op.regions:
                    if region is not None:
                        self.owners[region] = op
                        pending.append(region)

    # ------------------------------------------------------------------ sites

    def site(
        self, chain: list[RewriteRecord], before: dict[int, Any], alive: dict[int, Any]
    ) -> str | None:
        """Replace one site in the module (``chain``: its rewrites, see ``_chain``); None if
        done, else why not."""
        try:
            self._site(chain, before, alive)
        except _Skip as why:
            return str(why)
        return None

    def _site(
        self, chain: list[RewriteRecord], before: dict[int, Any], alive: dict[int, Any]
    ) -> None:
        from pypm_jax.vocab.impls import impl_for

        # the value the site replaces: the last rewrite's root where it grew the kernel over
        # more of the program, the first's where later ones refined the kernel in place
        root = before.get(chain[-1].root) or before.get(chain[0].root)
        made = chain[-1].created
        kernels = [
            alive[i]
            for i in made
            if i in alive and impl_for(alive[i].op) and not _is_pack(alive[i])
        ]
        if root is None or len(kernels) != 1 or len(root.outputs) != 1:
            raise _Skip("not one kernel node replacing one value (only kernels are emitted)")
        (kernel,) = kernels
        old, new = root.outputs[0], kernel.outputs[0]
        if len(kernel.outputs) != 1 or (old.shape, old.dtype) != (new.shape, new.dtype):
            raise _Skip("the kernel's type differs from the replaced value's")
        path, _ = self.lifter.defs.get(old, ((), 0))
        for step in path:
            owner = self.owners.get(step)
            if owner is not None and owner.name not in _BODIES:
                raise _Skip(
                    f"inside the region of {owner.name} (kernels are called from function "
                    "bodies and while/case/if bodies only)"
                )
        rid = self.value(old, "the replaced value", before)
        arg_ids: list[int] = []
        arg_values: list[Any] = []

        def spec(u: Any) -> tuple[Any, ...]:
            """How the kernel's implementation gets input ``u``: a literal, an argument of
            the private function, or a pack (``RegionOperands``) built from such inputs."""
            if _is_const(u):
                return ("const", _const_value(u))
            if _is_pack(u.node):
                return ("pack", u.node.op, tuple(spec(i) for i in u.node.inputs))
            arg_ids.append(self.value(u, "a kernel input", before))
            arg_values.append(u)
            return ("arg", len(arg_ids) - 1)

        inputs = [spec(u) for u in kernel.inputs]
        name = self._kernel(kernel, inputs, arg_values)
        call = self.editor.call(rid, name, arg_ids, rid)
        self.editor.replace_uses(rid, call)
        why = self.editor.verify()
        if why is not None:  # not expected; never leave a module that does not verify
            self.editor.undo_call(call, rid)
            raise _Skip(f"the kernel call does not verify: {why}")
        self.replaced[rid] = call
        self.made[new] = call  # a later site may read this kernel's result

    def _kernel(self, kernel: Any, inputs: list[tuple[Any, ...]], args: list[Any]) -> str:
        """The private function of the kernel's implementation for these inputs (lowered
        and added to the module once per distinct kernel, plan, literals and input types)."""
        from pypm_jax.vocab.impls import impl_for

        key = (
            kernel.op,
            impl_for(kernel.op),
            _frozen(kernel.attrs),
            _frozen(inputs),
            tuple((tuple(v.shape or ()), str(v.dtype)) for v in args),
        )
        name = self.kernels.get(key)
        if name is None:
            try:
                text = _lower_kernel(kernel, inputs, args)
            except Exception as exc:  # noqa: BLE001 - a kernel JAX cannot lower: leave the site
                raise _Skip(f"the kernel does not lower: {type(exc).__name__}: {exc}") from None
            name = self.kernels[key] = self.editor.import_functions(text, f"pypm_{kernel.op.name}")
        return name

    # ------------------------------------------------------------------ values

    def value(self, v: Any, what: str, before: dict[int, Any]) -> int:
        """The id of the MLIR value graph value ``v`` stands for, inlining calls as needed
        (``before``: the graph's nodes before the rules ran)."""
        if v in self.made:
            return self.made[v]
        found = self.lifter.defs.get(v)
        if found is None:
            if before.get(v.node.id) is not v.node:
                raise _Skip(f"{what} is the result of a rewrite that was not emitted")
            # e.g. the reduction inside max(init, reduce_max(x)), a normalized logistic
            raise _Skip(f"{what} is no value of the module (lifting or normalization made it)")
        path, vid = found
        while vid not in self._defined(path):  # captured: defined in a block around
            if not path or not isinstance(path[-1], _snapshot.Block):
                raise _Skip(f"{what} is captured from no block around its region")
            path = path[:-1]
        vid = self._real(path, vid)
        return self.replaced.get(vid, vid)

    def _real(self, path: Path, vid: int) -> int:
        """Value ``vid`` of the block ``path`` leads to, as a value of the edited module."""
        calls = [i for i, step in enumerate(path) if isinstance(step, _snapshot.Op)]
        if not calls:
            return vid
        values, _ = self._inline(path[: calls[-1] + 1])
        return values[vid]

    def _inline(self, path: Path) -> tuple[dict[int, int], dict[Any, int]]:
        """Inline the call ``path`` ends with (and the calls before it on the path)."""
        found = self.inlined.get(path)
        if found is None:
            call, outer = path[-1], path[:-1]
            calls = [i for i, step in enumerate(outer) if isinstance(step, _snapshot.Op)]
            if calls:
                _, ops = self._inline(outer[: calls[-1] + 1])
                ref = ops[call]
            else:
                ref = self.editor.op_id(call)
            callee = self.mod.funcs[call.attrs["callee"]].body
            try:
                found = self.editor.inline(ref, callee, call_scope)
            except FormatError as exc:
                raise _Skip(f"cannot inline @{call.attrs['callee']}: {exc}") from None
            self.inlined[path] = found
        return found

    def _defined(self, path: Path) -> frozenset[int]:
        """The values the block ``path`` leads to defines itself (arguments, op results)."""
        step = path[-1] if path else None
        found = self.defined.get(step)
        if found is None:
            if step is None:
                block = self.fn.body
            elif isinstance(step, _snapshot.Op):
                block = self.mod.funcs[step.attrs["callee"]].body
            else:
                block = step
            found = frozenset(block.args).union(r for op in block.ops for r in op.results)
            self.defined[step] = found
        return found


def _frozen(x: Any) -> Any:
    """A hashable stand-in for ``x`` (a kernel's attributes, literal inputs) with its value."""
    if isinstance(x, np.ndarray):
        return ("array", x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in x.items()))
    if isinstance(x, tuple | list):
        return (type(x).__name__, *(_frozen(v) for v in x))
    if isinstance(x, float | np.generic):  # 0.0 == -0.0, nan != nan: compare the spelling
        return (type(x).__name__, repr(x))
    try:
        hash(x)
    except TypeError:
        return ("repr", type(x).__name__, repr(x))
    return (type(x).__name__, x)


def _const_value(v: Any) -> Any:
    """A const node's value as the kernel implementation receives it when lowering."""
    value = v.attrs["value"]
    if v.dtype is None:
        return value  # a rule's untyped literal (0, 1): a Python scalar
    from pypm_jax.jax.types import numpy_dtype

    arr = np.asarray(value, dtype=numpy_dtype(v.dtype))
    if v.shape is not None and arr.shape != tuple(v.shape):
        arr = np.broadcast_to(arr, tuple(v.shape))
    return arr


def _is_pack(node: Any) -> bool:
    """Does ``node`` only gather a kernel's inputs (``RegionOperands``: op class ``pack``)?"""
    cls = node.op.op_class
    return cls is not None and cls.name == "pack"


def _lower_kernel(kernel: Any, inputs: list[tuple[Any, ...]], args: list[Any]) -> str:
    """StableHLO text of the kernel's implementation on its non-literal inputs."""
    import jax

    from pypm_jax.jax.types import numpy_dtype
    from pypm_jax.vocab.impls import impl_for

    impl = impl_for(kernel.op)
    attrs = dict(kernel.attrs)

    def build(spec: tuple[Any, ...], arrays: tuple[Any, ...]) -> Any:
        if spec[0] == "arg":
            return arrays[spec[1]]
        if spec[0] == "const":
            return spec[1]
        return impl_for(spec[1])(*(build(s, arrays) for s in spec[2]))

    def call(*arrays: Any) -> Any:
        return impl(*(build(s, arrays) for s in inputs), **attrs)

    avals = [jax.ShapeDtypeStruct(tuple(v.shape), numpy_dtype(v.dtype)) for v in args]
    return jax.jit(call, keep_unused=True).lower(*avals).as_text(debug_info=True)
