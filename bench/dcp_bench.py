"""PyTorch DCP rows: reshard against ``cp -r`` of its own output and against torch's consolidation.

    python3 bench/dcp_bench.py --size 1GiB --out bench/out/dcp.json

The workload is a model of float32 ``(4096 + i % 3, 4096)`` tensors (``--size`` in all) that torch
itself saves on 2 gloo ranks as ``Shard(0)`` DTensors (``tests/oracle_scripts/dcp_hf_save.py``):
once with ``FileSystemWriter`` (torch_save serialization: ``.metadata`` + ``.distcp``) and once with
``HuggingFaceStorageWriter(save_distributed=True)`` (safetensors shards, no ``.metadata``). Rows:

* ``dcp-to-safetensors``: ``reshard transform TS out --output-format safetensors`` against ``cp -r``
  of that output;
* ``hf-shards-to-safetensors``: ``reshard transform HF out --output-format safetensors`` against
  ``consolidate_safetensors_files(HF, out, {fqn: 1})`` (torch 2.13, its default one thread) on the
  very same files;
* ``dcp-n-to-m``: ``reshard transform TS out --output-format dcp --dcp-ranks 3`` against ``cp -r``;
* ``ms-ranks-to-dcp``: MindSpore rank folders (8 ranks, ``.ckpt``: 2 pipeline stages x dp2 x mp2,
  optimizer-sharded, the ``bench/workload.py`` model, made by reshard) ``--output-format dcp`` (each
  distinct rank slice a chunk) against ``cp -r``;
* ``torch_dist-to-ms-ranks``: that model as a Megatron-core torch_dist folder (2 DCP ranks, made by
  reshard) into the 8 MindSpore rank folders (``--dst-strategy``) against ``cp -r``.

``--repeat N`` runs each row N times, reshard and ``cp -r`` in turn, and keeps each side's fastest
run (the machine is shared: one run's ratio is as noisy as the other work on it; every run is kept
in the JSON, and the median of the runs' pair ratios beside the best against best).

Every run is a fresh process measured by ``bench/measure.py`` (wall time, peak RSS), page cache
cold for its inputs (``posix_fadvise`` per file), the machine settled first. Results: JSON with the
dependency versions, the CPU pressure at each start (other work on the 2-core box), the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from typing import Any

import measure
from versions import dependency_versions

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
TORCH_PYTHON = os.path.expanduser("~/.cache/reshard/torch-venv/bin/python")
COLS = 4096
CONSOLIDATE = """
import json, os, sys, time
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files
src, names_file, dst = sys.argv[1], sys.argv[2], sys.argv[3]
with open(names_file) as fh:
    names = json.load(fh)
start = time.perf_counter()
os.makedirs(dst, exist_ok=True)
consolidate_safetensors_files(src, dst, dict.fromkeys(names, 1))
print("@@BENCH@@" + json.dumps({"call": time.perf_counter() - start}))
"""
MAKE_MS = """
import json, os, sys
sys.path.insert(0, sys.argv[2])
from workload import DTYPES, Workload
from reshard import api
from reshard.formats.ckpt import save_ckpt
from reshard.formats.strategy import merge_pipeline_strategies
from reshard.synthetic import full_model, stage_strategies, write_stage_strategies
root, size = sys.argv[1], int(sys.argv[3])
w = Workload.layout(root, size, "fp32")
save_ckpt(w.full_ckpt, full_model(w.shape, DTYPES[w.dtype][0]))
folder = os.path.join(root, "strategy", "stages8")
write_stage_strategies(folder, stage_strategies(w.shape, 2, 2, 2, True), 4)
merge_pipeline_strategies(folder, w.strategy8)
api.transform(w.full_ckpt, w.ranks8_ckpt, None, w.strategy8)
api.transform(w.full_ckpt, root + "/torch_dist", None, None, output=api.OutputSpec("torch_dist", dcp_ranks=2))
os.remove(w.full_ckpt)
with open(os.path.join(root, "made.json"), "w") as fh:
    json.dump({"ranks8": w.ranks8_ckpt, "strategy8": w.strategy8, "torch_dist": root + "/torch_dist",
               "largest": w.largest_tensor}, fh)
