"""Checkpoint 2.0's on-disk facts (reshard.formats.checkpoint2), and bad input: one line, exit 2, nothing written."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from reshard.errors import FormatError, UnsupportedError, UsageError
from reshard.formats import checkpoint2 as cp2
from reshard.formats.safetensors import save_safetensors
from tests import checkpoint2_fixtures as fx
from tests.trust_helpers import run_cli, snapshot

ITER = "iteration_00000010"


def test_file_names() -> None:
    assert cp2.parse_file_name("model-0000003-0000008.safetensors") == cp2.FileName(None, "model", 3, 8)
    assert cp2.parse_file_name("llama-opt-0000000-0000004.safetensors") == cp2.FileName("llama", "opt", 0, 4)
    assert cp2.parse_file_name("model-3-8.safetensors") is None
    assert cp2.parse_file_name("checkpoint_0.safetensors") is None
    assert cp2.iteration_folder_name(10) == ITER


def test_shard_keys_are_parsed_without_eval() -> None:
    assert cp2.parse_shard_key("('decoder.w', (3,))", "m") == ("decoder.w", 3)
    assert cp2.parse_shard_key(cp2.shard_key("a'b", 0), "m") == ("a'b", 0)
    for bad in ("__import__('os')", "('w', 3)", "('w', (1, 2))", "('w', (-1,))", "[1, 2]", "('w', (True,))"):
        with pytest.raises(FormatError, match="storage_data key"):
            cp2.parse_shard_key(bad, "m")


def test_slice_ids_are_row_major_in_the_fragment_grid() -> None:
    frags = (4, 2)
    for sid in range(8):
        assert cp2.slice_id_of(cp2.slice_coordinate(sid, frags), frags) == sid
    assert cp2.slice_coordinate(5, frags) == (2, 1)
    chunk = cp2.Chunk(5, (3, 5))
    assert cp2.chunk_box(chunk, frags) == ((6, 9), (5, 10))
    assert cp2.slice_id_of_box(((6, 9), (5, 10)), frags) == 5
    assert cp2.slice_id_of_box(((1, 4), (0, 5)), frags) is None


def test_fixture_slice_ids_agree_with_reshard_boxes() -> None:
    """The fixture's port of MindFormers' slice ids against reshard's layout algebra."""
    from reshard.layout.algebra import rank_boxes

    for p in fx.dp2_tp4_params() + fx.pipeline_params():
        if p.layout is None:
            continue
        frags = fx.fragmentations(p.layout, len(p.shape))
        slices, _ = fx.slice_and_replica_ids(p.layout)
        lay = cp2.Layout(p.layout.device_matrix, tuple(
            tuple(e) if isinstance(e, list) else e for e in p.layout.tensor_map  # type: ignore[misc]
        ), p.layout.alias_name, p.layout.rank_list)  # fmt: skip
        boxes = rank_boxes(lay.param_layout(), p.shape)
        assert [cp2.slice_id_of_box(b, frags) for b in boxes] == slices, p.name


