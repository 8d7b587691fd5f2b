"""The strategy and the files agree (issue 18 items 1 and 11): checked before any byte is written.

Item 1: a strategy of the right size but another job's layout (the demo's 8 ranks are dp2 x mp2
with an optimizer shard; this one says dp1 x mp4, none) was accepted and wrote a scrambled model,
exit 0. Every face that plans from a strategy and headers now refuses it in one line, nothing
written; ``inspect --strategy`` runs the same checks. The checks themselves are tested in memory
(``reshard.plan.agree``): each names the parameter, the ranks and the two facts that disagree.

Item 11: one pipeline stage's strategy file (rank 0's of a 2-stage 8-rank job, what MindSpore's own
system test passes to ``unified_safetensors``) unifies that stage's parameters, as MindSpore does;
another stage's file, or another job's strategy, is still refused (the oracle comparison is
``tests/test_agree_oracle.py``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from reshard import dtypes
from reshard.errors import LayoutError
from reshard.formats.strategy import make_strategy, merge_pipeline_strategies, write_strategy
from reshard.layout import ParamLayout, slice_shape
from reshard.plan import SourceFile, SourceTensor, plan_transform
from reshard.plan.agree import check_agreement, first_stage_alone
from reshard.synthetic import ModelShape, stage_strategies, write_stage_strategies
from tests.trust_helpers import run_cli as run
from tests.trust_helpers import snapshot

EMBEDDING = "model.tok_embeddings.embedding_weight"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("demo"))
    proc = run("demo", "--dir", root)
    assert proc.returncode == 0, proc.stderr
    wrong_dir = os.path.join(root, "wrong_stages")
    write_stage_strategies(wrong_dir, stage_strategies(ModelShape(), dp=1, mp=4, pp=2, opt_shard=False), 4)
    wrong = os.path.join(root, "wrong.ckpt")
    merge_pipeline_strategies(wrong_dir, wrong)
    return {
        "root": root,
        "r8": f"{root}/ckpt_8ranks",
        "st8": f"{root}/st_8ranks",
        "s8": f"{root}/merged/src_strategy.ckpt",
        "s4": f"{root}/merged/dst_strategy.ckpt",
        "s8_dir": f"{root}/strategy_8",
        "wrong": wrong,
        "full": f"{root}/full/model.ckpt",
    }


def one_error(proc) -> str:  # type: ignore[no-untyped-def]
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reshard: error:"), proc.stderr
    return lines[0]


# --------------------------------------------------------------------------- item 1, every face


def faces(d: dict[str, str], out: str) -> dict[str, list[str]]:
    wrong = ["--src-strategy", d["wrong"]]
    to4 = [*wrong, "--dst-strategy", d["s4"]]
    return {
        "transform": ["transform", "--src", d["r8"], *wrong, "--dst", out],
        "transform 8->4": ["transform", "--src", d["r8"], *to4, "--dst", out],
        "transform --ranks": ["transform", "--src", d["r8"], *to4, "--dst", out, "--ranks", "0"],
        "plan": ["plan", "--src", d["r8"], *wrong, "--dst", out],
        "unify": ["unify", d["st8"], out, "--src-strategy", d["wrong"]],
        "rank-list --files": ["rank-list", "0", "--src", d["r8"], *to4, "--files"],
        "verify": ["verify", d["full"], d["r8"], "--b-strategy", d["wrong"]],
        "inspect": ["inspect", d["r8"], "--strategy", d["wrong"]],
    }


FACES = ["transform", "transform 8->4", "transform --ranks", "plan", "unify", "rank-list --files", "verify", "inspect"]


@pytest.mark.parametrize("face", FACES)
def test_another_jobs_layout_of_the_right_size_is_refused_before_writing(
    demo: dict[str, str], tmp_path: Path, face: str
) -> None:
    out = tmp_path / "out"
    before = snapshot(demo["root"])
    line = one_error(run(*faces(demo, str(out))[face]))
    assert EMBEDDING in line and "rank 0" in line and "rank 4" in line, line
    assert "[512, 128]" in line and "[256, 256]" in line, line  # the two global shapes that disagree
    assert not out.exists()
    assert snapshot(demo["root"]) == before


def test_drop_in_refuses_it_too(demo: dict[str, str], tmp_path: Path) -> None:
    from reshard.mindspore import parallel as ms

    with pytest.raises(LayoutError, match="shared by pipeline stages"):
        ms.transform_checkpoints(demo["r8"], str(tmp_path / "out"), "checkpoint_", demo["wrong"], None)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.ckpt"))
    files = {r: os.path.join(demo["r8"], f"rank_{r}", f"checkpoint_{r}.ckpt") for r in range(4)}
    with pytest.raises(LayoutError):
        ms.transform_checkpoint_by_rank(  # stage 0's ranks only: its slices disagree with one another
            0, files, str(tmp_path / "one.ckpt"), write_mixed_stage(tmp_path), None
        )
    assert not (tmp_path / "one.ckpt").exists()


def write_mixed_stage(tmp_path: Path) -> str:
    """A 4-rank strategy that says rank 0..3 hold w2 whole rows of a model-parallel split (mp4):
    the demo's ranks 0..3 hold [64, 128] slices, which give a [64, 512] w2 but a [128, 256] adam_m
    of it under the demo's own (optimizer-sharded) layout for the moments."""
    name = "model.layers.0.feed_forward.w2.weight"
    layouts = {name: ParamLayout((1, 4), (-1, 0)), "adam_m." + name: ParamLayout((2, 2), (-1, 0), 2, 2)}
    path = str(tmp_path / "mixed.ckpt")
    write_strategy(path, make_strategy(layouts))
    return path


