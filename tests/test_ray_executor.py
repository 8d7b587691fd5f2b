"""The Ray executor gives the local executor's bytes, with and without a shared disk; errors stay one line."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import pytest
import ray

from reshard import api, cli, manifest
from reshard.errors import ReshardError, UsageError
from reshard.execute.ray import RayOptions, run_plan_ray
from tests.trust_helpers import make_job, run_cli, temp_files, tree


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_job(str(tmp_path_factory.mktemp("job")))


def _tensor_files(root: str) -> dict[str, str]:
    """sha256 of every checkpoint / text output (the manifest holds timings, so it is left out)."""
    return {p: h for p, h in tree(root).items() if not p.startswith("reshard-")}


@pytest.mark.parametrize("shared_disk", [True, False])
@pytest.mark.parametrize("target", ["s4", None], ids=["8to4", "8tofull"])
def test_transform_matches_local(
    cluster: None, job: dict[str, str], tmp_path: Any, shared_disk: bool, target: str | None
) -> None:
    dst_strategy = job[target] if target else None
    api.transform(job["r8"], str(tmp_path / "local"), job["s8"], dst_strategy)
    run = RayOptions(shared_disk=shared_disk, max_tasks=None if shared_disk else 3)
    api.transform(job["r8"], str(tmp_path / "ray"), job["s8"], dst_strategy, run=run)
    expected = _tensor_files(str(tmp_path / "local"))
    assert expected and _tensor_files(str(tmp_path / "ray")) == expected
    assert os.path.isfile(tmp_path / "ray" / "reshard-manifest.json")


def test_unify_writes_parts_and_index(cluster: None, job: dict[str, str], tmp_path: Any) -> None:
    api.unify(job["r8st"], job["s8"], str(tmp_path / "local"))
    api.unify(job["r8st"], job["s8"], str(tmp_path / "ray"), run=RayOptions(shared_disk=False))
    expected = _tensor_files(str(tmp_path / "local"))
    assert "param_name_map.json" in expected
    assert _tensor_files(str(tmp_path / "ray")) == expected


@pytest.mark.parametrize("shared_disk", [True, False])
def test_missing_source_is_one_line_error(cluster: None, job: dict[str, str], tmp_path: Any, shared_disk: bool) -> None:
    src = tmp_path / "src"
    api.convert(job["r8"], str(src), "safetensors", destination=api.Destination(manifest=False))
    plan = api.transform(
        str(src), str(tmp_path / "out"), job["s8"], job["s4"], destination=api.Destination(dry_run=True)
    ).plan
    gone = plan.sources[0]
    os.unlink(gone)
    with pytest.raises(UsageError) as info:
        api.execute(plan, run=RayOptions(shared_disk=shared_disk), root=str(tmp_path / "out"))
    message = str(info.value)
    assert "\n" not in message and gone in message
    leftovers = [n for _, _, names in os.walk(tmp_path / "out") for n in names]
    assert leftovers == []  # rolled back


def test_plain_runner_and_executor_name(cluster: None, job: dict[str, str], tmp_path: Any) -> None:
    plan = api.transform(
        job["r8"], str(tmp_path / "a"), job["s8"], job["s4"], destination=api.Destination(dry_run=True)
    ).plan
    run_plan_ray(plan, None, None, shared_disk=False, max_tasks=1)
    api.transform(job["r8"], str(tmp_path / "b"), job["s8"], job["s4"], destination=api.Destination(manifest=False))
    assert _tensor_files(str(tmp_path / "a")) == _tensor_files(str(tmp_path / "b"))
    with pytest.raises(UsageError, match="unknown executor"):
        api.execute(plan, executor="spark")


def test_cli_executor_ray(cluster: None, job: dict[str, str], tmp_path: Any, capsys: Any) -> None:
    common = ["transform", "--src", job["r8"], "--src-strategy", job["s8"], "--dst-strategy", job["s4"]]
    assert cli.main([*common, "--dst", str(tmp_path / "local")]) == 0
    assert cli.main([*common, "--dst", str(tmp_path / "ray"), "--executor", "ray", "--no-shared-disk"]) == 0
    assert _tensor_files(str(tmp_path / "ray")) == _tensor_files(str(tmp_path / "local"))
    assert cli.main(["convert", job["r8"], str(tmp_path / "st"), "--to", "safetensors", "--executor", "ray"]) == 0
    assert "wrote 8 files" in capsys.readouterr().out


def test_cli_joins_cluster_by_address(cluster: None, job: dict[str, str], tmp_path: Any) -> None:
    """A separate process joins the running cluster with --ray-address (as on a multi-node job)."""
    address = ray.get_runtime_context().gcs_address
    proc = run_cli(
        "transform",
        "--src",
        job["r8"],
        "--src-strategy",
        job["s8"],
        "--dst-strategy",
        job["s4"],
        "--dst",
        str(tmp_path / "ray"),
        "--executor",
        "ray",
        "--ray-address",
        address,
        "--no-shared-disk",
    )
    assert proc.returncode == 0, proc.stderr
    api.transform(job["r8"], str(tmp_path / "local"), job["s8"], job["s4"])
    assert _tensor_files(str(tmp_path / "ray")) == _tensor_files(str(tmp_path / "local"))


@pytest.mark.parametrize("shared_disk", [True, False])
def test_file_written_hook_is_called_on_the_driver(
    cluster: None, job: dict[str, str], tmp_path: Any, shared_disk: bool
) -> None:
    """The caller's ``on_file_written`` sees every output once (after its journal line); one that
    raises after the first output stops the run with the finished files kept for ``resume``."""
    api.transform(job["r8"], str(tmp_path / "local"), job["s8"], job["s4"])
    dst = str(tmp_path / "ray")
    seen: list[str] = []
    run = RayOptions(shared_disk=shared_disk, on_file_written=lambda f, digest: seen.append(f.path))
    report = api.transform(job["r8"], dst, job["s8"], job["s4"], run=run)
    assert sorted(seen) == sorted(f.path for f in report.plan.files)
    stopped = str(tmp_path / "stopped")

    def stop(file: Any, digest: str | None) -> None:
        assert os.path.relpath(file.path, stopped) in manifest.read_journal(stopped)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as info:
        api.transform(job["r8"], stopped, job["s8"], job["s4"], run=replace(run, on_file_written=stop))
    progress = getattr(info.value, manifest.PROGRESS_ATTRIBUTE)
    assert progress.resumable and progress.completed == len(manifest.read_journal(stopped)) >= 1
    assert temp_files(stopped) == []
    resumed = api.transform(job["r8"], stopped, job["s8"], job["s4"], run=run, destination=api.Destination(resume=True))
    assert len(resumed.kept) == progress.completed
    assert _tensor_files(stopped) == _tensor_files(str(tmp_path / "local"))


def test_task_error_keeps_class_and_message() -> None:
    from reshard.execute.ray import _task_error

    class Wrapped(Exception):
        cause = UsageError("no such file", "/x/y.ckpt")

    err = _task_error(Wrapped("long\ntraceback"))
    assert type(err) is UsageError and str(err) == "/x/y.ckpt: no such file"
    assert isinstance(_task_error(Exception("worker died\nmore")), ReshardError)
