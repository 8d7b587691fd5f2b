"""reshard-written DCP checkpoints loaded by real torch (``torch.distributed.checkpoint.load``), bit for bit.

Every ``--output-format dcp`` output (rank folders' own slices; a ``--dtype bf16`` cast; a full model
cut into 3 row parts; ``split`` into a 4-rank strategy's boxes; ``convert --to dcp``; a model with
int64, 0-d and empty tensors; a ``--preset llama`` model map, against the same map's safetensors) is loaded
by torch 2.13 (its own venv, ``scripts/torch_env.sh``) alone, and into 3 gloo ranks' DTensors
sharded ``Shard(0)`` and ``Shard(1)`` (another world size and sharding than the one written), then
gathered: each tensor must equal the source's bytes.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from reshard import api, statenames
from reshard.formats.safetensors import read_safetensors, save_safetensors
from tests.test_dcp_write import full_tensors
from tests.torch_oracle import run_torch_script
from tests.trust_helpers import make_job, run_cli

DCP = api.OutputSpec(format="dcp")


def _int64_model(path: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    tensors = {
        "ids": rng.integers(-(2**62), 2**62, size=(7, 5), dtype=np.int64),
        "weight": rng.standard_normal((5, 3)).astype(np.float32),
        "step": np.array(12345678901, dtype=np.int64),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }
    save_safetensors(str(path), tensors)
    return tensors


def _bf16(model: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``--dtype bf16`` of the model: the weights rounded to bf16, training state as it is (bits as uint16)."""
    return {
        n: v.astype(ml_dtypes.bfloat16).view(np.uint16)
        if v.dtype == np.float32 and not statenames.DEFAULT.is_state(n)
        else v
        for n, v in model.items()
    }


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, np.ndarray]]]:
    """The DCP folders reshard wrote, each with the tensors it must hold."""
    root = tmp_path_factory.mktemp("dcpwrite-oracle")
    job = make_job(str(root / "job"))
    model = full_tensors(job["full"])
    api.transform(job["r8"], str(root / "slices"), job["s8"], None, output=DCP)
    api.transform(job["r8"], str(root / "bf16"), job["s8"], None, output=DCP, tensors=api.TensorOptions(dtype="bf16"))
    api.transform(job["full"], str(root / "rows3"), None, None, output=api.OutputSpec(format="dcp", dcp_ranks=3))
    api.split(job["full"], job["s4"], str(root / "split4"), output=DCP)
    api.convert(job["full"], str(root / "convert"), "dcp")
    ints = _int64_model(root / "ints.safetensors")
    api.transform(
        str(root / "ints.safetensors"), str(root / "int64"), None, None, output=api.OutputSpec("dcp", dcp_ranks=2)
    )
    mapped = ["--src-strategy", job["s8"], "--preset", "llama", "--weights-only"]  # model maps: views, transposes
    for dst, fmt in (("preset", "dcp"), ("preset_st", "safetensors")):
        proc = run_cli("transform", job["r8"], str(root / dst), *mapped, "--output-format", fmt)
        assert proc.returncode == 0, proc.stderr
    out = {name: (root / name, model) for name in ("slices", "rows3", "split4", "convert")}
    out["preset"] = (root / "preset", _safetensors(root / "preset_st" / "rank_0" / "checkpoint_0.safetensors"))
    out["bf16"] = (root / "bf16", _bf16(model))
    out["int64"] = (root / "int64", ints)
    return out


def _safetensors(path: Path) -> dict[str, np.ndarray]:
    index = read_safetensors(str(path))
    return {n: np.array(index.array(n)) for n in index.entries}


def _check(loaded: Path, want: dict[str, np.ndarray], what: str) -> None:
    got = np.load(loaded)
    assert sorted(got.files) == sorted(want), what
    for name, value in want.items():
        assert got[name].shape == value.shape, (what, name)
        assert got[name].tobytes() == np.ascontiguousarray(value).tobytes(), (what, name)


def test_torch_loads_every_output_alone(written: dict[str, tuple[Path, dict[str, np.ndarray]]]) -> None:
    loads = [{"folder": str(folder), "out": str(folder) + "-whole"} for folder, _ in written.values()]
    run_torch_script("dcp_write_load.py", {"loads": loads})
    for name, (folder, want) in written.items():
        _check(Path(str(folder) + "-whole.npz"), want, f"{name} alone")


def test_torch_loads_every_output_into_three_ranks(written: dict[str, tuple[Path, dict[str, np.ndarray]]]) -> None:
    loads = [
        {"folder": str(folder), "out": f"{folder}-dim{dim}", "dim": dim}
        for folder, _ in written.values()
        for dim in (0, 1)
    ]
    run_torch_script("dcp_write_load.py", {"loads": loads}, nproc=3)
    for name, (folder, want) in written.items():
        for dim in (0, 1):
            _check(Path(f"{folder}-dim{dim}.npz"), want, f"{name} into 3 ranks, Shard({dim})")
