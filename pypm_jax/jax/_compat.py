"""The one place that touches JAX internals (a test fails loudly when JAX moves them).

Everything the bridge needs from JAX beyond its documented API goes through a function here,
and ``tests/jax/test_jax_compat.py`` exercises each of them, so a JAX upgrade that moves one
fails loudly in one test instead of silently degrading lifting (e.g. losing source lines).

Used here: ``jax.extend.core`` (Jaxpr, ClosedJaxpr, Literal, Var, Primitive, the primitive
objects), ``Primitive.get_bind_params`` (how ``eval_jaxpr`` re-binds call primitives),
``jax._src.source_info_util`` (user frames, name stacks), ``jax._src.core.auto_insert_reshard``
(operands of one varying type in a ``shard_map`` body),
``jax._src.sharding_impls.parse_flatten_op_sharding`` (an XLA sharding as mesh axes),
``jax._src.interpreters.partial_eval.convert_constvars_jaxpr`` (hoisting a body's consts),
``DynamicJaxprTrace.emit_eqn`` (re-emitting an equation without binding it again), and the
params of control-flow equations, whose form changes between JAX versions.

Supported: jax 0.10.2 (the pin) and jax 0.11.2. What moved between them, and where it is
absorbed here:

* ``ClosedJaxpr`` and ``Jaxpr`` are one class on 0.11 (a ``Jaxpr`` carries its consts, and
  ``.jaxpr`` is a legacy accessor returning itself): :func:`body_parts`.
* ``scan`` params ``num_consts``/``num_carry`` became ``ft_in``/``ft_out`` (flat trees of the
  (consts, carry, xs) inputs and (carry, ys) outputs): :func:`control_params`.
* ``reduce_max``/``reduce_min`` gained ``out_sharding`` and ``top_k`` gained ``is_stable``:
  :func:`absent_params` / :func:`adapt_params`.
"""

from __future__ import annotations

__all__ = [
    "ClosedJaxpr",
    "Jaxpr",
    "JaxprEqn",
    "Literal",
    "Var",
    "Primitive",
    "primitive_by_name",
    "remember_primitive",
    "bind",
    "emittable",
    "emitter",
    "source_context",
    "user_frame",
    "name_stack",
    "literal_value",
    "convert_constvars",
    "is_extended_dtype",
    "closed_jaxpr",
    "jaxpr_as_fun",
    "is_tracer",
    "has_tracers",
    "JAX_VERSION",
    "body_parts",
    "control_params",
    "CONTROL_PARAMS",
    "absent_params",
    "adapt_params",
    "vary_alike",
    "mesh_axes",
]

from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.extend.core as _jex
import jax.extend.core.primitives as _jex_prims
from jax._src import core as _core
from jax._src import sharding_impls as _sharding_impls
from jax._src import source_info_util as _siu
from jax._src.interpreters import partial_eval as _pe

from ..core.errors import SourceLoc
from ..core.source import is_library_file, source_loc

ClosedJaxpr = _jex.ClosedJaxpr
Jaxpr = _jex.Jaxpr
JaxprEqn = _jex.JaxprEqn
Literal = _jex.Literal
Var = _jex.Var
Primitive = _jex.Primitive

JAX_VERSION: tuple[int, ...] = tuple(jax.__version_info__)

# ------------------------------------------------------------------------------ primitives

_PRIMS: dict[str, Primitive] = {}
for _attr in dir(_jex_prims):
    _p = getattr(_jex_prims, _attr)
    if isinstance(_p, Primitive):
        _PRIMS.setdefault(_p.name, _p)


def remember_primitive(prim: Primitive) -> None:
    """Record a primitive met while lifting, so ops built by rules can be lowered by name."""
    _PRIMS.setdefault(prim.name, prim)


def primitive_by_name(name: str) -> Primitive | None:
    """The JAX primitive object named ``name`` (``"dot_general"``, ``"scatter-add"``)."""
    return _PRIMS.get(name)