def test_inspect_says_the_checks_passed(demo: dict[str, str]) -> None:
    proc = run("inspect", demo["r8"], "--strategy", demo["s8"])
    assert proc.returncode == 0, proc.stderr
    assert "checks: the strategy and the files agree" in proc.stdout
    info = json.loads(run("inspect", demo["r8"], "--strategy", demo["s8"], "--json").stdout)
    assert info["checks"] == {"parameters": 117, "ranks": 8, "replicas": 81, "warnings": []}


def test_inspect_warns_of_a_strategy_for_fewer_ranks(demo: dict[str, str]) -> None:
    proc = run("inspect", demo["r8"], "--strategy", os.path.join(demo["s8_dir"], "ckpt_strategy_rank_0.ckpt"))
    assert proc.returncode == 0, proc.stderr
    assert "reshard: warning: the strategy describes 4 rank(s)" in proc.stderr


# --------------------------------------------------------------------------- item 1, each check

ROWS = ParamLayout((2, 2), (0, -1))  # dp2 x mp2, rows split over mp
F32 = dtypes.FLOAT32


def files_of(
    layouts: dict[str, tuple[ParamLayout, tuple[int, ...]]], ranks: int, stage: int = 0
) -> dict[int, SourceFile]:
    table = {}
    for name, (p, full) in layouts.items():
        shape = slice_shape(p, full)
        table[name] = SourceTensor(F32, shape, 4 * math.prod(shape))
    return {r: SourceFile(f"/x/rank_{r}/c.ckpt", r, dict(table)) for r in range(stage * ranks, (stage + 1) * ranks)}


def tensor(*shape: int) -> SourceTensor:
    return SourceTensor(F32, shape, 4 * math.prod(shape))


def test_every_rank_of_a_stage_holds_the_slice_the_layout_gives() -> None:
    files = files_of({"w": (ROWS, (8, 4))}, 4)
    strategy = make_strategy({"w": ROWS})
    assert check_agreement(files, strategy, 4).full_shapes == {"w": (8, 4)}
    files[3].tensors["w"] = tensor(4, 2)
    with pytest.raises(LayoutError, match=r"w: rank 3 holds Float32 \[4, 2\] but rank 0 holds Float32 \[4, 4\]"):
        check_agreement(files, strategy, 4)


def test_replicas_have_one_dtype() -> None:
    files = files_of({"w": (ROWS, (8, 4))}, 4)
    files[2].tensors["w"] = SourceTensor(dtypes.FLOAT16, (4, 4), 32)
    with pytest.raises(LayoutError, match=r"rank 2 holds Float16 \[4, 4\]"):
        check_agreement(files, make_strategy({"w": ROWS}), 4)


