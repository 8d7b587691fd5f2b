"""Megatron-core ``torch_dist`` checkpoints without torch: the files around the DCP data, the source kind
(a save folder, a Megatron-LM run folder and its iterations), ``--output-format torch_dist`` and its
run folder, stacked layer tensors sliced along their layer axis, and the refusals.

What megatron-core makes of reshard's outputs, and reshard of megatron's, is
``tests/test_megatron_oracle.py``'s; here reshard's own DCP reader reads them back.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest

from reshard import api
from reshard.formats import dcp, megatron
from reshard.formats.safetensors import save_safetensors
from reshard.sources import CHECKPOINT2, DCP, MEGATRON, ReadOptions, registry
from tests.test_dcp_write import full_tensors, read_back
from tests.trust_helpers import make_job, run_cli

TORCH_DIST = api.OutputSpec(format="torch_dist")
STACKED = "decoder.layers.mlp.linear_fc1.weight"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_job(str(tmp_path_factory.mktemp("megatron")))


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].shape == value.shape and got[name].tobytes() == value.tobytes(), name


def test_empty_common_is_torch_saves_zip_of_an_empty_dict() -> None:
    data = megatron.empty_common()
    archive = zipfile.ZipFile(io.BytesIO(data))
    assert archive.testzip() is None
    names = [i.filename for i in archive.infolist()]
    assert names == [
        "common/data.pkl",
        "common/.format_version",
        "common/.storage_alignment",
        "common/byteorder",
        "common/version",
        "common/.data/serialization_id",
    ]
    assert pickle.loads(archive.read("common/data.pkl")) == {}
    for info in archive.infolist():  # every member's data aligned to 64 bytes, as torch.save lays it out
        name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)  # the local header's
        start = info.header_offset + 30 + name_len + extra_len
        assert start % 64 == 0 and data[start : start + info.file_size] == archive.read(info)
    assert len(data) == 1255  # what torch.save({}, "common.pt") writes (the oracle compares the bytes)


def test_config_is_megatrons_record(tmp_path: Path) -> None:
    assert json.loads(megatron.config_text()) == megatron.CONFIG
    (tmp_path / "metadata.json").write_text(megatron.config_text())
    assert megatron.read_config(str(tmp_path))["sharded_backend"] == "torch_dist"


def test_torch_dist_output_files_and_order(job: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "td"
    report = api.transform(job["r8"], str(out), job["s8"], None, output=TORCH_DIST)
    names = [os.path.basename(t.path) for t in report.plan.texts]
    assert names == ["common.pt", ".metadata", "metadata.json"]  # metadata.json, megatron's marker, last
    assert (out / "common.pt").read_bytes() == megatron.empty_common()
    assert json.loads((out / "metadata.json").read_text()) == megatron.CONFIG
    assert_same(read_back(str(out)), full_tensors(job["full"]))
    assert registry.identify(str(out)) is MEGATRON


def test_run_folder_out_and_back(job: dict[str, str], tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = run_cli(
        "transform", job["r8"], str(run), "--src-strategy", job["s8"], "--output-format", "torch_dist",
        "--dst-iteration", "30", "--dcp-ranks", "2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "30"
    assert sorted(os.listdir(run / "iter_0000030")) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt", "metadata.json"
    ]  # fmt: skip
    assert registry.identify(str(run)) is MEGATRON
    proc = run_cli("verify", job["full"], str(run))
    assert proc.returncode == 0 and "SAME" in proc.stdout, proc.stdout + proc.stderr
    assert "reading iter_0000030" in proc.stderr
    api.transform(str(run / "iter_0000030"), str(run / "iter_0000040"), None, None, output=TORCH_DIST)
    (run / "latest_checkpointed_iteration.txt").write_text("40")
    opened = MEGATRON.open(str(run), ReadOptions(iteration=30), [])
    assert os.path.basename(opened.path) == "iter_0000030"
    assert os.path.basename(MEGATRON.open(str(run), None, []).path) == "iter_0000040"
    proc = run_cli("inspect", str(run), "--src-iteration", "30")
    assert proc.returncode == 0 and proc.stdout.startswith("Megatron-core torch_dist checkpoint"), proc.stdout


def test_a_torch_dist_source_carries_its_common_pt(job: dict[str, str], tmp_path: Path) -> None:
    src = tmp_path / "src"
    api.transform(job["full"], str(src), None, None, output=api.OutputSpec(format="torch_dist", dcp_ranks=3))
    opaque = b"not a pickle reshard would ever load \x00\xff"  # carried byte for byte, never unpickled
    (src / "common.pt").write_bytes(opaque)
    for cmd in (["transform", str(src), str(tmp_path / "o1")], ["convert", job["full"], str(tmp_path / "o2")]):
        fmt = ["--output-format", "torch_dist"] if cmd[0] == "transform" else ["--to", "torch_dist"]
        proc = run_cli(*cmd, *fmt)
        assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "o1" / "common.pt").read_bytes() == opaque
    assert (tmp_path / "o2" / "common.pt").read_bytes() == megatron.empty_common()
    assert_same(read_back(str(tmp_path / "o1")), full_tensors(job["full"]))
    proc = run_cli(
        "split", job["full"], str(tmp_path / "o3"), "--dst-strategy", job["s4"], "--output-format", "torch_dist"
    )
    assert proc.returncode == 0, proc.stderr
    assert_same(read_back(str(tmp_path / "o3")), full_tensors(job["full"]))


def test_a_stacked_layer_tensor_is_sliced_along_its_layer_axis(tmp_path: Path) -> None:
    stacked = np.arange(4 * 6 * 3, dtype=np.float32).reshape(4, 6, 3)  # 4 layers' fc1 weights, stacked
    save_safetensors(
        str(tmp_path / "m.safetensors"), {STACKED: stacked, "embedding.weight": np.ones((5, 3), np.float32)}
    )
    api.transform(str(tmp_path / "m.safetensors"), str(tmp_path / "pp2"), None, None, output=TORCH_DIST)
    api.transform(
        str(tmp_path / "pp2"), str(tmp_path / "pp4"), None, None, output=api.OutputSpec("torch_dist", dcp_ranks=4)
    )
    meta = dcp.read_dcp_metadata(str(tmp_path / "pp4"))
    chunks = meta.tensors[STACKED].chunks  # one chunk per "pipeline stage": a range of the layer axis
    assert [(c.offsets, c.sizes) for c in chunks] == [((k, 0, 0), (1, 6, 3)) for k in range(4)]
    assert read_back(str(tmp_path / "pp4"))[STACKED].tobytes() == stacked.tobytes()
    proc = run_cli("inspect", str(tmp_path / "pp4"), "--json")
    rows = {r["name"]: r for r in json.loads(proc.stdout)["tensors"]}
    assert rows[STACKED]["shape"] == [4, 6, 3] and rows[STACKED]["chunks"] == 4


def test_detection_before_checkpoint2_and_strategies(job: dict[str, str], tmp_path: Path) -> None:
    api.transform(job["full"], str(tmp_path / "run" / "iter_0000010"), None, None, output=TORCH_DIST)
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("10")  # MindFormers' tracker name too
    assert registry.identify(str(tmp_path / "run")) is MEGATRON
    os.remove(tmp_path / "run" / "latest_checkpointed_iteration.txt")
    assert registry.identify(str(tmp_path / "run")) is MEGATRON  # its one save
    plain = tmp_path / "plain"
    api.transform(job["full"], str(plain), None, None, output=api.OutputSpec(format="dcp"))
    assert registry.identify(str(plain)) is DCP
    assert registry.kind_of(str(tmp_path / "run")) is not CHECKPOINT2
    (tmp_path / "zarr").mkdir()
    (tmp_path / "zarr" / "metadata.json").write_text(json.dumps({**megatron.CONFIG, "sharded_backend": "zarr"}))
    (tmp_path / "zarr" / "common.pt").write_bytes(megatron.empty_common())
    assert registry.identify(str(tmp_path / "zarr")) is MEGATRON  # was taken for a strategy folder


def _torch_dist(job: dict[str, str], path: Path) -> Path:
    api.transform(job["full"], str(path), None, None, output=api.OutputSpec(format="torch_dist", dcp_ranks=2))
    return path


@pytest.mark.parametrize(
    ("breaks", "text"),
    [
        (lambda p: (p / "metadata.json").write_text("{not json"), "metadata.json does not parse"),
        (lambda p: (p / "metadata.json").write_text("[1]"), "no sharded_backend"),
        (
            lambda p: (p / "metadata.json").write_text(json.dumps({**megatron.CONFIG, "sharded_backend": "zarr"})),
            "'zarr' sharded backend is not supported",
        ),
        (lambda p: os.remove(p / "common.pt"), "no common.pt"),
    ],
    ids=["garbled", "not-a-record", "zarr", "no-common"],
)
def test_bad_save_folders(job: dict[str, str], tmp_path: Path, breaks: object, text: str) -> None:
    src = _torch_dist(job, tmp_path / "src")
    breaks(src)  # type: ignore[operator]
    proc = run_cli("transform", str(src), str(tmp_path / "out"), "--output-format", "safetensors")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert text in proc.stderr and not (tmp_path / "out").exists()


def test_bad_run_folders(job: dict[str, str], tmp_path: Path) -> None:
    run = tmp_path / "run"
    _torch_dist(job, run / "iter_0000010")
    (run / "latest_checkpointed_iteration.txt").write_text("20")
    for args, text in (
        (["inspect", str(run)], "names iter_0000020 but that folder is missing"),
        (["inspect", str(run), "--src-iteration", "7"], "no iteration 7 (iter_0000007 is missing; found iter_0000010)"),
        (["inspect", str(run / "iter_0000010"), "--src-iteration", "10"], "picks a save of a Megatron-LM run folder"),
    ):
        proc = run_cli(*args)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert text in proc.stderr, proc.stderr
    (run / "latest_checkpointed_iteration.txt").write_text("ten")
    proc = run_cli("inspect", str(run))
    assert proc.returncode == 2 and "not an iteration number or 'release'" in proc.stderr
    (run / "latest_checkpointed_iteration.txt").write_text("10")
    os.remove(run / "iter_0000010" / "metadata.json")
    proc = run_cli("inspect", str(run))
    assert proc.returncode == 2 and "no metadata.json" in proc.stderr, proc.stderr


def test_refusals_before_anything_is_read(job: dict[str, str], tmp_path: Path) -> None:
    proc = run_cli("transform", job["full"], str(tmp_path / "o"), "--output-format", "torch_dist", "--prefix", "x")
    assert proc.returncode == 2 and "give no --prefix" in proc.stderr
    proc = run_cli("transform", job["full"], str(tmp_path / "o"), "--output-format", "dcp", "--dst-iteration", "3")
    assert proc.returncode == 2, proc.stderr
    assert "--dst-iteration applies to --output-format checkpoint2 or torch_dist only, not to dcp" in proc.stderr
    proc = run_cli("unify", job["r8"], str(tmp_path / "o"), "--output-format", "torch_dist")
    assert proc.returncode == 2
    assert not (tmp_path / "o").exists()


def test_non_tensor_values_are_carried_into_torch_dist(job: dict[str, str], tmp_path: Path) -> None:
    from reshard.formats.dcp.data import read_bytes_item
    from reshard.sources import open_checkpoint
    from tests.test_dcp_ops import chunked_files

    with open_checkpoint(job["full"]) as index:
        tensors = {name: np.array(index.array(name)) for name in index.entries if name != "global_step"}
    src = tmp_path / "src"
    opaque = b"\x80\x02 a ShardedObject's torch.save bytes, never unpickled"
    dcp.save_dcp(src, tensors, chunked_files(tensors), {"extra_state": opaque})
    (src / "metadata.json").write_text(megatron.config_text())
    (src / "common.pt").write_bytes(megatron.empty_common())
    report = api.transform(str(src), str(tmp_path / "out"), None, None, output=TORCH_DIST)
    assert not any("not carried" in n for n in report.notes), report.notes
    assert [os.path.basename(t.path) for t in report.plan.texts] == [
        "common.pt", "__0_1.distcp", ".metadata", "metadata.json"
    ]  # fmt: skip
    meta = dcp.read_dcp_metadata(str(tmp_path / "out"))
    assert read_bytes_item(meta, "extra_state") == opaque
    proc = run_cli("transform", str(src), str(tmp_path / "plain"), "--output-format", "dcp")
    assert proc.returncode == 0 and "not carried" not in proc.stderr, proc.stderr  # a plain DCP output carries them
    assert read_bytes_item(dcp.read_dcp_metadata(str(tmp_path / "plain")), "extra_state") == opaque
    assert not (tmp_path / "plain" / "common.pt").exists()


def test_iteration_folders_and_the_release_tracker(tmp_path: Path) -> None:
    for name in ("iter_0000005", "iter_12345678", "release", "iteration_00000005"):
        (tmp_path / name).mkdir()
    assert megatron.iteration_folders(str(tmp_path)) == ["iter_0000005", "iter_12345678", "release"]
    assert megatron.iteration_name(12345678) == "iter_12345678"
    (tmp_path / megatron.TRACKER_NAME).write_text("release\n")
    assert megatron.resolve_iteration(str(tmp_path), None) == str(tmp_path / "release")
    assert megatron.resolve_iteration(str(tmp_path), 5) == str(tmp_path / "iter_0000005")


def test_every_command_reads_a_run_folder(job: dict[str, str], tmp_path: Path) -> None:
    run = tmp_path / "run"
    api.transform(job["r8"], str(run), job["s8"], None, output=api.OutputSpec("torch_dist", iteration=3, dcp_ranks=2))
    save = run / "iter_0000003"
    data = [str(save / f"__{r}_0.distcp") for r in range(2)]
    sides = [str(run / "latest_checkpointed_iteration.txt"), *(str(save / n) for n in ("metadata.json", "common.pt"))]
    proc = run_cli("rank-list", "0", "--src", str(run), "--files")  # what a copy of the run must hold
    assert proc.returncode == 0 and proc.stdout.split() == sorted([*data, *sides, str(save / ".metadata")]), (
        proc.stdout + proc.stderr
    )
    proc = run_cli("plan", str(run), str(tmp_path / "p"), "--dst-strategy", job["s4"])
    assert proc.returncode == 0 and "rank_3" in proc.stdout, proc.stderr
    proc = run_cli("show", str(run), "model.layers.0.attention.wq.weight", "-o", str(tmp_path / "wq.svg"))
    assert proc.returncode == 0 and (tmp_path / "wq.svg").read_text().startswith("<"), proc.stderr
    proc = run_cli("unify", str(run), str(tmp_path / "u"))
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("verify", str(tmp_path / "u"), job["full"])
    assert proc.returncode == 0 and "SAME" in proc.stdout, proc.stdout + proc.stderr
    proc = run_cli(
        "transform", str(run), str(tmp_path / "r4"), "--dst-strategy", job["s4"], "--src-strategy", job["s8"]
    )
    assert proc.returncode == 2 and "carries its layouts in .metadata: give no source strategy" in proc.stderr


def test_a_legacy_megatron_lm_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "run" / "iter_0000010" / "mp_rank_00").mkdir(parents=True)
    (tmp_path / "run" / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"PK")
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("10")
    proc = run_cli("inspect", str(tmp_path / "run"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "legacy torch checkpoint (mp_rank_*/model_optim_rng.pt) is not supported" in proc.stderr


def test_an_interrupted_run_folder_never_looks_complete(job: dict[str, str], tmp_path: Path) -> None:
    import signal

    from tests.test_integrity_signals import run_paused

    run = tmp_path / "run"
    args = ["transform", job["r8"], str(run), "--src-strategy", job["s8"], "--output-format", "torch_dist"]
    args += ["--dst-iteration", "9", "--workers", "1"]
    proc = run_paused(args, "file:8", signal.SIGINT, str(tmp_path / "marker"))
    assert proc.returncode == 130, proc.stderr
    save = run / "iter_0000009"
    assert not any((save / n).exists() for n in (".metadata", "metadata.json"))  # seven data files only
    assert not (run / "latest_checkpointed_iteration.txt").exists()
    done = run_cli(*args, "--resume")
    assert done.returncode == 0, done.stderr
    marker = os.stat(save / "metadata.json").st_mtime_ns
    assert all(os.stat(save / n).st_mtime_ns <= marker for n in os.listdir(save))  # metadata.json last
    assert os.stat(run / "latest_checkpointed_iteration.txt").st_mtime_ns >= marker  # then the tracker
    assert_same(read_back(str(save)), full_tensors(job["full"]))
    dst = tmp_path / "again"
    api.transform(job["full"], str(dst), None, None, output=api.OutputSpec("torch_dist", dcp_ranks=3))
    args = ["transform", job["full"], str(dst), "--output-format", "torch_dist", "--dcp-ranks", "2", "--overwrite"]
    proc = run_paused(args, "file", signal.SIGINT, str(tmp_path / "marker2"))
    assert proc.returncode == 130, proc.stderr
    assert not (dst / "metadata.json").exists() and not (dst / ".metadata").exists()  # no longer complete


def test_split_and_convert_write_a_run_folder(job: dict[str, str], tmp_path: Path) -> None:
    """``--dst-iteration`` on split and on convert --to torch_dist: a Megatron-LM run folder (a second
    iteration into it with --overwrite keeps the first); other outputs refuse it in one line."""
    run = tmp_path / "run"
    split = ["split", job["full"], str(run), "--dst-strategy", job["s4"], "--output-format", "torch_dist"]
    proc = run_cli(*split, "--dst-iteration", "5")
    assert proc.returncode == 0, proc.stderr
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert_same(read_back(str(run / "iter_0000005")), full_tensors(job["full"]))
    proc = run_cli("convert", job["full"], str(run), "--to", "torch_dist", "--dst-iteration", "6", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert (run / "iter_0000005" / "metadata.json").is_file()  # the earlier save stays
    assert_same(read_back(str(run / "iter_0000006")), full_tensors(job["full"]))
    proc = run_cli("verify", job["full"], str(run), "--src-iteration", "5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for args in (
        ["split", job["full"], str(tmp_path / "o"), "--dst-strategy", job["s4"]],
        ["split", job["full"], str(tmp_path / "o"), "--dst-strategy", job["s4"], "--output-format", "dcp"],
        ["convert", job["full"], str(tmp_path / "o"), "--to", "safetensors"],
        ["convert", job["full"], str(tmp_path / "o"), "--to", "dcp"],
    ):
        proc = run_cli(*args, "--dst-iteration", "3")
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "--dst-iteration applies to" in proc.stderr and "torch_dist" in proc.stderr
        assert not (tmp_path / "o").exists()


def test_unify_writes_the_full_tensors_as_dcp_and_torch_dist(job: dict[str, str], tmp_path: Path) -> None:
    """``unify --output-format dcp|torch_dist``: the full tensors (each whole, or dim 0 in ``--dcp-ranks`` data
    files), as transform writes them with no destination strategy; the part packing has no DCP form."""
    plain = tmp_path / "dcp"
    proc = run_cli("unify", job["r8"], str(plain), "--src-strategy", job["s8"], "--output-format", "dcp")
    assert proc.returncode == 0, proc.stderr
    meta = dcp.read_dcp_metadata(str(plain))
    assert meta.files == ("__0_0.distcp",) and all(len(t.chunks) == 1 for t in meta.tensors.values())
    run = tmp_path / "run"
    flags = ["--output-format", "torch_dist", "--dcp-ranks", "2", "--dst-iteration", "7"]
    proc = run_cli("unify", job["r8"], str(run), "--src-strategy", job["s8"], *flags)
    assert proc.returncode == 0, proc.stderr
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "7"
    assert (run / "iter_0000007" / "metadata.json").is_file() and (run / "iter_0000007" / "common.pt").is_file()
    for out in (plain, run):
        check = run_cli("verify", job["full"], str(out))
        assert check.returncode == 0 and "SAME" in check.stdout, check.stdout + check.stderr
    proc = run_cli("unify", job["r8"], str(tmp_path / "o"), "--src-strategy", job["s8"], "--output-format", "dcp",
                   "--split", "1/2")  # fmt: skip
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--split" in proc.stderr and "a dcp output has none" in proc.stderr
    for flags, said in (
        (["--dcp-ranks", "2"], "a DCP rank count needs --output-format dcp or torch_dist"),
        (["--dst-iteration", "3"], "not to the default output format"),
        (["--output-format", "dcp", "--dst-iteration", "3"], "not to dcp"),
    ):
        proc = run_cli("unify", job["r8"], str(tmp_path / "o"), "--src-strategy", job["s8"], *flags)
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists()
