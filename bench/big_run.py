"""A model larger than this machine's RAM: transform 8 -> 4 ranks (.safetensors), against ``cp -r``.

    python3 bench/big_run.py --size 27G --work /work/big-bench      # ~27 GB fp32 training checkpoint
    python3 bench/big_run.py --size 64M --work /tmp/big --no-settle # the harness's smoke test

``bench/run.py`` builds every input with reshard from a full model held in RAM and keeps many
copies (~8.5 model sizes on disk); neither works for a model larger than RAM on a disk that holds
about two copies of it. This script writes only what the run needs, and writes it lean:

* **Inputs, layer by layer.** The 8 source rank files (``rank_<r>/checkpoint_<r>.safetensors``,
  2 pipeline stages x dp2 x mp2, weights and fp32 Adam moments optimizer-sharded over dp, the tied
  embedding in both stages, as ``bench/run.py``'s model) are written directly: each rank's header is
  computed first (``safetensors_layout``), then each tensor's slice is generated from a formula of
  its full-tensor coordinates and written in place. Nothing larger than one slice is in memory.
* **The run.** ``reshard transform`` (the CLI with its defaults: workers, memory bound, manifest)
  in its own process, page cache cold, wall time and peak RSS measured as ``bench/run.py`` does
  (``bench/measure.py``).
* **Verified.** Every output tensor is compared with the formula at its destination box, chunk by
  chunk, after timing.
* **``cp -r`` of the same output**, after the inputs are deleted (the disk holds two model sizes,
  not three), page cache cold. Then everything this script made is deleted.

Free disk is checked first: two model sizes plus ``--headroom`` (default 5 GB) must be free.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
import threading
import time
from typing import Any

import numpy as np
import psutil

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
sys.path.insert(1, os.path.join(os.path.dirname(BENCH_DIR), "src"))

import measure  # noqa: E402
import versions  # noqa: E402

from reshard import dtypes, layout  # noqa: E402
from reshard.formats.base import TensorSpec  # noqa: E402
from reshard.formats.safetensors import read_safetensors, safetensors_layout  # noqa: E402
from reshard.formats.strategy import merge_pipeline_strategies  # noqa: E402
from reshard.layout import ParamLayout  # noqa: E402
from reshard.synthetic import ModelShape, stage_strategies, write_stage_strategies  # noqa: E402
from reshard.text import parse_size  # noqa: E402

HIDDEN = 1536  # largest tensor: the embedding, 16 x hidden x hidden fp32 = 151 MB
VOCAB_PER_HIDDEN, FFN_PER_HIDDEN = 16, 4
SRC = (2, 2, 2)  # dp, mp, pp of the 8 source ranks (optimizer shards over dp)
DST = (1, 2, 2)  # of the 4 destination ranks
PATTERN = 4093  # values are (row pattern + column) < 2 x PATTERN: exact in float32
VERIFY_ROWS = 4096  # rows compared at once (bounded memory while verifying)


def choose_shape(target: int, hidden: int = HIDDEN) -> ModelShape:
    """The layer count whose fp32 training checkpoint (weights + 2 Adam moments) is about ``target``."""

    def nbytes(layers: int) -> int:
        return 12 * ModelShape(VOCAB_PER_HIDDEN * hidden, hidden, FFN_PER_HIDDEN * hidden, layers).param_count()

    base, per_layer = nbytes(2) - 2 * (nbytes(3) - nbytes(2)), nbytes(3) - nbytes(2)
    layers = max(2, (target - base) // per_layer)  # at most ``target``
    return ModelShape(VOCAB_PER_HIDDEN * hidden, hidden, FFN_PER_HIDDEN * hidden, layers)


def values(index: int, box: tuple[tuple[int, int], ...]) -> np.ndarray:
    """The content of ``box`` of tensor number ``index``: v[i, j] = (7 i + 131 index) % PATTERN + j % PATTERN."""
    rows = ((np.arange(box[0][0], box[0][1], dtype=np.int64) * 7 + 131 * index) % PATTERN).astype(np.float32)
    if len(box) == 1:
        return rows
    cols = (np.arange(box[1][0], box[1][1], dtype=np.int64) % PATTERN).astype(np.float32)
    return np.add.outer(rows, cols)


def tensor_numbers(shape: ModelShape) -> dict[str, int]:
    """Every tensor name of the training checkpoint -> its number in the value formula."""
    names = list(shape.params())
    names += [p + n for p in ("adam_m.", "adam_v.") for n in shape.params()]
    return {name: i for i, name in enumerate(names)}


def write_rank(path: str, stage_layouts: dict[str, ParamLayout], local: int, shape: ModelShape) -> int:
    """One source rank's safetensors file, slice by slice; returns its size."""
    fulls = {**shape.params()}
    numbers = tensor_numbers(shape)

    def full_of(name: str) -> tuple[int, ...]:
        return fulls[name.split(".", 1)[1] if name.startswith("adam_") else name][0]

    boxes = {name: layout.rank_box(p, full_of(name), local) for name, p in stage_layouts.items()}
    specs = [TensorSpec(n, dtypes.FLOAT32, tuple(b - a for a, b in box)) for n, box in boxes.items()]
    file_layout = safetensors_layout(specs)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, file_layout.size)
        for offset, data in file_layout.framing:
            os.pwrite(fd, data, offset)
        for name in file_layout.order:
            ((offset, nbytes),) = file_layout.placements[name]
            data = values(numbers[name], boxes[name])
            assert data.nbytes == nbytes
            os.pwrite(fd, memoryview(data).cast("B"), offset)
    finally:
        os.close(fd)
    return file_layout.size


