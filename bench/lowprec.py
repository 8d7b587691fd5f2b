"""Benchmark of block-scaled low precision: FP8 -> bf16 dequantize and bf16 -> FP8 quantize, page cache cold.

Makes an FP8 block-scaled model of ``--size`` (default 1 GiB of F8_E4M3 weights, 128x128 F32 scales,
DeepSeek-V3-like 7168-wide linears), then times, each in its own process through ``measure.run_measured``
(wall time, peak RSS of the process tree, inputs evicted from the page cache first):

* ``reshard transform --hf --dequantize bf16`` against ``cp -r`` of the bf16 output it wrote;
* ``reshard transform --hf --quantize fp8-block`` of that bf16 output against ``cp -r`` of its output;
* ``reshard transform --hf --dequantize bf16 --block-size 128`` of the same model saved as a PyTorch DCP
  checkpoint (``--dcp-ranks``, default 2 data files; made once, untimed): its weights and scales come
  from their chunks, its peak RSS is the figure to watch; against ``cp -r`` of the bf16 output it
  wrote, and checked equal to the safetensors source's output bit for bit (``dcp_same``);
* DeepSeek's reference rules computed in torch on the same CPU (``--torch PYTHON``: a venv with torch and
  safetensors; skipped without it): every weight read whole, ``w.float() * scale`` expanded per block,
  cast to bf16 and saved with ``safetensors.torch.save_file``; and the quantizing rule (``amax / 448``
  per block, divide, clamp, ``.to(torch.float8_e4m3fn)``) on the bf16 output. Figures beside ours,
  not targets; ``same_as_torch`` counts the tensors of ours equal to theirs bit for bit. Every run
  also records its CPU seconds (user + system), which the other work on a shared machine moves far
  less than the wall time, and the CPU pressure when it started.

    python3 bench/lowprec.py --work /tmp/lowprec-bench --json docs/bench/results-lowprec.json \\
        --torch ~/.cache/reshard/hf-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import measure
import ml_dtypes
import numpy as np

from reshard.formats.safetensors import save_safetensors
from reshard.text import format_size, parse_size

ROWS, COLS = 7168, 2048  # one linear weight: 14 MiB of F8_E4M3 (DeepSeek-V3's hidden size on one axis)
BLOCK = 128
SHARD_TENSORS = 16  # tensors per source shard (about 224 MiB of FP8)

TORCH_RULE = r"""
import json, os, sys, time, torch
from safetensors.torch import load_file, save_file
src, dst = sys.argv[1], sys.argv[2]
start = time.perf_counter()
os.makedirs(dst, exist_ok=True)
for shard in sorted(f for f in os.listdir(src) if f.endswith(".safetensors")):
    raw = load_file(os.path.join(src, shard))
    out = {}
    for name, w in raw.items():
        if name.endswith("_scale_inv"):
            continue
        s = raw[name + "_scale_inv"]
        full = s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
        out[name] = (w.to(torch.float32) * full).to(torch.bfloat16)
    save_file(out, os.path.join(dst, shard))
print("@@BENCH@@" + json.dumps({"call": time.perf_counter() - start}))
"""


TORCH_QUANTIZE_RULE = r"""
import json, os, sys, time, torch
from safetensors.torch import load_file, save_file
src, dst = sys.argv[1], sys.argv[2]
start = time.perf_counter()
os.makedirs(dst, exist_ok=True)
for shard in sorted(f for f in os.listdir(src) if f.endswith(".safetensors")):
    out = {}
    for name, w in load_file(os.path.join(src, shard)).items():
        rows, cols = w.shape
        g0, g1 = -(-rows // 128), -(-cols // 128)
        padded = torch.zeros(g0 * 128, g1 * 128, dtype=torch.float32)
        padded[:rows, :cols] = w.to(torch.float32)
        blocks = padded.view(g0, 128, g1, 128)
        amax = blocks.abs().amax(dim=(1, 3))
        scale = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0)
        q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        out[name] = q.view(g0 * 128, g1 * 128)[:rows, :cols].contiguous()
        out[name + "_scale_inv"] = scale
    save_file(out, os.path.join(dst, shard))
