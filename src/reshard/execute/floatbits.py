"""Low-precision float conversions on the bits, in vectorised numpy, bit for bit what ``ml_dtypes`` gives.

``--dequantize`` and ``--quantize`` use these instead of ``ml_dtypes``' casts: they are faster, and a
run that needs no other cast then never imports ``ml_dtypes`` (about half a second of every start).

* ``bf16_bits``: float32 -> bfloat16, round to nearest even, NaN kept quiet with its sign.
* ``fp8_values``: every byte of F8_E4M3 (E4M3FN) or F8_E5M2 as its float32 value (exact).
* ``e4m3_bytes``: float32 -> F8_E4M3, below.
* ``torch_fp8_values``, ``fp4_values``, ``mxfp4_products``: the tables ``--dequantize`` looks values up
  in (FP8 bytes with torch's NaN bits, FP4 E2M1 nibbles, and every MXFP4 nibble times its E8M0 scale).

``--quantize fp8-block`` spends most of its time on this one cast: ``ml_dtypes`` converts one value
at a time (about 2.4 ns a value on this project's machine), while the rest of DeepSeek's rule (a
block's absolute maximum, a division, a clip) is a few whole-array numpy passes.

Why ``e4m3_bytes``' table is exact: rounding a float32 to F8_E4M3 (round to nearest, ties to even, overflow and
infinity to NaN, the sign kept) depends only on the float32's top 13 bits (sign, 8 exponent bits,
the 3 mantissa bits E4M3 keeps and the rounding bit below them) and on whether any of its 19 lower
bits is set (the "sticky" bit that tells a tie from a value just above it). E4M3's subnormals keep
fewer bits, all of them among the top 13, and float32 NaNs stay NaNs whatever their low bits. So the
cast is ``table[(bits >> 18) | sticky]``, a 16 Ki-entry table built once from one representative
float32 per index, rounded on the list of E4M3 values (no ``ml_dtypes``: its import alone is about
0.45 s of a quantizing run's start). Per value that is a mask, an add (which carries the sticky bit
into bit 18), an or, a shift and one lookup (``np.take`` with ``mode="wrap"``: no bounds-checking copy,
and a faster loop than ``"clip"``'s), about 0.8 ns a value, a third of ``ml_dtypes``' time;
``tests/test_floatbits.py`` checks it against ``ml_dtypes`` over every bfloat16 pattern, every
rounding boundary and a large random sample (the exhaustive 2^32 check is in docs/low-precision.md).

Arrays are cast in chunks of ``CHUNK`` values so the index temporary stays in the CPU's cache.
"""

from __future__ import annotations

import functools

import numpy as np

from reshard import dtypes

CHUNK = 1 << 16  # values a pass: 256 KiB of uint32 temporaries, within a core's L2 cache
_SHIFT = np.uint32(18)  # index = bits 31..18 with bit 0 replaced by the sticky bit of bits 18..0
_LOW = np.uint32((1 << 18) - 1)
_ONE = np.uint32(1)


