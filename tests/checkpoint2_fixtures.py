"""Build MindFormers 2.x "Checkpoint 2.0" trees as MindFormers 2.1.0 writes them, without MindFormers.

The slice ids and replica ids are computed by a port of MindFormers' own algorithm
(``sharded_tensor._get_global_offset_and_replica_id_from_layout``: the tensor map flattened,
device axes strided right to left), independent of reshard's layout algebra, so a test that
reads these trees with reshard checks the two against each other. Key order, chunk order,
storage records (``rank_group`` = every rank holding the slice, in rank order) and file names
follow ``metadata.save_metadata`` / ``get_total_params_file_mapping_info``; a redundancy-removed
save follows ``fully_parallel`` (one writer per slice, files numbered among the writers).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from reshard.formats.safetensors import save_safetensors

MS_NAMES = {
    np.dtype(np.float32): "Float32",
    np.dtype(np.float16): "Float16",
    np.dtype(ml_dtypes.bfloat16): "BFloat16",
    np.dtype(np.int32): "Int32",
    np.dtype(np.int64): "Int64",
    np.dtype(np.bool_): "Bool",
}


@dataclass(frozen=True)
class Lay:
    """``Layout(device_matrix, alias_name, rank_list)(*tensor_map)`` as ``to_dict`` gives it."""

    device_matrix: tuple[int, ...]
    alias_name: tuple[str, ...]
    tensor_map: tuple[object, ...]  # ints, or lists of ints for a dim split over several axes
    rank_list: tuple[int, ...]

    def to_dict(self) -> dict[str, object]:
        tmap = [list(e) if isinstance(e, (list, tuple)) else e for e in self.tensor_map]
        return {
            "device_matrix": list(self.device_matrix),
            "tensor_map": tmap,
            "interleaved_parallel": False,
            "alias_name": list(self.alias_name),
            "rank_list": list(self.rank_list),
        }


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    dtype: object = np.float32
    layout: Lay | None = None
    optimizer: bool = False  # written to opt-… (a name outside the network's parameters)


def _values(entry: object) -> list[int]:
    return list(entry) if isinstance(entry, (list, tuple)) else [int(entry)]  # type: ignore[call-overload]


def _axis_size(lay: Lay, v: int) -> int:
    return 1 if v == -1 else lay.device_matrix[len(lay.device_matrix) - 1 - v]


def _axis_coord(lay: Lay, v: int, inner: int) -> int:
    if v == -1:
        return 0
    dev = lay.device_matrix
    return (inner // math.prod(dev[len(dev) - v :])) % dev[len(dev) - 1 - v]


def fragmentations(lay: Lay | None, ndim: int) -> tuple[int, ...]:
    if lay is None:
        return (1,) * ndim
    return tuple(math.prod(_axis_size(lay, v) for v in _values(e)) for e in lay.tensor_map)


def slice_and_replica_ids(lay: Lay) -> tuple[list[int], list[int]]:
    """Per inner rank: its slice id and replica id (MindFormers' algorithm, ported)."""
    flat = [v for e in lay.tensor_map for v in _values(e)]
    strides = [1] * len(flat)
    for p in range(len(flat) - 2, -1, -1):
        strides[p] = strides[p + 1] * _axis_size(lay, flat[p + 1])
    slices = [
        sum(s * _axis_coord(lay, v, j) for s, v in zip(strides, flat, strict=True)) for j in range(len(lay.rank_list))
    ]
    seen: dict[int, int] = {}
    replicas = []
    for s in slices:
        replicas.append(seen.get(s, 0))
        seen[s] = seen.get(s, 0) + 1
    return slices, replicas


def slice_block(full: np.ndarray, slice_id: int, frags: Sequence[int]) -> np.ndarray:
    coord = []
    rest = slice_id
    for f in reversed(frags):
        coord.append(rest % f)
        rest //= f
    coord.reverse()
    local = [d // f for d, f in zip(full.shape, frags, strict=True)]
    return full[tuple(slice(c * n, (c + 1) * n) for c, n in zip(coord, local, strict=True))]


def full_tensors(params: Sequence[Param], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for p in params:
        values = rng.standard_normal(p.shape) * 8
        out[p.name] = (
            values.astype(p.dtype) if np.dtype(p.dtype).kind == "f" else values.astype(np.int64).astype(p.dtype)
        )
    return out


COMMON = {
    "epoch_num": 1,
    "step_num": 10,
    "global_step": 10,
    "loss_scale": 1.0,
    "global_batch_size": 8,
    "consumed_samples": 80,
    "ckpt_status": 0,
}


def file_name(prefix: str | None, kind: str, number: int, total: int) -> str:
    stem = f"{kind}-{number:07d}-{total:07d}"
    return f"{prefix}-{stem}.safetensors" if prefix else f"{stem}.safetensors"


def write_checkpoint2(
    root: str,
    params: Sequence[Param],
    world: int,
    *,
    iteration: int = 10,
    prefix: str | None = None,
    remove_redundancy: bool = False,
    seed: int = 0,
    common: dict[str, object] | None = None,
    tracker: bool = True,
) -> dict[str, np.ndarray]:
    """Write ``root/iteration_{n:08d}/…`` and the tracker; return the full tensors."""
    full = full_tensors(params, seed)
    folder = os.path.join(root, f"iteration_{iteration:08d}")
    os.makedirs(folder, exist_ok=True)
    # per rank: name -> (slice id, local array); a rank holds a laid-out tensor if its rank_list has it
    held: dict[int, dict[str, tuple[int, np.ndarray]]] = {r: {} for r in range(world)}
    info: dict[str, tuple[tuple[int, ...], list[int], list[int] | int]] = {}
    for p in params:
        frags = fragmentations(p.layout, len(p.shape))
        if p.layout is None:
            info[p.name] = (frags, [0] * world, 0)
            for r in range(world):
                held[r][p.name] = (0, full[p.name])
            continue
        slices, replicas = slice_and_replica_ids(p.layout)
        info[p.name] = (frags, slices, replicas)
        for inner, r in enumerate(p.layout.rank_list):
            held[r][p.name] = (slices[inner], np.ascontiguousarray(slice_block(full[p.name], slices[inner], frags)))
    kinds = {p.name: "opt" if p.optimizer else "model" for p in params}
    groups: dict[tuple[str, int], list[int]] = {}
    for r in range(world):
        for name, (sid, _) in held[r].items():
            groups.setdefault((name, sid), []).append(r)
    # who writes what
    # a redundancy-removed save: one rank of each group writes the slice
    writer = {key: ranks[-1] for key, ranks in groups.items()} if remove_redundancy and world > 1 else None
    records: list[tuple[str, int, list[int], tuple[str, int]]] = []
    for kind in ("model", "opt"):
        writing = [
            r
            for r in range(world)
            if any(kinds[n] == kind and (writer is None or writer[(n, s)] == r) for n, (s, _) in held[r].items())
        ]
        total = len(writing) if writer is not None else world
        for k, r in enumerate(writing if writer is not None else range(world)):
            number = k if writer is not None else r
            tensors = {
                n: a for n, (s, a) in held[r].items() if kinds[n] == kind and (writer is None or writer[(n, s)] == r)
            }
            if not tensors:
                continue
            fname = file_name(prefix, kind, number, total)
            save_safetensors(os.path.join(folder, fname), tensors, {"format": "ms"})
            os.chmod(os.path.join(folder, fname), 0o400)
            for n, (s, _) in held[r].items():
                if n in tensors:
                    records.append((fname, r, groups[(n, s)], (n, s)))
    if world > 1:
        _write_metadata(folder, params, held, info, records, world)
    with open(os.path.join(folder, "common.json"), "w", encoding="utf-8") as fh:
        fh.write(json.dumps(common if common is not None else COMMON, ensure_ascii=False, indent=4))
    if tracker:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w", encoding="utf-8") as fh:
            fh.write(str(iteration))
    for name in ("common.json", "metadata.json"):
        if os.path.exists(os.path.join(folder, name)):
            os.chmod(os.path.join(folder, name), 0o640)
    os.chmod(folder, 0o750)
    return full


def _write_metadata(folder, params, held, info, records, world) -> None:  # type: ignore[no-untyped-def]
    by_name = {p.name: p for p in params}
    state: dict[str, dict[str, object]] = {}
    seen: dict[str, set[tuple[int, tuple[int, ...]]]] = {}
    for r in range(world):
        for name, (sid, arr) in held[r].items():
            p = by_name[name]
            frags, _, replicas = info[name]
            chunk = {"global_offset": [sid], "local_shape": list(arr.shape)}
            key = (sid, tuple(arr.shape))
            if name not in state:
                state[name] = {
                    "properties": {
                        "dtype": MS_NAMES[np.dtype(p.dtype)],
                        "replica_id": replicas,
                        "allow_shape_mismatch": False,
                        "allow_to_save": True,
                    },
                    "global_shape": list(p.shape),
                    "axis_fragmentations": list(frags),
                    "layout": p.layout.to_dict() if p.layout is not None else None,
                    "chunk": [chunk],
                }
                seen[name] = {key}
            elif key not in seen[name]:
                seen[name].add(key)
                state[name]["chunk"].append(chunk)  # type: ignore[attr-defined]
    storage: dict[str, list[dict[str, object]]] = {}
    for fname, rank, group, (name, sid) in sorted(records, key=lambda rec: rec[1]):
        storage.setdefault(str((name, (sid,))), []).append(
            {"file_name": fname, "storage_rank": rank, "rank_group": list(group)}
        )
    text = json.dumps(
        {"state_dict_metadata": state, "storage_data": storage}, ensure_ascii=False, separators=(",", ":")
    )
    with open(os.path.join(folder, "metadata.json"), "w", encoding="utf-8") as fh:
        fh.write(text)


# ------------------------------------------------------------------------------------------
# the standard jobs

DP2_TP4 = ((2, 4), ("dp", "tp"))


def lay(tensor_map: Sequence[object], ranks: Sequence[int] = tuple(range(8)), dev=DP2_TP4) -> Lay:  # type: ignore[no-untyped-def]
    return Lay(dev[0], dev[1], tuple(tensor_map), tuple(ranks))


def dp2_tp4_params() -> list[Param]:
    """8 ranks, dp2 × tp4: row/column splits, a nested map [[1,0],-1], a replicated bf16 tensor,
    optimizer states with the parameters' layouts, and a layout-less scalar-like state."""
    emb = lay([0, -1])  # ("tp", "None")
    fc1 = lay([[1, 0], -1])  # (("dp","tp"), "None")
    proj = lay([-1, 0])  # ("None", "tp")
    norm = lay([-1])  # ("None",)
    return [
        Param("embedding.word_embeddings.weight", (16, 12), np.float32, emb),
        Param("decoder.layers.0.mlp.linear_fc1.weight", (32, 6), np.float32, fc1),
        Param("decoder.layers.0.self_attention.linear_proj.weight", (10, 16), np.float32, proj),
        Param("decoder.layers.0.input_layernorm.weight", (12,), ml_dtypes.bfloat16, norm),
        Param("adam_m.embedding.word_embeddings.weight", (16, 12), np.float32, emb, optimizer=True),
        Param("adam_v.decoder.layers.0.mlp.linear_fc1.weight", (32, 6), np.float32, fc1, optimizer=True),
        Param("adam_m.decoder.layers.0.input_layernorm.weight", (12,), np.float32, norm, optimizer=True),
        Param("global_step", (1,), np.int32, None, optimizer=True),
    ]


def pipeline_params() -> list[Param]:
    """8 ranks, 2 pipeline stages of dp1 × tp4 (ranks 0-3 and 4-7)."""
    dev = ((1, 4), ("dp", "tp"))
    s0, s1 = tuple(range(4)), tuple(range(4, 8))
    return [
        Param("embedding.word_embeddings.weight", (16, 8), np.float32, lay([0, -1], s0, dev)),
        Param("decoder.layers.0.mlp.linear_fc1.weight", (8, 12), np.float32, lay([-1, 0], s0, dev)),
        Param("decoder.layers.1.mlp.linear_fc1.weight", (8, 12), np.float32, lay([-1, 0], s1, dev)),
        Param("output_layer.weight", (16, 8), ml_dtypes.bfloat16, lay([0, -1], s1, dev)),
        Param("adam_m.output_layer.weight", (16, 8), np.float32, lay([0, -1], s1, dev), optimizer=True),
    ]


def single_card_params() -> list[Param]:
    return [
        Param("embedding.word_embeddings.weight", (16, 8), np.float32),
        Param("decoder.layers.0.mlp.linear_fc1.weight", (8, 12), ml_dtypes.bfloat16),
        Param("adam_m.embedding.word_embeddings.weight", (16, 8), np.float32, optimizer=True),
    ]


def mindformers_sample_params() -> list[Param]:
    """The network of a real MindFormers 2.1.0 save (8 ranks, Layout((2, 4), ("dp", "tp")), AdamW):
    for it this writer's metadata.json is byte-identical to the one MindFormers wrote."""
    f32 = np.float32
    trainable = [
        Param("embedding.word_embeddings.weight", (16, 8), f32, lay([0, -1])),
        Param("decoder.layers.0.linear_proj.weight", (8, 16), f32, lay([-1, 0])),
        Param("decoder.layers.0.linear_fc1.weight", (16, 8), f32, lay([[1, 0], -1])),
        Param("decoder.layers.0.dp_split.weight", (4, 6), f32, lay([1, -1])),
        Param("decoder.layers.0.input_layernorm.weight", (8,), ml_dtypes.bfloat16, lay([-1])),
    ]
    params = [
        *trainable,
        Param("decoder.layers.0.mask", (4, 4), np.bool_, lay([-1, 0])),
        Param("decoder.layers.0.position_ids", (8,), np.int32, lay([0])),
    ]
    for p in trainable:
        for state in ("adam_m", "adam_v"):
            params.append(Param(f"{state}.{p.name}", p.shape, f32, p.layout, optimizer=True))
    params += [
        Param("global_step", (1,), np.int32, None, optimizer=True),
        Param("learning_rate", (), f32, None, optimizer=True),
    ]
    return params
