"""Interrupted and failed runs: kill -9 at many moments then --resume gives byte-identical output;
the journal only keeps files it can verify; errors roll back; --overwrite replaces only its files."""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from reshard import api, lock, manifest
from reshard.errors import ReshardError, UsageError
from reshard.execute import local
from reshard.execute.digest import file_digest
from reshard.execute.options import RunOptions, WriteOptions
from reshard.formats.ckpt import read_ckpt
from tests.trust_helpers import make_big_job, make_job, run_cli, snapshot, temp_files, tree

KILL_POLL_SECONDS = 0.002
KILL_DELAY_SECONDS = 0.004  # the most a kill waits after its files are there (random)


# ------------------------------------------------------------------------------------ kill -9


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An 8-rank job of ~57 MB, a 16-rank target strategy, and the uninterrupted result."""
    job = make_big_job(str(tmp_path_factory.mktemp("big")), workers=1)
    assert len([p for p in job["reference"] if p.endswith(".ckpt")]) == 16
    return job


def _outputs(dst: str) -> int:
    return sum(1 for f, _, names in os.walk(dst) for n in names if n.endswith(".ckpt"))


def _journal_lines(dst: str) -> int:
    try:
        with open(os.path.join(dst, manifest.JOURNAL_NAME), "rb") as fh:
            return fh.read().count(b"\n")
    except OSError:
        return 0


def _kill_when(args: list[str], ready: Callable[[float], bool]) -> bool:
    """Start the CLI, SIGKILL it as soon as ``ready(elapsed)``; True if it was still running."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "reshard.cli", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    start = time.monotonic()
    try:
        while proc.poll() is None and not ready(time.monotonic() - start):
            time.sleep(KILL_POLL_SECONDS)
        alive = proc.poll() is None
        if alive:
            os.kill(proc.pid, signal.SIGKILL)
        return alive
    finally:
        proc.wait(timeout=60)


def _assert_no_false_complete(dst: str, reference: dict[str, str]) -> None:
    """Whatever a killed run left: every file that is not reshard's bookkeeping is a complete output."""
    for rel, digest in tree(dst).items():
        name = os.path.basename(rel)
        if name.endswith(".reshard-tmp") or name in (manifest.JOURNAL_NAME, lock.LOCK_NAME):
            continue
        assert reference.get(rel) == digest, f"{rel} looks complete but is not the finished output"


def _resume_and_compare(big: dict[str, Any], dst: str) -> None:
    proc = run_cli(*big["args"], "--dst", dst, "--resume")
    assert proc.returncode == 0, proc.stderr
    assert tree(dst) == big["reference"]  # outputs and manifest, byte for byte; no journal, no temp files
    assert not temp_files(dst)


MOMENTS: dict[str, Callable[[str], Callable[[float], bool]]] = {
    "first file": lambda dst: lambda _t: _outputs(dst) >= 1,
    "after 5 files": lambda dst: lambda _t: _outputs(dst) >= 5,
    "after 11 files": lambda dst: lambda _t: _outputs(dst) >= 11,
    "3 journal lines": lambda dst: lambda _t: _journal_lines(dst) >= 3,
    "all files, before manifest": lambda dst: lambda _t: _outputs(dst) >= 16,
    "while planning": lambda dst: lambda t: t > 0.15,
}


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_kill_9_then_resume_is_byte_identical(big: dict[str, Any], tmp_path, moment: str) -> None:
    dst = str(tmp_path / "out")
    before = snapshot(big["r8"])
    _kill_when([*big["args"], "--dst", dst], MOMENTS[moment](dst))
    _assert_no_false_complete(dst, big["reference"]) if os.path.isdir(dst) else None
    if os.path.isdir(dst) and os.listdir(dst):  # an interrupted destination is refused without --resume
        proc = run_cli(*big["args"], "--dst", dst)
        if not os.path.exists(os.path.join(dst, manifest.MANIFEST_NAME)):
            assert proc.returncode == 2 and "--resume" in proc.stderr, proc.stderr
    _resume_and_compare(big, dst)
    assert snapshot(big["r8"]) == before


