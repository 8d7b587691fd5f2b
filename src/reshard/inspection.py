"""``reshard inspect``: what is in anything the other commands read.

A checkpoint file (plain or encrypted), a folder holding one, a single ``rank_<r>`` folder, a
rank-folder tree, a unified folder (``part*.safetensors`` + ``param_name_map.json``), a Hugging
Face sharded model, a strategy file, or a folder of per-stage strategy files.

Reads headers only (tensor data is never touched), so inspecting a 1 TB checkpoint is instant.
The output starts with a summary (``summarize``: the job and its parallel degrees, parameters and
their elements, bytes by dtype, optimizer states, per-rank sizes), because that is what one asks
first and 500 lines of per-rank tables hid it; ``--params`` adds one table of every parameter over
all ranks, whose cells are never cut (``print_table``), and ``--json`` holds everything.
With a strategy, each sharded parameter also shows its full shape and layout. A parameter shared
by pipeline stages (an embedding used by the first and the last stage) may have a different
layout in each stage, so a rank's layout and full shape come from *that rank's* stage
(``rank // devices per stage``); a per-stage strategy file lists the stage it belongs to.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import replace
from typing import Any

from reshard import layout
from reshard.errors import UsageError
from reshard.formats import rank_dirs, registry
from reshard.formats.strategy import StrategyFile, load_strategy
from reshard.layout import STAGE_SEPARATOR, ParamLayout, device_num, layout_map, stage_count
from reshard.ops import chunked
from reshard.plan import quantized_view as quantized
from reshard.sources import (
    CHECKPOINT2,
    HUGGING_FACE,
    MEGATRON,
    ONE_RANK_FOLDER,
    RANK_FOLDERS,
    STRATEGY,
    UNIFIED,
    AnyKind,
    OpenedChunks,
    OpenedModel,
    OpenedRanks,
    config_path,
    full_model_file,
    identify,
    is_encrypted,
    resolve,
    source_file,
    unified_index,
)
from reshard.sources.registry import BUILT_IN, is_chunked
from reshard.statenames import DEFAULT as DEFAULT_STATE
from reshard.statenames import OPTIMIZER_NAMES, StateNames
from reshard.text import format_size, one_line

_RANK_FOLDER = re.compile(r"rank_(\d+)")

# name -> (the layout that applies, every stage holding the parameter)
Layouts = dict[str, tuple[ParamLayout, list[int]]]


def describe_layout(p: ParamLayout) -> str:
    text = f"dev {list(p.dev_matrix)} map {[list(e) if isinstance(e, tuple) else e for e in p.tensor_map]}"
    if p.opt_shard_size:
        text += f" opt {p.opt_shard_step}/{p.opt_shard_size}"
    return text


def _is_merged(sf: StrategyFile) -> bool:
    return any(STAGE_SEPARATOR in name for name in sf.layouts)


def param_layouts(sf: StrategyFile, rank: int | None = None) -> Layouts:
    """Each parameter's layout as seen by ``rank`` (None: its first stage's), and its stages.

    A merged strategy holds one layout per stage (``"0-emb"``, ``"1-emb"``): the rank's stage picks
    it. A per-stage file holds one stage's layouts, unprefixed: they are that file's stage.
    """
    lmap = layout_map(sf)
    if not _is_merged(sf):
        own_stage = sf.stage or 0
        return {name: (staged.layout, [own_stage]) for name, staged in lmap.items()}
    stage = rank // device_num(sf) if rank is not None else None
    found: Layouts = {}
    for name, staged in lmap.items():
        own = sf.layouts.get(f"{stage}{STAGE_SEPARATOR}{name}") if stage is not None else None
        found[name] = (own or staged.layout, list(staged.stages))
    return found


def stage_layouts(sf: StrategyFile, name: str) -> dict[int, ParamLayout]:
    """Every stage's layout of one parameter of a merged strategy."""
    prefix = f"{STAGE_SEPARATOR}{name}"
    return {
        int(key[: -len(prefix)]): p
        for key, p in sf.layouts.items()
        if key.endswith(prefix) and key[: -len(prefix)].isdigit()
    }


def _read_for(path: str, read: Any) -> Any:
    """The read options for one file: the key only for an encrypted ``.ckpt``."""
    if read is None or read.dec_key is None:
        return replace(read, dec_key=None) if read is not None else None
    return read if is_encrypted(path) else replace(read, dec_key=None)


