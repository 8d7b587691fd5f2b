"""``Parameter``: a named numpy array, the stand-in for ``mindspore.Parameter`` where MindSpore's API needs one.

Most of the drop-in passes tensors as ``{name: numpy array}``. ``merge_sliced_parameter`` is the one
function whose MindSpore signature takes and returns ``Parameter`` objects (the slices' name is how
it finds their layout), so reshard needs a named tensor with the attributes scripts read from a
MindSpore ``Parameter``: ``name``, ``data``, ``asnumpy()``, ``shape``, ``dtype``, ``requires_grad``,
``layerwise_parallel``, and MindSpore's ``repr``. Nothing here computes on the data: ``data`` is the
numpy array itself (bf16 through ``ml_dtypes``), and ``asnumpy()`` returns it without a copy.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from reshard import dtypes
from reshard.errors import FormatError, UsageError

# MindSpore names an unnamed Parameter "Parameter#<n>" with a process-wide counter.
_UNNAMED = itertools.count(1)


def _array(value: Any) -> np.ndarray:
    """A numpy array from a numpy array / scalar, or from an object with ``asnumpy()`` (a MindSpore Tensor)."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, np.generic):
        return np.asarray(value)
    asnumpy = getattr(value, "asnumpy", None)
    if callable(asnumpy):
        result = asnumpy()
        if isinstance(result, np.ndarray):
            return result
    raise UsageError(f"default_input must be a numpy array (or have asnumpy()), got {type(value).__name__}")


class Parameter:
    """``mindspore.Parameter`` for numpy data: ``Parameter(array, "name")``.

    Args:
        default_input: The value: a numpy array (bf16 via ``ml_dtypes``), a numpy scalar, or an
            object with ``asnumpy()`` such as a MindSpore ``Tensor``; kept without a copy.
        name: The parameter name (None: ``"Parameter#<n>"``, numbered as MindSpore does).
        requires_grad: Kept as an attribute (default True).
        layerwise_parallel: Kept as an attribute (default False).

    Returns:
        A ``Parameter`` whose ``data`` and ``asnumpy()`` are the numpy array.

    Raises:
        UsageError: A value that is not a numpy array, a name that is not a str, or flags that are
            not bools.

    Example:
        import numpy as np
        from reshard.mindspore import Parameter
        weight = Parameter(np.ones((2, 3), np.float32), "network.weight")
        rows = weight.asnumpy().shape[0]
    """

    __slots__ = ("_data", "layerwise_parallel", "name", "requires_grad")

    def __init__(
        self,
        default_input: Any,
        name: str | None = None,
        requires_grad: bool = True,
        layerwise_parallel: bool = False,
    ) -> None:
        if name is None:
            name = f"Parameter#{next(_UNNAMED)}"
        if not isinstance(name, str):
            raise UsageError(f"Parameter name must be a str, got {type(name).__name__}")
        for what, flag in (("requires_grad", requires_grad), ("layerwise_parallel", layerwise_parallel)):
            if not isinstance(flag, bool):
                raise UsageError(f"{what} must be True or False, got {flag!r}")
        self._data = _array(default_input)
        self.name = name
        self.requires_grad = requires_grad
        self.layerwise_parallel = layerwise_parallel

    @property
    def data(self) -> np.ndarray:
        """The value as a numpy array (MindSpore: the Parameter as a Tensor)."""
        return self._data

    def asnumpy(self) -> np.ndarray:
        """The value as a numpy array (the same object as ``data``, not a copy)."""
        return self._data

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of ``data``."""
        return tuple(self._data.shape)

    @property
    def dtype(self) -> np.dtype:
        """The numpy dtype of ``data`` (MindSpore: a ``mindspore.dtype``)."""
        return self._data.dtype

    def __repr__(self) -> str:
        try:
            kind = dtypes.from_numpy(self._data.dtype).ms_name
        except FormatError:
            kind = str(self._data.dtype)
        return f"Parameter (name={self.name}, shape={self.shape}, dtype={kind}, requires_grad={self.requires_grad})"

    __str__ = __repr__


__all__ = ["Parameter"]
