"""Checkpoint 2.0 output on the Ray executor: the same tree as the local executor, tracker last."""

from __future__ import annotations

import os
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from reshard import api  # noqa: E402
from reshard.execute.ray import RayOptions  # noqa: E402
from tests.cp2_write_helpers import write_job  # noqa: E402
from tests.trust_helpers import tree  # noqa: E402


@pytest.mark.parametrize("shared_disk", [True, False])
def test_ray_writes_the_same_checkpoint2_tree(tmp_path: Any, shared_disk: bool) -> None:
    job = write_job(str(tmp_path / "job"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        local, remote = str(tmp_path / "local"), str(tmp_path / "ray")
        for dst, run in ((local, None), (remote, RayOptions(shared_disk=shared_disk, max_tasks=3))):
            api.transform(
                job["full"],
                dst,
                None,
                job["strategy"],
                run=run,
                output=api.OutputSpec(format="checkpoint2", iteration=2),
            )
    finally:
        ray.shutdown()
    expected = {p: h for p, h in tree(local).items() if not p.startswith("reshard-")}
    assert len(expected) == 16 + 3
    assert {p: h for p, h in tree(remote).items() if not p.startswith("reshard-")} == expected
    tracker = os.path.join(remote, "latest_checkpointed_iteration.txt")
    newest = max(
        os.stat(os.path.join(remote, "iteration_00000002", n)).st_mtime_ns
        for n in os.listdir(os.path.join(remote, "iteration_00000002"))
    )
    assert os.stat(tracker).st_mtime_ns >= newest
