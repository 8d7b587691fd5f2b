"""The vectorised float32 -> F8_E4M3 cast (``reshard.execute.floatbits``) against ``ml_dtypes``, bit for bit.

The cast's result depends on a float32's top 13 bits and on whether any of its 19 lower bits is set
(the module says why), so the checks cover every class: every bfloat16 pattern (all 2^16 top
halves, low half zero), every top 14 bits with the low 18 bits at their extremes, every rounding
boundary of E4M3 (each midpoint and the float32 on either side of it), and a large random sample.
``RESHARD_F8_EXHAUSTIVE=1`` runs all 2^32 float32 patterns (about 30 s; run for this commit).
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np

from reshard.execute import floatbits

F8 = ml_dtypes.float8_e4m3fn


def _check(bits: np.ndarray) -> None:
    x = bits.astype(np.uint32).view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(F8).view(np.uint8)
    got = floatbits.e4m3_bytes(x)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(hex(int(bits[i])), hex(int(got[i])), hex(int(want[i]))) for i in bad[:5]]


def test_every_bfloat16_pattern() -> None:
    _check(np.arange(1 << 16, dtype=np.uint32) << np.uint32(16))


def test_every_index_with_the_low_bits_at_their_extremes() -> None:
    top = np.arange(1 << 14, dtype=np.uint32) << np.uint32(18)
    for low in (0, 1, 1 << 17, (1 << 17) - 1, (1 << 18) - 1, 0x2AAAA):
        _check(top | np.uint32(low))


def test_every_rounding_boundary() -> None:
    values = np.arange(256, dtype=np.uint8).view(F8).astype(np.float32)
    finite = np.sort(np.unique(np.abs(values[np.isfinite(values)])))
    mids = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)  # exact in float32
    edges = np.concatenate([finite, mids, [np.float32(464.0), np.float32(480.0)]]).view(np.uint32)
    around = np.concatenate([edges - np.uint32(1), edges, edges + np.uint32(1)])
    _check(np.concatenate([around, around | np.uint32(1 << 31)]))


def test_specials_and_a_random_sample() -> None:
    specials = np.array([np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0, 1e-45, 3.4e38, 448.0, 449.0], np.float32)
    _check(specials.view(np.uint32))
    _check(np.random.default_rng(0).integers(0, 1 << 32, 1 << 22, dtype=np.uint64).astype(np.uint32))


def test_shapes_chunks_and_out() -> None:
    x = np.random.default_rng(1).standard_normal((3, floatbits.CHUNK // 2 + 7), dtype=np.float32) * 300
    out = np.empty(x.shape, dtype=np.uint8)
    assert floatbits.e4m3_bytes(x, out) is out
    assert (out == x.astype(F8).view(np.uint8)).all()
    assert floatbits.e4m3_bytes(np.empty((0, 4), np.float32)).shape == (0, 4)


def test_float32_patterns() -> None:
    """Every float32 bit pattern with ``RESHARD_F8_EXHAUSTIVE=1`` (about 30 s); else one in 16 of every
    sign and exponent block (about 2 s), the 16 residues of the low bits taken in turn across the blocks."""
    exhaustive = os.environ.get("RESHARD_F8_EXHAUSTIVE") == "1"
    step, stride = 1 << 24, 1 if exhaustive else 16
    for k in range(1 << 8):
        base = np.arange(k % stride, step, stride, dtype=np.uint32)
        _check(base + np.uint32(k * step))
