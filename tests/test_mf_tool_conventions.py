"""MindFormers' folder conventions through the CLI: where a source strategy is found when none is
given, and ``--file-suffix auto`` (the newest ``-{epoch}_{step}`` checkpoint every rank folder holds)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reshard import api
from reshard.formats.ckpt import save_ckpt
from reshard.synthetic import ModelShape, full_model, stage_strategies, write_stage_strategies

SHAPE = ModelShape(vocab=32, hidden=16, ffn=32, layers=2)


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "LOCAL_DEFAULT_PATH"}
    return subprocess.run(
        [sys.executable, "-m", "reshard.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**base, **(env or {})},
    )


def digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "reshard-manifest.json"
    }


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``output/checkpoint/rank_<r>/llama_rank_<r>-{epoch}_{step}.ckpt`` (steps 1_2 and 2_4 everywhere,
    3_6 in ranks 0 and 1 only: a save cut short) and ``output/strategy``, as a MindFormers job leaves them;
    ``full_<seed>.ckpt``: the full model of each step; a 2-rank strategy ``s2``."""
    root = tmp_path_factory.mktemp("mf_conventions")
    output = root / "output"
    write_stage_strategies(str(output / "strategy"), stage_strategies(SHAPE, dp=1, mp=2, pp=2, opt_shard=False), 2)
    write_stage_strategies(str(root / "s2"), stage_strategies(SHAPE, dp=1, mp=2, pp=1, opt_shard=False), 2)
    for seed, suffix, ranks in ((0, "-1_2", range(4)), (1, "-2_4", range(4)), (2, "-3_6", range(2))):
        full = root / f"full_{seed}.ckpt"
        save_ckpt(full, full_model(SHAPE, seed=seed))
        scratch = root / f"scratch_{seed}"
        api.transform(
            str(full), str(scratch), None, str(output / "strategy"), destination=api.Destination(manifest=False)
        )
        for rank in ranks:
            target = output / "checkpoint" / f"rank_{rank}" / f"llama_rank_{rank}{suffix}.ckpt"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(scratch / f"rank_{rank}" / f"checkpoint_{rank}.ckpt", target)
        shutil.rmtree(scratch)
    return root


