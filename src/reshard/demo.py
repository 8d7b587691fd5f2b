"""``reshard demo``: the embedded example, end to end, checked.

Builds a small LLaMA-like model and the strategy files of an 8-rank job (2 pipeline stages x
data-parallel 2 x model-parallel 2, optimizer shards, an embedding shared by both stages with a
different layout in each) with reshard's own code, then shows each operation on it (also into
MindFormers 2.x's Checkpoint 2.0 layout and back) and checks every result against the original
full tensors.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable

import numpy as np

from reshard import api
from reshard.errors import UsageError
from reshard.formats import rank_dirs
from reshard.formats.ckpt import save_ckpt
from reshard.formats.strategy import merge_pipeline_strategies
from reshard.synthetic import ModelShape, full_model, stage_strategies, write_stage_strategies


def _check_full(path_or_dir: str, expected: dict[str, np.ndarray]) -> int:
    """Compare every tensor of a full checkpoint (file, or unified folder) with the original."""
    files = (
        [path_or_dir]
        if os.path.isfile(path_or_dir)
        else [
            os.path.join(path_or_dir, n)
            for n in sorted(os.listdir(path_or_dir))
            if n.endswith((".ckpt", ".safetensors"))
        ]
    )
    checked = 0
    for path in files:
        with api.open_checkpoint(path) as index:
            for name in index:
                want = expected[name]
                got = index.value(name)
                if not np.array_equal(np.asarray(got), np.asarray(want)):
                    raise AssertionError(f"{name} differs in {path}")
                checked += 1
    return checked


def main(work_dir: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    if work_dir is not None:
        _check_work_dir(work_dir)
    own_dir = work_dir is None
    root = work_dir or tempfile.mkdtemp(prefix="reshard-demo-")
    os.makedirs(root, exist_ok=True)
    table = Table(title=f"reshard demo in {root}")
    for col in ("step", "result", "time"):
        table.add_column(col)

    def step(title: str, action: Callable[[], str]) -> None:
        start = time.perf_counter()
        result = action()
        table.add_row(title, result, f"{time.perf_counter() - start:.2f} s")

    shape = ModelShape()
    model = full_model(shape)
    full_path = os.path.join(root, "full", "model.ckpt")
    src_strategy_dir = os.path.join(root, "strategy_8")
    dst_strategy_dir = os.path.join(root, "strategy_4")
    src_merged = os.path.join(root, "merged", "src_strategy.ckpt")
    dst_merged = os.path.join(root, "merged", "dst_strategy.ckpt")
    ranks8 = os.path.join(root, "ckpt_8ranks")

    def build_full_model() -> str:
        save_ckpt(full_path, model)
        with open(os.path.join(root, "config.json"), "w", encoding="utf-8") as fh:  # for --hf-config
            json.dump(shape.hf_config(), fh, indent=2)
        return f"{len(model)} tensors, {os.path.getsize(full_path) / 2**20:.1f} MiB"

    step("build full model", build_full_model)
    write_stage_strategies(src_strategy_dir, stage_strategies(shape, dp=2, mp=2, pp=2, opt_shard=True), 4)
    write_stage_strategies(dst_strategy_dir, stage_strategies(shape, dp=1, mp=2, pp=2, opt_shard=False), 2)
    step(
        "merge-strategies (8 and 4 ranks)",
        lambda: (
            merge_pipeline_strategies(src_strategy_dir, src_merged),
            merge_pipeline_strategies(dst_strategy_dir, dst_merged),
            "2 stages each",
        )[2],
    )
    step("transform full -> 8 ranks (ckpt)", lambda: _files(api.transform(full_path, ranks8, None, src_merged)))
    step(
        "convert 8 ranks -> safetensors",
        lambda: _files(api.convert(ranks8, os.path.join(root, "st_8ranks"), "safetensors")),
    )
    step(
        "transform 8 -> 4 ranks (dp1 mp2 pp2)",
        lambda: _files(api.transform(ranks8, os.path.join(root, "ckpt_4ranks"), src_merged, dst_merged)),
    )
    full_back = os.path.join(root, "full_back")
    step("transform 8 ranks -> full, check", lambda: _to_full_and_check(ranks8, full_back, src_merged, model))
    four = os.path.join(root, "ckpt_4ranks")
    step(
        "transform 4 ranks -> full, check",
        lambda: _to_full_and_check(four, os.path.join(root, "full_from_4"), dst_merged, model),
    )
    mf2 = os.path.join(root, "mf2_8ranks")
    step(
        "8 ranks -> MindFormers 2.x Checkpoint 2.0",
        lambda: _files(
            api.transform(
                os.path.join(root, "st_8ranks"),
                mf2,
                src_merged,
                src_merged,
                output=api.OutputSpec(format="checkpoint2", iteration=1000),
            )
        ),
    )
    step(
        "Checkpoint 2.0 -> full, check",
        lambda: _to_full_and_check(mf2, os.path.join(root, "full_from_mf2"), None, model),
    )
    console.print(table)
    if own_dir and os.environ.get("RESHARD_DEMO_KEEP") is None:
        shutil.rmtree(root, ignore_errors=True)
        console.print(
            "(temporary demo folder removed; `reshard demo --dir DIR` keeps the files, then: "
            "reshard inspect DIR/ckpt_8ranks/rank_0/checkpoint_0.ckpt --strategy "
            "DIR/merged/src_strategy.ckpt)"
        )
    else:
        rank0 = rank_dirs.rank_output(ranks8, 0, "checkpoint_", "ckpt")
        console.print(f"next: reshard inspect {rank0} --strategy {src_merged}")


def _check_work_dir(work_dir: str) -> None:
    """The demo writes a dozen folders: only into a new or empty folder, never over the user's files."""
    if os.path.exists(work_dir) and not os.path.isdir(work_dir):
        raise UsageError("--dir is a file; give a new or empty folder", work_dir)
    if os.path.isdir(work_dir) and os.listdir(work_dir):
        raise UsageError("--dir is not empty; give a new or empty folder (the demo never writes over files)", work_dir)
    try:
        os.makedirs(work_dir, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create the folder: {exc.strerror or exc}", work_dir) from None


def _to_full_and_check(src: str, dst: str, strategy: str | None, model: dict[str, np.ndarray]) -> str:
    """``src`` to one full checkpoint (a Checkpoint 2.0 carries its layouts: no strategy), checked."""
    report = api.transform(src, dst, strategy, None)
    checked = _check_full(report.plan.files[0].path, model)
    return f"{checked} tensors equal the original"


def _files(report: api.Report) -> str:
    p = report.plan
    return f"{len(p.files)} files, {p.bytes_written / 2**20:.1f} MiB"


__all__ = ["main"]
