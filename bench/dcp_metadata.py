"""Reading a huge DCP ``.metadata``: time and memory per chunk, on a synthetic checkpoint of N chunks.

    python3 bench/dcp_metadata.py --chunks 1000000                 # 250 params x 4 096 ranks, a table
    python3 bench/dcp_metadata.py --chunks 1000000 --ranks 256 --json
    python3 bench/dcp_metadata.py --chunks 200000 --profile        # + cProfile top entries of the read
    python3 bench/dcp_metadata.py --chunks 1000000 --grid          # chunks cut along two axes (2-D grid)
    python3 bench/dcp_metadata.py --chunks 1000000 --torch ~/.cache/reshard/torch-venv/bin/python
    python3 bench/dcp_metadata.py --chunks 1000000 --rows plan --to-ranks 1024   # reshard plan 4 096 -> 1 024
    python3 bench/dcp_metadata.py --chunks 20480000 --rows read,plan --keep /tmp/dcp20m  # 5 000 params x 4 096

The checkpoint is what an FSDP / ``Shard(0)`` save of ``--chunks / --ranks`` parameters on
``--ranks`` ranks writes: every parameter (a ``(4 x ranks, 64)`` float32 tensor) cut into one chunk
per rank, each rank's chunks in its own ``__<r>_0.distcp``. ``--grid`` cuts each parameter along
both axes instead (a 2-D device mesh: ``Shard(0)`` x ``Shard(1)`` over ranks = a x b), which takes
the grid check rather than the one-axis interval check. The ``.metadata`` is written by reshard's own
writer (``reshard.formats.dcp.write_metadata``, the globals torch's has: pickle protocol 2, strings and
globals memoised), or with ``--torch PYTHON`` by torch's own classes and ``pickle.dump`` in that
interpreter (protocol 4, every object memoised: what ``FileSystemWriter`` writes; the row
``torch-load`` then times torch's own ``pickle.load`` of it, as ``FileSystemReader`` does). The data
files are sparse files of the right sizes (``.metadata`` is checked against their sizes, never read).

Each timing runs in a fresh process (the page cache warm: the pickle is read once beforehand), so
its peak RSS is its own:

* ``read``: ``read_dcp_metadata``, the allowlisting unpickler, the records and every check (chunks
  inside their tensor, no overlap, no gap, every item inside its file);
* ``chunks``: then walking every chunk record once (``tensor.chunks``, built lazily on first use);
* ``open``: ``reshard.sources.dcp.open_dcp``, the planning facts (one ``SourceTensor`` per chunk);
* ``plan``: what ``reshard plan SRC DST --output-format dcp --dcp-ranks M`` plans (``--to-ranks M``,
  default 1 024): the ``.metadata`` read, the chunks planned from their boxes (``ops.chunked.boxed_dcp``)
  and the plan's totals (its files stay lazy; the output ``.metadata`` is pickled only when written).

``cpu`` is the process's CPU time (what the machine's other load inflates least), ``seconds`` its
wall time; ``bytes/chunk`` is the peak RSS above what the process held when the clock started (reshard
and numpy imported), per chunk.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import math
import os
import pstats
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import overload

import numpy as np

from reshard import dtypes
from reshard.formats import dcp

ROWS_PER_RANK, COLUMNS = 4, 64


def grid_of(ranks: int) -> tuple[int, int]:
    """The most square a x b = ranks."""
    a = math.isqrt(ranks)
    while ranks % a:
        a -= 1
    return a, ranks // a


class _Tensors(Sequence[dcp.TensorMeta]):
    """The parameters, each made from its columns when asked for (and dropped after): the writer's
    chunk records of 20 M chunks would not fit beside the pickle it writes."""

    def __init__(self, params: int, ranks: int, grid: bool) -> None:
        self.params, self.ranks = params, ranks
        a, b = grid_of(ranks) if grid else (ranks, 1)
        self.shape = (ROWS_PER_RANK * a, COLUMNS * b)
        r = np.arange(ranks, dtype=np.int64)
        self.offsets = np.stack([(r // b) * ROWS_PER_RANK, (r % b) * COLUMNS], axis=1)
        self.sizes = np.tile(np.array([ROWS_PER_RANK, COLUMNS], dtype=np.int64), (ranks, 1))
        self.files = tuple(f"__{k}_0.distcp" for k in range(ranks))

    def __len__(self) -> int:
        return self.params

    @overload
    def __getitem__(self, p: int) -> dcp.TensorMeta: ...
    @overload
    def __getitem__(self, p: slice) -> Sequence[dcp.TensorMeta]: ...
    def __getitem__(self, p: int | slice) -> dcp.TensorMeta | Sequence[dcp.TensorMeta]:
        if isinstance(p, slice):
            return [self[k] for k in range(*p.indices(self.params))]
        if not 0 <= p < self.params:
            raise IndexError(p)
        starts = np.full(self.ranks, p * LENGTH, dtype=np.int64)
        lengths = np.full(self.ranks, LENGTH, dtype=np.int64)
        ids = np.arange(self.ranks, dtype=np.int32)
        table = dcp.ChunkTable(self.offsets, self.sizes, self.files, ids, starts, lengths)
        return dcp.TensorMeta(f"layers.{p}.weight", dtypes.FLOAT32, self.shape, table)


LENGTH = ROWS_PER_RANK * COLUMNS * 4 + 1024  # an archive's size, roughly


def make(folder: str, chunks: int, ranks: int, grid: bool) -> None:
    params = max(1, chunks // ranks)
    for r in range(ranks):
        with open(os.path.join(folder, f"__{r}_0.distcp"), "wb") as fh:
            fh.truncate(params * LENGTH)
    dcp.write_metadata(folder, _Tensors(params, ranks, grid))


_TORCH_MAKE = """
import os, pickle, sys
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata)
folder, params, ranks, a, b, rows, columns, length = sys.argv[1], *map(int, sys.argv[2:])
def gathered(value):  # what the coordinator holds after gather_object: each rank's objects unpickled
    return pickle.loads(pickle.dumps(value))
