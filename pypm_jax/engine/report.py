"""How a rewrite report prints: one row per rewrite that fits 100 columns, a summary grouped
by kernel and by module, and the same as plain data (``to_dict``) for JSON.

A row says what a rewrite made, not which node ids it touched: the rule, the kernel it
called with the kernel's shapes and dtype, its flags (``causal``, the activation, ...), how
many nodes it replaced, the module path and the user's source line. The kernel columns come
from a *describer* registered for the replacement operator (:func:`register_describe`): the
standard rules register theirs beside their operators, and a new replacement operator plugs
in the same way. An operator without a describer shows its name and result type.
"""

from __future__ import annotations

__all__ = ["Built", "KernelInfo", "describe_record", "register_describe", "rows", "table"]

import os
import re
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ..core.terms import Operator

if TYPE_CHECKING:
    from .rewrite import RewriteRecord

WIDTH = 100  # the widest a printed row may be


class Built(NamedTuple):
    """A node a rewrite added, kept for the report: its operator, attributes and the printed
    type of its (first) result, e.g. ``f32[2,8,64]``."""

    op: Operator
    attrs: Mapping[str, Any]
    type: str


class KernelInfo(NamedTuple):
    """What a report says about a replacement: the kernel's name, its problem size and dtype
    in a few characters (``f32 B2 H8 S128x128 D64``), and its flags (``causal``, ``gelu``)."""

    kernel: str
    shape: str = ""
    flags: tuple[str, ...] = ()


Describer = Callable[[Mapping[str, Any], str], KernelInfo]
_DESCRIBERS: dict[Operator, Describer] = {}


def register_describe(op: Operator, fn: Describer | None = None) -> Any:
    """Register ``fn(attrs, type) -> KernelInfo`` as how reports describe a node of ``op``
    (``attrs``: the node's attributes, e.g. its ``plan``; ``type``: its printed result type).

    ``register_describe(op, fn)``, or as a decorator ``@register_describe(op)``; registered
    at import time of the module that defines the operator. The latest registration wins.
    """
    if not isinstance(op, Operator):
        raise TypeError(f"register_describe needs a pm operator, got {op!r}")

    def deco(f: Describer) -> Describer:
        if not callable(f):
            raise TypeError(f"the describer of {op.name} must be callable, got {f!r}")
        _DESCRIBERS[op] = f
        return f

    return deco(fn) if fn is not None else deco


def _is_kernel(b: Built) -> bool:
    """A node of a replacement operator (not a JAX primitive the rule also built)."""
    return b.op in _DESCRIBERS or not b.op.namespace.startswith("jax")


def _typed(text: str) -> str:
    """A printed type, empty when nothing of it is known (``?[?]``)."""
    return "" if text == "?[?]" else text


def describe_record(r: RewriteRecord) -> KernelInfo:
    """The kernel a rewrite made, described by its operator's describer; ``-`` when the rule
    built JAX primitives only (a normalization), with the type of what it built."""
    kernels = [b for b in r.built if _is_kernel(b)]
    if not kernels:
        return KernelInfo("-", _typed(r.built[-1].type) if r.built else "")
    b = kernels[-1]  # the outermost: a rule builds a result's inputs first
    fn = _DESCRIBERS.get(b.op)
    if fn is None:
        return KernelInfo(b.op.name, _typed(b.type))
    try:
        return fn(b.attrs, b.type)
    except Exception as exc:  # noqa: BLE001 - a report must print: say what went wrong
        return KernelInfo(b.op.name, b.type, (f"<describe failed: {type(exc).__name__}>",))


def short_path(file: str) -> str:
    """``file`` relative to the working directory when under it, to its package's parent
    when installed (``site-packages/flax/...`` prints ``flax/...``), else as given."""
    if not os.path.isabs(file):
        return file
    cwd = os.getcwd() + os.sep
    if file.startswith(cwd):
        return file[len(cwd) :]
    for marker in ("site-packages", "dist-packages"):
        head, sep, tail = file.rpartition(os.sep + marker + os.sep)
        if sep:
            return tail
    return file


