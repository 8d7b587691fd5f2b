"""DeepSeek's FP8 block rule on a bf16 weight by table: one subtraction and one lookup a value.

``--quantize fp8-block`` writes, per ``b0 x b1`` block, ``scale = amax(|w|) / 448`` (float32) and each
value ``w / scale`` (float32 division) rounded to F8_E4M3. Done literally (``rule_bytes``) that is a
bf16 -> float32 widening, a division and the cast: about 1.5 ns a value, most of a quantizing run's
CPU time. On a bf16 weight (``quantize_bf16``) the same bytes come from one table, because the byte of
``w`` depends on three things only (``A`` is the bf16 bits of the block's ``amax``, 15 bits without sign):

* ``w``'s sign, and ``d = A - |w|`` as bits (both non-negative bf16, so ``0 <= d <= A``);
* ``A``'s 7 mantissa bits ``mu``, not its exponent: scaling ``w`` and ``amax`` by one power of two scales
  the (correctly rounded) scale by it too, so ``w / scale`` and its rounding do not change. That holds
  while ``amax``, the scale and every ``w`` that matters are normal numbers: for ``A >= FAST_LOWEST``
  (exponent field 20, ``amax >= 2 ** -107``); blocks of smaller maxima (all-zero ones) take ``rule_bytes``;
* and only ``d < SPAN`` (19 binades) matters: below, ``|w| <= amax * 2 ** -19`` and
  ``|w| / scale <= 448 * 2 ** -19 * (1 + 2 ** -23) < 2 ** -10``, half E4M3's smallest subnormal, which
  rounds to zero (keeping ``w``'s sign, as torch's ``-0.0``).

So the table holds, for each ``mu``, both signs and ``d < SPAN``, the byte ``rule_bytes`` gives with
``amax`` in [1, 2) (built once, 2 x 128 x 2432 values through the rule itself), and the index of a value
is ``(mu + 1) * 2 ** 16 + A - bits(w)``: one int32 subtraction from a per-block constant. A negative
``w`` (sign bit ``0x8000``) borrows into the slot below, so slot ``s`` holds the positive bytes of
``mu = s - 1`` in its lower half and the negative bytes of ``mu = s`` in its upper half; entries past
``SPAN`` are the signed zeros. ``tests/test_blockquant.py`` checks the table against the literal rule
(and ``ml_dtypes``) for every ``mu``, every exponent and every ``d`` that rounds to something.

The subtraction and the lookup run over ``CHUNK`` values at a time, so the indexes stay in a core's L2
cache: about 0.2 ns a value for the subtraction (bf16 bits widened to int32 on the way) and 0.5 for
the lookup (``np.take``, whose ``mode="wrap"`` loop was measured faster than ``"clip"``'s; every index
is in range either way), 0.7 ns in all against 1.5 for the literal rule.

The block maxima (``bits_amax`` of bf16 bits, ``block_amax`` of float32) are computed once per weight:
its scale tensor and its values are two output tensors, and whichever is written first hands its
maxima to the other through a ``ScaleMemo`` (bounded by ``MEMO_BYTES``).
"""

from __future__ import annotations

import functools
import threading

import numpy as np

from reshard import dtypes
from reshard.execute import floatbits

FAST_LOWEST = 20 << 7  # smallest block maximum (bf16 bits) the table serves: amax >= 2 ** -107
ZERO_BINADES = 19  # |w| <= amax * 2 ** -19 rounds to a signed zero
SPAN = ZERO_BINADES << 7  # table entries of one sign and one mantissa that can round to something
_SLOT = 1 << 16
_SIGN = 0x8000
CHUNK = 1 << 16  # values a subtraction + lookup: 256 KiB of int32 indexes
# Smallest normal float32: a scale at least this (amax / 448 rounded) divides every value of its block to
# within 448 (1 + 2 ** -22) < 464, which F8_E4M3 rounds to 448 as the clip would.
SAFE_SCALE = np.float32(2.0**-126)
_BUILDING = threading.Lock()
MEMO_BYTES = 64 * 1024**2  # block maxima kept between a quantized weight's values and its scale tensor


def scale_of(amax: np.ndarray) -> np.ndarray:
    """DeepSeek's scale of blocks whose largest magnitudes are ``amax`` (float32, finite): ``amax / 448``,
    1.0 for an all-zero block."""
    scale = amax / np.float32(dtypes.FP8_E4M3_LARGEST)
    scale[amax == 0] = 1.0
    return scale


