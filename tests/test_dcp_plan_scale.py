"""A DCP source into a DCP output is planned from the chunk boxes at once (``ops.chunked.boxed_dcp``:
lazy files, one table per chunking, the ``.metadata`` pickled when written), and writes the same
bytes as the general path (every copy of a full tensor re-cut, ``plan.dcp.dcp_plan``); a checkpoint
of 4 096 ranks plans into 1 024 through ``reshard plan`` in seconds.

The synthetic checkpoints are ``bench/dcp_metadata.py``'s (``.metadata`` and sparse data files).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bench.dcp_metadata import make

from reshard import api
from reshard.formats import dcp
from reshard.ops import chunked
from reshard.plan.boxes import BoxTensors
from reshard.plan.dcp import DeferredText
from tests.test_dcp_ops import chunked_files
from tests.test_dcp_write import read_back
from tests.trust_helpers import make_job, run_cli, tree

PLAN_SECONDS = 60  # 64 000 chunks -> 64 ranks plans in well under a second alone; the suite shares 2 cores


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The trust job and its full model as a DCP folder of uneven chunks (``dcp``), with its tensors."""
    root = str(tmp_path_factory.mktemp("dcpscale"))
    job: dict[str, Any] = dict(make_job(root))
    tensors = {n: a for n, a in read_back_full(job["full"]).items()}
    dcp.save_dcp(f"{root}/dcp", tensors, chunked_files(tensors), {"extra_state": b"\x80\x04opaque"})
    job["dcp"], job["tensors"] = f"{root}/dcp", tensors
    return job


def read_back_full(path: str) -> dict[str, np.ndarray]:
    from reshard.sources import open_checkpoint

    with open_checkpoint(path) as index:
        return {
            name: np.array(index.array(name)) for name in index.entries if index.entries[name].dtype.ms_name != "String"
        }


