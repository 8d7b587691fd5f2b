"""The Ray executor on a cluster of several nodes whose workers cannot open the job's files.

A real multi-machine cluster is not available to CI, so this builds the next best thing: a Ray
cluster of three nodes on this machine (``ray.cluster_utils.Cluster``: a head with no CPUs, so no
task runs beside the driver, and two worker nodes), whose task workers are started with a setup
hook that refuses to open anything under the job's folders. A run with ``shared_disk=False`` must
then produce the local executor's bytes (sources reach the nodes only through the object store,
outputs come back the same way), and a run that wrongly assumes a shared disk must fail with one
line naming the file.
"""

from __future__ import annotations

import builtins
import io
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

from reshard import api
from reshard.errors import ReshardError
from reshard.execute.ray import RayOptions
from reshard.manifest import read_manifest
from tests.trust_helpers import make_job, tree

FORBIDDEN_ENV = "RESHARD_TEST_FORBIDDEN_ROOTS"  # os.pathsep-separated folders the task workers may not open


def _forbid_job_paths() -> None:
    """Ray ``worker_process_setup_hook``: every open of a path under the forbidden roots fails."""
    roots = [os.path.abspath(r) for r in os.environ.get(FORBIDDEN_ENV, "").split(os.pathsep) if r]

    def check(path: Any) -> None:
        if isinstance(path, int):
            return
        full = os.path.abspath(os.fsdecode(path))
        if any(full == r or full.startswith(r + os.sep) for r in roots):
            raise PermissionError(13, "not on this node (no shared disk)", full)

    real_os_open, real_open = os.open, builtins.open

    def os_open(path: Any, *args: Any, **kwargs: Any) -> int:
        check(path)
        return real_os_open(path, *args, **kwargs)

    def open_(file: Any, *args: Any, **kwargs: Any) -> Any:
        check(file)
        return real_open(file, *args, **kwargs)

    os.open = os_open
    builtins.open = open_
    io.open = open_


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_job(str(tmp_path_factory.mktemp("job")))


@pytest.fixture(scope="module")
def three_nodes(job: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A head without CPUs and two one-CPU worker nodes; yields the folder the outputs go under."""
    outputs = str(tmp_path_factory.mktemp("outputs"))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    runtime_env = {
        "env_vars": {FORBIDDEN_ENV: os.pathsep.join([job["root"], outputs])},
        "worker_process_setup_hook": _forbid_job_paths,
    }
    ray.init(address=cluster.address, runtime_env=runtime_env, log_to_driver=False, logging_level="ERROR")
    try:
        yield outputs
    finally:
        ray.shutdown()
        cluster.shutdown()


def _tensor_files(root: str) -> dict[str, str]:
    return {p: h for p, h in tree(root).items() if not p.startswith("reshard-")}


def test_workers_really_cannot_see_the_job(three_nodes: str, job: dict[str, str]) -> None:
    @ray.remote(num_cpus=1)
    def probe(path: str) -> tuple[str, str]:
        try:
            with open(path, "rb"):
                return ray.get_runtime_context().get_node_id(), "opened"
        except PermissionError:
            return ray.get_runtime_context().get_node_id(), "refused"

    head = ray.get_runtime_context().get_node_id()
    results = ray.get([probe.remote(job["full"]) for _ in range(4)])
    assert {status for _, status in results} == {"refused"}
    assert head not in {node for node, _ in results}  # tasks run on the worker nodes only


@pytest.mark.parametrize("target", ["s4", None], ids=["8to4", "8tofull"])
def test_no_shared_disk_matches_local(three_nodes: str, job: dict[str, str], tmp_path: Any, target: str | None) -> None:
    dst_strategy = job[target] if target else None
    api.transform(job["r8"], str(tmp_path / "local"), job["s8"], dst_strategy)
    out = os.path.join(three_nodes, f"ray-{target}")
    api.transform(job["r8"], out, job["s8"], dst_strategy, run=RayOptions(shared_disk=False, max_tasks=3))
    expected = _tensor_files(str(tmp_path / "local"))
    assert expected and _tensor_files(out) == expected
    assert read_manifest(out)["complete"] is True


def test_assuming_a_shared_disk_fails_cleanly(three_nodes: str, job: dict[str, str]) -> None:
    out = os.path.join(three_nodes, "wrong")
    with pytest.raises(ReshardError) as info:
        api.transform(job["r8"], out, job["s8"], job["s4"], run=RayOptions(shared_disk=True))
    message = str(info.value)  # the first file a node could not open: an output or a source
    assert "\n" not in message and "no shared disk" in message
    assert message.startswith((out, job["root"]))
    assert not [n for _, _, names in os.walk(out) for n in names]  # rolled back