def bind(
    prim: Primitive,
    args: Sequence[Any],
    params: dict[str, Any],
    source_info: Any = None,
    ctx: Any = None,
) -> Any:
    """Apply ``prim`` to ``args`` with an equation's ``params``, exactly as ``eval_jaxpr``.

    Call-like primitives (jit, custom_jvp_call, ...) take their callee as a bind param
    (``subfuns``), which ``get_bind_params`` builds. ``source_info`` and the equation context
    ``ctx``, when given, are re-established so the re-traced program keeps source lines and
    name stacks (visible in profiles and HLO metadata).
    """
    bind_params = prim.get_bind_params(params)
    with source_context(source_info):
        if ctx is None:
            return prim.bind(*args, **bind_params)
        with ctx.manager:
            return prim.bind(*args, **bind_params)


# Primitives whose staging rule is JAX's default one under another name (``reshape``'s only
# rebuilds its params): an equation of theirs can be emitted as recorded. A test compares
# emitting with binding for each, so a JAX that gives one a real rule fails there.
PLAIN_STAGING = frozenset({"reshape", "broadcast_in_dim"})


def emittable(
    prim: Primitive,
    params: dict[str, Any],
    source_info: Any,
    in_avals: Sequence[Any],
    out_avals: Sequence[Any],
) -> bool:
    """Whether an equation of ``prim`` (with ``params``, ``source_info``, its operands'
    types ``in_avals`` and its results' ``out_avals``) may be re-emitted as recorded
    (:func:`emitter`) instead of bound again: binding it would only abstract-evaluate it
    again, to the types it has, and record it.

    Not: primitives with a staging or constant-folding rule of their own (they may record
    another equation, or none), equations a forwarding rule drops (binding would forward
    an operand: the rule is asked), call-like primitives (their bind params differ from
    their params), ones that allocate refs or hold jaxprs (higher-order), types with
    mutable state, and an equation without a traceback (binding would take the current
    one).
    """
    if getattr(source_info, "traceback", None) is None or not _emittable_primitive(prim):
        return False
    for v in params.values():
        if isinstance(v, (Jaxpr, ClosedJaxpr)):
            return False
    for a in (*in_avals, *out_avals):
        if getattr(a, "has_qdd", False):  # (jax 0.12 has no such types)
            return False
    forward = _pe.forwarding_rules.get(prim)
    if forward is not None:  # what binding decides after recording the equation
        probe = _jex.new_jaxpr_eqn(
            [Var(a) for a in in_avals], [Var(a) for a in out_avals], prim, params, set()
        )
        in_fwd, kept = forward(probe)
        return kept is probe and all(i is None for i in in_fwd)
    return True


def _emittable_primitive(prim: Primitive) -> bool:
    """:func:`emittable`'s verdict on the primitive, remembered until JAX's rule tables
    change size (a module registering rules is imported)."""
    tables = (_pe.custom_staging_rules, _pe.forwarding_rules, _pe.const_fold_rules)
    version = tuple(map(len, tables))
    if version != _EMITTABLE_VERSION[0]:
        _EMITTABLE.clear()
        _EMITTABLE_VERSION[0] = version
    found = _EMITTABLE.get(prim)
    if found is None:
        found = _EMITTABLE[prim] = not (
            (prim in _pe.custom_staging_rules and prim.name not in PLAIN_STAGING)
            or prim in _pe.const_fold_rules
            or type(prim).get_bind_params is not _core.Primitive.get_bind_params
            or type(prim).is_high is not _core.Primitive.is_high
            or type(prim).bind_with_trace is not _core.Primitive.bind_with_trace
            or "bind_with_trace" in vars(prim)
            or prim.ref_allocating
        )
    return found


_EMITTABLE: dict[Primitive, bool] = {}
_EMITTABLE_VERSION: list[tuple[int, ...]] = [()]