entries, storage = {}, {}
plans = []
for r in range(ranks):
    offset = lambda: torch.Size([(r // b) * rows, (r % b) * columns])
    plans.append(gathered([(f"layers.{p}.weight", ChunkStorageMetadata(offset(), torch.Size([rows, columns])))
                           for p in range(params)]))
for plan in plans:
    for fqn, chunk in plan:
        if fqn not in entries:
            shape = torch.Size([rows * a, columns * b])
            entries[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), shape, [])
        entries[fqn].chunks.append(chunk)
for r in range(ranks):
    path = f"__{r}_0.distcp"  # one name per data file, as FileSystemWriter gives each of its items
    offsets = torch.Size([(r // b) * rows, (r % b) * columns])
    results = [(MetadataIndex(f"layers.{p}.weight", offsets, r), _StorageInfo(path, p * length, length))
               for p in range(params)]
    storage.update(gathered(results))
with open(os.path.join(folder, ".metadata"), "wb") as fh:
    pickle.dump(Metadata(entries, planner_data={k: (k,) for k in entries}, storage_data=storage), fh)
"""

_TORCH_LOAD = """
import json, pickle, resource, sys, time
import torch.distributed.checkpoint  # noqa: F401
with open(sys.argv[1], "rb") as fh:
    raw = fh.read()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start, cpu = time.perf_counter(), time.process_time()
pickle.loads(raw)
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": seconds, "cpu": cpu, "rss_kib": peak - base}))
"""


def make_with_torch(python: str, folder: str, chunks: int, ranks: int, grid: bool) -> None:
    """The same checkpoint's ``.metadata`` pickled by torch itself (its classes, ``pickle.dump``), its
    objects shared as a save on ``ranks`` processes shares them: each rank's plan and write results
    reach the coordinator pickled (``gather_object``), so a tensor's name is written out again in every
    rank's storage entries and a data file's name once per rank, storage rank by rank."""
    params = max(1, chunks // ranks)
    a, b = grid_of(ranks) if grid else (ranks, 1)
    length = ROWS_PER_RANK * COLUMNS * 4 + 1024
    numbers = [params, ranks, a, b, ROWS_PER_RANK, COLUMNS, length]
    subprocess.run([python, "-c", _TORCH_MAKE, folder, *map(str, numbers)], check=True)
    for r in range(ranks):
        with open(os.path.join(folder, f"__{r}_0.distcp"), "wb") as fh:
            fh.truncate(params * length)


def child(folder: str, what: str, profile: bool, to_ranks: int = 1024) -> dict[str, float]:
    """Run in a fresh process: time ``what`` once, and the peak RSS it added."""
    import numpy  # noqa: F401  (the baseline RSS includes numpy, which the reader imports anyway)

    from reshard import api
    from reshard.sources.dcp import open_dcp  # imported before the clock starts

    with open(os.path.join(folder, dcp.METADATA_NAME), "rb") as fh:
        while fh.read(16 << 20):  # into the page cache, not into this process (its peak stays the baseline)
            pass
    base = _rss_now_kib()  # and the peak set back to it: what imports left behind is not the row's
    profiler = cProfile.Profile() if profile else None
    start, cpu = time.perf_counter(), time.process_time()
    if profiler:
        profiler.enable()
    count = 0
    if what == "open":
        source = open_dcp(folder)
        count = sum(len(f.tensors) for f in source.files.values())
    elif what == "plan":
        out = api.OutputSpec(format="dcp", dcp_ranks=to_ranks)
        dry = api.Destination(dry_run=True)
        report = api.transform(folder, os.path.join(folder, "planned"), None, None, output=out, destination=dry)
        count = report.plan.summary()["copies"]
    else:
        meta = dcp.read_dcp_metadata(folder)
        if what == "chunks":
            count = sum(len(t.chunks) for t in meta.tensors.values())
    if profiler:
        profiler.disable()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    if profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
        print(out.getvalue(), file=sys.stderr)
    peak = _status_kib("VmHWM") if base is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    base = base if base is not None else 0
    return {"seconds": seconds, "cpu": cpu, "rss_kib": peak - base, "count": count}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))


def _rss_now_kib() -> int | None:
    """The resident size now, with the kernel's peak counter reset to it (Linux ``clear_refs`` 5);
    None where that is not there (the peak then counts from the interpreter's start)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return _status_kib("VmRSS")
    except OSError:
        return None


def run_child(folder: str, what: str, profile: bool, to_ranks: int = 1024) -> dict[str, float]:
    args = [sys.executable, __file__, "--child", what, "--folder", folder, "--to-ranks", str(to_ranks)]
    args += ["--profile"] if profile else []
    done = subprocess.run(args, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=1_000_000)
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--grid", action="store_true", help="chunks cut along two axes")
    parser.add_argument("--rows", default="read,chunks,open", help="comma-separated: read, chunks, open, plan")
    parser.add_argument("--to-ranks", type=int, default=1024, help="the plan row's DCP rank count")
    parser.add_argument("--torch", metavar="PYTHON", help="pickle the metadata with torch in this interpreter")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--keep", metavar="FOLDER", help="make the checkpoint here and keep it; reuse it if there")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.folder, args.child, args.profile, args.to_ranks)))
        return
    with contextlib.ExitStack() as stack:
        folder = args.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="dcp-metadata-"))
        start = time.perf_counter()
        if args.keep and os.path.exists(os.path.join(folder, dcp.METADATA_NAME)):
            pass  # made by an earlier run with the same --chunks/--ranks (its figures assume them)
        elif args.torch:
            os.makedirs(folder, exist_ok=True)
            make_with_torch(args.torch, folder, args.chunks, args.ranks, args.grid)
        else:
            os.makedirs(folder, exist_ok=True)
            make(folder, args.chunks, args.ranks, args.grid)
        made = time.perf_counter() - start
        chunks = max(1, args.chunks // args.ranks) * args.ranks
        size = os.path.getsize(os.path.join(folder, dcp.METADATA_NAME))
        results = {"chunks": chunks, "ranks": args.ranks, "metadata_bytes": size, "write_seconds": made}
        rows = args.rows.split(",") + (["torch-load"] if args.torch else [])
        for what in rows:
            if what == "torch-load":
                meta = os.path.join(folder, dcp.METADATA_NAME)
                done = subprocess.run([args.torch, "-c", _TORCH_LOAD, meta], check=True, stdout=subprocess.PIPE)
                results[what] = json.loads(done.stdout)
            else:
                results[what] = run_child(folder, what, args.profile, args.to_ranks)
    if args.json:
        print(json.dumps(results))
        return
    writer = "torch" if args.torch else "reshard"
    print(f"{chunks:,} chunks on {args.ranks} ranks; .metadata by {writer}, {size / 1e6:.1f} MB, made in {made:.1f} s")
    print("| row | seconds | cpu | cpu µs/chunk | peak RSS added | bytes/chunk |")
    print("|---|---:|---:|---:|---:|---:|")
    for what in rows:
        row = results[what]
        kib = row["rss_kib"]
        print(
            f"| {what} | {row['seconds']:.2f} | {row['cpu']:.2f} | {row['cpu'] / chunks * 1e6:.2f} "
            f"| {kib / 1024:.0f} MiB | {kib * 1024 / chunks:.0f} |"
        )


if __name__ == "__main__":
    main()
