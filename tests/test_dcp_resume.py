"""``--resume`` into a DCP output: a finished one is kept whole ("nothing to do"), a half-finished one
(some ``.distcp`` files, no ``.metadata``) gets only its missing files, and the manifest's checksums
are the files' (a ``.distcp``'s ZIP CRC-32s are patched after its data, so it is hashed once
finished, never while written).

Every command that writes a DCP folder (``transform``, ``convert --to dcp``, ``split``) and one that
writes from a DCP source (``unify``) is run twice through the CLI, the second time with ``--resume``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from reshard import api, manifest
from reshard.execute import local
from reshard.execute.digest import file_digest
from reshard.execute.options import RunOptions
from tests.test_dcp_write import full_tensors, read_back
from tests.test_integrity_signals import run_paused
from tests.trust_helpers import make_job, run_cli, snapshot, temp_files

DCP = api.OutputSpec(format="dcp")


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The trust job, its full model unified (``unified``) and as a 3-rank DCP folder (``dcp``)."""
    root = str(tmp_path_factory.mktemp("dcpresume"))
    job = make_job(root)
    api.unify(job["r8st"], job["s8"], f"{root}/unified")
    api.transform(job["full"], f"{root}/dcp", None, None, output=api.OutputSpec(format="dcp", dcp_ranks=3))
    return {**job, "unified": f"{root}/unified", "dcp": f"{root}/dcp"}


def _commands(job: dict[str, str], dst: str) -> dict[str, list[str]]:
    return {
        "transform": ["transform", job["r8"], dst, "--src-strategy", job["s8"], "--output-format", "dcp"],
        "transform-ranks": ["transform", job["full"], dst, "--output-format", "dcp", "--dcp-ranks", "4"],
        "convert": ["convert", job["full"], dst, "--to", "dcp"],
        "split": ["split", job["unified"], dst, "--dst-strategy", job["s4"], "--output-format", "dcp"],
        "unify-from-dcp": ["unify", job["dcp"], dst],
        "torch_dist": ["transform", job["r8"], dst, "--src-strategy", job["s8"], "--output-format", "torch_dist"],
        "torch_dist-run": [
            *("transform", job["full"], dst, "--output-format", "torch_dist", "--dcp-ranks", "3"),
            *("--dst-iteration", "40"),
        ],
        "torch_dist-from-dcp": ["transform", job["dcp"], dst, "--output-format", "torch_dist", "--dcp-ranks", "2"],
        "convert-torch_dist": ["convert", job["full"], dst, "--to", "torch_dist"],
    }


TORCH_DIST = ["torch_dist", "torch_dist-run", "torch_dist-from-dcp", "convert-torch_dist"]


# small texts a run always writes anew (torch_dist's too: common.pt, its ShardedObjects' __0_1.distcp, its markers)
TEXTS = {manifest.MANIFEST_NAME, ".metadata", "param_name_map.json"}
TEXTS |= {"common.pt", "__0_1.distcp", "metadata.json", "latest_checkpointed_iteration.txt"}


def _mtimes(dst: str) -> dict[str, int]:
    """Each data file's mtime (relative path -> ns)."""
    return {
        os.path.relpath(os.path.join(folder, n), dst): os.stat(os.path.join(folder, n)).st_mtime_ns
        for folder, _, names in os.walk(dst)
        for n in names
        if n not in TEXTS
    }


def assert_manifest_matches(dst: str) -> None:
    """Every output the manifest lists has the size and checksum it records."""
    for entry in manifest.read_manifest(dst)["outputs"]:
        path = os.path.join(dst, entry["path"])
        assert file_digest(path) == (entry["bytes"], entry["xxh128"]), entry["path"]


@pytest.mark.parametrize("command", ["transform", "transform-ranks", "convert", "split", "unify-from-dcp", *TORCH_DIST])
def test_resume_on_a_finished_output_has_nothing_to_do(job: dict[str, str], tmp_path: Path, command: str) -> None:
    dst = str(tmp_path / "out")
    args = _commands(job, dst)[command]
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    assert_manifest_matches(dst)
    before = _mtimes(dst)
    again = run_cli(*args, "--resume")
    assert again.returncode == 0, again.stderr
    assert "nothing to do" in again.stdout + again.stderr and "complete already" in again.stdout + again.stderr
    assert _mtimes(dst) == before  # not one file rewritten
    assert_manifest_matches(dst)


