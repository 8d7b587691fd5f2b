"""``RunOptions(on_file_written=...)``: the caller's hook is called once per output, after reshard's
own bookkeeping of that output, and what it raises stops the run as an interruption does (finished
files journaled, no temporary file, ``resume`` completes it byte for byte)."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from reshard import api, manifest
from reshard.execute.digest import file_digest
from reshard.execute.options import RunOptions
from reshard.plan import FilePlan
from tests.trust_helpers import make_job, temp_files, tree


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_job(str(tmp_path_factory.mktemp("job")))


@pytest.fixture(scope="module")
def reference(job: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    dst = str(tmp_path_factory.mktemp("ref") / "out")
    _transform(job, dst)
    return tree(dst)


def _transform(job: dict[str, str], dst: str, run: RunOptions | None = None, **where: Any) -> api.Report:
    return api.transform(job["r8"], dst, job["s8"], job["s4"], run=run, destination=api.Destination(**where))


class _Recorder:
    """A hook that checks each call against the journal and remembers the outputs in call order."""

    def __init__(self, dst: str) -> None:
        self.dst = dst
        self.paths: list[str] = []
        self.busy = threading.Lock()

    def __call__(self, file: FilePlan, digest: str | None) -> None:
        assert self.busy.acquire(blocking=False), "the hook was called while another call ran"
        try:
            rel = os.path.relpath(file.path, self.dst)
            assert os.path.isfile(file.path)  # renamed into place
            assert digest == file_digest(file.path)[1]  # the checksum the executor computed while writing
            journal = manifest.read_journal(self.dst)  # reshard journaled the file before calling the hook
            assert rel in journal and len(journal) == len(self.paths) + 1
            self.paths.append(rel)
        finally:
            self.busy.release()


@pytest.mark.parametrize("workers", [1, 4])
def test_hook_called_once_per_output_in_completion_order(job, reference, tmp_path, workers: int) -> None:
    dst = str(tmp_path / "out")
    hook = _Recorder(dst)
    report = _transform(job, dst, RunOptions(workers=workers, on_file_written=hook))
    expected = [os.path.relpath(f.path, dst) for f in report.plan.files]
    assert sorted(hook.paths) == sorted(expected) and len(hook.paths) == 4
    if workers == 1:
        assert hook.paths == expected  # one at a time: the plan's order
    assert tree(dst) == reference


def test_hook_without_manifest_still_called(job, tmp_path) -> None:
    dst = str(tmp_path / "out")
    seen: list[tuple[str, str | None]] = []
    run = RunOptions(workers=1, hash_outputs=True, on_file_written=lambda f, d: seen.append((f.path, d)))
    _transform(job, dst, run, manifest=False)
    assert len(seen) == 4 and all(d == file_digest(p)[1] for p, d in seen)  # hash_outputs kept as asked


@pytest.mark.parametrize("stop", [KeyboardInterrupt, ValueError])
@pytest.mark.parametrize("workers", [1, 2])
def test_hook_raising_after_first_file_leaves_a_resumable_run(
    job, reference, tmp_path, stop: type[BaseException], workers: int
) -> None:
    dst = str(tmp_path / "out")
    calls: list[str] = []

    def hook(file: FilePlan, digest: str | None) -> None:
        calls.append(file.path)
        raise stop("enough")

    with pytest.raises(stop, match="enough") as info:
        _transform(job, dst, RunOptions(workers=workers, on_file_written=hook))
    assert len(calls) == 1  # not called again once it has raised
    progress = getattr(info.value, manifest.PROGRESS_ATTRIBUTE)
    assert progress.total == 4 and progress.resumable and not progress.complete
    journal = manifest.read_journal(dst)
    assert os.path.relpath(calls[0], dst) in journal and progress.completed == len(journal) >= 1
    assert temp_files(dst) == []
    assert not os.path.exists(os.path.join(dst, manifest.MANIFEST_NAME))
    report = _transform(job, dst, resume=True)
    assert len(report.kept) == len(journal)
    assert tree(dst) == reference
