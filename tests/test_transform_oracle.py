"""Transforms against MindSpore 2.10: same file names, byte-identical files (docs/formats.md §3.6-§3.9, §4.1-§4.3).

Every case starts from one full checkpoint (written by us; byte-identical to MindSpore's, see
test_ckpt_oracle). MindSpore and reshard then each run the same chain of operations on their
own outputs — full -> A, A -> B, B -> full, and the safetensors flows — and every output tree
must match byte for byte.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest

from reshard import api
from reshard.formats.ckpt import save_ckpt
from reshard.formats.strategy import merge_pipeline_strategies
from reshard.layout import ParamLayout as L
from reshard.synthetic import ModelShape, full_model, stage_strategies
from tests.msjobs import StageLayouts, assert_same_tensors, assert_same_tree, run_ms_jobs, write_stages

pytestmark = pytest.mark.oracle


@dataclass
class Case:
    name: str
    model: dict[str, object]
    a: StageLayouts
    b: StageLayouts
    strategy_format: str = "ckpt"


def _small_llama(dtype: str = "float32", layers: int = 2) -> tuple[dict[str, object], ModelShape]:
    shape = ModelShape(vocab=64, hidden=16, ffn=32, layers=layers)
    return full_model(shape, dtype=dtype), shape


def _stages(shape: ModelShape, dp: int, mp: int, pp: int, opt: bool) -> StageLayouts:
    return [sf.layouts for sf in stage_strategies(shape, dp, mp, pp, opt)]


def _cases() -> list[Case]:
    llama, shape = _small_llama()
    llama_bf16, _ = _small_llama("bfloat16")
    llama4, shape4 = _small_llama(layers=4)
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    mixed = {
        "w": w,
        "h": rng.standard_normal((8, 16)).astype(np.float16),
        "i": rng.integers(-100, 100, (8, 8)).astype(np.int32),
        "v": rng.standard_normal(16).astype(ml_dtypes.bfloat16),
        "global_step": np.array([7], np.int64),
    }
    return [
        Case("llama dp2mp2pp2+opt -> dp1mp2pp2", llama, _stages(shape, 2, 2, 2, True), _stages(shape, 1, 2, 2, False)),
        Case(
            "llama bf16 dp1mp2pp2 -> dp2mp2pp2+opt",
            llama_bf16,
            _stages(shape, 1, 2, 2, False),
            _stages(shape, 2, 2, 2, True),
        ),
        Case("llama 4 stages -> 1 stage mp2", llama4, _stages(shape4, 1, 2, 4, False), _stages(shape4, 2, 2, 1, True)),
        Case(
            "dtypes 4 -> 2 (redundant copies)",
            mixed,
            [{"w": L((2, 2), (1, -1)), "h": L((2, 2), (-1, 0)), "i": L((2, 2), (0, 1)), "v": L((2, 2), (-1,))}],
            [{"w": L((2,), (-1, 0)), "h": L((2,), (0, -1)), "i": L((2,), (-1, -1)), "v": L((2,), (0,))}],
        ),
        Case(
            "2 -> 8 with opt shards (simple and helper paths)",
            mixed,
            [{"w": L((2,), (0, -1)), "h": L((2,), (-1, 0)), "i": L((2,), (-1, 0)), "v": L((2,), (-1,))}],
            [
                {
                    "w": L((2, 2, 2), (1, -1), 2, 2),
                    "h": L((2, 2, 2), (-1, 0), 2, 2),
                    "i": L((2, 2, 2), (0, 1), 4, 2),
                    "v": L((2, 2, 2), (-1,), 1, 2),
                }
            ],
        ),
        Case(
            "list tensor maps 8 -> 4",
            mixed,
            [
                {
                    "w": L((2, 2, 2), ((2, 1), -1)),
                    "h": L((2, 2, 2), (-1, (1, 0))),
                    "i": L((2, 2, 2), (0, 2)),
                    "v": L((2, 2, 2), ((2, 0),)),
                }
            ],
            [{"w": L((4,), (0, -1)), "h": L((2, 2), ((1, 0), -1)), "i": L((4,), (-1, -1)), "v": L((4,), (0,))}],
        ),
        Case(
            "json strategies 4 -> 2",
            mixed,
            [{"w": L((2, 2), (1, 0)), "h": L((2, 2), (-1, 1)), "i": L((4,), (0, -1)), "v": L((2, 2), (0,))}],
            [{"w": L((2,), (0, -1)), "h": L((2,), (-1, 0)), "i": L((2,), (-1, -1)), "v": L((2,), (-1,))}],
            strategy_format="json",
        ),
    ]


CASES = _cases()


def _shared_with_stage_layouts(case: Case) -> frozenset[str]:
    """Names held by several source stages with different layouts."""
    seen: dict[str, set[object]] = {}
    for stage in case.a:
        for name, lay in stage.items():
            seen.setdefault(name, set()).add(lay)
    return frozenset(n for n, lays in seen.items() if len(lays) > 1)


def _prepare(tmp: str, case: Case) -> dict[str, str]:
    paths = {k: os.path.join(tmp, k) for k in ("full", "ms", "rs", "strategy")}
    full_file = os.path.join(paths["full"], "rank_0", "model.ckpt")
    save_ckpt(full_file, case.model)
    ext = "json" if case.strategy_format == "json" else "ckpt"
    for side, stages in (("a", case.a), ("b", case.b)):
        folder = write_stages(os.path.join(tmp, f"stages_{side}"), stages, case.strategy_format)
        merged = os.path.join(paths["strategy"], f"{side}.{ext}")
        merge_pipeline_strategies(folder, merged)
        paths[side] = merged
    return paths


def _chain_steps(p: dict[str, str]) -> list[tuple[str, str | None, str, str | None, str | None, str]]:
    """(name, src under a side's root or None for the full model, dst, src strategy, dst strategy, format)."""
    return [
        ("full_a", None, "a_ckpt", None, p["a"], "ckpt"),
        ("a_b", "a_ckpt", "b_ckpt", p["a"], p["b"], "ckpt"),
        ("b_full", "b_ckpt", "full_ckpt", p["b"], None, "ckpt"),
    ]


def _chain_jobs(p: dict[str, str]) -> list[dict[str, object]]:
    jobs = []
    for _, src, dst, s, d, fmt in _chain_steps(p):
        src_dir = p["full"] if src is None else os.path.join(p["ms"], src)
        jobs.append(
            {
                "op": "transform",
                "src_checkpoints_dir": src_dir,
                "dst_checkpoints_dir": os.path.join(p["ms"], dst),
                "ckpt_prefix": "checkpoint_",
                "src_strategy_file": s,
                "dst_strategy_file": d,
                "output_format": fmt,
            }
        )
    return jobs


def _safetensors_jobs(p: dict[str, str]) -> list[dict[str, object]]:
    ms_root = p["ms"]
    return [
        {
            "op": "transform",
            "src_checkpoints_dir": p["full"],
            "dst_checkpoints_dir": f"{ms_root}/a_ckpt",
            "ckpt_prefix": "checkpoint_",
            "src_strategy_file": None,
            "dst_strategy_file": p["a"],
        },
        {"op": "ckpt_to_safetensors", "file_path": f"{ms_root}/a_ckpt", "save_path": f"{ms_root}/a_st"},
        {
            "op": "transform",
            "src_checkpoints_dir": f"{ms_root}/a_st",
            "dst_checkpoints_dir": f"{ms_root}/b_st",
            "ckpt_prefix": "net_",
            "src_strategy_file": p["a"],
            "dst_strategy_file": p["b"],
            "output_format": "safetensors",
        },
        {
            "op": "transform",
            "src_checkpoints_dir": f"{ms_root}/a_st",
            "dst_checkpoints_dir": f"{ms_root}/b_ck",
            "ckpt_prefix": "net_",
            "src_strategy_file": p["a"],
            "dst_strategy_file": p["b"],
            "output_format": "ckpt",
        },
        {"op": "unify", "src_dir": f"{ms_root}/a_st", "src_strategy_file": p["a"], "dst_dir": f"{ms_root}/unified"},
        {
            "op": "split",
            "predict_strategy": p["b"],
            "unified_safetensors_dir": f"{ms_root}/unified",
            "dst_safetensors_dir": f"{ms_root}/split",
        },
    ]


SAFETENSORS_CASES = CASES[:2] + CASES[4:5]


@pytest.fixture(scope="module")
def mindspore_ran(oracle, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, str]]:
    """Every case's inputs, and MindSpore's outputs of all of them from one oracle process (importing
    MindSpore costs seconds; one process per case was most of this module's time)."""
    root = str(tmp_path_factory.mktemp("transform_oracle"))
    prepared: dict[tuple[str, str], dict[str, str]] = {}
    jobs: list[dict[str, object]] = []
    for flow, cases, make_jobs in (
        ("chain", CASES, _chain_jobs),
        ("safetensors", SAFETENSORS_CASES, _safetensors_jobs),
    ):
        for i, case in enumerate(cases):
            p = _prepare(os.path.join(root, f"{flow}{i}"), case)
            prepared[flow, case.name] = p
            jobs += make_jobs(p)
    run_ms_jobs(oracle, jobs)
    return prepared


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_transform_chain_matches_mindspore(mindspore_ran, case: Case) -> None:
    p = mindspore_ran["chain", case.name]
    steps = _chain_steps(p)
    for _, src, dst, s, d, fmt in steps:
        src_dir = p["full"] if src is None else os.path.join(p["rs"], src)
        api.transform(
            src_dir, os.path.join(p["rs"], dst), s, d, output=api.OutputSpec(prefix="checkpoint_", format=fmt)
        )
        assert_same_tree(os.path.join(p["rs"], dst), os.path.join(p["ms"], dst))


