"""Checkpoint 2.0 output through every part of a run: the tracker last, interrupt + --resume, --overwrite,
--ranks, --dry-run / ``reshard plan``, the destination lock, the CLI flags and bad input."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from reshard import api, manifest
from reshard.errors import UsageError
from reshard.execute import local
from reshard.execute.options import RunOptions
from reshard.formats import base
from reshard.lock import DestinationLock
from tests.cp2_write_helpers import layouts, with_states, write_job
from tests.trust_helpers import run_cli, snapshot, tree

IT = "iteration_00000004"
TRACKER = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("cp2job"))
    out = write_job(root)
    out["strategy4"] = write_job(os.path.join(root, "four"), stages=[with_states(layouts((2, 2)))])["strategy"]
    return out


def _cp2(job: dict[str, str], dst: str, strategy: str = "strategy", **kw: Any) -> api.Report:
    where = api.Destination(**{k: kw.pop(k) for k in ("overwrite", "resume", "dry_run") if k in kw})
    output = api.OutputSpec(format="checkpoint2", iteration=4)
    return api.transform(job["full"], dst, None, job[strategy], output=output, destination=where, **kw)


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The order in which the executor writes tensor files and text files (base names)."""
    seen: list[str] = []
    real_file, real_text = local.run_file, base.write_whole

    def run_file(file: Any, *args: Any, **kwargs: Any) -> None:
        real_file(file, *args, **kwargs)
        seen.append(os.path.basename(file.path))

    def write_whole(path: Any, data: Any) -> None:
        real_text(path, data)
        seen.append(os.path.basename(os.fspath(path)))

    monkeypatch.setattr(local, "run_file", run_file)
    monkeypatch.setattr(base, "write_whole", write_whole)
    yield seen


def test_tracker_is_written_last(job: dict[str, str], tmp_path: Any, events: list[str]) -> None:
    dst = str(tmp_path / "out")
    _cp2(job, dst, run=RunOptions(workers=3))
    assert events[-3:] == ["metadata.json", "common.json", TRACKER]
    assert len(events) == 16 + 3
    # reshard's own record follows MindFormers' marker
    mtime = os.stat(os.path.join(dst, manifest.MANIFEST_NAME)).st_mtime_ns
    assert mtime >= os.stat(os.path.join(dst, TRACKER)).st_mtime_ns


@pytest.fixture
def interrupt_after(monkeypatch: pytest.MonkeyPatch) -> Callable[[int, BaseException], None]:
    real = local.run_file

    def arm(n: int, exc: BaseException) -> None:
        calls = {"n": 0}

        def run_file(*args: Any, **kwargs: Any) -> None:
            if calls["n"] == n:
                raise exc
            calls["n"] += 1
            real(*args, **kwargs)

        monkeypatch.setattr(local, "run_file", run_file)

    return arm


