"""MindFormers 2.1.0 as an oracle for Checkpoint 2.0: it writes trees and loads them into layouts.

The reshard package never imports MindSpore or MindFormers. This module (host side, numpy only)
describes a tiny network, generates its full tensors, cuts every rank's slice with numpy, and runs
``tests/oracle_scripts/mf_checkpoint2.py`` in the oracle venv (through ``tests.oracle.run_oracle``)
where MindFormers' own ``mindformers.checkpoint.checkpoint.save_checkpoint`` writes the tree (one
process, one save per rank) and MindFormers' own ``load_checkpoint`` (-> ``ReshardLoader``) loads a
tree into a destination layout for one rank. The patches MindFormers needs to run outside a
Trainer on CPU are listed at the top of that script; they live there and nowhere else.

Layouts are given per tensor as :class:`ParamSpec`: MindSpore ``Layout`` terms (device matrix,
alias names, a tensor map of alias names, ``"None"``, or a tuple of aliases for a dimension split
over several axes). :func:`spec_from_strategy` converts a strategy file's ``ParamLayout``
(tensor map counted from the right, -1 = none) into one. Every tensor's expected slice on a rank is
computed here with numpy (:func:`local_slice`), independently of MindFormers.

Example (one MindFormers subprocess per call; tests/test_mf_oracle_harness.py batches many saves
and loads into one with :func:`plan_save`, :func:`load_job` and :func:`run_jobs`)::

    full = make_checkpoint2(tmp / "cp2", DEFAULT_LAYOUTS, ranks=8)
    got = mindformers_load(tmp / "cp2", dp_tp_layouts(2, 2), rank=1, world=4)
    assert (got["decoder.layers.0.dp_split.weight"] == full["decoder.layers.0.dp_split.weight"][:2]).all()

``python -m tests.mindformers_oracle DIR [NAME ...]`` (with ``PYTHONPATH=src``) writes the trees
of :data:`SAMPLES` under DIR with their full tensors.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from tests.oracle import run_oracle

SCRIPT = Path(__file__).resolve().parent / "oracle_scripts" / "mf_checkpoint2.py"
DRIVER = '\nout([run_job(job) for job in ARGS["jobs"]])\n'  # ARGS, out(): tests.oracle.PRELUDE
NONE = "None"
LEARNING_RATE = 1e-3  # MindFormers AdamW's learning_rate in every save (a 0-d float32 state)
MapEntry = str | tuple[str, ...]

_NP_DTYPES: dict[str, Any] = {
    "float32": np.float32,
    "float16": np.float16,
    "float64": np.float64,
    "bfloat16": ml_dtypes.bfloat16,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
    "bool": np.bool_,
}


@dataclass(frozen=True)
class ParamSpec:
    """One tensor of the tiny network and its layout.

    ``tensor_map`` is None for a tensor without a layout (MindFormers writes ``"layout": null``);
    otherwise one entry per dimension: an alias name, ``"None"``, or a tuple of aliases.
    ``rank_list`` (default: every rank) restricts the tensor to a pipeline stage's ranks.
    """

    shape: tuple[int, ...]
    dtype: str = "float32"
    tensor_map: tuple[MapEntry, ...] | None = None
    device_matrix: tuple[int, ...] = (2, 4)
    alias_name: tuple[str, ...] = ("dp", "tp")
    trainable: bool = True
    rank_list: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        tensor_map = None
        if self.tensor_map is not None:
            tensor_map = [list(e) if isinstance(e, tuple) else e for e in self.tensor_map]
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "tensor_map": tensor_map,
            "device_matrix": list(self.device_matrix),
            "alias_name": list(self.alias_name),
            "trainable": self.trainable,
            "rank_list": list(self.rank_list) if self.rank_list is not None else None,
        }


def dp_tp_layouts(dp: int, tp: int) -> dict[str, ParamSpec]:
    """The default network laid out on a ``Layout((dp, tp), ("dp", "tp"))`` job."""
    dm = (dp, tp)
    return {
        "embedding.word_embeddings.weight": ParamSpec((16, 8), "float32", ("tp", NONE), dm),
        "decoder.layers.0.linear_proj.weight": ParamSpec((8, 16), "float32", (NONE, "tp"), dm),
        "decoder.layers.0.linear_fc1.weight": ParamSpec((16, 8), "float32", (("dp", "tp"), NONE), dm),
        "decoder.layers.0.dp_split.weight": ParamSpec((4, 6), "float32", ("dp", NONE), dm),
        "decoder.layers.0.input_layernorm.weight": ParamSpec((8,), "bfloat16", (NONE,), dm),
        "decoder.layers.0.mask": ParamSpec((4, 4), "bool", (NONE, "tp"), dm, trainable=False),
        "decoder.layers.0.position_ids": ParamSpec((8,), "int32", ("tp",), dm, trainable=False),
    }


DEFAULT_LAYOUTS = dp_tp_layouts(2, 4)


def pipeline_layouts() -> dict[str, ParamSpec]:
    """Two pipeline stages of 4 ranks each (ranks 0-3, 4-7), each stage ``Layout((2, 2), ("dp", "tp"))``."""
    dm = (2, 2)
    first, second = (0, 1, 2, 3), (4, 5, 6, 7)
    return {
        "embedding.word_embeddings.weight": ParamSpec((16, 8), "float32", ("tp", NONE), dm, rank_list=first),
        "decoder.layers.0.linear_fc1.weight": ParamSpec((16, 8), "float32", (("dp", "tp"), NONE), dm, rank_list=first),
        "decoder.layers.0.input_layernorm.weight": ParamSpec((8,), "bfloat16", (NONE,), dm, rank_list=first),
        "decoder.layers.1.linear_proj.weight": ParamSpec((8, 16), "float32", (NONE, "tp"), dm, rank_list=second),
        "decoder.layers.1.dp_split.weight": ParamSpec((4, 6), "float32", ("dp", NONE), dm, rank_list=second),
        "decoder.final_layernorm.weight": ParamSpec((8,), "bfloat16", (NONE,), dm, rank_list=second),
    }


def full_layouts(specs: Mapping[str, ParamSpec]) -> dict[str, ParamSpec]:
    """The same tensors without a layout (a single-card job)."""
    return {name: replace(s, tensor_map=None, device_matrix=(1,), alias_name=("dp",)) for name, s in specs.items()}


def spec_from_strategy(
    dev_matrix: Sequence[int], tensor_map: Sequence[int | Sequence[int]], shape: Sequence[int], dtype: str
) -> ParamSpec:
    """A strategy file's ParamLayout as a MindSpore Layout with alias names.

    Strategy tensor maps count device axes from the right (0 = last axis of ``dev_matrix``) and use
    -1 for "not split"; a dimension split over several axes is a sequence of such numbers. Axis
    ``i`` from the left gets the alias ``f"a{i}"``. A 0-d tensor gets no layout (MindFormers cannot
    slice a Layout with an empty tensor map).
    """
    if not shape:
        return ParamSpec((), dtype, None)
    aliases = tuple(f"a{i}" for i in range(len(dev_matrix)))

    def alias(axis: int) -> str:
        return NONE if axis == -1 else aliases[len(dev_matrix) - 1 - axis]

    entries: list[MapEntry] = []
    for entry in tensor_map:
        if isinstance(entry, int):
            entries.append(alias(entry))
        else:
            names = tuple(alias(a) for a in entry if a != -1)
            entries.append(names if len(names) > 1 else (names[0] if names else NONE))
    return ParamSpec(tuple(shape), dtype, tuple(entries), tuple(dev_matrix), aliases)


def optimizer_specs(specs: Mapping[str, ParamSpec]) -> dict[str, ParamSpec]:
    """MindFormers AdamW's states: fp32 ``adam_m.``/``adam_v.`` with the parameter's layout."""
    states: dict[str, ParamSpec] = {}
    for name, spec in specs.items():
        if spec.trainable:
            for prefix in ("adam_m", "adam_v"):
                states[f"{prefix}.{name}"] = replace(spec, dtype="float32", trainable=False)
    states["global_step"] = ParamSpec((1,), "int32", None, trainable=False)
    # AdamW's learning_rate: a 0-d Parameter (the optimizer's own value is saved, see full_tensors).
    states["learning_rate"] = ParamSpec((), "float32", None, trainable=False)
    return states


def sample(spec: ParamSpec, rng: np.random.Generator) -> np.ndarray:
    """Values exactly representable in the tensor's dtype, different everywhere."""
    np_type = _NP_DTYPES[spec.dtype]
    if spec.dtype == "bool":
        return rng.integers(0, 2, size=spec.shape).astype(np.bool_)
    if np.dtype(np_type).kind in "iu":
        return rng.integers(-1000 if np.dtype(np_type).kind == "i" else 0, 1000, size=spec.shape).astype(np_type)
    return (rng.standard_normal(size=spec.shape) * 10).astype(np.float32).astype(np_type)


