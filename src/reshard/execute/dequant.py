"""Dequantizing while copying: a block-scaled pair read box by box as the tensor it stands for.

A plan made with ``--dequantize`` (``reshard.plan.quantized``) names tensors no file holds as such
(``X.weight`` in bf16, ``P`` of an MXFP4 pair) and lists, in ``Plan.quantized``, the stored pair each
one comes from. ``wrapped_opener`` gives the executor an opener whose indexes answer for those
tensors: their entry has the tensor's shape and the *stored* dtype (so the executor always takes its
converting path, never a byte copy), and ``array(name)`` returns a ``Dequantized`` object that
computes only the box it is asked for (``copy_boxes`` slices it like a numpy array). Memory is the
box in float32 plus at most one block of padding per edge; the executor gives dequantized tensors a
smaller row block (``EXPANSION``).

The arithmetic is the references', reproduced exactly (tests compare bit for bit):

* FP8 blocks, as torch's ``QuantizedHuggingFaceStorageReader``: ``float32(w) * float32(scale)``
  per block (one float32 multiplication), then rounded to the target dtype (nearest even).
* MXFP4, as transformers' ``convert_moe_packed_tensors``: the FP4 E2M1 value of each nibble (low
  nibble first) times ``2 ** (scale - 127)``, axes 1 and 2 swapped at the end.

``check_scales`` reads every scale tensor (small: one value per block) before any output exists and
refuses a NaN or infinite scale naming the tensor.

``--quantize`` (``Quantized``) reads each weight twice, once for its F8 values and once for its F32
scale tensor; the pass written first hands its block maxima to the other (``blockquant.ScaleMemo``, bounded). A
bf16 weight's values come from one table lookup each (``blockquant``), other dtypes' through float32.
After a model map the weight is no stored tensor but a planned one (``Assembled``: its copies'
rows, read as the executor reads them).
"""

from __future__ import annotations

import functools
import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reshard import dtypes
from reshard.errors import UsageError
from reshard.execute import assemble, blockquant, floatbits
from reshard.execute.assemble import SourceArray
from reshard.formats.base import TensorEntry, TensorIndex, drop_resident
from reshard.plan import Plan, TensorPlan
from reshard.plan.model import QuantizedSource
from reshard.plan.quantized import FP8_BLOCK, QUANTIZE, QUANTIZE_SCALE

Opener = Callable[[str], TensorIndex]
Box = tuple[slice, ...]

E8M0_NAN = floatbits.E8M0_NAN
EXPANSION = 4  # a dequantized row block holds float32 values and one block of padding: a quarter of the budget
QUANTIZE_EXPANSION = 16  # a quantized row block (1 byte an element) needs three float32 temporaries
# Largest row block of a computed tensor, in output bytes: its float32 temporaries are 2-12x that, and
# larger blocks are no faster (measured), so peak memory stays near 100 MB a worker whatever --max-memory.
ROW_BLOCK_CAP = 16 * 1024**2
QUANTIZE_ROW_BLOCK_CAP = 4 * 1024**2  # F8 output bytes: 4 Mi elements, 16 MB a float32 temporary
SCALE_CHUNK = 1 << 22  # weight elements read at once to compute a --quantize scale tensor
BAND_ELEMENTS = 1 << 20  # --quantize computes this many weight elements at a time (4 MiB of float32)


@functools.cache
def _mxfp4_table(code: str) -> np.ndarray:
    """``floatbits.mxfp4_products`` rounded once to the target dtype (its carrier): what the float32 path writes, one
    lookup a value."""
    return _to_target(floatbits.mxfp4_products(), code)


def _mxfp4_overflows(code: str, largest_byte: int) -> bool:
    """Whether a scale byte up to ``largest_byte`` makes a finite value infinite in the target (fp16)."""
    made = _mxfp4_table(code)[: (largest_byte + 1) * 16]
    return _overflows(made, floatbits.mxfp4_products()[: (largest_byte + 1) * 16], code)


def _carrier(code: str | None) -> np.dtype:
    """The dtype dequantized boxes come in: the target's carrier (bf16's bits as uint16; float32 without one)."""
    return np.dtype(np.float32) if code is None else np.dtype(dtypes.from_st_code(code).carrier)


def _to_target(values: np.ndarray, code: str | None) -> np.ndarray:
    """float32 ``values`` rounded to nearest even in the target dtype, as its carrier (no ``ml_dtypes``)."""
    if code is None or code == "F32":
        return values
    if code == "BF16":
        return floatbits.bf16_bits(values)
    with np.errstate(over="ignore", invalid="ignore"):
        return values.astype(dtypes.from_st_code(code).numpy)  # F16: a numpy builtin


