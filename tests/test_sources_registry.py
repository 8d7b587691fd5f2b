"""The source registry (``reshard.sources.registry``): every kind of path is detected right on real
files, the "what is this path?" errors (missing, empty, ambiguous, unknown, a kind the operation
does not read) come from the registry alone and name the path and what was looked for, and every
operation (inspect, verify, transform, unify, split, convert) asks it."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from reshard import api, inspection, sources, verify
from reshard.errors import UsageError
from reshard.formats.ckpt import save_ckpt
from reshard.sources import registry
from reshard.sources.kind import FULL, SHARDED, OpenedModel, OpenedRanks, Traits
from reshard.sources.options import ReadOptions
from reshard.synthetic import full_model
from tests.trust_helpers import SMALL, make_job

KEY = b"0123456789abcdef"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("sources"))
    job = make_job(root)
    api.unify(job["r8st"], job["s8"], f"{root}/unified", destination=api.Destination(manifest=False))
    api.unify(
        job["r8st"],
        job["s8"],
        f"{root}/hf",
        output=api.OutputSpec(format="hf", max_shard_size="2KB"),
        destination=api.Destination(manifest=False),
    )
    save_ckpt(f"{root}/encrypted/model.ckpt", full_model(SMALL), enc_key=KEY)
    job.update(unified=f"{root}/unified", hf=f"{root}/hf", encrypted=f"{root}/encrypted/model.ckpt")
    return job


KIND_CASES = [  # (job key, relative path below it, the kind)
    ("full", "", sources.FULL_FILE),
    ("full", "..", sources.FULL_FILE),  # a folder holding one checkpoint file
    ("r8", "", sources.RANK_FOLDERS),
    ("r8st", "", sources.RANK_FOLDERS),
    ("r8", "rank_3", sources.ONE_RANK_FOLDER),
    ("unified", "", sources.UNIFIED),
    ("unified", "param_name_map.json", sources.UNIFIED),
    ("hf", "", sources.HUGGING_FACE),
    ("hf", "model.safetensors.index.json", sources.HUGGING_FACE),
    ("s8", "", sources.STRATEGY),
    ("s8dir", "", sources.STRATEGY),
    ("encrypted", "", sources.ENCRYPTED_CKPT),
    ("encrypted", "..", sources.ENCRYPTED_CKPT),
]


@pytest.mark.parametrize(("key", "below", "kind"), KIND_CASES, ids=[f"{k}/{b}" for k, b, _ in KIND_CASES])
def test_every_kind_detected(job: dict[str, str], key: str, below: str, kind: sources.Kind) -> None:
    path = os.path.normpath(os.path.join(job[key], below))
    assert sources.identify(path) is kind
    assert sources.kind_of(path) is kind


def test_open_returns_planning_facts(job: dict[str, str]) -> None:
    ranks = sources.open_source(job["r8"])
    assert ranks.fmt == "ckpt" and sorted(ranks.ranks) == list(range(8))
    full = sources.open_source(job["full"])
    assert list(full.ranks) == [0] and full.weight_map and set(full.weight_map.values()) == {"model.ckpt"}
    hf = sources.open_source(job["hf"])
    assert len(hf.files) > 1 and hf.hyper is not None and set(hf.weight_map.values()) <= set(hf.files)
    unified = sources.open_source(job["unified"])
    assert unified.files and unified.weight_map
    strategy = sources.open_source(job["s8dir"])
    assert strategy.strategy is not None and strategy.strategy.layouts
    encrypted = sources.open_source(job["encrypted"], options=ReadOptions(dec_key=KEY))
    assert encrypted.ranks[0].tensors == full.ranks[0].tensors


def _raised_in_registry(exc: BaseException) -> bool:
    frames = traceback.extract_tb(exc.__traceback__)
    return frames[-1].filename == registry.__file__


def _error(call: Callable[[], Any]) -> UsageError:
    with pytest.raises(UsageError) as info:
        call()
    assert _raised_in_registry(info.value), "".join(traceback.format_exception(info.value))
    return info.value


def test_missing_and_empty(tmp_path: Path) -> None:
    missing = str(tmp_path / "nothing")
    err = _error(lambda: sources.identify(missing))
    assert str(err) == f"{missing}: no such file or folder"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".hidden").write_text("")
    err = _error(lambda: sources.identify(str(tmp_path / "empty"), (sources.RANK_FOLDERS,)))
    assert "the folder holds only .hidden (looked for a folder of rank_<r> folders" in str(err)
    assert str(tmp_path / "empty") in str(err)


def test_unknown_names_what_was_looked_for(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hello")
    err = _error(lambda: sources.identify(str(tmp_path / "notes")))
    assert "holds no checkpoint or strategy files (looked for" in str(err)
    for kind in sources.KINDS:
        assert kind.looks_for in str(err)
    err = _error(lambda: sources.identify(str(tmp_path / "notes" / "readme.txt")))
    assert str(err).startswith(f"{tmp_path / 'notes' / 'readme.txt'}: not a file reshard reads (looked for")


def test_ambiguous_folder(job: dict[str, str], tmp_path: Path) -> None:
    folder = tmp_path / "two"
    folder.mkdir()
    for name in ("a.ckpt", "b.ckpt"):
        os.link(job["full"], folder / name)
    err = _error(lambda: sources.identify(str(folder)))
    assert "holds 2 checkpoint files and no rank_<r> folders" in str(err) and "give one of them" in str(err)


def test_known_kind_not_read_by_the_operation(job: dict[str, str]) -> None:
    err = _error(lambda: sources.identify(job["unified"], (sources.RANK_FOLDERS,)))
    assert str(err) == f"{job['unified']}: this is a unified model, not rank folders"
    err = _error(lambda: sources.identify(job["r8"], sources.FULL_MODELS))
    assert "this folder holds rank_<r> folders, not a unified model" in str(err) and "unify them first" in str(err)
    rank = os.path.join(job["r8"], "rank_3")
    err = _error(lambda: sources.identify(rank, sources.CHECKPOINTS))
    assert f"this is one rank's folder; give the folder holding the rank_<r> folders ({job['r8']})" in str(err)


def _operations(job: dict[str, str], out: str) -> dict[str, Callable[[str], Any]]:
    """Each operation called on one path (dry runs: nothing is written)."""
    return {
        "inspect": lambda p: inspection.gather(p),
        "verify": lambda p: verify.verify(p, job["full"]),
        "transform": lambda p: api.transform(p, out, None, job["s4"], destination=api.Destination(dry_run=True)),
        "unify": lambda p: api.unify(p, job["s8"], out, destination=api.Destination(dry_run=True)),
        "split": lambda p: api.split(p, job["s4"], out, destination=api.Destination(dry_run=True)),
        "convert": lambda p: api.convert(p, out, "safetensors", destination=api.Destination(dry_run=True)),
    }


@pytest.mark.parametrize("operation", ["inspect", "verify", "transform", "unify", "split", "convert"])
def test_what_is_this_errors_of_every_operation_come_from_the_registry(
    job: dict[str, str], tmp_path: Path, operation: str
) -> None:
    call = _operations(job, str(tmp_path / "out"))[operation]
    missing = str(tmp_path / "missing")
    assert str(_error(lambda: call(missing))) == f"{missing}: no such file or folder"
    (tmp_path / "empty").mkdir()
    assert "the folder is empty" in str(_error(lambda: call(str(tmp_path / "empty"))))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hello")
    assert "(looked for" in str(_error(lambda: call(str(tmp_path / "notes"))))


WRONG_KIND = {  # operation -> a path of a kind it does not read
    "verify": "s8",
    "transform": "s8",
    "unify": "full",
    "split": "r8st",
    "convert": "s8",
}


@pytest.mark.parametrize("operation", sorted(WRONG_KIND))
def test_wrong_kind_refused_by_the_registry(job: dict[str, str], tmp_path: Path, operation: str) -> None:
    call = _operations(job, str(tmp_path / "out"))[operation]
    path = job[WRONG_KIND[operation]]
    err = _error(lambda: call(path))
    assert str(err).startswith(f"{path}: this ")


@pytest.fixture
def detections(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str]]]:
    """Every ``detect(path)`` asked of the registry's kinds, as (kind name, path)."""
    calls: list[tuple[str, str]] = []
    for kind in registry.KINDS:

        def recording(path: str, kind: sources.Kind = kind, detect: Callable[[str], bool] = kind.detect) -> bool:
            calls.append((kind.name, path))
            return detect(path)

        monkeypatch.setattr(kind, "detect", recording)
    yield calls