def rule_bytes(values: np.ndarray, scale: np.ndarray, out: np.ndarray) -> None:
    """DeepSeek's rule, literally: float32 ``values`` divided (in place) by ``scale`` (broadcast against
    them), clipped to +-448 and rounded to F8_E4M3 into ``out`` (uint8, C-contiguous, ``values``' size)."""
    np.divide(values, scale, out=values)
    if scale.size and scale.min() < SAFE_SCALE:  # else |w| / scale <= 448 (1 + 2 ** -22): no clip needed
        np.clip(values, -dtypes.FP8_E4M3_LARGEST, dtypes.FP8_E4M3_LARGEST, out=values)
    floatbits.e4m3_bytes(values, out)


def table() -> np.ndarray:
    """The F8_E4M3 byte of every index ``(mu + 1) * 2 ** 16 + A - bits(w)`` (the module says why), uint8:
    built once, by the first of the executor's threads to ask."""
    with _BUILDING:
        return _table()


@functools.cache
def _table() -> np.ndarray:
    top = np.uint32(127 << 7) | np.arange(128, dtype=np.uint32)  # amax in [1, 2): bits 0x3F80 + mu
    amax = (top << np.uint32(16)).view(np.float32)
    scale = (amax / np.float32(dtypes.FP8_E4M3_LARGEST))[:, None]
    magnitude = top[:, None] - np.arange(SPAN, dtype=np.uint32)[None, :]  # bits of |w| = A - d
    out = np.zeros(129 * _SLOT, dtype=np.uint8)
    for sign, start in ((0, _SLOT), (_SIGN, _SIGN)):  # slot mu + 1's lower half; slot mu's upper half
        values = ((magnitude | np.uint32(sign)) << np.uint32(16)).view(np.float32)
        made = np.empty(values.shape, dtype=np.uint8)
        rule_bytes(values, scale, made)
        region = out[start : start + 128 * _SLOT].reshape(128, _SLOT)
        region[:, :SPAN] = made
        region[:, SPAN:_SIGN] = np.uint8(0x80 if sign else 0)
    return out


