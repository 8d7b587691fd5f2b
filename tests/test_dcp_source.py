"""The DCP source kind (``reshard.sources.dcp``): detection by names, planning facts from ``.metadata`` alone."""

from __future__ import annotations

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
    assert opened.fmt == dcp.FORMAT and opened.kind == DCP.name
    assert sorted(opened.files) == ["__0_0.distcp", "__1_0.distcp", "__1_1.distcp"]
    assert sorted(opened.ranks) == [0, 1]
    rank1 = opened.ranks[1]
    assert rank1.tensors["a@4,0"].shape == (3, 5) and rank1.tensors["a@4,0"].dtype is dtypes.FLOAT32
    assert rank1.path_of("e@0,0").endswith("__1_1.distcp") and rank1.path_of("a@4,0").endswith("__1_0.distcp")
    assert opened.weight_map["b@0,2"] == "__1_0.distcp"
    assert opened.files["__0_0.distcp"].tensors["b@0,0"].nbytes == 4 * 2 * 2
    assert notes == ["1 non-tensor values (opaque torch.save bytes) are not tensors"]


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