@pytest.mark.parametrize("case", SAFETENSORS_CASES, ids=[c.name for c in SAFETENSORS_CASES])
def test_safetensors_flows_match_mindspore(mindspore_ran, case: Case) -> None:
    """ckpt->safetensors convert, safetensors transform (both outputs), unify, split."""
    p = mindspore_ran["safetensors", case.name]
    ms_root, rs_root = p["ms"], p["rs"]
    api.transform(p["full"], f"{rs_root}/a_ckpt", None, p["a"])
    api.convert(f"{rs_root}/a_ckpt", f"{rs_root}/a_st", "safetensors")
    assert_same_tree(f"{rs_root}/a_st", f"{ms_root}/a_st")
    api.transform(
        f"{rs_root}/a_st", f"{rs_root}/b_ck", p["a"], p["b"], output=api.OutputSpec(prefix="net_", format="ckpt")
    )
    assert_same_tree(f"{rs_root}/b_ck", f"{ms_root}/b_ck")
    # MindSpore's safetensors-output path mixes one stage's copy of a pipeline-shared parameter with
    # another stage's layout (its .ckpt output of the same transform is right). We write the right
    # tensors there: equal to MindSpore's own .ckpt output; everything else is byte-identical.
    shared = _shared_with_stage_layouts(case)
    api.transform(
        f"{rs_root}/a_st", f"{rs_root}/b_st", p["a"], p["b"], output=api.OutputSpec(prefix="net_", format="safetensors")
    )
    assert_same_tree(f"{rs_root}/b_st", f"{ms_root}/b_st", ms_wrong=shared)
    assert_same_tensors(f"{rs_root}/b_st", f"{ms_root}/b_ck", shared)
    # MindSpore packs parts in folder-listing order: run on its own (byte-identical) folder to compare
    api.unify(f"{ms_root}/a_st", p["a"], f"{rs_root}/unified", parts=api.UnifyOptions(mindspore_order=True))
    assert_same_tree(f"{rs_root}/unified", f"{ms_root}/unified")
    api.split(f"{rs_root}/unified", p["b"], f"{rs_root}/split")
    assert_same_tree(f"{rs_root}/split", f"{ms_root}/split")


