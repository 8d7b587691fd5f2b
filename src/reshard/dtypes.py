"""The one dtype table: MindSpore tensor_type names <-> safetensors codes <-> numpy dtypes.

MindSpore writes ``str(mindspore_dtype)`` into ``.ckpt`` files ("Float32", "BFloat16", ...);
safetensors uses short codes ("F32", "BF16", ...). bf16 and fp8 have no numpy builtin, so their
numeric type comes from ``ml_dtypes``. ``Int4`` (MindSpore qint4x2: two 4-bit values per byte) is
carried as raw bytes (int8); safetensors files mark it with a ``"<name>": "Int4"`` metadata entry, as
MindSpore does.

Why the table names numpy types instead of holding them: moving bytes never needs a numeric type.
A bf16 or fp8 tensor copied, sliced or checksummed is items of a known size, so each row states its
``itemsize`` and the executors move items through ``DType.carrier`` (the same dtype for numpy's
builtins, an unsigned integer of the same size for the ``ml_dtypes`` ones). ``DType.numpy``, the
numeric type, is resolved on first use: only casts, ``verify``'s numeric comparisons and arrays
handed to a user import ``ml_dtypes`` (whose 0.7.0 release takes about a second to import, which
every reshard process used to pay at start; importing this module needs neither it nor numpy).
A new row is one line: ``_d`` for a numpy builtin, ``_ext`` for an ``ml_dtypes`` type, with the
numpy name and the item size (``tests/test_startup.py`` checks both against the real types).

Float8 and complex names are read and written like the rest, though MindSpore 2.10's
``load_checkpoint`` refuses them (docs/formats.md §1.3).

Some safetensors dtypes have no MindSpore 2.10 ``tensor_type`` name: ``F8_E8M0`` (the block scales
of FP8 / MXFP4 checkpoints) and the ``FNUZ`` float8 variants. They are read, written to safetensors
and resharded byte for byte like the rest (``ml_dtypes`` gives them a numpy type), are shown under
their safetensors code, and cannot go into a ``.ckpt`` (``in_ckpt`` is False: the ``.ckpt`` writer
refuses them with one line naming the tensor). The sub-byte codes ``F4``, ``F6_E2M3`` and
``F6_E3M2`` pack several values per byte, which no numpy view can slice: reading them is refused
(docs/formats.md §11.4).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from reshard.errors import FormatError, UsageError

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class DType:
    ms_name: str  # tensor_type in .ckpt files
    st_code: str | None  # safetensors dtype code (None: not representable)
    numpy_name: str  # numpy's name of the element type ("float32", "bfloat16"; "<U1" for STR)
    itemsize: int  # bytes per element, known without importing numpy or ml_dtypes
    in_ckpt: bool = True  # MindSpore 2.10 has a tensor_type name for it (ms_name), so .ckpt can hold it
    from_ml_dtypes: bool = False  # the numeric type is ml_dtypes' (bf16, fp8), not a numpy builtin

    @functools.cached_property
    def numpy(self) -> np.dtype:
        """The numeric element type of numpy views (imports ``ml_dtypes`` for bf16/fp8, on first use)."""
        import numpy as np

        if self.from_ml_dtypes:
            import ml_dtypes

            return np.dtype(getattr(ml_dtypes, self.numpy_name))
        return np.dtype(self.numpy_name)

    @functools.cached_property
    def carrier(self) -> np.dtype:
        """A numpy builtin of ``itemsize`` bytes holding the elements' bits: what byte moves copy."""
        import numpy as np

        return np.dtype(f"u{self.itemsize}") if self.from_ml_dtypes else self.numpy

    def __str__(self) -> str:
        return self.ms_name


def _d(ms: str, st: str | None, numpy_name: str, itemsize: int) -> DType:
    """A dtype numpy has as a builtin."""
    return DType(ms, st, numpy_name, itemsize)


def _ext(ms: str, st: str, numpy_name: str, itemsize: int, in_ckpt: bool = True) -> DType:
    """A dtype whose numeric type is ``ml_dtypes.<numpy_name>``."""
    return DType(ms, st, numpy_name, itemsize, in_ckpt=in_ckpt, from_ml_dtypes=True)


def _st_only(st: str, numpy_name: str, itemsize: int) -> DType:
    """A safetensors dtype MindSpore 2.10 has no name for (an ``ml_dtypes`` type): shown under its code."""
    return _ext(st, st, numpy_name, itemsize, in_ckpt=False)


