"""Replicas carry the same bytes (issue 18 item 1): sampled before any byte is written.

The layout says ranks 0..3 of the demo's first stage hold the same ``attention_norm`` (a 1-D
weight no dimension of the device matrix splits); a rank file whose copy differs (stale, or
another job's of the same shapes) passed every header check and the output took whichever copy
MindSpore's rule picks, exit 0. Every face that plans from a strategy and rank files now refuses
it in one line naming the parameter, the two ranks and the bytes that differ, nothing written;
``inspect --strategy`` says how many copies it compared. The sampling itself
(``reshard.sources.replicas``: slices up to 12 KiB whole, larger ones by their first, middle and
last 4 KiB) is tested on small safetensors files, with what it deliberately does not compare.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from reshard.errors import IntegrityError
from reshard.formats.base import TEMP_SUFFIX
from reshard.formats.safetensors import save_safetensors
from reshard.formats.strategy import make_strategy
from reshard.layout import ParamLayout
from reshard.sources import open_checkpoint, source_file
from reshard.sources.replicas import SAMPLE_BYTES, check_replicas, sample_blocks
from tests.trust_helpers import run_cli as run
from tests.trust_helpers import snapshot

NORM = "model.layers.0.attention_norm.weight"  # 128 float32: held whole by ranks 0..3 of stage 0


def tamper(path: str, name: str, at: int = 0) -> None:
    """Flip one byte of tensor ``name``'s data at offset ``at`` (a test's own copy of a file)."""
    with open_checkpoint(path) as index:
        offset = index.entries[name].segments[0][0] + at
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("demo"))
    proc = run("demo", "--dir", root)
    assert proc.returncode == 0, proc.stderr
    for tree, ext in (("ckpt_8ranks", "ckpt"), ("st_8ranks", "safetensors")):
        bad = os.path.join(root, f"bad_{tree}")
        shutil.copytree(os.path.join(root, tree), bad)
        tamper(os.path.join(bad, "rank_2", f"checkpoint_2.{ext}"), NORM, at=8)
    return {
        "root": root,
        "r8": f"{root}/bad_ckpt_8ranks",
        "st8": f"{root}/bad_st_8ranks",
        "s8": f"{root}/merged/src_strategy.ckpt",
        "s4": f"{root}/merged/dst_strategy.ckpt",
        "good": f"{root}/ckpt_8ranks",
    }


def faces(d: dict[str, str], out: str) -> dict[str, list[str]]:
    src = ["--src-strategy", d["s8"]]
    return {
        "transform": ["transform", "--src", d["r8"], *src, "--dst", out],
        "transform 8->4": ["transform", "--src", d["r8"], *src, "--dst-strategy", d["s4"], "--dst", out],
        "plan": ["plan", "--src", d["r8"], *src, "--dst", out],
        "unify": ["unify", d["st8"], out, "--src-strategy", d["s8"]],
        "inspect": ["inspect", d["r8"], "--strategy", d["s8"]],
    }


@pytest.mark.parametrize("face", ["transform", "transform 8->4", "plan", "unify", "inspect"])
def test_a_replica_that_differs_is_refused_before_writing(demo: dict[str, str], tmp_path: Path, face: str) -> None:
    out = tmp_path / "out"
    before = snapshot(demo["root"])
    proc = run(*faces(demo, str(out))[face])
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reshard: error:"), proc.stderr
    assert NORM in lines[0] and "ranks 0 and 2" in lines[0], lines[0]
    assert "different bytes at offset 0..512" in lines[0] and "rank_2" in lines[0], lines[0]
    assert not out.exists()
    assert snapshot(demo["root"]) == before


def test_the_drop_in_refuses_it_too(demo: dict[str, str], tmp_path: Path) -> None:
    from reshard.mindspore import parallel as ms

    with pytest.raises(IntegrityError, match="ranks 0 and 2 hold different bytes"):
        ms.transform_checkpoints(demo["r8"], str(tmp_path / "out"), "checkpoint_", demo["s8"], demo["s4"])
    assert not any((tmp_path / "out").rglob("*.ckpt")) if (tmp_path / "out").exists() else True
    files = {r: os.path.join(demo["r8"], f"rank_{r}", f"checkpoint_{r}.ckpt") for r in range(8)}
    with pytest.raises(IntegrityError, match=NORM):
        ms.transform_checkpoint_by_rank(0, files, str(tmp_path / "one.ckpt"), demo["s8"], demo["s4"])
    assert not (tmp_path / "one.ckpt").exists()


def test_the_demos_own_replicas_agree_and_inspect_says_how_many_it_compared(demo: dict[str, str]) -> None:
    proc = run("inspect", demo["good"], "--strategy", demo["s8"])
    assert proc.returncode == 0, proc.stderr
    assert "81 replica slices hold the same sampled bytes" in proc.stdout, proc.stdout


# --------------------------------------------------------------------------- the sampling


def test_small_slices_are_compared_whole_large_ones_by_three_blocks() -> None:
    assert sample_blocks(0) == ((0, 0),)
    assert sample_blocks(3 * SAMPLE_BYTES) == ((0, 3 * SAMPLE_BYTES),)
    n = 1 << 20
    blocks = sample_blocks(n)
    assert blocks == ((0, 4096), ((n - 4096) // 2, (n + 4096) // 2), (n - 4096, n))
    assert sum(b - a for a, b in blocks) == 3 * SAMPLE_BYTES  # the bound per replica, whatever the size


DP2 = ParamLayout((2, 1), (-1, -1))  # two data-parallel copies of a [64, 256] tensor
SHARDED = ParamLayout((2, 1), (-1, -1), opt_shard_step=1, opt_shard_size=2)  # each rank half the rows


def two_ranks(tmp_path: Path, edit: dict[int, dict[str, np.ndarray]]) -> dict[int, object]:
    """Two rank files of a dp2 job: ``w`` replicated, ``adam_m.w`` optimizer-sharded, a per-rank step."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 256)).astype(np.float32)  # 64 KiB
    moments = rng.standard_normal((64, 256)).astype(np.float32)
    files = {}
    for rank in (0, 1):
        tensors = {
            "w": w.copy(),
            "adam_m.w": moments[rank * 32 : (rank + 1) * 32].copy(),
            "global_step": np.array([rank], np.int32),
        }
        tensors.update(edit.get(rank, {}))
        path = str(tmp_path / f"rank_{rank}.safetensors")
        save_safetensors(path, tensors)
        files[rank] = source_file(path, rank)
    return files


