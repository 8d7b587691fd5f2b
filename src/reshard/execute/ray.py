"""Run a plan on a Ray cluster: output files become tasks, on nodes with or without a shared disk.

Why this shape:

* **The plan is plain data.** A ``Plan`` pickles (lazy ``RankTensors`` pickle as tuples), so the
  driver ships each task a small plan holding only its own output files (``FilePlan``) and the
  ``sources`` table, and the task runs the very same ``local.run_file`` as the local executor. One
  byte-copying engine means Ray outputs are byte-identical to local ones by construction.
* **Shared disk (default).** Tasks open sources and write outputs at their own paths (a network
  filesystem mounted on every node). Only the plan travels through Ray.
* **No shared disk** (``shared_disk=False``). Each task declares the source files its copies read
  (``plan.sources`` of its copies). The driver puts each needed source file into the Ray object
  store once (from a read-only memory map, so the driver holds no second copy), the task receives
  them as object refs, writes them to a node-local temporary folder, runs ``run_file`` with the
  source and output paths remapped there, and returns the output file's bytes; the driver writes
  them atomically to the destination (so journal, manifest and roll-back work as locally).
* **Bounded memory, honestly.** At most ``window`` tasks are in flight (default: the cluster's
  CPUs), and a source stays in the object store only while a submitted task still needs it. So
  the object store holds at most the sources of ``window`` tasks plus their outputs, *whole
  files*: a task needs node-local disk and object-store room for its sources plus its outputs.
  Ray spills to disk when the store is full, which is slow but safe. The next step would be
  chunked streaming (sources sent as byte ranges of only the tensors the task reads, outputs
  returned in chunks). Each task stages strided boxes in at most ``max_memory / workers`` bytes,
  as a local worker thread does.
* **Errors stay one line.** A task's ``ReshardError`` is re-raised on the driver as the same
  class with the same message; a lost worker or node becomes a ``ReshardError``. On the first
  failure the remaining tasks are cancelled and awaited, so roll-back never races a late rename.

Every node needs reshard (same version) and its dependencies installed; keys for encrypted
inputs/outputs travel inside the task arguments (Ray's object store), like the plan. An address
where no cluster listens is refused after a plain TCP connect (``probe_address``): Ray itself keeps
retrying the connection for minutes. A process whose Ray is already initialized runs on that cluster
(``ray.init`` holds for the process); an address naming another one is refused rather than ignored
(``check_running``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from reshard.errors import ReshardError, UnsupportedError, UsageError
from reshard.execute import dequant, local
from reshard.execute.digest import hash_pool
from reshard.execute.options import DEFAULT_IN_FLIGHT, RayOptions, RunOptions, WriteOptions
from reshard.execute.ray_nodes import NodeRun, plan_from_nodes, run_plan_nodes
from reshard.execute.ray_nodes import cancel_refs as _cancel
from reshard.execute.ray_nodes import task_error as _task_error
from reshard.formats import base
from reshard.plan import FilePlan, Plan
from reshard.plan.model import QuantizedSource
from reshard.plan.validate import validate_plan
from reshard.sources import ReadOptions, open_checkpoint
from reshard.text import first_line

TEMP_PREFIX = "reshard-ray-"  # node-local folder of one task (no shared disk), removed when it ends


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UsageError('the Ray executor needs Ray: python3 -m pip install "reshard[ray]"') from None
    return ray


@contextlib.contextmanager
def _cluster(address: str | None) -> Iterator[Any]:
    """The running Ray session, or one started (and shut down) for this run."""
    ray = _ray()
    if ray.is_initialized():
        check_running(ray, address)
        yield ray
        return
    probe_address(address if address is not None else os.environ.get("RAY_ADDRESS"))
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    except Exception as exc:  # ConnectionError, RuntimeError, ValueError: all "cannot reach it"
        raise UsageError(f"cannot start or reach Ray: {first_line(exc)}", address) from None
    try:
        yield ray
    finally:
        ray.shutdown()


PROBE_SECONDS = 10.0  # a cluster head answers a TCP connect at once; Ray itself would retry for minutes
RAY_DEFAULT_PORT = 6379


def probe_address(address: str | None, timeout: float = PROBE_SECONDS) -> None:
    """Refuse, in one line and within ``timeout``, a cluster address where nothing listens.

    ``ray.init`` keeps retrying an address that does not answer (about 13 minutes here), so the
    head's port is tried first with a plain TCP connect. ``None``, ``auto`` and ``local`` name no
    remote head and are left to Ray.
    """
    if not address or address in ("auto", "local"):
        return
    host, port = _host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except TimeoutError:
        raise UsageError(f"no Ray cluster answers there (no reply within {timeout:.0f} s)", address) from None
    except OSError as exc:
        raise UsageError(f"no Ray cluster answers there ({exc.strerror or exc})", address) from None


def _host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (a scheme such as ``ray://`` and brackets around an IPv6 host dropped; no port: Ray's)."""
    target = address.split("://", 1)[-1].rstrip("/")
    host, _, port_text = target.rpartition(":") if ":" in target else (target, "", str(RAY_DEFAULT_PORT))
    try:
        return host.strip("[]"), int(port_text)
    except ValueError:
        raise UsageError("not a Ray address: expected HOST:PORT", address) from None


