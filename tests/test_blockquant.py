"""``--quantize fp8-block``'s table for bf16 weights (``reshard.execute.blockquant``) against the literal rule.

The reference is DeepSeek's rule computed with ``ml_dtypes``' cast (float32 division by ``amax / 448``,
clip to +-448, round to F8_E4M3), as torch computes it. The table's claims are checked where they are
made: every mantissa of the block maximum, every exponent the table serves (its bytes must not depend on
it), every ``d = A - |w|`` up to past ``SPAN`` (beyond it a signed zero), both signs; then whole weights
through ``quantize_bf16`` and ``Quantized`` (edge blocks, a column box, tiny and zero blocks that take the
float32 path).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from reshard.execute import blockquant, dequant
from reshard.plan.model import QuantizedSource
from reshard.plan.quantized import QUANTIZE, QUANTIZE_SCALE

F8 = ml_dtypes.float8_e4m3fn


def _rule(bits: np.ndarray, amax_bits: np.ndarray) -> np.ndarray:
    """F8_E4M3 bytes of bf16 ``bits`` scaled by ``amax / 448`` (``amax_bits`` broadcast against them)."""
    w = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    amax = (amax_bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    scale = np.where(amax == 0, np.float32(1), amax / np.float32(448)).astype(np.float32)
    return np.clip(w / scale, -448, 448).astype(F8).view(np.uint8)


def _index(top: np.ndarray, bits: np.ndarray) -> np.ndarray:
    return (((top.astype(np.int64) & 0x7F) + 1) << 16 | top.astype(np.int64)) - bits.astype(np.int64)


@pytest.mark.parametrize("exponents", [range(20, 100), range(100, 180), range(180, 255)])
def test_table_is_the_rule_for_every_mantissa_and_exponent(exponents: range) -> None:
    table = blockquant.table()
    mu = np.arange(128, dtype=np.int64)
    for e in exponents:
        top = (e << 7) | mu
        top = top[top <= 0x7F7F]  # finite maxima only
        whole = e in (20, 21, 127, 254)  # every value of the block, down to zero
        d = np.arange(int(top.min()) + 1 if whole else blockquant.SPAN + 256)
        magnitude = top[:, None] - d[None, :]
        for sign in (0, 0x8000):
            bits = (magnitude | sign).astype(np.uint16)
            want = _rule(bits, top[:, None])
            got = table[_index(top[:, None], bits)]
            bad = np.argwhere(got != want)
            assert bad.size == 0, [(e, int(top[i]), hex(int(bits[i, j]))) for i, j in bad[:5]]


def test_past_the_span_every_value_rounds_to_a_signed_zero() -> None:
    top = np.arange(blockquant.FAST_LOWEST, 0x7F80, 7, dtype=np.int64)
    bits = np.maximum(top - blockquant.SPAN, 0).astype(np.uint16)
    assert (_rule(bits, top) == 0).all()
    assert (_rule(bits | np.uint16(0x8000), top) == 0x80).all()


def test_one_binade_lower_the_table_would_be_wrong() -> None:
    """Why ``FAST_LOWEST`` is where it is: with maxima of exponent field 19 some values are bf16 subnormals
    within ``SPAN`` of the maximum, and their bytes are no longer the table's."""
    top = ((blockquant.FAST_LOWEST >> 7) - 1) << 7 | np.arange(128, dtype=np.int64)
    bits = (top[:, None] - np.arange(int(top.min()) + 1)[None, :]).astype(np.uint16)
    assert (blockquant.table()[_index(top[:, None], bits)] != _rule(bits, top[:, None])).any()