def checkpoint_rows(
    path: str, strategy: StrategyFile | None = None, rank: int | None = None, read: Any = None, src: Any = None
) -> list[dict[str, Any]]:
    """One row per tensor of ``path`` (``src``: its header facts, when read already)."""
    src = src if src is not None else source_file(path, rank or 0, _read_for(path, read))
    lmap = param_layouts(strategy, rank) if strategy is not None else {}
    rows = []
    for name, t in src.tensors.items():
        row: dict[str, Any] = {"name": name, "dtype": t.dtype.ms_name, "shape": list(t.shape), "bytes": t.nbytes}
        if name in lmap:
            p, stages = lmap[name]
            row["layout"] = describe_layout(p)
            row["full_shape"] = list(layout.full_shape(p, t.shape))
            row["stages"] = stages
        if name in src.strings:
            row["value"] = src.strings[name]
        rows.append(row)
    return rows


def strategy_rows(sf: StrategyFile) -> list[dict[str, Any]]:
    rows = []
    merged = _is_merged(sf)
    for name, (p, stages) in param_layouts(sf).items():
        row: dict[str, Any] = {"name": name, "stages": stages, "layout": describe_layout(p), "devices": p.device_num}
        per_stage = stage_layouts(sf, name) if merged else {}
        if len({describe_layout(q) for q in per_stage.values()}) > 1:
            row["stage_layouts"] = {str(s): describe_layout(q) for s, q in sorted(per_stage.items())}
        rows.append(row)
    return rows


def full_model_info(path: str, strategy: StrategyFile | None = None) -> dict[str, Any]:
    """A Hugging Face sharded model or a unified folder as one checkpoint; rows name their file."""
    files, _, hyper = unified_index(path)
    return _model_info(path, "safetensors", [*files.values(), *([hyper] if hyper is not None else [])], strategy)


def _model_info(path: str, fmt: str, parts: list[Any], strategy: StrategyFile | None) -> dict[str, Any]:
    """A full model of several files as one checkpoint; rows name their file."""
    rows = [
        {**row, "file": os.path.basename(part.path)} for part in parts for row in checkpoint_rows(part.path, strategy)
    ]
    return {
        "kind": "checkpoint",
        "format": fmt,
        "path": path,
        "files": [p.path for p in parts],
        "tensors": rows,
        "bytes": sum(r["bytes"] for r in rows),
    }


def _file_info(path: str, sf: StrategyFile | None, read: Any, ignored: tuple[str, ...] = ()) -> dict[str, Any]:
    """One checkpoint file; a file inside a ``rank_<r>`` folder is that rank (for its stage's layouts)."""
    match = _RANK_FOLDER.fullmatch(os.path.basename(os.path.dirname(os.path.abspath(path))))
    rank = int(match.group(1)) if match else None
    rows = checkpoint_rows(path, sf, rank, read)
    info = {
        "kind": "checkpoint",
        "format": rank_dirs.detect_format(path),
        "path": path,
        "tensors": rows,
        "bytes": sum(r["bytes"] for r in rows),
    }
    if rank is not None:
        info["rank"] = rank
    if ignored:
        info["ignored"] = list(ignored)
    return info


def _distributed_info(path: str, sf: StrategyFile | None, read: Any) -> dict[str, Any]:
    fmt, chosen = rank_dirs.collect_rank_files(path)
    sources = {rank: source_file(p.path, rank, _read_for(p.path, read)) for rank, p in chosen.items()}
    ranks = {}
    for rank, picked in chosen.items():
        rows = checkpoint_rows(picked.path, sf, rank, read, sources[rank])
        ranks[rank] = {
            "file": picked.path,
            "ignored": list(picked.ignored),
            "tensors": rows,
            "bytes": sum(r["bytes"] for r in rows),
        }
    info: dict[str, Any] = {
        "kind": "distributed",
        "format": fmt,
        "path": path,
        "ranks": ranks,
        "bytes": sum(r["bytes"] for r in ranks.values()),
    }
    if sf is not None:
        info["checks"] = agreement(sources, sf, read)
    return info


