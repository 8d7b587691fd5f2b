"""One definition each: tensor assembly, the .ckpt crc/encryption probe, the temp suffix, and no
process-wide umask toggling anywhere in the library."""

from __future__ import annotations

import ast
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import reshard
from reshard import api, verify
from reshard import mindspore as ms
from reshard.execute import assemble
from reshard.formats import base, crypto
from reshard.formats.ckpt import CRC_TRAILER_BYTES, CkptProbe, probe_ckpt, save_ckpt
from reshard.formats.strategy import ParamLayout as L
from reshard.formats.strategy import make_strategy, write_strategy

SRC = Path(reshard.__file__).parent
RNG = np.random.default_rng(10)
FULL = {
    "w": RNG.standard_normal((8, 6)).astype(np.float32),  # columns split: strided boxes
    "h": RNG.standard_normal((6, 8)).astype(np.float16),
    "s": np.array(2.5, np.float32),
}
FOUR = {"w": L((2, 2), (1, 0)), "h": L((2, 2), (-1, 0))}


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(encoding="utf-8"))) for path in sorted(SRC.rglob("*.py"))]


def _job(tmp: Path) -> dict[str, str]:
    strategy = str(tmp / "four.ckpt")
    write_strategy(strategy, make_strategy(FOUR))
    full = str(tmp / "full" / "m.ckpt")
    save_ckpt(full, FULL)
    api.transform(full, str(tmp / "r4"), None, strategy)
    api.convert(str(tmp / "r4"), str(tmp / "r4st"), "safetensors")
    api.unify(str(tmp / "r4st"), strategy, str(tmp / "unified"))
    return {"strategy": strategy, "full": full, "r4": str(tmp / "r4"), "unified": str(tmp / "unified")}


