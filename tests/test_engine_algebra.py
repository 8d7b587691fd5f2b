"""The tensor-surgery algebra (reshard.naming) against a naive numpy reference.

The reference materialises every input with ``arange`` and builds each output the obvious way
(``np.split`` / ``np.concatenate`` of reshaped groups / ``np.stack`` / indexing); the algebra's
answer is materialised by copying its pieces (through their views) into an empty output. They must
be equal element for element, and a map followed by its inverse must give back every input.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.errors import UnsupportedError, UsageError
from reshard.naming import (
    Derived,
    Join,
    ModelMap,
    Rename,
    Split,
    Stack,
    TensorInfo,
    Transpose,
    Unstack,
    apply,
    evaluate,
)


def arrays(catalogue: Mapping[str, TensorInfo]) -> dict[str, np.ndarray]:
    out, base = {}, 0
    for name, info in catalogue.items():
        n = math.prod(info.shape)
        out[name] = np.arange(base, base + n).reshape(info.shape)
        base += n
    return out


def materialise(d: Derived, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    out = np.full(d.shape, -1)
    seen = np.zeros(d.shape, dtype=int)
    for p in d.pieces:
        src = inputs[p.source]
        if p.view is not None:
            src = src.reshape(p.view)
        sbox = tuple(slice(s, s + n) for s, n in zip(p.src_start, p.src_lengths, strict=True))
        dbox = tuple(slice(s, s + n) for s, n in zip(p.dst_start, p.lengths, strict=True))
        out[dbox] = src[sbox] if p.perm is None else src[sbox].transpose(p.perm)
        seen[dbox] += 1
    assert (seen == 1).all(), f"{d.name}: pieces do not cover it exactly once"
    return out


def run(model_map: ModelMap, catalogue: Mapping[str, TensorInfo]) -> dict[str, np.ndarray]:
    inputs = arrays(catalogue)
    return {d.name: materialise(d, inputs) for d in apply(model_map, catalogue).outputs}


def info(*shape: int) -> TensorInfo:
    return TensorInfo(tuple(shape), "Float32")


# ------------------------------------------------------------------------------------------
# properties


@st.composite
def split_cases(draw: st.DrawFn) -> tuple[tuple[int, ...], int, list[int], int]:
    ndim = draw(st.integers(1, 3))
    axis = draw(st.integers(0, ndim - 1))
    groups = draw(st.integers(1, 3))
    parts = draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))
    sizes = [p * groups for p in parts]
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    shape[axis] = sum(sizes)
    return tuple(shape), axis, sizes, groups


def reference_split(x: np.ndarray, axis: int, sizes: list[int], groups: int) -> list[np.ndarray]:
    moved = np.moveaxis(x, axis, 0)
    grouped = moved.reshape(groups, moved.shape[0] // groups, *moved.shape[1:])
    cuts = np.cumsum([s // groups for s in sizes])[:-1]
    parts = np.split(grouped, cuts, axis=1)
    return [np.moveaxis(p.reshape(-1, *moved.shape[1:]), 0, axis) for p in parts]


@settings(max_examples=150, deadline=None)
@given(split_cases())
def test_split_matches_numpy(case: tuple[tuple[int, ...], int, list[int], int]) -> None:
    shape, axis, sizes, groups = case
    outputs = tuple(f"out.{k}" for k in range(len(sizes)))
    m = ModelMap((Split(r"fused", outputs, axis, tuple(sizes), groups),))
    got = run(m, {"fused": info(*shape)})
    want = reference_split(arrays({"fused": info(*shape)})["fused"], axis, sizes, groups)
    assert list(got) == list(outputs)
    for name, w in zip(outputs, want, strict=True):
        np.testing.assert_array_equal(got[name], w)


@settings(max_examples=150, deadline=None)
@given(split_cases())
def test_join_inverts_split(case: tuple[tuple[int, ...], int, list[int], int]) -> None:
    shape, axis, sizes, groups = case
    outputs = tuple(f"part{k}" for k in range(len(sizes)))
    split = ModelMap((Split(r"fused", outputs, axis, tuple(sizes), groups),))
    catalogue = {"fused": info(*shape)}
    parts = apply(split, catalogue).outputs
    join = ModelMap((Join(outputs, "fused", axis, groups),))
    inputs = run(split, catalogue)
    joined = apply(join, {d.name: TensorInfo(d.shape, d.dtype) for d in parts}).outputs
    assert [d.name for d in joined] == ["fused"]
    np.testing.assert_array_equal(materialise(joined[0], inputs), arrays(catalogue)["fused"])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=3), st.integers(1, 4), st.data())
def test_stack_and_unstack_match_numpy(shape: list[int], experts: int, data: st.DataObject) -> None:
    axis = data.draw(st.integers(0, len(shape) - 1))  # unstack refuses the last axis of the stacked tensor
    catalogue = {f"layer.experts.{e}.w": info(*shape) for e in range(experts)}
    stack = ModelMap((Stack(r"layer\.experts\.(?P<expert>\d+)\.w", "layer.experts.w", axis),))
    got = run(stack, catalogue)
    inputs = arrays(catalogue)
    want = np.stack([inputs[f"layer.experts.{e}.w"] for e in range(experts)], axis=axis)
    np.testing.assert_array_equal(got["layer.experts.w"], want)
    unstack = ModelMap((Unstack(r"layer\.experts\.w", "layer.experts.{expert}.w", axis),))
    back = run(unstack, {"layer.experts.w": info(*want.shape)})
    for e in range(experts):
        np.testing.assert_array_equal(
            back[f"layer.experts.{e}.w"], np.take(np.arange(want.size).reshape(want.shape), e, axis=axis)
        )


def test_interleaved_qkv_like_mindformers() -> None:
    """Megatron's interleaved QKV: per kv head [q (n_rep*head_dim), k (head_dim), v (head_dim)]."""
    heads, kv, dim, hidden = 4, 2, 3, 5
    config = {"num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": dim}
    catalogue = {
        "l.q": info(heads * dim, hidden),
        "l.k": info(kv * dim, hidden),
        "l.v": info(kv * dim, hidden),
    }
    join = ModelMap((Join((r"(.*)\.q", r"(.*)\.k", r"(.*)\.v"), r"\1.qkv", 0, "num_key_value_heads"),), config)
    got = run(join, catalogue)["l.qkv"]
    x = arrays(catalogue)
    n_rep = heads // kv
    want = np.concatenate(
        (x["l.q"].reshape(kv, n_rep * dim, -1), x["l.k"].reshape(kv, dim, -1), x["l.v"].reshape(kv, dim, -1)), axis=1
    ).reshape((n_rep + 2) * dim * kv, -1)
    np.testing.assert_array_equal(got, want)
    split = ModelMap(
        (
            Split(
                r"(.*)\.qkv",
                (r"\1.q", r"\1.k", r"\1.v"),
                0,
                ("num_attention_heads*head_dim", "num_key_value_heads*head_dim", -1),
                "num_key_value_heads",
            ),
        ),
        config,
    )
    inputs = {"l.qkv": want}
    for d in apply(split, {"l.qkv": info(*want.shape)}).outputs:
        np.testing.assert_array_equal(materialise(d, inputs), x[d.name])