def agreement(sources: dict[int, Any], sf: StrategyFile, read: Any = None) -> dict[str, Any]:
    """The checks every plan from this strategy makes (``reshard.plan.agree``, and the replicas'
    sampled bytes, ``reshard.sources.replicas``): a failed one raises (exit 2); what is only
    suspicious (a rank count the strategy does not describe) is a warning."""
    from reshard.plan.agree import check_agreement
    from reshard.sources.replicas import check_replicas

    per_stage = device_num(sf)
    done = check_agreement(sources, sf, per_stage)
    copies = check_replicas(sources, sf, options_for=lambda path: _read_for(path, read))
    expected = per_stage * stage_count(sf)
    warnings = []
    if sorted(sources) != list(range(expected)):
        warnings.append(
            f"the strategy describes {expected} rank(s) (0..{expected - 1}), the checkpoint has "
            f"{len(sources)} rank folder(s): a transform refuses that"
        )
    return {"parameters": done.parameters, "ranks": done.ranks, "replicas": copies.tensors, "warnings": warnings}


def _rank_folder_info(path: str, sf: StrategyFile | None, read: Any) -> dict[str, Any]:
    """One ``rank_<r>`` folder: the file MindSpore's rule picks for its format, as that rank."""
    fmts = [fmt for fmt in registry.names() if rank_dirs.files_in(path, fmt)]
    if len(fmts) > 1:
        first, second = (registry.suffix(f) for f in fmts[:2])
        raise UsageError(f"the rank folder holds both {first} and {second} files; inspect one of them", path)
    fmt = fmts[0]
    picked = rank_dirs.pick_file(path, fmt, rank_dirs.default_rule(fmt))
    assert picked is not None  # the registry recognised a rank folder holding checkpoints
    return _file_info(picked.path, sf, read, picked.ignored)


def _strategy_info(path: str, notes: list[str]) -> tuple[dict[str, Any], StrategyFile]:
    sf = STRATEGY.open(path, None, notes).strategy
    return {"kind": "strategy", "path": path, "params": strategy_rows(sf)}, sf


def gather(path: str, strategy: str | None = None, read: Any = None, notes: list[str] | None = None) -> dict[str, Any]:
    """What ``path`` holds, as plain data (the ``--json`` output); loading notes go to ``notes``.

    What ``path`` is comes from the source registry (``reshard.sources.registry``), which also
    words every "missing / empty / not something reshard reads" error. ``summary`` holds the
    job, sizes and optimizer states (``summarize``); rank folders also get ``parameters``, one row
    per parameter over all ranks.
    """
    notes = notes if notes is not None else []
    info, sf = _gather(path, strategy, read, notes)
    info["source"] = identify(path).name  # what the registry calls it ("a Hugging Face model")
    if info["kind"] == "distributed":
        info["parameters"] = parameter_rows(info)
    rows = [row for part in _entries_by_rank(info).values() for row in part]
    info["quantized"] = quantized.quantized_view(rows, quantized.config_block(config_path(path)))
    info["summary"] = summarize(info, sf)
    quantized.counted_once(info["summary"], info["quantized"], rows, _state_kind)
    return info


def _gather(path: str, strategy: str | None, read: Any, notes: list[str]) -> tuple[dict[str, Any], StrategyFile | None]:
    kind = resolve(path, strategy=strategy, read=read, flag="strategy", full_takes_strategy=True)
    if kind is CHECKPOINT2:
        return _checkpoint2(path, read, notes)
    if is_chunked(kind):  # its layouts are its chunks (.metadata): each tensor's global shape, chunks, saving ranks
        opened = kind.open(path, read, notes)
        assert isinstance(opened, OpenedChunks)
        return chunked.chunk_facts(opened), None
    sf = load_strategy(strategy) if strategy else None
    if sf is not None:
        notes.extend(sf.notes)
    if kind not in BUILT_IN:
        return _opened_info(path, kind, sf, read, notes)
    if kind in (HUGGING_FACE, UNIFIED):
        return full_model_info(path, sf), sf
    if kind is RANK_FOLDERS:
        return _distributed_info(path, sf, read), sf
    if kind is ONE_RANK_FOLDER:
        return _rank_folder_info(path, sf, read), sf
    if kind is STRATEGY:
        return _strategy_info(path, notes)
    single = full_model_file(path)  # a checkpoint file (plain or encrypted), or a folder holding one
    assert single is not None
    return _file_info(single, sf, read), sf


