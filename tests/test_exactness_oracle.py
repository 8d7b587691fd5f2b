"""Exactness against MindSpore 2.10 where reshard's planner once chose differently or failed.

* By-stage mode: MindSpore picks ``_transform_checkpoint_by_stage`` (``{prefix}{r}_part{stage}.ckpt``)
  only when the source's names, optimizer states left out on both sides, are a strict subset of
  the destination's; a destination that merely adds optimizer states is the all-stage mode.
* Device counts that do not divide (8 -> 6, 4 -> 6) from a pipelined source whose tied
  embedding has a different layout in each stage. MindSpore refuses these; the reference is
  MindSpore's own full -> 6 (same tensors) and its two-step source -> full -> 6 (same bytes: a
  direct transform orders names as MindSpore's load order does).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from reshard import api
from reshard import mindspore as rms
from reshard.formats.ckpt import save_ckpt
from reshard.formats.strategy import make_strategy, merge_pipeline_strategies, write_strategy
from reshard.layout import ParamLayout as L
from reshard.synthetic import ModelShape, full_model, stage_strategies, write_stage_strategies
from tests.msjobs import assert_same_tree, run_ms_jobs, tree_files

pytestmark = pytest.mark.oracle

# --------------------------------------------------------------------------------------------
# by-stage mode

W = np.arange(32, dtype=np.float32).reshape(8, 4)
B = np.arange(4, dtype=np.float32) - 2
# name -> (source layouts, destination layouts, MindSpore's mode)
BY_STAGE_CASES = {
    # same model names; only the destination holds optimizer states: all-stage mode
    "dst_adds_optimizer_states": (
        {"w": L((2,), (0, -1)), "b": L((2,), (-1,))},
        {
            "w": L((2,), (-1, 0)),
            "b": L((2,), (0,)),
            "adam_m.w": L((2,), (-1, 0)),
            "adam_v.w": L((2,), (-1, 0)),
            "accu_grads.b": L((2,), (0,)),
        },
        "all-stage",
    ),
    # the destination adds a model parameter too: by-stage mode
    "dst_adds_a_parameter": (
        {"w": L((2,), (0, -1))},
        {"w": L((2,), (-1, 0)), "b": L((2,), (0,)), "adam_m.w": L((2,), (-1, 0))},
        "by-stage",
    ),
    # only the source holds optimizer states, same model names otherwise: by-stage mode
    "src_holds_optimizer_states": (
        {"w": L((2,), (0, -1)), "adam_m.w": L((2,), (0, -1))},
        {"w": L((2,), (-1, 0)), "b": L((2,), (0,))},
        "by-stage",
    ),
}


def test_by_stage_mode_only_when_model_names_grow(oracle, tmp_path) -> None:
    root = str(tmp_path)
    save_ckpt(f"{root}/full/rank_0/m.ckpt", {"w": W, "b": B, "global_step": np.array([3], np.int32)})
    jobs = []
    for name, (src, dst, _) in BY_STAGE_CASES.items():
        write_strategy(f"{root}/{name}/src.ckpt", make_strategy(src))
        write_strategy(f"{root}/{name}/dst.ckpt", make_strategy(dst))
        api.transform(f"{root}/full", f"{root}/{name}/ranks", None, f"{root}/{name}/src.ckpt")
        jobs.append(
            {
                "op": "transform",
                "src_checkpoints_dir": f"{root}/{name}/ranks",
                "dst_checkpoints_dir": f"{root}/{name}/ms",
                "ckpt_prefix": "checkpoint_",
                "src_strategy_file": f"{root}/{name}/src.ckpt",
                "dst_strategy_file": f"{root}/{name}/dst.ckpt",
            }
        )
    run_ms_jobs(oracle, jobs)
    for name, (_, _, mode) in BY_STAGE_CASES.items():
        rms.transform_checkpoints(
            f"{root}/{name}/ranks",
            f"{root}/{name}/rs",
            "checkpoint_",
            f"{root}/{name}/src.ckpt",
            f"{root}/{name}/dst.ckpt",
        )
        tail = "_part0" if mode == "by-stage" else ""
        assert sorted(tree_files(f"{root}/{name}/ms")) == [f"rank_{r}/checkpoint_{r}{tail}.ckpt" for r in range(2)]
        assert_same_tree(f"{root}/{name}/rs", f"{root}/{name}/ms")


# --------------------------------------------------------------------------------------------
# device counts that do not divide, with a pipeline-shared parameter

SHAPE = ModelShape(vocab=48, hidden=24, ffn=48, layers=2)  # every split below divides these
# name -> (dp, mp, pp, optimizer shards); the embedding is row-split in stage 0, column-split in the last
STRATEGIES = {"s8": (2, 2, 2, True), "s4": (1, 2, 2, False), "s6_pp2": (3, 1, 2, True), "s6_pp1": (3, 2, 1, False)}


@pytest.fixture(scope="module")
def non_dividing(oracle, tmp_path_factory) -> str:
    """MindSpore's side: 8- and 4-rank sources, full -> 6, source -> full -> 6, and its refusal of 8 -> 6."""
    root = str(tmp_path_factory.mktemp("non_dividing"))
    save_ckpt(f"{root}/full/rank_0/model.ckpt", full_model(SHAPE))
    for name, (dp, mp, pp, opt) in STRATEGIES.items():
        write_stage_strategies(f"{root}/stages_{name}", stage_strategies(SHAPE, dp, mp, pp, opt), dp * mp)
        merge_pipeline_strategies(f"{root}/stages_{name}", f"{root}/{name}.ckpt")

    def job(src: str, dst: str, s: str | None, d: str | None) -> dict[str, object]:
        return {
            "op": "transform",
            "src_checkpoints_dir": f"{root}/{src}",
            "dst_checkpoints_dir": f"{root}/{dst}",
            "ckpt_prefix": "checkpoint_",
            "src_strategy_file": s and f"{root}/{s}.ckpt",
            "dst_strategy_file": d and f"{root}/{d}.ckpt",
        }

    jobs = [
        job("full", "ms8", None, "s8"),
        job("full", "ms4", None, "s4"),
        job("ms8", "ms8_full", "s8", None),
        job("ms4", "ms4_full", "s4", None),
    ]
    for six in ("s6_pp2", "s6_pp1"):
        jobs += [
            job("full", f"full_{six}", None, six),
            job("ms8_full", f"ms8_full_{six}", None, six),
            job("ms4_full", f"ms4_full_{six}", None, six),
        ]
    run_ms_jobs(oracle, jobs)
    refused = oracle(REFUSAL_SCRIPT, job("ms8", "ms8_s6", "s8", "s6_pp2"))
    assert "Cannot transform device_num from 4 to 3" in refused, refused
    return root