BOOL = _d("Bool", "BOOL", "bool", 1)
INT8 = _d("Int8", "I8", "int8", 1)
UINT8 = _d("UInt8", "U8", "uint8", 1)
INT16 = _d("Int16", "I16", "int16", 2)
UINT16 = _d("UInt16", "U16", "uint16", 2)
INT32 = _d("Int32", "I32", "int32", 4)
UINT32 = _d("UInt32", "U32", "uint32", 4)
INT64 = _d("Int64", "I64", "int64", 8)
UINT64 = _d("UInt64", "U64", "uint64", 8)
FLOAT16 = _d("Float16", "F16", "float16", 2)
FLOAT32 = _d("Float32", "F32", "float32", 4)
FLOAT64 = _d("Float64", "F64", "float64", 8)
BFLOAT16 = _ext("BFloat16", "BF16", "bfloat16", 2)
INT4 = _d("Int4", "I8", "int8", 1)  # qint4x2 bytes; see module docstring
FLOAT8_E4M3 = _ext("Float8E4M3FN", "F8_E4M3", "float8_e4m3fn", 1)
FLOAT8_E5M2 = _ext("Float8E5M2", "F8_E5M2", "float8_e5m2", 1)
FLOAT8_E8M0 = _st_only("F8_E8M0", "float8_e8m0fnu", 1)
FLOAT8_E4M3FNUZ = _st_only("F8_E4M3FNUZ", "float8_e4m3fnuz", 1)
FLOAT8_E5M2FNUZ = _st_only("F8_E5M2FNUZ", "float8_e5m2fnuz", 1)
COMPLEX64 = _d("Complex64", "C64", "complex64", 8)
COMPLEX128 = _d("Complex128", None, "complex128", 16)
# A python string: .ckpt stores it with dims [0] and UTF-32-LE code points; never a numpy view.
STR = _d("str", None, "<U1", 4)

ALL: tuple[DType, ...] = (
    BOOL,
    INT8,
    UINT8,
    INT16,
    UINT16,
    INT32,
    UINT32,
    INT64,
    UINT64,
    FLOAT16,
    FLOAT32,
    FLOAT64,
    BFLOAT16,
    INT4,
    FLOAT8_E4M3,
    FLOAT8_E5M2,
    FLOAT8_E8M0,
    FLOAT8_E4M3FNUZ,
    FLOAT8_E5M2FNUZ,
    COMPLEX64,
    COMPLEX128,
    STR,
)

_BY_MS = {d.ms_name: d for d in ALL if d.in_ckpt}
# INT4 shares I8 with INT8: the code maps back to INT8 (Int4 is restored from metadata).
_BY_ST = {d.st_code: d for d in reversed(ALL) if d.st_code is not None}
_BY_ST["I8"] = INT8
# Keyed by numpy's name of the type, so a lookup needs no ml_dtypes ("bfloat16" names ml_dtypes.bfloat16).
_BY_NUMPY_NAME = {d.numpy_name: d for d in reversed(ALL) if d not in (INT4, STR)}


def from_ms_name(name: str, path: str | None = None) -> DType:
    """The dtype of a ``.ckpt`` ``tensor_type`` string."""
    try:
        return _BY_MS[name]
    except KeyError:
        raise FormatError(f"unknown MindSpore tensor type {name!r}", path) from None


def from_st_code(code: str, path: str | None = None) -> DType:
    """The dtype of a safetensors ``dtype`` code."""
    try:
        return _BY_ST[code]
    except KeyError:
        raise FormatError(f"unknown safetensors dtype {code!r}", path) from None


def from_numpy(dtype: np.dtype | type, path: str | None = None) -> DType:
    """The dtype of a numpy array (bf16/fp8 via ml_dtypes); either byte order."""
    import numpy as np

    key = np.dtype(dtype)
    if key.kind == "U":
        return STR
    try:
        return _BY_NUMPY_NAME[key.name]
    except KeyError:
        raise FormatError(f"numpy dtype {key} has no MindSpore equivalent", path) from None


# PyTorch names its dtypes as numpy does (``torch.float32``, ``torch.bfloat16``, ``torch.float8_e4m3fn``):
# the numpy name is the torch name, for every row torch has. Pickles of PyTorch checkpoints (DCP's
# ``.metadata``, ``torch.save`` archives) spell a dtype as the global ``torch.<name>``.
_BY_TORCH_NAME = {d.numpy_name: d for d in ALL if d not in (INT4, STR)}


def from_torch_name(name: str, path: str | None = None) -> DType:
    """The dtype of a PyTorch dtype name (``"float32"`` for ``torch.float32``)."""
    try:
        return _BY_TORCH_NAME[name]
    except KeyError:
        raise FormatError(f"torch dtype {name!r} is not one reshard carries", path) from None


def torch_name(dtype: DType) -> str:
    """The PyTorch name of a dtype (``torch.<name>``); Int4 and strings have none."""
    if dtype not in _BY_TORCH_NAME.values():
        raise UsageError(f"{dtype} has no PyTorch dtype")
    return dtype.numpy_name


# --------------------------------------------------------------------------------------------
# casting (``--dtype``): which dtypes a cast may produce, and which it may touch

