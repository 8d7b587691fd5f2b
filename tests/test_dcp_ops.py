"""Every command reads a PyTorch DCP folder (no torch: folders written by ``formats.dcp.save_dcp``).

The DCP folders hold uneven ``torch.chunk``-style shards and grids, several chunks per data file, a
rank writing two data files, bf16/fp8 chunks and non-tensor values. Each command's output is checked
against the global tensors the folder was made from (``transform`` to a full file, Hugging Face
shards and MindSpore rank folders of a destination strategy; ``unify``; ``verify``; ``plan``;
``rank-list --files``; ``inspect``; ``show``), and bad input (a truncated ``.distcp``, a ``.metadata``
naming a missing file, a strategy given with a DCP) is one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from reshard import api, dtypes
from reshard.errors import UnsupportedError
from reshard.formats import dcp
from reshard.formats.dcp import ChunkSpec
from reshard.layout.chunks import even_boxes
from reshard.sources import DCP, OpenedChunks, identify, open_checkpoint
from tests.trust_helpers import make_job, run_cli, snapshot, temp_files

RANKS = 3


def _spec(fqn: str, arr: np.ndarray, box: tuple[tuple[int, int], ...]) -> ChunkSpec:
    offsets = tuple(a for a, _ in box)
    sizes = tuple(b - a for a, b in box)
    return ChunkSpec(fqn, dtypes.from_numpy(arr.dtype), tuple(arr.shape), offsets, sizes)


def chunked_files(tensors: dict[str, np.ndarray]) -> dict[str, list[ChunkSpec | str]]:
    """Uneven shards: dim 0 in ``RANKS`` torch.chunk parts (rank r holds part r), every other 2-D tensor
    also cut in two along dim 1 (two chunks of it in one file); 1-D and 0-D tensors whole in rank 0's
    second data file."""
    files: dict[str, list[ChunkSpec | str]] = {f"__{r}_0.distcp": [] for r in range(RANKS)}
    files["__0_1.distcp"] = ["extra_state"]
    for i, (name, arr) in enumerate(tensors.items()):
        if arr.ndim < 2:
            files["__0_1.distcp"].append(_spec(name, arr, tuple((0, d) for d in arr.shape)))
            continue
        for r, row_box in enumerate(even_boxes(arr.shape, 0, RANKS)):
            if row_box[0][0] == row_box[0][1]:
                continue  # an empty trailing part: torch.chunk gives fewer parts
            if i % 2:
                for col_box in even_boxes(arr.shape, 1, 2):
                    files[f"__{r}_0.distcp"].append(_spec(name, arr, (row_box[0], col_box[1], *row_box[2:])))
            else:
                files[f"__{r}_0.distcp"].append(_spec(name, arr, row_box))
    return files


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The trust job (full.ckpt, s4, ...) and ``dcp``: its full model as a DCP folder of 3 ranks."""
    root = str(tmp_path_factory.mktemp("job"))
    job = make_job(root)
    with open_checkpoint(job["full"]) as index:
        tensors = {name: np.array(index.array(name)) for name in index.entries}
    dcp.save_dcp(f"{root}/dcp", tensors, chunked_files(tensors), {"extra_state": b"\x80\x04opaque pickle"})
    job["dcp"] = f"{root}/dcp"
    mixed = {
        "w": np.arange(35, dtype=np.float32).reshape(7, 5),
        "bf": (np.arange(24, dtype=np.float32).reshape(4, 6) / 7).astype(ml_dtypes.bfloat16),
        "f8": np.linspace(-2, 2, 9).astype(ml_dtypes.float8_e4m3fn),
    }
    files: dict[str, list[ChunkSpec | str]] = {
        "__0_0.distcp": [_spec("w", mixed["w"], ((0, 3), (0, 5))), _spec("bf", mixed["bf"], ((0, 4), (0, 1))), "s"],
        "__1_0.distcp": [
            _spec("w", mixed["w"], ((3, 7), (0, 5))),
            _spec("bf", mixed["bf"], ((0, 4), (1, 6))),
            _spec("f8", mixed["f8"], ((0, 9),)),
            "t",
        ],
    }
    dcp.save_dcp(f"{root}/mixed", mixed, files, {"s": b"step", "t": b"lr"})
    job["mixed"] = f"{root}/mixed"
    return job