def row(r: RewriteRecord, on: int | None = None) -> dict[str, Any]:
    """One rewrite as plain data (what ``to_dict`` lists and the table prints); ``on``: the
    index of the earlier rewrite whose result this one rewrote again (e.g. a causal mask
    folded into an attention kernel), or None."""
    info = describe_record(r)
    return {
        "on": on,
        "rule": r.rule,
        "pattern": r.pattern,
        "kernel": info.kernel,
        "shape": info.shape,
        "flags": list(info.flags),
        "replaced": len(r.replaced),
        "op": r.op,
        "module": r.module_path or None,
        "source": (
            None if r.source is None else {"file": short_path(r.source.file), "line": r.source.line}
        ),
        "detail": r.detail or None,  # a region the kernel compiles (its logits, mask, band)
    }


def rows(records: Sequence[RewriteRecord]) -> list[dict[str, Any]]:
    """The records as :func:`row` dicts, each knowing which earlier rewrite it rewrote."""
    made_by: dict[int, int] = {}
    out = []
    for i, r in enumerate(records):
        out.append(row(r, made_by.get(r.root)))
        for n in r.created:
            made_by[n] = i
    return out


def final(rows: Sequence[Mapping[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """The rows of the kernels that run, with their indices: a rewrite whose result a later
    one rewrote again (an attention kernel whose causal mask was then folded in) is left out,
    its replaced nodes counted in the later row."""
    out: dict[int, dict[str, Any]] = {}
    for i, d in enumerate(rows):
        d = dict(d)
        earlier = out.pop(d["on"], None) if d["on"] is not None else None
        if earlier is not None:
            d["replaced"] += earlier["replaced"]
        out[i] = d
    return list(out.items())


_HEADER = ("rule", "kernel", "shape", "flags", "nodes", "module", "source")
_PATHS = ("module", "source")  # their end says most: cut at the left, at a "/" if one fits
# When a row is too wide, the module and source columns give way first, down to these
# widths in turn, then the widest of the elastic columns shrinks, a character at a time.
_FLOORS = ({"module": 16, "source": 28}, {"module": 10, "source": 20}, {"module": 8, "source": 14})
_ELASTIC = ("module", "source", "shape", "flags", "kernel", "rule")
_MIN = 8


def _cells(d: Mapping[str, Any], printable: Callable[[str], str]) -> tuple[str, ...]:
    src = d["source"]
    return tuple(
        printable(c) or "-"
        for c in (
            d["rule"],
            d["kernel"],
            d["shape"],
            ",".join(d["flags"]),
            str(d["replaced"]),
            d["module"] or "",
            "" if src is None else f"{src['file']}:{src['line']}",
        )
    )


def _fit(header: Sequence[str], widths: list[int], width: int) -> list[int]:
    """Column widths whose row (two spaces between columns) fits ``width``."""
    widths = list(widths)
    excess = sum(widths) + 2 * (len(widths) - 1) - width
    for floors in _FLOORS:
        for name, floor in floors.items():
            if name not in header:
                continue
            c = header.index(name)
            cut = max(0, min(excess, widths[c] - floor))
            widths[c] -= cut
            excess -= cut
    elastic = [header.index(c) for c in _ELASTIC if c in header]
    while excess > 0:
        c = max(elastic, key=lambda j: widths[j])
        if widths[c] <= _MIN:
            break
        widths[c] -= 1
        excess -= 1
    return widths


def _cut(cell: str, w: int, path: bool) -> str:
    """``cell`` in ``w`` characters: a path keeps its end (from a ``/`` if one fits), other
    text its start."""
    if len(cell) <= w:
        return cell
    if not path:
        return cell[: w - 3] + "..."
    tail = cell[len(cell) - w + 3 :]
    slash = tail.find("/")
    return "..." + (tail[slash:] if 0 <= slash < len(tail) - 1 else tail)


def _common_dir(cells: Sequence[str]) -> str:
    """The leading ``/``-separated components every cell shares (each keeps at least its
    last component), with the trailing ``/``; empty when there are none."""
    parts = [c.split("/")[:-1] for c in cells if c != "-"]
    if not parts:
        return ""
    common = []
    for names in zip(*parts, strict=False):
        if any(n != names[0] for n in names):
            break
        common.append(names[0])
    return "/".join(common) + "/" if common else ""


def _strip_common(
    header: Sequence[str], body: list[tuple[str, ...]]
) -> tuple[list[tuple[str, ...]], list[str]]:
    """The rows with the module paths' and sources' shared leading components taken out,
    and a line per column saying what they were."""
    notes = []
    for name in _PATHS:
        if name not in header:
            continue
        c = header.index(name)
        prefix = _common_dir([r[c] for r in body])
        if prefix:
            label = f"{name}s under "
            notes.append(label + _cut(prefix, WIDTH - len(label), True))
            n = len(prefix)
            body = [(*r[:c], r[c][n:] if r[c] != "-" else r[c], *r[c + 1 :]) for r in body]
    return body, notes


def _natural(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[int]:
    return [max(len(r[c]) for r in [header, *body]) for c in range(len(header))]


def table(rows: Sequence[Mapping[str, Any]], printable: Callable[[str], str]) -> str:
    """The :func:`final` rows as a table at most :data:`WIDTH` columns wide (without the
    module column when no row has a module path). When the rows are too wide, the leading
    components all module paths (or all sources) share are said once above the table."""
    body = [_cells(d, printable) for _, d in final(rows)]
    keep = [
        c for c, name in enumerate(_HEADER) if name != "module" or any(r[c] != "-" for r in body)
    ]
    header = tuple(_HEADER[c] for c in keep)
    body = [tuple(r[c] for c in keep) for r in body]
    notes: list[str] = []
    if sum(_natural(header, body)) + 2 * (len(header) - 1) > WIDTH:
        body, notes = _strip_common(header, body)
    widths = _fit(header, _natural(header, body), WIDTH)
    paths = [name in _PATHS for name in header]
    details = [None] + [d.get("detail") for _, d in final(rows)]
    lines = []
    for r, detail in zip([header, *body], details, strict=True):
        lines.append(
            "  ".join(
                _cut(cell, w, path).ljust(w) for cell, w, path in zip(r, widths, paths, strict=True)
            ).rstrip()
        )
        if detail:  # the region under its row, wrapped to the table's width
            lines += textwrap.wrap(
                printable(detail), WIDTH, initial_indent="  ", subsequent_indent="    "
            )
    return "\n".join([*notes, *lines])


def _module_group(path: str | None) -> str:
    """A module path with its layer numbers as ``*`` (``encoder/layer/*/attention``), so
    the layers of a stack count as one group."""
    if not path:
        return "-"
    return "/".join("*" if re.fullmatch(r"(layers?_?)?\d+", p) else p for p in path.split("/"))


def _kernel_key(d: Mapping[str, Any]) -> str:
    if d["kernel"] == "-":
        return "no kernel"
    flags = ",".join(d["flags"])
    return f"{d['kernel']}[{flags}]" if flags else d["kernel"]


def groups(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """How many of the :func:`final` kernels each kernel (with its flags) and each module
    group has."""
    kernels: dict[str, int] = {}
    modules: dict[str, int] = {}
    for _, d in final(rows):
        k, m = _kernel_key(d), _module_group(d["module"])
        kernels[k] = kernels.get(k, 0) + 1
        modules[m] = modules.get(m, 0) + 1
    return {"kernels": kernels, "modules": modules}


def summary(rows: Sequence[Mapping[str, Any]], printable: Callable[[str], str]) -> str:
    """``by kernel: flash_attention[causal] x12, ...`` and ``by module: ...`` lines."""
    out = []
    for title, counts in groups(rows).items():
        if title == "modules" and list(counts) == ["-"]:
            continue  # no module paths (not a Flax model): nothing to group
        items = ", ".join(f"{printable(k)} x{n}" for k, n in counts.items())
        out += textwrap.wrap(
            f"by {title[:-1]}: {items}", WIDTH, subsequent_indent="  ", break_on_hyphens=False
        )
    return "\n".join(out)