def _opened_info(
    path: str, kind: AnyKind, sf: StrategyFile | None, read: Any, notes: list[str]
) -> tuple[dict[str, Any], StrategyFile | None]:
    """A registered kind, by what it opens as: a full model's files, or a job's ranks (with the layouts
    it carries, or the strategy given)."""
    opened = kind.open(path, read, notes)
    if isinstance(opened, OpenedModel):
        parts = [*opened.files.values(), *([opened.hyper] if opened.hyper is not None else [])]
        return _model_info(path, opened.fmt, parts, sf), sf
    if not isinstance(opened, OpenedRanks):
        return _strategy_info(path, notes)
    sf = sf if sf is not None else opened.strategy
    ranks = {}
    for rank, facts in sorted(opened.ranks.items()):
        rows = checkpoint_rows(facts.path, sf, rank, read, facts)
        ranks[rank] = {"file": facts.path, "ignored": [], "tensors": rows, "bytes": sum(r["bytes"] for r in rows)}
    info: dict[str, Any] = {
        "kind": "distributed",
        "format": opened.fmt,
        "path": path,
        "ranks": ranks,
        "bytes": sum(r["bytes"] for r in ranks.values()),
    }
    if sf is not None:
        info["checks"] = agreement(dict(opened.ranks), sf, read)
    return info, sf


def checkpoint2_info(path: str, read: Any = None, notes: list[str] | None = None) -> dict[str, Any]:
    """A MindFormers Checkpoint 2.0: each tensor's global shape, dtype, layout and files, the files, and
    ``common.json`` (docs/formats.md §13). Every fact is cross-checked as a transform would."""
    return _checkpoint2(path, read, notes if notes is not None else [])[0]


def _checkpoint2(path: str, read: Any, notes: list[str]) -> tuple[dict[str, Any], StrategyFile | None]:
    from reshard.sources.checkpoint2 import open_checkpoint2, read_iteration

    it = read_iteration(path, read, notes)
    opened = open_checkpoint2(path, read, [], CHECKPOINT2.name, it)  # the same checks a transform makes
    tensors: list[dict[str, Any]] = []
    if it.metadata is None:
        for file_name, facts in it.headers.items():
            for name, t in facts.tensors.items():
                tensors.append(_cp2_row(name, t.dtype.ms_name, t.shape, None, None, [file_name], t.nbytes))
    else:
        for name, meta in it.metadata.tensors.items():
            files = sorted({r.file_name for (n, _), recs in it.metadata.storage.items() if n == name for r in recs})
            nbytes = math.prod(meta.global_shape) * meta.dtype.itemsize
            tensors.append(_cp2_row(name, meta.dtype.ms_name, meta.global_shape, meta, len(meta.chunks), files, nbytes))
    info = {
        "kind": "checkpoint2",
        "path": path,
        "iteration_folder": it.folder,
        "format": "safetensors",
        "ranks": len(opened.ranks) or 1,
        "tensors": tensors,
        "files": [
            {"name": n, "bytes": os.path.getsize(f.path), "tensors": len(f.tensors)} for n, f in it.headers.items()
        ],
        "common": it.common,
        "bytes": sum(t["bytes"] for t in tensors),
        # what each rank holds (its slice of every tensor, wherever a redundancy-removed save stored it)
        "rank_bytes": {str(r): sum(t.nbytes for t in f.tensors.values()) for r, f in sorted(opened.ranks.items())},
    }
    return info, opened.strategy


def _cp2_row(
    name: str, dtype: str, shape: tuple[int, ...], meta: Any, chunks: int | None, files: list[str], nbytes: int
) -> dict[str, Any]:
    lay = meta.layout if meta is not None else None
    layout_json = None
    if lay is not None:
        layout_json = {
            "device_matrix": list(lay.device_matrix),
            "tensor_map": [list(e) if isinstance(e, tuple) else e for e in lay.tensor_map],
            "alias_name": list(lay.alias_name),
            "rank_list": list(lay.rank_list),
        }
    return {
        "name": name,
        "dtype": dtype,
        "shape": list(shape),
        "bytes": nbytes,
        "layout": layout_json,
        "axis_fragmentations": list(meta.axis_fragmentations) if meta is not None else [1] * len(shape),
        "chunks": chunks if chunks is not None else 1,
        "files": files,
    }