def _ok(*args: str) -> str:
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


def _arrays(path: str) -> dict[str, np.ndarray]:
    with open_checkpoint(path) as index:
        return {name: np.array(index.array(name)) for name in index.entries}


def test_the_kind_opens_as_chunked_tensors(job: dict[str, str]) -> None:
    assert identify(job["dcp"]) is DCP
    opened = DCP.open(job["dcp"], None, [])
    assert isinstance(opened, OpenedChunks) and opened.fmt == "distcp"
    w1 = opened.tensors["model.layers.0.attention.wq.weight"]
    assert w1.shape == (8, 8) and len(w1.boxes) in (3, 6)
    assert sorted(set(opened.saved_by.values())) == [0, 1, 2]
    assert list(opened.values) == ["extra_state"]


def test_transform_to_one_full_file_equals_the_model(job: dict[str, str], tmp_path: Path) -> None:
    out = _ok("transform", job["dcp"], str(tmp_path / "full"), "--output-format", "safetensors")
    assert "1 non-tensor values not carried: a safetensors output holds tensors only" in out
    (written,) = [str(p) for p in (tmp_path / "full").rglob("*.safetensors")]
    want, got = _arrays(job["full"]), _arrays(written)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name
    assert "SAME" in _ok("verify", job["dcp"], job["full"])
    assert "SAME" in _ok("verify", job["dcp"], written)


def test_transform_to_a_destination_strategy(job: dict[str, str], tmp_path: Path) -> None:
    _ok("transform", job["dcp"], str(tmp_path / "r4"), "--dst-strategy", job["s4"])
    assert len(list((tmp_path / "r4").glob("rank_*/*.safetensors"))) == 4
    assert "SAME" in _ok("verify", job["full"], str(tmp_path / "r4"), "--b-strategy", job["s4"])