def _bf16_weight(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """bf16 bits of a weight that reaches every kind of value: wide exponents, zeros, -0, subnormals."""
    w = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-30, 30, shape)).astype(np.float32)
    bits = (w.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    special = rng.random(shape)
    bits[special < 0.02] = 0
    bits[(special >= 0.02) & (special < 0.04)] = 0x8000
    bits[(special >= 0.04) & (special < 0.05)] = rng.integers(
        1, 0x80, int(((special >= 0.04) & (special < 0.05)).sum())
    )
    return bits


def test_quantize_bf16_edges_tiny_blocks_and_column_boxes() -> None:
    rng = np.random.default_rng(3)
    bits = _bf16_weight(rng, (300, 260))
    bits[128:256, 256:260] = 0x8000  # a partial block of -0.0 only: its maximum is 0
    tiny = rng.integers(0, blockquant.FAST_LOWEST, (44, 128)).astype(np.uint16)
    bits[256:300, :128] = tiny | (bits[256:300, :128] & np.uint16(0x8000))  # below what the table serves
    k, j, b = 3, 3, 128
    magnitude = np.zeros((k * b, j * b), dtype=np.uint16)
    magnitude[:300, :260] = bits & 0x7FFF
    top = magnitude.reshape(k, b, j, b).max(axis=(1, 3))
    assert top[1, 2] == 0 and 0 < top[2, 0] < blockquant.FAST_LOWEST and (top >= blockquant.FAST_LOWEST).sum() == 7
    out = np.full((k * b, j * b), 0x55, dtype=np.uint8)
    blockquant.quantize_bf16(out, bits, top)
    want = _rule(bits, np.repeat(np.repeat(top, b, 0), b, 1)[:300, :260])
    assert (out[:300, :260] == want).all()
    assert (out[300:] == 0x55).all() and (out[:, 260:] == 0x55).all()  # past the edges: untouched
    box = np.zeros((k * b, b), dtype=np.uint8)
    blockquant.quantize_bf16(box, bits[:, 128:256], top[:, 1:2])  # a strided column box
    assert (box[:300] == want[:, 128:256]).all()


def _quantized(bits: np.ndarray, scales: bool, memo: blockquant.ScaleMemo) -> dequant.Quantized:
    kind = QUANTIZE_SCALE if scales else QUANTIZE
    source = QuantizedSource("m", "w", kind, "w", "m", "w_scale_inv", (128, 128))
    return dequant.Quantized(source, bits, scales, memo)


@pytest.mark.parametrize("scales_first", [True, False])
def test_quantized_weights_with_every_kind_of_block(scales_first: bool) -> None:
    """Blocks the table serves beside an all-zero block, one of -0.0 only and tiny ones (float32 path)."""
    rng = np.random.default_rng(5)
    bits = _bf16_weight(rng, (520, 400))
    bits[:128, :128] = 0
    bits[:128, 128:256] = 0x8000
    bits[128:256, :128] = rng.integers(0, 0x0A00, (128, 128))  # maxima below 2 ** -107
    bits[256:384, 256:384] = rng.integers(0x7F00, 0x7F80, (128, 128))  # near the largest bf16
    memo = blockquant.ScaleMemo()
    values, scale = _quantized(bits, False, memo), _quantized(bits, True, memo)
    first, second = (scale, values) if scales_first else (values, scale)
    got = {id(first): first[:, :], id(second): second[:, :]}
    magnitude = np.zeros((640, 512), dtype=np.uint16)
    magnitude[:520, :400] = bits & 0x7FFF
    top = magnitude.reshape(5, 128, 4, 128).max(axis=(1, 3))
    want = _rule(bits, np.repeat(np.repeat(top, 128, 0), 128, 1)[:520, :400])
    assert (got[id(values)] == want).all()
    amax = (top.astype(np.uint32) << np.uint32(16)).view(np.float32)
    want_scale = np.where(amax == 0, np.float32(1), amax / np.float32(448))
    assert got[id(scale)].tobytes() == want_scale.astype(np.float32).tobytes()
    assert (values[100:300, 50:390] == want[100:300, 50:390]).all()  # a box inside: whole blocks computed


def test_float32_weights_take_the_literal_rule() -> None:
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((300, 200)) * np.exp2(rng.integers(-20, 20, (300, 200)))).astype(np.float32)
    w[:128, :128] = 0
    memo = blockquant.ScaleMemo()
    got, scale = _quantized(w, False, memo)[:, :], _quantized(w, True, memo)[:, :]
    padded = np.zeros((384, 256), dtype=np.float32)
    padded[:300, :200] = np.abs(w)
    amax = padded.reshape(3, 128, 2, 128).max(axis=(1, 3))
    want_scale = np.where(amax == 0, np.float32(1), amax / np.float32(448)).astype(np.float32)
    full = np.repeat(np.repeat(want_scale, 128, 0), 128, 1)[:300, :200]
    assert scale.tobytes() == want_scale.tobytes()
    assert (got == np.clip(w / full, -448, 448).astype(F8).view(np.uint8)).all()


