"""The benchmark's input files: a synthetic LLaMA-like model and its distributed layouts.

Why it is built this way:

* **Fixed tensor sizes, layer count follows the model size.** The hidden size is fixed
  (``DEFAULT_HIDDEN``) and the number of layers is chosen to reach the requested size, so the
  largest single tensor (the vocabulary embedding, ``VOCAB_PER_HIDDEN x hidden``) is the same
  at every size of a scaling series. That isolates the claim "peak RSS <= largest tensor +
  300 MB, flat as the model grows": a bigger model has more tensors, not bigger ones. The
  model is a training checkpoint (weights + two fp32 Adam moments + scalars), as users convert.
* **Every input is made by reshard itself, before any timing.** Full weights are written with
  ``save_ckpt``; the 8-rank shards (2 pipeline stages x dp2 x mp2, optimizer-sharded) and the
  4-rank shards (dp1 mp2 pp2) with ``reshard.api.transform`` from the full file, their
  safetensors form with ``convert``, and the unified (full safetensors) folder with ``unify``.
  The 4-rank shards are the reference the 8->4 outputs are checked against.
* **Generation runs in its own process** (``python3 bench/workload.py SPEC``) so that the
  multi-GB model built in RAM is gone before the first timed run, and a finished workload is
  reused (``workload.json`` is written last, as the completion marker).
* **Outputs are verified after timing** (``verify_output``): every tensor of an output must equal
  the reference tensor byte for byte, so a fast but wrong executor cannot pass the benchmark.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from reshard import dtypes, statenames
from reshard.plan.cast import Cast, cast_rule
from reshard.synthetic import ModelShape

DEFAULT_HIDDEN = 768  # fixed across sizes; 768 keeps the layer step (~113 MB fp32) fine-grained
VOCAB_PER_HIDDEN = 16  # vocab = 16 x hidden: the embedding is the largest tensor, as in LLaMA
FFN_PER_HIDDEN = 4
MIN_LAYERS = 2  # two pipeline stages need at least two layers
MIN_HIDDEN = 48  # divisible by every split of the layouts (mp2 x optimizer shard dp2 on dim 0)
ADAM_BYTES_PER_PARAM = 8  # adam_m + adam_v, always float32 in the synthetic model
DTYPES = {"fp32": ("float32", 4), "bf16": ("bfloat16", 2)}
MARKER = "workload.json"
# Disk needed, in model sizes: inputs (full .ckpt, 8-rank .ckpt and .safetensors, 4-rank .ckpt and
# .safetensors, unified folder, two Checkpoint 2.0 trees; the tied embedding lives in both pipeline
# stages) ~ 8.3, plus one operation's output and its cp copy ~ 2.2 at a time; rounded up.
DISK_FACTOR_INPUTS = 8.5
DISK_FACTOR_OUTPUTS = 2.5
DISK_HEADROOM = 1024**3


def _shape(hidden: int, layers: int) -> ModelShape:
    return ModelShape(vocab=VOCAB_PER_HIDDEN * hidden, hidden=hidden, ffn=FFN_PER_HIDDEN * hidden, layers=layers)


def _linear(hidden: int, dtype: str) -> tuple[int, int]:
    """(bytes without layers, bytes per layer): checkpoint bytes are linear in the layer count."""
    two, three = (_shape(hidden, n).param_count() * (DTYPES[dtype][1] + ADAM_BYTES_PER_PARAM) for n in (2, 3))
    return two - 2 * (three - two), three - two


def model_bytes(shape: ModelShape, dtype: str) -> int:
    """Tensor bytes of the full training checkpoint (weights + Adam moments; scalars ignored)."""
    base, per_layer = _linear(shape.hidden, dtype)
    return base + shape.layers * per_layer


def choose_shape(target: int, dtype: str, hidden: int | None = None) -> ModelShape:
    """The smallest layer count (>= MIN_LAYERS) whose checkpoint is at least ``target`` bytes.

    Without an explicit ``hidden``, ``DEFAULT_HIDDEN`` is halved only while even a
    ``MIN_LAYERS`` model would exceed ``target`` (tiny smoke-test models), so every size from
    0.5 GiB up shares the same tensor sizes.
    """
    if hidden is None:
        hidden = DEFAULT_HIDDEN
        while hidden > MIN_HIDDEN and model_bytes(_shape(hidden, MIN_LAYERS), dtype) > target:
            hidden //= 2
    base, per_layer = _linear(hidden, dtype)
    return _shape(hidden, max(MIN_LAYERS, -(-(target - base) // per_layer)))


def largest_tensor(shape: ModelShape, dtype: str) -> int:
    """Bytes of the largest tensor: the embedding's fp32 Adam moment, or the weight if wider."""
    biggest = max(int(np.prod(full)) for full, _, _ in _shape(shape.hidden, MIN_LAYERS).params().values())
    return biggest * max(DTYPES[dtype][1], 4)