# ------------------------------------------------------------------------------------------
# names and the report


def test_first_matching_op_wins_and_unmatched_are_kept() -> None:
    m = ModelMap((Rename(r"a\.(.*)", r"x.\1"), Rename(r"a\.b", "never"), Rename(r"c", "d")))
    out = apply(m, {"a.b": info(2), "keep": info(1), "c": info(3)})
    assert [d.name for d in out.outputs] == ["x.b", "keep", "d"]
    assert out.report.renamed == (("a.b", "x.b"), ("c", "d"))
    assert out.report.unmatched == ("keep",)


def test_two_inputs_to_one_output_name_both() -> None:
    with pytest.raises(UsageError, match=r"a\.1, a\.2 -> b"):
        apply(ModelMap((Rename(r"a\.\d", "b"),)), {"a.1": info(1), "a.2": info(1)})


def test_bad_inputs_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="bad regular expression"):
        apply(ModelMap((Rename("(", "x"),)), {"a": info(1)})
    with pytest.raises(UsageError, match="do not add up"):
        apply(ModelMap((Split("a", ("b", "c"), 0, (1, 1)),)), {"a": info(3)})
    with pytest.raises(UsageError, match="no tensor matches"):
        apply(ModelMap((Join(("(.)q", "(.)k"), r"\1qk", 0),)), {"aq": info(1)})
    with pytest.raises(UsageError, match=r"not 0\.\.1"):
        apply(ModelMap((Stack(r"e(?P<expert>\d)", "s"),)), {"e0": info(1), "e2": info(1)})
    with pytest.raises(UsageError, match="named group"):
        apply(ModelMap((Stack(r"e(\d)", "s"),)), {"e0": info(1)})
    with pytest.raises(UsageError, match="does not give"):
        apply(ModelMap((Split("a", ("b", "c"), 0, ("heads", -1)),)), {"a": info(3)})
    with pytest.raises(UnsupportedError, match="last axis"):
        apply(ModelMap((Unstack("a", "a{expert}", 1),)), {"a": info(2, 2)})