def check_running(ray: Any, address: str | None) -> None:
    """Refuse ``address`` when this process's Ray is already initialized to another cluster.

    ``ray.init`` holds for the whole process, so the run goes to the running cluster whatever the
    address says; a user who names one expects that one. No address and ``auto`` take the running
    cluster; a ``ray://`` address is taken while a Ray client session is connected (its server is not
    the cluster's own address, so the two cannot be compared); any other address must be the running
    cluster's (a loopback host stands for this machine's address).

    Raises:
        UsageError: Another cluster named, saying which one the process is on and the two ways out.
    """
    if not address or address == "auto":
        return
    if address.startswith("ray://") and _client_connected(ray):
        return
    running = _running_address(ray)
    if running is not None and _same_cluster(ray, address, running):
        return
    on = f" (to the cluster at {running})" if running else ""
    raise UsageError(
        f"Ray is already initialized in this process{on}, so the run cannot go to {address}: give no address "
        "(RayOptions(address=None)) to run there, or call ray.shutdown() first"
    )


def _running_address(ray: Any) -> str | None:
    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:  # a client session or an older Ray: unknown
        return None


def _client_connected(ray: Any) -> bool:
    try:
        return bool(ray.util.client.ray.is_connected())
    except Exception:
        return False


def _same_cluster(ray: Any, address: str, running: str) -> bool:
    (host, port), (running_host, running_port) = _host_port(address), _host_port(running)
    if port != running_port:
        return False
    given, there = _resolved(host), _resolved(running_host)
    if given == there:
        return True
    try:
        here = str(ray.util.get_node_ip_address())
    except Exception:
        return False
    return given.startswith("127.") and there == here