def _new_outputs(dst: str, since_ns: int) -> int:
    count = 0
    for folder, _, names in os.walk(dst):
        for name in names:
            with contextlib.suppress(OSError):
                count += name.endswith(".ckpt") and os.stat(os.path.join(folder, name)).st_mtime_ns >= since_ns
    return count


def test_repeated_kills_at_random_moments_then_resume(big: dict[str, Any], tmp_path) -> None:
    """Kill the first run and several resumed runs, each after a few new files and a random delay.

    The delay stays within a few milliseconds: this job's 16 outputs are written in ~30 ms once the
    sources are read in large requests, so a longer one let a run finish before its kill (2 of 5
    kills landed in one CI run, with delays of up to 30 ms)."""
    dst = str(tmp_path / "out")
    rng = random.Random(5)
    interrupted = 0
    for attempt in range(5):
        wanted, extra = rng.randint(1, 4), rng.uniform(0.0, KILL_DELAY_SECONDS)
        since = time.time_ns()
        flags = ["--resume"] if attempt else []
        seen: dict[str, float] = {}

        def ready(
            t: float, wanted: int = wanted, extra: float = extra, since: int = since, seen: dict[str, float] = seen
        ) -> bool:
            if "at" not in seen and _new_outputs(dst, since) >= wanted:
                seen["at"] = t
            return "at" in seen and t >= seen["at"] + extra

        interrupted += _kill_when([*big["args"], "--dst", dst, *flags], ready)
        if os.path.isdir(dst):
            _assert_no_false_complete(dst, big["reference"])
    assert interrupted >= 3  # the kills really hit running processes
    _resume_and_compare(big, dst)


# ------------------------------------------------------------------------------------ API level


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_job(str(tmp_path_factory.mktemp("job")))


def _transform(job: dict[str, str], dst: str, **kw: Any) -> api.Report:
    where = api.Destination(**{k: kw.pop(k) for k in ("overwrite", "resume", "manifest") if k in kw})
    return api.transform(job["r8"], dst, job["s8"], job["s4"], destination=where, **kw)


class _Stop(Exception):
    pass