def quantize_bf16(out: np.ndarray, bits: np.ndarray, top: np.ndarray) -> None:
    """F8_E4M3 bytes of bf16 ``bits`` into ``out``: by the table, and blocks whose maximum is below
    ``FAST_LOWEST`` (rare: all-zero blocks, tiny values) by ``rule_bytes`` afterwards.

    ``out``: uint8 ``[k * b0, j * b1]``, C-contiguous (whole blocks); ``bits``: uint16, the weight's rows
    and columns at its top-left (fewer at the tensor's edges; the rest of ``out`` is left as it was);
    ``top``: ``[k, j]``, each block's maximum magnitude as bf16 bits, every one finite.
    """
    k, j = top.shape
    b0, b1 = out.shape[0] // k, out.shape[1] // j
    rows, cols = bits.shape
    wide = top.astype(np.int32)
    offsets = ((wide & 0x7F) + 1) << 16 | wide  # (mu + 1) * 2 ** 16 + A
    lookup = table()
    step = max(1, min(b0, CHUNK // max(1, cols)))
    index = np.empty(step * cols, dtype=np.int32)
    for kk in range(k):
        line = np.repeat(offsets[kk], b1)[:cols]  # every column's constant in block row kk
        for r0 in range(kk * b0, min(rows, (kk + 1) * b0), step):
            r1 = min(r0 + step, (kk + 1) * b0, rows)
            at = index[: (r1 - r0) * cols].reshape(r1 - r0, cols)
            np.subtract(line, bits[r0:r1], out=at)
            np.take(lookup, at, out=out[r0:r1, :cols], mode="wrap")  # every index is in range
    for kk, jj in np.argwhere(top < FAST_LOWEST):  # overwritten: the table does not serve these
        r0, c0 = kk * b0, jj * b1
        block = bits[r0 : r0 + b0, c0 : c0 + b1]
        values = (block.astype(np.uint32) << np.uint32(16)).view(np.float32)
        amax = (top[kk : kk + 1, jj : jj + 1].astype(np.uint32) << np.uint32(16)).view(np.float32)
        made = np.empty(block.shape, dtype=np.uint8)
        rule_bytes(values, scale_of(amax), made)
        out[r0 : r0 + block.shape[0], c0 : c0 + block.shape[1]] = made


def bits_amax(bits: np.ndarray, grid: tuple[int, int], block: tuple[int, ...]) -> np.ndarray:
    """``max(|w|)`` (float32) of each of ``grid``'s blocks of bf16 ``bits`` (uint16, fewer rows or columns
    at the tensor's edges: zeros past them): non-negative bf16 order as their bits, widened exactly.

    Whole contiguous blocks take two reductions and no copy: the largest bits read as int16 are the
    largest positive magnitude (negative when there is none), the largest read as uint16 the largest
    negative one with its sign bit (or the positive one again): 0.10 -> 0.06 ns a value.
    """
    (k, j), (b0, b1) = grid, block
    if bits.shape == (k * b0, j * b1) and bits.flags.c_contiguous:
        positive = np.maximum.reduce(bits.view(np.int16).reshape(k, b0, j * b1), axis=1)
        signed = np.maximum.reduce(bits.reshape(k, b0, j * b1), axis=1)
        tall = np.maximum(np.maximum(positive, 0).view(np.uint16), signed & np.uint16(0x7FFF))
    else:
        magnitude = np.bitwise_and(bits, np.uint16(0x7FFF))
        if magnitude.shape != (k * b0, j * b1):  # a partial block at the tensor's edge
            padded = np.zeros((k * b0, j * b1), dtype=np.uint16)
            padded[: bits.shape[0], : bits.shape[1]] = magnitude
            magnitude = padded
        tall = np.maximum.reduce(magnitude.reshape(k, b0, j * b1), axis=1)
    top = tall.reshape(k, j, b1).max(axis=2)
    return (top.astype(np.uint32) << np.uint32(16)).view(np.float32)


def block_amax(grid: np.ndarray) -> np.ndarray:
    """``max(|x|)`` of each block of float32 ``grid`` ``[rows, b0, cols, b1]``, as float32 (NaN stays NaN).

    On the values' bits with the sign cleared (non-negative floats order as their bits do): rows of
    each block first (whole contiguous rows at a time), then the columns of what is left, 5x
    ``np.abs(grid).max(axis=(1, 3))``.
    """
    rows, b0, cols, b1 = grid.shape
    magnitude = np.bitwise_and(grid.view(np.uint32), np.uint32(0x7FFFFFFF))
    tall = np.maximum.reduce(magnitude.reshape(rows, b0, cols * b1), axis=1)
    return tall.reshape(rows, cols, b1).max(axis=2).view(np.float32)


class ScaleMemo:
    """Rows of block maxima (the scales' ``amax``) one pass over a ``--quantize`` weight computed (its values
    or its scale tensor, whichever the executor writes first: safetensors puts the F32 scale first), until
    the other pass takes them.

    Bounded (``MEMO_BYTES``): past it rows are not kept and the other pass computes them itself, so a
    weight and its scale written far apart (other Hugging Face shards) cannot grow it.
    """

    def __init__(self) -> None:
        self.rows: dict[tuple[str, int], np.ndarray] = {}
        self.first: dict[str, bool] = {}  # weight -> which pass came first (True: its scale tensor)
        self.nbytes = 0
        self.lock = threading.Lock()

    def keep(self, weight: str, scales: bool, first_row: int, amax: np.ndarray) -> None:
        """Keep rows ``first_row...`` of ``weight``'s block maxima, computed by its values (or scale) pass."""
        with self.lock:
            if self.first.setdefault(weight, scales) != scales or self.nbytes + amax.nbytes > MEMO_BYTES:
                return  # the other pass came first (it needs nothing), or the memo is full
            for k, row in enumerate(amax):
                self.rows[(weight, first_row + k)] = row
            self.nbytes += amax.nbytes

    def take(self, weight: str, scales: bool, rows: range) -> np.ndarray | None:
        """Block maxima rows ``rows`` of ``weight`` the other pass kept (None unless it kept every one)."""
        with self.lock:
            if self.first.setdefault(weight, scales) == scales:
                return None
            if not rows or any((weight, i) not in self.rows for i in rows):
                return None  # not kept, or not yet (the other pass runs on another thread)
            got = [self.rows.pop((weight, i)) for i in rows]
            self.nbytes -= sum(g.nbytes for g in got)
            return np.stack(got)


__all__ = [
    "CHUNK",
    "FAST_LOWEST",
    "MEMO_BYTES",
    "SAFE_SCALE",
    "SPAN",
    "ScaleMemo",
    "bits_amax",
    "block_amax",
    "quantize_bf16",
    "rule_bytes",
    "scale_of",
    "table",
]
