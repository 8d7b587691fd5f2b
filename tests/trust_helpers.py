"""Shared helpers of the "trust" tests (resume, verify, encryption, bad inputs): small synthetic
jobs, running the CLI as a real process, and snapshots that prove inputs never change."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Mapping

from reshard import api
from reshard.formats.ckpt import save_ckpt
from reshard.formats.strategy import merge_pipeline_strategies
from reshard.synthetic import ModelShape, full_model, stage_strategies, write_stage_strategies

SMALL = ModelShape(vocab=32, hidden=8, ffn=16, layers=2)
CLI_TIMEOUT = 300  # seconds; a hang fails the test instead of the whole run


def run_cli(
    *args: str, env: Mapping[str, str] | None = None, cwd: str | None = None
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "reshard.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=CLI_TIMEOUT,
    )


def make_job(root: str, shape: ModelShape = SMALL) -> dict[str, str]:
    """full.ckpt, an 8-rank .ckpt tree (dp2 mp2 pp2, opt shards), its safetensors twin, strategies
    for 8 and 4 ranks (per-stage folders and merged files)."""
    model = full_model(shape)
    full = os.path.join(root, "full", "model.ckpt")
    save_ckpt(full, model)
    write_stage_strategies(f"{root}/s8", stage_strategies(shape, 2, 2, 2, True), 4)
    write_stage_strategies(f"{root}/s4", stage_strategies(shape, 1, 2, 2, False), 2)
    merge_pipeline_strategies(f"{root}/s8", f"{root}/merged/s8.ckpt")
    merge_pipeline_strategies(f"{root}/s4", f"{root}/merged/s4.ckpt")
    api.transform(full, f"{root}/r8", None, f"{root}/merged/s8.ckpt", destination=api.Destination(manifest=False))
    api.convert(f"{root}/r8", f"{root}/r8st", "safetensors", destination=api.Destination(manifest=False))
    return {
        "root": root,
        "full": full,
        "r8": f"{root}/r8",
        "r8st": f"{root}/r8st",
        "s8": f"{root}/merged/s8.ckpt",
        "s4": f"{root}/merged/s4.ckpt",
        "s8dir": f"{root}/s8",
        "s4dir": f"{root}/s4",
    }


def sha256(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def tree(root: str) -> dict[str, str]:
    """relative path -> sha256 of every file below root (nothing excluded)."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            out[os.path.relpath(path, root)] = sha256(path)
    return out


def snapshot(root: str) -> dict[str, tuple[str, int, int]]:
    """sha256, mode and mtime (ns) of every file and folder below root: inputs must never change."""
    out: dict[str, tuple[str, int, int]] = {}
    for folder, dirs, names in os.walk(root):
        for name in dirs:
            st = os.stat(os.path.join(folder, name))
            out[os.path.join(folder, name) + "/"] = ("", st.st_mode, 0)
        for name in names:
            path = os.path.join(folder, name)
            st = os.stat(path)
            out[path] = (sha256(path), st.st_mode, st.st_mtime_ns)
    return out


def temp_files(root: str) -> list[str]:
    """Leftover temporary files of reshard below root."""
    return [os.path.join(f, n) for f, _, names in os.walk(root) for n in names if n.endswith(".reshard-tmp")]


BIG = ModelShape.for_bytes(40_000_000)  # ~57 MB full checkpoint with Adam moments


def make_big_job(root: str, workers: int, shape: ModelShape = BIG) -> dict:
    """An 8-rank job of ~57 MB (of ``shape``), a merged 16-rank target strategy (``s16``), the CLI
    arguments of the 8 -> 16 transform (``args``, without ``--dst``) and the tree of its uninterrupted
    result (``reference``): what the interrupt, resume and lock tests cut short and compare against."""
    job = make_job(root, shape)
    write_stage_strategies(f"{root}/s16", stage_strategies(shape, 2, 4, 2, False), 8)
    merge_pipeline_strategies(f"{root}/s16", f"{root}/merged/s16.ckpt")
    job["s16"] = f"{root}/merged/s16.ckpt"
    job["args"] = [
        "transform",
        "--src",
        job["r8"],
        "--src-strategy",
        job["s8"],
        "--dst-strategy",
        job["s16"],
        "--workers",
        str(workers),
    ]
    ref = f"{root}/reference"
    proc = run_cli(*job["args"], "--dst", ref)
    assert proc.returncode == 0, proc.stderr
    job["reference"] = tree(ref)
    return job
