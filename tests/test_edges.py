"""The edges a new user meets first (issue 18): Hugging Face exports hold weights only, no command
writes inside its source or replaces a file of the user's, every output path and the free space are
checked before the first byte, and the messages say what happened (``--resume`` with nothing to do,
``-q``, ``--json``, auto-transform's waiting, whole paths in plan tables). Every case runs the real
command and checks the exit code, the one line on stderr and that nothing on disk changed."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from reshard import manifest
from tests.trust_helpers import make_job, run_cli, snapshot, tree


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_job(str(tmp_path_factory.mktemp("edges")))


def _transform(job: dict[str, str], dst: str, *flags: str, env: dict[str, str] | None = None):
    args = ["transform", "--src", job["r8"], "--src-strategy", job["s8"], "--dst-strategy", job["s4"], "--dst", dst]
    return run_cli(*args, *flags, env=env)


def _one_error(proc) -> str:
    """The single stderr line of a refused command (exit 2, no traceback)."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("reshard: error:"), proc.stderr
    return lines[0]


def _copy(src: str, dst: Path) -> Path:
    """A private copy of an input tree, for tests whose defect would write into it."""
    import shutil

    shutil.copytree(src, dst)
    return dst


def _state_names(folder: Path) -> list[str]:
    """Training-state names in a folder's safetensors headers (read as the format defines them)."""
    names: list[str] = []
    for part in sorted(folder.glob("*.safetensors")):
        with open(part, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        names += [n for n in header if n.startswith(("adam_", "global_step", "learning_rate"))]
    return names


# ------------------------------------------------------------------ 2: Hugging Face exports


def test_hf_export_holds_weights_only_and_says_config_json_is_missing(job: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "hf"
    proc = run_cli("transform", "--src", job["r8"], "--src-strategy", job["s8"], "--dst", str(out), "--hf")
    assert proc.returncode == 0, proc.stderr
    assert _state_names(out) == []
    assert "no config.json" in proc.stderr and "--hf-config" in proc.stderr
    assert "transformers loads model weights only" not in proc.stderr  # no training-state note
    # the name report says why the states were dropped though --weights-only was not given
    assert "(--hf: weights only, --keep-training-state keeps them)" in proc.stderr
    assert "(--weights-only)" not in proc.stderr


def test_hf_export_keeps_training_state_only_when_asked_and_says_so(job: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "hf"
    proc = run_cli("convert", job["full"], str(out), "--to", "safetensors", "--hf", "--keep-training-state")
    assert proc.returncode == 0, proc.stderr
    assert any(n.startswith("adam_m.") for n in _state_names(out))
    said = [line for line in proc.stderr.splitlines() if "training-state" in line]
    assert len(said) == 1 and "transformers loads model weights only" in said[0]


def test_keep_training_state_needs_hf_and_contradicts_weights_only(job: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "o"
    assert "--keep-training-state" in _one_error(
        run_cli("convert", job["full"], str(out), "--to", "safetensors", "--keep-training-state")
    )
    line = _one_error(
        run_cli(
            "convert", job["full"], str(out), "--to", "safetensors", "--hf", "--keep-training-state", "--weights-only"
        )
    )
    assert "contradict" in line and not out.exists()


# ------------------------------------------------------------------ 3: never inside the source


def test_convert_without_destination_writes_a_new_folder_beside_the_source(job: dict[str, str], tmp_path: Path) -> None:
    src = _copy(job["r8"], tmp_path / "r8")
    before = snapshot(str(src))
    proc = run_cli("convert", str(src), "--to", "safetensors")
    assert proc.returncode == 0, proc.stderr
    assert snapshot(str(src)) == before  # no output, no manifest replaced in the source
    beside = tmp_path / "r8_safetensors"
    assert "new folder beside the source" in proc.stderr and str(beside.name) in proc.stderr
    assert manifest.read_manifest(str(beside))["complete"]
    proc = run_cli("transform", "--src", str(beside), "--src-strategy", job["s8"], "--dst", str(tmp_path / "full"))
    assert proc.returncode == 0, proc.stderr  # the next command reads it


def test_reencrypting_without_destination_writes_beside_the_file(job: dict[str, str], tmp_path: Path) -> None:
    src = tmp_path / "full" / "model.ckpt"
    src.parent.mkdir()
    src.write_bytes(Path(job["full"]).read_bytes())
    key = tmp_path / "k"
    key.write_bytes(b"K" * 16)
    proc = run_cli("convert", str(src), "--to", "ckpt", "--enc-key-file", str(key))
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(src.parent)) == ["model.ckpt", "model_ckpt"]  # the source's folder holds one checkpoint
    assert (src.parent / "model_ckpt" / "model.ckpt").read_bytes() != src.read_bytes()


def test_api_convert_of_rank_folders_without_destination_is_refused(job: dict[str, str], tmp_path: Path) -> None:
    from reshard import api
    from reshard.errors import UsageError

    src = str(_copy(job["r8"], tmp_path / "r8"))
    before = snapshot(src)
    with pytest.raises(UsageError, match="give a destination folder"):
        api.convert(src, None, "safetensors")
    assert snapshot(src) == before


@pytest.mark.parametrize("where", ["equal", "inside", "holding"])
def test_no_command_writes_inside_equal_to_or_around_its_source(job: dict[str, str], tmp_path: Path, where) -> None:
    root = tmp_path / "root"
    src = _copy(job["r8st"], root / "r8st")
    dst = {"equal": src, "inside": src / "out", "holding": root}[where]
    before = snapshot(str(root))
    commands = [
        ["transform", "--src", str(src), "--src-strategy", job["s8"], "--dst-strategy", job["s4"], "--dst", str(dst)],
        ["convert", str(src), str(dst), "--to", "ckpt"],
        ["unify", str(src), str(dst), "--src-strategy", job["s8"]],
    ]
    for args in commands:
        for flags in ([], ["--overwrite"]):
            line = _one_error(run_cli(*args, *flags))
            assert "source" in line, line
    assert snapshot(str(root)) == before


def test_transform_by_rank_never_writes_onto_an_input(job: dict[str, str], tmp_path: Path) -> None:
    from reshard import api
    from reshard.errors import UsageError

    src = _copy(job["r8"], tmp_path / "r8")
    files = {r: str(src / f"rank_{r}" / os.listdir(src / f"rank_{r}")[0]) for r in range(8)}
    before = snapshot(str(src))
    with pytest.raises(UsageError, match="would replace the source"):
        api.transform_by_rank(0, files, files[0], job["s8"], job["s4"])
    assert snapshot(str(src)) == before


def test_split_refuses_a_destination_holding_its_source(job: dict[str, str], tmp_path: Path) -> None:
    unified = tmp_path / "u" / "unified"
    assert run_cli("unify", job["r8st"], str(unified), "--src-strategy", job["s8"]).returncode == 0
    before = snapshot(str(tmp_path / "u"))
    line = _one_error(run_cli("split", str(unified), str(tmp_path / "u"), "--dst-strategy", job["s4"], "--overwrite"))
    assert "holds the source" in line and snapshot(str(tmp_path / "u")) == before


def test_destination_holding_a_strategy_is_refused(job: dict[str, str], tmp_path: Path) -> None:
    dst = tmp_path / "out"
    dst.mkdir()
    strategy = dst / "s4.ckpt"
    strategy.write_bytes(Path(job["s4"]).read_bytes())
    line = _one_error(
        run_cli("transform", "--src", job["r8"], "--src-strategy", job["s8"], "--dst-strategy", str(strategy),
                "--dst", str(dst), "--overwrite")
    )  # fmt: skip
    assert "holds the source" in line and os.listdir(dst) == ["s4.ckpt"]


# ------------------------------------------------------------------ 4: never replace a user's file


def test_merge_strategies_refuses_an_existing_file_unless_overwrite(job: dict[str, str], tmp_path: Path) -> None:
    mine = tmp_path / "keys.ckpt"
    mine.write_bytes(b"precious")
    line = _one_error(run_cli("merge-strategies", job["s8dir"], str(mine)))
    assert "--overwrite" in line and mine.read_bytes() == b"precious"
    proc = run_cli("merge-strategies", job["s8dir"], str(mine), "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert mine.read_bytes() == Path(job["s8"]).read_bytes()
    stages = str(_copy(job["s8dir"], tmp_path / "s8"))
    before = snapshot(stages)
    stage_file = os.path.join(stages, sorted(os.listdir(stages))[0])
    for flags in ([], ["--overwrite"]):  # onto a per-stage file it reads: never
        line = _one_error(run_cli("merge-strategies", stages, stage_file, *flags))
        assert "would replace the source" in line and snapshot(stages) == before
    # into the per-stage folder, as MindSpore's merge_pipeline_strategys allows: a new file only
    assert run_cli("merge-strategies", stages, os.path.join(stages, "merged.ckpt")).returncode == 0
    assert "--overwrite" in _one_error(run_cli("merge-strategies", stages, os.path.join(stages, "merged.ckpt")))


def test_plan_picture_refuses_an_existing_file_unless_overwrite(job: dict[str, str], tmp_path: Path) -> None:
    picture = tmp_path / "mine.svg"
    picture.write_text("<svg/>")
    args = ["plan", "--src", job["r8"], "--src-strategy", job["s8"], "--dst-strategy", job["s4"], "--dst", "o"]
    line = _one_error(run_cli(*args, "--picture", str(picture)))
    assert "--overwrite" in line and picture.read_text() == "<svg/>"
    assert run_cli(*args, "--picture", str(picture), "--overwrite").returncode == 0
    assert picture.read_text() != "<svg/>"


# ------------------------------------------------------------------ 5: every output path before the first byte


def test_names_report_paths_are_checked_before_any_output(job: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    src = _copy(job["r8"], tmp_path / "r8")
    existing = tmp_path / "report.json"
    existing.write_text("mine")
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, stat.S_IRUSR | stat.S_IXUSR)
    cases = {
        str(tmp_path / "missing" / "r.json"): "no such folder",
        str(existing): "--overwrite",
        str(tmp_path): "is a folder",
        str(src / "r.json"): "inside the source",
    }
    if not os.access(locked, os.W_OK):  # root writes anywhere: the read-only case needs a user
        cases[str(locked / "r.json")] = "read-only"
    for path, words in cases.items():
        line = _one_error(_transform({**job, "r8": str(src)}, str(out), "--weights-only", "--names-report", path))
        assert words in line, line
        assert not out.exists(), path
    assert existing.read_text() == "mine"


def test_unwritable_destination_parent_is_refused_before_reading(job: dict[str, str], tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = _one_error(_transform(job, str(blocker / "out")))
    assert "not a folder" in line and blocker.read_text() == "x"


# ------------------------------------------------------------------ 6: free space


def test_too_little_free_space_is_refused_with_both_numbers(job: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    line = _one_error(_transform(job, str(out), env={"RESHARD_TEST_FREE_BYTES": "1000"}))
    assert "not enough free space" in line and "1000 bytes" in line
    assert not out.exists()
    needed = int(line.split("needs ")[1].split("(")[1].split(" bytes")[0])
    plan = json.loads(run_cli("plan", "--src", job["r8"], "--src-strategy", job["s8"], "--dst-strategy", job["s4"],
                              "--dst", str(out), "--json").stdout)  # fmt: skip
    sizes = [os.path.getsize(f["path"]) for f in json.loads(_transform(job, str(out), "--json").stdout)["written"]]
    assert sum(sizes) <= needed <= plan["bytes_written"] + 64 * 1024 * len(sizes)  # headers bounded, not ignored


def test_disk_filling_up_keeps_finished_files_for_resume(job: dict[str, str], tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    assert _transform(job, str(reference)).returncode == 0
    out = tmp_path / "out"
    line = _one_error(_transform(job, str(out), "--workers", "1", env={"RESHARD_TEST_ENOSPC_AFTER": "2"}))
    assert "no space left" in line and "2 of 4 files" in line and "--resume" in line
    assert len(manifest.read_journal(str(out))) == 2 and not os.path.exists(manifest.manifest_path(str(out)))
    proc = _transform(job, str(out), "--resume")
    assert proc.returncode == 0, proc.stderr
    assert "kept 2 from the interrupted run" in proc.stdout and "wrote 2 files" in proc.stdout
    assert tree(str(out)) == tree(str(reference))


def test_free_space_check_counts_only_what_resume_still_writes(job: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    _one_error(_transform(job, str(out), "--workers", "1", env={"RESHARD_TEST_ENOSPC_AFTER": "3"}))
    line = _one_error(_transform(job, str(tmp_path / "new"), env={"RESHARD_TEST_FREE_BYTES": "0"}))
    room = str(int(line.split("needs ")[1].split("(")[1].split(" bytes")[0]) - 1)  # not enough for all four
    assert "not enough free space" in _one_error(
        _transform(job, str(tmp_path / "new"), env={"RESHARD_TEST_FREE_BYTES": room})
    )
    proc = _transform(job, str(out), "--resume", env={"RESHARD_TEST_FREE_BYTES": room})
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------ 8: messages


def test_resume_of_a_finished_destination_says_there_was_nothing_to_do(job: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert _transform(job, str(out)).returncode == 0
    proc = _transform(job, str(out), "--resume")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("nothing to do") and "wrote" not in proc.stdout and "MiB/s" not in proc.stdout
    assert " are complete already" in proc.stdout  # several files; one file "is"
    one = tmp_path / "one"
    assert run_cli("convert", job["full"], str(one), "--to", "safetensors").returncode == 0
    again = run_cli("convert", job["full"], str(one), "--to", "safetensors", "--resume")
    assert again.returncode == 0 and "the 1 file" in again.stdout and " is complete already" in again.stdout, (
        again.stdout
    )


def test_quiet_silences_the_name_report(job: dict[str, str], tmp_path: Path) -> None:
    proc = _transform(job, str(tmp_path / "out"), "--weights-only", "-q")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_json_of_a_run_is_one_record_of_what_was_written(job: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _transform(job, str(out), "--json", "-q")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)  # one JSON document, no plan before it
    assert record["operation"] == "transform" and record["destination"] == str(out)
    written = {w["path"]: w["bytes"] for w in record["written"]}
    assert sorted(written) == sorted(str(out / f"rank_{r}" / f"checkpoint_{r}.ckpt") for r in range(4))
    assert all(os.path.getsize(p) == n for p, n in written.items())
    assert record["bytes_written"] == sum(written.values()) and record["kept"] == []
    proc = _transform(job, str(out), "--json", "--resume")
    assert json.loads(proc.stdout)["written"] == [] and len(json.loads(proc.stdout)["kept"]) == 4
    proc = run_cli("convert", job["full"], str(tmp_path / "st"), "--to", "safetensors", "--json")
    assert json.loads(proc.stdout)["written"][0]["path"].endswith("model.safetensors")


# ------------------------------------------------------------------ 9: auto-transform waits aloud


def test_auto_transform_says_it_is_waiting_and_which_stage_is_missing(job: dict[str, str], tmp_path: Path) -> None:
    strategies = tmp_path / "strategies"
    strategies.mkdir()
    first = sorted(os.listdir(job["s4dir"]))[0]
    (strategies / first).write_bytes(Path(job["s4dir"], first).read_bytes())
    os.utime(strategies / first, (time.time() - 60, time.time() - 60))  # stage 0's file, settled
    proc = run_cli(
        "auto-transform", job["full"], "--dst-strategy", str(strategies), "--rank-id", "0", "--world-size", "4",
        "--cache-dir", str(tmp_path / "cache"), "--timeout", "1.2",
        env={"RESHARD_AUTO_WAIT_EVERY": "0.3"},
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("reshard: note: waiting for the destination strategy")
    still = [line for line in lines if "still waiting" in line]
    assert len(still) >= 2 and all("no strategy file yet of pipeline stage 1 of 2" in line for line in still), (
        proc.stderr
    )
    assert "timed out" in lines[-1]


# ------------------------------------------------------------------ 10: whole paths on a pipe


def test_plan_table_keeps_whole_paths_on_a_pipe(job: dict[str, str]) -> None:
    dst = "a_rather_longer_destination_folder_name/that/goes/on/and/on/for/the/test"
    proc = run_cli("plan", "--src", job["r8"], "--src-strategy", job["s8"], "--dst-strategy", job["s4"], "--dst", dst)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if "checkpoint_" in line]
    assert len(rows) == 4 and all(f"{dst}/rank_" in row for row in rows), proc.stdout
    assert "…" not in proc.stdout