SOURCE_OF = {
    "inspect": "r8",
    "verify": "unified",
    "transform": "full",
    "unify": "r8st",
    "split": "hf",
    "convert": "full",
}


@pytest.mark.parametrize("operation", sorted(SOURCE_OF))
def test_every_operation_asks_the_registry(
    job: dict[str, str], tmp_path: Path, operation: str, detections: list[tuple[str, str]]
) -> None:
    path = job[SOURCE_OF[operation]]
    _operations(job, str(tmp_path / "out"))[operation](path)
    assert any(p == path for _, p in detections), detections


def test_a_new_kind_is_one_module_and_one_registry_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Checkpoint2:
        name = "a Checkpoint 2.0 folder"
        looks_for = "a Checkpoint 2.0 folder (checkpoint2.json)"
        traits = Traits(FULL)  # a full model: read where a full model is, so refused where rank folders are wanted

        def detect(self, path: str) -> bool:
            return os.path.isfile(os.path.join(path, "checkpoint2.json"))

        def open(self, path: str, options: ReadOptions | None, notes: list[str]) -> OpenedModel:
            return OpenedModel(self.name, path, "safetensors", {}, {})

    new = Checkpoint2()
    monkeypatch.setattr(registry, "KINDS", (new, *registry.KINDS))
    (tmp_path / "c2").mkdir()
    (tmp_path / "c2" / "checkpoint2.json").write_text("{}")
    assert sources.identify(str(tmp_path / "c2"), (new,)) is new
    assert sources.open_source(str(tmp_path / "c2"), (new,)).kind == new.name
    err = _error(lambda: sources.identify(str(tmp_path / "c2"), (sources.RANK_FOLDERS,)))
    assert "this is a Checkpoint 2.0 folder, not rank folders" in str(err)