REFUSAL_SCRIPT = """
job = dict(ARGS); job.pop("op")
try:
    ms.transform_checkpoints(**job)
    out("transformed")
except Exception as exc:
    out(f"{type(exc).__name__}: {exc}")
"""


def _assert_same_tensors_as(ours: str, reference: str) -> None:
    """Same files, each with the same names, dtypes, shapes and values (in any order)."""
    a, b = tree_files(ours), tree_files(reference)
    assert sorted(a) == sorted(b)
    for rel in a:
        with api.open_checkpoint(os.path.join(ours, rel)) as x, api.open_checkpoint(os.path.join(reference, rel)) as y:
            assert sorted(x) == sorted(y), rel
            for name in x:
                vx, vy = x.array(name), y.array(name)
                assert vx.dtype == vy.dtype and np.array_equal(vx, vy), (rel, name)


@pytest.mark.parametrize("six", ["s6_pp2", "s6_pp1"])
@pytest.mark.parametrize("source", ["8", "4"])
def test_non_dividing_transform_of_a_pipeline_shared_parameter(non_dividing: str, source: str, six: str) -> None:
    """8 -> 6 and 4 -> 6 (the CLI, on MindSpore's own source ranks) give full -> 6's tensors and
    MindSpore's source -> full -> 6 bytes."""
    root = non_dividing
    out = f"{root}/rs{source}_{six}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "reshard.cli",
            "transform",
            "--src_ckpt_dir",
            f"{root}/ms{source}",
            "--dst_ckpt_dir",
            out,
            "--src_ckpt_strategy",
            f"{root}/s{source}.ckpt",
            "--dst_ckpt_strategy",
            f"{root}/{six}.ckpt",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    _assert_same_tensors_as(out, f"{root}/full_{six}")
    assert_same_tree(out, f"{root}/ms{source}_full_{six}")


