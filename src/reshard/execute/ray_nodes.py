"""Run a plan on Ray when each node holds some source files on its own disk (no shared disk).

Why this shape (the schedule itself is ``execute.nodes``, plain data):

* **Ask the nodes.** Which node holds which source file is found by a small task pinned to each
  alive node (``NodeAffinitySchedulingStrategy(node_id, soft=False)``) that looks for the plan's
  source files there and returns their size and header facts (tensor shapes and file segments), or
  is read from a placement file (then only the nodes it names are asked, to confirm). Copies of one
  file on several nodes must agree (size and segments), else the run is refused.
* **One task per writer node.** Each node that writes outputs gets one task, pinned to it. The task
  fetches the byte ranges it needs of every source file it does not hold by starting small reader
  tasks pinned to a node holding that file (``os.pread`` of exactly those ranges: the offsets come
  from the format readers' segments, run by the probe on the holding node). Each fetched piece
  reaches the writer node through Ray's object store and is written at its own offset into a
  *sparse* node-local replica of the source file. Then the local executor itself
  (``local.run_plan``, with ``workers`` threads and ``max_memory``) writes the node's outputs,
  reading local sources from disk and remote ones from their replicas: outputs are byte-identical
  to the local executor's by construction. A byte two outputs of one node need is fetched once
  (the schedule merges their ranges).
* **Nothing through the driver.** The driver sends each node task its file plans and the ranges to
  fetch; pieces go from the reader's node to the writer's node; the driver receives each output's
  checksum. It puts nothing into the object store and gets no tensor bytes.
* **Bounded object store.** A writer node task keeps at most ``in_flight`` bytes of pieces
  requested and not yet written into its replicas (``ray.wait`` windows); a piece is at most a
  quarter of that. The replicas take node-local disk for the bytes fetched (sparse files).
* **Failures.** A killed worker's task is retried (Ray ``max_retries``; outputs are written
  atomically, so a retry starts clean). A node that is lost fails the run with one line naming it;
  outputs already written are journaled, so ``--resume`` completes the run.

Encrypted ``.ckpt`` sources cannot be read in byte ranges (their records decrypt whole): they are
refused here; ``shared_disk=False`` without a placement (the driver ships whole files) reads them.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from reshard.errors import ReshardError, UsageError
from reshard.execute import local
from reshard.execute.nodes import (
    Fetch,
    Run,
    Schedule,
    SourceFacts,
    load_placement,
    merge_runs,
    schedule,
    source_facts,
)
from reshard.execute.options import DEFAULT_IN_FLIGHT, KEEP_FINISHED, RunOptions, WriteOptions
from reshard.formats import registry
from reshard.formats.base import TensorEntry, TensorIndex, stale_temps
from reshard.plan import FilePlan, Plan
from reshard.plan.validate import PlanError
from reshard.sources import ReadOptions, open_checkpoint
from reshard.text import RESUME, first_line

TASK_RETRIES = 3  # a killed worker's task is run again this many times
TEMP_PREFIX = "reshard-ray-node-"  # node-local folder of one writer task (sparse replicas)
AUTO = "auto"  # placement: ask every alive node what it holds


@dataclass(frozen=True)
class NodeRun:
    """What a node-local run did: the schedule, and the bytes each writer node received."""

    schedule: Schedule
    names: Mapping[str, str]  # node id -> the name used in messages
    received: Mapping[str, int]  # writer node id -> bytes of pieces it fetched from other nodes


# ------------------------------------------------------------------------------ errors


def task_error(exc: BaseException) -> ReshardError | PlanError:
    """A one-line ``ReshardError`` for what a task raised (the same class and message if it was ours);
    a ``PlanError`` stays what it is: an internal error, not the user's."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, PlanError):
        return PlanError(str(cause))
    if isinstance(cause, ReshardError):
        err = type(cause).__new__(type(cause))
        ReshardError.__init__(err, cause.detail, cause.path)
        return err
    if isinstance(cause, OSError):
        return ReshardError(f"write failed: {cause.strerror or cause}", cause.filename)
    if isinstance(cause, BaseException):
        return ReshardError(f"Ray task failed: {type(cause).__name__}: {first_line(cause)}")
    return ReshardError(f"Ray task failed: {first_line(exc)}")


def cancel_refs(ray: Any, refs: list[Any]) -> None:
    """Cancel what is still running and wait for it to stop (so no late rename follows a roll-back)."""
    for ref in refs:
        with contextlib.suppress(Exception):
            ray.cancel(ref)
    for ref in refs:
        with contextlib.suppress(Exception):
            ray.get(ref)


# ------------------------------------------------------------------------------ node tasks


