"""MindFormers 2.x "Checkpoint 2.0": its file names and the text files that describe a save.

A Checkpoint 2.0 (docs/formats.md §10) is ``ROOT/iteration_{n:08d}/`` holding per rank
``[prefix-]model-{rank:07d}-{world:07d}.safetensors`` and ``[prefix-]opt-…`` (MindSpore
safetensors), ``metadata.json`` (every tensor's layout and which file holds which block),
``common.json`` (training counters), and ``ROOT/latest_checkpointed_iteration.txt``, the tracker
MindFormers writes last as its completion marker. This module knows those names and writes the
three texts exactly as MindFormers 2.1.0 does (key order, separators, indentation), from plain
values: what each rank holds is decided by ``reshard.plan.checkpoint2``; the slice ids come from
``reshard.layout.slices``.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reshard.dtypes import DType
from reshard.errors import UsageError
from reshard.layout import ParamLayout
from reshard.layout.slices import alias_names, axis_fragmentations, replica_ids, slice_ids

CHECKPOINT2 = "checkpoint2"  # the output format's name (``--output-format checkpoint2``)
TRACKER_NAME = "latest_checkpointed_iteration.txt"
METADATA_NAME = "metadata.json"
COMMON_NAME = "common.json"
MODEL = "model"
OPTIMIZER = "opt"
DEFAULT_ITERATION = 0

# common.json's keys in MindFormers' order (its ``CommonInfo`` dataclass) and the types each takes.
COMMON_KEYS: tuple[str, ...] = (
    "epoch_num",
    "step_num",
    "global_step",
    "loss_scale",
    "global_batch_size",
    "consumed_samples",
    "ckpt_status",
)
_FLOAT_KEYS = frozenset({"loss_scale"})


def iteration_dir(root: str, iteration: int) -> str:
    """``ROOT/iteration_{n:08d}``."""
    return os.path.join(root, f"iteration_{iteration:08d}")


def file_name(kind: str, rank: int, world: int, prefix: str = "") -> str:
    """``[prefix-]{kind}-{rank:07d}-{world:07d}.safetensors`` (``kind``: ``model`` or ``opt``)."""
    head = f"{prefix}-" if prefix else ""
    return f"{head}{kind}-{rank:07d}-{world:07d}.safetensors"


def check_iteration(iteration: object) -> int:
    """``iteration`` as a non-negative int, or ``UsageError``."""
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise UsageError(f"the iteration must be a non-negative integer, not {iteration!r}")
    return iteration


def tracker_text(iteration: int) -> str:
    """The tracker's content: the iteration number, no newline (as MindFormers writes it)."""
    return str(iteration)


def check_common(common: Mapping[str, object] | None) -> dict[str, object]:
    """``common.json``'s values: the seven keys in MindFormers' order, None where not given.

    Args:
        common: Given values (None: all unknown). Keys outside the seven are refused (MindFormers'
            loader would fail on them); integers for the counters, a number for ``loss_scale``.

    Returns:
        The complete mapping, in order.

    Raises:
        UsageError: An unknown key or a value of the wrong type.

    Example:
        from reshard.formats.checkpoint2 import check_common
        assert check_common({"global_step": 10})["global_step"] == 10
    """
    given = dict(common or {})
    unknown = sorted(set(given) - set(COMMON_KEYS))
    if unknown:
        raise UsageError(f"common.json has no key(s) {', '.join(unknown)} (MindFormers knows {', '.join(COMMON_KEYS)})")
    for key, value in given.items():
        if value is None:
            continue
        number = (int, float) if key in _FLOAT_KEYS else (int,)
        if isinstance(value, bool) or not isinstance(value, number):
            kind = "a number" if key in _FLOAT_KEYS else "an integer"
            raise UsageError(f"common.json's {key} must be {kind} or null, not {value!r}")
    return {key: given.get(key) for key in COMMON_KEYS}


def common_text(common: Mapping[str, object] | None) -> str:
    """``common.json`` as MindFormers writes it (``json.dumps(..., indent=4)``, no newline at the end)."""
    return json.dumps(check_common(common), ensure_ascii=False, indent=4)


# --------------------------------------------------------------------------------------------
# metadata.json