def _resolved(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def _groups(files: Sequence[FilePlan], max_tasks: int | None) -> list[list[FilePlan]]:
    """Consecutive output files per task (neighbouring ranks tend to read the same sources)."""
    count = len(files) if max_tasks is None else max(1, min(max_tasks, len(files)))
    size, extra = divmod(len(files), count) if count else (0, 0)
    groups, start = [], 0
    for i in range(count):
        stop = start + size + (1 if i < extra else 0)
        groups.append(list(files[start:stop]))
        start = stop
    return [g for g in groups if g]


def _needed(plan: Plan, files: Sequence[FilePlan]) -> list[int]:
    """Indices into ``plan.sources`` of the files the copies of ``files`` read (and, for a tensor computed
    while copying, the files of its block scale or its planned weight: ``_with_quantized_sources``)."""
    read = {c.source for f in files for t in f.tensors for c in t.copies}
    named = {(plan.sources[c.source], c.tensor) for f in files for t in f.tensors for c in t.copies}
    index = {p: i for i, p in enumerate(plan.sources)}
    for q in plan.quantized:
        if (q.path, q.name) in named:
            read.update(index[p] for p in (q.path, q.scale_path, *q.assembled_sources))
    return sorted(read)


def _with_quantized_sources(plan: Plan) -> Plan:
    """``plan`` whose ``sources`` also list every file its computed tensors read (a scale in another
    Hugging Face shard, say), so a task without a shared disk is sent them."""
    extra = [p for q in plan.quantized for p in (q.path, q.scale_path, *q.assembled_sources)]
    missing = tuple(dict.fromkeys(p for p in extra if p not in plan.sources))
    return replace(plan, sources=plan.sources + missing) if missing else plan


def _remapped(quantized: tuple[QuantizedSource, ...], paths: dict[str, str]) -> tuple[QuantizedSource, ...]:
    """The computed tensors' records with their files at a task's node-local copies."""
    return tuple(
        replace(
            q,
            path=paths.get(q.path, q.path),
            scale_path=paths.get(q.scale_path, q.scale_path),
            assembled_sources=tuple(paths.get(p, p) for p in q.assembled_sources),
        )
        for q in quantized
    )


def _open(read: ReadOptions | None) -> local.Opener:
    return lambda path: open_checkpoint(path, read)


TaskResult = tuple[list[str | None], list[np.ndarray] | None]  # checksum per file, file bytes (no shared disk)


def _task(
    sources: tuple[str, ...],
    files: list[FilePlan],
    read: ReadOptions | None,
    write: WriteOptions,
    run: RunOptions,
    budget: int,
    needed: list[int],
    quantized: tuple[QuantizedSource, ...],
    *blobs: np.ndarray,
) -> TaskResult:
    """One Ray task: write ``files``; with ``blobs`` (no shared disk) work in a node-local folder.

    ``quantized``: the plan's tensors computed while copying (``--dequantize``/``--quantize``), read
    through ``dequant.wrapped_opener`` as the local executor reads them. Each file is hashed on the
    node while it is written (``run.hash_outputs``), so the driver does not read the outputs back for
    the manifest.
    """
    if not blobs:
        return _run_files(Plan("ray", sources, tuple(files), quantized=quantized), read, write, run, budget), None
    with tempfile.TemporaryDirectory(prefix=TEMP_PREFIX) as tmp:
        remapped = list(sources)
        for i, blob in zip(needed, blobs, strict=True):
            remapped[i] = os.path.join(tmp, f"src{i}-{os.path.basename(sources[i])}")
            with open(remapped[i], "wb") as fh:
                fh.write(blob.data)
        outs = [
            replace(f, path=os.path.join(tmp, f"out{k}-{os.path.basename(f.path)}"), tensors=tuple(f.tensors))
            for k, f in enumerate(files)
        ]
        moved = _remapped(quantized, {sources[i]: remapped[i] for i in needed})
        digests = _run_files(Plan("ray", tuple(remapped), tuple(outs), quantized=moved), read, write, run, budget)
        return digests, [np.fromfile(f.path, dtype=np.uint8) for f in outs]


def _run_files(
    plan: Plan, read: ReadOptions | None, write: WriteOptions, run: RunOptions, budget: int
) -> list[str | None]:
    cache = local.SourceCache(dequant.wrapped_opener(plan, _open(read)))
    try:
        validate_plan(plan, lambda i, name: cache.shape(plan.sources[i], name))  # source bounds, on the node
        with contextlib.ExitStack() as stack:
            hashers = stack.enter_context(hash_pool()) if run.hash_outputs else None
            return [local.run_file(f, plan, cache, write, run, budget, 1, hashers) for f in plan.files]
    finally:
        cache.close()


def _put_source(ray: Any, path: str) -> Any:
    """One whole source file into the object store, copied from a read-only map."""
    try:
        size = os.path.getsize(path)
        data = np.memmap(path, dtype=np.uint8, mode="r") if size else np.empty(0, dtype=np.uint8)
    except OSError as exc:
        raise UsageError(f"cannot read the source: {exc.strerror or exc}", path) from None
    try:
        return ray.put(data)
    finally:
        del data


def _write_output(path: str, data: np.ndarray) -> None:
    try:
        base.write_whole(path, data.data)
    except OSError as exc:
        raise ReshardError(f"write failed: {exc.strerror or exc}", path) from exc  # errno kept: a full disk


def run_plan_ray(
    plan: Plan,
    read: ReadOptions | None = None,
    write: WriteOptions | None = None,
    run: RunOptions | None = None,
    *,
    address: str | None = None,
    shared_disk: bool = True,
    max_tasks: int | None = None,
    placement: str | None = None,
    in_flight: int = DEFAULT_IN_FLIGHT,
    on_nodes: Callable[[NodeRun], None] | None = None,
    sources_from: tuple[str, str] | None = None,
) -> None:
    """Execute every output of ``plan`` as Ray tasks; text outputs are written last by the driver.

    ``run.progress`` / ``on_start`` / ``on_file_written`` are called on the driver (per finished
    task), never shipped to the nodes. With ``placement`` (``"auto"`` or a placement file) the
    sources are on the nodes' own disks: ``execute.ray_nodes`` runs it, and ``on_nodes`` is called
    with the schedule before any byte moves and with the bytes each node received at the end.
    """
    write, run = write or WriteOptions(), run or RunOptions()
    if plan.quantized:
        if placement is not None:
            raise UnsupportedError(
                "--dequantize/--quantize on Ray with the sources on the nodes' own disks (a placement) is not "
                "supported: use a shared disk, shared_disk=False, or the local executor"
            )
        dequant.check_scales(plan, _open(read))  # a NaN or infinite scale: refused before any task starts
        plan = _with_quantized_sources(plan)
    if placement is not None:
        if run.on_start is not None:
            run.on_start(sum(f.nbytes for f in plan.files))
        with _cluster(address) as ray:
            done = run_plan_nodes(ray, plan, read, write, run, placement, in_flight, on_nodes, sources_from)
        if on_nodes is not None:
            on_nodes(done)
        local.write_texts(plan)
        return
    shipped = RunOptions(workers=1, max_memory=run.max_memory, hash_outputs=run.hash_outputs)
    budget = max(mmap.PAGESIZE, run.max_memory // max(1, run.workers))
    if run.on_start is not None:
        run.on_start(sum(f.nbytes for f in plan.files))
    with _cluster(address) as ray:
        remote = ray.remote(num_cpus=1, max_retries=0)(_task)
        window = max(1, int(ray.cluster_resources().get("CPU", 1)))
        _drive(
            ray, remote, plan, _groups(plan.files, max_tasks), read, write, shipped, run, budget, shared_disk, window
        )
    local.write_texts(plan)


def _drive(
    ray: Any,
    remote: Any,
    plan: Plan,
    groups: list[list[FilePlan]],
    read: ReadOptions | None,
    write: WriteOptions,
    shipped: RunOptions,
    run: RunOptions,
    budget: int,
    shared_disk: bool,
    window: int,
) -> None:
    """Submit groups (at most ``window`` in flight), collect results, keep sources only while needed."""
    needs = [[] if shared_disk else _needed(plan, g) for g in groups]
    users: dict[int, int] = {}
    for n in needs:
        for i in n:
            users[i] = users.get(i, 0) + 1
    refs: dict[int, Any] = {}
    pending: dict[Any, int] = {}
    nxt = 0
    try:
        while nxt < len(groups) or pending:
            while nxt < len(groups) and len(pending) < window:
                for i in needs[nxt]:
                    if i not in refs:
                        refs[i] = _put_source(ray, plan.sources[i])
                blobs = [refs[i] for i in needs[nxt]]
                args = (plan.sources, groups[nxt], read, write, shipped, budget, needs[nxt], plan.quantized)
                ref = remote.remote(*args, *blobs)
                pending[ref] = nxt
                nxt += 1
            [done], _ = ray.wait(list(pending), num_returns=1)
            k = pending.pop(done)
            _finish(ray, done, groups[k], run)
            for i in needs[k]:
                users[i] -= 1
                if users[i] == 0:
                    del refs[i]  # the object store may free it
    except BaseException:
        _cancel(ray, list(pending))
        raise


def _finish(ray: Any, ref: Any, files: list[FilePlan], run: RunOptions) -> None:
    try:
        result = ray.get(ref)
    except ray.exceptions.RayError as exc:
        raise _task_error(exc) from None
    digests, contents = result
    for k, f in enumerate(files):
        if contents is not None:
            _write_output(f.path, contents[k])
        if run.on_file_written is not None:
            run.on_file_written(f, digests[k])
        if run.progress is not None:
            run.progress(f.nbytes)


def source_from_nodes(src: str, run: RayOptions, read: ReadOptions | None = None) -> tuple[str, RayOptions]:
    """Plan without the source on this machine: a header-only copy of ``src`` made from the nodes.

    Args:
        src: The source as the nodes hold it (rank folders spread over them, say).
        run: Ray options with a ``placement`` (``"auto"``: every alive node is asked).
        read: How the sources are read (decryption is refused: encrypted files have no header-only copy).

    Returns:
        The copy's path, to give an operation as its source, and ``run`` set to read the real files.

    Raises:
        UsageError: No placement, a placement that names no alive node, or nothing under ``src``.

    Example:
        from reshard import api
        from reshard.execute.ray import RayOptions, source_from_nodes
        shadow, run = source_from_nodes("/data/ckpt", RayOptions(placement="auto"))
        api.transform(shadow, "/data/out", "s8.ckpt", "s4.ckpt", run=run)
    """
    if run.placement is None:
        raise UsageError("planning from the nodes needs a placement (auto or a file)")
    with _cluster(run.address) as ray:
        shadow = plan_from_nodes(ray, src, run.placement, read)
    return shadow, replace(run, sources_from=(shadow, os.path.abspath(src)))


def _never_opened(path: str) -> base.TensorIndex:
    raise AssertionError(f"the Ray driver opens no source ({path})")


NO_OPENER: local.Opener = _never_opened  # the driver's opener under Ray: tasks open their sources on the nodes


def runner(read: ReadOptions | None, run: RunOptions) -> Callable[[Plan, WriteOptions, RunOptions], None]:
    """How the run-recording layer executes a plan on Ray: ``runner(plan, write, run)`` writes the
    outputs still to write as Ray tasks (journal, manifest and roll-back stay on the driver, with
    the caller). ``run`` says where and how (a ``RayOptions``; plain ``RunOptions`` runs on a
    local Ray with a shared disk)."""
    ray_run = run if isinstance(run, RayOptions) else RayOptions()

    def run_on_ray(todo: Plan, todo_write: WriteOptions, todo_run: RunOptions) -> None:
        run_plan_ray(
            todo,
            read,
            todo_write,
            todo_run,
            address=ray_run.address,
            shared_disk=ray_run.shared_disk,
            max_tasks=ray_run.max_tasks,
            placement=ray_run.placement,
            in_flight=ray_run.in_flight,
            on_nodes=ray_run.on_nodes,
            sources_from=ray_run.sources_from,
        )

    return run_on_ray


__all__ = [
    "NO_OPENER",
    "PROBE_SECONDS",
    "RayOptions",
    "check_running",
    "probe_address",
    "run_plan_ray",
    "runner",
    "source_from_nodes",
]