@dataclass(frozen=True)
class Workload:
    """Paths and facts of one generated model (all inside ``root``)."""

    root: str
    target: int
    dtype: str
    hidden: int
    layers: int
    model_bytes: int
    largest_tensor: int
    full_ckpt: str
    strategy8: str
    strategy4: str
    ranks8_ckpt: str
    ranks8_st: str
    ranks4_ckpt: str
    ranks4_st: str
    unified: str
    cp2_8: str  # Checkpoint 2.0 (MindFormers 2.x) of the 8-rank layout, written from the full model
    cp2_4: str  # the same for the 4-rank layout: the reference of the Checkpoint 2.0 8 -> 4 row
    crc: bool = False  # the .ckpt rank shards carry crc trailers (checked on every read by default)

    @classmethod
    def layout(cls, root: str, target: int, dtype: str, hidden: int | None = None, crc: bool = False) -> Workload:
        shape = choose_shape(target, dtype, hidden)
        j = lambda *p: os.path.join(root, *p)  # noqa: E731
        return cls(
            root,
            target,
            dtype,
            shape.hidden,
            shape.layers,
            model_bytes(shape, dtype),
            largest_tensor(shape, dtype),
            j("full", "rank_0", "model.ckpt"),
            j("strategy", "ranks8.ckpt"),
            j("strategy", "ranks4.ckpt"),
            j("ranks8_ckpt"),
            j("ranks8_st"),
            j("ranks4_ckpt"),
            j("ranks4_st"),
            j("unified"),
            j("cp2_8"),
            j("cp2_4"),
            crc,
        )

    @property
    def shape(self) -> ModelShape:
        return _shape(self.hidden, self.layers)

    def is_complete(self) -> bool:
        path = os.path.join(self.root, MARKER)
        if not os.path.isfile(path):
            return False
        with open(path, encoding="utf-8") as fh:
            return json.load(fh).get("workload") == asdict(self)

    def disk_needed(self) -> int:
        factor = DISK_FACTOR_OUTPUTS + (0 if self.is_complete() else DISK_FACTOR_INPUTS)
        return int(factor * self.model_bytes) + DISK_HEADROOM


def generate(w: Workload) -> dict[str, float]:
    """Write every input of ``w`` (seconds per step returned); the marker file is written last."""
    import measure  # bench/ is on sys.path: this file runs as a script

    from reshard import api
    from reshard.execute.options import WriteOptions
    from reshard.formats.ckpt import save_ckpt
    from reshard.formats.strategy import merge_pipeline_strategies
    from reshard.synthetic import full_model, stage_strategies, write_stage_strategies

    for path in (
        w.full_ckpt,
        w.strategy8,
        w.ranks8_ckpt,
        w.ranks8_st,
        w.ranks4_ckpt,
        w.ranks4_st,
        w.unified,
        w.cp2_8,
        w.cp2_4,
    ):
        measure.remove(path)
    steps: dict[str, float] = {}

    def step(name: str, start: float) -> None:
        steps[name] = round(time.perf_counter() - start, 3)

    crc = WriteOptions(write_crc=w.crc)
    t = time.perf_counter()
    save_ckpt(w.full_ckpt, full_model(w.shape, DTYPES[w.dtype][0]))
    step("full model", t)
    sdir = os.path.dirname(w.strategy8)
    for name, (dp, mp, pp, opt), merged in (
        ("stages8", (2, 2, 2, True), w.strategy8),
        ("stages4", (1, 2, 2, False), w.strategy4),
    ):
        folder = os.path.join(sdir, name)
        write_stage_strategies(folder, stage_strategies(w.shape, dp, mp, pp, opt), dp * mp)
        merge_pipeline_strategies(folder, merged)
    for label, func in (
        ("8 ranks .ckpt", lambda: api.transform(w.full_ckpt, w.ranks8_ckpt, None, w.strategy8, write=crc)),
        ("8 ranks .safetensors", lambda: api.convert(w.ranks8_ckpt, w.ranks8_st, "safetensors")),
        ("4 ranks .ckpt", lambda: api.transform(w.full_ckpt, w.ranks4_ckpt, None, w.strategy4, write=crc)),
        ("4 ranks .safetensors", lambda: api.convert(w.ranks4_ckpt, w.ranks4_st, "safetensors")),
        ("unified .safetensors", lambda: api.unify(w.ranks8_st, w.strategy8, w.unified)),
        (
            "Checkpoint 2.0 8 ranks",
            lambda: api.transform(w.full_ckpt, w.cp2_8, None, w.strategy8, output=api.OutputSpec(format="checkpoint2")),
        ),
        (
            "Checkpoint 2.0 4 ranks",
            lambda: api.transform(w.full_ckpt, w.cp2_4, None, w.strategy4, output=api.OutputSpec(format="checkpoint2")),
        ),
    ):
        t = time.perf_counter()
        func()
        step(label, t)
    with open(os.path.join(w.root, MARKER), "w", encoding="utf-8") as fh:
        json.dump({"workload": asdict(w), "seconds": steps}, fh, indent=1)
    return steps