print("@@BENCH@@" + json.dumps({"call": time.perf_counter() - start}))
"""


def make_fp8_model(folder: str, size: int) -> int:
    """An FP8 block-scaled Hugging Face folder of about ``size`` bytes of weights; returns the tensor count."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    count = max(1, round(size / (ROWS * COLS)))
    grid = (math.ceil(ROWS / BLOCK), math.ceil(COLS / BLOCK))
    weight_map: dict[str, str] = {}
    shards = math.ceil(count / SHARD_TENSORS)
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors: dict[str, np.ndarray] = {}
        for k in range(s * SHARD_TENSORS, min(count, (s + 1) * SHARD_TENSORS)):
            w = f"model.layers.{k}.mlp.down_proj.weight"
            tensors[w] = rng.integers(0, 0x7E, (ROWS, COLS), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
            tensors[w + "_scale_inv"] = (rng.random(grid, dtype=np.float32) * 1e-3).astype(np.float32)
        save_safetensors(os.path.join(folder, name), tensors, {"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w", encoding="utf-8") as fh:
        json.dump(index, fh)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as fh:
        json.dump({"quantization_config": {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}}, fh)
    return count


def timed(argv: list[str], inputs: list[str], log: str, env: dict[str, str] | None = None) -> dict[str, float]:
    """One run, cache cold. ``cpu``: user + system seconds of the contestant (and its ~10 ms ``spawn.py``
    parent), which other engineers' load on the machine changes far less than the wall time."""
    measure.prepare_cache("cold", measure.files_under(inputs))
    before = os.times()
    m = measure.run_measured(argv, log, env=env)
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return {"wall": m.wall, "call": m.call, "cpu": cpu, "peak_rss": m.peak_rss, "cpu_pressure": m.cpu_pressure}


def same_tensors(a: str, b: str) -> dict[str, int]:
    """How many tensors of folder ``a``'s shards equal (bit for bit) those of the same names in ``b``."""
    from reshard.formats.safetensors import read_safetensors

    def arrays(folder: str) -> dict[str, tuple[str, str]]:
        out = {}
        for shard in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
            with read_safetensors(os.path.join(folder, shard)) as index:
                out.update(dict.fromkeys(index.entries, (folder, shard)))
        return out

    mine, theirs = arrays(a), arrays(b)
    same = 0
    for name in sorted(mine.keys() & theirs.keys()):
        with read_safetensors(os.path.join(*mine[name])) as x, read_safetensors(os.path.join(*theirs[name])) as y:
            left, right = x.array(name), y.array(name)
            same += left.shape == right.shape and left.view(np.uint8).tobytes() == right.view(np.uint8).tobytes()
    return {"tensors": len(mine), "same": same, "only_one_side": len(mine.keys() ^ theirs.keys())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="scratch folder (needs about 4x --size free)")
    ap.add_argument("--size", default="1GiB", help="FP8 weight bytes of the model (default 1GiB)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--torch", help="a python with torch and safetensors, for the reference rule's time")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--dcp-ranks", type=int, default=2, help="data files of the DCP source (0: no DCP row)")
    args = ap.parse_args()
    work = os.path.abspath(args.work)
    src, bf16, fp8 = (os.path.join(work, n) for n in ("fp8_model", "bf16_out", "fp8_out"))
    if not os.path.isdir(src):
        make_fp8_model(src, parse_size(args.size))
    dcp_src, bf16_dcp = os.path.join(work, f"fp8_dcp{args.dcp_ranks}"), os.path.join(work, "bf16_from_dcp")
    if args.dcp_ranks and not os.path.isdir(dcp_src):
        from reshard import api

        api.transform(src, dcp_src, output=api.OutputSpec(format="dcp", dcp_ranks=args.dcp_ranks))
    # no PYTHON* variable of ours (PYTHONDONTWRITEBYTECODE would make every reshard process compile its modules)
    package = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {"PYTHONPATH": package}
    cli = [sys.executable, "-m", "reshard.cli", "transform", "--no-progress", "-q"]
    results: dict[str, object] = {"fp8_bytes": measure.tree_bytes(src), "runs": []}
    with measure.steady_host_memory(True) as host:  # measure.py: freed pages otherwise fault on the host
        results["host_memory"] = host
        _rounds(args, results, cli, env, work, src, bf16, fp8, dcp_src, bf16_dcp)
    results["bf16_bytes"] = measure.tree_bytes(bf16)
    results["cpu_count"] = os.cpu_count()
    results["command"] = " ".join(["python3 bench/lowprec.py", *sys.argv[1:]])
    git = ["git", "-C", os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rev-parse", "--short", "HEAD"]
    results["commit"] = subprocess.run(git, capture_output=True, text=True).stdout.strip()
    results["versions"] = {
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "ml_dtypes": ml_dtypes.__version__,
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)
    return 0


def _rounds(
    args: argparse.Namespace,
    results: dict[str, object],
    cli: list[str],
    env: dict[str, str],
    work: str,
    src: str,
    bf16: str,
    fp8: str,
    dcp_src: str,
    bf16_dcp: str,
) -> None:
    """``args.repeat`` rounds of every step, each appended to ``results["runs"]``."""
    for _ in range(args.repeat):
        run: dict[str, object] = {}
        for out in (bf16, fp8, bf16 + "_cp", fp8 + "_cp", bf16 + "_torch", bf16_dcp, bf16_dcp + "_cp"):
            measure.remove(out)
        argv = [*cli, "--src", src, "--dst", bf16, "--hf", "--dequantize", "bf16"]
        run["dequantize"] = timed(argv, [src], os.path.join(work, "dequantize"), env)
        run["cp_bf16"] = timed(measure.cp_argv(bf16, bf16 + "_cp"), [bf16], os.path.join(work, "cp_bf16"))
        argv = [*cli, "--src", bf16, "--dst", fp8, "--hf", "--quantize", "fp8-block"]
        run["quantize"] = timed(argv, [bf16], os.path.join(work, "quantize"), env)
        run["cp_fp8"] = timed(measure.cp_argv(fp8, fp8 + "_cp"), [fp8], os.path.join(work, "cp_fp8"))
        if args.dcp_ranks:
            argv = [*cli, "--src", dcp_src, "--dst", bf16_dcp, "--hf", "--dequantize", "bf16", "--block-size", "128"]
            run["dequantize_dcp"] = timed(argv, [dcp_src], os.path.join(work, "dequantize_dcp"), env)
            copy = measure.cp_argv(bf16_dcp, bf16_dcp + "_cp")
            run["cp_bf16_dcp"] = timed(copy, [bf16_dcp], os.path.join(work, "cp_bf16_dcp"))
            run["dcp_same"] = same_tensors(bf16_dcp, bf16)
        if args.torch:
            script = os.path.join(work, "torch_rule.py")
            with open(script, "w", encoding="utf-8") as fh:
                fh.write(TORCH_RULE)
            argv = [args.torch, script, src, bf16 + "_torch"]
            run["torch_rule"] = timed(argv, [src], os.path.join(work, "torch_rule"))
            script = os.path.join(work, "torch_quantize_rule.py")
            with open(script, "w", encoding="utf-8") as fh:
                fh.write(TORCH_QUANTIZE_RULE)
            measure.remove(fp8 + "_torch")
            argv = [args.torch, script, bf16, fp8 + "_torch"]
            run["torch_quantize_rule"] = timed(argv, [bf16], os.path.join(work, "torch_quantize_rule"))
            run["same_as_torch"] = {
                "dequantize": same_tensors(bf16, bf16 + "_torch"),
                "quantize": same_tensors(fp8, fp8 + "_torch"),
            }
        results["runs"].append(run)  # type: ignore[attr-defined]
        deq, cp_bf16 = run["dequantize"], run["cp_bf16"]
        q, cp_fp8 = run["quantize"], run["cp_fp8"]
        assert isinstance(deq, dict) and isinstance(cp_bf16, dict) and isinstance(q, dict) and isinstance(cp_fp8, dict)
        line = (
            f"CPU pressure {deq['cpu_pressure']:.0f}-{cp_fp8['cpu_pressure']:.0f} %: "
            f"dequantize {deq['wall']:.2f} s ({deq['wall'] / cp_bf16['wall']:.2f}x cp -r {cp_bf16['wall']:.2f} s), "
            f"CPU {deq['cpu']:.2f} s, peak {format_size(int(deq['peak_rss']))}; quantize {q['wall']:.2f} s "
            f"({q['wall'] / cp_fp8['wall']:.2f}x cp -r {cp_fp8['wall']:.2f} s of its output, "
            f"{q['wall'] / cp_bf16['wall']:.2f}x cp -r of its bf16 input), CPU {q['cpu']:.2f} s, "
            f"peak {format_size(int(q['peak_rss']))}"
        )
        if "dequantize_dcp" in run:
            d, c = run["dequantize_dcp"], run["cp_bf16_dcp"]
            assert isinstance(d, dict) and isinstance(c, dict)
            line += (
                f"; dequantize of the {args.dcp_ranks}-file DCP {d['wall']:.2f} s ({d['wall'] / c['wall']:.2f}x cp -r "
                f"{c['wall']:.2f} s), CPU {d['cpu']:.2f} s, peak {format_size(int(d['peak_rss']))}, "
                f"same as from safetensors: {run['dcp_same']}"
            )
        if "torch_rule" in run:
            t = run["torch_rule"]
            assert isinstance(t, dict)
            peak = format_size(int(t["peak_rss"]))
            line += f"; torch reference rule {t['wall']:.2f} s, CPU {t['cpu']:.2f} s, peak {peak}"
            t = run["torch_quantize_rule"]
            assert isinstance(t, dict)
            peak = format_size(int(t["peak_rss"]))
            line += f"; torch quantize rule {t['wall']:.2f} s, CPU {t['cpu']:.2f} s, peak {peak}"
            line += f"; bit for bit the torch rules' tensors: {run['same_as_torch']}"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
