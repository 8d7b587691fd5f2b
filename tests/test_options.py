"""Options grouped by concern: read / write / run, each its own type and its own keyword."""

from __future__ import annotations

import dataclasses
import inspect
import os

import numpy as np
import pytest

from reshard import api
from reshard.execute import local
from reshard.execute.options import RunOptions, WriteOptions
from reshard.execute.ray import RayOptions
from reshard.formats.ckpt import probe_ckpt, read_ckpt, save_ckpt

OPERATIONS = ("transform", "transform_by_rank", "unify", "split", "convert", "recrypt", "execute")


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_the_catch_all_is_gone() -> None:
    assert not hasattr(local, "Options")
    assert "crc_check" not in _fields(WriteOptions) | _fields(RunOptions) | _fields(RayOptions)


def test_each_concern_holds_its_own_fields() -> None:
    assert _fields(WriteOptions) == {"write_crc", "enc_key", "enc_mode", "chunk_bytes", "checksum"}
    assert _fields(RunOptions) == {
        "workers",
        "max_memory",
        "progress",
        "on_start",
        "on_file_written",
        "hash_outputs",
        "before_commit",
    }
    assert issubclass(RayOptions, RunOptions)
    assert _fields(RayOptions) - _fields(RunOptions) == {
        "address",
        "shared_disk",
        "max_tasks",
        "placement",
        "in_flight",
        "on_nodes",
        "sources_from",
    }


def test_write_options_never_print_the_key() -> None:
    assert "kkkk" not in repr(WriteOptions(enc_key=b"k" * 16))


@pytest.mark.parametrize("name", OPERATIONS)
def test_api_takes_read_write_run_keyword_only(name: str) -> None:
    params = inspect.signature(getattr(api, name)).parameters
    for kind in ("write", "run") + (() if name == "split" else ("read",)):
        assert params[kind].kind is inspect.Parameter.KEYWORD_ONLY, (name, kind)
        assert params[kind].default is None
    assert "options" not in params


def test_api_uses_each_group(tmp_path) -> None:
    src = tmp_path / "src" / "m.ckpt"
    save_ckpt(src, {"w": np.arange(64, dtype=np.float32).reshape(8, 8), "b": np.ones(3, np.float16)})
    seen: list[int] = []
    report = api.transform(
        str(src),
        str(tmp_path / "out"),
        None,
        None,
        read=api.ReadOptions(),
        write=WriteOptions(write_crc=True, chunk_bytes=64),
        run=RunOptions(workers=1, progress=seen.append),
    )
    (out,) = [f.path for f in report.plan.files]
    assert probe_ckpt(out).crc_trailer
    with read_ckpt(out, verify_crc=True) as index:
        assert len(index.entries["w"].segments) == 4  # 256 bytes in 64-byte records
    assert sum(seen) == report.plan.bytes_written
    assert os.path.isfile(os.path.join(tmp_path, "out", "reshard-manifest.json"))


def test_execute_no_longer_takes_options_positionally(tmp_path) -> None:
    src = tmp_path / "m.ckpt"
    save_ckpt(src, {"w": np.zeros(4, np.float32)})
    plan = api.transform(str(src), str(tmp_path / "out"), None, None, destination=api.Destination(dry_run=True)).plan
    with pytest.raises(TypeError):
        api.execute(plan, None, RunOptions())  # type: ignore[misc]