def test_expressions() -> None:
    assert evaluate("a*b + 2", {"a": 3, "b": 4}) == 14
    assert evaluate("(a+b)//2", {"a": 3, "b": 5}) == 4
    with pytest.raises(UsageError, match="not an integer"):
        evaluate("a/2", {"a": 3})
    with pytest.raises(UsageError, match="only integers"):
        evaluate("__import__('os')", {})


def test_model_config_files(tmp_path) -> None:
    from reshard.naming import load_config

    hf = tmp_path / "config.json"
    hf.write_text('{"num_attention_heads": 32, "head_dim": 128, "rope_scaling": {"factor": 8}}')
    assert load_config(str(hf))["num_attention_heads"] == 32 and load_config(str(hf))["factor"] == 8
    mf = tmp_path / "model.yaml"
    mf.write_text("model:\n  model_config:\n    num_heads: 8\n    hidden_size: 64\n")
    config = load_config(str(mf))
    assert evaluate("hidden_size//num_heads", config) == 8
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(UsageError, match="mapping"):
        load_config(str(bad))


@settings(max_examples=120, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=3), st.integers(1, 3), st.data())
def test_permuted_and_folded_stacks_match_numpy(shape: list[int], experts: int, data: st.DataObject) -> None:
    """MindFormers' grouped experts: each expert transposed, then stacked or concatenated (folded)."""
    perm = tuple(data.draw(st.permutations(range(len(shape)))))
    fold = data.draw(st.booleans())
    axis = data.draw(st.integers(0, len(shape) - 1 if fold else len(shape)))
    catalogue = {f"x.{e}.w": info(*shape) for e in range(experts)}
    stack = ModelMap((Stack(r"x\.(?P<expert>\d+)\.w", "s", axis, perm, fold),))
    got = run(stack, catalogue)["s"]
    inputs = arrays(catalogue)
    parts = [inputs[f"x.{e}.w"].transpose(perm) for e in range(experts)]
    want = np.concatenate(parts, axis) if fold else np.stack(parts, axis)
    np.testing.assert_array_equal(got, want)
    inverse = tuple(int(a) for a in np.argsort(perm))
    if fold:
        unstack = Unstack("s", "x.{expert}.w", axis, inverse, "n")
    elif axis < want.ndim - 1:
        unstack = Unstack("s", "x.{expert}.w", axis, inverse)
    else:
        return
    back = apply(ModelMap((unstack,), {"n": experts}), {"s": info(*want.shape)})
    for d in back.outputs:
        np.testing.assert_array_equal(materialise(d, {"s": want}), inputs[d.name])


def test_transpose() -> None:
    got = run(ModelMap((Transpose("w", "wt", (1, 0)),)), {"w": info(2, 3)})
    np.testing.assert_array_equal(got["wt"], np.arange(6).reshape(2, 3).T)
    with pytest.raises(UsageError, match="not a permutation"):
        apply(ModelMap((Transpose("w", "wt", (0, 0)),)), {"w": info(2, 3)})
