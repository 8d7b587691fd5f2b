"""A DCP checkpoint torch saved with ``HuggingFaceStorageWriter(save_distributed=True)`` (safetensors
shards, the chunk offsets in each header, no ``.metadata``) reads as any DCP folder: ``transform`` to a
full safetensors file equals torch's own ``consolidate_safetensors_files`` of it and torch's tensors,
and to a DCP of other ranks; a shard without its sharding metadata is one line, exit 2."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from reshard.sources import DCP, identify
from tests.torch_oracle import run_torch_script
from tests.trust_helpers import run_cli


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcphf")
    args = {"tensors": 5, "rows": 7, "cols": 6, "hf": str(root / "hf"), "torch_save": str(root / "ts")}
    run_torch_script(
        "dcp_hf_save.py", {**args, "consolidated": str(root / "torch_full"), "npz": str(root / "w.npz")}, nproc=2
    )
    return root


def _arrays(path: Path) -> dict[str, np.ndarray]:
    from reshard.sources import open_checkpoint

    with open_checkpoint(str(path)) as index:
        return {name: np.array(index.array(name)) for name in index.entries}


def test_it_is_a_dcp_folder_and_transforms_like_torch_consolidates(saved: Path, tmp_path: Path) -> None:
    assert not (saved / "hf" / ".metadata").exists()
    assert identify(str(saved / "hf")) is DCP
    out = tmp_path / "full"
    proc = run_cli("transform", str(saved / "hf"), str(out), "--output-format", "safetensors")
    assert proc.returncode == 0, proc.stderr
    (ours,) = out.rglob("*.safetensors")
    (theirs,) = (saved / "torch_full").glob("*.safetensors")
    got, want = _arrays(ours), _arrays(theirs)
    assert sorted(got) == sorted(want)
    with np.load(saved / "w.npz") as whole:
        for name in want:
            assert got[name].tobytes() == want[name].tobytes() == whole[name].tobytes(), name
    same = run_cli("verify", str(saved / "hf"), str(saved / "ts"))
    assert same.returncode == 0, same.stdout + same.stderr


def test_to_a_dcp_of_three_ranks(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "d3"
    proc = run_cli("transform", str(saved / "hf"), str(out), "--output-format", "dcp", "--dcp-ranks", "3")
    assert proc.returncode == 0, proc.stderr
    assert run_cli("verify", str(out), str(saved / "ts")).returncode == 0


def test_a_shard_without_its_sharding_metadata_is_one_line(saved: Path, tmp_path: Path) -> None:
    folder = tmp_path / "bad"
    shutil.copytree(saved / "hf", folder)
    shard = sorted(folder.iterdir())[0]
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header["__metadata__"].pop("DCP_SHARDING_INFO")
    text = json.dumps(header).encode().ljust(n)
    shard.write_bytes(raw[:8] + text + raw[8 + n :])
    proc = run_cli("transform", str(folder), str(tmp_path / "o"), "--output-format", "safetensors")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "DCP_SHARDING_INFO" in proc.stderr and not os.path.exists(tmp_path / "o")
