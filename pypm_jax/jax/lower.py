"""Lowering a (rewritten) lifted program back to a JAX function: an interpreter over nodes.

Evaluation is demand-driven from the graph outputs (dead nodes are never bound) and uses an
explicit stack, so graph depth never meets Python's recursion limit. What each node becomes:

* a JAX table op: its primitive bound with the node's params (the original params of a lifted
  node, or the attrs of a node a rule built, converted back and completed with defaults), under
  the equation's source info, so the re-jitted program keeps source lines in its metadata;
* an op with an implementation in the table :func:`lower` is given (by default
  :data:`pypm_jax.vocab.impls.KERNEL_IMPLS`, what ``register_impl`` fills; a kernel a rule
  introduced): a call of that implementation with the node's attrs as keyword arguments,
  wrapped on several devices so XLA partitions it by the op's declared factors
  (:mod:`pypm_jax.jax.partition`);
* ``scan`` / ``while`` / ``cond``: ``lax.scan`` / ``lax.while_loop`` / ``lax.switch`` over
  the lowered (possibly rewritten) bodies; ``shard_map``: ``jax.shard_map`` of the lowered
  body with the equation's mesh, specs, manual axes and ``check_vma`` (its kernels run per
  device, as the body does);
* a :class:`~pypm_jax.jax.lift.Region` still intact (no rewrite reached inside: every node
  lifted from the body reads what it read when lifted, up to replaced region inputs): the
  original ``custom_jvp_call`` / ``custom_vjp_call`` / ``remat2`` equation, so gradients keep
  their custom rules. A region a rewrite reached into is lowered node by node; the
  replacement kernel's own ``custom_vjp`` then provides the gradient of what it replaced.
"""

from __future__ import annotations

__all__ = ["LoweringError", "lower"]

import contextvars
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from ..core.dtypes import as_dtype
from ..core.errors import PyPMError
from ..core.terms import CONST, LEAF, Operator
from ..vocab.impls import KERNEL_IMPLS
from ..vocab.partitioning import partitioning_for
from ..vocab.primitives import is_table_op
from . import _compat
from .lift import NESTED_PARAMS, EqnInfo, LiftedProgram, Region, eqn_info
from .types import lower_attrs, numpy_dtype

Impls = Mapping[Operator, Callable[..., Any]]


# Re-emit an equation lifted as it was recorded (no abstract evaluation, no staging dispatch)
# while its operands have the types they had; False binds every equation again, as JAX's
# eval_jaxpr would (the reference the tests compare the HLO of both with).
REEMIT = True


class LoweringError(PyPMError):
    """A rewritten graph that cannot be turned back into a JAX program."""


# ------------------------------------------------------------------------------ planning


def _describe(node: Any) -> str:
    where = f" at {node.loc}" if getattr(node, "loc", None) is not None else ""
    return f"{node.op.qualname} node %{node.id}{where}"


def _region_inputs(region: Region) -> tuple[Any, ...] | None:
    """The region's current inputs if it is intact, else None.

    Intact: every node lifted from the body reads what it read when lifted, except that a
    region input may have been replaced (consistently) by another value.
    """
    ins_ids = {id(v) for v in region.ins}
    subst: dict[int, Any] = {}
    for node, recorded in region.nodes:
        current = node.inputs
        if len(current) != len(recorded):
            return None
        for now, then in zip(current, recorded, strict=True):
            if now is then:
                continue
            if id(then) not in ins_ids:
                return None
            prev = subst.setdefault(id(then), now)
            if prev is not now:
                return None
    return tuple(subst.get(id(v), v) for v in region.ins)


class _Cycle(Exception):
    def __init__(self, region: Region):
        self.region = region