def probe(paths: Sequence[str], read: ReadOptions | None) -> dict[str, SourceFacts]:
    """On one node: the given source files this node holds, with their size and tensor facts."""
    found: dict[str, SourceFacts] = {}
    for path in paths:
        try:
            os.stat(path)
        except OSError:
            continue  # not on this node
        found[path] = source_facts(path, read)
    return found


def read_runs(path: str, runs: Sequence[Run]) -> np.ndarray:
    """On the node holding ``path``: exactly the bytes of ``runs``, one after another."""
    out = np.empty(sum(n for _, n in runs), dtype=np.uint8)
    view = out.data
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise UsageError(f"cannot read the source on its node: {exc.strerror or exc}", path) from None
    try:
        pos = 0
        for offset, length in runs:
            got = os.preadv(fd, [view[pos : pos + length]], offset)
            if got != length:
                raise UsageError("the source ended early on its node (changed since planning?)", path)
            pos += length
    finally:
        os.close(fd)
    return out


def _pieces(fetch: Fetch, piece_bytes: int) -> list[list[Run]]:
    """A fetch's runs cut into pieces of at most ``piece_bytes`` (long runs are split)."""
    pieces: list[list[Run]] = [[]]
    size = 0
    for offset, length in fetch.runs:
        while length:
            n = min(length, piece_bytes - size)
            pieces[-1].append((offset, n))
            offset, length, size = offset + n, length - n, size + n
            if size == piece_bytes:
                pieces.append([])
                size = 0
    return [p for p in pieces if p]


def _gather(
    ray: Any,
    sources: Sequence[str],
    fetches: Sequence[Fetch],
    replicas: Mapping[int, str],
    sizes: Mapping[int, int],
    in_flight: int,
    names: Mapping[str, str],
) -> int:
    """Fetch every piece into its sparse replica, at most ``in_flight`` bytes requested at once."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    reader = ray.remote(num_cpus=0, max_retries=TASK_RETRIES)(read_runs)
    piece_bytes = max(1, in_flight // 4)
    fds: dict[int, int] = {}
    pending: dict[Any, tuple[int, list[Run], str]] = {}
    waiting = received = 0

    def drain_one() -> None:
        nonlocal waiting, received
        [done], _ = ray.wait(list(pending), num_returns=1)
        source, runs, node = pending.pop(done)
        try:
            data = ray.get(done)
        except ray.exceptions.RayError as exc:
            raise _reader_error(exc, names.get(node, node), sources[source]) from None
        view, pos = memoryview(data), 0
        for offset, length in runs:
            os.pwrite(fds[source], view[pos : pos + length], offset)
            pos += length
        del view, data
        waiting -= pos
        received += pos

    try:
        for f in fetches:
            fds[f.source] = os.open(replicas[f.source], os.O_RDWR | os.O_CREAT, 0o600)
            os.ftruncate(fds[f.source], sizes[f.source])
            strategy = NodeAffinitySchedulingStrategy(f.reader, soft=False)
            for runs in _pieces(f, piece_bytes):
                nbytes = sum(n for _, n in runs)
                while pending and waiting + nbytes > in_flight:
                    drain_one()
                ref = reader.options(scheduling_strategy=strategy).remote(sources[f.source], runs)
                pending[ref] = (f.source, runs, f.reader)
                waiting += nbytes
        while pending:
            drain_one()
    except BaseException:
        for ref in pending:
            with contextlib.suppress(Exception):
                ray.cancel(ref)
        raise
    finally:
        for fd in fds.values():
            os.close(fd)
    return received


def _reader_error(exc: BaseException, node: str, path: str) -> ReshardError:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ReshardError):
        return cause
    return ReshardError(f"reading it on node {node} failed: {type(exc).__name__}: {first_line(exc)}", path)


def _replica_index(path: str, facts: SourceFacts, fmt: str) -> TensorIndex:
    """A tensor index over a sparse replica: the source's segments, only the fetched bytes present."""
    entries = {n: TensorEntry(n, t.dtype, t.shape, t.segments) for n, t in facts.tensors.items()}
    if facts.size == 0:
        return TensorIndex(path, fmt, b"", entries)
    with open(path, "rb") as fh:
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    return TensorIndex(path, fmt, buf, entries, _closer=buf.close, file_backed=True)


