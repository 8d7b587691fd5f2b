"""Ray without a shared disk: each node holds some rank folders on its own "disk".

One machine stands in for three: a ``ray.cluster_utils.Cluster`` of three nodes, each with a custom
resource (``node_a``, ``node_b``, ``node_c``). The rank folders of one source tree are split
between the nodes: node_a holds rank_0..3, node_b rank_4..7, node_c only an unrelated folder. Every
task worker is started with a setup hook that makes the other nodes' folders absent on its node
(``open``, ``os.open`` and ``os.stat`` of a path in them fail with ENOENT), so a task that reads a
file another node holds fails the run. The driver (not a task worker) plans from the headers.

Checked: outputs byte-identical to the local executor; the bytes that crossed nodes equal the
schedule's number, which equals a minimum computed here independently (element masks of every box a
writer node needs from a file it does not hold); node_c gets no task; the driver gets checksums,
never tensor bytes; bad placements fail in one line.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import pickle
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster

from reshard import api, cli
from reshard.errors import ReshardError, UsageError
from reshard.execute import ray_nodes
from reshard.execute.nodes import Schedule
from reshard.execute.ray import RayOptions
from reshard.execute.ray_nodes import NodeRun
from reshard.plan import Plan
from reshard.synthetic import ModelShape
from tests.trust_helpers import make_job, run_cli, tree

ABSENT_ENV = "RESHARD_TEST_ABSENT_BY_NODE"  # JSON: node id -> folders absent on that node
TRAPS_ENV = "RESHARD_TEST_TRAPS"  # a JSON file: [{"node", "under", "marker", "action": "exit"|"sleep"}]
CLUSTER: dict[str, Cluster] = {}
NODES = ("node_a", "node_b", "node_c")
HOLDS = {"node_a": range(0, 4), "node_b": range(4, 8)}  # node_c holds only an unrelated folder


def _hide_other_nodes_folders() -> None:
    """Ray ``worker_process_setup_hook``: the folders other nodes hold are absent on this one."""
    import errno

    by_node: dict[str, list[str]] = json.loads(os.environ.get(ABSENT_ENV, "{}"))
    absent: list[str] = []
    here: list[str] = []  # this worker's node id, once known

    def check(path: Any) -> None:
        if isinstance(path, int):
            return
        if not here:
            here.append(ray.get_runtime_context().get_node_id())
            absent.extend(by_node.get(here[0], []))
        node = here[0]
        full = os.path.abspath(os.fsdecode(path))
        if any(full == r or full.startswith(r + os.sep) for r in absent):
            raise FileNotFoundError(errno.ENOENT, "not on this node (no shared disk)", full)
        spring(node, full)

    def spring(node: str, full: str) -> None:
        """A trap set by a test: the first open under a folder on a node kills the worker or hangs."""
        traps_file = os.environ.get(TRAPS_ENV, "")
        if not exists(traps_file) or full.startswith(traps_file):
            return
        with real_open(traps_file, encoding="utf-8") as fh:
            traps = json.load(fh)
        for trap in traps:
            if trap["node"] == node and full.startswith(trap["under"]) and not exists(trap["marker"]):
                with real_open(trap["marker"], "w") as fh:
                    fh.write(str(os.getpid()))
                if trap["action"] == "exit":
                    os._exit(1)
                time.sleep(120)

    real_os_open, real_open, real_stat = os.open, builtins.open, os.stat

    def exists(path: str) -> bool:
        try:
            real_stat(path)
        except OSError:
            return False
        return bool(path)

    def os_open(path: Any, *args: Any, **kwargs: Any) -> int:
        check(path)
        return real_os_open(path, *args, **kwargs)

    def open_(file: Any, *args: Any, **kwargs: Any) -> Any:
        check(file)
        return real_open(file, *args, **kwargs)

    def stat(path: Any, *args: Any, **kwargs: Any) -> Any:
        check(path)
        return real_stat(path, *args, **kwargs)

    os.open, os.stat = os_open, stat
    builtins.open = open_
    io.open = open_


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    made = make_job(str(tmp_path_factory.mktemp("job")), ModelShape())  # a few MB: pieces of many sizes
    other = os.path.join(made["root"], "unrelated", "rank_0")
    os.makedirs(other)
    shutil.copy(os.path.join(made["r8"], "rank_0", os.listdir(os.path.join(made["r8"], "rank_0"))[0]), other)
    made["other"] = os.path.dirname(other)
    return made


def _folders(job: dict[str, str], node: str) -> list[str]:
    if node == "node_c":
        return [job["other"]]
    return [os.path.join(job["r8"], f"rank_{r}") for r in HOLDS[node]]


@pytest.fixture(scope="module")
def nodes(job: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Three one-CPU nodes (the head is node_a); yields resource name -> node id."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"node_a": 1}, "include_dashboard": False},
    )
    ids = {"node_a": cluster.head_node.node_id}
    for name in NODES[1:]:
        ids[name] = cluster.add_node(num_cpus=1, resources={name: 1}).node_id
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    absent = {ids[n]: [f for m in NODES if m != n for f in _folders(job, m)] for n in NODES}
    traps = str(tmp_path_factory.mktemp("traps") / "traps.json")
    env = {ABSENT_ENV: json.dumps(absent), TRAPS_ENV: traps}
    runtime_env = {"env_vars": env, "worker_process_setup_hook": _hide_other_nodes_folders}
    CLUSTER["cluster"] = cluster
    ids["traps"] = traps
    ray.init(address=cluster.address, runtime_env=runtime_env, log_to_driver=False, logging_level="ERROR")
    try:
        yield ids
    finally:
        ray.shutdown()
        cluster.shutdown()


def _tensor_files(root: str) -> dict[str, str]:
    return {p: h for p, h in tree(root).items() if not p.startswith("reshard-")}


def _holder(job: dict[str, str], path: str) -> str:
    rank = int(os.path.basename(os.path.dirname(path)).split("_")[1])
    return next(n for n, ranks in HOLDS.items() if rank in ranks)


def minimum_cross_bytes(plan: Plan, writers: tuple[str, ...], holder_of: dict[int, str]) -> int:
    """Independently: per writer node, the bytes of each source tensor it needs from another node
    (the union of its copies' boxes as element masks), summed."""
    need: dict[tuple[str, int, str], np.ndarray | int] = {}
    itemsize: dict[tuple[str, int, str], int] = {}
    for f, writer in zip(plan.files, writers, strict=True):
        for t in f.tensors:
            for c in t.copies:
                if holder_of[c.source] == writer:
                    continue
                key = (writer, c.source, c.tensor)
                with api.open_checkpoint(plan.sources[c.source]) as index:
                    entry = index.entries[c.tensor]
                if not entry.shape or entry.is_string:
                    need[key] = entry.nbytes  # copied whole
                    continue
                mask = need.setdefault(key, np.zeros(entry.shape, dtype=bool))
                assert isinstance(mask, np.ndarray)
                mask[tuple(slice(s, s + n) for s, n in zip(c.src_start, c.lengths, strict=True))] = True
                itemsize[key] = entry.dtype.itemsize
    return sum(v if isinstance(v, int) else int(v.sum()) * itemsize[k] for k, v in need.items())


def _placement_file(tmp_path: Any, job: dict[str, str], extra: dict[str, Any] | None = None) -> str:
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"nodes": {n: _folders(job, n) for n in ("node_a", "node_b")}, **(extra or {})}))
    return str(path)


