"""Slice ids and replica ids (``reshard.layout.slices``) against a naive enumeration, and the state-name rule."""

from __future__ import annotations

import itertools
import math
from typing import ClassVar

from hypothesis import given, settings
from hypothesis import strategies as st

from reshard import layout
from reshard.layout import ParamLayout
from reshard.layout.slices import (
    ModelParallelTable,
    alias_names,
    axis_fragmentations,
    model_parallel,
    replica_ids,
    slice_ids,
)
from reshard.statenames import DEFAULT, StateNames


@st.composite
def layouts(draw: st.DrawFn) -> ParamLayout:
    """Any valid layout: 1-4 device axes, 1-3 tensor dims, each axis unused or splitting one dim
    (several axes on one dim, in any order: a Layout-API list map)."""
    dev = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=4)))
    ndim = draw(st.integers(1, 3))
    entries: list[list[int]] = [[] for _ in range(ndim)]
    for axis in draw(st.permutations(range(len(dev)))):
        dim = draw(st.integers(-1, ndim - 1))
        if dim >= 0:
            entries[dim].append(len(dev) - 1 - axis)  # tensor maps count axes from the right
    as_lists = draw(st.booleans()) or any(len(e) > 1 for e in entries)
    if as_lists:
        tmap: tuple = tuple(tuple(e) if e else (-1,) for e in entries)
    else:
        tmap = tuple(e[0] if e else -1 for e in entries)
    return ParamLayout(dev, tmap)


def naive_ids(p: ParamLayout) -> tuple[list[int], list[int]]:
    """Slice ids by enumerating the block grid row-major and finding each rank's block in it."""
    frags = axis_fragmentations(p)
    full = tuple(2 * k for k in frags)
    local = tuple(s // k for s, k in zip(full, frags, strict=True))
    grid = list(itertools.product(*(range(k) for k in frags)))
    ids, replicas, seen = [], [], []
    for rank in range(math.prod(p.dev_matrix)):
        start = tuple(a for a, _ in layout.rank_box(p, full, rank))
        cell = tuple(a // n for a, n in zip(start, local, strict=True))
        ids.append(grid.index(cell))
        replicas.append(seen.count(cell))
        seen.append(cell)
    return ids, replicas


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_slice_ids_match_naive_enumeration(p: ParamLayout) -> None:
    ids, replicas = naive_ids(p)
    assert list(slice_ids(p)) == ids
    assert list(replica_ids(p)) == replicas
    assert set(ids) == set(range(math.prod(axis_fragmentations(p))))  # every block held by someone


def test_known_layouts() -> None:
    dp_tp = (2, 4)
    assert slice_ids(ParamLayout(dp_tp, (0, -1))) == (0, 1, 2, 3, 0, 1, 2, 3)
    assert replica_ids(ParamLayout(dp_tp, (0, -1))) == (0, 0, 0, 0, 1, 1, 1, 1)
    assert slice_ids(ParamLayout(dp_tp, ((1, 0), -1))) == tuple(range(8))  # dp major
    assert slice_ids(ParamLayout(dp_tp, ((0, 1), -1))) == (0, 2, 4, 6, 1, 3, 5, 7)  # tp major
    assert slice_ids(ParamLayout(dp_tp, (1, 0))) == tuple(range(8))
    assert slice_ids(ParamLayout(dp_tp, (0, 1))) == (0, 2, 4, 6, 1, 3, 5, 7)
    assert slice_ids(ParamLayout(dp_tp, (-1,))) == (0,) * 8 and replica_ids(ParamLayout(dp_tp, (-1,))) == tuple(
        range(8)
    )


def test_optimizer_shard_is_ignored() -> None:
    sharded = ParamLayout((2, 4), (0, -1), 4, 2)
    assert model_parallel(sharded) == ParamLayout((2, 4), (0, -1))
    assert slice_ids(sharded) == slice_ids(model_parallel(sharded))
    assert axis_fragmentations(sharded) == (4, 1)

    class Table:
        path = "s.ckpt"
        layouts: ClassVar[dict[str, ParamLayout]] = {"w": sharded}

    table = ModelParallelTable(Table())
    assert table.layouts == {"w": ParamLayout((2, 4), (0, -1))} and table.path == "s.ckpt"


def test_alias_names_follow_tensor_map_values() -> None:
    assert alias_names((2, 4)) == ("axis1", "axis0")
    assert alias_names((8,)) == ("axis0",)
    assert len(set(alias_names((1, 1, 1, 1)))) == 4  # unique, as mindspore.parallel.Layout demands


def test_state_names() -> None:
    for name in ("adam_m.w", "adam_v.w", "accu_grads.w", "global_step", "learning_rate", "beta1_power", "muon_m.w"):
        assert DEFAULT.is_state(name), name
    for name in ("w", "model.adam_m", "global_step_embedding", "learning_rate_scale.weight"):
        assert not DEFAULT.is_state(name), name
    rule = StateNames().with_prefixes(["ema.", ""])
    assert rule.is_state("ema.w") and not rule.is_state("w") and not DEFAULT.is_state("ema.w")


def test_completed_table_adds_states_in_every_stage() -> None:
    from reshard.layout import layout_map
    from reshard.layout.slices import CompletedTable, parameter_of

    emb = ParamLayout((2,), (0, -1))

    class Merged:
        path = None
        layouts: ClassVar[dict[str, ParamLayout]] = {"0-emb": emb, "1-emb": emb, "1-w": ParamLayout((2,), (-1, 0))}

    table = CompletedTable(Merged(), ("adam_m.emb", "adam_v.w", "adam_m.nothing", "emb"))
    assert list(table.layouts) == ["0-emb", "1-emb", "1-w", "0-adam_m.emb", "1-adam_m.emb", "1-adam_v.w"]
    assert layout_map(table)["adam_m.emb"].stages == (0, 1)
    assert parameter_of("adam_m.model.w", {"model.w": 1, "w": 2}) == "model.w"
    assert parameter_of("w", {"w": 1}) is None