def node_job(
    sources: tuple[str, ...],
    files: list[FilePlan],
    fetches: list[Fetch],
    facts: dict[int, SourceFacts],
    read: ReadOptions | None,
    write: WriteOptions,
    run: RunOptions,
    in_flight: int,
    names: dict[str, str],
) -> tuple[list[str | None], int]:
    """On a writer node: fetch what other nodes hold, then write ``files``; returns checksums, bytes fetched.

    A retried attempt (its predecessor's worker was killed) first removes the temporary files the
    killed attempt left beside these outputs; the run's lock makes this task their only writer."""
    import ray

    for f in files:
        for stale in stale_temps(f.path):
            with contextlib.suppress(FileNotFoundError):
                os.remove(stale)

    with tempfile.TemporaryDirectory(prefix=TEMP_PREFIX) as tmp:
        replicas = {i: os.path.join(tmp, f"src{i}-{os.path.basename(sources[i])}") for i in (f.source for f in fetches)}
        sizes = {i: facts[i].size for i in replicas}
        received = _gather(ray, sources, fetches, replicas, sizes, in_flight, names)
        by_path = {replicas[i]: (i, os.path.splitext(sources[i])[1].lstrip(".")) for i in replicas}
        remapped = tuple(replicas.get(i, p) for i, p in enumerate(sources))

        def opener(path: str) -> TensorIndex:
            if path in by_path:
                i, fmt = by_path[path]
                return _replica_index(path, facts[i], fmt)
            return open_checkpoint(path, read)

        checksums: dict[str, str | None] = {}  # the local executor's threads report each file here
        node_run = replace(run, on_file_written=lambda f, digest: checksums.__setitem__(f.path, digest))
        local.run_plan(Plan("ray", remapped, tuple(files)), opener, write, node_run)
        return [checksums.get(f.path) for f in files], received


# ------------------------------------------------------------------------------ planning from the nodes

SHADOW_WHOLE_MAX = 64 * 1024**2  # other files under the source (strategies, JSON) copied whole up to this size


@dataclass(frozen=True)
class Skeleton:
    """One file under the source as a node has it: size, mtime and the bytes planning reads."""

    size: int
    mtime_ns: int
    runs: tuple[Run, ...]  # byte ranges present in ``data``: a checkpoint's framing, or the whole file
    data: bytes


def skeletons(root: str, read: ReadOptions | None) -> dict[str, Skeleton]:
    """On one node: every file under ``root`` it holds, a checkpoint without its tensor data."""
    if not os.path.isdir(root):
        paths = {".": root}
    else:
        paths = {
            os.path.relpath(os.path.join(d, n), root): os.path.join(d, n)
            for d, _, names in os.walk(root)
            for n in names
        }
    found = {}
    for rel, path in sorted(paths.items()):
        try:
            st = os.stat(path)
        except OSError:
            continue  # listed but not readable here: another node's
        if registry.format_of(path) is not None:  # a checkpoint file: its header and framing, not its data
            with open_checkpoint(path, read) as index:
                if not index.file_backed:
                    source_facts(path, read)  # raises the one-line refusal of encrypted sources
                data = [seg for e in index.entries.values() if not e.is_string for seg in e.segments]
            runs = _complement(merge_runs(data), st.st_size)
        elif st.st_size <= SHADOW_WHOLE_MAX:
            runs = [(0, st.st_size)]
        else:
            continue
        found[rel] = Skeleton(st.st_size, st.st_mtime_ns, tuple(runs), read_runs(path, runs).tobytes())
    return found


def _complement(runs: Sequence[Run], size: int) -> list[Run]:
    gaps, pos = [], 0
    for offset, length in runs:
        if offset > pos:
            gaps.append((pos, offset - pos))
        pos = max(pos, offset + length)
    if pos < size:
        gaps.append((pos, size - pos))
    return gaps


def shadow_folder(src: str) -> str:
    """Where the header-only copy of ``src`` is made on the driver (the same place for the same source,
    so a resumed run's fingerprints match)."""
    key = hashlib.sha256(os.path.abspath(src).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"reshard-shadow-{os.getuid()}", key)