# The dtypes ``--dtype`` writes, under every name reshard knows them by (short, numpy, MindSpore,
# safetensors). fp8 is not offered: a float8 weight needs its scales (a plain cast loses the model),
# and MindSpore 2.10's ``load_checkpoint`` refuses float8 entries (docs/formats.md §1.3).
CAST_TARGETS: dict[str, DType] = {
    alias: d
    for d, aliases in (
        (BFLOAT16, ("bf16", "bfloat16")),
        (FLOAT16, ("fp16", "float16")),
        (FLOAT32, ("fp32", "float32")),
    )
    for alias in (*aliases, d.ms_name.lower(), str(d.st_code).lower())
}

# The dtypes a cast converts: IEEE-style floats with infinities. Integers, bools, strings, complex
# values and float8 (quantized weights whose scales a cast would not apply; E8M0 block scales) are
# never touched.
CASTABLE: frozenset[DType] = frozenset({FLOAT16, FLOAT32, FLOAT64, BFLOAT16})


def cast_target(name: str) -> DType:
    """The dtype a ``--dtype`` name stands for (``bf16``, ``bfloat16``, ``BFloat16``, ``BF16``, ...).

    Args:
        name: A dtype name, any case: bf16/bfloat16, fp16/float16, fp32/float32 (also the
            MindSpore and safetensors spellings).

    Returns:
        The ``DType``.

    Raises:
        UsageError: Not a dtype reshard casts to (the message lists the choices).

    Example:
        from reshard import dtypes
        assert dtypes.cast_target("bf16") is dtypes.BFLOAT16
        assert dtypes.cast_target("Float16") is dtypes.FLOAT16
    """
    found = CAST_TARGETS.get(name.strip().lower())
    if found is None:
        raise UsageError(f"unknown --dtype {name!r} (choose bf16, fp16 or fp32)")
    return found


# --------------------------------------------------------------------------------------------
# block-scaled low precision (``--dequantize``, ``--quantize``: reshard.plan.quantized)


@dataclass(frozen=True)
class LowPrecision:
    """How one low-precision format is stored: the dtype of its bytes, values per item, ``.ckpt`` or not.

    ``storage.itemsize`` bytes hold ``values_per_item`` values: an MXFP4 ``*_blocks`` byte holds two
    FP4 E2M1 values, every float8 byte one. ``in_ckpt`` is the storage dtype's: a ``.ckpt`` output can
    hold F8_E4M3 / F8_E5M2 weights and MXFP4's U8 bytes, never F8_E8M0 scales (refused naming the tensor).
    """

    name: str
    storage: DType
    values_per_item: int
    role: str  # "weight" (values) or "scale" (one per block)

    @property
    def in_ckpt(self) -> bool:
        return self.storage.in_ckpt


LOW_PRECISION: dict[str, LowPrecision] = {
    lp.name: lp
    for lp in (
        LowPrecision("F8_E4M3", FLOAT8_E4M3, 1, "weight"),
        LowPrecision("F8_E5M2", FLOAT8_E5M2, 1, "weight"),
        LowPrecision("F8_E8M0", FLOAT8_E8M0, 1, "scale"),
        LowPrecision("MXFP4", UINT8, 2, "weight"),  # packed: low nibble first
    )
}

FP8_WEIGHTS: frozenset[DType] = frozenset({FLOAT8_E4M3, FLOAT8_E5M2})  # what X.weight of a FP8 pair holds
FP8_SCALES: frozenset[DType] = frozenset({FLOAT32, BFLOAT16, FLOAT8_E8M0})  # what X.weight_scale_inv holds
FP8_E4M3_LARGEST = 448.0  # largest finite F8_E4M3 (e4m3fn has no infinities): DeepSeek's quantizing divisor
MXFP4_BLOCK = 32  # FP4 values sharing one scale: 16 bytes of a *_blocks tensor's last axis
E8M0_BIAS = 127  # an E8M0 byte b stands for 2 ** (b - 127); 255 is NaN
# FP4 E2M1 (sign, 2 exponent bits, 1 mantissa bit): the value of each nibble 0..15.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def largest_finite(dtype: DType) -> float:
    """The largest finite value of a floating dtype (65504 for Float16)."""
    import ml_dtypes

    return float(ml_dtypes.finfo(dtype.numpy).max)


__all__ = [
    "ALL",
    "BFLOAT16",
    "BOOL",
    "CASTABLE",
    "CAST_TARGETS",
    "COMPLEX64",
    "COMPLEX128",
    "E8M0_BIAS",
    "FLOAT8_E4M3",
    "FLOAT8_E4M3FNUZ",
    "FLOAT8_E5M2",
    "FLOAT8_E5M2FNUZ",
    "FLOAT8_E8M0",
    "FLOAT16",
    "FLOAT32",
    "FLOAT64",
    "FP4_E2M1_VALUES",
    "FP8_E4M3_LARGEST",
    "FP8_SCALES",
    "FP8_WEIGHTS",
    "INT4",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "LOW_PRECISION",
    "MXFP4_BLOCK",
    "STR",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "DType",
    "LowPrecision",
    "cast_target",
    "from_ms_name",
    "from_numpy",
    "from_st_code",
    "from_torch_name",
    "largest_finite",
    "torch_name",
]