def emitter() -> Any:
    """While a jaxpr is traced (``jax.jit(f).trace``, ``jax.make_jaxpr``): a function
    ``emit(prim, args, params, in_avals, out_avals, source_info, ctx)`` that records an
    equation as :func:`bind` would (same primitive, params, types, source info, context)
    without binding it (no canonicalization, abstract evaluation or staging dispatch), and
    returns its results; or None when the arguments are not all tracers of that jaxpr with
    exactly the types ``in_avals`` (then :func:`bind` is the way). ``prim`` and ``params``
    must be :func:`emittable` with these avals; ``out_avals`` are the types binding gave
    before. Outside a jaxpr trace (eager evaluation), None.
    """
    trace = _core.trace_ctx.trace
    if type(trace) is not _pe.DynamicJaxprTrace:
        return None
    tracer_type = _pe.DynamicJaxprTracer
    info_ctx = _siu._source_info_context
    no_effects = _core.no_effects
    contexts: dict[int, tuple[Any, Any]] = {}

    def emit(
        prim: Primitive,
        args: Sequence[Any],
        params: dict[str, Any],
        in_avals: Sequence[Any],
        out_avals: Sequence[Any],
        source_info: Any,
        ctx: Any,
    ) -> list[Any] | None:
        for x, aval in zip(args, in_avals, strict=True):
            if type(x) is not tracer_type or x._trace is not trace:
                return None
            have = x.aval
            if have is not aval and have != aval:
                return None
        # binding under source_context: the traceback, the current name stack + the node's
        outer = info_ctx.context.name_stack
        if outer.stack:
            source_info = source_info.replace(name_stack=outer + source_info.name_stack)
        # binding under ctx.manager: the context JAX makes there (the current XLA metadata
        # joined with the equation's), the same for every node of one ctx in one trace
        found = contexts.get(id(ctx))
        if found is None:
            with ctx.manager:
                found = contexts[id(ctx)] = (ctx, _core.current_jaxpr_eqn_context())
        return trace.emit_eqn(
            list(args), out_avals, prim, params, no_effects, source_info, found[1]
        )

    return emit


def source_context(source_info: Any) -> Any:
    """A context in which traced operations get ``source_info``'s traceback and name stack."""
    import contextlib

    if source_info is None:
        return contextlib.nullcontext()
    stack = _siu.current_name_stack() + source_info.name_stack
    return _siu.user_context(source_info.traceback, name_stack=stack)


# ------------------------------------------------------------------------------ sources

# JAX's own notion of "user frame" excludes JAX and the standard library; the project's
# (core.source) also excludes Flax and this project, so a node's source is the line of the
# model (or test) that produced it.


def _frames(traceback: Any) -> Iterator[Any]:
    return _siu.user_frames(traceback)


def user_frame(source_info: Any) -> SourceLoc | None:
    """The innermost frame of the equation's traceback in user code (not JAX/Flax/pypm)."""
    tb = getattr(source_info, "traceback", None)
    if tb is None:
        return None
    try:
        codes, lastis = tb.raw_frames()
    except Exception:  # a traceback without raw frames: JAX's frame iterator
        for frame in _frames(tb):
            if not is_library_file(frame.file_name):
                return source_loc(frame.file_name, frame.start_line)
        return None
    # JAX's user_frames, with the filenames tested before any frame's line is computed:
    # only the frame chosen needs one (a model's traceback has dozens of frames, and a
    # model's equations share most of them: each file is classified once)
    user = _USER_FILES
    for code, lasti in zip(codes, lastis, strict=True):
        fname = code.co_filename
        mine = user.get(fname)
        if mine is None:
            mine = not is_library_file(fname) and _siu.is_user_filename(fname)
            if len(user) >= 4096:
                user.clear()
            user[fname] = mine
        if mine:
            return source_loc(fname, _siu.raw_frame_to_frame(code, lasti).start_line)
    return None