@dataclass(frozen=True)
class TensorFacts:
    """One tensor of the checkpoint: dtype, global shape, and its layout over ``rank_list`` (None: full)."""

    dtype: DType
    global_shape: tuple[int, ...]
    layout: ParamLayout | None
    rank_list: tuple[int, ...] = (0,)

    @functools.cached_property
    def _ids(self) -> tuple[int, ...]:
        return slice_ids(self.layout) if self.layout is not None else ()

    def slice_of(self, rank: int) -> int:
        """The slice id of global ``rank``'s block (0 for a full tensor)."""
        if self.layout is None:
            return 0
        position = rank - self.rank_list[0]  # a layout's rank list is its stage's consecutive ranks
        if not 0 <= position < len(self.rank_list) or self.rank_list[position] != rank:
            position = self.rank_list.index(rank)
        return self._ids[position]

    @functools.cached_property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of one rank's block."""
        if self.layout is None:
            return self.global_shape
        return tuple(s // k for s, k in zip(self.global_shape, axis_fragmentations(self.layout), strict=True))


def layout_json(layout: ParamLayout, rank_list: Sequence[int]) -> dict[str, Any]:
    """MindSpore's ``Layout.to_dict()`` of ``layout`` over ``rank_list``, keys in its order.

    The order matters: MindFormers' ``_deserialize_sharded_tensor_layout`` unpacks ``.values()``.
    Alias names are ``alias_names``'s (a strategy file carries none). A dimension split over several
    axes is a list; a one-axis list (how a Layout-API strategy file stores every dimension) is
    written as that one number, as ``Layout.to_dict()`` writes a plain alias.
    """
    tensor_map = [(e[0] if len(e) == 1 else list(e)) if isinstance(e, tuple) else e for e in layout.tensor_map]
    return {
        "device_matrix": list(layout.dev_matrix),
        "tensor_map": tensor_map,
        "interleaved_parallel": False,
        "alias_name": list(alias_names(layout.dev_matrix)),
        "rank_list": list(rank_list),
    }


def shard_key(name: str, slice_id: int) -> str:
    """``storage_data``'s key: the Python repr of ``(name, (slice_id,))`` (``get_sharded_tensor_shard_id``)."""
    return str((name, (slice_id,)))


def metadata_text(
    facts: Mapping[str, TensorFacts],
    holdings: Sequence[tuple[int, Sequence[str]]],
    file_of: Mapping[tuple[int, str], str],
) -> str:
    """``metadata.json`` for the given tensors as MindFormers 2.1.0's ``save_metadata`` writes it.

    Args:
        facts: Every tensor's facts, by name.
        holdings: Per rank, in rank order, the names its files hold, in its order.
        file_of: (rank, name) -> the file name holding it.

    Returns:
        The compact JSON text: ``state_dict_metadata`` (tensors in first-appearance order over
        ranks, each chunk once) then ``storage_data`` (one key per (name, slice), every holding
        rank in order, ``rank_group`` the ranks holding that slice).

    Example:
        from reshard import dtypes
        from reshard.formats.checkpoint2 import TensorFacts, metadata_text
        facts = {"w": TensorFacts(dtypes.FLOAT32, (4,), None)}
        text = metadata_text(facts, [(0, ["w"])], {(0, "w"): "model-0000000-0000001.safetensors"})
    """
    groups: dict[tuple[str, int], list[int]] = {}
    slices = [[facts[name].slice_of(rank) for name in names] for rank, names in holdings]
    for (rank, names), ids in zip(holdings, slices, strict=True):
        for name, slice_id in zip(names, ids, strict=True):
            groups.setdefault((name, slice_id), []).append(rank)
    state: dict[str, Any] = {}
    chunks: dict[str, set[int]] = {}
    storage: dict[str, list[dict[str, Any]]] = {}
    for (rank, names), ids in zip(holdings, slices, strict=True):
        for name, slice_id in zip(names, ids, strict=True):
            f = facts[name]
            entry = state.get(name)
            if entry is None:
                entry = state[name] = _tensor_entry(f)
                chunks[name] = set()
            if slice_id not in chunks[name]:
                chunks[name].add(slice_id)
                entry["chunk"].append({"global_offset": [slice_id], "local_shape": list(f.local_shape)})
            record = {"file_name": file_of[(rank, name)], "storage_rank": rank, "rank_group": groups[(name, slice_id)]}
            storage.setdefault(shard_key(name, slice_id), []).append(record)
    return json.dumps(
        {"state_dict_metadata": state, "storage_data": storage}, ensure_ascii=False, separators=(",", ":")
    )


def _tensor_entry(f: TensorFacts) -> dict[str, Any]:
    layout = f.layout
    return {
        "properties": {
            "dtype": f.dtype.ms_name,
            "replica_id": list(replica_ids(layout)) if layout is not None else 0,
            "allow_shape_mismatch": False,
            "allow_to_save": True,
        },
        "global_shape": list(f.global_shape),
        "axis_fragmentations": list(axis_fragmentations(layout)) if layout is not None else [1] * len(f.global_shape),
        "layout": layout_json(layout, f.rank_list) if layout is not None else None,
        "chunk": [],
    }


def global_shape(layout: ParamLayout | None, local: Sequence[int]) -> tuple[int, ...]:
    """The full shape of a tensor whose rank block is ``local`` under ``layout`` (None: ``local``)."""
    if layout is None:
        return tuple(local)
    return tuple(s * k for s, k in zip(local, axis_fragmentations(layout), strict=True))


__all__ = [
    "CHECKPOINT2",
    "COMMON_KEYS",
    "COMMON_NAME",
    "DEFAULT_ITERATION",
    "METADATA_NAME",
    "MODEL",
    "OPTIMIZER",
    "TRACKER_NAME",
    "TensorFacts",
    "check_common",
    "check_iteration",
    "common_text",
    "file_name",
    "global_shape",
    "iteration_dir",
    "layout_json",
    "metadata_text",
    "shard_key",
    "tracker_text",
]