def test_an_optimizer_state_has_its_parameters_global_shape() -> None:
    sharded = ParamLayout((2, 2), (0, -1), 2, 2)
    files = files_of({"w": (ROWS, (8, 4)), "adam_m.w": (sharded, (8, 4))}, 4)
    ok = make_strategy({"w": ROWS, "adam_m.w": sharded})
    check_agreement(files, ok, 4)
    wrong = make_strategy({"w": ROWS, "adam_m.w": ROWS})  # the moment's optimizer shard left out
    with pytest.raises(LayoutError, match=r"adam_m.w: .* give a \[4, 4\] tensor, but its parameter w .* is \[8, 4\]"):
        check_agreement(files, wrong, 4)


def test_a_layout_that_does_not_fit_the_slice_names_both() -> None:
    files = files_of({"w": (ParamLayout((4,), (-1,)), (8,))}, 4)
    with pytest.raises(LayoutError, match=r"w: rank 0 holds Float32 \[8\], which the strategy's layout"):
        check_agreement(files, make_strategy({"w": ROWS}), 4)


def test_ranks_sharing_one_header_table_are_checked_once_and_beyond_ranks_not_at_all() -> None:
    files = files_of({"w": (ROWS, (8, 4))}, 4)
    shared = files[0].tensors
    for f in files.values():
        f.tensors = shared
    files[9] = SourceFile("/x/rank_9/c.ckpt", 9, {"w": tensor(1, 1)})  # beyond the strategy: the rank checks say so
    assert check_agreement(files, make_strategy({"w": ROWS}), 4).ranks == 4


def test_the_planner_checks_before_planning() -> None:
    files = files_of({"w": (ROWS, (8, 4))}, 4)
    files[1].tensors["w"] = tensor(2, 4)
    with pytest.raises(LayoutError, match="rank 1 holds"):
        plan_transform(files, make_strategy({"w": ROWS}), None, "/nonexistent", "c_", "ckpt")


# --------------------------------------------------------------------------- item 11, unify one stage's file


def test_unify_with_the_first_stages_file_unifies_that_stage(demo: dict[str, str], tmp_path: Path) -> None:
    stage0 = os.path.join(demo["s8_dir"], "ckpt_strategy_rank_0.ckpt")
    proc = run("unify", demo["st8"], str(tmp_path / "u0"), "--src-strategy", stage0)
    assert proc.returncode == 0, proc.stderr
    assert "only that stage's parameters are unified, as MindSpore does" in proc.stderr
    index = json.loads((tmp_path / "u0" / "param_name_map.json").read_text())["weight_map"]
    assert EMBEDDING in index and "model.layers.1.attention.wq.weight" in index
    assert "model.layers.2.attention.wq.weight" not in index and "lm_head.weight" not in index
    whole = run("unify", demo["st8"], str(tmp_path / "all"), "--src-strategy", demo["s8"])
    assert whole.returncode == 0, whole.stderr
    proc = run("verify", str(tmp_path / "u0"), str(tmp_path / "all"), "--include", "model.layers.[01].*")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_unify_with_a_later_stages_file_is_refused(demo: dict[str, str], tmp_path: Path) -> None:
    stage1 = os.path.join(demo["s8_dir"], "ckpt_strategy_rank_4.ckpt")
    line = one_error(run("unify", demo["st8"], str(tmp_path / "u4"), "--src-strategy", stage1))
    assert "pipeline stage 1's alone" in line and "MindSpore would unify them wrongly" in line, line
    assert not (tmp_path / "u4").exists()


def test_a_smaller_jobs_strategy_on_rank_folders_holding_the_same_names_is_refused() -> None:
    files = files_of({"w": (ROWS, (8, 4))}, 4)
    files.update(files_of({"w": (ROWS, (8, 4))}, 4, stage=1))
    strategy = make_strategy({"w": ROWS})
    assert not first_stage_alone(files, strategy, 0)  # 8 folders of one job holding the same names
    files.update(files_of({"v": (ROWS, (8, 4))}, 4, stage=1))
    assert first_stage_alone(files, strategy, 0)  # the later ranks hold another stage's parameters
    assert not first_stage_alone(files, strategy, 1)
    del files[7]
    assert not first_stage_alone(files, strategy, 0)  # not whole stages