# ------------------------------------------------------------------------------------ verification


def _checkpoint_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    found = []
    for folder, _, names in os.walk(path):
        found.extend(os.path.join(folder, n) for n in names if n.endswith((".ckpt", ".safetensors")))
    return sorted(found)


def _rank_of(path: str, root: str) -> str:
    """``rank_3`` for ``root/rank_3/x.ckpt``; "" for a file directly in ``root``."""
    rel = os.path.relpath(path, root)
    return rel.split(os.sep)[0] if os.sep in rel else ""


GROUPINGS = ("rank", "model", "file")  # compare rank folder by rank folder, as one model, file by file


def _group_of(path: str, root: str, grouping: str) -> str:
    if grouping == "rank":
        return _rank_of(path, root)
    return os.path.relpath(path, root) if grouping == "file" else ""


def _same(a: object, b: object) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    x, y = np.asarray(a), np.asarray(b)
    return (
        x.shape == y.shape
        and x.dtype == y.dtype
        and np.array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))
    )


def _expected(name: str, value: object, cast: Cast | None) -> object:
    """The reference value as a ``--dtype`` output holds it (reshard.plan.cast decides what is cast)."""
    if cast is None or isinstance(value, str):
        return value
    array = np.asarray(value)
    target = cast.dtype_of(name, dtypes.from_numpy(array.dtype), array.shape)
    return array if target.numpy == array.dtype else array.astype(target.numpy)


def verify_output(
    output: str,
    reference: str,
    grouping: str,
    cast: str | None = None,
    weights_only: bool = False,
    preset: str | None = None,
) -> int:
    """Check ``output`` against ``reference``; return the number of tensors compared.

    ``grouping`` ``"rank"``: the files of ``output/rank_<r>`` must hold exactly the tensors of
    ``reference/rank_<r>`` (any format, any order). ``"file"``: each file must hold exactly the
    tensors of the reference's file at the same relative path (Checkpoint 2.0 trees). ``"model"``:
    the output's files together must hold exactly the reference's tensors (a merged or unified
    model against the full one). ``cast`` (``"bf16"``...): the output was written with ``--dtype``,
    so the reference's model weights are cast the same way first; ``weights_only``: the output holds
    no training state (``reshard.statenames``), so the reference's is left out; ``preset``: the
    output has that preset's Hugging Face names, so the reference's names are mapped the same way
    (renames only: the demo-like workload's llama names).
    Raises ``AssertionError`` naming the first difference.
    """
    from reshard.api import open_checkpoint

    rule = cast_rule(cast)
    renamed = _preset_names(reference, preset)

    def groups(root: str) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for path in _checkpoint_files(root):  # a unified folder's hyper_param.safetensors counts too
            out.setdefault(_group_of(path, root, grouping), []).append(path)
        return out

    got, want = groups(output), groups(reference)
    if sorted(got) != sorted(want):
        raise AssertionError(f"{output}: {grouping}s {sorted(got)} differ from the reference's {sorted(want)}")
    compared = 0
    for key, want_files in want.items():
        ref = {}
        handles = [open_checkpoint(p) for p in want_files + got[key]]
        try:
            for index in handles[: len(want_files)]:
                ref.update(
                    {
                        renamed.get(name, name): _expected(name, index.value(name), rule)
                        for name in index
                        if not (weights_only and statenames.DEFAULT.is_state(name))
                    }
                )
            seen: set[str] = set()
            for index in handles[len(want_files) :]:
                for name in index:
                    if name not in ref or not _same(index.value(name), ref[name]):
                        raise AssertionError(f"{index.path}: tensor {name!r} differs from the reference")
                    seen.add(name)
                    compared += 1
            if seen != set(ref):
                missing = sorted(set(ref) - seen)[:3]
                raise AssertionError(f"{output} {key}: tensors missing from the output, e.g. {missing}")
        finally:
            ref.clear()
            for index in handles:
                index.close()
    return compared


def _preset_names(reference: str, preset: str | None) -> dict[str, str]:
    """Reference name -> output name under ``preset`` (MindFormers -> Hugging Face renames)."""
    if preset is None:
        return {}
    from reshard.api import open_checkpoint
    from reshard.naming import TensorInfo, apply
    from reshard.naming.presets import TO_HF, preset_map

    catalogue: dict[str, TensorInfo] = {}
    for path in _checkpoint_files(reference):
        index = open_checkpoint(path)
        try:
            catalogue.update({n: TensorInfo(index.entries[n].shape, index.entries[n].dtype.ms_name) for n in index})
        finally:
            index.close()
    report = apply(preset_map(preset, list(catalogue), direction=TO_HF), catalogue).report
    if report.surgery:
        raise AssertionError(f"preset {preset}: verification maps renames only, not {report.surgery[0][0]}")
    return dict(report.renamed)


def main() -> int:
    w = Workload(**json.loads(sys.argv[1]))
    steps = generate(w)
    print(json.dumps(steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
