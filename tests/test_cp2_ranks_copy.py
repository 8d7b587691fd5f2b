"""A node without a shared disk and a Checkpoint 2.0: copying the files ``rank-list N --files`` names
(tensor files, ``metadata.json``, ``common.json``, the tracker) is enough for ``transform --ranks N``,
in every output format, and gives the bytes a run on the whole tree gives; a file a chosen rank reads
that is not there is one line naming it and the rank; without ``--ranks`` every file is needed."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from reshard.formats.safetensors import read_safetensors
from reshard.formats.strategy import make_strategy, write_strategy
from reshard.layout import ParamLayout
from tests import checkpoint2_fixtures as fx
from tests.trust_helpers import run_cli, snapshot

ITER = "iteration_00000010"
TEXTS = {"metadata.json", "common.json", "latest_checkpointed_iteration.txt"}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """``mf2`` (8 ranks, dp2 x tp4) and ``s2.ckpt`` (rows cut in 2) in one folder, the CLI's working folder."""
    here = tmp_path_factory.mktemp("site")
    full = fx.write_checkpoint2(str(here / "mf2"), fx.dp2_tp4_params(), 8)
    layouts = {n: ParamLayout((2,), (0,) + (-1,) * (a.ndim - 1)) for n, a in full.items() if a.shape[0] % 2 == 0}
    write_strategy(str(here / "s2.ckpt"), make_strategy(layouts))
    return here, full


def _cli(here: Path, *args: str) -> tuple[int, str, str]:
    proc = run_cli(*args, cwd=str(here))
    return proc.returncode, proc.stdout, proc.stderr


def _copy_listed(here: Path, rank: int, node: str) -> list[str]:
    """What ``rank-list RANK --files`` prints, copied under ``here/node`` in the same relative layout."""
    code, out, err = _cli(here, "rank-list", str(rank), "--src", "mf2", "--dst-strategy", "s2.ckpt", "--files")
    assert code == 0, err
    listed = out.split()
    for path in listed:
        os.makedirs(here / node / os.path.dirname(path), exist_ok=True)
        shutil.copy(here / path, here / node / path)
    return listed


def _outputs(root: Path) -> list[Path]:
    """The files a run wrote, relative to its destination (its manifest aside: it names the sources)."""
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file() and p.name != "reshard-manifest.json")


def _one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if not line.startswith("reshard: note:")]
    assert len(lines) == 1 and lines[0].startswith("reshard: error:") and "Traceback" not in err, err
    return lines[0]


def test_rank_list_files_names_the_texts_a_transform_reads(site: tuple[Path, dict]) -> None:
    here, _ = site
    listed = _copy_listed(here, 0, "node_list")
    names = {os.path.basename(p) for p in listed}
    assert names >= TEXTS and "mf2/latest_checkpointed_iteration.txt" in listed
    assert 0 < len(names - TEXTS) < 16  # only some of the 16 tensor files


@pytest.mark.parametrize("fmt", ["checkpoint2", "safetensors", "ckpt"])
def test_the_listed_files_are_enough_for_ranks(site: tuple[Path, dict], fmt: str) -> None:
    here, _ = site
    node = f"node_{fmt}"
    _copy_listed(here, 0, node)
    before = snapshot(str(here / node / "mf2"))
    args = ["--dst-strategy", "s2.ckpt", "--ranks", "0", "--output-format", fmt]
    code, _, err = _cli(here, "transform", f"{node}/mf2", f"{node}/out", *args)
    assert code == 0, err
    code, _, err = _cli(here, "transform", "mf2", f"whole_{fmt}", *args)
    assert code == 0, err
    ours, theirs = _outputs(here / node / "out"), _outputs(here / f"whole_{fmt}")
    assert ours == theirs and ours
    for rel in ours:
        assert filecmp.cmp(here / node / "out" / rel, here / f"whole_{fmt}" / rel, shallow=False), rel
    assert snapshot(str(here / node / "mf2")) == before  # the copy untouched


def test_a_file_a_chosen_rank_reads_missing_is_one_line(site: tuple[Path, dict]) -> None:
    here, _ = site
    _copy_listed(here, 0, "node_r1")
    args = ["transform", "node_r1/mf2", "node_r1/out", "--dst-strategy", "s2.ckpt", "--output-format", "checkpoint2"]
    code, _, err = _cli(here, *args, "--ranks", "1")
    assert code == 2
    line = _one_error(err)
    assert "named in metadata.json storage_data, is missing, and destination rank 1 reads" in line, line
    assert not (here / "node_r1" / "out").exists()
    code, _, err = _cli(here, *args)  # without --ranks every file is read
    assert code == 2 and "named in metadata.json storage_data, is missing (and" in _one_error(err)
    assert not (here / "node_r1" / "out").exists()


def test_rank_list_reads_the_layouts_of_a_copy(site: tuple[Path, dict]) -> None:
    here, _ = site
    _copy_listed(here, 0, "node_rl")
    code, on_copy, err = _cli(here, "rank-list", "0", "--src", "node_rl/mf2", "--dst-strategy", "s2.ckpt")
    assert code == 0, err
    assert on_copy == _cli(here, "rank-list", "0", "--src", "mf2", "--dst-strategy", "s2.ckpt")[1]


def test_a_replica_in_a_file_that_is_here_stands_for_one_that_is_not(tmp_path: Path) -> None:
    """Every tensor held by both data-parallel halves: the files of ranks 4-7 alone give rank 0 of a
    full model, read from the copies those hold (MindFormers' choice, among the files present)."""
    params = [p for p in fx.dp2_tp4_params() if "linear_fc1" not in p.name]  # fc1 is cut over dp too
    full = fx.write_checkpoint2(str(tmp_path / "mf2"), params, 8)
    folder = tmp_path / "mf2" / ITER
    for name in os.listdir(folder):
        parsed = name.split("-")
        if name.endswith(".safetensors") and int(parsed[1]) < 4:
            os.remove(folder / name)
    code, _, err = _cli(tmp_path, "transform", "mf2", "out", "--ranks", "0", "--output-format", "safetensors")
    assert code == 0, err
    index = read_safetensors(str(tmp_path / "out" / "rank_0" / "checkpoint_0.safetensors"))
    assert sorted(index.entries) == sorted(full)
    for name, a in full.items():
        assert np.array_equal(index.array(name), a), name


def test_tensors_metadata_does_not_list_make_a_copy_unknowable(tmp_path: Path) -> None:
    """A rank file's state metadata.json does not list (taken up as MindFormers does) could be in a
    missing file too: a copy for some ranks is then refused in one line, nothing written."""
    fx.write_checkpoint2(str(tmp_path / "mf2"), fx.dp2_tp4_params(), 8)
    folder = tmp_path / "mf2" / ITER
    meta = json.loads((folder / "metadata.json").read_text())
    del meta["state_dict_metadata"]["adam_v.decoder.layers.0.mlp.linear_fc1.weight"]
    meta["storage_data"] = {k: v for k, v in meta["storage_data"].items() if "adam_v." not in k}
    os.chmod(folder / "metadata.json", 0o644)
    (folder / "metadata.json").write_text(json.dumps(meta))
    os.remove(folder / "opt-0000007-0000008.safetensors")
    code, _, err = _cli(tmp_path, "transform", "mf2", "out", "--ranks", "0", "--output-format", "safetensors")
    assert code == 2
    assert "are not listed in metadata.json (e.g. 'adam_v." in _one_error(err)
    assert "opt-0000007-0000008.safetensors) cannot be known: copy them too" in err
    assert not (tmp_path / "out").exists()