STRATEGY = make_strategy({"w": DP2, "adam_m.w": SHARDED})


def changed(at: int) -> np.ndarray:
    w = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    flat = w.reshape(-1).view(np.uint8)
    flat[at] ^= 0xFF
    return w


@pytest.mark.parametrize(
    ("at", "block"), [(0, "0..4096"), (32 * 1024, "30720..34816"), (64 * 1024 - 1, "61440..65536")]
)
def test_each_sampled_block_is_compared(tmp_path: Path, at: int, block: str) -> None:
    files = two_ranks(tmp_path, {1: {"w": changed(at)}})
    with pytest.raises(IntegrityError, match=f"w: ranks 0 and 1 hold different bytes at offset {block} "):
        check_replicas(files, STRATEGY)  # type: ignore[arg-type]


def test_what_the_sample_leaves_out_and_what_is_no_replica(tmp_path: Path) -> None:
    # a byte between the sampled blocks is not compared (docs/checks.md, "What no check can catch");
    # an optimizer-sharded state and a per-rank step counter legitimately differ
    files = two_ranks(tmp_path, {1: {"w": changed(8 * 1024)}})
    done = check_replicas(files, STRATEGY)  # type: ignore[arg-type]
    assert done.tensors == 1 and done.bytes_read == 2 * 3 * SAMPLE_BYTES


def test_copies_of_another_size_are_refused(tmp_path: Path) -> None:
    # casting plans both copies as one dtype; the files still hold another size each
    files = two_ranks(tmp_path, {1: {"w": np.zeros((64, 256), np.float16)}})
    with pytest.raises(IntegrityError, match="rank 1 holds 32768 bytes, rank 0 65536"):
        check_replicas(files, STRATEGY)  # type: ignore[arg-type]


def test_encrypted_copies_are_compared_from_their_decrypted_bytes(tmp_path: Path) -> None:
    from reshard.formats.ckpt import save_ckpt
    from reshard.sources import ReadOptions

    key = bytes(range(16))
    read = ReadOptions(dec_key=key)
    files = {}
    for rank in (0, 1):
        w = changed(63 * 1024) if rank else np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
        path = str(tmp_path / f"rank_{rank}.ckpt")
        save_ckpt(path, {"w": w}, enc_key=key)
        files[rank] = source_file(path, rank, read)
    with pytest.raises(IntegrityError, match=r"ranks 0 and 1 hold different bytes at offset 61440\.\.65536"):
        check_replicas(files, STRATEGY, read)  # type: ignore[arg-type]


def test_the_check_runs_beside_the_copy_and_the_output_waits_for_it(
    demo: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check's verdict comes while the copy runs (``ops.pending``): a failing one still leaves no output."""
    from reshard import api
    from reshard.sources import replicas

    out = tmp_path / "out"
    seen: dict[str, bool] = {}

    def slow_check(*args: object, **kwargs: object) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(out.rglob(f"*{TEMP_SUFFIX}")):
            time.sleep(0.001)
        seen["copy started first"] = any(out.rglob(f"*{TEMP_SUFFIX}"))
        raise IntegrityError("ranks 0 and 2 hold different bytes (a test's check)", "rank_2")

    monkeypatch.setattr(replicas, "check_replicas", slow_check)
    with pytest.raises(IntegrityError, match="a test's check"):
        api.transform(demo["good"], str(out), demo["s8"], None)
    assert seen == {"copy started first": True}
    assert not out.exists()


def test_its_error_comes_before_a_refused_destination(demo: dict[str, str], tmp_path: Path) -> None:
    """As when the check ran before the copy: a stale rank file is the problem to tell first."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("a user's file")
    proc = run("transform", "--src", demo["r8"], "--src-strategy", demo["s8"], "--dst", str(out))
    assert proc.returncode == 2, proc.stderr
    assert "ranks 0 and 2" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]


def test_a_passing_check_lets_every_output_in(demo: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run("transform", "--src", demo["good"], "--src-strategy", demo["s8"], "--dst-strategy", demo["s4"],
               "--dst", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.parent.name for p in out.rglob("*.ckpt")) == [f"rank_{r}" for r in range(4)]
