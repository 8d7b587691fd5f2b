"""Planning reads small records through ``pread``, and unmaps what it read through a map at once.

A touch of a page the page cache holds in a large folio maps all of the folio into the process (the
start-up read-ahead and the kernel's own read-ahead cache sources so). Indexing a DCP data file through
its map, and checking every block scale through the maps without unmapping them, raised a dequantize of
a 2-file DCP from 74 to 189 MiB peak RSS. These tests hold the two paths to reads that leave nothing
mapped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from reshard import api
from reshard.execute import dequant
from reshard.formats.dcp import data
from reshard.ops.options import TensorOptions
from reshard.plan.quantized import Precision
from tests.lowprec_fixtures import fp8_model
from tests.page_helpers import CountingMap


@pytest.fixture(scope="module")
def fp8_dcp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mapped")
    fp8 = fp8_model(root / "fp8")
    out = root / "dcp2"
    api.transform(str(fp8), str(out), output=api.OutputSpec(format="dcp", dcp_ranks=2))
    return out


def test_a_dcp_data_file_is_indexed_without_touching_its_map(fp8_dcp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    maps: list[CountingMap] = []
    real = data.map_file

    def map_file(path: Any) -> Any:
        buf, closer, size = real(path)
        maps.append(CountingMap(buf))
        return maps[-1], closer, size

    monkeypatch.setattr(data, "map_file", map_file)
    files = sorted(p for p in fp8_dcp.iterdir() if p.suffix == ".distcp")
    assert files
    for path in files:
        index = data.open_distcp(path)
        try:
            assert index.entries
        finally:
            index.close()
    assert maps and all(m.reads == 0 for m in maps)


def test_every_block_scale_checked_is_unmapped_at_once(
    fp8_dcp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    released: list[str] = []
    real = dequant._release
    monkeypatch.setattr(dequant, "_release", lambda index, name: (released.append(name), real(index, name)))
    checked: list[int] = []
    real_check = dequant.check_scales

    def check(plan: Any, opener: Any) -> None:
        checked.append(sum(1 for q in plan.quantized if q.kind not in (dequant.QUANTIZE, dequant.QUANTIZE_SCALE)))
        real_check(plan, opener)

    monkeypatch.setattr(dequant, "check_scales", check)
    for src in (fp8_dcp.parent / "fp8", fp8_dcp):  # stored whole, and chunked in 2 DCP data files
        released.clear()
        checked.clear()
        api.transform(
            str(src),
            str(tmp_path / src.name),
            output=api.OutputSpec(format="hf"),
            tensors=TensorOptions(precision=Precision(dequantize="bf16", block_size=(128, 128))),
        )
        scales = [name for name in released if "scale" in name]
        assert checked and len(scales) >= checked[0]  # each scale (or its chunks) unmapped once checked
