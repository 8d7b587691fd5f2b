"""MindSpore 2.10 loads what --dtype writes, and its own cast gives the same values.

A full model written with ``--dtype bf16`` / ``fp16`` (``.ckpt`` and ``.safetensors``) is loaded
with ``mindspore.load_checkpoint``: every parameter has the dtype the cast rule says and the value
numpy's ``astype`` gives. MindSpore's own ``Tensor.astype`` of the fp32 source agrees bit for bit.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from reshard import api, statenames
from reshard.sources import open_checkpoint

pytestmark = pytest.mark.oracle

NP = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}
MS = {"bf16": "BFloat16", "fp16": "Float16"}

LOAD = """
import hashlib


def load(job):
    fmt = job["format"]
    params = ms.load_checkpoint(job["path"], format=fmt) if fmt == "safetensors" else ms.load_checkpoint(job["path"])
    result = {}
    for name, p in params.items():
        dtype = str(p.dtype)
        value = p.float().asnumpy() if dtype in ("BFloat16", "Float16") else p.asnumpy()
        ms_digest = None
        if job["cast"] and name in job["source"]:
            src = np.load(job["source"][name])
            target = ms.bfloat16 if job["cast"] == "bf16" else ms.float16
            theirs = np.ascontiguousarray(ms.Tensor(src).astype(target).float().asnumpy())
            ms_digest = hashlib.sha256(theirs.tobytes()).hexdigest()
        result[name] = [dtype, hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest(), ms_digest]
    return result


out([load(job) for job in ARGS["jobs"]])
"""

CASES = [(dtype, fmt) for fmt in ("ckpt", "safetensors") for dtype in ("bf16", "fp16")]


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> str:
    from reshard import demo as demo_mod

    folder = str(tmp_path_factory.mktemp("demo") / "demo")
    demo_mod.main(folder)
    return folder


@pytest.fixture(scope="module")
def model(demo: str) -> dict[str, np.ndarray]:
    with open_checkpoint(os.path.join(demo, "full", "model.ckpt")) as index:
        return {n: np.array(index.array(n)) for n, e in index.entries.items() if not e.is_string}


def _cast_names(model: dict[str, np.ndarray]) -> set[str]:
    return {n for n, a in model.items() if a.dtype == np.float32 and a.ndim and not statenames.DEFAULT.is_state(n)}


@pytest.fixture(scope="module")
def loaded(oracle: Any, demo: str, model: dict[str, np.ndarray], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every case's output as MindSpore loads it, from one oracle process (its import costs seconds)."""
    root = tmp_path_factory.mktemp("cast")
    saved = {}
    for name in sorted(_cast_names(model))[:12]:  # MindSpore's own cast, on a sample of the weights
        saved[name] = str(root / f"{len(saved)}.npy")
        np.save(saved[name], model[name])
    jobs = []
    for dtype, fmt in CASES:
        dst = str(root / f"{dtype}-{fmt}")
        api.transform(
            f"{demo}/ckpt_8ranks",
            dst,
            f"{demo}/strategy_8",
            None,
            output=api.OutputSpec(format=fmt),
            tensors=api.TensorOptions(dtype=dtype),
        )
        (path,) = [os.path.join(dst, "rank_0", n) for n in os.listdir(os.path.join(dst, "rank_0"))]
        jobs.append({"path": path, "format": fmt, "cast": dtype, "source": saved})
    return dict(zip(CASES, oracle(LOAD, {"jobs": jobs}), strict=True))


@pytest.mark.parametrize(("dtype", "fmt"), CASES)
def test_mindspore_loads_the_cast_model(loaded: dict, model: dict[str, np.ndarray], dtype: str, fmt: str) -> None:
    got = loaded[dtype, fmt]
    cast = _cast_names(model)
    assert set(got) == set(model)
    for name, ref in model.items():
        ms_dtype, digest, ms_cast = got[name]
        if name in cast:
            expected = ref.astype(NP[dtype]).astype(np.float32)
            assert ms_dtype == MS[dtype] and digest == _sha(expected), name
            if ms_cast is not None:
                assert ms_cast == digest, f"{name}: MindSpore's astype differs"
        else:
            assert ms_dtype == {np.dtype(np.float32): "Float32", np.dtype(np.int32): "Int32"}[ref.dtype], name
            assert digest == _sha(ref), name
