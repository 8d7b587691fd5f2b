"""Same inputs, same bytes: outputs and manifests must not depend on Python's hash seed.

Each run is a separate process with its own ``PYTHONHASHSEED``, so any set-order iteration that
reaches the bytes (unify once merged source metadata in set order) shows up as a difference.
"""

from __future__ import annotations

import os

import pytest

from reshard.formats.safetensors import read_safetensors, save_safetensors
from tests.trust_helpers import make_job, run_cli, tree

SEEDS = ("1", "2", "3")


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The 8-rank job, its safetensors twin with different metadata per rank (as a crc_num differs)."""
    job = make_job(str(tmp_path_factory.mktemp("det")))
    tagged = os.path.join(job["root"], "tagged")
    for rank in range(8):
        folder = os.path.join(job["r8st"], f"rank_{rank}")
        (name,) = os.listdir(folder)
        with read_safetensors(os.path.join(folder, name)) as index:
            values = {n: index.array(n).copy() for n in index.entries}
        meta = {"format": "ms", "crc_num": str(1000 + rank), f"only_rank_{rank}": "x"}
        save_safetensors(os.path.join(tagged, f"rank_{rank}", name), values, meta)
    job["tagged"] = tagged
    return job


def _runs(args: list[str], dst_root: str) -> list[dict[str, str]]:
    trees = []
    for seed in SEEDS:
        dst = os.path.join(dst_root, f"seed{seed}")
        proc = run_cli(*args, dst, env={"PYTHONHASHSEED": seed})
        assert proc.returncode == 0, proc.stderr
        trees.append(tree(dst))
    return trees


def test_unify_bytes_and_manifest_do_not_depend_on_the_hash_seed(job: dict[str, str], tmp_path) -> None:
    trees = _runs(["unify", job["tagged"], "--src-strategy", job["s8"], "--workers", "2"], str(tmp_path))
    assert "reshard-manifest.json" in trees[0]
    assert all(t == trees[0] for t in trees[1:])


def test_transform_bytes_and_manifest_do_not_depend_on_the_hash_seed(job: dict[str, str], tmp_path) -> None:
    args = ["transform", "--src", job["tagged"], "--src-strategy", job["s8"], "--dst-strategy", job["s4"], "--dst"]
    trees = _runs(args, str(tmp_path))
    assert len([p for p in trees[0] if p.endswith(".safetensors")]) == 4
    assert all(t == trees[0] for t in trees[1:])