def test_interrupted_run_has_no_tracker_and_resume_completes_it(
    job: dict[str, str], tmp_path: Any, interrupt_after: Callable[[int, BaseException], None], monkeypatch: Any
) -> None:
    ref, dst = str(tmp_path / "ref"), str(tmp_path / "out")
    _cp2(job, ref)
    real = local.run_file
    interrupt_after(5, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        _cp2(job, dst, run=RunOptions(workers=1))
    assert not os.path.exists(os.path.join(dst, TRACKER))
    assert not os.path.exists(os.path.join(dst, IT, "metadata.json"))
    assert len(manifest.read_journal(dst)) == 5
    for argv in (["inspect", dst], ["transform", dst, str(tmp_path / "again")]):  # not a save missing its metadata
        proc = run_cli(*argv)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "metadata.json is not written yet: these are the files of an unfinished reshard run" in proc.stderr
        assert manifest.JOURNAL_NAME in proc.stderr and "again with --resume" in proc.stderr
    monkeypatch.setattr(local, "run_file", real)
    report = _cp2(job, dst, resume=True)
    assert any("kept 5 finished file" in n for n in report.notes)
    assert tree(dst) == tree(ref)


def test_failed_run_leaves_nothing(
    job: dict[str, str], tmp_path: Any, interrupt_after: Callable[[int, BaseException], None]
) -> None:
    dst = str(tmp_path / "out")
    interrupt_after(3, UsageError("disk on fire"))
    with pytest.raises(UsageError, match="disk on fire"):
        _cp2(job, dst, run=RunOptions(workers=1))
    assert not os.path.exists(dst) or os.listdir(dst) == []


def test_overwrite_with_another_world_removes_the_earlier_files_and_the_tracker_first(
    job: dict[str, str], tmp_path: Any, monkeypatch: Any
) -> None:
    dst = str(tmp_path / "out")
    _cp2(job, dst)
    assert os.path.isfile(os.path.join(dst, TRACKER))
    real = local.run_file
    tracker_seen: list[bool] = []

    def run_file(*args: Any, **kwargs: Any) -> None:
        tracker_seen.append(os.path.exists(os.path.join(dst, TRACKER)))
        real(*args, **kwargs)

    monkeypatch.setattr(local, "run_file", run_file)
    _cp2(job, dst, strategy="strategy4", overwrite=True)
    assert tracker_seen and not any(tracker_seen)  # never a tracker while files are replaced
    names = sorted(os.listdir(os.path.join(dst, IT)))
    assert [n for n in names if n.endswith(".safetensors")] == sorted(
        f"{k}-{r:07d}-0000004.safetensors" for k in ("model", "opt") for r in range(4)
    )
    with open(os.path.join(dst, TRACKER)) as fh:
        assert fh.read() == "4"


def test_overwrite_refuses_a_checkpoint_file_reshard_did_not_write(job: dict[str, str], tmp_path: Any) -> None:
    dst = str(tmp_path / "out")
    os.makedirs(os.path.join(dst, IT))
    foreign = os.path.join(dst, IT, "model-0000000-0000002.safetensors")
    with open(foreign, "wb") as fh:
        fh.write(b"not ours")
    before = snapshot(dst)
    with pytest.raises(UsageError, match="did not write this"):
        _cp2(job, dst, overwrite=True)
    assert snapshot(dst) == before


def test_ranks_split_over_two_runs_gives_the_same_files(job: dict[str, str], tmp_path: Any) -> None:
    ref, first, second = (str(tmp_path / n) for n in ("ref", "first", "second"))
    _cp2(job, ref)
    report = _cp2(job, first, ranks=[0, 1, 2, 3])
    _cp2(job, second, ranks=[4, 5, 6, 7])
    assert any(TRACKER in n and "every rank" in n for n in report.notes)
    ours = {**tree(first), **tree(second)}
    theirs = tree(ref)
    assert not os.path.exists(os.path.join(first, TRACKER)) and not os.path.exists(os.path.join(second, TRACKER))
    assert sorted(os.listdir(os.path.join(second, IT))) == sorted(
        f"{k}-{r:07d}-0000008.safetensors" for k in ("model", "opt") for r in range(4, 8)
    )
    for rel, digest in theirs.items():
        if rel.startswith("reshard-") or rel == TRACKER:
            continue
        assert ours[rel] == digest, rel  # metadata.json and common.json came with rank 0's run


def test_dry_run_and_plan_write_nothing(job: dict[str, str], tmp_path: Any) -> None:
    dst = str(tmp_path / "out")
    report = _cp2(job, dst, dry_run=True)
    assert not os.path.exists(dst)
    assert len(report.plan.files) == 16 and report.plan.bytes_written > 0
    summary = report.plan.summary()
    assert summary["outputs"] == 16
    assert sum(len(list(f.tensors)) for f in report.plan.files) == summary["tensors"]
    proc = run_cli(
        "plan",
        "--src",
        job["full"],
        "--dst",
        dst,
        "--dst-strategy",
        job["strategy"],
        "--output-format",
        "checkpoint2",
        "--dst-iteration",
        "4",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert printed["outputs"] == 16 and printed["texts"][-1].endswith(TRACKER)
    assert not os.path.exists(dst)


def test_plan_stats_equal_built_tensors(job: dict[str, str], tmp_path: Any) -> None:
    """The model / optimizer split answers its totals without building tensors; they must agree."""
    from reshard.plan import FileStats

    report = _cp2(job, str(tmp_path / "out"), dry_run=True)
    for f in report.plan.files:
        assert f.stats == FileStats.of(tuple(f.tensors)), f.path


def test_locked_destination_is_refused(job: dict[str, str], tmp_path: Any) -> None:
    dst = str(tmp_path / "out")
    os.makedirs(dst)
    lock = DestinationLock(os.path.abspath(dst))
    lock.acquire()
    try:
        with pytest.raises(UsageError, match="writing into this destination"):
            _cp2(job, dst)
    finally:
        lock.release()


def test_cli_writes_the_tree_with_its_flags(job: dict[str, str], tmp_path: Any) -> None:
    common = tmp_path / "common.json"
    common.write_text(json.dumps({"global_step": 4, "epoch_num": 1, "step_num": 4}))
    dst = str(tmp_path / "out")
    proc = run_cli(
        "transform",
        "--src",
        job["full"],
        "--dst",
        dst,
        "--dst-strategy",
        job["strategy"],
        "--output-format",
        "checkpoint2",
        "--dst-iteration",
        "4",
        "--common-json",
        str(common),
        "--prefix",
        "demo",
        "--optimizer-prefix",
        "decoder.layers.0.position",
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote 16 files" in proc.stdout
    names = os.listdir(os.path.join(dst, IT))
    assert "demo-model-0000000-0000008.safetensors" in names and "demo-opt-0000007-0000008.safetensors" in names
    with open(os.path.join(dst, IT, "common.json")) as fh:
        values = json.load(fh)
    assert values["global_step"] == 4 and values["step_num"] == 4 and values["loss_scale"] is None
    with open(os.path.join(dst, IT, "metadata.json")) as fh:
        meta = json.load(fh)
    assert meta["storage_data"]["('decoder.layers.0.position_ids', (0,))"][0]["file_name"].startswith("demo-opt-")


BAD = [
    (["--dst-iteration", "-1"], "iteration"),
    (["--dst-iteration", "x"], "iteration"),
    (["--hf"], "Hugging Face"),
    (["--crc"], "crc"),
    (["--enc-key-file", "{key}"], "encrypted"),
    (["--common-json", "{bad}"], "common"),
    (["--common-json", "{unknown}"], "c.json: holds key(s) wall_clock, which common.json does not have"),
    (["--common-json", "{string}"], "integer"),
    (["--prefix", "../x"], "prefix"),
]


@pytest.mark.parametrize(("flags", "said"), BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_input_is_one_line_exit_2_nothing_written(
    job: dict[str, str], tmp_path: Any, flags: list[str], said: str
) -> None:
    files = {
        "{bad}": "not json",
        "{unknown}": json.dumps({"global_step": 1, "wall_clock": 3}),
        "{string}": json.dumps({"global_step": "ten"}),
        "{key}": "00112233445566778899aabbccddeeff",
    }
    resolved = []
    for flag in flags:
        if flag in files:
            path = tmp_path / "c.json"
            path.write_text(files[flag])
            flag = str(path)
        resolved.append(flag)
    dst = str(tmp_path / "out")
    args = ["transform", "--src", job["full"], "--dst", dst, "--dst-strategy", job["strategy"]]
    proc = run_cli(*args, "--output-format", "checkpoint2", *resolved)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], proc.stderr
    assert not os.path.exists(dst)


@pytest.mark.parametrize("flags", [["--dst-iteration", "3"], ["--optimizer-prefix", "x."]])
def test_checkpoint2_flags_without_checkpoint2_output(job: dict[str, str], tmp_path: Any, flags: list[str]) -> None:
    dst = str(tmp_path / "out")
    proc = run_cli("transform", "--src", job["full"], "--dst", dst, "--dst-strategy", job["strategy"], *flags)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "checkpoint2" in proc.stderr
    assert not os.path.exists(dst)


def test_api_refuses_bad_iteration_and_common(job: dict[str, str], tmp_path: Any) -> None:
    dst = str(tmp_path / "out")
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(UsageError, match="iteration"):
            api.transform(
                job["full"], dst, None, job["strategy"], output=api.OutputSpec(format="checkpoint2", iteration=bad)
            )  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="loss_scale"):
        api.transform(
            job["full"],
            dst,
            None,
            job["strategy"],
            output=api.OutputSpec(format="checkpoint2", common={"loss_scale": "x"}),
        )
    assert not os.path.exists(dst)


def test_api_refuses_ckpt_only_write_options(job: dict[str, str], tmp_path: Any) -> None:
    from reshard.execute.options import WriteOptions

    dst = str(tmp_path / "out")
    for write, said in ((WriteOptions(write_crc=True), "crc"), (WriteOptions(enc_key=bytes(16)), "encrypted")):
        with pytest.raises(UsageError, match=said):
            _cp2(job, dst, write=write)
    assert not os.path.exists(dst)


def test_strings_are_refused_before_anything_is_written(tmp_path: Any) -> None:
    from reshard.errors import UnsupportedError
    from reshard.formats.ckpt import save_ckpt
    from tests.cp2_write_helpers import full_tensors

    src = str(tmp_path / "with_string.ckpt")
    save_ckpt(src, {**full_tensors(False), "note": "a string"})
    dst = str(tmp_path / "out")
    with pytest.raises(UnsupportedError, match="'note' is a str"):
        api.transform(src, dst, None, None, output=api.OutputSpec(format="checkpoint2"))
    assert not os.path.exists(dst)


def test_rank_0_run_needs_every_source_rank_for_metadata(job: dict[str, str], tmp_path: Any) -> None:
    import shutil

    ranks8 = str(tmp_path / "ranks8")
    api.transform(
        job["full"],
        ranks8,
        None,
        job["strategy"],
        output=api.OutputSpec(format="safetensors"),
        destination=api.Destination(manifest=False),
    )
    shutil.rmtree(os.path.join(ranks8, "rank_7"))
    kw: dict[str, Any] = {"output": api.OutputSpec(format="checkpoint2", iteration=4)}
    api.transform(ranks8, str(tmp_path / "one"), job["strategy"], job["strategy"], ranks=[1], **kw)
    assert sorted(os.listdir(tmp_path / "one" / IT)) == [
        "model-0000001-0000008.safetensors",
        "opt-0000001-0000008.safetensors",
    ]
    dst = str(tmp_path / "zero")
    with pytest.raises(UsageError, match=r"metadata\.json"):
        api.transform(ranks8, dst, job["strategy"], job["strategy"], ranks=[0], **kw)
    assert not os.path.exists(dst)


def test_default_iteration_is_said_with_how_to_choose_another(
    job: dict[str, str], tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A source without an iteration is written as iteration 0, and a note says so and names the option."""
    dst = str(tmp_path / "out")
    output = api.OutputSpec(format="checkpoint2")
    report = api.transform(job["full"], dst, None, job["strategy"], output=output)
    said = [n for n in report.notes if "iteration 0 (iteration_00000000)" in n]
    assert len(said) == 1 and "--dst-iteration N" in said[0] and "OutputSpec(iteration=N)" in said[0]
    assert os.path.isdir(os.path.join(dst, "iteration_00000000"))
    # given, or carried over from a Checkpoint 2.0 source: nothing to say
    assert not [n for n in _cp2(job, str(tmp_path / "four"), dry_run=True).notes if "--dst-iteration" in n]
    again = api.transform(dst, str(tmp_path / "again"), None, job["strategy"], output=output)
    assert not [n for n in again.notes if "--dst-iteration" in n]
    from reshard import cli

    args = ["transform", job["full"], str(tmp_path / "cli"), "--dst-strategy", job["strategy"]]
    assert cli.main([*args, "--output-format", "checkpoint2"]) == 0
    assert "note: the Checkpoint 2.0 is iteration 0 (iteration_00000000)" in capsys.readouterr().err