def generate(root: str, shape: ModelShape) -> tuple[str, str, str, float]:
    """Source rank folders and both merged strategies under ``root``; (src, src strategy, dst strategy, seconds)."""
    start = time.perf_counter()
    strategies = {}
    for label, (dp, mp, pp) in (("src", SRC), ("dst", DST)):
        stages = stage_strategies(shape, dp, mp, pp, opt_shard=dp > 1)
        folder = os.path.join(root, f"stages_{label}")
        write_stage_strategies(folder, stages, dp * mp)
        strategies[label] = merge_pipeline_strategies(folder, os.path.join(root, f"strategy_{label}.ckpt"))
        if label == "src":
            src_stages = stages
    src = os.path.join(root, "src")
    per_stage = SRC[0] * SRC[1]
    for rank in range(per_stage * SRC[2]):
        stage_layouts = dict(src_stages[rank // per_stage].layouts)
        path = os.path.join(src, f"rank_{rank}", f"checkpoint_{rank}.safetensors")
        write_rank(path, stage_layouts, rank % per_stage, shape)
    return src, strategies["src"], strategies["dst"], time.perf_counter() - start


def verify(out: str, dst_strategy: str, shape: ModelShape) -> int:
    """Compare every output tensor with the formula at its destination box; returns tensors checked."""
    from reshard.formats.strategy import load_strategy

    lmaps = {}
    sf = load_strategy(dst_strategy)
    per_stage = DST[0] * DST[1]
    numbers = tensor_numbers(shape)
    fulls = shape.params()
    checked = 0
    for rank in range(per_stage * DST[2]):
        if rank // per_stage not in lmaps:
            lmaps[rank // per_stage] = layout.layout_map(sf, rank)
        lmap = lmaps[rank // per_stage]
        path = os.path.join(out, f"rank_{rank}", f"checkpoint_{rank}.safetensors")
        with read_safetensors(path) as index:
            entries = dict(index.entries)
        data = np.memmap(path, dtype=np.uint8, mode="r")
        for name, entry in entries.items():
            base = name.split(".", 1)[1] if name.startswith("adam_") else name
            box = layout.rank_box(lmap[name].layout, fulls[base][0], rank % per_stage)
            ((offset, nbytes),) = entry.segments
            got = data[offset : offset + nbytes].view(np.float32).reshape(entry.shape)
            for lo in range(0, max(1, got.shape[0]), VERIFY_ROWS):
                hi = min(got.shape[0], lo + VERIFY_ROWS)
                sub = ((box[0][0] + lo, box[0][0] + hi), *box[1:])
                if not np.array_equal(got[lo:hi], values(numbers[name], sub)):
                    raise SystemExit(f"big_run: {path}: tensor {name!r} differs from the expected values")
            checked += 1
        del data
    return checked


class DiskWatch(threading.Thread):
    """Stops the run (kills this script's own child processes) if the disk's free space falls below
    ``floor`` while it runs: the disk is shared, and other work must not run out of space."""

    def __init__(self, work: str, floor: int) -> None:
        super().__init__(daemon=True)
        self.work, self.floor = work, floor
        self.tripped = False
        self.lowest = shutil.disk_usage(work).free
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(0.5):
            free = shutil.disk_usage(self.work).free
            self.lowest = min(self.lowest, free)
            if free < self.floor:
                self.tripped = True
                for child in psutil.Process().children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        child.kill()
                return

    def stop(self) -> None:
        self._halt.set()
        self.join()


def _check_disk(work: str, need: int) -> None:
    free = shutil.disk_usage(work).free
    if free < need:
        raise SystemExit(
            f"big_run: not enough free disk in {work}: {free / 1e9:.1f} GB free, {need / 1e9:.1f} GB needed"
        )


def run(args: argparse.Namespace) -> dict[str, Any]:
    target = parse_size(args.size)
    shape = choose_shape(target, args.hidden)
    work = os.path.abspath(args.work)
    if os.path.exists(work):
        raise SystemExit(f"big_run: {work} exists; give a new folder (everything in it is deleted afterwards)")
    os.makedirs(work)
    try:
        _check_disk(work, 2 * target + args.headroom)
        watch = DiskWatch(work, args.abort_below)
        watch.start()
        src, s_src, s_dst, gen_seconds = generate(work, shape)
        in_bytes = measure.tree_bytes(src)
        print(f"big_run: inputs {in_bytes / 1e9:.2f} GB written in {gen_seconds:.0f} s", file=sys.stderr, flush=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env["PYTHONPATH"] = os.path.join(os.path.dirname(BENCH_DIR), "src")
        out, copy = os.path.join(work, "out"), os.path.join(work, "copy")
        measure.prepare_cache("cold", [src, s_src, s_dst], settle_first=args.settle)
        cli = ["transform", "--src", src, "--dst", out, "--src-strategy", s_src, "--dst-strategy", s_dst]
        argv = [sys.executable, os.path.join(BENCH_DIR, "rs_child.py"), json.dumps(cli)]
        pressure_before = measure.cpu_pressure()
        rs = measure.run_measured(argv, os.path.join(work, "reshard"), env=env)
        out_bytes = measure.tree_bytes(out)
        print(f"big_run: reshard {rs.wall:.1f} s, peak RSS {rs.peak_rss / 2**20:.0f} MiB", file=sys.stderr, flush=True)
        checked = verify(out, s_dst, shape) if args.verify else 0
        measure.remove(src)  # the disk holds two model sizes: the output and its copy
        measure.prepare_cache("cold", [out], settle_first=args.settle)
        cp = measure.run_measured(measure.cp_argv(out, copy), os.path.join(work, "cp"), env=env)
        print(f"big_run: cp -r {cp.wall:.1f} s", file=sys.stderr, flush=True)
        watch.stop()
        if watch.tripped:
            raise SystemExit(f"big_run: stopped: less than {args.abort_below / 1e9:.1f} GB free on the disk")
        with open("/proc/loadavg", encoding="ascii") as fh:
            load = fh.read().split()[:3]
        return {
            "model": {"hidden": shape.hidden, "layers": shape.layers, "vocab": shape.vocab, "dtype": "fp32"},
            "largest_tensor_bytes": shape.vocab * shape.hidden * 4,
            "input_bytes": in_bytes,
            "output_bytes": out_bytes,
            "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "generate_seconds": gen_seconds,
            "reshard": rs.to_json(),
            "cp": cp.to_json(),
            "ratio_wall": rs.wall / cp.wall,
            "ratio_call": rs.call / cp.wall,
            "tensors_verified": checked,
            "cpu_pressure_before": pressure_before,
            "lowest_free_disk_bytes": watch.lowest,
            "loadavg_after": load,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "versions": versions.dependency_versions(),
            "command": "python3 bench/big_run.py " + " ".join(sys.argv[1:]),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/big_run.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="27G", help="fp32 training checkpoint size on disk (default 27G)")
    p.add_argument("--hidden", type=int, default=HIDDEN, help="hidden size (multiple of 4; default %(default)s)")
    p.add_argument("--work", required=True, help="a new folder (deleted afterwards)")
    p.add_argument("--headroom", type=parse_size, default=5 * 10**9, help="disk left free (default 5 GB)")
    p.add_argument(
        "--abort-below", type=parse_size, default=2 * 10**9, help="stop if free disk falls below (default 2 GB)"
    )
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip checking the output")
    p.add_argument("--no-settle", dest="settle", action="store_false", help=argparse.SUPPRESS)
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