def main(path: str, as_json: bool = False, strategy: str | None = None, read: Any = None, params: bool = False) -> None:
    """Print what ``path`` holds: the summary, then with ``params`` one row per parameter (``--json``: all of it)."""
    notes: list[str] = []
    info = gather(path, strategy, read, notes)
    for note in notes:
        print(f"reshard: note: {one_line(note)}", file=sys.stderr)
    for warning in info.get("checks", {}).get("warnings", []):
        print(f"reshard: warning: {one_line(warning)}", file=sys.stderr)
    if as_json:
        print(json.dumps(info, indent=1))
        return
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False)
    for line in summary_lines(info):
        console.print(escape(line), soft_wrap=not console.is_terminal)
    if params:
        print_table(*params_table(info), console)
    else:
        console.print("(--params lists every parameter, --json everything)")


# ------------------------------------------------------------------------------------ the summary
#
# What a careful user asks first: what job is this (ranks, stages, parallel degrees), how big is
# the model (parameters, elements, bytes by dtype), is the optimizer in it, and are the ranks
# balanced. Every field is computed from the rows ``gather`` already read (headers only) and the
# strategy's layouts through ``reshard.layout``; the text form prints the same dict ``--json`` has.


def _state_kind(name: str, rule: StateNames = DEFAULT_STATE) -> str | None:
    """The kind of training state ``name`` is (``adam_m``, ``global_step``), None for a model weight."""
    if not rule.is_state(name):
        return None
    prefix = rule.prefix_of(name)
    return prefix.rstrip("._/") if prefix is not None else name