def _ranks(spec: ParamSpec, world: int) -> list[int]:
    return list(spec.rank_list) if spec.rank_list is not None else list(range(world))


def holds(spec: ParamSpec, rank: int, world: int) -> bool:
    """Whether ``rank`` holds this tensor at all (pipeline stages hold only theirs)."""
    return rank in _ranks(spec, world)


def local_slice(full: np.ndarray, spec: ParamSpec, rank: int, world: int) -> np.ndarray:
    """The block of ``full`` that ``rank`` holds under ``spec`` (numpy, independent of MindFormers)."""
    if spec.tensor_map is None:
        return full
    inner = _ranks(spec, world).index(rank)
    coords = dict(zip(spec.alias_name, np.unravel_index(inner, spec.device_matrix), strict=True))
    sizes = dict(zip(spec.alias_name, spec.device_matrix, strict=True))
    index: list[slice] = []
    for dim, entry in enumerate(spec.tensor_map):
        axes = [a for a in ((entry,) if isinstance(entry, str) else entry) if a != NONE]
        parts = math.prod(sizes[a] for a in axes)
        position = 0
        for axis in axes:
            position = position * sizes[axis] + int(coords[axis])
        step = full.shape[dim] // parts
        index.append(slice(position * step, (position + 1) * step))
    return full[tuple(index)]


