"""Experts with several parts (``Stack(parts=...)`` / ``Unstack(outputs=...)``): MindFormers' grouped ``weight1``.

MindFormers 2.1.0's training model keeps a layer's routed experts as ``weight1`` = per expert
``[gate.T | up.T]`` folded on axis 0 (``[experts*hidden, 2*moe_ffn]``) and ``weight2`` = per expert
``down.T`` (``[experts*moe_ffn, hidden]``). Checked against numpy written out the way MindFormers'
``concat_expert_weight`` reads (stack, transpose, reshape), and back.
"""

from __future__ import annotations

import numpy as np
import pytest

from reshard.errors import UnsupportedError, UsageError
from reshard.naming import ModelMap, Stack, TensorInfo, Unstack, apply
from tests.test_presets_models import materialize

E, HIDDEN, FFN = 3, 4, 5
GATE, UP, DOWN = (rf"l\.0\.experts\.(?P<expert>\d+)\.{x}\.weight" for x in ("gate", "up", "down"))
TO_MF = ModelMap(
    (
        Stack(GATE, "l.0.w1", axis=0, perm=(1, 0), fold=True, parts=(UP,), part_axis=1),
        Stack(DOWN, "l.0.w2", axis=0, perm=(1, 0), fold=True),
    )
)
FROM_MF = ModelMap(
    (
        Unstack(r"l\.0\.w1", "l.0.experts.{expert}.gate.weight", 0, (1, 0), "E", ("l.0.experts.{expert}.up.weight",)),
        Unstack(r"l\.0\.w2", "l.0.experts.{expert}.down.weight", 0, (1, 0), "E"),
    ),
    {"E": E},
)


def experts() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for e in range(E):
        out[f"l.0.experts.{e}.gate.weight"] = rng.standard_normal((FFN, HIDDEN)).astype(np.float32)
        out[f"l.0.experts.{e}.up.weight"] = rng.standard_normal((FFN, HIDDEN)).astype(np.float32)
        out[f"l.0.experts.{e}.down.weight"] = rng.standard_normal((HIDDEN, FFN)).astype(np.float32)
    return out


def test_grouped_experts_as_mindformers_lays_them_out_and_back():
    t = experts()
    mf, _ = materialize(TO_MF, t)
    fc1 = np.stack([np.concatenate([t[f"l.0.experts.{e}.{x}.weight"] for x in ("gate", "up")]) for e in range(E)])
    assert np.array_equal(mf["l.0.w1"], fc1.transpose(0, 2, 1).reshape(E * HIDDEN, 2 * FFN))
    down = np.stack([t[f"l.0.experts.{e}.down.weight"] for e in range(E)])
    assert np.array_equal(mf["l.0.w2"], down.transpose(0, 2, 1).reshape(E * FFN, HIDDEN))
    back, _ = materialize(FROM_MF, mf)
    assert sorted(back) == sorted(t) and all(back[n].tobytes() == t[n].tobytes() for n in t)


def test_a_missing_part_or_an_unfolded_stack_is_refused():
    catalogue = {n: TensorInfo(a.shape, "Float32") for n, a in experts().items()}
    del catalogue["l.0.experts.1.up.weight"]
    with pytest.raises(UsageError, match="expert 1 has no tensor matching"):
        apply(TO_MF, catalogue)
    unfolded = ModelMap((Stack(GATE, "l.0.w1", perm=(1, 0), parts=(UP,), part_axis=1),))
    with pytest.raises(UnsupportedError, match="fold=True"):
        apply(unfolded, {n: TensorInfo(a.shape, "Float32") for n, a in experts().items()})
    with pytest.raises(UsageError, match="not 2 equal parts"):
        apply(FROM_MF, {"l.0.w1": TensorInfo((E * HIDDEN, 2 * FFN + 1), "Float32")})