def test_unify_sources_saved_without_redundancy(oracle, tmp_path) -> None:
    """Each slice stored by one rank of its redundancy group (``remove_redundancy=True``): unify
    merges it as MindSpore's ``merge_with_redundancy=False`` does."""
    from reshard import layout
    from reshard.formats.safetensors import save_safetensors
    from reshard.formats.strategy import load_strategy, write_strategy
    from reshard.formats.strategy import make_strategy as mk

    rng = np.random.default_rng(3)
    full = {
        "w": rng.standard_normal((8, 4)).astype(np.float32),
        "b": rng.standard_normal(4).astype(np.float16),
        "e": rng.standard_normal((4, 8)).astype(np.float32),
    }
    layouts = {"w": L((2, 2), (1, -1)), "b": L((2, 2), (-1,)), "e": L((2, 2), (-1, 0))}
    strategy = str(tmp_path / "s.ckpt")
    write_strategy(strategy, mk(layouts))
    sf = load_strategy(strategy)
    src = tmp_path / "src"
    seen: dict[str, set] = {n: set() for n in full}
    for rank in range(4):
        tensors = {"global_step": np.array([5], np.int64)}
        for name, arr in full.items():
            box = layout.rank_box(sf.layouts[name], arr.shape, rank)
            if box not in seen[name]:  # keep only the first rank of each redundancy group
                seen[name].add(box)
                tensors[name] = np.ascontiguousarray(arr[tuple(slice(a, b) for a, b in box)])
        save_safetensors(
            str(src / f"rank_{rank}" / f"net_{rank}.safetensors"),
            tensors,
            {"format": "ms", "remove_redundancy": "True"},
        )
    run_ms_jobs(
        oracle,
        [
            {
                "op": "unify",
                "src_dir": str(src),
                "src_strategy_file": strategy,
                "dst_dir": str(tmp_path / "ms"),
                "merge_with_redundancy": False,
            }
        ],
    )
    api.unify(str(src), strategy, str(tmp_path / "rs"), parts=api.UnifyOptions(mindspore_order=True))
    assert_same_tree(str(tmp_path / "rs"), str(tmp_path / "ms"))
    with api.open_checkpoint(str(tmp_path / "rs" / "part0.safetensors")) as index:
        for name, arr in full.items():
            assert np.array_equal(index.array(name), arr)
