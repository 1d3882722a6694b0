"""``emit``: the StableHLO module with every site the rules find replaced by its kernel.

``find`` rewrites the lifted graph; ``emit`` carries the rewrites back into (a copy of) the
module. Each replacement node is a kernel with an implementation registered by
``pypm_jax.jax.register_impl`` (the standard rules' ``FlashAttention`` and
``GemmEpilogue``): the implementation is lowered by JAX for the kernel's input types (its
literal inputs and the plan baked in) and added to the module as a private function, the
site's root value is replaced by a ``func.call`` of it placed before the root op (with the
root op's location), and the ops only the site used are erased. The result is StableHLO text
that parses, verifies, and runs like the original (``hlo.execute``).

A site is emitted when its root and the kernel's inputs are values of the entry function's
own body; sites inside ``while``/``case`` bodies, or whose root is inside an inlined private
function, are reported in ``skipped`` with the reason, and the module keeps them as they are.
"""

from __future__ import annotations

__all__ = ["Emitted", "emit"]

from dataclasses import dataclass, field
from typing import Any

import numpy as np

import pypm_jax as pm
from pypm_jax import RewriteRecord

from . import _compat
from ._find import NORMALIZE_RULES, SiteReport, _children
from ._lift import SMALL_CONST_ELEMENTS, _entry, _is_const, _Lifter
from ._ops import TABLE

# Ops erased when nothing reads them any more (no effects; calls: if their callee is pure).
_PURE = (frozenset(TABLE) - {"stablehlo.optimization_barrier"}) | {
    "stablehlo.constant",
    "stablehlo.reduce",
    "stablehlo.compare",
    "chlo.broadcast_compare",
}


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
    snapshot, editor = _compat.load_for_editing(module, small=SMALL_CONST_ELEMENTS)
    fn = _entry(snapshot, function)
    lifter = _Lifter(snapshot, track=True)
    graph = lifter.function(fn)
    if rules is None:
        from pypm_jax.rules import default_rules

        rules = default_rules()
    rules = list(rules)
    report = SiteReport()
    report.graph = graph
    if normalize:
        report.normalized.extend(pm.rewrite(graph, NORMALIZE_RULES, **options).report)
    before = {n.id: n for n in graph.nodes()}
    main = pm.rewrite(graph, rules, **options).report
    report.extend(main)
    result = Emitted("", report)
    alive = {n.id: n for n in graph.nodes()}
    for record in main:
        why = _emit_site(record, before, alive, lifter, editor)
        if why is None:
            result.emitted.append(record)
        else:
            result.skipped.append((record, why))
    pending = list(_children(graph))
    while pending:  # region bodies: found, not emitted
        g = pending.pop(0)
        if normalize:
            report.normalized.extend(pm.rewrite(g, NORMALIZE_RULES, **options).report)
        for record in pm.rewrite(g, rules, **options).report:
            report.append(record)
            result.skipped.append((record, "inside the region of an op (while, case, ...)"))
        pending.extend(_children(g))
    if result.emitted:
        editor.erase_dead(fn.name, lambda name: name in _PURE)
    result.text = editor.text()
    return result


def _emit_site(
    record: RewriteRecord,
    before: dict[int, Any],
    alive: dict[int, Any],
    lifter: _Lifter,
    editor: _compat.Editor,
) -> str | None:
    """Replace one site in the module; None if done, else why not."""
    top = lifter.top
    from pypm_jax.jax.impls import impl_for

    root = before.get(record.root)
    kernels = [alive[i] for i in record.created if i in alive and impl_for(alive[i].op)]
    if root is None or len(kernels) != 1 or len(root.outputs) != 1:
        return "not one kernel node replacing one value"
    (kernel,) = kernels
    old, new = root.outputs[0], kernel.outputs[0]
    if len(kernel.outputs) != 1 or (old.shape, old.dtype) != (new.shape, new.dtype):
        return "the kernel's type differs from the replaced value's"
    rid = top.get(old)
    if rid is None:
        return "the replaced value is computed inside an inlined function"
    inputs: list[tuple[str, Any]] = []
    arg_ids: list[int] = []
    made: dict[Any, int] = {}
    for u in kernel.inputs:
        if _is_const(u):
            inputs.append(("const", _const_value(u)))
            continue
        vid = _materialize(u, rid, lifter, editor, made)
        if vid is None:
            return "a kernel input is computed where the entry function cannot read it"
        inputs.append(("arg", len(arg_ids)))
        arg_ids.append(vid)
    arg_values = [kernel.inputs[i] for i, (k, _) in enumerate(inputs) if k == "arg"]
    try:
        text = _lower_kernel(kernel, inputs, arg_values)
    except Exception as exc:  # noqa: BLE001 - a kernel JAX cannot lower: leave the site
        return f"the kernel does not lower: {type(exc).__name__}: {exc}"
    name = editor.import_functions(text, f"pypm_{kernel.op.name}")
    call = editor.call(rid, name, arg_ids, rid)
    editor.replace_uses(rid, call)
    top[new] = call  # a later site may read this kernel's result (the next layer's input)
    return None


def _materialize(
    v: Any, before: int, lifter: _Lifter, editor: _compat.Editor, made: dict[Any, int]
) -> int | None:
    """The id of an MLIR value of the entry function holding graph value ``v``: the value
    itself, or, for a value computed in an inlined function's body (``jnp.where``'s mask),
    copies of the ops computing it placed before the op defining ``before``."""
    if v in lifter.top:
        return lifter.top[v]
    if v in made:
        return made[v]
    found = lifter.origin.get(v)
    if found is None or len(made) > 256:
        return None
    op, index, read = found
    if any(r is None for r in op.regions):
        return None
    operands = []
    for vid in op.operands:
        x = _materialize(read(vid), before, lifter, editor, made)
        if x is None:
            return None
        operands.append(x)
    copies = editor.clone(op.results[0], before, operands)
    made[v] = copies[index]
    return copies[index]


def _const_value(v: Any) -> Any:
    """A const node's value as the kernel implementation receives it when lowering."""
    value = v.attrs["value"]
    if v.dtype is None:
        return value  # a rule's untyped literal (0, 1): a Python scalar
    from pypm_jax.jax.lower import numpy_dtype

    arr = np.asarray(value, dtype=numpy_dtype(v.dtype))
    if v.shape is not None and arr.shape != tuple(v.shape):
        arr = np.broadcast_to(arr, tuple(v.shape))
    return arr


def _lower_kernel(kernel: Any, inputs: list[tuple[str, Any]], args: list[Any]) -> str:
    """StableHLO text of the kernel's implementation on its non-literal inputs."""
    import jax

    from pypm_jax.jax.impls import impl_for
    from pypm_jax.jax.lower import numpy_dtype

    impl = impl_for(kernel.op)
    attrs = dict(kernel.attrs)

    def call(*arrays: Any) -> Any:
        ins = [arrays[x] if kind == "arg" else x for kind, x in inputs]
        return impl(*ins, **attrs)

    avals = [jax.ShapeDtypeStruct(tuple(v.shape), numpy_dtype(v.dtype)) for v in args]
    return jax.jit(call, keep_unused=True).lower(*avals).as_text(debug_info=True)
