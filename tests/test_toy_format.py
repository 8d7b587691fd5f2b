"""A new checkpoint format is three files: a format module, a source kind, one registry line (issue 20).

File 3 of 3: the registry lines are the two ``register`` calls of the ``npyraw`` fixture below;
``tests/toy_npyraw.py`` is the format and ``tests/toy_npyraw_kind.py`` the kind. With nothing else
changed, ``inspect``, ``verify`` and ``transform`` (in Python and through the command, in this
process) read npyraw models and write npyraw files, sharded or whole, and what they write holds the
same model as the ``.ckpt`` it was made from. An unknown format is refused, never written as
another.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from reshard import api, cli, inspection, verify
from reshard.errors import UsageError
from reshard.execute.local import byte_layout
from reshard.execute.options import WriteOptions
from reshard.formats import registry as formats
from reshard.formats.ckpt import read_ckpt
from reshard.plan import FilePlan
from reshard.sources import registry as kinds
from tests import toy_npyraw
from tests.toy_npyraw_kind import INDEX, NPYRAW_MODEL
from tests.trust_helpers import make_job


@pytest.fixture(scope="module")
def npyraw() -> Iterator[None]:
    formats.register(toy_npyraw.NPYRAW)
    kinds.register(NPYRAW_MODEL)
    yield
    kinds.unregister(NPYRAW_MODEL)
    formats.unregister(toy_npyraw.NAME)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, npyraw: None) -> dict[str, str]:
    """The synthetic job's full model as an npyraw model of two files (its tensors, no strings)."""
    root = str(tmp_path_factory.mktemp("toy"))
    job = make_job(root)
    with read_ckpt(job["full"]) as index:
        values = {name: index.array(name).copy() for name, e in index.entries.items() if not e.is_string}
    names = list(values)
    halves = {"a.npyraw": names[: len(names) // 2], "b.npyraw": names[len(names) // 2 :]}
    model = os.path.join(root, "toy")
    for file, held in halves.items():
        toy_npyraw.save(os.path.join(model, file), {n: values[n] for n in held})
    weight_map = {n: file for file, held in halves.items() for n in held}
    Path(model, INDEX).write_text(json.dumps({"weight_map": weight_map}))
    job["toy"] = model
    return job


def _files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root) for n in names)


def test_inspect_reads_the_new_kind(job: dict[str, str]) -> None:
    info = inspection.gather(job["toy"])
    assert info["source"] == "an npyraw model"
    assert info["format"] == "npyraw"
    assert {row["file"] for row in info["tensors"]} == {"a.npyraw", "b.npyraw"}


def test_transform_writes_the_new_format_whole_and_sharded(job: dict[str, str], tmp_path: Path) -> None:
    whole, sharded = str(tmp_path / "whole"), str(tmp_path / "sharded")
    api.transform(job["toy"], whole, None, None)  # the source's format: npyraw
    assert all(f.endswith(".npyraw") for f in _files(whole) if f != "reshard-manifest.json")
    assert verify.verify(job["toy"], whole).ok
    api.transform(job["toy"], sharded, None, job["s4"])
    assert "rank_3/checkpoint_3.npyraw" in _files(sharded)
    assert inspection.gather(sharded, job["s4"])["format"] == "npyraw"  # rank folders of the new format
    assert verify.verify(job["toy"], sharded, b_strategy=job["s4"]).ok
    back = str(tmp_path / "back")  # and back to the built-in format, from npyraw rank folders
    api.transform(sharded, back, job["s4"], None, output=api.OutputSpec(format="ckpt"))
    report = verify.verify(job["full"], back)
    assert not report.names(verify.DIFFER) and not report.names(verify.MISSING)  # its strings are only in the .ckpt


def test_the_command_runs_on_it_in_this_process(job: dict[str, str], tmp_path: Path) -> None:
    out = str(tmp_path / "cli")
    assert cli.main(["inspect", job["toy"]]) == 0
    assert cli.main(["transform", "--src", job["toy"], "--dst", out, "--dst-strategy", job["s8"]]) == 0
    assert cli.main(["verify", job["toy"], out, "--b-strategy", job["s8"]]) == 0


def test_an_unknown_format_is_refused_not_defaulted(npyraw: None) -> None:
    with pytest.raises(UsageError, match="unknown format 'npz'"):
        formats.get("npz")
    with pytest.raises(UsageError, match="unknown format 'npz'"):
        byte_layout(FilePlan("out/x.npz", "npz", ()), WriteOptions())
    with pytest.raises(UsageError, match=r"not a \.ckpt, \.safetensors or \.npyraw file"):  # the list is the registry's
        formats.detect("model.npz")