"""


def parse_size(text: str) -> int:
    units = {"GIB": 1024**3, "MIB": 1024**2, "GB": 10**9, "MB": 10**6}
    for unit, factor in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def torch_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {"OMP_NUM_THREADS": "1"}


def make(work: str, size: int) -> dict[str, Any]:
    """Save the workload with torch (once per folder); the tensor names and the largest tensor's bytes."""
    tensors = max(1, size // (COLS * COLS * 4))
    names = [f"layers.{i}.weight" for i in range(tensors)]
    if not os.path.isdir(os.path.join(work, "hf")):
        args = {"tensors": tensors, "rows": COLS, "cols": COLS, "hf": f"{work}/hf", "torch_save": f"{work}/ts"}
        launcher = [TORCH_PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        script = os.path.join(REPO, "tests", "oracle_scripts", "dcp_hf_save.py")
        subprocess.run([*launcher, script, json.dumps(args)], check=True, env=torch_env())
    return {"names": names, "largest": (COLS + 2) * COLS * 4, "bytes": measure.tree_bytes(f"{work}/ts")}


def make_ms(work: str, size: int, env: dict[str, str]) -> dict[str, Any]:
    """The MindSpore rank folders, their strategy and a torch_dist folder of the same model (made once)."""
    root = os.path.join(work, "ms")
    made = os.path.join(root, "made.json")
    if not os.path.isfile(made):
        measure.remove(root)
        subprocess.run([sys.executable, "-c", MAKE_MS, root, BENCH, str(size)], check=True, env=env)
    with open(made, encoding="utf-8") as fh:
        found: dict[str, Any] = json.load(fh)
    return found


def reshard_argv(args: list[str]) -> list[str]:
    return [sys.executable, os.path.join(BENCH, "rs_child.py"), json.dumps(args)]


def timed(argv: list[str], inputs: list[str], out: str, log: str, env: dict[str, str]) -> measure.Measurement:
    measure.remove(out)
    measure.prepare_cache("cold", measure.files_under(inputs))
    return measure.run_measured(argv, log, env=env)


def row(
    work: str,
    key: str,
    inputs: list[str],
    reshard: list[str],
    other: list[str] | None,
    env: dict[str, str],
    repeat: int = 1,
) -> dict[str, Any]:
    """reshard's run, then ``other`` (torch), or ``cp -r`` of reshard's output; ``repeat`` times in turn,
    each side's fastest run kept."""
    out, theirs = f"{work}/out-{key}", f"{work}/theirs-{key}"
    runs: list[tuple[measure.Measurement, measure.Measurement]] = []
    for _ in range(repeat):
        ours = timed(reshard_argv([*reshard, out]), inputs, out, f"{work}/{key}-reshard", env)
        if other is None:
            against = timed(measure.cp_argv(out, theirs), [out], theirs, f"{work}/{key}-cp", env)
        else:
            against = timed([*other, theirs], inputs, theirs, f"{work}/{key}-torch", torch_env())
        runs.append((ours, against))
        shutil.rmtree(theirs, ignore_errors=True)
    best = min((r for r, _ in runs), key=lambda m: m.wall)
    best_other = min((o for _, o in runs), key=lambda m: m.wall)
    output_bytes = measure.tree_bytes(out)
    shutil.rmtree(out, ignore_errors=True)  # the next row's disk
    return {
        "reshard": best.to_json(),
        "against": "cp -r" if other is None else "consolidate_safetensors_files",
        "other": best_other.to_json(),
        "ratio_wall": best.wall / best_other.wall,
        "ratio_median": statistics.median(r.wall / o.wall for r, o in runs),  # of each run's pair
        "output_bytes": output_bytes,
        "runs": [{"reshard": r.wall, "other": o.wall} for r, o in runs],
    }


ROWS = (
    "dcp-to-safetensors",
    "dcp-to-hf",
    "hf-shards-to-safetensors",
    "dcp-n-to-m",
    "ms-ranks-to-dcp",
    "torch_dist-to-ms-ranks",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--work", default="/tmp/reshard-dcp-bench")
    parser.add_argument("--out", default=os.path.join(BENCH, "out", "dcp.json"))
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--repeat", type=int, default=1, help="runs per row, each side's fastest kept")
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    made = make(args.work, parse_size(args.size))
    # no PYTHON* variable of ours (PYTHONDONTWRITEBYTECODE would make every reshard process compile its modules)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {
        "PYTHONPATH": os.path.join(REPO, "src")
    }
    ts, hf = f"{args.work}/ts", f"{args.work}/hf"
    names_file = f"{args.work}/names.json"
    with open(names_file, "w", encoding="utf-8") as fh:
        json.dump(made["names"], fh)
    consolidate = [TORCH_PYTHON, "-c", CONSOLIDATE, hf, names_file]  # the output folder is appended
    plans = {
        "dcp-to-safetensors": ([ts], ["transform", ts, "--output-format", "safetensors", "-q"], None),
        "dcp-to-hf": ([ts], ["transform", ts, "--hf", "-q"], None),  # Hugging Face shards (5 GB: one here)
        "hf-shards-to-safetensors": (
            [hf],
            ["transform", hf, "--output-format", "safetensors", "-q"],
            consolidate,
        ),
        "dcp-n-to-m": ([ts], ["transform", ts, "--output-format", "dcp", "--dcp-ranks", "3", "-q"], None),
    }
    if any(key.startswith(("ms-", "torch_dist-")) for key in args.rows.split(",")):
        ms = make_ms(args.work, parse_size(args.size), env)
        r8, s8, td = ms["ranks8"], ms["strategy8"], ms["torch_dist"]
        plans["ms-ranks-to-dcp"] = ([r8], ["transform", r8, "--src-strategy", s8, "--output-format", "dcp", "-q"], None)
        plans["torch_dist-to-ms-ranks"] = ([td], ["transform", td, "--dst-strategy", s8, "-q"], None)
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    results: dict[str, Any] = {
        "command": "python3 bench/dcp_bench.py " + " ".join(sys.argv[1:]),
        "commit": commit,
        "workload": {"bytes": made["bytes"], "tensors": len(made["names"]), "largest_tensor": made["largest"]},
        "targets": {"cp": 1.25, "torch_consolidate": 1 / 3, "rss_allowance": 300 * 1024**2},
        "versions": dependency_versions(),
        "rows": {},
    }
    for key in args.rows.split(","):
        inputs, reshard, other = plans[key]
        results["rows"][key] = row(args.work, key, inputs, reshard, other, env, args.repeat)
        print(key, json.dumps(results["rows"][key]), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
