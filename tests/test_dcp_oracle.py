"""DCP checkpoints made by real torch, read by reshard; reshard's DCP outputs loaded back by torch.

torch 2.13 (its own venv, ``scripts/torch_env.sh``) saves DCP checkpoints on two gloo ranks
(``tests/oracle_scripts/dcp_save.py``: DTensor ``Shard(0)`` uneven, ``Shard(1)``, ``Replicate``, an
empty shard, a 0-d tensor, fp32/bf16/fp16/int64/fp8, FSDP2 ``fully_shard`` with its Adam state,
non-tensor values; both serializations; and megatron-core's ``dist_checkpointing.save``, whose
``torch_dist`` data is DCP). Every tensor reshard assembles from the chunks it indexes
must equal, bit for bit, what ``torch.distributed.checkpoint.load`` gives and what the ranks saved.
Then reshard re-chunks each checkpoint (other boxes, three files, values carried byte for byte, and
once with ZIP64 records forced) and torch loads the result alone and into three ranks' DTensors.
The checkpoints are made once per session (about a minute of torch in all).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from reshard.formats import dcp
from reshard.formats.dcp import ChunkSpec, DcpMetadata
from tests.test_dcp_bulk import both_ways
from tests.torch_oracle import run_torch_script

FIXTURES = ("dtensor", "dtensor_st", "fsdp2")
BITS = {"BFloat16": np.int16, "Float8E4M3FN": np.uint8}  # how the scripts keep bf16 / fp8 in .npz


@pytest.fixture(scope="session")
def torch_made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoints torch saved on two ranks, with the full tensors and values beside each."""
    root = tmp_path_factory.mktemp("torch-dcp")
    run_torch_script("dcp_save.py", {"root": str(root)}, nproc=2)
    return root


def assembled(meta: DcpMetadata) -> dict[str, np.ndarray]:
    """Every tensor whole, from the chunks reshard indexes (bits as the oracle scripts keep them)."""
    out = {fqn: np.zeros(t.shape, dtype=BITS.get(t.dtype.ms_name, t.dtype.carrier)) for fqn, t in meta.tensors.items()}
    for rel in meta.files:
        with dcp.index_distcp(meta, rel) as index:
            for tensor in meta.tensors.values():
                for chunk in tensor.chunks:
                    if chunk.file == rel:
                        box = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
                        out[tensor.fqn][box] = index.items(chunk.name).view(out[tensor.fqn].dtype)
    return out


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for fqn in want:
        assert got[fqn].shape == want[fqn].shape, fqn
        assert got[fqn].dtype == want[fqn].dtype, fqn
        assert got[fqn].tobytes() == want[fqn].tobytes(), fqn


def npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="session")
def torch_loaded(torch_made: Path) -> Path:
    """torch's own dcp.load of each torch_save checkpoint (its FileSystemReader cannot load safetensors ones)."""
    loads = [
        {"folder": str(torch_made / name), "out": str(torch_made / f"{name}.loaded")} for name in ("dtensor", "fsdp2")
    ]
    run_torch_script("dcp_load.py", {"loads": loads})
    return torch_made


@pytest.mark.parametrize("name", FIXTURES)
def test_reads_what_torch_saved(torch_loaded: Path, name: str) -> None:
    meta = dcp.read_dcp_metadata(torch_loaded / name)
    tensors = assembled(meta)
    assert_same(tensors, npz(torch_loaded / f"{name}.npz"))
    if name != "dtensor_st":
        assert_same(tensors, npz(torch_loaded / f"{name}.loaded.npz"))
    serialization = dcp.SAFETENSORS if name == "dtensor_st" else dcp.TORCH_SAVE
    assert {dcp.serialization_of(meta, rel) for rel in meta.files} == {serialization}


def test_reads_the_dcp_data_of_a_megatron_save(torch_made: Path) -> None:
    meta = dcp.read_dcp_metadata(torch_made / "megatron")
    assert_same(assembled(meta), npz(torch_made / "megatron.npz"))
    assert [c.sizes for c in meta.tensors["decoder.layers.mlp.linear_fc1.weight"].chunks] == [(1, 4, 6), (1, 4, 6)]
    assert len(meta.tensors["decoder.final_layernorm.weight"].chunks) == 1  # replicas saved once
    assert (torch_made / "megatron" / "metadata.json").is_file() and (torch_made / "megatron" / "common.pt").is_file()