def _to_wire(array: np.ndarray) -> np.ndarray:
    return array.view(np.uint16) if array.dtype == ml_dtypes.bfloat16 else array


def _from_wire(array: np.ndarray, dtype: str) -> np.ndarray:
    return array.view(ml_dtypes.bfloat16) if dtype == "bfloat16" else array.astype(_NP_DTYPES[dtype])


def default_common(iteration: int) -> dict[str, Any]:
    """The ``common_info`` every save passes (``CommonInfo`` fields, see docs/formats.md)."""
    return {
        "epoch_num": 1,
        "step_num": iteration,
        "global_step": iteration,
        "loss_scale": 1.0,
        "global_batch_size": 8,
        "consumed_samples": iteration * 8,
        "ckpt_status": 0,
    }


@dataclass(frozen=True)
class SaveOptions:
    """How MindFormers saves (see :func:`make_checkpoint2`)."""

    ranks: int = 8
    optimizer: bool = True
    pipeline: bool = False
    seed: int = 0
    iteration: int = 10
    prefix: str | None = None
    remove_redundancy: bool = False
    common: Mapping[str, Any] | None = None


def full_tensors(layouts: Mapping[str, ParamSpec], how: SaveOptions) -> dict[str, np.ndarray]:
    """The full tensors a save of ``layouts`` writes: parameters, then AdamW's states."""
    rng = np.random.default_rng(how.seed)
    every = {**layouts, **(optimizer_specs(layouts) if how.optimizer else {})}
    full = {name: sample(spec, rng) for name, spec in every.items()}
    if how.optimizer:
        full["global_step"] = np.array([how.iteration], np.int32)
        full["learning_rate"] = np.array(LEARNING_RATE, np.float32)  # the optimizer keeps its own value
    return full


