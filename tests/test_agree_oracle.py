"""Issue 18 item 11 against MindSpore 2.10: ``unified_safetensors`` given ONE stage's strategy file.

MindSpore's own system test ``test_unified_safetensors_pp_shared_param`` trains a 2-stage, 8-rank
job with a parameter shared by both stages and the parallel optimizer, then passes rank 0's
strategy file (stage 0's alone) to ``unified_safetensors``; MindSpore unifies stage 0's parameters
from ranks 0..3. The demo's job has the same shape (2 stages of dp2 x mp2, a tied embedding with a
different layout in each stage, optimizer shards), so the same call is made on its files by both
MindSpore and reshard's drop-in: the outputs are byte-identical. Given rank 4's file (stage 1's)
MindSpore reads ranks 0..3 with stage 1's layouts and writes a wrong embedding; reshard refuses.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from reshard import demo
from reshard.errors import LayoutError
from reshard.mindspore import parallel as rmp
from reshard.sources import source_file
from tests.msjobs import assert_same_tree, run_ms_jobs

pytestmark = pytest.mark.oracle

EMBEDDING = "model.tok_embeddings.embedding_weight"


def test_unified_safetensors_with_one_stages_strategy_as_mindspore(
    oracle: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("one_stage")
    demo.main(str(root / "demo"))
    src, strategies = str(root / "demo" / "st_8ranks"), root / "demo" / "strategy_8"
    stage0, stage1 = str(strategies / "ckpt_strategy_rank_0.ckpt"), str(strategies / "ckpt_strategy_rank_4.ckpt")
    jobs = [
        {"op": "unify", "src_dir": src, "src_strategy_file": stage0, "dst_dir": str(root / "ms0")},
        {"op": "unify", "src_dir": src, "src_strategy_file": stage1, "dst_dir": str(root / "ms1")},
    ]
    run_ms_jobs(oracle, jobs)

    rmp.unified_safetensors(src, stage0, str(root / "rs0"))  # the system test's exact call
    assert_same_tree(str(root / "rs0"), str(root / "ms0"))
    assert sorted(os.listdir(root / "rs0")) == ["hyper_param.safetensors", "param_name_map.json", "part0.safetensors"]

    # stage 1's file: MindSpore's embedding is not the model's [512, 128]; reshard refuses, writes nothing
    theirs = source_file(str(root / "ms1" / "part0.safetensors")).tensors[EMBEDDING].shape
    assert theirs != (512, 128)
    with pytest.raises(LayoutError, match="pipeline stage 1's alone"):
        rmp.unified_safetensors(src, stage1, str(root / "rs1"))
    assert not (root / "rs1").exists() or not os.listdir(root / "rs1")