class _Plan:
    """The units to run, in dependency order: ("node", node) or ("region", region, ins)."""

    def __init__(self, prog: LiftedProgram, intact: dict[int, tuple[Any, ...]]):
        self.prog = prog
        given = {id(v) for v in prog.inputs} | {id(v) for v, _ in prog.hoisted}
        # a value produced by an intact region is computed by the region's original call;
        # the outermost region wins (a body returning an inner call's result directly)
        region_of: dict[int, Region] = {}
        for rid in sorted(intact, reverse=True):
            region = prog.regions[rid]
            for v in region.outs:
                region_of[id(v)] = region
        self.units: list[tuple[Any, ...]] = []
        done: set[Any] = set()
        active: set[Any] = set()

        def unit_of(v: Any) -> tuple[Any, Any] | None:
            if id(v) in given:
                return None
            r = region_of.get(id(v))
            if r is not None:
                return (("r", r.id), r)
            return (("n", id(v.node)), v.node)

        def deps(key: Any, obj: Any) -> Sequence[Any]:
            return intact[obj.id] if key[0] == "r" else obj.inputs

        # effects first, in program order (impure nodes are kept even when nothing reads
        # them), then whatever the outputs need
        roots = [n.outputs[0] for n in prog.graph.nodes() if not n.op.pure]
        for out in [*roots, *prog.graph.outputs]:
            start = unit_of(out)
            if start is None or start[0] in done:
                continue
            stack = [(start[0], start[1], iter(deps(*start)))]
            active.add(start[0])
            while stack:
                key, obj, it = stack[-1]
                for v in it:
                    u = unit_of(v)
                    if u is None or u[0] in done:
                        continue
                    if u[0] in active:
                        raise _Cycle(_region_on_cycle(stack, u[0]))
                    active.add(u[0])
                    stack.append((u[0], u[1], iter(deps(*u))))
                    break
                else:
                    stack.pop()
                    active.discard(key)
                    done.add(key)
                    if key[0] == "r":
                        self.units.append(("region", obj, intact[obj.id]))
                    else:
                        self.units.append(("node", obj))


def _region_on_cycle(stack: list[tuple[Any, Any, Any]], back_to: Any) -> Region:
    """A region on the cycle the stack closes at ``back_to`` (a cycle needs one)."""
    keys = [key for key, _, _ in stack]
    start = keys.index(back_to)
    for key, obj, _ in stack[start:]:
        if key[0] == "r":
            return obj
    raise LoweringError("the rewritten graph has a cycle")


def _plan(prog: LiftedProgram) -> _Plan:
    intact: dict[int, tuple[Any, ...]] = {}
    for rid, region in prog.regions.items():
        ins = _region_inputs(region)
        if ins is not None:
            intact[rid] = ins
    while True:
        try:
            return _Plan(prog, intact)
        except _Cycle as cyc:  # only after merges across a region boundary; inline it
            intact.pop(cyc.region.id, None)
            where = _compat.user_frame(cyc.region.source_info)
            warnings.warn(
                f"{cyc.region.name} region{f' at {where}' if where else ''} is lowered "
                "equation by equation (rewrites made it depend on its own body): its "
                "custom derivative rule is not kept",
                stacklevel=2,
            )


def _check_lowerable(plan: _Plan, impls: Impls) -> None:
    for unit in plan.units:
        if unit[0] != "node":
            continue
        node = unit[1]
        op: Operator = node.op
        if op is CONST:
            continue
        if op is LEAF:
            raise LoweringError(f"{_describe(node)} is an input the program does not provide")
        if op in impls:
            continue
        info = eqn_info(node)
        if info is not None and info.kind == "nested":
            for name in NESTED_PARAMS[op.name]:
                bodies = node.attrs[name]
                for body in bodies if isinstance(bodies, tuple) else (bodies,):
                    _check_lowerable(_plan(body), impls)
            continue
        if info is not None:  # lifted from an equation: binds that equation's primitive
            continue
        if is_table_op(op) and _compat.primitive_by_name(op.name) is not None:
            continue  # built by a rule from the primitive table (never by name alone)
        raise LoweringError(
            f"no implementation for {_describe(node)}: register one with "
            "pypm_jax.jax.register_impl(op, fn)"
        )


# ------------------------------------------------------------------------------ running


