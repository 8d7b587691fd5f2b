"""Casting dtypes while streaming (``--dtype``): which entries a cast converts, decided on the planning facts.

A cast is applied to the *planning inputs*: a tensor to convert is planned as if its source file
already held the target dtype (``cast_files`` rewrites the ``SourceFile`` facts). Every planner
then produces outputs that agree with the cast without knowing about it: output headers, byte
counts, Hugging Face shard sizes and ``total_size``, a Checkpoint 2.0's ``metadata.json``. The
executors notice that a source file's real dtype differs from the plan's and convert while copying
(``reshard.execute.assemble.copy_boxes``, element by element as numpy's ``astype``; a finite value
that would become infinite is an error there). Doing it on the facts rather than as a pass over
finished plans keeps one cast rule for every operation, including those that size their outputs
while planning.

What is cast (``Cast.dtype_of``): floating tensors (``dtypes.CASTABLE``: Float16, Float32, Float64,
BFloat16) of at least one dimension. Never: integers, bools, strings, complex values, float8
(quantized weights need their scales), an FP8 weight's block scale (``X_scale_inv`` beside an FP8
``X``: a BF16 scale would round every value of its block; ``--quantize --dtype bf16`` keeps its F32
scales so), and 0-d scalars. Training state (``reshard.statenames``:
optimizer moments, ``global_step``, ...) is cast only with ``training_state=True`` (``--dtype-all``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from reshard import dtypes, statenames
from reshard.dtypes import DType
from reshard.errors import UsageError
from reshard.plan.model import SCALE_INV, SourceFile, SourceTensor
from reshard.statenames import StateNames

K = TypeVar("K")


@dataclass(frozen=True)
class Cast:
    """Convert floating tensors to ``target``; training state too when ``training_state``.

    Example:
        from reshard import dtypes
        from reshard.plan.cast import Cast
        cast = Cast(dtypes.BFLOAT16)
        assert cast.dtype_of("embedding.weight", dtypes.FLOAT32, (4, 8)) is dtypes.BFLOAT16
        assert cast.dtype_of("adam_m.embedding.weight", dtypes.FLOAT32, (4, 8)) is dtypes.FLOAT32
    """

    target: DType
    training_state: bool = False  # --dtype-all: optimizer moments and the like as well
    state: StateNames = statenames.DEFAULT

    def dtype_of(self, name: str, dtype: DType, shape: tuple[int, ...]) -> DType:
        """The dtype entry ``name`` (of ``dtype`` and ``shape``) is written in."""
        if dtype not in dtypes.CASTABLE or not shape:
            return dtype
        if not self.training_state and self.state.is_state(name):
            return dtype
        return self.target


def cast_rule(dtype: str | None, dtype_all: bool = False, optimizer_prefixes: Sequence[str] = ()) -> Cast | None:
    """The cast ``--dtype`` / ``--dtype-all`` ask for (None: no cast).

    Raises:
        UsageError: An unknown dtype name, or ``dtype_all`` without a dtype.
    """
    if dtype is None:
        if dtype_all:
            raise UsageError("--dtype-all needs --dtype (dtype_all needs dtype in Python)")
        return None
    return Cast(dtypes.cast_target(dtype), dtype_all, statenames.DEFAULT.with_prefixes(optimizer_prefixes))


class _Caster:
    """Casts tensor tables, deciding once per name (a job's ranks share names) and counting for the note."""

    def __init__(self, cast: Cast) -> None:
        self.cast = cast
        self.castable = {id(d) for d in dtypes.CASTABLE if d is not cast.target}
        self.kept: dict[str, bool] = {}  # name -> left as it is (training state without --dtype-all)
        self.made: dict[tuple[int, ...], SourceTensor] = {}  # shape -> the cast tensor's facts (shared)
        self.converted: set[str] = set()
        self.float8: set[str] = set()

    def table(self, tensors: dict[str, SourceTensor]) -> dict[str, SourceTensor]:
        out = {}
        for name, t in tensors.items():
            out[name] = t
            if id(t.dtype) not in self.castable or not t.shape or _fp8_scale(name, tensors):
                if t.dtype in dtypes.FP8_WEIGHTS:
                    self.float8.add(name)
                continue
            kept = self.kept.get(name)
            if kept is None:
                kept = self.kept[name] = self.cast.dtype_of(name, t.dtype, t.shape) is t.dtype
            if not kept:
                self.converted.add(name)
                out[name] = self.made.get(t.shape) or self.made.setdefault(
                    t.shape, SourceTensor(self.cast.target, t.shape, math.prod(t.shape) * self.cast.target.itemsize)
                )
        return out

    def note(self) -> str:
        """``--dtype: 12 tensor(s) cast to BFloat16; kept 24 training-state tensor(s) as they are (...)``."""
        parts = [f"--dtype: {len(self.converted)} tensor(s) cast to {self.cast.target.ms_name}"]
        state = sum(1 for name, kept in self.kept.items() if kept and name not in self.converted)
        if state:
            parts.append(f"kept {state} training-state tensor(s) as they are (--dtype-all casts them too)")
        if self.float8:
            parts.append(f"kept {len(self.float8)} float8 weight(s) and their block scales as they are (not cast)")
        return "; ".join(parts)


def _fp8_scale(name: str, tensors: Mapping[str, SourceTensor]) -> bool:
    """Whether ``name`` is an FP8 weight's block scale (``X_scale_inv`` beside an FP8 ``X``): part of a pair,
    which a cast leaves whole (a BF16 scale rounds every dequantized value of its block)."""
    if not name.endswith(SCALE_INV):
        return False
    weight = tensors.get(name[: -len(SCALE_INV)])
    return weight is not None and weight.dtype in dtypes.FP8_WEIGHTS


def cast_files(files: Mapping[K, SourceFile], cast: Cast | None, notes: list[str] | None = None) -> dict[K, SourceFile]:
    """``files`` as planning should see them under ``cast`` (unchanged without one).

    Tensor tables shared by several files (a Checkpoint 2.0's virtual ranks) stay shared. A note
    says how many tensors are converted and which kinds are kept as they are.
    """
    if cast is None:
        return dict(files)
    caster = _Caster(cast)
    done: dict[int, dict[str, SourceTensor]] = {}
    out: dict[K, SourceFile] = {}
    for key, f in files.items():
        if id(f.tensors) not in done:
            done[id(f.tensors)] = caster.table(f.tensors)
        out[key] = replace(f, tensors=done[id(f.tensors)])
    if notes is not None:
        notes.append(caster.note())
    return out


__all__ = ["Cast", "cast_files", "cast_rule"]