# file name -> is it the user's (neither a library's nor JAX's notion of one)
_USER_FILES: dict[str, bool] = {}


def name_stack(source_info: Any) -> Any:
    """The equation's name stack object (scopes from ``jax.named_scope`` and Flax modules)."""
    return getattr(source_info, "name_stack", None)


def name_stack_scopes(stack: Any) -> tuple[str, ...]:
    """The scope names of a name stack, outermost first; transforms (``jvp(...)``) dropped."""
    if stack is None:
        return ()
    out = []
    for elem in stack.stack:
        if isinstance(elem, _siu.Scope):
            out.append(elem.name)
    return tuple(out)


def join_name_stacks(outer: Any, inner: Any) -> Any:
    """The name stack of an equation inlined from a callee (``outer + inner``)."""
    if outer is None:
        return inner
    if inner is None:
        return outer
    return outer + inner


def with_name_stack(source_info: Any, stack: Any) -> Any:
    return source_info.replace(name_stack=stack)


# ------------------------------------------------------------------------------ jaxprs


def literal_value(lit: Any) -> Any:
    """A literal's value as a numpy array or scalar (``Literal.val`` may be a jax array)."""
    import numpy as np

    return np.asarray(lit.val)


def convert_constvars(jaxpr: Any) -> Any:
    """Turn a jaxpr's constvars into leading invars (to pass a body's consts as operands)."""
    return _pe.convert_constvars_jaxpr(jaxpr)


def jaxpr_as_fun(closed: Any) -> Any:
    """The function a ClosedJaxpr computes (list of outputs)."""
    return _jex.jaxpr_as_fun(closed)


def is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def has_tracers(values: Sequence[Any]) -> bool:
    return any(isinstance(v, jax.core.Tracer) for v in values)


def closed_jaxpr(jaxpr: Any, consts: Sequence[Any]) -> Any:
    return ClosedJaxpr(jaxpr, list(consts))


