"""The DCP source kind (``reshard.sources.dcp``): detection by names, planning facts from ``.metadata`` alone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from reshard import dtypes
from reshard.errors import FormatError
from reshard.formats import dcp
from reshard.sources.dcp import DCP, is_dcp_folder, open_dcp, saving_rank
from tests.test_dcp_format import sample


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    tensors, files, values = sample()
    files["__1_1.distcp"] = [files["__1_0.distcp"].pop()]  # rank 1 wrote two files
    dcp.save_dcp(tmp_path / "ckpt", tensors, files, values)
    return tmp_path / "ckpt"


def test_detects_by_names(saved: Path, tmp_path: Path) -> None:
    assert DCP.detect(str(saved))
    assert not DCP.detect(str(tmp_path))  # no .metadata
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / ".metadata").write_bytes(b"")
    assert not is_dcp_folder(str(tmp_path / "only"))  # no data file
    assert not is_dcp_folder(str(saved / ".metadata"))


def test_planning_facts_from_the_metadata(saved: Path) -> None:
    notes: list[str] = []
    opened = DCP.open(str(saved), None, notes)
    assert opened.fmt == "distcp" and opened.kind == DCP.name
    assert [os.path.basename(p) for p in opened.files] == ["__0_0.distcp", "__1_0.distcp", "__1_1.distcp"]
    assert sorted(set(opened.saved_by.values())) == [0, 1]
    a = opened.tensors["a"]
    assert a.shape == (7, 5) and a.dtype is dtypes.FLOAT32
    assert a.boxes == (((0, 4), (0, 5)), ((4, 7), (0, 5))) and a.tensors == ("a@0,0", "a@4,0")
    assert a.files[1].endswith("__1_0.distcp")
    assert opened.tensors["e"].files[0].endswith("__1_1.distcp")
    assert list(opened.values) == ["step"] and opened.values["step"].file.endswith("__0_0.distcp")
    assert notes == []
    # the per-chunk facts (open_dcp) stay: every chunk a tensor of its own
    rank1 = open_dcp(str(saved)).ranks[1]
    assert rank1.tensors["a@4,0"].shape == (3, 5) and rank1.path_of("e@0,0").endswith("__1_1.distcp")


def test_no_data_file_is_read(saved: Path) -> None:
    for data in saved.glob("*.distcp"):
        data.write_bytes(b"\0" * data.stat().st_size)  # same sizes, garbage contents
    assert len(open_dcp(str(saved)).metadata.tensors) == 6


def test_bad_metadata_is_one_line(saved: Path) -> None:
    (saved / ".metadata").write_bytes(b"cos\nsystem\n(S'true'\ntR.")
    with pytest.raises(FormatError, match=r"names os\.system"):
        DCP.open(str(saved), None, [])


def test_saving_rank() -> None:
    assert saving_rank("__12_3.distcp") == 12
    assert saving_rank("sub/__4_0.distcp") == 4
    assert saving_rank("model.distcp", default=7) == 7
