"""The local executor stops at the first failed output: nothing new starts after it, and the
outputs still running give up (their temporary files removed), so a bad input at terabyte scale
fails in seconds instead of after writing (and rolling back) the whole job."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from reshard import api
from reshard.errors import FormatError
from reshard.execute import local
from reshard.execute.options import RunOptions
from reshard.formats.strategy import merge_pipeline_strategies
from reshard.plan import FilePlan
from reshard.synthetic import ModelShape, stage_strategies, write_stage_strategies
from tests.trust_helpers import make_job, temp_files

WORKERS = 3


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The small 8-rank job and a 32-rank target (32 outputs: room to see what starts after a failure)."""
    root = str(tmp_path_factory.mktemp("ff"))
    shape = ModelShape(vocab=64, hidden=16, ffn=32, layers=2)
    job = make_job(root, shape)
    write_stage_strategies(f"{root}/s32", stage_strategies(shape, 2, 8, 2, False), 16)
    merge_pipeline_strategies(f"{root}/s32", f"{root}/merged/s32.ckpt")
    job["s32"] = f"{root}/merged/s32.ckpt"
    return job


def test_no_output_starts_after_a_failure(job: dict[str, str], tmp_path, monkeypatch) -> None:
    real = local.run_file
    lock = threading.Lock()
    events: list[tuple[str, str]] = []  # ("start" | "fail", path) in time order

    def run_file(file: FilePlan, *args: Any, **kwargs: Any) -> Any:
        with lock:
            events.append(("start", file.path))
            nth = sum(1 for kind, _ in events if kind == "start")
        time.sleep(0.02)  # outputs overlap, as real ones do
        if nth == 5:
            with lock:
                events.append(("fail", file.path))
            raise FormatError("injected failure", file.path)
        return real(file, *args, **kwargs)

    monkeypatch.setattr(local, "run_file", run_file)
    dst = tmp_path / "out"
    with pytest.raises(FormatError, match="injected failure"):
        api.transform(job["r8"], str(dst), job["s8"], job["s32"], run=RunOptions(workers=WORKERS))
    failed_at = events.index(next(e for e in events if e[0] == "fail"))
    started_after = [p for kind, p in events[failed_at:] if kind == "start"]
    assert len(started_after) <= WORKERS, started_after
    assert sum(1 for kind, _ in events if kind == "start") < 32
    assert not dst.exists() or not temp_files(str(dst))
    assert not dst.exists()  # rolled back: it did not exist before


def test_running_outputs_give_up_when_another_fails(job: dict[str, str], tmp_path, monkeypatch) -> None:
    """An output already running when another fails stops before its next tensor."""
    real_fill = local._fill_tensor
    calls = {"n": 0}
    lock = threading.Lock()

    def fill(*args: Any, **kwargs: Any) -> None:
        with lock:
            calls["n"] += 1
            n = calls["n"]
        if n == 3:
            raise OSError(28, "No space left on device")
        time.sleep(0.01)
        real_fill(*args, **kwargs)

    monkeypatch.setattr(local, "_fill_tensor", fill)
    dst = tmp_path / "out"
    tensors_per_file = 30  # the small model's rank files hold dozens of tensors
    with pytest.raises(Exception, match="No space left"):
        api.transform(job["r8"], str(dst), job["s8"], job["s32"], run=RunOptions(workers=WORKERS))
    assert calls["n"] < WORKERS * tensors_per_file
    assert not dst.exists()


def test_all_outputs_written_without_failure(job: dict[str, str], tmp_path) -> None:
    dst = tmp_path / "out"
    report = api.transform(job["r8"], str(dst), job["s8"], job["s32"], run=RunOptions(workers=WORKERS))
    assert all(os.path.isfile(f.path) for f in report.plan.files)
    assert len(report.plan.files) == 32


def test_each_file_fills_its_tensors_on_its_share_of_the_workers() -> None:
    """A unify's one large part beside a tiny file takes every worker; equal files take one each."""
    gib = 1 << 30
    assert local.tensor_threads(gib, gib + 200, 4) == 4  # part0 beside hyper_param
    assert local.tensor_threads(200, gib + 200, 4) == 1  # never less than one
    assert [local.tensor_threads(gib, 4 * gib, 4) for _ in range(4)] == [1, 1, 1, 1]  # transform 8 -> 4 ranks
    assert local.tensor_threads(gib, 2 * gib, 4) == 2
    assert local.tensor_threads(0, 0, 4) == 1  # an output of empty tensors only


def test_a_run_that_computes_tensors_takes_at_most_one_thread_per_core(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dequantizing is numpy's work, not the disk's: threads past the cores only contend (local.computing_threads)."""
    from reshard.ops.options import OutputSpec, TensorOptions
    from reshard.plan.quantized import Precision
    from tests.lowprec_fixtures import fp8_model

    src = fp8_model(tmp_path / "fp8")
    threads: list[int] = []
    real = local.run_file

    def spy(*args: Any, **kwargs: Any) -> Any:
        threads.append(args[6])  # the file's tensor threads
        return real(*args, **kwargs)

    monkeypatch.setattr(local, "run_file", spy)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    hf = OutputSpec(format="hf")
    api.transform(
        str(src),
        str(tmp_path / "bf16"),
        output=hf,
        tensors=TensorOptions(precision=Precision(dequantize="bf16")),
        run=RunOptions(workers=6),
    )
    assert threads == [2]
    api.transform(str(src), str(tmp_path / "copy"), output=hf, run=RunOptions(workers=6))
    assert threads == [2, 6]  # byte copies keep every worker (cold, they wait on the disk)
    assert local.computing_threads(8) == 2 and local.computing_threads(1) == 1


def test_a_quantized_weights_scale_and_values_are_filled_one_after_the_other(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The F32 scale tensors stand before every F8 weight in the file, and each reads its whole weight:
    filled in file order, a cold run read its whole input before computing anything (local.work_order)."""
    import json

    import ml_dtypes
    import numpy as np

    from reshard.formats.safetensors import save_safetensors
    from reshard.ops.options import OutputSpec, TensorOptions
    from reshard.plan.quantized import Precision

    rng = np.random.default_rng(3)
    weights = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(3)]
    tensors = {name: rng.standard_normal((256, 128)).astype(ml_dtypes.bfloat16) for name in weights}
    tensors["model.norm.weight"] = np.ones(128, dtype=ml_dtypes.bfloat16)
    (tmp_path / "bf16").mkdir()
    save_safetensors(tmp_path / "bf16" / "model.safetensors", tensors, {"format": "pt"})
    (tmp_path / "bf16" / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    filled: list[str] = []
    real = local._fill_tensor
    monkeypatch.setattr(local, "_fill_tensor", lambda out, t, *rest: (filled.append(t.name), real(out, t, *rest)))
    api.transform(
        str(tmp_path / "bf16"),
        str(tmp_path / "fp8"),
        output=OutputSpec(format="hf"),
        tensors=TensorOptions(precision=Precision(quantize="fp8-block")),
        run=RunOptions(workers=1),
    )
    pairs = [name for w in weights for name in (w + "_scale_inv", w)]
    assert [n for n in filled if n != "model.norm.weight"] == pairs
    raw = (tmp_path / "fp8" / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    stored = sorted((v["data_offsets"][0], k) for k, v in header.items() if k != "__metadata__")
    layout = [name for _, name in stored]
    assert layout.index(weights[0]) > layout.index(weights[2] + "_scale_inv")  # the file's own order differs