def is_extended_dtype(dtype: Any) -> bool:
    """PRNG key types and other extended dtypes have no numpy equivalent."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


# ------------------------------------------------------------------------------ versioned params


def body_parts(body: Any) -> tuple[Any, list[Any]]:
    """A body param (of ``scan``, ``while``, ``cond``, ``jit``, ``custom_jvp_call``, ...) as
    ``(jaxpr, consts)``, with ``jaxpr.constvars`` paired with ``consts``.

    jax 0.10 gives a ``ClosedJaxpr`` (``.jaxpr`` + ``.consts``) or an open ``Jaxpr`` (no
    consts: ``remat2``); jax 0.11 merged the two classes, a ``Jaxpr`` carrying its consts.
    """
    consts = list(getattr(body, "consts", None) or ())
    inner = getattr(body, "jaxpr", body)
    if not isinstance(inner, Jaxpr):
        raise TypeError(f"expected a jaxpr, got {type(body).__name__}")
    if len(inner.constvars) != len(consts):
        raise TypeError(
            f"a jaxpr with {len(inner.constvars)} constvars came with {len(consts)} consts"
        )
    return inner, consts


# The version-independent params of the nested (control-flow) primitives: lifted nodes carry
# these as attrs whatever JAX produced, and lowering reads them.
CONTROL_PARAMS: dict[str, tuple[str, ...]] = {
    "scan": ("reverse", "length", "jaxpr", "num_consts", "num_carry", "unroll"),
    "while": ("cond_jaxpr", "body_jaxpr", "cond_nconsts", "body_nconsts"),
    "cond": ("branches",),
    "shard_map": ("jaxpr", "mesh", "in_specs", "out_specs", "check_vma", "newly_manual_axes"),
}


def control_params(prim_name: str, params: dict[str, Any]) -> dict[str, Any]:
    """A ``scan``/``while``/``cond``/``shard_map`` equation's params in the form
    :data:`CONTROL_PARAMS` names.

    ``scan``: jax 0.10 has ``num_consts``/``num_carry``; jax 0.11 replaced them by ``ft_in``
    (a flat tree of the (consts, carry, xs) inputs) and ``ft_out`` ((carry, ys)). The body's
    inputs are consts, carry, xs and its outputs carry, ys in both. Anything else raises, so
    a JAX that changes these params again fails here, not with a wrong lowering.
    """
    want = CONTROL_PARAMS.get(prim_name)
    if want is None:
        raise KeyError(f"{prim_name} is not a control-flow primitive")
    if prim_name == "scan" and "num_consts" not in params and "ft_in" in params:
        parts = params["ft_in"].unpack()
        if len(parts) != 3:
            raise TypeError(f"scan ft_in has {len(parts)} parts, expected (consts, carry, xs)")
        n_consts, n_carry, _ = (len(p) for p in parts)
        n_carry_out = len(params["ft_out"].unpack()[0])
        if n_carry_out != n_carry:
            raise TypeError(f"scan ft_out has {n_carry_out} carries, ft_in {n_carry}")
        params = {**params, "num_consts": n_consts, "num_carry": n_carry}
    missing = [k for k in want if k not in params]
    if missing:
        raise TypeError(
            f"unsupported {prim_name} params on jax {jax.__version__}: {sorted(params)} "
            f"(missing {missing}); update pypm_jax.jax._compat.control_params"
        )
    return {k: params[k] for k in want}


# Params that only some supported JAX versions give a primitive, with the first version that
# has each. The op table lists them (a rule may set them); lowering an op a rule built drops
# the ones the installed JAX does not take.
_PARAMS_SINCE: dict[tuple[str, str], tuple[int, int]] = {
    ("reduce_max", "out_sharding"): (0, 11),
    ("reduce_min", "out_sharding"): (0, 11),
    ("top_k", "is_stable"): (0, 11),
}


def absent_params(prim_name: str) -> frozenset[str]:
    """Params the op table lists for ``prim_name`` that the installed JAX does not take."""
    return frozenset(
        param
        for (name, param), since in _PARAMS_SINCE.items()
        if name == prim_name and JAX_VERSION[:2] < since
    )


def adapt_params(prim_name: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` without the ones the installed JAX does not take for ``prim_name``."""
    absent = absent_params(prim_name)
    return {k: v for k, v in params.items() if k not in absent} if absent else params


# ------------------------------------------------------------------------------ shard_map


def vary_alike(args: Sequence[Any]) -> list[Any]:
    """Operands of one operation in a ``shard_map`` body (``check_vma``) made varying over
    the same manual mesh axes, as JAX's own ``jnp`` operations do before binding: lifting
    drops the ``pvary`` casts JAX put there, and most primitives demand operands of one
    varying-axes type. ``jax._src.core.auto_insert_reshard`` is what ``jnp`` calls. A
    kernel node's operands may be tuples (captured operands): their arrays are cast too."""
    leaves, tree = jax.tree.flatten(list(args))
    if len(leaves) > 1:
        leaves = list(_core.auto_insert_reshard(*leaves))
    return jax.tree.unflatten(tree, leaves)


def mesh_axes(sharding: Any, mesh: Any, ndim: int) -> tuple[tuple[str, ...], ...] | None:
    """The mesh axes splitting each dimension of an array with ``sharding`` (an XLA sharding
    a partitioner chose), or None when no mesh axes express it: Shardy may split an axis
    into sub-axes (``model:(1)2``), which JAX's own decoding rejects with an error."""
    try:
        hlo = sharding._to_xla_hlo_sharding(ndim)
        (spec,) = _sharding_impls.parse_flatten_op_sharding(hlo, mesh)
    except (ValueError, NotImplementedError, KeyError):  # not the mesh's axes (KeyError: a
        # tile the axes' sizes do not compose, as a sub-axis cut of them)
        return None
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return tuple(() if e is None else tuple(e) if isinstance(e, tuple) else (e,) for e in entries)