def lower(prog: LiftedProgram, impls: Impls | None = None) -> Callable[..., list[Any]]:
    """A function of the program's inputs returning the list of its outputs.

    ``impls`` maps replacement operators to their implementations (default: the table
    ``register_impl`` fills, :data:`pypm_jax.vocab.impls.KERNEL_IMPLS`); nested bodies are
    lowered with the same. Raises :class:`LoweringError` now (not when called) for an op
    nothing can compute.
    """
    impls = KERNEL_IMPLS if impls is None else impls
    plan = _plan(prog)
    _check_lowerable(plan, impls)
    steps = [_step(unit, impls) for unit in plan.units]
    in_keys = [id(v) for v in prog.inputs]
    hoisted = [(id(v), c) for v, c in prog.hoisted]

    def run(*args: Any) -> list[Any]:
        if len(args) != len(in_keys):
            raise LoweringError(f"expected {len(in_keys)} arguments, got {len(args)}")
        env: dict[int, Any] = dict(zip(in_keys, args, strict=True))
        for k, c in hoisted:
            env[k] = c
        emit = _compat.emitter() if REEMIT else None  # None unless a jaxpr is traced
        check_vma = _CHECK_VMA.get()
        for step in steps:
            kind = step[0]
            if kind is _EQN:
                _, node, ins, outs, info, emittable = step
                xs = [env[k] for k in ins]
                if check_vma and len(xs) > 1:
                    xs = _compat.vary_alike(_args(xs))
                if emittable and emit is not None:
                    ys = emit(
                        info.primitive,
                        xs,
                        info.params,
                        info.in_avals,
                        info.avals,
                        info.source_info,
                        info.ctx,
                    )
                    if ys is not None:
                        for k, y in zip(outs, ys, strict=True):
                            env[k] = y
                        continue
                _bind_eqn(node, info, xs, env)
            elif kind is _CONST:
                env[step[1]] = step[2]
            elif kind is _REGION:
                _run_region(step[1], step[2], env)
            else:
                _run_node(step[1], env, impls)
        outs = [_typed(env[id(v)]) for v in prog.graph.outputs]
        return [_match_aval(x, aval) for x, aval in zip(outs, prog.out_avals, strict=True)]

    return run


# What running a unit of the plan takes, decided once per lowering (``_step``):
_EQN = "eqn"  # (_EQN, node, input keys, output keys, its EqnInfo, whether it may be emitted)
_CONST = "const"  # (_CONST, output key, the value)
_REGION = "region"  # (_REGION, region, its inputs)
_NODE = "node"  # (_NODE, node): anything else (_run_node decides)


def _step(unit: tuple[Any, ...], impls: Impls) -> tuple[Any, ...]:
    if unit[0] == "region":
        return (_REGION, unit[1], unit[2])
    node = unit[1]
    op: Operator = node.op
    if op is CONST:
        return (_CONST, id(node.outputs[0]), _const(node))
    info = eqn_info(node)
    if op in impls or info is None or info.kind == "nested" or not info.avals:
        return (_NODE, node)
    emittable = (
        info.kind == "plain"  # (not opaque: no effects)
        and len(info.in_avals) == len(node.inputs)
        and _compat.emittable(
            info.primitive, info.params, info.source_info, info.in_avals, info.avals
        )
    )
    ins = tuple([id(v) for v in node.inputs])
    outs = tuple([id(v) for v in node.outputs])
    return (_EQN, node, ins, outs, info, emittable)


def _bind_eqn(node: Any, info: EqnInfo, args: list[Any], env: dict[int, Any]) -> None:
    """Bind the equation a node was lifted from again (on ``args``, the current inputs)."""
    out = _compat.bind(info.primitive, _args(args), info.params, info.source_info, info.ctx)
    outs = list(out) if info.primitive.multiple_results else [out]
    _store(node, [_match_aval(x, a) for x, a in zip(outs, info.avals, strict=True)], env)


def _store(node: Any, outs: list[Any], env: dict[int, Any]) -> None:
    """``outs``, one per output of ``node``, into ``env``."""
    if len(outs) != len(node.outputs):
        raise LoweringError(
            f"{_describe(node)} produced {len(outs)} outputs, not {len(node.outputs)}"
        )
    for v, x in zip(node.outputs, outs, strict=True):
        env[id(v)] = x


def _run_region(region: Region, ins: Sequence[Any], env: dict[int, Any]) -> None:
    args = [_typed(env[id(v)]) for v in ins]
    outs = _compat.bind(region.primitive, args, region.params, region.source_info, region.ctx)
    for v, x in zip(region.outs, outs, strict=True):
        env.setdefault(id(v), x)


def _const(node: Any) -> Any:
    v = node.outputs[0]
    value = node.attrs["value"]
    if v.dtype is None and isinstance(value, bool | int | float | complex):
        return _Untyped(value)  # a rule's literal: takes its dtype from its use (see _args)
    dtype = numpy_dtype(v.dtype) if v.dtype is not None else None
    arr = np.asarray(value, dtype=dtype)
    if v.shape is not None and arr.shape != tuple(v.shape):
        arr = np.broadcast_to(arr, tuple(v.shape))
    return arr