def test_resolve_iteration(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    fx.write_checkpoint2(str(root), fx.single_card_params(), 1, iteration=10)
    fx.write_checkpoint2(str(root), fx.single_card_params(), 1, iteration=20, tracker=False)
    assert cp2.resolve_iteration(str(root)) == str(root / ITER)
    assert cp2.resolve_iteration(str(root), 20) == str(root / "iteration_00000020")
    assert cp2.resolve_iteration(str(root / ITER)) == str(root / ITER)
    with pytest.raises(UsageError, match="names another"):
        cp2.resolve_iteration(str(root / ITER), 20)
    with pytest.raises(UsageError, match="no iteration 7"):
        cp2.resolve_iteration(str(root), 7)
    (root / cp2.TRACKER_NAME).write_text("30")
    with pytest.raises(UsageError, match="names iteration 30 but iteration_00000030 is missing"):
        cp2.resolve_iteration(str(root))
    (root / cp2.TRACKER_NAME).write_text("ten")
    with pytest.raises(FormatError, match="not an iteration number"):
        cp2.resolve_iteration(str(root))
    os.remove(root / cp2.TRACKER_NAME)
    with pytest.raises(UsageError, match="choose one with --src-iteration"):
        cp2.resolve_iteration(str(root))


def test_metadata_is_parsed_into_frozen_values(tmp_path: Path) -> None:
    fx.write_checkpoint2(str(tmp_path), fx.dp2_tp4_params(), 8)
    md = cp2.read_metadata(str(tmp_path / ITER / cp2.METADATA_NAME))
    fc1 = md.tensors["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1.layout is not None and fc1.layout.tensor_map == ((1, 0), -1)
    assert fc1.layout.param_layout().tensor_map == ((1, 0), (-1,))
    assert fc1.axis_fragmentations == (8, 1) and len(fc1.chunks) == 8
    emb = md.tensors["embedding.word_embeddings.weight"]
    assert emb.replica_id == (0, 0, 0, 0, 1, 1, 1, 1)
    assert md.storage[(emb.name, 2)] == (
        cp2.StorageRecord("model-0000002-0000008.safetensors", 2, (2, 6)),
        cp2.StorageRecord("model-0000006-0000008.safetensors", 6, (2, 6)),
    )
    assert md.tensors["global_step"].layout is None
    assert cp2.read_common(str(tmp_path / ITER)) == fx.COMMON


# --------------------------------------------------------------------------------------------
# bad input: each one line on stderr, exit 2, nothing written, the input untouched


def _meta(folder: Path) -> dict:
    return json.loads((folder / cp2.METADATA_NAME).read_text())


def _put_meta(folder: Path, meta: object) -> None:
    path = folder / cp2.METADATA_NAME
    os.chmod(path, 0o644)
    path.write_text(json.dumps(meta))


def _not_json(f: Path) -> None:
    _put_meta(f, {})
    (f / cp2.METADATA_NAME).write_text("{not json")


def _missing_key(f: Path) -> None:
    m = _meta(f)
    del m["state_dict_metadata"]["embedding.word_embeddings.weight"]["global_shape"]
    _put_meta(f, m)


def _wrong_type(f: Path) -> None:
    m = _meta(f)
    m["state_dict_metadata"]["embedding.word_embeddings.weight"]["axis_fragmentations"] = "4,1"
    _put_meta(f, m)


def _bad_dtype_name(f: Path) -> None:
    m = _meta(f)
    m["state_dict_metadata"]["embedding.word_embeddings.weight"]["properties"]["dtype"] = "Float99"
    _put_meta(f, m)


def _bad_storage_key(f: Path) -> None:
    m = _meta(f)
    m["storage_data"]["__import__('os').system('true')"] = m["storage_data"].popitem()[1]
    _put_meta(f, m)


def _interleaved(f: Path) -> None:
    m = _meta(f)
    m["state_dict_metadata"]["embedding.word_embeddings.weight"]["layout"]["interleaved_parallel"] = True
    _put_meta(f, m)


def _storage_file_missing(f: Path) -> None:
    os.remove(f / "opt-0000003-0000008.safetensors")


def _other_shape(f: Path) -> None:
    path = f / "model-0000001-0000008.safetensors"
    os.remove(path)
    arrays = fx.full_tensors([p for p in fx.dp2_tp4_params() if not p.optimizer])
    tensors = {n: np.ascontiguousarray(a[:2]) if a.ndim > 1 else a for n, a in arrays.items()}
    save_safetensors(str(path), tensors, {"format": "ms"})


def _other_dtype(f: Path) -> None:
    path = f / "model-0000002-0000008.safetensors"
    from reshard.formats.safetensors import read_safetensors

    with read_safetensors(str(path)) as index:
        tensors = {n: index.array(n).copy() for n in index.entries}
    tensors["embedding.word_embeddings.weight"] = tensors["embedding.word_embeddings.weight"].astype(np.float16)
    os.remove(path)
    save_safetensors(str(path), tensors, {"format": "ms"})


def _two_worlds(f: Path) -> None:
    shutil.copy(f / "model-0000000-0000008.safetensors", f / "model-0000000-0000004.safetensors")


def _chunk_off_the_layout(f: Path) -> None:
    m = _meta(f)
    emb = m["state_dict_metadata"]["embedding.word_embeddings.weight"]
    emb["layout"]["tensor_map"] = [-1, 0]  # says columns, the chunks say rows
    _put_meta(f, m)


EMB = "embedding.word_embeddings.weight"  # 4 chunks: rows cut in 4 by its layout


def _layout_dropped(f: Path) -> None:
    m = _meta(f)
    m["state_dict_metadata"][EMB]["layout"] = None  # its chunks still cut it in 4
    _put_meta(f, m)


def _chunk_dropped(f: Path) -> None:
    m = _meta(f)
    emb = m["state_dict_metadata"][EMB]
    emb["chunk"] = [c for c in emb["chunk"] if c["global_offset"] != [2]]  # a gap, and no record of it
    m["storage_data"] = {k: v for k, v in m["storage_data"].items() if k != str((EMB, (2,)))}
    _put_meta(f, m)


def _two_slices_in_one_file(f: Path) -> None:
    m = _meta(f)
    m["storage_data"][str((EMB, (1,)))] = m["storage_data"][str((EMB, (0,)))]  # slice 1 "in" slice 0's files
    _put_meta(f, m)


def _no_storage_data(f: Path) -> None:
    m = _meta(f)
    del m["storage_data"]
    _put_meta(f, m)


def _metadata_missing(f: Path) -> None:
    os.remove(f / cp2.METADATA_NAME)


BAD: dict[str, tuple[Callable[[Path], None], str]] = {
    "not-json": (_not_json, "metadata.json: not valid JSON"),
    "missing-key": (_missing_key, "missing 'global_shape'"),
    "wrong-type": (_wrong_type, "axis_fragmentations is not a list of integers"),
    "unknown-dtype": (_bad_dtype_name, "unknown MindSpore tensor type 'Float99'"),
    "storage-key": (_bad_storage_key, "is not ('name', (slice_id,))"),
    "interleaved": (_interleaved, "interleaved_parallel"),
    "file-missing": (_storage_file_missing, "opt-0000003-0000008.safetensors, named in metadata.json"),
    "other-shape": (_other_shape, "model-0000001-0000008.safetensors: 'embedding.word_embeddings.weight' has shape"),
    "other-dtype": (_other_dtype, "model-0000002-0000008.safetensors: 'embedding.word_embeddings.weight' is Float16"),
    "two-worlds": (_two_worlds, "model-0000000-0000004.safetensors (of 4 files) and model-0000000-0000008"),
    "layout-vs-chunks": (_chunk_off_the_layout, "axis_fragmentations are [4, 1], but its layout"),
    "layout-null-chunks-cut": (_layout_dropped, "axis_fragmentations are [4, 1], but it has no layout"),
    "chunk-gap": (
        _chunk_dropped,
        "chunk(s) leave a gap in global_shape [16, 12]: none is slice 2 (elements [[8, 12], [0, 12]])",
    ),
    "two-slices-one-file": (_two_slices_in_one_file, f"holds one {EMB!r}, but storage_data stores slices 0 and 1"),
    "no-storage-data": (_no_storage_data, "metadata.json: missing 'storage_data'"),
    "metadata-missing": (_metadata_missing, "metadata.json is missing (the files are of an 8-rank job)"),
}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("command", ["transform", "unify", "inspect"])
def test_bad_checkpoint2_is_one_line_and_nothing_written(tmp_path: Path, case: str, command: str) -> None:
    root = tmp_path / "ck"
    fx.write_checkpoint2(str(root), fx.dp2_tp4_params(), 8)
    spoil, expected = BAD[case]
    spoil(root / ITER)
    before = snapshot(str(root))
    out = tmp_path / "out"
    argv = {
        "transform": ["transform", "--src", str(root), "--dst", str(out)],
        "unify": ["unify", str(root), str(out)],
        "inspect": ["inspect", str(root)],
    }[command]
    proc = run_cli(*argv)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("reshard: note:")]
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    assert not out.exists()
    assert snapshot(str(root)) == before


def test_tracker_naming_a_missing_iteration(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    fx.write_checkpoint2(str(root), fx.single_card_params(), 1)
    (root / cp2.TRACKER_NAME).write_text("12")
    proc = run_cli("transform", "--src", str(root), "--dst", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"reshard: error: {root / cp2.TRACKER_NAME}: names iteration 12 but iteration_00000012 is missing"
    )
    assert not (tmp_path / "o").exists()


def test_a_source_strategy_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    fx.write_checkpoint2(str(root), fx.dp2_tp4_params(), 8)
    for argv in (
        ["transform", "--src", str(root), "--dst", str(tmp_path / "o"), "--src-strategy", "s.ckpt"],
        ["unify", str(root), str(tmp_path / "o"), "--src-strategy", "s.ckpt"],
        ["verify", str(root), str(root), "--a-strategy", "s.ckpt"],
        ["inspect", str(root), "--strategy", "s.ckpt"],
        ["rank-list", "0", "--src", str(root), "--src-strategy", "s.ckpt"],
    ):
        proc = run_cli(*argv)
        assert proc.returncode == 2, (argv, proc.stderr)
        assert "carries its layouts in metadata.json" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_refusals_raise_the_house_errors(tmp_path: Path) -> None:
    fx.write_checkpoint2(str(tmp_path), fx.dp2_tp4_params(), 8)
    _interleaved(tmp_path / ITER)
    with pytest.raises(UnsupportedError):
        cp2.read_metadata(str(tmp_path / ITER / cp2.METADATA_NAME))


# sha256 of the metadata.json MindFormers 2.1.0 wrote for fx.mindformers_sample_params() (8 ranks,
# save_checkpoint once per rank with its own _build_all_sharded_tensor_from_global_layout metadata)
MINDFORMERS_METADATA_SHA256 = "be1c096b7eac7ee6beb9fdcd38c755cb46e7e58319aacf7b5e17d3882c96112b"


def test_fixture_metadata_is_what_mindformers_writes(tmp_path: Path) -> None:
    import hashlib

    full = fx.write_checkpoint2(str(tmp_path), fx.mindformers_sample_params(), 8)
    data = (tmp_path / ITER / cp2.METADATA_NAME).read_bytes()
    assert hashlib.sha256(data).hexdigest() == MINDFORMERS_METADATA_SHA256
    assert full["learning_rate"].shape == ()
    assert (tmp_path / cp2.TRACKER_NAME).read_bytes() == b"10"
    assert oct(os.stat(tmp_path / ITER / "model-0000000-0000008.safetensors").st_mode & 0o777) == "0o400"


def test_an_iteration_for_another_kind_is_refused(tmp_path: Path) -> None:
    from tests.trust_helpers import make_job

    job = make_job(str(tmp_path / "job"))
    root = tmp_path / "ck"
    fx.write_checkpoint2(str(root), fx.single_card_params(), 1)
    for argv in (
        ["transform", "--src", job["r8"], "--src-strategy", job["s8"], "--dst", str(tmp_path / "o"),
         "--src-iteration", "3"],
        ["unify", job["r8st"], str(tmp_path / "o"), "--src-strategy", job["s8"], "--src-iteration", "3"],
        ["inspect", job["r8"], "--src-iteration", "3"],
        ["verify", job["r8"], job["r8"], "--a-strategy", job["s8"], "--b-strategy", job["s8"], "--src-iteration", "3"],
        ["rank-list", "0", "--src-strategy", job["s8"], "--src-iteration", "3"],
    ):  # fmt: skip
        proc = run_cli(*argv)
        assert proc.returncode == 2, (argv, proc.stderr)
        assert "applies to a MindFormers Checkpoint 2.0" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
    # verify: the iteration applies to the Checkpoint 2.0 side, the other side is read as usual
    assert run_cli("transform", "--src", str(root), "--dst", str(tmp_path / "full")).returncode == 0
    proc = run_cli("verify", str(root), str(tmp_path / "full"), "--src-iteration", "10")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_notes_for_a_missing_tracker_and_an_unhealthy_status(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    fx.write_checkpoint2(str(root), fx.single_card_params(), 1, tracker=False, common={**fx.COMMON, "ckpt_status": 1})
    proc = run_cli("inspect", str(root))
    assert proc.returncode == 0, proc.stderr
    assert "the save may be unfinished" in proc.stderr
    assert "ckpt_status is 1 (0 is a healthy checkpoint)" in proc.stderr