def _both(job: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> tuple[str, str]:
    """The same transform through the box plan and through the general re-cut."""
    boxed, general = str(tmp_path / "boxed"), str(tmp_path / "general")
    report = api.transform(job["dcp"], boxed, None, kw.pop("dst_strategy", None), **kw)
    assert all(isinstance(f.tensors, BoxTensors) for f in report.plan.files)
    assert isinstance(report.plan.texts[-1], DeferredText)  # .metadata, after the carried values' file
    with monkeypatch.context() as patched:
        patched.setattr(chunked, "boxed_dcp", lambda *args: None)
        again = api.transform(job["dcp"], general, None, None, **kw)
        assert not any(isinstance(f.tensors, BoxTensors) for f in again.plan.files)
    return boxed, general


def _data(folder: str) -> dict[str, str]:
    return {k: v for k, v in tree(folder).items() if not k.startswith("reshard-")}


@pytest.mark.parametrize("ranks", [1, 2, 5])
def test_the_box_plan_writes_the_general_path_s_bytes(job, tmp_path, monkeypatch, ranks: int) -> None:
    out = api.OutputSpec(format="dcp", dcp_ranks=ranks)
    boxed, general = _both(job, tmp_path, monkeypatch, output=out)
    assert _data(boxed) == _data(general)
    got = read_back(boxed)
    assert all(got[n].tobytes() == job["tensors"][n].tobytes() for n in job["tensors"])


def test_a_rename_goes_through_the_box_plan(job, tmp_path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("- {match: '(.*)', replace: 'net.\\1'}\n")
    dst = str(tmp_path / "out")
    proc = run_cli("transform", job["dcp"], dst, "--output-format", "dcp", "--dcp-ranks", "3", "--rename", str(rules))
    assert proc.returncode == 0, proc.stderr
    got = read_back(dst)
    assert sorted(got) == sorted(f"net.{n}" for n in job["tensors"])
    assert all(got[f"net.{n}"].tobytes() == a.tobytes() for n, a in job["tensors"].items())


def test_a_cast_takes_the_general_path(job, tmp_path) -> None:
    dst = str(tmp_path / "bf16")
    report = api.transform(
        job["dcp"],
        dst,
        None,
        None,
        output=api.OutputSpec(format="dcp", dcp_ranks=2),
        tensors=api.TensorOptions(dtype="bf16"),
    )
    assert not any(isinstance(f.tensors, BoxTensors) for f in report.plan.files)
    assert "BFloat16" in {t.dtype.ms_name for t in dcp.read_dcp_metadata(dst).tensors.values()}


def test_the_cli_resume_keeps_a_box_planned_output(job, tmp_path) -> None:
    dst = str(tmp_path / "out")
    args = ["transform", job["dcp"], dst, "--output-format", "dcp", "--dcp-ranks", "4"]
    assert run_cli(*args).returncode == 0
    again = run_cli(*args, "--resume")
    assert again.returncode == 0 and "nothing to do" in again.stdout + again.stderr, again.stderr


def test_reshard_plan_of_many_ranks_is_seconds(tmp_path) -> None:
    """250 parameters on 256 ranks (64 000 chunks) into 64: planned from the boxes, metadata not pickled."""
    folder = str(tmp_path / "big")
    os.makedirs(folder)
    make(folder, 250 * 256, 256, False)
    start = time.process_time()
    report = api.transform(
        folder,
        str(tmp_path / "p"),
        None,
        None,
        output=api.OutputSpec(format="dcp", dcp_ranks=64),
        destination=api.Destination(dry_run=True),
    )
    summary = report.plan.summary()
    assert time.process_time() - start < PLAN_SECONDS
    assert (summary["outputs"], summary["tensors"], summary["copies"], summary["sources"]) == (64, 16000, 64000, 256)
    assert report.plan.texts[0]._made is None  # type: ignore[attr-defined]  # not pickled by planning
    proc = run_cli("plan", folder, str(tmp_path / "p"), "--output-format", "dcp", "--dcp-ranks", "64")
    assert proc.returncode == 0, proc.stderr
    assert "64 files, 16000 tensors from 256 source files" in proc.stdout.replace("\n", " ")


def _as_torch_dist(job: dict[str, Any], folder: Path) -> str:
    """The job's DCP folder as a Megatron-core torch_dist save (its files, metadata.json, common.pt)."""
    import shutil

    from reshard.formats import megatron

    shutil.copytree(job["dcp"], folder)
    (folder / megatron.CONFIG_NAME).write_text(megatron.config_text())
    (folder / megatron.COMMON_NAME).write_bytes(b"common state bytes, carried as they are")
    return str(folder)


def test_torch_dist_in_and_out_goes_through_the_box_plan(job, tmp_path, monkeypatch) -> None:
    """A torch_dist source into a torch_dist run folder of other ranks: planned from the boxes, its
    ShardedObjects and common.pt carried, the same bytes as the general path."""
    from reshard.formats.dcp.data import read_bytes_item

    src = _as_torch_dist(job, tmp_path / "src")
    out = api.OutputSpec(format="torch_dist", dcp_ranks=3, iteration=7)
    boxed, general = str(tmp_path / "boxed"), str(tmp_path / "general")
    report = api.transform(src, boxed, None, None, output=out)
    assert all(isinstance(f.tensors, BoxTensors) for f in report.plan.files)
    names = [os.path.basename(t.path) for t in report.plan.texts]
    assert names == ["common.pt", "__0_1.distcp", ".metadata", "metadata.json", "latest_checkpointed_iteration.txt"]
    with monkeypatch.context() as patched:
        patched.setattr(chunked, "boxed_dcp", lambda *args: None)
        again = api.transform(src, general, None, None, output=out)
        assert not any(isinstance(f.tensors, BoxTensors) for f in again.plan.files)
    assert _data(boxed) == _data(general)
    save = os.path.join(boxed, "iter_0000007")
    assert read_bytes_item(dcp.read_dcp_metadata(save), "extra_state") == b"\x80\x04opaque"
    assert Path(save, "common.pt").read_bytes() == b"common state bytes, carried as they are"
    got = read_back(save)
    assert all(got[n].tobytes() == job["tensors"][n].tobytes() for n in job["tensors"])
