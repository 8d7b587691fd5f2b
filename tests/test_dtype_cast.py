"""--dtype casts element by element exactly as numpy/ml_dtypes ``astype``; overflow to inf is refused.

The cast happens in ``assemble.copy_boxes`` (the one assembly function the executor, verify and the
drop-in share). Random bit patterns cover every class of value: subnormals, NaN, infinities, and the
neighbourhood of the target's largest finite value (where round-to-nearest-even decides between the
maximum and infinity). Which entries a cast touches is ``reshard.plan.cast.Cast.dtype_of``.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from reshard import dtypes
from reshard.errors import UsageError
from reshard.execute import assemble
from reshard.plan import Copy, SourceFile, SourceTensor, TensorPlan
from reshard.plan.cast import Cast, cast_files, cast_rule

FLOATS = {"fp32": np.float32, "bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp64": np.float64}
TARGETS = ("fp32", "bf16", "fp16")
PAIRS = [(s, t) for s in FLOATS for t in TARGETS if s != t]
BITS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _whole(dtype: np.dtype, shape: tuple[int, ...]) -> TensorPlan:
    zeros = (0,) * len(shape)
    d = dtypes.from_numpy(dtype)
    return TensorPlan("w", d, shape, (Copy(0, "w", zeros, zeros, shape, True),), math.prod(shape) * d.itemsize)


def _cast(src: np.ndarray, target: np.dtype) -> np.ndarray:
    out = np.empty(src.shape, dtype=target)
    assemble.copy_boxes(out, _whole(target, src.shape), 0, lambda _s, _n: src)
    return out


def _expected(src: np.ndarray, target: np.dtype) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return src.astype(target)


def _raw(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(BITS[a.dtype.itemsize])


def _near_max(target: np.dtype) -> list[float]:
    """Values around the target's largest finite value: at, one ulp below, just under and at half an
    ulp above (ties to even: infinity), one ulp above, and their negatives."""
    top = float(ml_dtypes.finfo(target).max)
    ulp = float(ml_dtypes.finfo(target).eps) * 2.0 ** float(np.floor(np.log2(top)))
    near = [top, top - ulp, top + ulp / 2 * 0.999, top + ulp / 2, top + ulp]
    return near + [-v for v in near]


@st.composite
def source_arrays(draw: st.DrawFn, source: str, target: str) -> np.ndarray:
    """Any bit pattern of the source dtype, mixed with values near the target's maximum."""
    np_src = np.dtype(FLOATS[source])
    bits = draw(arrays(BITS[np_src.itemsize], st.integers(1, 48)))
    values = bits.view(np_src).copy()
    extra = [v for v in _near_max(np.dtype(FLOATS[target])) if abs(v) <= float(ml_dtypes.finfo(np_src).max)]
    picks = draw(st.lists(st.sampled_from(extra), max_size=4)) if extra else []
    for i, v in enumerate(picks[: values.size]):
        values[i] = np.array(v, dtype=np.float64).astype(np_src)
    return values


