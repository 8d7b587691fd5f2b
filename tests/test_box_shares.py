"""``plan.box_shares`` on numpy columns is the Python layout core: ``grid_shares`` (every share of a grid
class at once) equals ``plan.boxes.relative_share`` (one box at a time), and ``grid_index`` equals
``ChunkIndex``, on random uneven grids, shuffled chunk orders, replicas, empty chunks and empty and
absent destination boxes."""

from __future__ import annotations

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from reshard import dtypes
from reshard.errors import LayoutError
from reshard.layout.chunks import ChunkedTensor, ChunkIndex, grid_boxes
from reshard.plan.box_shares import grid_index, grid_shares
from reshard.plan.boxes import Share, relative_share


def _sizes(total: int, rng: random.Random) -> list[int]:
    """``total`` cut into random consecutive blocks (some maybe empty)."""
    cuts = sorted(rng.randint(0, total) for _ in range(rng.randint(0, 3)))
    edges = [0, *cuts, total]
    return [b - a for a, b in itertools.pairwise(edges)]


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    seed=st.integers(0, 2**32 - 1),
    outputs=st.integers(1, 6),
)
def test_grid_shares_are_relative_shares(shape: list[int], seed: int, outputs: int) -> None:
    rng = random.Random(seed)
    cells = [b for b in grid_boxes(shape, [_sizes(d, rng) for d in shape]) if all(a < z for a, z in b)]
    boxes = cells + [rng.choice(cells) for _ in range(rng.randint(0, 2))]  # replicas: the first is read
    rng.shuffle(boxes)
    tensor = ChunkedTensor("t", tuple(shape), dtypes.FLOAT32, tuple(boxes), tuple(f"f{k}" for k in range(len(boxes))))
    index = ChunkIndex(tensor)
    assert index.is_grid
    dst = []
    for _ in range(outputs):
        if rng.random() < 0.15:
            dst.append(None)
            continue
        box = []
        for d in shape:
            lo = rng.randint(0, d)
            box.append((lo, rng.randint(lo, d)))
        dst.append(tuple(box))
    got = grid_shares(index, dst)
    assert got is not None
    assert sorted(got) == [f for f, b in enumerate(dst) if b is not None]
    for f, box in enumerate(dst):
        if box is not None:
            assert Share(*got[f]) == relative_share(index, tensor.boxes, box), (f, box)


def test_no_grid_and_no_dimension_are_left_to_relative_share() -> None:
    scalar = ChunkedTensor("s", (), dtypes.FLOAT32, ((),), ("f",))
    assert grid_shares(ChunkIndex(scalar), [(), ()]) is None
    boxes = (((0, 2), (0, 4)), ((2, 4), (0, 1)), ((2, 4), (1, 4)))  # a tiling, not a grid of its cuts
    uneven = ChunkedTensor("u", (4, 4), dtypes.FLOAT32, boxes, ("a", "b", "c"))
    assert grid_shares(ChunkIndex(uneven), [((0, 4), (0, 4))]) is None


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(0, 9), min_size=1, max_size=3), seed=st.integers(0, 2**32 - 1))
def test_grid_index_is_chunk_index(shape: list[int], seed: int) -> None:
    """On columns, the same chunks read in the same order, the same cuts and cells; None where the
    Python index must check and say (a box outside, overlaps, no grid)."""
    rng = random.Random(seed)
    boxes = list(grid_boxes(shape, [_sizes(d, rng) for d in shape]))  # empty cells included
    boxes += [rng.choice(boxes) for _ in range(rng.randint(0, 2))]
    if rng.random() < 0.3:  # sometimes not a grid, or not even a tiling
        d = rng.randrange(len(shape))
        box = list(rng.choice(boxes))
        box[d] = (box[d][0], min(shape[d], box[d][1] + rng.randint(-1, 2)) if rng.random() < 0.8 else shape[d] + 1)
        boxes.append(tuple(box))
    rng.shuffle(boxes)
    tensor = ChunkedTensor("t", tuple(shape), dtypes.FLOAT32, tuple(boxes), tuple(f"f{k}" for k in range(len(boxes))))
    found = grid_index(tensor)
    try:
        index = ChunkIndex(tensor)
    except LayoutError:
        assert found is None
        return
    if found is None:
        assert not index.is_grid or not any(all(a < z for a, z in b) for b in boxes)
        return
    assert (found.used, found.boxes, found.grid) == (index.used, index.boxes, index.grid)