@pytest.fixture
def interrupt_after(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """``arm(n, exc)``: the executor raises ``exc`` instead of writing output number ``n`` (0-based);
    ``arm(None)`` restores it."""
    real = local.run_file

    def arm(n: int | None, exc: BaseException | None = None) -> None:
        calls = {"n": 0}

        def run_file(*args: Any, **kwargs: Any) -> None:
            if calls["n"] == n and exc is not None:
                raise exc
            calls["n"] += 1
            real(*args, **kwargs)

        monkeypatch.setattr(local, "run_file", real if n is None else run_file)

    yield arm


def test_manifest_lists_every_output_and_is_last(job: dict[str, str], tmp_path) -> None:
    dst = str(tmp_path / "out")
    report = _transform(job, dst)
    data = manifest.read_manifest(dst)
    assert data["operation"] == "transform" and data["complete"] is True
    outputs = {o["path"]: o for o in data["outputs"]}
    assert set(outputs) == {os.path.relpath(f.path, dst) for f in report.plan.files}
    for rel, entry in outputs.items():
        assert (entry["bytes"], entry["xxh128"]) == file_digest(os.path.join(dst, rel))
        assert entry["bytes"] == os.path.getsize(os.path.join(dst, rel))
    assert {s["path"] for s in data["sources"]} == set(report.plan.sources)
    assert not os.path.exists(os.path.join(dst, manifest.JOURNAL_NAME))
    newest_output = max(os.stat(os.path.join(dst, rel)).st_mtime_ns for rel in outputs)
    assert os.stat(os.path.join(dst, manifest.MANIFEST_NAME)).st_mtime_ns >= newest_output


def test_unify_manifest_includes_the_index(job: dict[str, str], tmp_path) -> None:
    dst = str(tmp_path / "unified")
    api.unify(job["r8st"], job["s8"], dst)
    paths = {o["path"] for o in manifest.read_manifest(dst)["outputs"]}
    assert "param_name_map.json" in paths and "part0.safetensors" in paths


def test_no_manifest_option(job: dict[str, str], tmp_path) -> None:
    dst = str(tmp_path / "out")
    _transform(job, dst, manifest=False)
    assert sorted(os.listdir(dst)) == [f"rank_{r}" for r in range(4)]
    with pytest.raises(UsageError, match="resume needs the journal"):
        _transform(job, str(tmp_path / "other"), manifest=False, resume=True)


def test_interrupt_keeps_finished_files_and_resume_verifies_them(job, tmp_path, interrupt_after) -> None:
    ref, dst = str(tmp_path / "ref"), str(tmp_path / "out")
    _transform(job, ref)
    interrupt_after(2, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):  # one worker: outputs 0 and 1 are done when 2 is interrupted
        _transform(job, dst, run=RunOptions(workers=1))  # (with more, running outputs give up at once)
    journal = manifest.read_journal(dst)
    assert sorted(journal) == ["rank_0/checkpoint_0.ckpt", "rank_1/checkpoint_1.ckpt"]
    assert not os.path.exists(os.path.join(dst, manifest.MANIFEST_NAME))
    with pytest.raises(UsageError, match="unfinished run"):
        _transform(job, dst)
    # damage one kept file without changing its size: resume must notice and redo it
    path = os.path.join(dst, "rank_1", "checkpoint_1.ckpt")
    data = bytearray(Path(path).read_bytes())
    data[-1] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    # a torn journal line and stale temp files of the killed run
    with open(os.path.join(dst, manifest.JOURNAL_NAME), "a") as fh:
        fh.write('{"path": "rank_2/checkpoint_2.ckpt", "bytes": 12')
    stale = os.path.join(dst, "rank_2", ".checkpoint_2.ckpt.x1y2z3.reshard-tmp")
    os.makedirs(os.path.dirname(stale), exist_ok=True)
    Path(stale).write_bytes(b"partial")
    keep = os.path.join(dst, "rank_2", "user-notes.txt")
    Path(keep).write_text("mine")
    interrupt_after(None)
    report = _transform(job, dst, resume=True)
    assert any("kept 1 finished file" in n for n in report.notes), report.notes
    os.unlink(keep)
    assert tree(dst) == tree(ref)


def test_resume_with_other_write_options_redoes_files(job, tmp_path, interrupt_after) -> None:
    ref, dst = str(tmp_path / "ref"), str(tmp_path / "out")
    _transform(job, ref, write=WriteOptions(write_crc=True))
    interrupt_after(3, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        _transform(job, dst)  # without crc trailers
    interrupt_after(None)
    report = _transform(job, dst, resume=True, write=WriteOptions(write_crc=True))
    assert not any("kept" in n for n in report.notes)
    assert tree(dst) == tree(ref)
    read_ckpt(os.path.join(dst, "rank_0", "checkpoint_0.ckpt"), verify_crc=True).close()


def test_resume_after_sources_changed_redoes_files(tmp_path, interrupt_after) -> None:
    job = make_job(str(tmp_path / "job"))
    dst = str(tmp_path / "out")
    interrupt_after(2, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        _transform(job, dst)
    for rank in range(8):  # sources that changed since (their mtime) invalidate the fingerprints
        os.utime(os.path.join(job["r8"], f"rank_{rank}", f"checkpoint_{rank}.ckpt"), ns=(1, 1))
    interrupt_after(None)
    report = _transform(job, dst, resume=True)
    assert not any("kept" in n for n in report.notes)


def test_error_rolls_back_what_the_run_created(job, tmp_path, interrupt_after) -> None:
    dst = str(tmp_path / "out")
    interrupt_after(2, OSError(errno.EIO, "Input/output error"))
    with pytest.raises(ReshardError, match="Input/output error"):
        _transform(job, dst)
    assert not os.path.exists(dst)
    # an existing destination keeps its own files and gets nothing new
    os.makedirs(os.path.join(dst, "rank_0"))
    Path(dst, "rank_0", "old.txt").write_text("old")
    before = snapshot(dst)
    interrupt_after(1, OSError(errno.EIO, "Input/output error"))
    with pytest.raises(ReshardError):
        _transform(job, dst, overwrite=True)
    assert snapshot(dst) == before


def test_full_disk_keeps_finished_files_for_resume(job, tmp_path, interrupt_after) -> None:
    """Space running out part way (another writer) keeps the journaled files; --resume goes on."""
    dst = str(tmp_path / "out")
    interrupt_after(2, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(ReshardError, match=r"2 of 4 files are finished and kept.*--resume"):
        _transform(job, dst, run=RunOptions(workers=1))  # one at a time: outputs 0 and 1 finish first
    assert len(manifest.read_journal(dst)) == 2 and not glob.glob(os.path.join(dst, "*", "*.reshard-tmp"))
    interrupt_after(None)
    assert len(_transform(job, dst, resume=True).kept) == 2
    assert manifest.read_manifest(dst)["complete"]


def test_full_disk_before_any_file_finished_rolls_back(job, tmp_path, interrupt_after) -> None:
    dst = str(tmp_path / "out")
    interrupt_after(0, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(ReshardError, match="No space left"):
        _transform(job, dst)
    assert not os.path.exists(dst)  # nothing finished: nothing to resume, nothing left behind


def test_overwrite_replaces_only_the_files_it_writes(job: dict[str, str], tmp_path) -> None:
    dst = str(tmp_path / "out")
    _transform(job, dst)
    with pytest.raises(UsageError, match="not empty"):
        _transform(job, dst)
    extra = os.path.join(dst, "rank_0", "keep.me")
    Path(extra).write_text("x")
    stale_output = os.path.join(dst, "rank_1", "checkpoint_1.ckpt")
    Path(stale_output).write_bytes(b"old")
    _transform(job, dst, overwrite=True)
    assert Path(extra).read_text() == "x"
    assert os.path.getsize(stale_output) > 3
    outputs = {o["path"] for o in manifest.read_manifest(dst)["outputs"]}
    assert "rank_0/keep.me" not in outputs


def test_overwrite_removes_the_old_manifest_first(job, tmp_path, interrupt_after) -> None:
    dst = str(tmp_path / "out")
    _transform(job, dst)
    interrupt_after(1, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        _transform(job, dst, overwrite=True)
    assert not os.path.exists(os.path.join(dst, manifest.MANIFEST_NAME))  # no stale completion marker


def test_convert_in_place_refuses_existing_outputs(job: dict[str, str], tmp_path) -> None:
    src = str(tmp_path / "one.ckpt")
    Path(src).write_bytes(Path(job["full"]).read_bytes())
    api.convert(src, None, "safetensors")
    assert os.path.exists(str(tmp_path / "one.safetensors"))
    data = json.loads((tmp_path / manifest.MANIFEST_NAME).read_text())
    assert [o["path"] for o in data["outputs"]] == ["one.safetensors"]
    with pytest.raises(UsageError, match="output exists"):
        api.convert(src, None, "safetensors")
    api.convert(src, None, "safetensors", destination=api.Destination(overwrite=True))


def test_cli_resume_flag_and_refusal(job: dict[str, str], tmp_path) -> None:
    dst = str(tmp_path / "out")
    args = ["transform", "--src", job["r8"], "--dst", dst, "--src-strategy", job["s8"], "--dst-strategy", job["s4"]]
    assert run_cli(*args).returncode == 0
    proc = run_cli(*args)
    assert proc.returncode == 2 and "--overwrite" in proc.stderr
    proc = run_cli(*args, "--resume")  # everything verified and kept
    assert proc.returncode == 0, proc.stderr
    assert "kept 4 finished file(s)" in proc.stderr