@pytest.mark.parametrize("contiguous", [True, False])
def test_block_maxima_of_bf16_bits_are_the_largest_magnitudes(contiguous: bool) -> None:
    """``blockquant.bits_amax`` (two reductions on whole contiguous blocks, else the sign cleared first) against
    ``max(abs(float32))``: blocks all negative, all positive, of zeros and ``-0.0``, mixed, and NaN."""
    rng = np.random.default_rng(7)
    values = rng.standard_normal((4 * 8, 3 * 16)).astype(np.float32)
    values[:8, :16] = -np.abs(values[:8, :16])  # only negative values
    values[8:16, :16] = np.abs(values[8:16, :16])  # only positive values
    values[16:24, :16] = -0.0
    values[24:32, 16:32] = 0.0
    values[24, 40] = np.nan
    values[3, 20] = -1e30  # a negative magnitude above every positive one of its block
    bits = (values.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    if not contiguous:
        wide = np.zeros((bits.shape[0], bits.shape[1] + 5), dtype=np.uint16)
        wide[:, :-5] = bits
        bits = wide[:, :-5]
    got = blockquant.bits_amax(bits, (4, 3), (8, 16))
    widened = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    want = np.abs(widened).reshape(4, 8, 3, 16).max(axis=(1, 3))
    assert np.isnan(got[3, 2]) and np.isnan(want[3, 2])
    got[3, 2] = want[3, 2] = 0
    assert got.tobytes() == want.tobytes()


def test_quantized_boxes_are_whole_block_rows_computed_once_into_the_staging(tmp_path, monkeypatch) -> None:
    """Row blocks of a ``--quantize`` weight are whole block rows (``dequant.row_alignment``): each block row is
    computed once, straight into the executor's staging (``Quantized.fill_box``), whatever the memory bound
    makes of the row block; the bytes are those of a run with memory to spare."""
    import json

    from reshard import api
    from reshard.execute.options import RunOptions
    from reshard.formats.safetensors import save_safetensors
    from reshard.plan.quantized import Precision

    rng = np.random.default_rng(11)
    weight = "model.layers.0.mlp.down_proj.weight"
    src = tmp_path / "bf16"
    src.mkdir()
    bf16 = (rng.standard_normal((1024, 384)) * 0.02).astype(ml_dtypes.bfloat16)
    save_safetensors(src / "model.safetensors", {weight: bf16}, {"format": "pt"})
    (src / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    precision = api.TensorOptions(precision=Precision(quantize="fp8-block"))
    hf = api.OutputSpec(format="hf")
    api.transform(str(src), str(tmp_path / "roomy"), output=hf, tensors=precision)
    rows: list[int] = []
    filled: list[tuple[bool, bool]] = []  # (a scale tensor's box, filled in place)
    real_quantize, real_fill = blockquant.quantize_bf16, dequant.Quantized.fill_box
    monkeypatch.setattr(
        blockquant, "quantize_bf16", lambda out, bits, top: (rows.append(bits.shape[0]), real_quantize(out, bits, top))
    )

    def fill(self: dequant.Quantized, box: tuple[slice, ...], dst: np.ndarray) -> bool:
        filled.append((self.scales, real_fill(self, box, dst)))
        return filled[-1][1]

    monkeypatch.setattr(dequant.Quantized, "fill_box", fill)
    # 3.7 MB: a row block of ~300 F8 rows before alignment, 256 after (two block rows)
    api.transform(
        str(src), str(tmp_path / "tight"), output=hf, tensors=precision, run=RunOptions(workers=1, max_memory=3_700_000)
    )
    assert sum(rows) == 1024  # the values pass: every row once (the scale pass took the maxima from the memo)
    values = [done for scales, done in filled if not scales]
    assert values and all(values)  # every values box in place; a scale tensor's box is copied
    made = (tmp_path / "tight" / "model.safetensors").read_bytes()
    assert made == (tmp_path / "roomy" / "model.safetensors").read_bytes()