class DriverTally:
    """What the driver process puts into and gets out of the object store, measured."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.puts = 0
        self.received = 0
        real_get, real_put = ray.get, ray.put

        def get(refs: Any, *args: Any, **kwargs: Any) -> Any:
            value = real_get(refs, *args, **kwargs)
            self.received += len(pickle.dumps(value))
            return value

        def put(value: Any, *args: Any, **kwargs: Any) -> Any:
            self.puts += 1
            return real_put(value, *args, **kwargs)

        monkeypatch.setattr(ray, "get", get)
        monkeypatch.setattr(ray, "put", put)


def test_each_node_sees_only_its_own_folders(nodes: dict[str, str], job: dict[str, str]) -> None:
    @ray.remote(num_cpus=0)
    def can_open(path: str) -> bool:
        try:
            with open(path, "rb"):
                return True
        except FileNotFoundError:
            return False

    def first_file(rank: int) -> str:
        folder = os.path.join(job["r8"], f"rank_{rank}")
        return os.path.join(folder, sorted(os.listdir(folder))[0])

    for name, expected in (("node_a", [True, False]), ("node_b", [False, True]), ("node_c", [False, False])):
        pinned = can_open.options(resources={name: 0.01})
        assert ray.get([pinned.remote(first_file(0)), pinned.remote(first_file(4))]) == expected, name


@pytest.mark.parametrize("target", ["s4", None], ids=["8to4", "8tofull"])
def test_auto_placement_matches_local_and_ships_the_minimum(
    nodes: dict[str, str], job: dict[str, str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch, target: str | None
) -> None:
    dst_strategy = job[target] if target else None
    api.transform(job["r8"], str(tmp_path / "local"), job["s8"], dst_strategy)
    runs: list[NodeRun] = []
    tally = DriverTally(monkeypatch)
    run = RayOptions(placement="auto", in_flight=1024**2, on_nodes=runs.append)  # small windows: many pieces
    report = api.transform(job["r8"], str(tmp_path / "ray"), job["s8"], dst_strategy, run=run)
    assert _tensor_files(str(tmp_path / "ray")) == _tensor_files(str(tmp_path / "local"))
    planned, done = runs[0].schedule, runs[-1]
    assert isinstance(planned, Schedule) and done.schedule == planned
    ids = {v: k for k, v in nodes.items()}
    holder_of = {i: nodes[_holder(job, p)] for i, p in enumerate(report.plan.sources)}
    minimum = minimum_cross_bytes(report.plan, planned.writers, holder_of)
    assert planned.cross_node_bytes == minimum == sum(done.received.values())
    assert minimum > 0  # the job really moves bytes between nodes
    assert {ids[n] for n in planned.nodes_used()} <= {"node_a", "node_b"}  # node_c holds nothing needed
    assert tally.puts == 0
    assert tally.received < 64 * 1024 < minimum  # checksums and probe answers, no tensor bytes


def test_placement_file_and_named_writer(
    nodes: dict[str, str], job: dict[str, str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A placement file names the holders (node_c is never asked) and one writer (node_c writes rank 1)."""
    placement = _placement_file(tmp_path, job, {"writers": {"1": "node_c"}})
    runs: list[NodeRun] = []
    run = RayOptions(placement=placement, on_nodes=runs.append)
    report = api.transform(job["r8"], str(tmp_path / "ray"), job["s8"], job["s4"], run=run)
    api.transform(job["r8"], str(tmp_path / "local"), job["s8"], job["s4"])
    assert _tensor_files(str(tmp_path / "ray")) == _tensor_files(str(tmp_path / "local"))
    sched = runs[-1].schedule
    rank1 = next(k for k, f in enumerate(report.plan.files) if f.rank == 1)
    assert sched.writers[rank1] == nodes["node_c"]
    assert sched.fetches[nodes["node_c"]]  # everything rank 1 reads crosses to node_c
    holder_of = {i: nodes[_holder(job, p)] for i, p in enumerate(report.plan.sources)}
    assert sched.cross_node_bytes == minimum_cross_bytes(report.plan, sched.writers, holder_of)
    assert sum(runs[-1].received.values()) == sched.cross_node_bytes