def job_degrees(sf: StrategyFile) -> dict[str, int | None]:
    """Ranks, pipeline stages and the parallel degrees a strategy implies.

    ``mp`` is the largest number of model-parallel blocks any one parameter is cut into
    (``layout.tensor_strategy``), ``dp`` the devices of a stage over that, ``opt_shard`` the
    largest optimizer-shard group (``layout.opt_shard_size``, 1 when none).
    """
    lmap = layout_map(sf)
    per_stage = device_num(sf, lmap)
    own_stage = None if _is_merged(sf) else sf.stage  # a per-stage file is one stage of a job
    stages = stage_count(sf, lmap) if own_stage is None else 1
    layouts = list(sf.layouts.values())
    mp = max((math.prod(layout.tensor_strategy(p)) for p in layouts), default=1)
    opt = max((layout.opt_shard_size(p) for p in layouts), default=0)
    return {
        "ranks": per_stage * stages,
        "stages": stages,
        "stage": own_stage,
        "devices_per_stage": per_stage,
        "dp": max(per_stage // mp, 1),
        "mp": mp,
        "opt_shard": max(opt, 1),
    }


def ranges_text(ranks: list[int]) -> str:
    """``0-3,6,8-9``: a list of ranks, sorted and compact."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def summarize(info: dict[str, Any], sf: StrategyFile | None = None) -> dict[str, Any]:
    """The summary of what ``gather`` found (``info["summary"]``; every field is in ``--json``)."""
    per_rank = _entries_by_rank(info)
    names: dict[str, dict[str, Any]] = {}
    by_dtype: dict[str, int] = {}
    for rows in per_rank.values():
        for row in rows:
            names.setdefault(row["name"], row)
            by_dtype[row["dtype"]] = by_dtype.get(row["dtype"], 0) + row["bytes"]
    states: dict[str, int] = {}
    for name in names:
        kind = _state_kind(name)
        if kind is not None:
            states[kind] = states.get(kind, 0) + 1
    weights = [name for name in names if _state_kind(name) is None]
    summary: dict[str, Any] = {
        "source": info["kind"],
        "ranks": info["ranks"] if info["kind"] in ("checkpoint2", "dcp") else len(per_rank) if per_rank else None,
        "stages": None,
        "stage": None,
        "devices_per_stage": None,
        "dp": None,
        "mp": None,
        "opt_shard": None,
        "parameters": len(weights),
        "parameter_elements": _elements(info, names, weights, len(per_rank)),
        "source_name": info.get("source"),
        "files": len(info["files"]) if isinstance(info.get("files"), list) else len(per_rank) or None,
        "tensors": len(names),
        "bytes": info.get("bytes", 0),
        "bytes_by_dtype": dict(sorted(by_dtype.items(), key=lambda kv: -kv[1])),
        "optimizer_states": states,
        "rank_bytes": _rank_bytes(info, per_rank),
    }
    if info["kind"] == "strategy":
        summary["ranks"] = None
    if sf is not None:
        summary.update(job_degrees(sf))
    return summary


def _entries_by_rank(info: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    """Each rank's rows (one rank for a single checkpoint; none for a strategy)."""
    if info["kind"] == "distributed":
        return {int(r): part["tensors"] for r, part in info["ranks"].items()}
    if info["kind"] == "strategy":
        return {-1: [{"name": p["name"], "dtype": "", "bytes": 0} for p in info["params"]]}
    return {info.get("rank", 0): info["tensors"]}


def _elements(info: dict[str, Any], names: dict[str, dict[str, Any]], weights: list[str], ranks: int) -> int | None:
    """Elements of the model weights' full tensors; None when only slices are known (no strategy)."""
    if info["kind"] == "strategy":
        return None
    if info["kind"] == "distributed" and ranks > 1:
        full = [names[n].get("full_shape") for n in weights]
        if any(shape is None for shape in full):
            return None
        return sum(math.prod(shape) for shape in full if shape is not None)
    return sum(math.prod(names[n].get("full_shape", names[n]["shape"])) for n in weights)


def _rank_bytes(info: dict[str, Any], per_rank: dict[int, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """Min / max / total bytes over the ranks, and each rank's bytes (rank folders, Checkpoint 2.0)."""
    sizes = info.get("rank_bytes") or (
        {r: sum(row["bytes"] for row in rows) for r, rows in per_rank.items()} if info["kind"] == "distributed" else {}
    )
    if not sizes:
        return None
    sizes = {int(r): b for r, b in sizes.items()}
    low = min(sizes, key=lambda r: (sizes[r], r))
    high = max(sizes, key=lambda r: (sizes[r], -r))
    return {
        "min": sizes[low],
        "min_rank": low,
        "max": sizes[high],
        "max_rank": high,
        "total": sum(sizes.values()),
        "by_rank": {str(r): sizes[r] for r in sorted(sizes)},
    }


def summary_lines(info: dict[str, Any]) -> list[str]:
    """The summary as a few lines of text (the default output of ``reshard inspect``)."""
    s = info["summary"]
    lines = [f"{_what(info)}: {info['path']}"]
    if s["stages"] is not None:
        stages = f"{s['stages']} pipeline stage{'s' if s['stages'] != 1 else ''} of {s['devices_per_stage']} devices"
        opt = f", optimizer shard {s['opt_shard']}" if s["opt_shard"] > 1 else ", no optimizer shard"
        ranks = f"{s['ranks']} ranks, " if s["ranks"] is not None else ""
        if s["stage"] is not None:  # one stage's file: its own devices only
            ranks, stages = "", f"pipeline stage {s['stage']}'s file, {s['devices_per_stage']} devices"
        lines.append(f"job: {ranks}{stages}; dp {s['dp']}, mp {s['mp']}{opt}")
    elif info["kind"] == "dcp":
        lines.append(f"job: saved by {s['ranks']} rank{'s' if s['ranks'] != 1 else ''} (each chunk's box in .metadata)")
    elif s["ranks"] and s["ranks"] > 1:
        lines.append(f"job: {s['ranks']} rank{'s' if s['ranks'] != 1 else ''} (give --strategy for stages and degrees)")
    elements = s["parameter_elements"]
    counted = (
        f", {elements:,} elements ({_short_count(elements)})"
        if elements is not None
        else (", elements: give --strategy for full shapes" if s["source"] == "distributed" else "")
    )
    lines.append(f"parameters: {s['parameters']} model weights{counted}")
    lines += quantized.quantized_lines(info.get("quantized", {}))
    if s["source"] != "strategy":
        dtypes = ", ".join(f"{d} {format_size(b)}" for d, b in s["bytes_by_dtype"].items())
        lines.append(f"tensors: {s['tensors']} names, {format_size(s['bytes'])} ({dtypes or 'none'})")
    lines.append("optimizer states: " + _states_text(s["optimizer_states"]))
    rb = s["rank_bytes"]
    if rb is not None:
        lines.append(
            f"per rank: min {format_size(rb['min'])} (rank {rb['min_rank']}), "
            f"max {format_size(rb['max'])} (rank {rb['max_rank']}), total {format_size(rb['total'])}"
        )
    if info["kind"] == "dcp":
        values = info["values"]
        lines.append(
            f"chunks: {sum(t['chunks'] for t in info['tensors'])} in {len(info['files'])} data files; "
            f"non-tensor values: {len(values)}"
            + (f" ({format_size(sum(v['bytes'] for v in values))})" if values else "")
        )
    if info["kind"] == "checkpoint2":
        common = info["common"]
        lines.append("common.json: " + (", ".join(f"{k}={v}" for k, v in common.items()) if common else "none"))
    if info.get("ignored"):
        lines.append(f"ignored: {', '.join(info['ignored'])}")
    checks = info.get("checks")
    if checks is not None:
        lines.append(
            f"checks: the strategy and the files agree ({checks['parameters']} tensors over {checks['ranks']} ranks: "
            "one slice shape per stage, one global shape per parameter and its optimizer states; "
            f"{checks['replicas']} replica slices hold the same sampled bytes)"
        )
    return lines


def _what(info: dict[str, Any]) -> str:
    kind = info["kind"]
    if kind == "distributed":
        return f"rank folders ({info['format']})"
    if kind == "checkpoint2":
        return f"MindFormers Checkpoint 2.0 {os.path.basename(info['iteration_folder'])}"
    if kind == "strategy":
        return "strategy"
    if kind == "dcp":
        what = "Megatron-core torch_dist" if info.get("source") == MEGATRON.name else "PyTorch DCP"
        return f"{what} checkpoint ({len(info['files'])} data files)"
    if "files" in info:  # a Hugging Face model or a unify output
        count = len(info["files"])
        return f"{info.get('source', 'a full model').removeprefix('a ')} ({count} file{'s' if count != 1 else ''})"
    return f"checkpoint ({info['format']}{', rank ' + str(info['rank']) if 'rank' in info else ''})"


def _short_count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


def _states_text(states: dict[str, int]) -> str:
    if not states:
        return "none (model weights only)"
    moments = [f"{k} ({n})" for k, n in states.items() if n > 1 or k not in OPTIMIZER_NAMES]
    counters = [k for k, n in states.items() if n == 1 and k in OPTIMIZER_NAMES]
    parts = moments + ([f"step counters: {', '.join(counters)}"] if counters else [])
    return "; ".join(parts)


# ------------------------------------------------------------------------------------ --params


def parameter_rows(info: dict[str, Any]) -> list[dict[str, Any]]:
    """Rank folders' tensors as one row per parameter: dtype, shape (full when a strategy gives it),
    layout (each distinct one with the ranks using it), the ranks holding it, and its stored bytes."""
    grouped: dict[str, dict[str, Any]] = {}
    for rank, part in sorted(info["ranks"].items(), key=lambda kv: int(kv[0])):
        for row in part["tensors"]:
            entry = grouped.setdefault(
                row["name"], {"name": row["name"], "dtype": row["dtype"], "ranks": [], "bytes": 0, "_shapes": {}}
            )
            entry["ranks"].append(int(rank))
            entry["bytes"] += row["bytes"]
            key = (str(row.get("full_shape", row["shape"])), row.get("layout", ""))
            entry["_shapes"].setdefault(key, []).append(int(rank))
            entry.setdefault("full_shape", row.get("full_shape"))
            entry.setdefault("shape", row["shape"])
    for entry in grouped.values():
        variants = entry.pop("_shapes")
        entry["layouts"] = [{"ranks": ranks, "shape": shape, "layout": lay} for (shape, lay), ranks in variants.items()]
    return list(grouped.values())


Column = tuple[str, bool]  # a column's title, right-justified or not


def params_table(info: dict[str, Any]) -> tuple[str, list[Column], list[list[str]]]:
    """The ``--params`` table of any kind: a title, its columns and its rows as text."""
    kind = info["kind"]
    if kind == "distributed":
        return _distributed_table(info)
    if kind == "strategy":
        rows = []
        for row in info["params"]:
            shown = row["layout"]
            if "stage_layouts" in row:
                shown = "; ".join(f"stage {s}: {text}" for s, text in row["stage_layouts"].items())
            rows.append([row["name"], ranges_text(row["stages"]), str(row["devices"]), shown])
        return (
            f"strategy {info['path']}",
            [("name", False), ("stages", False), ("devices", True), ("layout", False)],
            rows,
        )
    if kind == "checkpoint2":
        rows = []
        for row in info["tensors"]:
            lay = row["layout"]
            shown = (
                f"dev {lay['device_matrix']} map {lay['tensor_map']} ranks {ranges_text(lay['rank_list'])}"
                if lay
                else ""
            )
            files = row["files"]
            rows.append([
                row["name"], row["dtype"], str(row["shape"]), shown, str(row["chunks"]),
                files[0] if len(files) == 1 else f"{len(files)} files", format_size(row["bytes"]),
            ])  # fmt: skip
        cols = [("name", False), ("dtype", False), ("global shape", False), ("layout", False), ("chunks", True)]
        return f"Checkpoint 2.0 {info['iteration_folder']}", [*cols, ("files", False), ("size", True)], rows
    if kind == "dcp":
        rows = [
            [
                r["name"],
                r["dtype"],
                str(r["shape"]),
                str(r["chunks"]),
                ranges_text(r["saved_by"]),
                format_size(r["bytes"]),
            ]
            for r in info["tensors"]
        ]
        cols = [("name", False), ("dtype", False), ("global shape", False), ("chunks", True), ("saved by", False)]
        return f"PyTorch DCP {info['path']}", [*cols, ("size", True)], rows
    rows = []
    for row in info["tensors"]:
        shape = repr(row["value"]) if "value" in row else str(row["shape"])
        dtype = quantized.quantized_dtype(row["dtype"], info.get("quantized", {}).get(row["name"]))
        rows.append([
            row["name"], dtype, shape, format_size(row["bytes"]), str(row.get("full_shape", "")),
            row.get("layout", ""), *([row["file"]] if "file" in row else []),
        ])  # fmt: skip
    cols = [("name", False), ("dtype", False), ("shape", False), ("size", True), ("full shape", False)]
    cols += [("layout", False), *([("file", False)] if any("file" in r for r in info["tensors"]) else [])]
    return f"{info['format']} {info['path']}", cols, rows


def _distributed_table(info: dict[str, Any]) -> tuple[str, list[Column], list[list[str]]]:
    rows = []
    every = set(range(len(info["ranks"])))
    for entry in info["parameters"]:
        variants = entry["layouts"]
        shape = str(entry["full_shape"]) if entry["full_shape"] is not None else f"{entry['shape']} (a rank's)"
        if len(variants) == 1:
            shown = variants[0]["layout"]
        else:
            same_shape = len({v["shape"] for v in variants}) == 1
            shown = "; ".join(
                f"ranks {ranges_text(v['ranks'])}: {'' if same_shape else v['shape'] + ' '}{v['layout']}".rstrip()
                for v in variants
            )
        ranks = "all" if set(entry["ranks"]) == every and len(every) > 1 else ranges_text(entry["ranks"])
        dtype = quantized.quantized_dtype(entry["dtype"], info.get("quantized", {}).get(entry["name"]))
        rows.append([entry["name"], dtype, shape, shown, ranks, format_size(entry["bytes"])])
    cols = [("name", False), ("dtype", False), ("shape", False), ("layout", False), ("ranks", False), ("stored", True)]
    return f"{len(info['parameters'])} parameters of {len(info['ranks'])} ranks", cols, rows


def print_table(title: str, columns: list[Column], rows: list[list[str]], console: Any) -> None:
    """A table whose cells are never cut: on a terminal long cells wrap inside their column (rich,
    ``overflow="fold"``); on a pipe or in a log every row is one whole line with the columns
    padded, under one header line, so ``| grep wq`` finds each row whole."""
    from rich.markup import escape
    from rich.table import Table

    shown = [i for i in range(len(columns)) if i == 0 or any(r[i] for r in rows)]  # no column of blanks
    columns, rows = [columns[i] for i in shown], [[r[i] for i in shown] for r in rows]
    if not console.is_terminal:
        widths = [max([len(c[0]), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
        for cells in ([c[0] for c in columns], *rows):
            padded = [
                cell.rjust(w) if right else cell.ljust(w)
                for cell, w, (_, right) in zip(cells, widths, columns, strict=True)
            ]
            console.print(escape("  ".join(padded).rstrip()), soft_wrap=True)
        return
    table = Table(title=escape(title))
    longest = max((len(r[0]) for r in rows), default=4)
    for i, (name, right) in enumerate(columns):
        table.add_column(
            name, justify="right" if right else "left", overflow="fold", min_width=min(longest, 40) if i == 0 else None
        )
    for r in rows:
        table.add_row(*(escape(c) for c in r))
    console.print(table)


__all__ = [
    "Column",
    "Layouts",
    "agreement",
    "checkpoint2_info",
    "checkpoint_rows",
    "describe_layout",
    "full_model_info",
    "gather",
    "job_degrees",
    "main",
    "param_layouts",
    "parameter_rows",
    "params_table",
    "print_table",
    "ranges_text",
    "stage_layouts",
    "strategy_rows",
    "summarize",
    "summary_lines",
]
