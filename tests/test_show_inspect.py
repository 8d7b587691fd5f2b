"""``reshard inspect`` as a summary first (issue 13, show lane): the job, parameters, bytes by
dtype, optimizer states and per-rank sizes, all in ``--json``; ``--params`` one table over all
ranks whose names are never cut (whole lines on a pipe, folded cells on a terminal)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from reshard import api
from reshard.statenames import DEFAULT as STATE
from tests.trust_helpers import run_cli as run

EMBEDDING = "model.tok_embeddings.embedding_weight"  # both stages hold it, each with its own layout


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("demo"))
    proc = run("demo", "--dir", root)
    assert proc.returncode == 0, proc.stderr
    return {
        "full": f"{root}/full/model.ckpt",
        "r8": f"{root}/ckpt_8ranks",
        "st8": f"{root}/st_8ranks",
        "s8": f"{root}/merged/src_strategy.ckpt",
        "s8_dir": f"{root}/strategy_8",
        "mf2": f"{root}/mf2_8ranks",
    }


def summary(*args: str) -> dict:
    proc = run("inspect", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["summary"]


def model_facts(demo: dict[str, str]) -> tuple[int, int, dict[str, int]]:
    """Weights, their elements, and the count of each optimizer-state kind, read from the full model."""
    tensors = api.source_file(demo["full"]).tensors
    weights = {n: t for n, t in tensors.items() if not STATE.is_state(n)}
    kinds = {
        "adam_m": sum(n.startswith("adam_m.") for n in tensors),
        "adam_v": sum(n.startswith("adam_v.") for n in tensors),
    }
    return len(weights), sum(math.prod(t.shape) for t in weights.values()), kinds


def test_rank_folders_summary(demo: dict[str, str]) -> None:
    weights, elements, kinds = model_facts(demo)
    s = summary(demo["r8"], "--strategy", demo["s8"])
    assert s["source"] == "distributed" and s["ranks"] == 8 and s["stages"] == 2 and s["devices_per_stage"] == 4
    assert (s["dp"], s["mp"], s["opt_shard"]) == (2, 2, 2)
    assert s["parameters"] == weights and s["parameter_elements"] == elements
    assert {k: s["optimizer_states"][k] for k in kinds} == kinds and s["optimizer_states"]["global_step"] == 1
    assert sum(s["bytes_by_dtype"].values()) == s["bytes"]
    sizes = {int(r): os.path.getsize(f"{demo['r8']}/rank_{r}/checkpoint_{r}.ckpt") for r in range(8)}
    rb = s["rank_bytes"]
    assert len(rb["by_rank"]) == 8 and rb["total"] == s["bytes"] == sum(rb["by_rank"].values())
    assert rb["min"] == min(rb["by_rank"].values()) and rb["max"] == rb["by_rank"][str(rb["max_rank"])]
    assert all(rb["by_rank"][str(r)] <= sizes[r] for r in sizes)  # tensor bytes, without the file framing


def test_rank_folders_without_strategy_say_what_is_missing(demo: dict[str, str]) -> None:
    s = summary(demo["r8"])
    assert s["ranks"] == 8 and s["stages"] is None and s["parameter_elements"] is None
    text = run("inspect", demo["r8"]).stdout
    assert "give --strategy" in text


def test_single_file_summary(demo: dict[str, str]) -> None:
    weights, elements, _ = model_facts(demo)
    s = summary(demo["full"])
    assert s["source"] == "checkpoint" and s["ranks"] == 1 and s["rank_bytes"] is None and s["stages"] is None
    assert s["parameters"] == weights and s["parameter_elements"] == elements
    assert s["bytes_by_dtype"] == {"Float32": s["bytes_by_dtype"]["Float32"], "Int32": 4}


def test_strategy_summary_merged_and_per_stage(demo: dict[str, str]) -> None:
    weights, _, _ = model_facts(demo)
    s = summary(demo["s8"])
    assert s["source"] == "strategy" and s["stages"] == 2 and s["ranks"] == 8 and s["stage"] is None
    assert s["parameters"] == weights and s["parameter_elements"] is None
    stage1 = summary(os.path.join(demo["s8_dir"], "ckpt_strategy_rank_4.ckpt"))
    assert stage1["stage"] == 1 and stage1["stages"] == 1 and stage1["devices_per_stage"] == 4
    text = run("inspect", os.path.join(demo["s8_dir"], "ckpt_strategy_rank_4.ckpt")).stdout
    assert "pipeline stage 1's file" in text


def test_checkpoint2_summary(demo: dict[str, str]) -> None:
    weights, elements, kinds = model_facts(demo)
    s = summary(demo["mf2"])
    assert s["source"] == "checkpoint2" and s["ranks"] == 8 and s["stages"] == 2 and s["mp"] == 2
    assert s["parameters"] == weights and s["parameter_elements"] == elements
    assert {k: s["optimizer_states"][k] for k in kinds} == kinds
    assert len(s["rank_bytes"]["by_rank"]) == 8


def test_stage_one_is_read_as_stage_one(demo: dict[str, str]) -> None:
    """Each rank's layout comes from its own stage: the embedding shows two layouts, one full shape."""
    proc = run("inspect", demo["r8"], "--strategy", demo["s8"], "--json")
    rows = {r["name"]: r for r in json.loads(proc.stdout)["parameters"]}
    emb = rows[EMBEDDING]
    assert emb["full_shape"] == list(api.source_file(demo["full"]).tensors[EMBEDDING].shape)
    assert [v["ranks"] for v in emb["layouts"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert emb["layouts"][0]["layout"] != emb["layouts"][1]["layout"]


def test_params_piped_is_one_whole_line_per_parameter(demo: dict[str, str]) -> None:
    names = list(api.source_file(demo["full"]).tensors)
    proc = run("inspect", demo["r8"], "--strategy", demo["s8"], "--params")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) < len(names) + 15  # one table for all ranks, not one per rank
    for name in names:
        found = [line for line in lines if line.split()[:1] == [name]]
        assert len(found) == 1, name
    wq = [line for line in lines if "wq" in line]
    assert len(wq) == sum("wq" in n for n in names) and all("…" not in line for line in lines)
    assert any(line.startswith(f"adam_m.{EMBEDDING} ") and "ranks 4-7" in line for line in lines)


def test_params_on_a_terminal_fold_names(demo: dict[str, str]) -> None:
    from rich.console import Console

    from reshard import inspection as inspect

    info = inspect.gather(demo["r8"], demo["s8"])
    console = Console(force_terminal=True, width=70, record=True, color_system=None)
    inspect.print_table(*inspect.params_table(info), console)
    text = console.export_text()
    assert "…" not in text
    first_column = "".join(line.split("│")[1].strip() for line in text.splitlines() if line.count("│") > 2)
    assert f"adam_m.{EMBEDDING}" in first_column


@pytest.mark.parametrize("kind", ["full", "s8", "mf2"])
def test_params_of_every_kind(demo: dict[str, str], kind: str) -> None:
    proc = run("inspect", demo[kind], "--params")
    assert proc.returncode == 0, proc.stderr
    assert any(line.startswith(f"adam_v.{EMBEDDING} ") for line in proc.stdout.splitlines())


def test_default_output_is_a_summary(demo: dict[str, str]) -> None:
    proc = run("inspect", demo["r8"], "--strategy", demo["s8"])
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) < 12, proc.stdout
    assert lines[1].startswith("job: 8 ranks, 2 pipeline stages of 4 devices; dp 2, mp 2, optimizer shard 2")
    assert any(line.startswith("optimizer states: adam_m (") for line in lines)
    assert any(line.startswith("per rank: min ") for line in lines)