def test_a_distcp_checksum_is_the_finished_file_s(job: dict[str, str], tmp_path: Path) -> None:
    """The run's recorded checksum of each ``.distcp`` is that of its bytes with the CRC-32s in place."""
    dst = str(tmp_path / "out")
    report = api.transform(job["r8"], dst, job["s8"], None, output=DCP, run=RunOptions(workers=2))
    assert any(f.path.endswith(".distcp") for f in report.plan.files)
    assert_manifest_matches(dst)


def _interrupt_after(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """The local executor raises Ctrl-C instead of writing output number ``n`` (0-based)."""
    real, calls = local.run_file, {"n": 0}

    def run_file(*args: Any, **kwargs: Any) -> Any:
        if calls["n"] == n:
            raise KeyboardInterrupt
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(local, "run_file", run_file)


def test_a_half_finished_dcp_output_resumes_only_the_missing_files(
    job: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = str(tmp_path / "out")
    _interrupt_after(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        api.transform(job["r8"], dst, job["s8"], None, output=DCP, run=RunOptions(workers=1))
    monkeypatch.undo()
    assert not os.path.exists(os.path.join(dst, ".metadata"))  # not a checkpoint yet
    done = sorted(n for n in os.listdir(dst) if n.endswith(".distcp"))
    assert done == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    before = _mtimes(dst)
    report = api.transform(job["r8"], dst, job["s8"], None, output=DCP, destination=api.Destination(resume=True))
    assert sorted(report.kept) == done
    assert all(os.stat(os.path.join(dst, n)).st_mtime_ns == before[n] for n in done)  # kept, not rewritten
    assert sorted(n for n in os.listdir(dst) if n.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(8)]
    assert_manifest_matches(dst)
    want = full_tensors(job["full"])
    got = read_back(dst)
    assert all(got[n].tobytes() == want[n].tobytes() for n in want)


def test_a_killed_cli_run_resumes_and_verifies(job: dict[str, str], tmp_path: Path) -> None:
    """Ctrl-C while the fourth data file is written; ``--resume`` keeps three, ``verify`` agrees."""
    dst = str(tmp_path / "out")
    args = [*_commands(job, dst)["transform"], "--workers", "1"]
    proc = run_paused(args, "file:4", signal.SIGINT, str(tmp_path / "marker"))
    assert proc.returncode == 130, proc.stderr
    assert not os.path.exists(os.path.join(dst, ".metadata")) and not temp_files(dst)
    resumed = run_cli(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "kept 3 from the interrupted run" in resumed.stdout + resumed.stderr
    same = run_cli("verify", job["full"], dst)
    assert same.returncode == 0, same.stdout + same.stderr
    assert_manifest_matches(dst)


def test_a_half_finished_torch_dist_run_folder_resumes_only_the_missing_files(
    job: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Megatron-LM's run folder (``--dst-iteration``): the kept data files are not rewritten, the missing
    ones are, then ``common.pt``, ``.metadata``, ``metadata.json`` and the tracker, in that order."""
    dst = tmp_path / "run"
    out = api.OutputSpec(format="torch_dist", iteration=12)
    _interrupt_after(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        api.transform(job["r8"], str(dst), job["s8"], None, output=out, run=RunOptions(workers=1))
    monkeypatch.undo()
    save = dst / "iter_0000012"
    assert not any((save / n).exists() for n in (".metadata", "metadata.json", "common.pt"))
    assert not (dst / "latest_checkpointed_iteration.txt").exists()
    done = sorted(n for n in os.listdir(save) if n.endswith(".distcp"))
    assert done == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    before = _mtimes(str(save))
    resumed = api.transform(job["r8"], str(dst), job["s8"], None, output=out, destination=api.Destination(resume=True))
    assert sorted(os.path.basename(k) for k in resumed.kept) == done
    assert all(os.stat(save / n).st_mtime_ns == before[n] for n in done)  # kept, not rewritten
    marker = os.stat(save / "metadata.json").st_mtime_ns
    assert all(os.stat(save / n).st_mtime_ns <= marker for n in os.listdir(save) if not n.startswith("reshard-"))
    assert os.stat(dst / "latest_checkpointed_iteration.txt").st_mtime_ns >= marker
    assert (dst / "latest_checkpointed_iteration.txt").read_text() == "12"
    assert_manifest_matches(str(dst))
    want = full_tensors(job["full"])
    got = read_back(str(save))
    assert all(got[n].tobytes() == want[n].tobytes() for n in want)
    again = run_cli("verify", job["full"], str(dst))
    assert again.returncode == 0, again.stdout + again.stderr


# ------------------------------------------------------------------ --resume with other options, and what it wrote


def _dcp_ranks(job: dict[str, str], dst: str, ranks: int) -> list[str]:
    return ["transform", job["full"], dst, "--output-format", "dcp", "--dcp-ranks", str(ranks), "--workers", "1"]


def _refused(proc: Any) -> str:
    """The one line a refused ``--resume`` prints (exit 2, no traceback)."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("reshard: error: "), lines[0]
    assert "--resume (Destination(resume=True) in Python) refused" in lines[0], lines[0]
    assert "without --resume into a new or emptied destination" in lines[0], lines[0]
    return lines[0]


def test_resume_with_fewer_dcp_ranks_is_refused_and_the_earlier_files_stay(job: dict[str, str], tmp_path: Path) -> None:
    """Interrupted with its three data files in place (before ``.metadata``); ``--dcp-ranks 2 --resume``
    once left ``__2_0.distcp`` beside a 2-rank checkpoint, listed nowhere."""
    dst = str(tmp_path / "out")
    proc = run_paused(_dcp_ranks(job, dst, 3), "texts", signal.SIGINT, str(tmp_path / "marker"))
    assert proc.returncode == 130, proc.stderr
    before = snapshot(dst)
    assert sorted(n for n in os.listdir(dst) if n.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(3)]
    line = _refused(run_cli(*_dcp_ranks(job, dst, 2), "--resume"))
    assert "its output __2_0.distcp is not among this run's" in line, line
    assert snapshot(dst) == before  # nothing removed, nothing written, no lock left
    done = run_cli(*_dcp_ranks(job, dst, 3), "--resume")  # the run's own options continue it
    assert done.returncode == 0 and "kept 3 finished file(s)" in done.stderr, done.stderr
    assert_manifest_matches(dst)


def test_resume_into_another_iteration_is_refused_and_the_half_written_one_stays(
    job: dict[str, str], tmp_path: Path
) -> None:
    run = str(tmp_path / "run")
    args = ["transform", job["full"], run, "--output-format", "torch_dist", "--dcp-ranks", "3", "--workers", "1"]
    proc = run_paused([*args, "--dst-iteration", "500"], "file:3", signal.SIGINT, str(tmp_path / "marker"))
    assert proc.returncode == 130, proc.stderr
    before = snapshot(run)
    line = _refused(run_cli(*args, "--dst-iteration", "600", "--resume"))
    assert "iter_0000500/" in line and "not among this run's" in line, line
    assert snapshot(run) == before and not os.path.exists(os.path.join(run, "iter_0000600"))


def _resume_after_the_data_files(job: dict[str, str], tmp_path: Path) -> tuple[str, Any]:
    """A 4-rank DCP run interrupted once its data files are in place, before ``.metadata``; then ``--resume``."""
    dst = str(tmp_path / "out")
    proc = run_paused(_dcp_ranks(job, dst, 4), "texts", signal.SIGTERM, str(tmp_path / "marker"))
    assert proc.returncode == 143, proc.stderr
    assert not os.path.exists(os.path.join(dst, ".metadata"))
    resumed = run_cli(*_dcp_ranks(job, dst, 4), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    return dst, resumed


def test_a_resume_that_wrote_only_the_metadata_says_so_and_the_next_has_nothing_to_do(
    job: dict[str, str], tmp_path: Path
) -> None:
    dst, resumed = _resume_after_the_data_files(job, tmp_path)
    assert "kept 4 finished file(s) of the earlier run (verified); finished it with .metadata" in resumed.stderr
    assert_manifest_matches(dst)
    before = {n: os.stat(os.path.join(dst, n)).st_mtime_ns for n in os.listdir(dst) if n != manifest.MANIFEST_NAME}
    again = run_cli(*_dcp_ranks(job, dst, 4), "--resume")
    assert again.returncode == 0 and again.stdout.startswith("nothing to do: the 5 files in "), again.stdout
    after = {n: os.stat(os.path.join(dst, n)).st_mtime_ns for n in os.listdir(dst) if n != manifest.MANIFEST_NAME}
    assert after == before  # .metadata included: nothing was written but the manifest


def test_a_resume_that_wrote_only_the_metadata_does_not_say_nothing_to_do(job: dict[str, str], tmp_path: Path) -> None:
    _, resumed = _resume_after_the_data_files(job, tmp_path)
    assert "nothing to do" not in resumed.stdout and "wrote .metadata" in resumed.stdout, resumed.stdout