@pytest.fixture
def callers(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The modules that called ``assemble.copy_boxes`` (directly or through ``assemble``'s own helpers)."""
    seen: set[str] = set()
    real = assemble.copy_boxes

    def spy(*args: Any, **kwargs: Any) -> None:
        frame = sys._getframe(1)
        while frame.f_globals["__name__"] == assemble.__name__:
            frame = frame.f_back  # type: ignore[assignment]
        seen.add(frame.f_globals["__name__"])
        real(*args, **kwargs)

    monkeypatch.setattr(assemble, "copy_boxes", spy)
    return seen


def test_the_three_assemblers_use_copy_boxes(tmp_path: Path, callers: set[str]) -> None:
    job = _job(tmp_path)
    callers.clear()
    report = api.transform(job["r4"], str(tmp_path / "merged"), job["strategy"], None)
    assert callers == {"reshard.execute.local"}
    merged = report.plan.files[0].path

    callers.clear()
    result = verify.verify(job["full"], job["r4"], b_strategy=job["strategy"])
    assert result.ok and callers == {"reshard.verify"}
    assert verify.verify(merged, job["full"]).ok

    callers.clear()
    loaded = ms.load_distributed_checkpoint(
        None,
        predict_strategy=job["strategy"],
        format="safetensors",
        unified_safetensors_dir=job["unified"],
        rank_id=3,
        return_param_dict=True,
    )
    assert callers == {"reshard.execute.memory"}  # the drop-in's in-memory executor
    assert loaded is not None
    assert np.array_equal(loaded["w"], FULL["w"][4:8, 3:6])  # rank 3: dim 0 on axis 1, dim 1 on axis 0


def test_only_assemble_copies_boxes() -> None:
    """``np.copyto`` (a box copy) appears in execute/assemble.py alone."""
    users = sorted(
        str(path.relative_to(SRC))
        for path, tree in _modules()
        if any(isinstance(node, ast.Attribute) and node.attr == "copyto" for node in ast.walk(tree))
    )
    assert users == [os.path.join("execute", "assemble.py")]


def test_tensor_rows_and_full_tensor() -> None:
    from reshard import dtypes
    from reshard.plan import Copy, TensorPlan

    left, right = np.arange(12, dtype=np.int32).reshape(4, 3), np.arange(100, 108, dtype=np.int32).reshape(4, 2)
    arrays = {0: left, 1: right}
    boxes = (Copy(0, "x", (0, 0), (0, 0), (4, 3)), Copy(1, "x", (0, 0), (0, 3), (4, 2)))
    t = TensorPlan("x", dtypes.INT32, (4, 5), boxes, 80)
    source: Callable[[int, str], np.ndarray] = lambda i, _name: arrays[i]  # noqa: E731
    want = np.concatenate([left, right], axis=1)
    assert np.array_equal(assemble.full_tensor(t, source), want)
    assert np.array_equal(assemble.tensor_rows(t, 1, 3, source), want[1:3])
    whole = TensorPlan("y", dtypes.INT32, (4, 3), (Copy(0, "x", (0, 0), (0, 0), (4, 3), True),), 48)
    assert np.shares_memory(assemble.tensor_rows(whole, 0, 4, source), left)  # zero-copy


# ------------------------------------------------------------------------------------ the .ckpt probe


def test_probe_ckpt(tmp_path: Path) -> None:
    values = {"w": np.arange(6, dtype=np.float32)}
    plain, crc, enc = tmp_path / "plain.ckpt", tmp_path / "crc.ckpt", tmp_path / "enc.ckpt"
    save_ckpt(plain, values)
    save_ckpt(crc, values, write_crc=True)
    save_ckpt(enc, values, enc_key=bytes(16), enc_mode="AES-CBC")
    assert probe_ckpt(plain) == CkptProbe(None, False)
    assert probe_ckpt(crc) == CkptProbe(None, True)
    assert probe_ckpt(enc) == CkptProbe("AES-CBC", False)
    # MindSpore's zero trailer after encrypted records carries no checksum: not a crc trailer
    enc.write_bytes(enc.read_bytes() + b"crc_num" + bytes(10))
    assert probe_ckpt(enc) == CkptProbe("AES-CBC", False)
    tiny = tmp_path / "tiny.ckpt"
    tiny.write_bytes(b"crc_num")
    assert probe_ckpt(tiny) == CkptProbe(None, False)
    assert os.path.getsize(crc) - os.path.getsize(plain) == CRC_TRAILER_BYTES
    with pytest.raises(OSError):
        probe_ckpt(tmp_path / "missing.ckpt")


def test_crc_and_cipher_are_probed_in_one_place() -> None:
    """No module but formats/ckpt.py compares against the crc mark, and the cipher magics live in
    formats/crypto.py alone."""
    marks, magics = [], []
    for path, tree in _modules():
        rel = str(path.relative_to(SRC))
        for node in ast.walk(tree):
            if isinstance(node, ast.Name | ast.Attribute) and getattr(node, "id", getattr(node, "attr", "")) in (
                "CRC_MARK",
            ):
                marks.append(rel)
            if isinstance(node, ast.Constant) and node.value in (
                crypto.MAGIC_AES_GCM,
                crypto.MAGIC_AES_CBC,
                crypto.MAGIC_SM4_CBC,
            ):
                magics.append(rel)
    assert set(marks) == {os.path.join("formats", "ckpt.py")}
    assert set(magics) == {os.path.join("formats", "crypto.py")}


# ------------------------------------------------------------------------------------ temp files, umask


def test_one_temp_suffix() -> None:
    """The temporary-file suffix is spelled once (formats/base.py); everything else imports it."""
    spelled = []
    for path, tree in _modules():
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        spelled += [
            str(path.relative_to(SRC))
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and "reshard-tmp" in node.value
            and id(node) not in docstrings
        ]
    assert spelled == [os.path.join("formats", "base.py")]


def test_no_module_toggles_the_umask() -> None:
    """``os.umask`` sets the mask of the whole process (every thread): library code never calls it."""
    names = {"umask"}
    calls = [
        f"{path.relative_to(SRC)}:{getattr(node, 'lineno', '?')}"
        for path, tree in _modules()
        for node in ast.walk(tree)
        if (isinstance(node, ast.Attribute) and node.attr in names)
        or (isinstance(node, ast.Name) and node.id in names)
        or (isinstance(node, ast.alias) and node.name in names)
    ]
    assert calls == []


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_outputs_get_the_mode_of_a_new_file(tmp_path: Path, mask: int) -> None:
    """Outputs are created like ``open()`` creates files: 0o666 less the umask (here set by the test)."""
    old = os.umask(mask)
    try:
        save_ckpt(tmp_path / "m.ckpt", FULL)
        base.write_whole(tmp_path / "t.json", "{}")
    finally:
        os.umask(old)
    for name in ("m.ckpt", "t.json"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o666 & ~mask, name
    assert not [n for n in os.listdir(tmp_path) if n.endswith(base.TEMP_SUFFIX)]
