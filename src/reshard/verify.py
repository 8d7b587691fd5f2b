"""``reshard verify A B``: do two checkpoints hold the same model, whatever their layouts?

Each side is a full checkpoint file, a unified folder (``part*.safetensors`` +
``param_name_map.json``), a Hugging Face sharded model (its folder or its index file), or a
``rank_<r>`` folder tree with its strategy, in either format.
Why it is built this way:

* **No second slicer.** Each side is turned into a plan of its *full* tensors with the planners
  the converters use (a dry-run transform to no strategy for a rank tree, a whole-file convert
  plan for files and unified parts). A full tensor is then assembled from that plan's copies,
  exactly as the executor would write it, so verify checks the layout engine's view of a
  checkpoint rather than re-deriving it.
* **Streaming, bounded memory.** Tensors are compared one at a time, in row blocks of dim 0 sized
  from ``max_memory`` (the float64 difference of a block needs 8 bytes per element, so a block
  has at most ``max_memory / 32`` elements). A tensor that is one unchanged source tensor is a
  zero-copy view of the source map; source pages are handed back after each tensor.
* **Exact by default.** Two tensors match when dtype, shape and every byte are equal (so -0.0 vs
  0.0 or two different NaN payloads differ). ``atol > 0`` also accepts values within ``atol``.
  For differing tensors the maximum absolute difference is reported (``inf`` when a NaN is on one
  side only).
* **crc trailers** of plain ``.ckpt`` sources are checked by default (one extra read per file);
  safetensors ``crc_num`` metadata is not, because MindSpore copies a source's value into every
  unified part, where it no longer matches.
* A is the reference: names only in A are *missing*, names only in B *unexpected*.
* **``dtype``** (``--dtype bf16``) reads every floating tensor of both sides as that dtype (the
  cast ``--dtype-all`` writes, through the same ``reshard.plan.cast`` rule and the same
  ``assemble.copy_boxes`` conversion), then compares exactly: an output written with ``--dtype``
  matches its source bit for bit, and a wrong cast shows up as a difference.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from reshard import api, dtypes
from reshard.errors import UsageError
from reshard.execute import assemble
from reshard.execute.dequant import wrapped_opener
from reshard.execute.local import SourceCache
from reshard.formats import rank_dirs
from reshard.formats.base import decode_string
from reshard.formats.strategy import StrategyFile
from reshard.naming import NameFilter, NameOptions
from reshard.plan import Plan, TensorPlan, plan_convert
from reshard.plan.cast import cast_files, cast_rule
from reshard.plan.quantized import Precision
from reshard.plan.surgery import NameRun
from reshard.sources import (
    ANY_CHECKPOINT,
    HUGGING_FACE,
    ONE_RANK_FOLDER,
    UNIFIED,
    Kind,
    OpenedModel,
    ReadOptions,
    full_model_file,
    has_crc_trailer,
    identify,
    is_encrypted,
    is_sharded,
    kind_of,
    open_checkpoint,
    resolve,
)
from reshard.sources.checkpoint2 import check_iteration

EXIT_DIFFER = 1  # the CLI's exit code when the checkpoints differ (2 stays "bad input")
DEFAULT_MAX_MEMORY = 256 * 1024**2
_BYTES_PER_COMPARED_ELEMENT = 32  # two float64 copies, their difference, and slack
_VIRTUAL_OUT = "<verify>"  # output path of the dry-run plans: never written

MATCH, DIFFER, MISSING, UNEXPECTED = "match", "differ", "missing", "unexpected"


@dataclass(frozen=True)
class TensorResult:
    """The verdict on one name. ``dtype``/``shape`` are A's (B's for unexpected names)."""

    name: str
    status: str
    dtype: str
    shape: tuple[int, ...]
    max_abs_diff: float | None = None
    detail: str = ""
    first_index: tuple[int, ...] | None = None  # the first differing element, row-major (values that differ)

    def to_json(self) -> dict[str, Any]:
        diff = self.max_abs_diff
        return {
            "name": self.name,
            "status": self.status,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "max_abs_diff": None if diff is None else (diff if np.isfinite(diff) else str(diff)),
            "detail": self.detail,
            "first_index": None if self.first_index is None else list(self.first_index),
        }


class _Names:
    """``report.matching``, ``.differing``, ...: the names whose verdict has one status."""

    def __init__(self, status: str) -> None:
        self.status = status

    def __get__(self, report: VerifyReport, owner: type | None = None) -> list[str]:
        return report.names(self.status)


@dataclass
class VerifyReport:
    a: str
    b: str
    results: list[TensorResult]
    notes: list[str] = field(default_factory=list)

    def names(self, status: str) -> list[str]:
        return [r.name for r in self.results if r.status == status]

    matching = _Names(MATCH)
    differing = _Names(DIFFER)
    missing = _Names(MISSING)  # only in A
    unexpected = _Names(UNEXPECTED)  # only in B

    @property
    def ok(self) -> bool:
        return all(r.status == MATCH for r in self.results)

    def summary(self) -> dict[str, int]:
        return {s: len(self.names(s)) for s in (MATCH, DIFFER, MISSING, UNEXPECTED)}

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "ok": self.ok,
            "summary": self.summary(),
            "notes": self.notes,
            "tensors": [r.to_json() for r in self.results],
        }


@dataclass
class _Side:
    path: str
    plan: Plan
    cache: SourceCache
    tensors: dict[str, TensorPlan] = field(default_factory=dict)

    def array(self, source: int, tensor: str) -> np.ndarray:
        return self.cache.get(self.plan.sources[source]).array(tensor)

    def release(self, t: TensorPlan) -> None:
        for c in t.copies:
            self.cache.release(self.plan.sources[c.source], c.tensor)


# ------------------------------------------------------------------------------------ sides


def _first_ckpt(path: str) -> str | None:
    if os.path.isfile(path):
        return path if path.endswith(".ckpt") else None
    found = rank_dirs.files_in(path, "ckpt")
    if not found and os.path.isdir(path):
        for folder in rank_dirs.rank_dirs(path).values():
            found = rank_dirs.files_in(folder, "ckpt")
            if found:
                break
    return found[0] if found else None


def _side_read(path: str, read: ReadOptions) -> ReadOptions:
    """The key is used only for a side whose checkpoints are encrypted (the other may be plain)."""
    kind = kind_of(path)
    if read.iteration is not None and (kind is None or not kind.traits.iterations):  # the other side's iteration
        read = replace(read, iteration=None)
    first = _first_ckpt(path)
    if read.dec_key is None or first is None:
        return replace(read, dec_key=None)
    return read if is_encrypted(first) else replace(read, dec_key=None)


_VALUES = "non-tensor values not carried"  # ops.chunked.values_note's words


def _side_kinds(path: str) -> tuple[Kind, ...]:
    """What a side may be: rank folders, or a full model (one rank's folder only as the file it holds)."""
    return (*ANY_CHECKPOINT, ONE_RANK_FOLDER) if full_model_file(path) is not None else ANY_CHECKPOINT


def side_plan(
    path: str,
    strategy: str | StrategyFile | None,
    read: ReadOptions,
    notes: list[str],
    dtype: str | None = None,
    names: NameFilter | None = None,
    dequantize: str | None = None,
    block_size: tuple[int, int] | None = None,
) -> Plan:
    """A plan whose tensors are the full tensors of one side (never executed), floats read as ``dtype``,
    only the names ``names`` keeps (filtered where every operation filters: once, before planning),
    block-scaled pairs read as ``dequantize`` (planned as a transform to one full file does)."""
    options = NameOptions(names) if names is not None else None
    # a strategy with a full model is refused below, in words about rank folders
    kind = resolve(path, _side_kinds(path), strategy=strategy, flag="strategy", full_takes_strategy=True)
    if is_sharded(kind) or dequantize is not None:
        report = api.transform(
            path,
            _VIRTUAL_OUT,
            strategy,
            None,
            read=read,
            output=api.OutputSpec(format="ckpt"),
            destination=api.Destination(dry_run=True),
            tensors=api.TensorOptions(
                dtype=dtype,
                dtype_all=dtype is not None,
                names=options,
                precision=Precision(dequantize, block_size) if dequantize is not None else None,
            ),
        )
        # a DCP side's non-tensor values are opaque bytes: not compared (the dry run words them for its output)
        notes.extend(f"{path}: {note.split(':')[0].replace('not carried', 'not compared')}" if _VALUES in note else
                     f"{path}: {note}" for note in report.notes)  # fmt: skip
        return report.plan
    if strategy is not None:
        if os.path.isfile(path) and kind not in (HUGGING_FACE, UNIFIED):
            raise UsageError("a strategy belongs to a folder of rank_<r> folders, not to one file", path)
        raise UsageError("a strategy was given but the folder has no rank_<r> folders", path)
    opened = kind.open(path, read, notes)
    assert isinstance(opened, OpenedModel)  # a sharded kind took the branch above
    parts = [*opened.files.values(), *([opened.hyper] if opened.hyper is not None else [])]
    cast = cast_rule(dtype, dtype_all=dtype is not None)
    cast_notes: list[str] = []
    kept = NameRun(options).narrow(dict(enumerate(parts)))
    parts = list(cast_files(kept, cast, cast_notes).values())
    notes.extend(f"{path}: {note}" for note in cast_notes)
    return plan_convert([(sf, _VIRTUAL_OUT, "ckpt") for sf in parts])


def _open_side(
    path: str,
    strategy: str | StrategyFile | None,
    read: ReadOptions,
    notes: list[str],
    dtype: str | None,
    names: NameFilter | None,
    dequantize: str | None = None,
    block_size: tuple[int, int] | None = None,
) -> _Side:
    read = _side_read(path, read)
    plan = side_plan(path, strategy, read, notes, dtype, names, dequantize, block_size)
    opened = replace(read, verify_crc=False)  # trailers were checked while planning
    side = _Side(path, plan, SourceCache(wrapped_opener(plan, lambda p: open_checkpoint(p, opened))))
    for f in plan.files:
        for t in f.tensors:
            side.tensors.setdefault(t.name, t)
    if read.verify_crc:
        checked = sum(1 for s in plan.sources if s.endswith(".ckpt") and has_crc_trailer(s))
        if checked:
            notes.append(f"{path}: crc trailers of {checked} file(s) checked")
    return side


# ------------------------------------------------------------------------------------ comparing


def _string(side: _Side, t: TensorPlan) -> str:
    if t.literal is not None:
        return decode_string(t.literal)
    c = t.copies[0]
    return str(side.cache.get(side.plan.sources[c.source]).value(c.tensor))


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype.itemsize != b.dtype.itemsize:
        return False
    raw_a, raw_b = np.ascontiguousarray(a).reshape(-1), np.ascontiguousarray(b).reshape(-1)
    word = next(w for w in (8, 4, 2, 1) if raw_a.nbytes % w == 0)  # widest compare the size allows
    view = np.dtype(f"u{word}")
    return bool(np.array_equal(raw_a.view(np.uint8).view(view), raw_b.view(np.uint8).view(view)))


def _max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    if a.size == 0:
        return 0.0
    wide = np.complex128 if "c" in (a.dtype.kind, b.dtype.kind) else np.float64
    with np.errstate(all="ignore"):
        diff = np.abs(a.astype(wide) - b.astype(wide))
    nan = np.isnan(diff)
    if nan.any():
        both_nan = np.isnan(a.astype(wide)) & np.isnan(b.astype(wide))
        if (nan & ~both_nan).any():
            return float("inf")
        diff = np.where(nan, 0.0, diff)
    return float(diff.max())


def _first_difference(a: np.ndarray, b: np.ndarray, atol: float) -> tuple[int, ...] | None:
    """The first element (row-major) where ``a`` and ``b`` differ: in their bytes when both have one
    dtype and no tolerance is given, else by more than ``atol`` in value (NaN against NaN is equal)."""
    if a.dtype == b.dtype and atol == 0:
        width = a.dtype.itemsize
        raw_a = np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape(-1, width)
        raw_b = np.ascontiguousarray(b).reshape(-1).view(np.uint8).reshape(-1, width)
        differs = (raw_a != raw_b).any(axis=1)
    else:
        wide = np.complex128 if "c" in (a.dtype.kind, b.dtype.kind) else np.float64
        wide_a, wide_b = a.astype(wide).reshape(-1), b.astype(wide).reshape(-1)
        with np.errstate(all="ignore"):
            differs = (np.abs(wide_a - wide_b) > atol) | (np.isnan(wide_a) != np.isnan(wide_b))
    found = np.flatnonzero(differs)
    return tuple(int(i) for i in np.unravel_index(int(found[0]), a.shape)) if found.size else None


def _block_rows(t: TensorPlan, max_memory: int) -> int:
    row_elems = int(np.prod(t.shape[1:], dtype=np.int64)) if t.shape else 1
    return max(1, max_memory // _BYTES_PER_COMPARED_ELEMENT // max(1, row_elems))


class _Meter:
    """Bytes of A compared, told to ``progress`` block by block; each tensor's count ends at its size
    (a tensor decided without reading it, a string or a shape mismatch, counts at once)."""

    def __init__(self, progress: Callable[[int], None] | None) -> None:
        self.progress = progress
        self.counted = 0  # of the current tensor

    def block(self, nbytes: int) -> None:
        if self.progress is not None and nbytes:
            self.progress(nbytes)
        self.counted += nbytes

    def tensor_done(self, nbytes: int) -> None:
        self.block(max(0, nbytes - self.counted))
        self.counted = 0


def _compare(
    name: str,
    a: _Side,
    ta: TensorPlan,
    b: _Side,
    tb: TensorPlan,
    atol: float,
    max_memory: int,
    meter: _Meter | None = None,
) -> TensorResult:
    dtype = ta.dtype.ms_name if ta.dtype is tb.dtype else f"{ta.dtype.ms_name} / {tb.dtype.ms_name}"
    if ta.dtype is dtypes.STR or tb.dtype is dtypes.STR:
        if ta.dtype is not tb.dtype:
            return TensorResult(name, DIFFER, dtype, ta.shape, None, "string vs tensor")
        same = _string(a, ta) == _string(b, tb)
        return TensorResult(name, MATCH if same else DIFFER, dtype, (), None, "" if same else "strings differ")
    if ta.shape != tb.shape:
        return TensorResult(name, DIFFER, dtype, ta.shape, None, f"shape {list(ta.shape)} vs {list(tb.shape)}")
    worst, exact = 0.0, ta.dtype is tb.dtype
    first: tuple[int, ...] | None = None
    rows = ta.shape[0] if ta.shape else 1
    step = _block_rows(ta, max_memory)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        block_a, block_b = assemble.tensor_rows(ta, r0, r1, a.array), assemble.tensor_rows(tb, r0, r1, b.array)
        if meter is not None:
            meter.block(block_a.nbytes)
        if exact and _same_bytes(block_a, block_b):
            continue
        exact = False
        worst = max(worst, _max_abs_diff(block_a, block_b))
        if first is None:
            found = _first_difference(block_a, block_b, atol)
            first = None if found is None else ((found[0] + r0, *found[1:]) if ta.shape else found)
    a.release(ta)
    b.release(tb)
    if exact:
        return TensorResult(name, MATCH, dtype, ta.shape, 0.0)
    detail = f"dtype {ta.dtype.ms_name} vs {tb.dtype.ms_name}" if ta.dtype is not tb.dtype else ""
    if not detail and atol > 0 and first is None:  # within the tolerance everywhere
        return TensorResult(name, MATCH, dtype, ta.shape, worst, f"within atol {atol:g}")
    where = "" if first is None else f", first at {list(first)}"
    return TensorResult(name, DIFFER, dtype, ta.shape, worst, (detail or "values differ") + where, first)


def _need_strategy(path: str, strategy: str | StrategyFile | None, side: str) -> None:
    """Several rank folders need their strategy; the hint names this command's flag for that side."""
    if strategy is None and os.path.isdir(path) and len(rank_dirs.rank_dirs(path)) > 1:
        raise UsageError(
            f"several rank folders but no strategy for them: give --{side}-strategy ({side}_strategy in Python)", path
        )


def verify(
    a: str,
    b: str,
    *,
    a_strategy: str | StrategyFile | None = None,
    b_strategy: str | StrategyFile | None = None,
    read: ReadOptions | None = None,
    atol: float = 0.0,
    max_memory: int = DEFAULT_MAX_MEMORY,
    dtype: str | None = None,
    names: NameFilter | None = None,
    dequantize: str | Precision | None = None,
    on_start: Callable[[int], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Compare the logical full tensors of ``a`` (reference) and ``b``, one tensor block at a time.

    ``read.dec_key``/``dec_mode`` decrypt whichever side holds encrypted ``.ckpt`` files. ``dtype``
    (``"bf16"``, ``"fp16"``, ``"fp32"``) reads the floating tensors of both sides as that dtype
    first (optimizer states too), so an output written with ``dtype`` matches its source exactly.

    Args:
        a: the reference checkpoint, in any form ``reshard`` reads.
        b: the other checkpoint.
        a_strategy: strategy of ``a``'s rank folders (None: a full model or a Checkpoint 2.0).
        b_strategy: strategy of ``b``'s rank folders.
        read: decryption key, which file of a rank folder, iteration, and whether to check the crc
            trailers of ``.ckpt`` sources that have one (``read.verify_crc``, the default).
        atol: values within this absolute difference count as equal.
        max_memory: bound on the tensor blocks compared at once.
        dtype: read both sides' floating tensors as this dtype before comparing (None: as stored).
        names: compare only the names this filter keeps, on both sides (``--include``/``--exclude``/
            ``--weights-only``: an export without optimizer states against its source); None: all.
        dequantize: read block-scaled pairs (FP8 blocks, MXFP4) of both sides as this dtype, as
            ``--dequantize`` writes them (a quantized checkpoint against its dequantized export).
            A ``Precision(dequantize=..., block_size=(rows, cols))`` also gives the FP8 block (else each
            side's ``config.json`` does; a DCP folder torch saved has none).
        on_start: called once, before the first comparison, with the bytes to compare (A's size of
            the names both sides hold), as ``RunOptions.on_start`` is for a transform.
        progress: called with the bytes of each block compared (they add up to ``on_start``'s).

    Returns:
        The verdict on every name of either side.

    Raises:
        UsageError: a side that cannot be read as given (no strategy for rank folders, a bad ``atol``),
            an unknown ``dtype``, or a value that overflows in it.
    """
    if atol < 0 or not np.isfinite(atol):
        raise UsageError(f"atol must be a finite number >= 0, got {atol}")
    read = read or ReadOptions()
    notes: list[str] = []
    check_iteration(a, [k for k in (kind_of(a), kind_of(b)) if k is not None] or [identify(a)], read)
    _need_strategy(a, a_strategy, "a")
    _need_strategy(b, b_strategy, "b")
    cast_rule(dtype)  # an unknown dtype is refused before anything is read
    block_size = dequantize.block_size if isinstance(dequantize, Precision) else None
    dequantize = dequantize.dequantize if isinstance(dequantize, Precision) else dequantize
    if block_size is not None and dequantize is None:
        raise UsageError("--block-size is the block of --dequantize: give --dequantize too")
    side_a = _open_side(a, a_strategy, read, notes, dtype, names, dequantize, block_size)
    side_b = _open_side(b, b_strategy, read, notes, dtype, names, dequantize, block_size)
    results: list[TensorResult] = []
    meter = _Meter(progress)
    if on_start is not None:
        on_start(sum(ta.nbytes for name, ta in side_a.tensors.items() if name in side_b.tensors))
    try:
        for name, ta in side_a.tensors.items():
            tb = side_b.tensors.get(name)
            if tb is None:
                results.append(TensorResult(name, MISSING, ta.dtype.ms_name, ta.shape, None, "only in A"))
            else:
                results.append(_compare(name, side_a, ta, side_b, tb, atol, max_memory, meter))
                meter.tensor_done(ta.nbytes)
        for name, tb in side_b.tensors.items():
            if name not in side_a.tensors:
                results.append(TensorResult(name, UNEXPECTED, tb.dtype.ms_name, tb.shape, None, "only in B"))
    finally:
        side_a.cache.close()
        side_b.cache.close()
    return VerifyReport(a, b, results, notes)


def print_report(report: VerifyReport, console: Any, all_rows: bool = False) -> None:
    """The names that do not match (every name with ``all_rows``), then one summary line.

    Names are never cut: on a terminal a long one wraps inside its cell; on a pipe or in a log each
    tensor is one whole line (``| grep wq`` finds it)."""
    from rich.markup import escape
    from rich.table import Table

    rows = [r for r in report.results if all_rows or r.status != MATCH]
    if rows and not console.is_terminal:  # a pipe or a log: one whole line per tensor, for grep
        for r in rows:
            diff = "" if r.max_abs_diff is None else f"max |a-b| {r.max_abs_diff:.6g}"
            fields = [r.status, r.name, r.dtype, str(list(r.shape)), diff, r.detail]
            console.print(escape("  ".join(f for f in fields if f)), soft_wrap=True)
    elif rows:
        table = Table(title=f"verify {report.a} vs {report.b}")
        longest = max(len(r.name) for r in rows)
        table.add_column("name", overflow="fold", min_width=min(longest, 40))
        for col in ("status", "dtype", "shape", "max |a-b|", "detail"):
            table.add_column(col, justify="right" if col == "max |a-b|" else "left", overflow="fold")
        style = {MATCH: "green", DIFFER: "red", MISSING: "yellow", UNEXPECTED: "yellow"}
        for r in rows:
            diff = "" if r.max_abs_diff is None else f"{r.max_abs_diff:.6g}"
            table.add_row(
                escape(r.name), f"[{style[r.status]}]{r.status}[/]", r.dtype, str(list(r.shape)), diff, escape(r.detail)
            )
        console.print(table)
    s = report.summary()
    verdict = "SAME" if report.ok else "DIFFERENT"
    console.print(
        f"{verdict}: {s[MATCH]} match, {s[DIFFER]} differ, {s[MISSING]} missing (only in A), "
        f"{s[UNEXPECTED]} unexpected (only in B)"
    )


__all__ = ["EXIT_DIFFER", "TensorResult", "VerifyReport", "print_report", "side_plan", "verify"]