@pytest.mark.parametrize(("source", "target"), PAIRS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_cast_equals_astype_element_by_element(source: str, target: str, data: st.DataObject) -> None:
    src = data.draw(source_arrays(source, target))
    to = np.dtype(FLOATS[target])
    expected = _expected(src, to)
    overflow = np.isfinite(src) & np.isinf(expected)
    if overflow.any():
        with pytest.raises(UsageError, match=r"^w: cast to \w+ overflows: largest magnitude"):
            _cast(src, to)
        src = np.where(overflow, np.zeros_like(src), src)  # the rest must still cast exactly
        expected = _expected(src, to)
    assert np.array_equal(_raw(_cast(src, to)), _raw(expected))


BF16_TIE = (2 - 2**-8) * 2.0**127  # bf16's maximum plus half an ulp
BOUNDARIES = [  # (source, target, largest value that rounds to the maximum, smallest that overflows)
    ("fp32", "fp16", 65519.0, 65520.0),
    ("fp32", "bf16", float(np.nextafter(np.float32(BF16_TIE), np.float32(0))), BF16_TIE),
    ("bf16", "fp16", 65280.0, 65536.0),
]


@pytest.mark.parametrize(("source", "target", "fits", "overflows"), BOUNDARIES)
def test_round_to_nearest_even_at_the_maximum(source: str, target: str, fits: float, overflows: float) -> None:
    """Half an ulp above the maximum rounds to infinity (ties to even): an error naming both values."""
    frm, to = np.dtype(FLOATS[source]), np.dtype(FLOATS[target])
    top = float(ml_dtypes.finfo(to).max)
    ok = np.array([fits, -fits], dtype=np.float64).astype(frm)
    assert float(ok[0]) == fits
    out = _cast(ok, to)
    assert np.array_equal(_raw(out), _raw(ok.astype(to))) and np.isfinite(out).all()
    bad = np.array([1.0, -overflows], dtype=np.float64).astype(frm)
    assert float(bad[1]) == -overflows and np.isinf(_expected(bad, to)[1])
    with pytest.raises(UsageError) as info:
        _cast(bad, to)
    message = str(info.value)
    assert message.startswith(f"w: cast to {dtypes.from_numpy(to).ms_name} overflows")
    assert f"largest magnitude {overflows:.6g}" in message and f"at most {top:.6g}" in message
    assert "\n" not in message


def test_source_infinities_and_nan_are_not_overflow() -> None:
    src = np.array([np.inf, -np.inf, np.nan, 1.0], dtype=np.float32)
    out = _cast(src, np.dtype(np.float16))
    assert np.isposinf(out[0]) and np.isneginf(out[1]) and np.isnan(out[2]) and out[3] == 1


def test_boxes_and_row_blocks_cast_too() -> None:
    """A tensor assembled from two column halves of two sources, in row blocks, equals astype."""
    rng = np.random.default_rng(0)
    left, right = rng.standard_normal((6, 3)).astype(np.float32), rng.standard_normal((6, 5)).astype(np.float32)
    bf16 = dtypes.BFLOAT16
    plan = TensorPlan(
        "w",
        bf16,
        (6, 8),
        (Copy(0, "w", (0, 0), (0, 0), (6, 3), True), Copy(1, "w", (0, 0), (0, 3), (6, 5), True)),
        6 * 8 * 2,
    )
    arrays_by_source = {0: left, 1: right}
    out = np.empty((6, 8), dtype=bf16.numpy)
    for r0 in range(0, 6, 4):  # two row blocks, as the executor stages them
        assemble.copy_boxes(out[r0 : r0 + 4], plan, r0, lambda s, _n: arrays_by_source[s])
    expected = np.concatenate([left, right], axis=1).astype(bf16.numpy)
    assert np.array_equal(_raw(out), _raw(expected))
    rows = assemble.tensor_rows(_whole(bf16.numpy, (6, 3)), 1, 4, lambda _s, _n: left)
    assert rows.dtype == bf16.numpy and np.array_equal(_raw(rows), _raw(left[1:4].astype(bf16.numpy)))


# ------------------------------------------------------------------------------------- which entries


@pytest.mark.parametrize(
    ("name", "dtype", "shape", "cast_default", "cast_all"),
    [
        ("model.w", dtypes.FLOAT32, (4, 4), True, True),
        ("model.norm", dtypes.FLOAT16, (4,), True, True),
        ("model.w64", dtypes.FLOAT64, (2,), True, True),
        ("adam_m.model.w", dtypes.FLOAT32, (4, 4), False, True),
        ("exp_avg_sq.model.w", dtypes.FLOAT32, (4,), False, True),
        ("global_step", dtypes.INT32, (1,), False, False),
        ("learning_rate", dtypes.FLOAT32, (), False, False),
        ("some_scalar", dtypes.FLOAT32, (), False, False),
        ("model.mask", dtypes.BOOL, (4,), False, False),
        ("model.ids", dtypes.INT64, (4,), False, False),
        ("model.q", dtypes.INT4, (4,), False, False),
        ("model.fp8", dtypes.FLOAT8_E4M3, (4,), False, False),
        ("model.scale", dtypes.FLOAT8_E8M0, (4,), False, False),
        ("model.c", dtypes.COMPLEX64, (4,), False, False),
        ("name", dtypes.STR, (0,), False, False),
    ],
)
def test_which_entries_are_cast(
    name: str, dtype: dtypes.DType, shape: tuple[int, ...], cast_default: bool, cast_all: bool
) -> None:
    for training_state, expected in ((False, cast_default), (True, cast_all)):
        cast = Cast(dtypes.BFLOAT16, training_state)
        assert (cast.dtype_of(name, dtype, shape) is dtypes.BFLOAT16) is expected, (name, training_state)


def test_cast_files_keeps_shared_tables_and_notes() -> None:
    shared = {
        "w": SourceTensor(dtypes.FLOAT32, (2, 3), 24),
        "adam_m.w": SourceTensor(dtypes.FLOAT32, (2, 3), 24),
        "global_step": SourceTensor(dtypes.INT32, (1,), 4),
    }
    files = {r: SourceFile(f"rank {r}", r, shared) for r in range(3)}
    notes: list[str] = []
    out = cast_files(files, cast_rule("bf16"), notes)
    assert out[0].tensors is out[2].tensors  # still one table
    assert out[1].tensors["w"] == SourceTensor(dtypes.BFLOAT16, (2, 3), 12)
    assert out[1].tensors["adam_m.w"] is shared["adam_m.w"] and out[1].tensors["global_step"] is shared["global_step"]
    assert notes == [
        "--dtype: 1 tensor(s) cast to BFloat16; kept 1 training-state tensor(s) as they are "
        "(--dtype-all casts them too)"
    ]
    assert cast_files(files, None) == files


def test_an_fp8_pairs_scale_is_not_cast() -> None:
    """A BF16 scale would round every dequantized value of its block: the pair stays as it is; a float
    named like a scale beside no FP8 weight is an ordinary float."""
    table = {
        "q.weight": SourceTensor(dtypes.FLOAT8_E4M3, (256, 256), 65536),
        "q.weight_scale_inv": SourceTensor(dtypes.FLOAT32, (2, 2), 16),
        "k.weight_scale_inv": SourceTensor(dtypes.FLOAT32, (2, 2), 16),
        "norm.weight": SourceTensor(dtypes.FLOAT32, (256,), 1024),
    }
    notes: list[str] = []
    out = cast_files({0: SourceFile("m.safetensors", 0, table)}, cast_rule("bf16"), notes)[0].tensors
    assert out["q.weight"] is table["q.weight"] and out["q.weight_scale_inv"] is table["q.weight_scale_inv"]
    assert out["k.weight_scale_inv"].dtype is dtypes.BFLOAT16 and out["norm.weight"].dtype is dtypes.BFLOAT16
    assert notes == [
        "--dtype: 2 tensor(s) cast to BFloat16; kept 1 float8 weight(s) and their block scales as they are (not cast)"
    ]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("bf16", dtypes.BFLOAT16),
        ("BFloat16", dtypes.BFLOAT16),
        ("bfloat16", dtypes.BFLOAT16),
        ("BF16", dtypes.BFLOAT16),
        ("fp16", dtypes.FLOAT16),
        ("float16", dtypes.FLOAT16),
        ("F16", dtypes.FLOAT16),
        ("fp32", dtypes.FLOAT32),
        ("Float32", dtypes.FLOAT32),
    ],
)
def test_dtype_names(name: str, expected: dtypes.DType) -> None:
    assert dtypes.cast_target(name) is expected


@pytest.mark.parametrize("name", ["fp8", "int8", "float64", "", "bf 16"])
def test_unknown_dtype_names_are_usage_errors(name: str) -> None:
    with pytest.raises(UsageError, match="choose bf16, fp16 or fp32"):
        cast_rule(name)


def test_dtype_all_needs_dtype() -> None:
    with pytest.raises(UsageError, match="--dtype-all needs --dtype"):
        cast_rule(None, dtype_all=True)
    assert cast_rule(None) is None
