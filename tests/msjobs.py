"""Run MindSpore's converters on prepared folders (oracle side) and compare output trees.

One oracle call runs a list of jobs in order, so a test case pays MindSpore's import once.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from reshard.formats.strategy import make_strategy, write_strategy
from reshard.layout import ParamLayout

JOBS_SCRIPT = """
import mindspore.parallel as mp_
results = []
for job in ARGS["jobs"]:
    op = job.pop("op")
    if op == "transform":
        ms.transform_checkpoints(**job)
        results.append(None)
    elif op == "rank_list":
        results.append([int(r) for r in ms.rank_list_for_transform(**job)])
    elif op == "by_rank":
        job["checkpoint_files_map"] = {int(k): v for k, v in job["checkpoint_files_map"].items()}
        ms.transform_checkpoint_by_rank(**job)
        results.append(None)
    elif op == "unify":
        ms.unified_safetensors(**job)
        results.append(None)
    elif op == "split":
        ms.load_distributed_checkpoint(None, format="safetensors", **job)
        results.append(None)
    elif op == "ckpt_to_safetensors":
        ms.ckpt_to_safetensors(**job)
        results.append(None)
    elif op == "safetensors_to_ckpt":
        ms.safetensors_to_ckpt(**job)
        results.append(None)
    elif op == "merge":
        ms.merge_pipeline_strategys(**job)
        results.append(None)
    else:
        raise ValueError(op)
out(results)
"""


def run_ms_jobs(oracle: Callable[..., Any], jobs: Sequence[Mapping[str, Any]]) -> list[Any]:
    return oracle(JOBS_SCRIPT, {"jobs": [dict(j) for j in jobs]})


RESHARD_OWN_FILES = ("reshard-manifest.json", ".reshard-journal")  # our completion marker / resume journal


def tree_files(root: str) -> dict[str, str]:
    """relative path -> sha256 of every file below root (reshard's own bookkeeping files excluded)."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            if name.startswith(RESHARD_OWN_FILES):
                continue
            path = os.path.join(folder, name)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = hashlib.sha256(fh.read()).hexdigest()
    return dict(sorted(out.items()))


def assert_same_tree(ours: str, theirs: str, ms_wrong: frozenset[str] = frozenset()) -> None:
    """Same file names and bytes; ``ms_wrong`` names tensors where MindSpore is known to be wrong.

    A file that differs only in those tensors passes here; the caller checks those tensors
    against the truth separately.
    """
    a, b = tree_files(ours), tree_files(theirs)
    assert sorted(a) == sorted(b), f"file names differ:\nours   {sorted(a)}\ntheirs {sorted(b)}"
    differing = [
        k for k in a if a[k] != b[k] and not _same_but_metadata_order(os.path.join(ours, k), os.path.join(theirs, k))
    ]
    if ms_wrong:
        differing = [k for k in differing if differing_tensors(ours, theirs, k) - ms_wrong]
    assert not differing, f"bytes differ: {differing} ({describe_difference(ours, theirs, differing[0])})"


def _same_but_metadata_order(x: str, y: str) -> bool:
    """safetensors writes ``__metadata__`` keys in random order (a Rust HashMap): with two or more
    keys no writer can be byte-identical to MindSpore. Same header as JSON and same data passes."""
    import json
    import struct

    if not x.endswith(".safetensors"):
        return False
    with open(x, "rb") as fx, open(y, "rb") as fy:
        bx, by = fx.read(), fy.read()
    (nx,), (ny,) = struct.unpack("<Q", bx[:8]), struct.unpack("<Q", by[:8])
    same_header = nx == ny and json.loads(bx[8 : 8 + nx]) == json.loads(by[8 : 8 + ny])
    return same_header and bx[8 + nx :] == by[8 + ny :]


def differing_tensors(ours: str, theirs: str, rel: str) -> set[str]:
    """Names whose dtype, shape or values differ (names present on one side only count too)."""
    from reshard.api import open_checkpoint

    with open_checkpoint(os.path.join(ours, rel)) as x, open_checkpoint(os.path.join(theirs, rel)) as y:
        names = set(x) ^ set(y)
        for name in set(x) & set(y):
            vx, vy = x.value(name), y.value(name)
            if isinstance(vx, str) or isinstance(vy, str):
                same = vx == vy
            else:
                same = vx.dtype == vy.dtype and vx.shape == vy.shape and np.array_equal(vx, vy)
            if not same:
                names.add(name)
        if x.metadata != y.metadata:
            names.add("__metadata__")
        return names


def assert_same_tensors(a_dir: str, b_dir: str, names: frozenset[str]) -> None:
    """The named tensors are equal in every pair of same-rank files of two trees (any formats)."""
    from reshard.api import open_checkpoint

    a_files = {os.path.dirname(k): k for k in tree_files(a_dir)}
    b_files = {os.path.dirname(k): k for k in tree_files(b_dir)}
    assert sorted(a_files) == sorted(b_files)
    for folder, rel in a_files.items():
        with open_checkpoint(os.path.join(a_dir, rel)) as x, open_checkpoint(os.path.join(b_dir, b_files[folder])) as y:
            for name in names & set(x):
                assert np.array_equal(x.array(name), y.array(name)), (folder, name)


def describe_difference(ours: str, theirs: str, rel: str) -> str:
    from reshard.api import open_checkpoint

    with open_checkpoint(os.path.join(ours, rel)) as x, open_checkpoint(os.path.join(theirs, rel)) as y:
        if list(x) != list(y):
            return f"order/names: ours {list(x)} theirs {list(y)}"
        for name in x:
            vx, vy = x.value(name), y.value(name)
            if isinstance(vx, str) or isinstance(vy, str):
                if vx != vy:
                    return f"{name}: {vx!r} vs {vy!r}"
                continue
            if vx.dtype != vy.dtype or vx.shape != vy.shape or not np.array_equal(vx, vy):
                return f"{name}: {vx.dtype}{vx.shape} vs {vy.dtype}{vy.shape}"
        return f"same tensors, different metadata: {x.metadata} vs {y.metadata}"


StageLayouts = Sequence[Mapping[str, ParamLayout]]


def write_stages(folder: str, stages: StageLayouts, fmt: str = "ckpt") -> str:
    """Per-stage strategy files in ``folder``; returns the folder."""
    os.makedirs(folder, exist_ok=True)
    for stage, layouts in enumerate(stages):
        write_strategy(
            os.path.join(folder, f"stage_{stage}.{'json' if fmt == 'json' else 'ckpt'}"),
            make_strategy(layouts, stage=stage),
        )
    return folder