@functools.cache
def _e4m3_table() -> np.ndarray:
    """F8_E4M3 byte of each index: the float32 the index stands for rounded to nearest, ties to even.

    Built on the 127 finite non-negative E4M3 values (bytes 0x00-0x7E, ascending) and 480, the value
    byte 0x7F would have: a magnitude goes to the nearer neighbour (exact in float64), a tie to the even
    byte, and whatever lands on 0x7F (above 464, infinity) or is NaN becomes the NaN 0x7F; the sign bit
    is or-ed in. ``tests/test_floatbits.py`` checks it against ``ml_dtypes``' own cast.
    """
    index = np.arange(1 << 14, dtype=np.uint32)
    representative = ((index >> _ONE) << np.uint32(19)) | (index & _ONE)  # sticky: the lowest bit set
    with np.errstate(invalid="ignore"):  # signalling NaN patterns among them
        magnitude = (representative & np.uint32(0x7FFFFFFF)).view(np.float32).astype(np.float64)
    grid = np.append(fp8_values("F8_E4M3")[:0x7F].astype(np.float64), 480.0)
    low = np.clip(np.searchsorted(grid, magnitude, side="right") - 1, 0, 0x7E)
    below, above = magnitude - grid[low], grid[low + 1] - magnitude
    up = (above < below) | ((above == below) & (low % 2 == 1))
    byte = (low + up).astype(np.uint8)
    byte[~np.isfinite(magnitude) | (byte == 0x7F)] = 0x7F
    return byte | np.where(representative >> np.uint32(31), np.uint8(0x80), np.uint8(0)).astype(np.uint8)


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """The bfloat16 bits (uint16, ``values``' shape) of float32 ``values``: round to nearest, ties to even
    (overflow to infinity), a NaN as the quiet NaN ``0x7FC0`` with its sign."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & _ONE))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        out[nan] = ((bits[nan] >> np.uint32(16)) & np.uint32(0x8000) | np.uint32(0x7FC0)).astype(np.uint16)
    return out


def fp8_values(code: str) -> np.ndarray:
    """float32 value of each of the 256 bytes of ``code`` (``F8_E4M3`` or ``F8_E5M2``; exact; a NaN is the
    quiet NaN ``0x7FC00000`` with its sign)."""
    byte = np.arange(256, dtype=np.int32)
    exponent_bits, bias = (4, 7) if code == "F8_E4M3" else (5, 15)
    mantissa_bits = 7 - exponent_bits
    exponent = (byte >> mantissa_bits) & ((1 << exponent_bits) - 1)
    mantissa = (byte & ((1 << mantissa_bits) - 1)).astype(np.float32)
    normal = np.ldexp(1 + mantissa / (1 << mantissa_bits), exponent - bias)
    subnormal = np.ldexp(mantissa / (1 << mantissa_bits), 1 - bias)
    value = np.where(exponent == 0, subnormal, normal).astype(np.float32)
    if code == "F8_E4M3":  # E4M3FN: no infinities, only S.1111.111 is NaN
        value[(byte & 0x7F) == 0x7F] = np.nan
    else:  # E5M2: IEEE-like, exponent 31 is infinity (mantissa 0) or NaN
        top = exponent == (1 << exponent_bits) - 1
        value[top] = np.where(mantissa[top] == 0, np.inf, np.nan)
    value[byte >= 0x80] *= -1
    bits = value.view(np.uint32)
    nan = np.isnan(value)
    bits[nan] = np.where(byte[nan] >= 0x80, np.uint32(0xFFC00000), np.uint32(0x7FC00000))
    return value


def e4m3_bytes(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The F8_E4M3 bytes (uint8, ``values``' shape) of float32 ``values``, rounded as ``ml_dtypes`` rounds.

    ``out``: a C-contiguous uint8 array of that shape to write into (None: a new one).
    """
    flat_in = np.ascontiguousarray(values, dtype=np.float32).reshape(-1).view(np.uint32)
    result = out if out is not None else np.empty(values.shape, dtype=np.uint8)
    flat_out = result.reshape(-1)
    table = _e4m3_table()
    index = np.empty(min(CHUNK, flat_in.size), dtype=np.uint32)
    for start in range(0, flat_in.size, CHUNK):
        bits = flat_in[start : start + CHUNK]
        i = index[: bits.size]
        # (low 18 bits) + (2 ** 18 - 1) carries into bit 18 exactly when one of them is set, and stays below
        # bit 19: or-ed into the bits, then shifted, that is the index with its sticky bit.
        np.bitwise_and(bits, _LOW, out=i)
        np.add(i, _LOW, out=i)
        np.bitwise_or(i, bits, out=i)
        np.right_shift(i, _SHIFT, out=i)
        np.take(table, i, out=flat_out[start : start + bits.size], mode="wrap")  # every index is in range
    return result


E8M0_NAN = 255  # the one E8M0 scale byte that is no power of two
# The float32 bits torch gives F8_E4M3's two NaN bytes (numpy's would be 0x7FC00000): a NaN weight
# then stays the NaN torch's reference computes through the multiplication.
_E4M3_NAN_BITS = {0x7F: 0x7FF00000, 0xFF: 0xFFF00000}


@functools.cache
def torch_fp8_values(code: str) -> np.ndarray:
    """float32 value of every byte of an F8 dtype (exact: every float8 value is a float32), NaNs as torch's."""
    table = fp8_values(code)
    if code == "F8_E4M3":
        bits = table.view(np.uint32)
        for byte, nan in _E4M3_NAN_BITS.items():
            bits[byte] = nan
    return table


@functools.cache
def fp4_values() -> np.ndarray:
    """float32 value of every FP4 E2M1 nibble."""
    return np.array(dtypes.FP4_E2M1_VALUES, dtype=np.float32)


@functools.cache
def mxfp4_products() -> np.ndarray:
    """float32 ``FP4[nibble] * 2 ** (byte - 127)`` for every scale byte and nibble, flat (byte * 16 + nibble)."""
    exps = np.arange(256, dtype=np.int32) - dtypes.E8M0_BIAS
    with np.errstate(over="ignore", invalid="ignore"):
        powers = np.ldexp(np.float32(1.0), exps).astype(np.float32)
        out = (powers[:, None] * fp4_values()[None, :]).astype(np.float32)
    out[E8M0_NAN] = np.nan
    return out.reshape(-1)


__all__ = [
    "CHUNK",
    "E8M0_NAN",
    "bf16_bits",
    "e4m3_bytes",
    "fp4_values",
    "fp8_values",
    "mxfp4_products",
    "torch_fp8_values",
]