def test_bad_placements_fail_in_one_line(nodes: dict[str, str], job: dict[str, str], tmp_path: Any) -> None:
    def fails(placement: str) -> str:
        out = tmp_path / f"out{len(os.listdir(tmp_path))}"
        with pytest.raises(UsageError) as info:
            api.transform(job["r8"], str(out), job["s8"], job["s4"], run=RayOptions(placement=placement))
        assert not [n for _, _, names in os.walk(out) for n in names]  # nothing written
        message = str(info.value)
        assert "\n" not in message
        return message

    bad = tmp_path / "bad.json"
    bad.write_text("{nodes")
    assert "not JSON" in fails(str(bad))
    bad.write_text(json.dumps({"node_a": []}))
    assert "not a placement" in fails(str(bad))
    bad.write_text(json.dumps({"nodes": {"node_z": [job["r8"]]}}))
    assert "node_z" in fails(str(bad))
    wrong = {"nodes": {"node_c": [job["r8"]]}}  # node_c holds none of it
    bad.write_text(json.dumps(wrong))
    assert "does not" in fails(str(bad))
    partial = {"nodes": {"node_a": _folders(job, "node_a")}}
    bad.write_text(json.dumps(partial))
    assert "no node holds" in fails(str(bad))
    assert "cannot read the placement file" in fails(str(tmp_path / "missing.json"))


