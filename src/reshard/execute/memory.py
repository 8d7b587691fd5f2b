"""The in-memory executor: one planned file's tensors as numpy arrays, nothing written.

``mindspore.load_distributed_checkpoint(..., return_param_dict=True)`` hands a rank's tensors to
the caller instead of writing them. The plan is the one a written run would follow; this executor
assembles each tensor from its copies (``assemble.full_tensor``) into an owned array, opening each
source once and closing it after, so the result outlives every memory map.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from reshard import dtypes
from reshard.execute import assemble
from reshard.formats.base import TensorIndex, decode_string
from reshard.plan import FilePlan, Plan
from reshard.sources import open_checkpoint

Value = np.ndarray | str


def materialize(plan: Plan, file: FilePlan, opener: Callable[[str], TensorIndex] = open_checkpoint) -> dict[str, Value]:
    """The tensors of ``file`` (one of ``plan``'s) as ``{name: owned numpy array | str}``, in the plan's order.

    Raises:
        FormatError: A source that is truncated, corrupted or not what it claims.
    """
    opened: dict[int, TensorIndex] = {}

    def index(source: int) -> TensorIndex:
        if source not in opened:
            opened[source] = opener(plan.sources[source])
        return opened[source]

    def source_array(source: int, tensor: str) -> np.ndarray:
        return index(source).array(tensor)

    try:
        result: dict[str, Value] = {}
        for t in file.tensors:
            if t.literal is not None and t.dtype is dtypes.STR:
                result[t.name] = decode_string(t.literal)
            elif t.dtype is dtypes.STR:
                c = t.copies[0]
                result[t.name] = str(index(c.source).value(c.tensor))
            else:
                result[t.name] = assemble.full_tensor(t, source_array)
        return result
    finally:
        for opened_index in opened.values():
            opened_index.close()


__all__ = ["Value", "materialize"]