def _scale_f32(scale: np.ndarray) -> np.ndarray:
    """Block scales as float32 (E8M0 / U8 exponent bytes as ``2 ** (b - 127)``, BF16's bits (uint16) widened;
    exact)."""
    if scale.dtype == np.uint16:  # BF16 scales read as their carrier: float32's top half
        return (scale.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if scale.dtype == np.uint8 or scale.dtype.itemsize == 1:
        raw = scale.view(np.uint8)
        with np.errstate(over="ignore"):  # byte 255 (2 ** 128) is E8M0's NaN: made NaN below
            out = np.ldexp(np.float32(1.0), raw.astype(np.int32) - dtypes.E8M0_BIAS).astype(np.float32)
        out[raw == E8M0_NAN] = np.nan
        return out
    return scale.astype(np.float32)


def _overflows(made: np.ndarray, exact: np.ndarray, code: str | None) -> bool:
    """Whether rounding ``exact`` (float32) to ``made`` (the carrier of ``code``) turned a finite value infinite."""
    if code is None or code == "F32":
        return False
    infinite = (made & np.uint16(0x7FFF)) == np.uint16(0x7F80) if code == "BF16" else np.isinf(made)
    return bool((infinite & np.isfinite(exact)).any())


def _bounds(box: Box, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    out = []
    for s, n in zip(box, shape, strict=False):
        start, stop, _ = s.indices(n)
        out.append((start, max(start, stop)))
    out.extend((0, n) for n in shape[len(box) :])
    return out


class Dequantized:
    """One dequantized tensor, computed box by box from its stored pair (boxes in the target's carrier:
    bf16's bits as uint16, so no ``ml_dtypes``).

    ``values`` / ``scale``: the stored arrays as their carriers (F8 bytes as uint8, BF16 scales as uint16);
    ``code``: the values' safetensors dtype (``F8_E4M3``, ``F8_E5M2``; ``U8`` for MXFP4 blocks).
    """

    def __init__(
        self,
        source: QuantizedSource,
        values: np.ndarray | Assembled,
        scale: np.ndarray | Assembled,
        shape: tuple[int, ...],
        code: str,
        release: Callable[[], None] | None = None,
    ) -> None:
        self.source = source
        self.values = values
        self.scale = scale
        self.shape = shape
        self.ndim = len(shape)
        self.source_code = code
        self.dtype = _carrier(source.target)
        self.release = release

    def fill_box(self, box: Box, dst: np.ndarray) -> bool:
        """Compute ``self[box]`` straight into ``dst`` (the executor's staging) when it is FP8 blocks read
        through tables into ``dst``'s own dtype; False: not done, index and copy the box instead. Saves a
        copy of every output byte and a fresh array per box: on the bench's 2 GiB dequantize, 0.05 s of
        wall and peak RSS 104 -> 89 MB."""
        if self.source.kind != FP8_BLOCK or self.source.target is None or dst.dtype != self.dtype:
            return False
        bounds = _bounds(box, self.shape)
        if len(bounds) != 2 or self._fp8_tables(bounds, dst) is None:
            return False
        if self.release is not None:
            self.release()
        return True

    def __getitem__(self, box: Box) -> np.ndarray:
        bounds = _bounds(box if isinstance(box, tuple) else (box,), self.shape)
        out = self._fp8(bounds) if self.source.kind == FP8_BLOCK else self._mxfp4(bounds)
        if self.release is not None:
            self.release()  # assembled from chunks: their pages read for this box dropped (the executor cannot)
        if out.dtype == self.dtype:
            return out
        made = _to_target(out, self.source.target)  # the float32 path: rounded once, here
        if _overflows(made, out, self.source.target):
            target = dtypes.from_st_code(str(self.source.target))
            largest = float(np.max(np.abs(out[np.isfinite(out)]), initial=0.0))
            raise UsageError(
                f"{self.source.name}: --dequantize to {target.ms_name} overflows: largest magnitude {largest:.6g}, "
                f"{target.ms_name} holds at most {dtypes.largest_finite(target):.6g} (choose bf16 or fp32)"
            )
        return made

    def reshape(self, view: Sequence[int]) -> Viewed:
        return Viewed(self, tuple(view))

    def _fp8(self, bounds: list[tuple[int, int]]) -> np.ndarray:
        if self.source.target is not None and len(bounds) == 2:
            fast = self._fp8_tables(bounds)
            if fast is not None:
                return fast
        b0, b1 = self.source.block
        lead = tuple(slice(a, b) for a, b in bounds[:-2])
        (r0, r1), (c0, c1) = bounds[-2:]
        i0, i1 = r0 // b0, -(-r1 // b0)
        j0, j1 = c0 // b1, -(-c1 // b1)
        rows, cols = self.shape[-2:]
        pr0, pr1, pc0, pc1 = i0 * b0, min(i1 * b0, rows), j0 * b1, min(j1 * b1, cols)
        values_box = (*lead, slice(pr0, pr1), slice(pc0, pc1))
        stored = self.values[values_box]
        values = floatbits.torch_fp8_values(self.source_code)[
            stored.view(np.uint8)
        ]  # fancy indexing: 10x np.take(out=)
        if values.shape[-2:] != ((i1 - i0) * b0, (j1 - j0) * b1):  # a partial block at the tensor's edge
            padded = np.zeros((*values.shape[:-2], (i1 - i0) * b0, (j1 - j0) * b1), dtype=np.float32)
            padded[..., : pr1 - pr0, : pc1 - pc0] = values
            values = padded
        scale_box = (*lead, slice(i0, i1), slice(j0, j1))
        scale = _scale_f32(self.scale[scale_box])
        grid = values.reshape(*values.shape[:-2], i1 - i0, b0, j1 - j0, b1)
        grid *= scale[..., :, None, :, None]
        return values[..., r0 - pr0 : r1 - pr0, c0 - pc0 : c1 - pc0]

    def _fp8_tables(self, bounds: list[tuple[int, int]], out: np.ndarray | None = None) -> np.ndarray | None:
        """The box in the target dtype through one 256-entry table per block (None: a value would overflow).

        Each table holds ``target(float32(byte) * float32(scale))`` for the 256 bytes: the very values
        the float32 path rounds, so the result is the same bit for bit, at one table lookup an element
        (measured about twice as fast; ``np.take(mode="clip", out=)`` is 1.8x fancy indexing again). Per
        band of block rows, ``byte + 256 * column block`` (16 bits) indexes the band's tables laid end to
        end. ``out``: write there (the executor's staging). Measured and not kept: the index made in
        numpy's native integers, which ``take`` converts a 16-bit one to (12% of the samples), whole or
        in L2-sized pieces: no faster end to end (pieces of two rows: 1.5x slower).
        """
        (r0, r1), (c0, c1) = bounds
        b0, b1 = self.source.block
        j0, j1 = c0 // b1, -(-c1 // b1)
        if (j1 - j0) * 256 > 1 << 16:  # indexes must fit 16 bits: very wide tensors take the float32 path
            return None
        code = self.source.target
        table = floatbits.torch_fp8_values(self.source_code)
        offsets = ((np.arange(c0, c1) // b1 - j0) * 256).astype(np.uint16)
        out = np.empty((r1 - r0, c1 - c0), dtype=self.dtype) if out is None else out
        i0 = r0 // b0
        scales = self.scale[i0 : -(-r1 // b0), j0:j1]  # the box's scale rows, read once (slices: Assembled too)
        for i in range(i0, -(-r1 // b0)):
            lo, hi = max(r0, i * b0), min(r1, (i + 1) * b0)
            scale = _scale_f32(scales[i - i0])
            with np.errstate(over="ignore", invalid="ignore"):
                products = table[None, :] * scale[:, None]
            tables = _to_target(products, code)
            if _overflows(tables, products, code):
                return None  # the float32 path copies it, and the cast there names the tensor
            stored = self.values[lo:hi, c0:c1].view(np.uint8)
            # mode="clip" (every index is in range): no bounds-checking buffer, straight into ``out``
            np.take(tables.reshape(-1), stored + offsets, out=out[lo - r0 : hi - r0], mode="clip")
        return out

    def _mxfp4(self, bounds: list[tuple[int, int]]) -> np.ndarray:
        (e0, e1), (k0, k1), (r0, r1) = bounds
        block = dtypes.MXFP4_BLOCK
        g0, g1 = k0 // block, -(-k1 // block)
        stored = self.values[e0:e1, r0:r1, g0:g1, :]
        exps = self.scale[e0:e1, r0:r1, g0:g1].view(np.uint8)
        if self.source.target is not None and exps.size:
            table = _mxfp4_table(str(self.source.target))
            if not _mxfp4_overflows(str(self.source.target), int(exps.max())):
                rows = exps.astype(np.uint16)[..., None] << 4  # [e, r, g, 1]: the exponent's 16 entries
                out = np.empty((*stored.shape, 2), dtype=table.dtype)
                out[..., 0] = table[rows + (stored & 0x0F)]
                out[..., 1] = table[rows + (stored >> 4)]
                flat = out.reshape(e1 - e0, r1 - r0, (g1 - g0) * block)[:, :, k0 - g0 * block : k1 - g0 * block]
                return flat.transpose(0, 2, 1)
        table = floatbits.fp4_values()
        out = np.empty((*stored.shape, 2), dtype=np.float32)  # [e, r, g, 16, 2]: low nibble first
        out[..., 0] = table[stored & 0x0F]
        out[..., 1] = table[stored >> 4]
        scaled = out.reshape(e1 - e0, r1 - r0, g1 - g0, block)
        scaled *= _scale_f32(self.scale[e0:e1, r0:r1, g0:g1])[..., None]
        flat = scaled.reshape(e1 - e0, r1 - r0, (g1 - g0) * block)[:, :, k0 - g0 * block : k1 - g0 * block]
        return flat.transpose(0, 2, 1)


class Quantized:
    """A weight quantized by DeepSeek's rule, box by box: its F8_E4M3 values, or its F32 ``weight_scale_inv``.

    Per ``b0 x b1`` block (edge blocks partial): ``scale = amax(|w|) / 448`` in float32 (1.0 for an
    all-zero block, whose values are zeros), ``value = w / scale`` clamped to +-448 and rounded to
    the nearest even F8_E4M3. Every box is computed from whole blocks, so any cut gives the same bytes.

    ``memo`` (shared by a weight's values and scale): the block maxima of whichever pass comes first, which
    the other then takes instead of computing them again. ``release`` drops the weight's
    resident pages once a part of it is read (the scale tensor, one row block for the executor,
    would otherwise keep the whole weight mapped).
    """

    def __init__(
        self,
        source: QuantizedSource,
        weight: np.ndarray | Assembled,
        scales: bool,
        memo: blockquant.ScaleMemo | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        self.source = source
        self.weight = weight
        self.scales = scales
        self.memo = memo if memo is not None else blockquant.ScaleMemo()
        self.release = release
        b0, b1 = source.block
        rows, cols = weight.shape
        self.grid = (-(-rows // b0), -(-cols // b1))
        self.shape = self.grid if scales else (rows, cols)
        self.ndim = 2
        self.dtype = np.dtype(np.float32) if scales else np.dtype(np.uint8)  # F8_E4M3 as its carrier

    def reshape(self, view: Sequence[int]) -> Viewed:
        raise UsageError(f"{self.source.weight}: --quantize cannot be combined with a model map that reshapes it")

    def fill_box(self, box: Box, dst: np.ndarray) -> bool:
        """Compute the F8 values of whole block rows straight into ``dst`` (the executor's staging, whole
        rows); False: not such a box, index and copy it instead. Spares a copy of every output byte."""
        (a0, a1), (c0, c1) = _bounds(box, self.shape)
        (b0, b1), cols = self.source.block, self.shape[1]
        whole = (c0, c1) == (0, cols) and not (cols % b1 or a0 % b0 or a1 % b0)
        fits = dst.dtype == self.dtype and dst.shape == (a1 - a0, cols) and dst.flags.c_contiguous
        if self.scales or not whole or not fits:
            return False
        self._blocks(a0 // b0, a1 // b0, 0, self.grid[1], out=dst)
        return True

    def __getitem__(self, box: Box) -> np.ndarray:
        (a0, a1), (c0, c1) = _bounds(box if isinstance(box, tuple) else (box,), self.shape)
        b0, b1 = self.source.block
        if self.scales:
            return self._scales(a0, a1, c0, c1)
        i0, i1, j0, j1 = a0 // b0, -(-a1 // b0), c0 // b1, -(-c1 // b1)
        values, _ = self._blocks(i0, i1, j0, j1)
        return values[a0 - i0 * b0 : a1 - i0 * b0, c0 - j0 * b1 : c1 - j0 * b1]

    def _scales(self, a0: int, a1: int, c0: int, c1: int) -> np.ndarray:
        """Scale rows a0:a1, columns c0:c1, computed from whole rows of blocks (a few at a time)."""
        step = max(1, SCALE_CHUNK // max(1, self.source.block[0] * self.weight.shape[1]))
        parts = [
            self._scale_of(self._blocks(i, min(a1, i + step), 0, self.grid[1])[1], i, 0)[:, c0:c1]
            for i in range(a0, a1, step)
        ]
        return np.concatenate(parts) if parts else np.empty((0, c1 - c0), dtype=np.float32)

    def _blocks(
        self, i0: int, i1: int, j0: int, j1: int, out: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Values (F8_E4M3, padded to whole blocks) and block maxima (F32) of block rows i0:i1, columns j0:j1.

        Computed a band of block rows at a time (``BAND_ELEMENTS``). A bf16 weight's maxima are those of
        its bits (no float32 copy) and its values come from ``blockquant``'s table; other dtypes (and
        blocks of tiny maxima) go through a float32 copy of the band, divided and cast while it is in
        the CPU's cache. Whole block rows hand their maxima to the weight's other pass (``memo``).
        """
        b0, b1 = self.source.block
        whole_rows = (j0, j1) == (0, self.grid[1])  # whole scale rows: shared with the other pass (``memo``)
        kept = self.memo.take(self.source.weight, self.scales, range(i0, i1)) if whole_rows else None
        if kept is not None and self.scales:
            return np.empty((0, 0), dtype=np.uint8), kept
        values = out  # the F8 values (padded to whole blocks): into ``out`` when given, else a fresh array
        if values is None and not self.scales:
            values = np.empty(((i1 - i0) * b0, (j1 - j0) * b1), dtype=np.uint8)
        step = max(1, BAND_ELEMENTS // ((j1 - j0) * b0 * b1))  # block rows a band
        maxima = []
        for k0 in range(i0, i1, step):
            k1 = min(i1, k0 + step)
            bits = self._bf16_bits(k0, k1, j0, j1)
            amax = kept[k0 - i0 : k1 - i0] if kept is not None else None
            if amax is None and bits is not None:
                amax = blockquant.bits_amax(bits, (k1 - k0, j1 - j0), self.source.block)
            if values is not None:
                if kept is None and amax is not None:
                    self._scale_of(amax, k0, j0)  # refuses a NaN or infinite block before any value is made
                rows = values[(k0 - i0) * b0 : (k1 - i0) * b0]
                amax = self._values(rows, bits, amax, k0, j0)
            elif amax is None:  # the scales alone of a float weight
                amax = blockquant.block_amax(self._floats(k0, k1, j0, j1))
            maxima.append(amax)
        if self.release is not None:
            self.release()  # the rows are computed now
        amax = np.concatenate(maxima)
        if whole_rows and kept is None:
            self.memo.keep(self.source.weight, self.scales, i0, amax)
        return (values, amax) if values is not None else (np.empty((0, 0), dtype=np.uint8), amax)

    def _values(
        self, rows: np.ndarray, bits: np.ndarray | None, amax: np.ndarray | None, k0: int, j0: int
    ) -> np.ndarray:
        """F8_E4M3 bytes of the band into ``rows`` (whole blocks from block row k0, column j0); returns its maxima.

        ``bits``: a bf16 weight's (None for another dtype); ``amax``: the band's block maxima if known.
        """
        if bits is not None and amax is not None:
            blockquant.quantize_bf16(rows, bits, (amax.view(np.uint32) >> np.uint32(16)).astype(np.uint16))
            return amax
        b0, b1 = self.source.block
        k, j = rows.shape[0] // b0, rows.shape[1] // b1
        grid = self._floats(k0, k0 + k, j0, j0 + j)
        if amax is None:
            amax = blockquant.block_amax(grid)
        scale = self._scale_of(amax, k0, j0)
        blockquant.rule_bytes(grid, scale[:, None, :, None], rows)
        return amax

    def _bf16_bits(self, k0: int, k1: int, j0: int, j1: int) -> np.ndarray | None:
        """A bf16 weight's bits (uint16) in block rows k0:k1, columns j0:j1 (fewer at its edges); None for
        another dtype."""
        b0, b1 = self.source.block
        rows, cols = self.weight.shape
        stored = self.weight[k0 * b0 : min(k1 * b0, rows), j0 * b1 : min(j1 * b1, cols)]
        if stored.dtype == np.uint16 or stored.dtype.name == "bfloat16":  # bf16 or its carrier
            return stored.view(np.uint16)
        return None

    def _floats(self, k0: int, k1: int, j0: int, j1: int) -> np.ndarray:
        """The weight's block rows k0:k1, columns j0:j1 as float32 ``[k, b0, j, b1]`` (zeros past its edges)."""
        b0, b1 = self.source.block
        rows, cols = self.weight.shape
        r0, r1, c0, c1 = k0 * b0, min(k1 * b0, rows), j0 * b1, min(j1 * b1, cols)
        band = np.empty(((k1 - k0) * b0, (j1 - j0) * b1), dtype=np.float32)
        if band.shape != (r1 - r0, c1 - c0):  # a partial block at the tensor's edge
            band[...] = 0
        stored = self.weight[r0:r1, c0:c1]
        inside = band[: r1 - r0, : c1 - c0]
        if stored.dtype == np.uint16 or stored.dtype.name == "bfloat16":  # bf16 (or its carrier): float32's top half
            np.left_shift(stored.view(np.uint16), np.uint32(16), out=inside.view(np.uint32), dtype=np.uint32)
        else:
            inside[...] = stored
        return band.reshape(k1 - k0, b0, j1 - j0, b1)

    def _scale_of(self, amax: np.ndarray, i0: int, j0: int) -> np.ndarray:
        """DeepSeek's scale of each block from its ``amax`` (refusing NaN or infinity)."""
        if not np.isfinite(amax).all():
            i, j = (int(k) for k in np.argwhere(~np.isfinite(amax))[0])
            raise UsageError(
                f"{self.source.weight}: block [{i0 + i}, {j0 + j}] holds NaN or infinite values, "
                "which --quantize cannot scale"
            )
        return blockquant.scale_of(amax)


class Viewed:
    """A ``Dequantized`` tensor seen through a C-order reshape (model maps' stacked views): gathered element-wise."""

    def __init__(self, base: Dequantized, shape: tuple[int, ...]) -> None:
        self.base = base
        self.shape = shape
        self.ndim = len(shape)
        self.dtype = base.dtype

    def reshape(self, view: Sequence[int]) -> Viewed:
        return Viewed(self.base, tuple(view))

    def __getitem__(self, box: Box) -> np.ndarray:
        bounds = _bounds(box if isinstance(box, tuple) else (box,), self.shape)
        lengths = [b - a for a, b in bounds]
        if 0 in lengths:
            return np.zeros(lengths, dtype=self.dtype)
        grids = np.ix_(*(np.arange(a, b) for a, b in bounds))
        flat = np.ravel_multi_index(grids, self.shape)
        row = int(np.prod(self.base.shape[1:], dtype=np.int64))
        first, last = int(flat.min()) // row, int(flat.max()) // row + 1
        rows = self.base[(slice(first, last),)]
        return np.ascontiguousarray(rows).reshape(-1)[flat - first * row]


@dataclass
class QuantizedIndex(TensorIndex):
    """A source file's index that also answers for the dequantized tensors read from it."""

    made: dict[str, Callable[[], Any]] = field(default_factory=dict)

    def array(self, name: str) -> np.ndarray:
        if name in self.made:  # a Dequantized / Quantized seen as numbers, sliced like an array by copy_boxes
            out: np.ndarray = AsNumbers(self.made[name]())  # type: ignore[assignment]
            return out
        return super().array(name)


def wrapped_opener(plan: Plan, opener: Opener) -> Opener:
    """``opener`` whose indexes answer for ``plan``'s dequantized tensors (``opener`` itself without any)."""
    if not plan.quantized:
        return opener
    by_path: dict[str, list[QuantizedSource]] = {}
    for q in plan.quantized:
        by_path.setdefault(q.path, []).append(q)

    def open_one(path: str) -> TensorIndex:
        index = opener(path)
        records = by_path.get(path)
        if not records:
            return index
        others: dict[str, TensorIndex] = {}

        def scale_index(p: str) -> TensorIndex:
            if p == path:
                return index
            if p not in others:
                others[p] = opener(p)
            return others[p]

        def close() -> None:
            for other in others.values():
                other.close()
            index.close()

        entries = dict(index.entries)
        made: dict[str, Callable[[], Any]] = {}
        memo = blockquant.ScaleMemo()  # one per opened file: its quantized weights' values hand their scales on
        for q in records:
            if q.assembled is not None:  # --quantize after a model map, or a DCP source: the weight is assembled
                if q.name in index.entries and not _own_chunk(q, path):
                    raise UsageError(
                        f"{q.name}: --quantize would compute this tensor after the model map, but {path} "
                        "already holds a tensor of that name"
                    )
                shape = _shape(q, q.assembled.shape)
                entries[q.name] = TensorEntry(q.name, q.assembled.dtype, shape, ())
                made[q.name] = functools.partial(_assembled, q, scale_index, memo)
                continue
            stored = index.entries[q.weight]
            shape = _shape(q, stored.shape)
            entries[q.name] = TensorEntry(q.name, stored.dtype, shape, stored.segments)
            made[q.name] = functools.partial(_dequantized, q, index, scale_index, shape, memo)
        return QuantizedIndex(
            index.path, index.format, index.buffer, entries, index.metadata, close, index.file_backed, made
        )

    return open_one


def _own_chunk(q: QuantizedSource, path: str) -> bool:
    """Whether tensor ``q.name`` of ``path`` is a chunk of the very weight ``q`` assembles (a DCP source's
    ``X.weight``): the computed tensor then stands in for it (the assembly reads the file's own index)."""
    assert q.assembled is not None
    return any(q.assembled_sources[c.source] == path and c.tensor == q.name for c in q.assembled.copies)


def _shape(q: QuantizedSource, stored: tuple[int, ...]) -> tuple[int, ...]:
    if q.kind in (FP8_BLOCK, QUANTIZE):
        return stored
    if q.kind == QUANTIZE_SCALE:
        return (-(-stored[0] // q.block[0]), -(-stored[1] // q.block[1]))
    e, r, g, _ = stored
    return (e, g * dtypes.MXFP4_BLOCK, r)


def _dequantized(
    q: QuantizedSource,
    index: TensorIndex,
    scale_index: Callable[[str], TensorIndex],
    shape: tuple[int, ...],
    memo: blockquant.ScaleMemo | None = None,
) -> Dequantized | Quantized:
    if q.kind in (QUANTIZE, QUANTIZE_SCALE):  # the weight as its carrier: bf16's bits (uint16), widened exactly
        release = functools.partial(_release, index, q.weight)
        return Quantized(q, index.items(q.weight), q.kind == QUANTIZE_SCALE, memo, release)
    code = str(index.entries[q.weight].dtype.st_code)
    return Dequantized(q, index.items(q.weight), scale_index(q.scale_path).items(q.scale), shape, code)


def _release(index: TensorIndex, name: str) -> None:
    """Drop the resident pages of tensor ``name`` of ``index`` (they stay in the page cache)."""
    for offset, length in index.entries[name].segments:
        start = offset - offset % mmap.PAGESIZE
        drop_resident(index.buffer, start, offset + length - start)


class Assembled:
    """A planned tensor (``TensorPlan``) read as an array, rows by rows from its copies' sources.

    What ``Quantized`` reads when ``--quantize`` comes after a model map: the Hugging Face tensor a
    rename, join or stack makes of the stored ones, assembled only for the rows asked. What
    ``Dequantized`` and ``Quantized`` read of a chunked source's pair (a DCP folder): the stored
    weight and scale, assembled from their chunks.

    ``raw``: ``source_array`` gives stored items as their carriers (F8 bytes as uint8, bf16 as uint16) and
    every copy reads ``t``'s own dtype, so rows are bytes moved, never numbers (no ``ml_dtypes``, no rounding).
    """

    def __init__(self, t: TensorPlan, source_array: SourceArray, raw: bool = False) -> None:
        self.t = t
        self.source_array = source_array
        self.shape = t.shape
        self.ndim = len(t.shape)
        self.raw = raw
        self.dtype = np.dtype(t.dtype.carrier if raw else t.dtype.numpy)

    def __getitem__(self, box: Box) -> np.ndarray:
        bounds = _bounds(box if isinstance(box, tuple) else (box,), self.shape)
        (r0, r1), rest = bounds[0], bounds[1:]
        if self.raw:
            rows = np.empty((r1 - r0, *self.shape[1:]), dtype=self.dtype)
            assemble.copy_boxes(rows, self.t, r0, self.source_array)  # carriers alike: np.copyto, bytes as bytes
        else:
            rows = assemble.tensor_rows(self.t, r0, r1, self.source_array)
        index = (slice(None), *[slice(a, b) for a, b in rest])
        return rows[index]


def _assembled(
    q: QuantizedSource, index_of: Callable[[str], TensorIndex], memo: blockquant.ScaleMemo
) -> Dequantized | Quantized:
    assert q.assembled is not None
    weight, release = _assembled_array(q.assembled, q.assembled_sources, index_of)
    if q.kind in (QUANTIZE, QUANTIZE_SCALE):
        return Quantized(q, weight, q.kind == QUANTIZE_SCALE, memo, release)
    assert q.scale_assembled is not None, "a dequantized pair assembled from chunks has its scale assembled too"
    scale, release_scale = _assembled_array(q.scale_assembled, q.assembled_sources, index_of)

    def both() -> None:
        release()
        release_scale()

    shape = _shape(q, q.assembled.shape)
    return Dequantized(q, weight, scale, shape, str(q.assembled.dtype.st_code), both)


def _assembled_array(
    t: TensorPlan, paths: Sequence[str], index_of: Callable[[str], TensorIndex]
) -> tuple[Assembled, Callable[[], None]]:
    """``t`` read from the files ``paths`` (its copies' sources), and what drops their pages read so far: stored
    items when every copy reads ``t``'s own dtype (a chunked pair's bytes as bytes), numbers otherwise (a cast)."""
    raw = all(index_of(paths[c.source]).entries[c.tensor].dtype is t.dtype for c in t.copies)
    arrays: dict[tuple[int, str], np.ndarray] = {}

    def source_array(source: int, tensor: str) -> np.ndarray:
        if (source, tensor) not in arrays:
            index = index_of(paths[source])
            arrays[(source, tensor)] = index.items(tensor) if raw else index.array(tensor)
        return arrays[(source, tensor)]

    def release() -> None:  # the sources' pages read so far (transposed ones are read again by every block)
        for c in t.copies:
            if c.src_perm is None:
                _release(index_of(paths[c.source]), c.tensor)

    return Assembled(t, source_array, raw), release


Computed = Dequantized | Quantized | Viewed


def _numeric_code(a: Computed) -> str:
    """The safetensors dtype whose bits a computed tensor's boxes hold."""
    if isinstance(a, Viewed):
        return _numeric_code(a.base)
    if isinstance(a, Quantized):
        return "F32" if a.scales else "F8_E4M3"
    return str(a.source.target) if a.source.target is not None else "F32"


class AsNumbers:
    """A computed tensor whose boxes (its carrier's bits) are viewed as the numbers they are, for a staging
    buffer of numbers (an output that also reads stored tensors, or is cast afterwards)."""

    def __init__(self, base: Computed | AsNumbers) -> None:
        self.base = base
        self.shape: tuple[int, ...] = tuple(base.shape)
        self.ndim: int = base.ndim
        self.code: str = base.code if isinstance(base, AsNumbers) else _numeric_code(base)

    @property
    def dtype(self) -> np.dtype:
        """The numbers' dtype (bf16 / F8 import ``ml_dtypes``: asked only when they are read as numbers)."""
        return np.dtype(dtypes.from_st_code(self.code).numpy)

    def reshape(self, view: Sequence[int]) -> AsNumbers:
        return AsNumbers(self.base.reshape(view))

    def __getitem__(self, box: Box) -> np.ndarray:
        return self.base[box].view(self.dtype)


def staging(t: TensorPlan, read: SourceArray) -> tuple[np.dtype, SourceArray]:
    """The staging dtype of ``t``, whose copies read computed tensors, and how to read its sources.

    Every copy computed in ``t``'s own dtype: boxes are bits copied into a staging of ``t``'s carrier (bf16 as
    uint16), so a ``--dequantize`` / ``--quantize`` run never needs ``ml_dtypes``. Otherwise (stored tensors
    beside them, a cast afterwards) the staging holds numbers and computed boxes are viewed as theirs.
    """
    opened = [read(c.source, c.tensor) for c in t.copies]
    own = np.dtype(t.dtype.carrier)
    if all(isinstance(a, AsNumbers) and a.base.dtype == own and a.code == t.dtype.st_code for a in opened):

        def bits(source: int, tensor: str) -> Any:
            return read(source, tensor).base

        return own, bits
    return np.dtype(t.dtype.numpy), read


def row_alignment(computed: Sequence[QuantizedSource]) -> int:
    """Rows each row block of a tensor whose copies read ``computed`` should be a multiple of: the block
    rows of its ``--quantize`` weight (1: none, or several). Each box of one is computed from whole
    blocks, so a box that ends inside a block row computes that block row twice and cannot take its
    maxima from the memo. 32 bf16 weights of 2048x7168 (585-row boxes before), quantized: warm
    0.82-0.90 -> 0.56-0.59 s, cold medians of 5 0.862 -> 0.647 s (with ``Quantized.fill_box``); the
    bench's 7168x2048 weights, already aligned, 1.351 -> 1.270 s cold from ``fill_box`` alone."""
    rows = {q.block[0] for q in computed if q.kind == QUANTIZE}
    return rows.pop() if len(rows) == 1 else 1


def row_block_bytes(kinds: set[str], budget: int) -> int:
    """The row block (output bytes) of a tensor read through these kinds, out of a worker's ``budget``.

    Smaller than a copy's: float32 temporaries sit beside the staging buffer, and a cap keeps each
    worker near 100 MB whatever ``--max-memory`` (larger blocks were measured no faster).
    """
    if kinds & {QUANTIZE, QUANTIZE_SCALE}:
        return max(1, min(budget // QUANTIZE_EXPANSION, QUANTIZE_ROW_BLOCK_CAP))
    return max(1, min(budget // EXPANSION, ROW_BLOCK_CAP))


def check_scales(plan: Plan, opener: Opener) -> None:
    """Refuse a NaN or infinite block scale of ``plan``'s dequantized tensors, before anything is written.

    Raises:
        UsageError: Naming the scale tensor, how many of its values are not finite, and the first.
    """
    opened: dict[str, TensorIndex] = {}

    def index_of(path: str) -> TensorIndex:
        if path not in opened:
            opened[path] = opener(path)
        return opened[path]

    try:
        for q in plan.quantized:
            if q.kind in (QUANTIZE, QUANTIZE_SCALE):  # scales made by this run, not read
                continue
            chunked = q.scale_assembled  # a chunked source's scale: its chunks put together (small)
            if chunked is not None:
                whole, release = _assembled_array(chunked, q.assembled_sources, index_of)
                scale = _scale_f32(whole[(slice(None),)])
            else:
                release = functools.partial(_release, index_of(q.scale_path), q.scale)
                scale = _scale_f32(index_of(q.scale_path).items(q.scale))
            release()  # unmapped at once: a page cached in a large folio maps all of it (RSS 113 -> 73 MiB)
            bad = ~np.isfinite(scale)
            if bad.any():
                first = tuple(int(i) for i in np.argwhere(bad)[0])
                raise UsageError(
                    f"{q.scale}: {int(bad.sum())} block scale(s) are NaN or infinite (first at {list(first)}): "
                    f"{q.weight} cannot be dequantized"
                )
    finally:
        for index in opened.values():
            index.close()


__all__ = [
    "EXPANSION",
    "AsNumbers",
    "Assembled",
    "Dequantized",
    "Quantized",
    "QuantizedIndex",
    "Viewed",
    "check_scales",
    "row_alignment",
    "row_block_bytes",
    "staging",
    "wrapped_opener",
]