def test_bad_input(demo: dict[str, str], tmp_path: Path) -> None:
    proc = run("inspect", str(tmp_path / "nothing"), "--params")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stdout == ""


def test_full_model_folders_summary(demo: dict[str, str], tmp_path: Path) -> None:
    weights, elements, kinds = model_facts(demo)
    unified, hf = tmp_path / "unified", tmp_path / "hf"
    assert run("unify", demo["st8"], str(unified), "--src-strategy", demo["s8"]).returncode == 0
    proc = run(
        "transform", "--src", demo["full"], "--dst", str(hf), "--hf", "--keep-training-state", "--max-shard-size", "4MB"
    )
    assert proc.returncode == 0, proc.stderr
    for folder, name, files in ((unified, "a unified model", 2), (hf, "a Hugging Face model", 3)):
        s = summary(str(folder))
        assert s["source_name"] == name and s["files"] == files and s["ranks"] == 1, s
        assert s["parameters"] == weights and s["parameter_elements"] == elements
        assert {k: s["optimizer_states"][k] for k in kinds} == kinds
    text = run("inspect", str(hf), "--params").stdout
    assert text.startswith(f"Hugging Face model (3 files): {hf}\n")
    assert "model-00001-of-00003.safetensors" in text and "full shape" not in text  # no column of blanks


def test_json_strategy_reads_as_the_protobuf_one(demo: dict[str, str], tmp_path: Path) -> None:
    from reshard.formats.strategy import JSON, load_strategy, write_strategy

    as_json = tmp_path / "strategy.json"
    write_strategy(as_json, load_strategy(demo["s8"]), JSON)
    assert summary(str(as_json)) == summary(demo["s8"])
    shown = [run("show", path, EMBEDDING).stdout for path in (str(as_json), demo["s8"])]
    assert shown[0] == shown[1] and "stage 1 (ranks 4-7)" in shown[0]


SUMMARY_KEYS = {
    "source", "source_name", "ranks", "stages", "stage", "devices_per_stage", "dp", "mp", "opt_shard", "parameters",
    "parameter_elements", "files", "tensors", "bytes", "bytes_by_dtype", "optimizer_states", "rank_bytes",
}  # fmt: skip


@pytest.mark.parametrize("kind", ["full", "r8", "s8", "mf2"])
def test_every_summary_field_is_in_the_json_of_every_kind(demo: dict[str, str], kind: str) -> None:
    assert set(summary(demo[kind])) == SUMMARY_KEYS