def test_non_dividing_drop_in_matches_the_cli(non_dividing: str) -> None:
    """``reshard.mindspore.transform_checkpoints`` does what MindSpore refuses, with the same bytes."""
    root = non_dividing
    rms.transform_checkpoints(f"{root}/ms8", f"{root}/dropin8", "checkpoint_", f"{root}/s8.ckpt", f"{root}/s6_pp2.ckpt")
    assert_same_tree(f"{root}/dropin8", f"{root}/ms8_full_s6_pp2")


# --------------------------------------------------------------------------------------------
# safetensors output from a full safetensors source


def test_full_safetensors_source_column_split_gets_the_right_slice(oracle, tmp_path) -> None:
    """MindSpore 2.10's safetensors-output transform from a full safetensors model copies a
    contiguous run of elements for a column-split block (its ``.ckpt`` output is right); reshard
    writes the right slice, and everything else byte for byte as MindSpore does."""
    from reshard.formats.safetensors import save_safetensors

    root = str(tmp_path)
    full = {
        "col": np.arange(48, dtype=np.float32).reshape(6, 8),
        "row": np.arange(48, dtype=np.float32).reshape(8, 6),
        "v": np.arange(8, dtype=np.float16),
    }
    layouts = {"col": L((2,), (-1, 0)), "row": L((2,), (0, -1)), "v": L((2,), (0,))}
    save_safetensors(f"{root}/full/rank_0/model.safetensors", full, {"format": "ms"})
    write_strategy(f"{root}/dst.ckpt", make_strategy(layouts))
    run_ms_jobs(
        oracle,
        [
            {
                "op": "transform",
                "src_checkpoints_dir": f"{root}/full",
                "dst_checkpoints_dir": f"{root}/ms_{fmt}",
                "ckpt_prefix": "net_",
                "src_strategy_file": None,
                "dst_strategy_file": f"{root}/dst.ckpt",
                "output_format": fmt,
            }
            for fmt in ("safetensors", "ckpt")
        ],
    )
    for fmt in ("safetensors", "ckpt"):
        rms.transform_checkpoints(
            f"{root}/full", f"{root}/rs_{fmt}", "net_", None, f"{root}/dst.ckpt", output_format=fmt
        )
    assert_same_tree(f"{root}/rs_ckpt", f"{root}/ms_ckpt")
    assert_same_tree(f"{root}/rs_safetensors", f"{root}/ms_safetensors", ms_wrong=frozenset({"col"}))
    for rank in range(2):
        with (
            api.open_checkpoint(f"{root}/rs_safetensors/rank_{rank}/net_{rank}.safetensors") as ours,
            api.open_checkpoint(f"{root}/ms_safetensors/rank_{rank}/net_{rank}.safetensors") as theirs,
        ):
            assert np.array_equal(ours.array("col"), full["col"][:, 4 * rank : 4 * rank + 4])
            # MindSpore's block: the 24 elements from the block's first one on, not the column slice
            assert np.array_equal(theirs.array("col").ravel(), full["col"].ravel()[4 * rank : 4 * rank + 24])