def test_readme_names_stay_importable_from_api() -> None:
    for name in (
        "ReadOptions",
        "open_checkpoint",
        "unified_index",
        "source_file",
        "rank_sources",
        "hf_model",
        "is_hf_model",
        "model_folder",
    ):
        assert getattr(api, name) is getattr(sources, name)
        assert name in api.__all__
    assert "verify_crc" in {f.name for f in __import__("dataclasses").fields(api.ReadOptions)}


def test_resolve_words_every_refusal_from_the_traits(job: dict[str, str], tmp_path: Path) -> None:
    def refusal(**given: Any) -> str:
        return str(_error(lambda: sources.resolve(given.pop("path"), **given)))

    assert refusal(path=job["unified"], strategy=job["s8"]).endswith(
        "a unified model is a full model: give no source strategy"
    )
    assert sources.resolve(job["unified"], strategy=job["s8"], full_takes_strategy=True) is sources.UNIFIED
    said = refusal(path=job["s8"], strategy=job["s8"], flag="--strategy", subject="the source")
    assert said.endswith("the source is a strategy already: give no --strategy")
    with pytest.raises(UsageError) as info:  # worded by sources.checkpoint2.check_iteration, from the traits
        sources.resolve(job["r8"], read=ReadOptions(iteration=3))
    assert str(info.value).endswith(
        "an iteration (3) applies to a MindFormers Checkpoint 2.0 or a Megatron-LM run folder only; "
        "this is rank folders"
    )
    assert sources.resolve(job["r8"], strategy=job["s8"]) is sources.RANK_FOLDERS

    class ToyJob:  # a registered sharded kind that carries its layouts (as a DCP checkpoint will)
        name = "a toy job"
        looks_for = "a toy job (job.json)"
        traits = Traits(SHARDED, owns_layouts="job.json")

        def detect(self, path: str) -> bool:
            return os.path.isfile(os.path.join(path, "job.json"))

        def open(self, path: str, options: ReadOptions | None, notes: list[str]) -> OpenedRanks:
            return OpenedRanks(self.name, path, "safetensors", {})

    toy = ToyJob()
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "job.json").write_text("{}")
    registry.register(toy)
    try:
        path = str(tmp_path / "job")
        assert sources.identify(path, (sources.RANK_FOLDERS,)) is toy  # read wherever rank folders are
        assert "this is a toy job, not a unified model" in str(
            _error(lambda: sources.identify(path, (sources.UNIFIED,)))
        )
        assert refusal(path=path, strategy=job["s8"]).endswith(
            "a toy job carries its layouts in job.json: give no source strategy"
        )
    finally:
        registry.unregister(toy)
    assert sources.kind_of(path) is not toy  # unregistered: a folder of JSON is a strategy folder again


def test_a_folder_of_hidden_files_says_what_it_holds(tmp_path: Path) -> None:
    folder = tmp_path / "dcp"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"\x80\x02.")  # a DCP folder's .metadata without its data files
    err = _error(lambda: sources.identify(str(folder)))
    assert "the folder holds only .metadata (looked for" in str(err)