def plan_save(
    dst: str | Path, layouts: Mapping[str, ParamSpec], workdir: Path, how: SaveOptions = SaveOptions()
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A save job for :func:`run_jobs` (every rank's slice written under ``workdir``) and its full tensors."""
    full = full_tensors(layouts, how)
    opt = optimizer_specs(layouts) if how.optimizer else {}
    every = {**layouts, **opt}
    slices = Path(tempfile.mkdtemp(prefix="slices-", dir=workdir))
    for rank in range(how.ranks):
        local = {
            name: _to_wire(np.ascontiguousarray(local_slice(full[name], spec, rank, how.ranks)))
            for name, spec in every.items()
            if holds(spec, rank, how.ranks)
        }
        np.savez(slices / f"rank_{rank}.npz", **local)
    job = {
        "op": "save",
        "dst": str(dst),
        "world": how.ranks,
        "specs": {n: s.to_json() for n, s in layouts.items()},
        "optimizer_specs": {n: s.to_json() for n, s in opt.items()},
        "optimizer": how.optimizer,
        "learning_rate": LEARNING_RATE,
        "iteration": how.iteration,
        "prefix": how.prefix,
        "common": dict(how.common) if how.common is not None else default_common(how.iteration),
        "slices": str(slices),
        "pipeline": how.pipeline,
        "remove_redundancy": how.remove_redundancy,
    }
    return job, full


def run_jobs(jobs: Sequence[Mapping[str, Any]], timeout: float = 900) -> list[Any]:
    """Run MindFormers jobs (see the script) in order in ONE oracle subprocess, in a temporary cwd."""
    with tempfile.TemporaryDirectory(prefix="mf-oracle-cwd-") as cwd:
        result = run_oracle(SCRIPT.read_text() + DRIVER, {"jobs": list(jobs)}, timeout=timeout, cwd=cwd)
    assert isinstance(result, list)
    return result


def make_checkpoint2(
    dst: str | Path,
    layouts: Mapping[str, ParamSpec] = DEFAULT_LAYOUTS,
    *,
    ranks: int = 8,
    optimizer: bool = True,
    pipeline: bool = False,
    seed: int = 0,
    iteration: int = 10,
    prefix: str | None = None,
    remove_redundancy: bool = False,
) -> dict[str, np.ndarray]:
    """MindFormers writes an N-rank Checkpoint 2.0 of the tiny network; returns the full tensors.

    ``dst`` becomes the checkpoint root (tracker + ``iteration_{n:08d}/``). ``ranks=1`` with
    :func:`full_layouts` is a single-card save (no metadata.json). The full tensors (parameters and,
    with ``optimizer``, MindFormers AdamW's ``adam_m.*``/``adam_v.*``/``global_step``/
    ``learning_rate``) are returned and written beside the tree as ``<dst>.full.npz`` (bfloat16 as
    its uint16 bits, dtypes in ``<dst>.full.dtypes``). ``pipeline`` expects specs whose
    ``rank_list`` name the stage of every tensor; ``remove_redundancy`` is MindFormers' balanced save.
    """
    dst = Path(dst)
    how = SaveOptions(ranks, optimizer, pipeline, seed, iteration, prefix, remove_redundancy)
    with tempfile.TemporaryDirectory(prefix="mf-oracle-in-") as work:
        job, full = plan_save(dst, layouts, Path(work), how)
        run_jobs([job])
    write_full(dst.with_name(dst.name + ".full.npz"), full)
    return full


def write_full(path: Path, full: Mapping[str, np.ndarray]) -> None:
    """Full tensors as .npz (bfloat16 as uint16 bits) plus a ``name dtype`` list beside it."""
    np.savez(path, **{n: _to_wire(a) for n, a in full.items()})
    dtypes = "".join(f"{n} {_dtype_name(a)}\n" for n, a in full.items())
    path.with_suffix(".dtypes").write_text(dtypes)


def read_full(path: Path) -> dict[str, np.ndarray]:
    """Inverse of :func:`write_full`."""
    kinds = dict(line.split(" ") for line in path.with_suffix(".dtypes").read_text().splitlines())
    with np.load(path) as data:
        return {n: _from_wire(data[n], kinds[n]) for n in data.files}


def _dtype_name(array: np.ndarray) -> str:
    return "bfloat16" if array.dtype == ml_dtypes.bfloat16 else str(array.dtype)


def load_job(
    checkpoint_dir: str | Path, dst_layouts: Mapping[str, ParamSpec], rank: int, world: int, out: Path
) -> dict[str, Any]:
    """A job description for :func:`run_jobs`: MindFormers loads ``rank``'s tensors into ``out``."""
    return {
        "op": "load",
        "src": str(checkpoint_dir),
        "specs": {n: s.to_json() for n, s in dst_layouts.items()},
        "rank": rank,
        "world": world,
        "out": str(out),
    }


def read_loaded(out: Path, result: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A load job's tensors. Fails when MindFormers left a tensor unloaded, or resharded it to another
    dtype or shape than the job holds (``load_param_into_net`` would cast it silently)."""
    if result["problems"]:
        raise AssertionError("MindFormers' load: " + "; ".join(result["problems"]))
    with np.load(out) as data:
        return {n: _from_wire(data[n], result["dtypes"][n]) for n in data.files}


def mindformers_load_many(
    checkpoint_dir: str | Path, dst_layouts: Mapping[str, ParamSpec], ranks: Sequence[int], world: int
) -> dict[int, dict[str, np.ndarray]]:
    """:func:`mindformers_load` for several ranks in one MindFormers subprocess."""
    with tempfile.TemporaryDirectory(prefix="mf-oracle-out-") as work:
        outs = [Path(work) / f"rank_{r}.npz" for r in ranks]
        results = run_jobs(
            [load_job(checkpoint_dir, dst_layouts, r, world, o) for r, o in zip(ranks, outs, strict=True)]
        )
        return {r: read_loaded(o, res) for r, o, res in zip(ranks, outs, results, strict=True)}


def mindformers_load(
    checkpoint_dir: str | Path, dst_layouts: Mapping[str, ParamSpec], rank: int, world: int
) -> dict[str, np.ndarray]:
    """The tensors MindFormers' ``load_checkpoint`` gives ``rank`` of a ``world``-rank job.

    ``checkpoint_dir`` is a Checkpoint 2.0 root or iteration folder (or a Hugging Face folder,
    as MindFormers' own ``get_checkpoint_path`` decides). The destination network holds every
    tensor of ``dst_layouts`` (optimizer state names included, as plain parameters) with its local
    shape; MindFormers' ``ReshardLoader`` fills it. Tensors MindFormers did not load keep zeros.
    """
    return mindformers_load_many(checkpoint_dir, dst_layouts, [rank], world)[rank]


def checkpoint_tensors(checkpoint_dir: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{name: (global shape, dtype name)}`` from a Checkpoint 2.0's metadata.json (root or iteration)."""
    folder = Path(checkpoint_dir)
    tracker = folder / "latest_checkpointed_iteration.txt"
    if tracker.exists():
        folder = folder / f"iteration_{int(tracker.read_text()):08d}"
    metadata = json.loads((folder / "metadata.json").read_text())
    return {
        name: (tuple(entry["global_shape"]), entry["properties"]["dtype"].lower())
        for name, entry in metadata["state_dict_metadata"].items()
    }


def strategy_layouts(
    strategy_path: str | Path, tensors: Mapping[str, tuple[tuple[int, ...], str]], optimizer: bool = True
) -> dict[str, ParamSpec]:
    """Destination layouts from a strategy file (read by reshard), as ParamSpecs.

    A strategy file records neither global shapes nor dtypes: they come from ``tensors``
    (``{name: (shape, dtype)}``, e.g. :func:`checkpoint_tensors`); strategy names missing there are
    left out. With ``optimizer``, every ``adam_m.``/``adam_v.`` state in ``tensors`` takes its
    parameter's layout (as MindFormers' ``complete_optimizer_sharded_tensor`` does) and every other
    name of ``tensors`` (``global_step``, ``learning_rate``, ...) is loaded full. Optimizer-shard fields of the
    strategy are ignored: MindFormers' Layout has no equivalent.
    """
    from reshard.formats.strategy import read_strategy  # host side only

    strategy = read_strategy(strategy_path)
    specs: dict[str, ParamSpec] = {}
    for name, layout in strategy.layouts.items():
        if name in tensors:
            shape, dtype = tensors[name]
            specs[name] = spec_from_strategy(layout.dev_matrix, layout.tensor_map, shape, dtype)
    if optimizer:
        for name, (shape, dtype) in tensors.items():
            base = name.split(".", 1)[1] if name.startswith(("adam_m.", "adam_v.")) else ""
            if name in specs:
                continue
            if base in specs:
                specs[name] = replace(specs[base], dtype=dtype)
            else:
                specs[name] = ParamSpec(shape, dtype, None, trainable=False)
    return specs


def mindformers_load_strategy(
    checkpoint_dir: str | Path, strategy_path: str | Path, ranks: Sequence[int], optimizer: bool = True
) -> dict[int, dict[str, np.ndarray]]:
    """What MindFormers loads on ``ranks`` of a job laid out by a strategy file (world = its devices).

    Shapes and dtypes come from the checkpoint's metadata.json; see :func:`strategy_layouts`.
    """
    specs = strategy_layouts(strategy_path, checkpoint_tensors(checkpoint_dir), optimizer)
    world = max(math.prod(s.device_matrix) for s in specs.values() if s.tensor_map is not None)
    return mindformers_load_many(checkpoint_dir, specs, ranks, world)


def sparse_optimizer_layouts() -> dict[str, ParamSpec]:
    """The default network with only the layernorm trainable: few optimizer shards, so a balanced
    save leaves ranks without an optimizer file and file numbers stop following ranks."""
    return {n: replace(s, trainable=n.endswith("input_layernorm.weight")) for n, s in DEFAULT_LAYOUTS.items()}


def pipeline_sparse_layouts() -> dict[str, ParamSpec]:
    """The two-stage network with only the last stage's layernorm trainable: a balanced save then
    writes the optimizer files 2 and 3 (of 4) from ranks 4 and 5, so file numbers are not ranks."""
    return {n: replace(s, trainable=n == "decoder.final_layernorm.weight") for n, s in pipeline_layouts().items()}


SAMPLES: dict[str, dict[str, Any]] = {  # explicit seeds: a sample's tensors never change when one is added
    "cp2-8rank": {"layouts": DEFAULT_LAYOUTS, "ranks": 8, "seed": 0},
    "cp2-1card": {"layouts": full_layouts(DEFAULT_LAYOUTS), "ranks": 1, "seed": 1},
    "cp2-8rank-balanced": {"layouts": DEFAULT_LAYOUTS, "ranks": 8, "remove_redundancy": True, "seed": 2},
    "cp2-8rank-balanced-sparse": {
        "layouts": sparse_optimizer_layouts(),
        "ranks": 8,
        "remove_redundancy": True,
        "seed": 3,
    },
    "cp2-8rank-pipeline": {"layouts": pipeline_layouts(), "ranks": 8, "pipeline": True, "seed": 4},
    "cp2-8rank-prefix": {"layouts": DEFAULT_LAYOUTS, "ranks": 8, "prefix": "llama", "optimizer": False, "seed": 5},
    "cp2-8rank-pipeline-balanced": {
        "layouts": pipeline_sparse_layouts(),
        "ranks": 8,
        "pipeline": True,
        "remove_redundancy": True,
        "seed": 6,
    },
}


def make_samples(root: Path, names: Sequence[str] = ()) -> None:
    """The sample trees of :data:`SAMPLES` (all, or ``names``) under ``root`` with their full tensors
    beside them (``<name>.full.npz`` + ``.dtypes``, and ``<name>.full.safetensors`` written by reshard)."""
    from reshard.formats.safetensors import save_safetensors  # host side only

    root.mkdir(parents=True, exist_ok=True)
    for name, how in SAMPLES.items():
        if names and name not in names:
            continue
        how = dict(how)
        full = make_checkpoint2(root / name, how.pop("layouts"), **how)
        save_safetensors(root / f"{name}.full.safetensors", full)


if __name__ == "__main__":  # python -m tests.mindformers_oracle DIR [NAME ...]  (PYTHONPATH=src)
    import sys

    make_samples(Path(sys.argv[1]), sys.argv[2:])