def plan_from_nodes(ray: Any, src: str, placement: str, read: ReadOptions | None) -> str:
    """Make a header-only copy of ``src`` from what the nodes hold; returns its path to plan from.

    Every checkpoint file keeps its size, modification time and every byte but its tensor data
    (sparse holes), and other files (strategies, JSON) are copied whole, so any source kind plans
    from it as from ``src``; the run then reads the real files on the nodes
    (``RayOptions.sources_from``). The nodes check crc trailers (``read.verify_crc``) as they go.
    """
    nodes = (
        [n["NodeID"] for n in alive_nodes(ray)]
        if placement == AUTO
        else list(resolve_nodes(ray, sorted(load_placement(placement).holders)).values())
    )
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(num_cpus=0, max_retries=TASK_RETRIES)(skeletons)
    refs = [
        remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(src, read)
        for n in nodes
    ]
    merged: dict[str, Skeleton] = {}
    for ref in refs:
        try:
            found = ray.get(ref)
        except ray.exceptions.RayError as exc:
            raise task_error(exc) from None
        for rel, skeleton in found.items():
            if rel in merged and merged[rel].size != skeleton.size:
                raise UsageError("the nodes hold different files under this name", os.path.join(src, rel))
            merged.setdefault(rel, skeleton)
    if not merged:
        raise UsageError("no node holds anything under this path", src)
    top = shadow_folder(src)
    shutil.rmtree(top, ignore_errors=True)  # our own folder: an earlier run's copy
    shadow = os.path.join(top, os.path.basename(os.path.normpath(src)) or "source")
    for rel, skeleton in merged.items():
        _write_skeleton(os.path.normpath(os.path.join(shadow, rel)), skeleton)
    return shadow


def _write_skeleton(path: str, skeleton: Skeleton) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, skeleton.size)
        view, pos = memoryview(skeleton.data), 0
        for offset, length in skeleton.runs:
            os.pwrite(fd, view[pos : pos + length], offset)
            pos += length
    finally:
        os.close(fd)
    os.utime(path, ns=(skeleton.mtime_ns, skeleton.mtime_ns))


def unshadow(plan: Plan, sources_from: tuple[str, str] | None) -> Plan:
    """The plan with sources planned from a header-only copy renamed to the real files."""
    if sources_from is None:
        return plan
    shadow, real = sources_from
    renamed = tuple(
        real + p[len(shadow) :] if p == shadow or p.startswith(shadow + os.sep) else p for p in plan.sources
    )
    return replace(plan, sources=renamed)


# ------------------------------------------------------------------------------ the driver


def alive_nodes(ray: Any) -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n.get("Alive")]


def resolve_nodes(ray: Any, names: Sequence[str]) -> dict[str, str]:
    """Placement names -> node ids: a node id, a node's IP, or a custom resource one node has."""
    nodes = alive_nodes(ray)
    resolved = {}
    for name in names:
        matches = [n["NodeID"] for n in nodes if n["NodeID"] == name]
        matches = matches or [n["NodeID"] for n in nodes if n.get("NodeManagerAddress") == name]
        matches = matches or [n["NodeID"] for n in nodes if name in n.get("Resources", {})]
        if len(matches) != 1:
            why = "no alive node" if not matches else f"{len(matches)} nodes"
            raise UsageError(f"placement: {why} answers to {name!r} (give a node id, an IP or a custom resource)")
        resolved[name] = matches[0]
    return resolved