def test_reads_every_kind_torch_saved(torch_made: Path) -> None:
    meta = dcp.read_dcp_metadata(torch_made / "dtensor")
    assert {t.dtype.ms_name for t in meta.tensors.values()} == {
        "Float32",
        "BFloat16",
        "Float16",
        "Int64",
        "Float8E4M3FN",
    }
    assert [c.sizes for c in meta.tensors["rows"].chunks] == [(4, 5), (3, 5)]  # uneven Shard(0)
    assert [c.offsets for c in meta.tensors["cols_bf16"].chunks] == [(0, 0), (0, 3)]  # Shard(1)
    assert [c.sizes for c in meta.tensors["one_row"].chunks] == [(1, 3), (0, 3)]  # an empty shard
    assert meta.tensors["scalar"].shape == ()
    assert sorted(meta.byte_items) == ["extra.lr", "extra.names", "step"]
    assert meta.planner_data["extra.lr"] == ("extra", "lr")


def rechunked(meta: DcpMetadata, files: int = 3) -> dict[str, list[ChunkSpec | str]]:
    """Other boxes than torch's: a 2x2 grid for matrices, thirds for vectors, spread over ``files`` files."""
    out: dict[str, list[ChunkSpec | str]] = {f"__{r}_0.distcp": [] for r in range(files)}
    names = list(out)
    k = 0
    for tensor in meta.tensors.values():
        for offsets, sizes in boxes(tensor.shape):
            out[names[k % files]].append(ChunkSpec(tensor.fqn, tensor.dtype, tensor.shape, offsets, sizes))
            k += 1
    out[names[-1]].extend(meta.byte_items)
    return out