def _run_node(node: Any, env: dict[int, Any], impls: Impls) -> None:
    op: Operator = node.op
    if op is CONST:
        env[id(node.outputs[0])] = _const(node)
        return
    args = _args([env[id(v)] for v in node.inputs])
    if _CHECK_VMA.get() and len(args) > 1:
        args = _compat.vary_alike(args)
    impl = impls.get(op)
    info = eqn_info(node)
    # a node a rule built carries a copy of the replaced root's meta: use its source line
    near = node.meta.get("jax_eqn")
    source_info = near.source_info if isinstance(near, EqnInfo) else None
    if impl is not None:
        with _compat.source_context(source_info):
            outs = _call_impl(node, impl, args)
    elif info is not None and info.kind == "nested":
        with _compat.source_context(source_info):
            params = _compat.control_params(op.name, info.params)
            outs = _NESTED[op.name](node, params, args, impls)
    elif info is not None:
        out = _compat.bind(info.primitive, args, info.params, source_info, info.ctx)
        outs = list(out) if info.primitive.multiple_results else [out]
        if not info.avals:  # no results (an effect): the node's placeholder output
            env[id(node.outputs[0])] = None
            return
    else:
        prim = _compat.primitive_by_name(op.name)
        params = lower_attrs(op.name, node.attrs)
        out = _compat.bind(prim, args, params, source_info)
        outs = list(out) if prim.multiple_results else [out]
    if info is not None:
        outs = [_match_aval(x, a) for x, a in zip(outs, info.avals, strict=True)]
    _store(node, outs, env)


class _Untyped:
    """A literal a rule wrote without a dtype (``prims.mul(x, 0.125)``)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


def _args(args: list[Any]) -> list[Any]:
    """Give untyped literals the dtype of the other operands, as JAX's weak types would."""
    if not any(isinstance(a, _Untyped) for a in args):
        return args
    dtypes = {jax.numpy.dtype(jax.typeof(a).dtype) for a in args if not isinstance(a, _Untyped)}
    dtype = dtypes.pop() if len(dtypes) == 1 else None
    return [
        (np.asarray(a.value, dtype) if dtype is not None else a.value)
        if isinstance(a, _Untyped)
        else a
        for a in args
    ]


def _call_impl(node: Any, impl: Callable[..., Any], args: list[Any]) -> list[Any]:
    out = _kernel_call(node, impl, args)
    outs = list(out) if node.op.n_out > 1 else [out]
    for v, x in zip(node.outputs, outs, strict=False):
        shape = getattr(x, "shape", None)
        if v.shape is not None and shape is not None and tuple(shape) != tuple(v.shape):
            raise LoweringError(
                f"{_describe(node)}: implementation returned shape {tuple(shape)}, the graph "
                f"expects {tuple(v.shape)}"
            )
        dtype = getattr(x, "dtype", None)
        if v.dtype is not None and dtype is not None and as_dtype(dtype) is not v.dtype:
            raise LoweringError(
                f"{_describe(node)}: implementation returned {as_dtype(dtype)}, the graph "
                f"expects {v.dtype}"
            )
    return outs


def _kernel_call(node: Any, impl: Callable[..., Any], args: list[Any]) -> Any:
    """The implementation's call; on several devices, partitioned by the op's declaration
    (:mod:`pypm_jax.jax.partition`) so XLA splits it like the program it replaced. An
    operand that is a pack (a tuple: ``RegionOperands``) is its elements to the declaration
    and to the partitioned call, each an operand of its own."""
    declare = partitioning_for(node.op)
    if declare is None or node.op.n_out != 1 or jax.device_count() == 1 or _PER_DEVICE.get():
        return impl(*args, **node.attrs)
    flat = [_typed(x) for a in args for x in (a if isinstance(a, tuple) else (a,))]
    spec = declare(*(np.shape(x) for x in flat), **node.attrs)
    if spec is None:
        return impl(*args, **node.attrs)
    from .partition import partitioned  # (several devices only: ~2 ms of imports)

    packs = [len(a) if isinstance(a, tuple) else None for a in args]

    def call(*xs: Any, **kw: Any) -> Any:  # the flat operands, packs rebuilt
        it = iter(xs)
        full = [next(it) if n is None else tuple(next(it) for _ in range(n)) for n in packs]
        return impl(*full, **node.attrs, **kw)

    return partitioned(call, spec, flat)


