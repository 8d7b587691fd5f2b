"""Megatron-core ``torch_dist`` checkpoints saved by megatron-core, read by reshard; reshard's torch_dist
outputs loaded back by megatron-core into another tensor-parallel layout.

megatron-core 0.16.1 (the torch venv, ``scripts/torch_env.sh``) saves on two gloo ranks
(``tests/oracle_scripts/megatron_save.py``): hand-built ShardedTensors (split along dim 0 and dim 1,
replicated, bf16, a stacked layer axis, a ShardedObject, a value in common.pt) and a tiny GPTModel
on two pipeline stages and on two tensor-parallel ranks (its layers stacked along a leading axis).
Every tensor reshard reads through its commands must equal, bit for bit, what the ranks saved (the
GPT models': what torch's own DCP reader gives). Then reshard writes torch_dist from a MindSpore rank
folder and re-chunks megatron's saves (a run folder too), and ``dist_checkpointing.load`` loads each
into ShardedTensors split along another axis (``tests/oracle_scripts/megatron_load.py``).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from reshard import api
from reshard.formats import megatron
from reshard.sources import MEGATRON, open_checkpoint, registry
from reshard.verify import verify
from tests.test_dcp_write import full_tensors
from tests.torch_oracle import run_torch_script
from tests.trust_helpers import make_job

SAVES = ("handmade", "gpt_pp2", "gpt_tp2")
BF16 = ["output_layer.weight"]  # the handmade bf16 tensor (int16 bit patterns in the .npz)


@pytest.fixture(scope="module")
def megatron_made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("megatron-saved")
    run_torch_script("megatron_save.py", {"root": str(root)}, nproc=2)
    return root


def npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def through_reshard(src: Path, out: Path) -> dict[str, np.ndarray]:
    """Every tensor of ``src`` as reshard's commands read it: transformed into one full safetensors file."""
    api.transform(str(src), str(out), None, None, output=api.OutputSpec(format="safetensors"))
    with open_checkpoint(str(out / "rank_0" / "checkpoint_0.safetensors")) as index:
        return {name: np.array(index.array(name)) for name in index.entries}


@pytest.mark.parametrize("name", SAVES)
def test_reads_what_megatron_saved(megatron_made: Path, tmp_path: Path, name: str) -> None:
    assert registry.identify(str(megatron_made / name)) is MEGATRON
    got, want = through_reshard(megatron_made / name, tmp_path / "full"), npz(megatron_made / f"{name}.npz")
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].shape == value.shape and got[key].tobytes() == value.tobytes(), key
    if name == "gpt_pp2":  # stacked: one tensor with the layer axis first, each stage saving its layer
        opened = MEGATRON.open(str(megatron_made / name), None, [])
        qkv = opened.tensors["decoder.layers.self_attention.linear_qkv.weight"]
        assert qkv.shape == (2, 24, 8) and sorted(qkv.boxes) == [((0, 1), (0, 24), (0, 8)), ((1, 2), (0, 24), (0, 8))]
        assert any("_extra_state" in v for v in opened.values)  # ShardedObjects: byte items of .metadata


def test_empty_common_is_the_bytes_torch_save_writes(megatron_made: Path) -> None:
    theirs = (megatron_made / "empty" / "common.pt").read_bytes()
    made_up = zipfile.ZipFile(megatron_made / "empty" / "common.pt").read("common/.data/serialization_id")
    assert megatron.torch_save_file("common", b"\x80\x02}q\x00.", made_up.decode()) == theirs
    assert len(megatron.empty_common()) == len(theirs)


def _split(tensors: dict[str, np.ndarray], axis: int) -> dict[str, int | None]:
    """Each tensor's part along ``axis`` when it divides in two, else the whole tensor on each rank."""
    return {k: axis if v.ndim > axis and v.shape[axis] % 2 == 0 else None for k, v in tensors.items()}


def test_megatron_loads_what_reshard_wrote(megatron_made: Path, tmp_path: Path) -> None:
    job = make_job(str(tmp_path / "job"))
    loads = []
    # a MindSpore rank folder (8 ranks, dp2 mp2 pp2) as torch_dist: the source slices as chunks
    ms_out = tmp_path / "from_ms"
    api.transform(job["r8"], str(ms_out), job["s8"], None, output=api.OutputSpec(format="torch_dist"))
    expected = full_tensors(job["full"])
    np.savez(tmp_path / "from_ms.npz", **expected)
    loads.append({"folder": str(ms_out), "expected": str(tmp_path / "from_ms.npz"), "split": _split(expected, 1)})
    # megatron's hand-built save re-chunked in three files, loaded split along the other axis
    hand = tmp_path / "handmade3"
    api.transform(
        str(megatron_made / "handmade"), str(hand), None, None, output=api.OutputSpec("torch_dist", dcp_ranks=3)
    )
    hand_split = {
        "decoder.layers.self_attention.linear_qkv.weight": 1,  # saved split along dim 0
        "output_layer.weight": 0,  # saved split along dim 1
        "decoder.layers.mlp.linear_fc1.weight": 1,  # saved one layer per rank
        "decoder.final_layernorm.weight": None,
    }
    loads.append(
        {"folder": str(hand), "expected": str(megatron_made / "handmade.npz"), "split": hand_split, "bf16": BF16}
    )
    # the GPT model's pipeline-stage save as a Megatron-LM run folder, loaded tensor-parallel
    run = tmp_path / "run"
    api.transform(
        str(megatron_made / "gpt_pp2"),
        str(run),
        None,
        None,
        output=api.OutputSpec("torch_dist", iteration=5, dcp_ranks=2),
    )
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "5"
    gpt = npz(megatron_made / "gpt_pp2.npz")
    loads.append(
        {"folder": str(run / "iter_0000005"), "expected": str(megatron_made / "gpt_pp2.npz"), "split": _split(gpt, 1)}
    )
    # the GPT model's tensor-parallel save re-chunked, loaded by the model itself on two pipeline stages
    # (its ShardedObjects carried: megatron's loader asks for them) and saved again by megatron
    tp_out = tmp_path / "gpt_tp2_rechunked"
    api.transform(str(megatron_made / "gpt_tp2"), str(tp_out), None, None, output=api.OutputSpec("torch_dist"))
    loads.append({"folder": str(tp_out), "model": [1, 2], "resave": str(tmp_path / "resaved")})
    for k, load in enumerate(loads):
        load["out"] = str(tmp_path / f"load{k}.json")
    run_torch_script("megatron_load.py", {"loads": loads}, nproc=2)
    results = [json.loads(Path(load["out"]).read_text()) for load in loads]
    assert [r["mismatched"] for r in results] == [[], [], [], []]
    assert [r["loaded"] for r in results][:3] == [len(expected), 4, len(gpt)]
    assert [r["common"] for r in results] == ["{}", "{'iteration': 7}", "{}", "{}"]  # carried from megatron's saves
    report = verify(str(megatron_made / "gpt_tp2"), str(tmp_path / "resaved"))
    assert report.ok and len(report.matching) == len(gpt), report.summary()