def test_transform_to_hugging_face_with_filters_and_a_cast(job: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "hf"
    _ok("transform", job["dcp"], str(out), "--hf", "--weights-only", "--dtype", "bf16", "--include", "model.*")
    index = (
        json.loads((out / "model.safetensors.index.json").read_text())
        if (out / "model.safetensors.index.json").exists()
        else None
    )
    files = list(out.glob("*.safetensors"))
    got = {k: v for f in files for k, v in _arrays(str(f)).items()}
    assert got and all(name.startswith("model.") and "adam" not in name for name in got)
    assert all(a.dtype == ml_dtypes.bfloat16 for a in got.values() if a.ndim)
    want = _arrays(job["full"])
    for name, arr in got.items():
        assert np.array_equal(arr, want[name].astype(ml_dtypes.bfloat16)), name
    assert index is None or set(index["weight_map"]) == set(got)


def test_transform_with_a_rename_and_a_preset(job: dict[str, str], tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("- {match: 'model\\.(.*)', replace: 'net.\\1'}\n")
    _ok("transform", job["dcp"], str(tmp_path / "out"), "--output-format", "safetensors", "--rename", str(rules))
    (written,) = list((tmp_path / "out").rglob("*.safetensors"))
    got, want = _arrays(str(written)), _arrays(job["full"])
    assert not any(n.startswith("model.") for n in got)
    for name, arr in want.items():
        assert np.array_equal(got[name.replace("model.", "net.", 1) if name.startswith("model.") else name], arr)
    # a preset through the one tensor pipeline: the same Hugging Face model as from the full checkpoint
    _ok("transform", job["dcp"], str(tmp_path / "hf"), "--hf", "--preset", "llama")
    _ok("transform", job["full"], str(tmp_path / "hf_full"), "--hf", "--preset", "llama")
    assert "SAME" in _ok("verify", str(tmp_path / "hf_full"), str(tmp_path / "hf"))


def test_bf16_fp8_chunks_move_as_bytes(job: dict[str, str], tmp_path: Path) -> None:
    out = _ok("transform", job["mixed"], str(tmp_path / "m"), "--output-format", "safetensors")
    assert "2 non-tensor values not carried" in out
    (written,) = [str(p) for p in (tmp_path / "m").rglob("*.safetensors")]
    got = _arrays(written)
    assert got["bf"].dtype == ml_dtypes.bfloat16 and got["f8"].dtype == ml_dtypes.float8_e4m3fn
    want_bf = (np.arange(24, dtype=np.float32).reshape(4, 6) / 7).astype(ml_dtypes.bfloat16)
    assert got["bf"].view(np.uint16).tobytes() == want_bf.view(np.uint16).tobytes()
    assert np.array_equal(got["w"], np.arange(35, dtype=np.float32).reshape(7, 5))


def test_unify_parts_and_hugging_face(job: dict[str, str], tmp_path: Path) -> None:
    out = _ok("unify", job["dcp"], str(tmp_path / "u"))
    assert "non-tensor values not carried: a unified model holds tensors only" in out
    index = json.loads((tmp_path / "u" / "param_name_map.json").read_text())
    assert set(index["weight_map"]) == set(_arrays(job["full"]))
    assert "SAME" in _ok("verify", job["full"], str(tmp_path / "u"))
    _ok("unify", job["dcp"], str(tmp_path / "uh"), "--hf")  # model weights only, as transformers loads
    assert "SAME" in _ok("verify", job["full"], str(tmp_path / "uh"), "--weights-only")


def test_plan_and_rank_list_files(job: dict[str, str], tmp_path: Path) -> None:
    out = _ok("plan", job["dcp"], str(tmp_path / "p"), "--dst-strategy", job["s4"])
    assert "rank_0" in out and not (tmp_path / "p").exists()
    proc = run_cli("rank-list", "0", "--src", job["dcp"], "--dst-strategy", job["s4"], "--files", "--json")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr  # it writes nothing: no "values not carried"
    listed = json.loads(proc.stdout)
    assert listed and all(p.endswith((".distcp", ".metadata")) for p in listed)  # .metadata: a copy needs it
    assert os.path.abspath(os.path.join(job["dcp"], ".metadata")) in listed
    everything = json.loads(run_cli("rank-list", "0", "--src", job["dcp"], "--files", "--json").stdout)
    assert set(listed) <= set(everything)
    assert sorted(os.path.basename(p) for p in everything) == sorted(
        n for n in os.listdir(job["dcp"]) if n.endswith((".distcp", ".metadata"))
    )


def test_inspect_and_show(job: dict[str, str]) -> None:
    info = json.loads(run_cli("inspect", job["mixed"], "--json").stdout)
    assert info["kind"] == "dcp" and info["ranks"] == 2
    rows = {r["name"]: r for r in info["tensors"]}
    assert rows["bf"]["shape"] == [4, 6] and rows["bf"]["chunks"] == 2 and rows["bf"]["saved_by"] == [0, 1]
    assert rows["f8"]["saved_by"] == [1] and {v["name"] for v in info["values"]} == {"s", "t"}
    text = _ok("inspect", job["mixed"], "--params")
    assert "PyTorch DCP checkpoint" in text and "non-tensor values: 2" in text
    shown = _ok("show", job["mixed"], "bf")
    assert "bf [4, 6]" in shown and "cols 0:1" in shown and "cols 1:6" in shown


def test_verify_two_dcp_folders(job: dict[str, str], tmp_path: Path) -> None:
    other = tmp_path / "again"
    with open_checkpoint(job["full"]) as index:
        tensors = {name: np.array(index.array(name)) for name in index.entries}
    files = {"__0_0.distcp": [_spec(n, a, tuple((0, d) for d in a.shape)) for n, a in tensors.items()]}
    dcp.save_dcp(other, tensors, files)
    assert "SAME" in _ok("verify", job["dcp"], str(other))


# ------------------------------------------------------------------------------------ bad input


def _clean_failure(args: list[str], text: str, tmp_path: Path, watched: str) -> None:
    before = snapshot(watched)
    proc = run_cli(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reshard: error:") and text in lines[0], proc.stderr
    assert not (tmp_path / "out").exists() and not temp_files(str(tmp_path))
    assert snapshot(watched) == before


def test_a_strategy_given_with_a_dcp_is_refused(job: dict[str, str], tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    text = "carries its layouts in .metadata: give no"
    _clean_failure(["transform", job["dcp"], out, "--src-strategy", job["s4"]], text, tmp_path, job["dcp"])
    _clean_failure(["unify", job["dcp"], out, "--src-strategy", job["s4"]], text, tmp_path, job["dcp"])
    _clean_failure(["inspect", job["dcp"], "--strategy", job["s4"]], text, tmp_path, job["dcp"])


def test_a_truncated_distcp_is_one_line(job: dict[str, str], tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(job["dcp"], src)
    data = src / "__1_0.distcp"
    with open(data, "r+b") as fh:
        fh.truncate(data.stat().st_size // 2)
    _clean_failure(["transform", str(src), str(tmp_path / "out")], "truncated", tmp_path, str(src))


def test_a_metadata_naming_a_missing_file_is_one_line(job: dict[str, str], tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(job["dcp"], src)
    os.remove(src / "__2_0.distcp")
    _clean_failure(["transform", str(src), str(tmp_path / "out")], "__2_0.distcp", tmp_path, str(src))
    _clean_failure(["inspect", str(src)], "__2_0.distcp", tmp_path, str(src))


def test_the_python_api_reads_a_dcp(job: dict[str, str], tmp_path: Path) -> None:
    report = api.transform(job["mixed"], str(tmp_path / "o"), output=api.OutputSpec(format="safetensors"))
    assert any("non-tensor values not carried" in n for n in report.notes)
    assert report.plan.files and all(s.endswith(".distcp") for s in report.plan.sources)


# ------------------------------------------------------------------------------------ re-sourcing a plan onto chunks


def _apply(copies: list, chunks: dict[str, np.ndarray], out: np.ndarray) -> None:
    """What the executor does with each copy: a box of the chunk, permuted, put in place."""
    for c in copies:
        box = tuple(slice(s, s + n) for s, n in zip(c.src_start, c.src_lengths, strict=True))
        piece = chunks[c.tensor][box]
        if c.src_perm is not None:
            piece = piece.transpose(c.src_perm)
        out[tuple(slice(d, d + n) for d, n in zip(c.dst_start, c.lengths, strict=True))] = piece


def test_a_transposing_copy_reads_the_right_chunk_boxes() -> None:
    from reshard.layout.chunks import ChunkedTensor
    from reshard.ops.chunked import _chunk_copies
    from reshard.plan.boxes import Indexes
    from reshard.plan.model import Copy, SourcePaths

    full = np.arange(4 * 7, dtype=np.float32).reshape(4, 7)
    boxes = (((0, 4), (0, 4)), ((0, 2), (4, 7)), ((2, 4), (4, 7)))  # uneven, three chunks, not a grid in dim 0
    chunks = {f"w@{b[0][0]},{b[1][0]}": full[b[0][0] : b[0][1], b[1][0] : b[1][1]] for b in boxes}
    tensor = ChunkedTensor("w", (4, 7), dtypes.FLOAT32, boxes, ("f0", "f1", "f1"), tuple(chunks))
    # source box [1:4, 3:7] of w read transposed: the transpose's [3:7, 1:4]
    copy = Copy(0, "w", (1, 3), (0, 0), (4, 3), src_perm=(1, 0))
    out = np.zeros((4, 3), dtype=np.float32)
    _apply(_chunk_copies(copy, tensor, SourcePaths(), Indexes()), chunks, out)
    assert np.array_equal(out, full.T[3:7, 1:4])
    with pytest.raises(UnsupportedError, match="reshapes a tensor of a PyTorch DCP checkpoint"):
        _chunk_copies(Copy(0, "w", (0,), (0,), (28,), src_view=(28,)), tensor, SourcePaths(), Indexes())