def _typed(x: Any) -> Any:
    return np.asarray(x.value) if isinstance(x, _Untyped) else x


def _match_aval(x: Any, aval: Any) -> Any:
    """Restore a value's weak type when lowering changed it (literals lower as strong)."""
    want = getattr(aval, "weak_type", None)
    if want is None:
        return x
    try:
        have = jax.typeof(x)
    except TypeError:
        return x
    if getattr(have, "weak_type", want) == want or have.dtype != aval.dtype:
        return x
    prim = _compat.primitive_by_name("convert_element_type")
    return _compat.bind(prim, [x], {"new_dtype": aval.dtype, "weak_type": want, "sharding": None})


# ------------------------------------------------------------------------------ nested


def _body_fn(prog: LiftedProgram, impls: Impls) -> Callable[..., list[Any]]:
    return lower(prog, impls)


def _scan(node: Any, p: dict[str, Any], args: list[Any], impls: Impls) -> list[Any]:
    body = _body_fn(node.attrs["jaxpr"], impls)
    nc, nk = p["num_consts"], p["num_carry"]
    consts, init, xs = args[:nc], args[nc : nc + nk], args[nc + nk :]

    def step(carry: tuple[Any, ...], x: tuple[Any, ...]) -> tuple[Any, Any]:
        outs = body(*consts, *carry, *x)
        return tuple(outs[:nk]), tuple(outs[nk:])

    carry, ys = lax.scan(
        step, tuple(init), tuple(xs), length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
    )
    return [*carry, *ys]


def _while(node: Any, p: dict[str, Any], args: list[Any], impls: Impls) -> list[Any]:
    cond = _body_fn(node.attrs["cond_jaxpr"], impls)
    body = _body_fn(node.attrs["body_jaxpr"], impls)
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = args[:cn], args[cn : cn + bn], args[cn + bn :]
    out = lax.while_loop(
        lambda c: cond(*cconsts, *c)[0], lambda c: tuple(body(*bconsts, *c)), tuple(init)
    )
    return list(out)


def _cond(node: Any, p: dict[str, Any], args: list[Any], impls: Impls) -> list[Any]:
    branches = [_body_fn(b, impls) for b in node.attrs["branches"]]
    index, ops = args[0], args[1:]
    fns = [lambda *a, f=f: tuple(f(*a)) for f in branches]
    return list(lax.switch(index, fns, *ops))


# Set while a shard_map body manual over its whole mesh is traced: its kernels already run
# per device, so they are called as registered, never wrapped for partitioning.
_PER_DEVICE: contextvars.ContextVar[bool] = contextvars.ContextVar("pypm_per_device", default=False)
# Set while a shard_map body with check_vma is traced: operands are made varying alike.
_CHECK_VMA: contextvars.ContextVar[bool] = contextvars.ContextVar("pypm_check_vma", default=False)


def _shard_map(node: Any, p: dict[str, Any], args: list[Any], impls: Impls) -> list[Any]:
    """``jax.shard_map`` of the lowered body with the equation's mesh, specs and checks."""
    body = _body_fn(node.attrs["jaxpr"], impls)
    mesh, manual = p["mesh"], p["newly_manual_axes"]
    per_device = frozenset(mesh.axis_names) <= frozenset(manual)

    def run(*xs: Any) -> tuple[Any, ...]:
        token = _PER_DEVICE.set(per_device or _PER_DEVICE.get())
        vma = _CHECK_VMA.set(bool(p["check_vma"]))
        try:
            return tuple(body(*xs))
        finally:
            _CHECK_VMA.reset(vma)
            _PER_DEVICE.reset(token)

    mapped = jax.shard_map(
        run,
        mesh=mesh,
        in_specs=tuple(p["in_specs"]),
        out_specs=tuple(p["out_specs"]),
        axis_names=frozenset(manual),
        check_vma=p["check_vma"],
    )
    return list(mapped(*args))


_NESTED: dict[str, Callable[[Any, dict[str, Any], list[Any], Impls], list[Any]]] = {
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "shard_map": _shard_map,
}