def test_cli_placement_prints_bytes_across_nodes(
    nodes: dict[str, str], job: dict[str, str], tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run says the bytes that cross nodes; ``reshard plan --placement`` says the same number first."""
    common = ["transform", "--src", job["r8"], "--src-strategy", job["s8"], "--dst-strategy", job["s4"]]
    placement = _placement_file(tmp_path, job)
    assert cli.main([*common, "--dst", str(tmp_path / "ray"), "--executor", "ray", "--placement", placement]) == 0
    line = next(x for x in capsys.readouterr().err.splitlines() if "bytes across nodes" in x)
    crossed = int(line.split("bytes across nodes: ")[1].split()[0])
    assert crossed > 0
    plan_args = ["--src", job["r8"], "--src-strategy", job["s8"], "--dst-strategy", job["s4"]]
    plan = run_cli("plan", *plan_args, "--dst", str(tmp_path / "p"), "--placement", placement)  # no cluster needed
    assert plan.returncode == 0, plan.stderr
    assert f"bytes across nodes: {crossed} " in plan.stdout
    bad = run_cli(*common, "--dst", str(tmp_path / "bad"), "--placement", placement)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--executor ray" in bad.stderr
    assert not (tmp_path / "bad").exists()


def test_driver_without_the_sources_plans_from_the_nodes(
    nodes: dict[str, str], job: dict[str, str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver cannot open or stat anything of the source tree: it plans from a header-only copy
    the nodes send (their checkpoints' framing, no tensor data) and the nodes read the real files."""
    api.transform(job["r8"], str(tmp_path / "local"), job["s8"], job["s4"])
    source = os.path.abspath(job["r8"])
    real_os_open, real_open, real_stat = os.open, builtins.open, os.stat

    def check(path: Any) -> None:
        if not isinstance(path, int) and os.path.abspath(os.fsdecode(path)).startswith(source + os.sep):
            raise FileNotFoundError(2, "not on the driver", os.fsdecode(path))

    monkeypatch.setattr(os, "open", lambda p, *a, **k: (check(p), real_os_open(p, *a, **k))[1])
    monkeypatch.setattr(builtins, "open", lambda p, *a, **k: (check(p), real_open(p, *a, **k))[1])
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: (check(p), real_stat(p, *a, **k))[1])
    with pytest.raises(FileNotFoundError):
        os.stat(os.path.join(job["r8"], "rank_0"))
    common = ["transform", "--src", job["r8"], "--src-strategy", job["s8"], "--dst-strategy", job["s4"]]
    assert cli.main([*common, "--dst", str(tmp_path / "ray"), "--executor", "ray", "--placement", "auto"]) == 0
    monkeypatch.undo()
    assert _tensor_files(str(tmp_path / "ray")) == _tensor_files(str(tmp_path / "local"))
    shadow = ray_nodes.shadow_folder(job["r8"])
    held = sum(os.stat(os.path.join(d, n)).st_blocks * 512 for d, _, names in os.walk(shadow) for n in names)
    full = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(job["r8"]) for n in names)
    assert held < full / 4  # the copy holds headers, not tensor data


def test_killed_worker_is_retried(nodes: dict[str, str], job: dict[str, str], tmp_path: Any) -> None:
    out, marker = tmp_path / "ray", tmp_path / "killed"
    traps = [{"node": nodes["node_b"], "under": str(out), "marker": str(marker), "action": "exit"}]
    with open(nodes["traps"], "w", encoding="utf-8") as fh:
        json.dump(traps, fh)
    try:
        api.transform(job["r8"], str(out), job["s8"], job["s4"], run=RayOptions(placement="auto"))
    finally:
        os.unlink(nodes["traps"])
    assert marker.exists()  # node_b's worker really died once
    api.transform(job["r8"], str(tmp_path / "local"), job["s8"], job["s4"])
    assert _tensor_files(str(out)) == _tensor_files(str(tmp_path / "local"))


def test_lost_node_fails_in_one_line_and_resume_completes(
    nodes: dict[str, str], job: dict[str, str], tmp_path: Any
) -> None:
    """node_c writes rank 1 and hangs; it is removed from the cluster. Runs last: the node stays gone."""
    out, marker = tmp_path / "ray", tmp_path / "hanging"
    traps = [{"node": nodes["node_c"], "under": str(out), "marker": str(marker), "action": "sleep"}]
    with open(nodes["traps"], "w", encoding="utf-8") as fh:
        json.dump(traps, fh)
    cluster = CLUSTER["cluster"]
    node_c = next(n for n in cluster.worker_nodes if n.node_id == nodes["node_c"])

    def remove_when_hanging() -> None:
        for _ in range(600):
            if marker.exists():
                cluster.remove_node(node_c)
                return
            time.sleep(0.1)

    remover = threading.Thread(target=remove_when_hanging)
    remover.start()
    try:
        with pytest.raises(ReshardError) as info:
            api.transform(
                job["r8"],
                str(out),
                job["s8"],
                job["s4"],
                run=RayOptions(placement=_placement_file(tmp_path, job, {"writers": {"1": "node_c"}})),
            )
    finally:
        remover.join()
        os.unlink(nodes["traps"])
    message = str(info.value)
    assert "\n" not in message and "node node_c was lost" in message, message
    report = api.transform(
        job["r8"],
        str(out),
        job["s8"],
        job["s4"],
        run=RayOptions(placement="auto"),
        destination=api.Destination(resume=True),
    )
    assert report.kept  # node_a's and node_b's outputs were journaled
    api.transform(job["r8"], str(tmp_path / "local"), job["s8"], job["s4"])
    assert _tensor_files(str(out)) == _tensor_files(str(tmp_path / "local"))