def boxes(shape: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A 2x2 grid over the first two axes of a matrix (later axes whole), thirds of a vector, a 0-d whole."""
    if not shape:
        yield (), ()
        return
    if len(shape) == 1:
        axes = [split(shape[0], 3)]
    else:
        axes = [split(shape[0], 2), split(shape[1], 2), *([(0, d)] for d in shape[2:])]
    for spans in itertools.product(*axes):
        yield tuple(o for o, _ in spans), tuple(n for _, n in spans)


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """``n`` cut into at most ``parts`` (offset, size) pieces, torch.chunk-like (one empty piece for n = 0)."""
    if n == 0:
        return [(0, 0)]
    step = math.ceil(n / parts)
    return [(o, min(step, n - o)) for o in range(0, n, step)]


def write_rechunked(source: Path, target: Path) -> DcpMetadata:
    """``source`` re-chunked by reshard (``rechunked``), its values and planner data carried."""
    meta = dcp.read_dcp_metadata(source)
    values = {fqn: dcp.read_bytes_item(meta, fqn) for fqn in meta.byte_items}
    return dcp.save_dcp(target, assembled(meta), rechunked(meta), values, meta.planner_data)


@pytest.fixture(scope="session")
def reshard_made(torch_made: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each torch checkpoint re-chunked by reshard; ``dtensor_zip64`` with ZIP64 records everywhere."""
    root = tmp_path_factory.mktemp("reshard-dcp")
    for name in FIXTURES:
        write_rechunked(torch_made / name, root / name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dcp.write, "_ZIP64_AT", 0)
        write_rechunked(torch_made / "dtensor", root / "dtensor_zip64")
    return root


def test_rechunked_reads_back(torch_made: Path, reshard_made: Path) -> None:
    for name in FIXTURES:
        meta = dcp.read_dcp_metadata(reshard_made / name)
        assert_same(assembled(meta), npz(torch_made / f"{name}.npz"))
        assert len(meta.files) == 3
    grid = dcp.read_dcp_metadata(reshard_made / "dtensor").tensors["rows"].chunks
    assert sorted((c.offsets, c.sizes) for c in grid) == [
        ((0, 0), (4, 3)),
        ((0, 3), (4, 2)),
        ((4, 0), (3, 3)),
        ((4, 3), (3, 2)),
    ]


def test_torch_loads_what_reshard_wrote(torch_loaded: Path, reshard_made: Path) -> None:
    names = [*FIXTURES, "dtensor_zip64"]
    loads = [{"folder": str(reshard_made / n), "out": str(reshard_made / f"{n}.whole")} for n in names]
    run_torch_script("dcp_load.py", {"loads": loads})
    sharded = [
        {"folder": str(reshard_made / n), "out": str(reshard_made / f"{n}.ranks3")} for n in ("dtensor", "fsdp2")
    ]
    run_torch_script("dcp_load.py", {"loads": sharded}, nproc=3)
    for name in names:
        source = "dtensor" if name == "dtensor_zip64" else name
        assert_same(npz(reshard_made / f"{name}.whole.npz"), npz(torch_loaded / f"{source}.npz"))
        # values carried byte for byte load as torch saved them (both dtensor checkpoints hold the same)
        torch_values = torch_loaded / f"{'fsdp2' if name == 'fsdp2' else 'dtensor'}.loaded.json"
        assert json.loads((reshard_made / f"{name}.whole.json").read_text()) == json.loads(torch_values.read_text())
    for name in ("dtensor", "fsdp2"):
        assert_same(npz(reshard_made / f"{name}.ranks3.npz"), npz(torch_loaded / f"{name}.npz"))


# ------------------------------------------------------------------------------------ the commands on torch's folders


def test_the_dcp_output_of_the_command_carries_values_torch_loads(torch_loaded: Path, tmp_path: Path) -> None:
    """``reshard transform SRC OUT --output-format dcp --dcp-ranks 3`` of what torch saved: its non-tensor
    values (an int step, a float, a list of names) carried byte for byte, loaded by torch as torch saved them,
    whole and into three ranks' DTensors."""
    from tests.trust_helpers import run_cli

    out = tmp_path / "dcp3"
    proc = run_cli("transform", str(torch_loaded / "dtensor"), str(out), "--output-format", "dcp", "--dcp-ranks", "3")
    assert proc.returncode == 0 and "not carried" not in proc.stderr, proc.stderr
    meta = dcp.read_dcp_metadata(out)
    source = dcp.read_dcp_metadata(torch_loaded / "dtensor")
    assert sorted(meta.byte_items) == sorted(source.byte_items)
    for fqn in source.byte_items:
        assert dcp.read_bytes_item(meta, fqn) == dcp.read_bytes_item(source, fqn), fqn
    run_torch_script("dcp_load.py", {"loads": [{"folder": str(out), "out": str(tmp_path / "whole")}]})
    run_torch_script("dcp_load.py", {"loads": [{"folder": str(out), "out": str(tmp_path / "ranks3")}]}, nproc=3)
    want = npz(torch_loaded / "dtensor.npz")
    assert_same(npz(tmp_path / "whole.npz"), want)
    assert_same(npz(tmp_path / "ranks3.npz"), want)
    loaded = json.loads((tmp_path / "whole.json").read_text())
    assert loaded == json.loads((torch_loaded / "dtensor.loaded.json").read_text())


def _outputs(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors files below ``folder`` (reshard's own reader)."""
    from reshard.sources import open_checkpoint

    out: dict[str, np.ndarray] = {}
    for path in sorted(folder.rglob("*.safetensors")):
        with open_checkpoint(str(path)) as index:
            out.update({name: np.array(index.array(name)) for name in index.entries})
    return out


def assert_same_bits(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """Tensor by tensor, byte for byte (the oracle keeps bf16 / fp8 as integers of their size)."""
    assert sorted(got) == sorted(want)
    for fqn in want:
        assert got[fqn].shape == want[fqn].shape, fqn
        assert got[fqn].dtype.itemsize == want[fqn].dtype.itemsize, fqn
        assert got[fqn].tobytes() == want[fqn].tobytes(), fqn


@pytest.mark.parametrize("name", FIXTURES)
def test_transform_and_unify_a_torch_made_folder(torch_made: Path, tmp_path: Path, name: str) -> None:
    """``reshard transform SRC OUT --output-format safetensors`` and ``reshard unify SRC OUT`` of what torch
    saved (DTensor Shard/Replicate, uneven and empty shards, FSDP2 with Adam state, both serializations)
    equal torch's own full state dict, tensor by tensor; its non-tensor values are said, not carried."""
    from tests.trust_helpers import run_cli

    want = npz(torch_made / f"{name}.npz")
    for command, extra in (("transform", ["--output-format", "safetensors"]), ("unify", [])):
        out = tmp_path / command
        proc = run_cli(command, str(torch_made / name), str(out), *extra)
        assert proc.returncode == 0, proc.stderr
        assert_same_bits(_outputs(out), want)
        if dcp.read_dcp_metadata(torch_made / name).byte_items:
            assert "non-tensor values not carried" in proc.stderr
    proc = run_cli("verify", str(torch_made / name), str(tmp_path / "unify"))
    assert proc.returncode == 0 and "SAME" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", [*FIXTURES, "megatron"])
def test_the_bulk_reader_reads_torch_saves_as_the_unpickler(
    torch_made: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast, slow, used = both_ways(torch_made / name, monkeypatch)
    assert fast == slow
    # megatron-core's .metadata also names chunk records again (in its cached plans): left to the unpickler
    assert used == (name != "megatron")


@pytest.fixture(scope="session")
def torch_pickled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 300-rank save's .metadata pickled by torch in every protocol (3 900 chunks)."""
    root = tmp_path_factory.mktemp("torch-pickled")
    spec = {"folder": str(root / "fsdp"), "params": 13, "ranks": 300, "rows": 1, "protocols": [2, 3, 4, 5]}
    run_torch_script("dcp_metadata_made.py", spec)
    return root


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_the_bulk_reader_reads_torch_pickles_of_every_protocol(
    torch_pickled: Path, protocol: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast, slow, used = both_ways(torch_pickled / f"fsdp-p{protocol}", monkeypatch)
    assert used and fast == slow
    assert len(fast[0]) == 13 and all(len(t[5][0]) == 300 for t in fast[0])