def test_strategy_beside_the_checkpoint_folder(job: Path, tmp_path: Path) -> None:
    """Run from elsewhere: output/strategy is beside output/checkpoint."""
    ckpt = job / "output" / "checkpoint"
    proc = cli("transform", "--src", str(ckpt), "--dst", str(tmp_path / "a"), "--dst-strategy", "None",
               "--file-suffix", "-2_4", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    strategy = job / "output" / "strategy"
    assert f"no --src-strategy given: using {strategy} (the strategy folder beside the checkpoint folder" in proc.stderr
    explicit = cli("transform", "--src", str(ckpt), "--dst", str(tmp_path / "b"), "--dst-strategy", "None",
                   "--src-strategy", str(strategy), "--file-suffix", "-2_4", cwd=tmp_path)  # fmt: skip
    assert explicit.returncode == 0 and "no --src-strategy" not in explicit.stderr
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    assert cli("verify", str(tmp_path / "a"), str(job / "full_1.ckpt"), cwd=tmp_path).returncode == 0


def test_the_output_folder_of_the_working_directory_second(job: Path, tmp_path: Path) -> None:
    """A checkpoint copied away from its strategy: ./output/strategy (or $LOCAL_DEFAULT_PATH/strategy)."""
    moved = tmp_path / "moved" / "ckpt"
    shutil.copytree(job / "output" / "checkpoint", moved)
    args = ("transform", "--src", str(moved), "--dst", str(tmp_path / "out"), "--dst-strategy", "None",
            "--file-suffix", "-1_2")  # fmt: skip
    proc = cli(*args, cwd=job)
    assert proc.returncode == 0, proc.stderr
    assert f"using {job / 'output' / 'strategy'} (MindFormers' output folder" in proc.stderr
    shutil.rmtree(tmp_path / "out")
    proc = cli(*args, cwd=tmp_path, env={"LOCAL_DEFAULT_PATH": str(job / "output")})
    assert proc.returncode == 0 and "($LOCAL_DEFAULT_PATH)" in proc.stderr, proc.stderr


def test_beside_wins_over_the_output_folder(job: Path, tmp_path: Path) -> None:
    """Both places hold strategy files: the one beside the checkpoint is used (a wrong one in ./output is not)."""
    work = tmp_path / "work"
    write_stage_strategies(str(work / "output" / "strategy"), stage_strategies(SHAPE, 1, 2, 1, False), 2)
    proc = cli("transform", "--src", str(job / "output" / "checkpoint"), "--dst", str(tmp_path / "o"),
               "--dst-strategy", "None", "--file-suffix", "-1_2", cwd=work)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"using {job / 'output' / 'strategy'} (the strategy folder beside" in proc.stderr


def test_no_strategy_anywhere_names_the_places(job: Path, tmp_path: Path) -> None:
    moved = tmp_path / "moved" / "ckpt"
    shutil.copytree(job / "output" / "checkpoint", moved)
    proc = cli("transform", "--src", str(moved), "--dst", str(tmp_path / "out"), "--dst-strategy", "None",
               cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "several rank folders but no source strategy" in proc.stderr
    assert str(tmp_path / "moved" / "strategy") in proc.stderr and str(tmp_path / "output" / "strategy") in proc.stderr
    assert not (tmp_path / "out").exists()


def test_unify_verify_and_rank_list_find_it_too(job: Path, tmp_path: Path) -> None:
    st = tmp_path / "st"
    conv = cli("convert", str(job / "output" / "checkpoint"), str(st / "checkpoint"), "--to", "safetensors",
               "--file-suffix", "-2_4", cwd=tmp_path)  # fmt: skip
    assert conv.returncode == 0, conv.stderr
    shutil.copytree(job / "output" / "strategy", st / "strategy")
    unify = cli("unify", str(st / "checkpoint"), str(tmp_path / "unified"), cwd=tmp_path)
    assert unify.returncode == 0 and "no --src-strategy given: using" in unify.stderr, unify.stderr
    verify = cli("verify", str(job / "output" / "checkpoint"), str(job / "full_1.ckpt"), "--file-suffix", "-2_4",
                 cwd=tmp_path)  # fmt: skip
    assert verify.returncode == 0 and "no --a-strategy given: using" in verify.stderr, verify.stderr
    ranks = cli("rank-list", "1", "--dst-strategy", str(job / "s2"), cwd=job)  # ./output/strategy
    assert ranks.returncode == 0 and "no --src-strategy given: using" in ranks.stderr, ranks.stderr
    assert ranks.stdout.split() == cli("rank-list", "1", "--src-strategy", "output/strategy", "--dst-strategy",
                                       str(job / "s2"), cwd=job).stdout.split()  # fmt: skip
    nowhere = cli("rank-list", "1", "--dst-strategy", str(job / "s2"), cwd=tmp_path)
    assert nowhere.returncode == 2 and nowhere.stderr.count("\n") == 1 and "output/strategy" in nowhere.stderr


def test_file_suffix_auto_takes_the_newest_step_every_rank_holds(job: Path, tmp_path: Path) -> None:
    ckpt = str(job / "output" / "checkpoint")
    auto = cli("transform", "--src", ckpt, "--dst", str(tmp_path / "auto"), "--dst-strategy", "None",
               "--file-suffix", "auto", cwd=tmp_path)  # fmt: skip
    assert auto.returncode == 0, auto.stderr
    assert "--file-suffix auto: using -2_4 (epoch 2, step 4: the newest present in all 4 rank folders)" in auto.stderr
    assert "-3_6 is newer but missing in rank 2, 3" in auto.stderr
    fixed = cli("transform", "--src", ckpt, "--dst", str(tmp_path / "fixed"), "--dst-strategy", "None",
                "--file-suffix", "-2_4", cwd=tmp_path)  # fmt: skip
    assert fixed.returncode == 0 and digest(tmp_path / "auto") == digest(tmp_path / "fixed")
    assert cli("verify", str(tmp_path / "auto"), str(job / "full_1.ckpt"), cwd=tmp_path).returncode == 0
    conv = cli("convert", ckpt, str(tmp_path / "st"), "--to", "safetensors", "--file-suffix", "auto", cwd=tmp_path)
    assert conv.returncode == 0 and "using -2_4" in conv.stderr, conv.stderr
    assert sorted(p.name for p in (tmp_path / "st").rglob("*.safetensors")) == [
        f"llama_rank_{r}-2_4.safetensors" for r in range(4)
    ]


def test_file_suffix_auto_without_a_common_step(job: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(job / "output" / "checkpoint", ckpt)
    for rank in range(4):
        for path in (ckpt / f"rank_{rank}").iterdir():
            path.rename(path.with_name(f"step{rank}.ckpt"))
    proc = cli("transform", "--src", str(ckpt), "--dst", str(tmp_path / "o"), "--dst-strategy", "None",
               "--src-strategy", str(job / "output" / "strategy"), "--file-suffix", "auto", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "no -<epoch>_<step> checkpoint is present in every rank folder" in proc.stderr
    assert not (tmp_path / "o").exists()