def _ask(ray: Any, node_paths: Mapping[str, Sequence[str]], read: ReadOptions | None) -> dict[str, dict[str, Any]]:
    """Run ``probe`` pinned on each node with its paths; node id -> what it holds."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(num_cpus=0, max_retries=TASK_RETRIES)(probe)
    refs = {
        node: remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            list(paths), read
        )
        for node, paths in node_paths.items()
    }
    found = {}
    for node, ref in refs.items():
        try:
            found[node] = ray.get(ref)
        except ray.exceptions.RayError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, ReshardError):
                raise cause from None
            raise ReshardError(f"cannot ask node {node} what it holds: {first_line(exc)}") from None
    return found


def locate(
    ray: Any, plan: Plan, placement: str, read: ReadOptions | None
) -> tuple[dict[int, list[str]], dict[int, SourceFacts], dict[int, str], dict[str, str]]:
    """Where each needed source is: holders, facts, writers named by rank, node names for messages."""
    needed = sorted({c.source for f in plan.files for t in f.tensors for c in t.copies})
    paths = [plan.sources[i] for i in needed]
    writers: dict[int, str] = {}
    if placement == AUTO:
        names = {n["NodeID"]: f"{n.get('NodeManagerAddress', '?')}/{n['NodeID'][:8]}" for n in alive_nodes(ray)}
        asked = {node: paths for node in names}
    else:
        given = load_placement(placement)
        ids = resolve_nodes(ray, sorted(set(given.holders) | set(given.writers.values())))
        names = {node_id: name for name, node_id in ids.items()}
        asked = {}
        for path in paths:
            for name in given.nodes_holding(path):
                asked.setdefault(ids[name], []).append(path)
        writers = {rank: ids[name] for rank, name in given.writers.items()}
    found = _ask(ray, asked, read)
    holders: dict[int, list[str]] = {}
    facts: dict[int, SourceFacts] = {}
    for i, path in zip(needed, paths, strict=True):
        for node in sorted(asked):
            if path not in asked[node]:
                continue
            if path not in found[node]:
                if placement != AUTO:
                    raise UsageError(f"the placement says node {names[node]} holds it, but it does not", path)
                continue
            got = found[node][path]
            if i in facts and facts[i].identity() != got.identity():
                raise UsageError(f"the copies on nodes {names[holders[i][0]]} and {names[node]} differ", path)
            facts[i] = got
            holders.setdefault(i, []).append(node)
    return holders, facts, writers, names


def run_plan_nodes(
    ray: Any,
    plan: Plan,
    read: ReadOptions | None,
    write: WriteOptions,
    run: RunOptions,
    placement: str,
    in_flight: int = DEFAULT_IN_FLIGHT,
    on_schedule: Callable[[NodeRun], None] | None = None,
    sources_from: tuple[str, str] | None = None,
) -> NodeRun:
    """Write ``plan``'s outputs on the nodes holding their inputs; returns what crossed nodes.

    ``sources_from`` = (header-only copy, real source): the plan was made from ``plan_from_nodes``'
    copy; its sources are read at the real paths on the nodes.
    """
    plan = unshadow(plan, sources_from)
    holders, facts, writers, names = locate(ray, plan, placement, read)
    sched = schedule(plan, holders, facts, writers)
    if on_schedule is not None:
        on_schedule(NodeRun(sched, names, {}))
    # Each writer node runs the local executor on its outputs, with the driver's threads and memory bound.
    shipped = RunOptions(workers=run.workers, max_memory=run.max_memory, hash_outputs=run.hash_outputs)
    received = _drive(ray, plan, sched, facts, read, write, shipped, run, in_flight, names)
    return NodeRun(sched, names, received)


def _drive(
    ray: Any,
    plan: Plan,
    sched: Schedule,
    facts: Mapping[int, SourceFacts],
    read: ReadOptions | None,
    write: WriteOptions,
    shipped: RunOptions,
    run: RunOptions,
    in_flight: int,
    names: dict[str, str],
) -> dict[str, int]:
    """One task per writer node, all at once; results (checksums only) journaled as they come."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(num_cpus=1, max_retries=TASK_RETRIES)(node_job)
    pending: dict[Any, tuple[str, list[FilePlan]]] = {}
    for node in sorted(set(sched.writers)):
        files = [f for f, w in zip(plan.files, sched.writers, strict=True) if w == node]
        fetches = list(sched.fetches.get(node, ()))
        wanted = {f.source for f in fetches}
        strategy = NodeAffinitySchedulingStrategy(node, soft=False)
        ref = remote.options(scheduling_strategy=strategy).remote(
            plan.sources, files, fetches, {i: facts[i] for i in wanted}, read, write, shipped, in_flight, names
        )
        pending[ref] = (node, files)
    received: dict[str, int] = {}
    lost: BaseException | None = None  # a lost node: the other nodes finish (journaled), then it is raised
    try:
        while pending:
            [done], _ = ray.wait(list(pending), num_returns=1)
            node, files = pending.pop(done)
            try:
                digests, received[node] = ray.get(done)
            except ray.exceptions.RayError as exc:
                error = _node_error(ray, exc, node, names)
                if not getattr(error, KEEP_FINISHED, False):
                    raise error from None
                lost = lost or error
                continue
            for f, digest in zip(files, digests, strict=True):
                if run.on_file_written is not None:
                    run.on_file_written(f, digest)
                if run.progress is not None:
                    run.progress(f.nbytes)
    except BaseException:
        cancel_refs(ray, list(pending))
        raise
    if lost is not None:
        raise lost
    return received


def _node_error(ray: Any, exc: BaseException, node: str, names: Mapping[str, str]) -> BaseException:
    """A writer task's failure in one line; a node that is no longer alive is named as lost."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ReshardError):
        return task_error(exc)
    alive = {n["NodeID"] for n in alive_nodes(ray)}
    label = names.get(node, node)
    if node not in alive:
        lost = ReshardError(f"node {label} was lost during the run; finished outputs are kept: {RESUME} completes it")
        setattr(lost, KEEP_FINISHED, True)
        return lost
    return ReshardError(f"the task on node {label} failed: {type(exc).__name__}: {first_line(exc)}")


__all__ = [
    "AUTO",
    "DEFAULT_IN_FLIGHT",
    "TASK_RETRIES",
    "NodeRun",
    "Skeleton",
    "alive_nodes",
    "cancel_refs",
    "locate",
    "node_job",
    "plan_from_nodes",
    "probe",
    "read_runs",
    "resolve_nodes",
    "run_plan_nodes",
    "shadow_folder",
    "skeletons",
    "task_error",
    "unshadow",
]
