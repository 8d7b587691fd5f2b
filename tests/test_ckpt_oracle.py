"""The .ckpt writer/reader against MindSpore 2.10: identical bytes, and MindSpore loads our files.

One oracle call does everything: MindSpore saves every case (list form, append_dict, crc, and 1 KiB
chunks by patching ``SLICE_SIZE``) and loads every file we wrote.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from reshard import dtypes
from reshard.formats import crypto
from reshard.formats.base import TensorSpec, fill_from_values, write_file
from reshard.formats.ckpt import ckpt_layout, read_ckpt, save_ckpt

pytestmark = pytest.mark.oracle

SAVABLE = [  # every tensor_type of docs/formats.md §1.3 that MindSpore creates from numpy
    dtypes.BOOL, dtypes.INT8, dtypes.UINT8, dtypes.INT16, dtypes.UINT16, dtypes.INT32, dtypes.UINT32,
    dtypes.INT64, dtypes.UINT64, dtypes.FLOAT16, dtypes.FLOAT32, dtypes.FLOAT64, dtypes.BFLOAT16,
]  # fmt: skip


def sample(dtype: dtypes.DType, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Finite, exactly representable values (MindSpore builds bf16 from float32)."""
    rng = np.random.default_rng(seed)
    if dtype is dtypes.BOOL:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dtype.numpy.kind in "iu":
        info = np.iinfo(dtype.numpy)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype.numpy, endpoint=True)
    return (rng.standard_normal(size=shape) * 100).astype(dtype.numpy)


def wire(name: str, arr: np.ndarray) -> dict[str, Any]:
    return {"name": name, "dtype": dtypes.from_numpy(arr.dtype).ms_name, "shape": list(arr.shape),
            "hex": arr.tobytes().hex()}  # fmt: skip


KEYS = {"AES-GCM": bytes(range(32)), "AES-CBC": bytes(range(16)), "SM4-CBC": bytes(range(16, 32))}

# Each case: tensors saved via the list form, then append_dict items ([name, kind, value]).
APPEND = [["epoch_num", "int", 7], ["lr", "float", 0.125], ["flag", "bool", True], ["note", "str", "hé€😀 x"]]


def build_cases() -> dict[str, dict[str, Any]]:
    every = [(f"p.{d.ms_name}", sample(d, (3, 4), i)) for i, d in enumerate(SAVABLE)]
    scalars = [(f"s.{d.ms_name}", sample(d, (), 50 + i)) for i, d in enumerate(SAVABLE)]
    chunky = [
        ("c.f32_2800", sample(dtypes.FLOAT32, (7, 100), 1)),
        ("c.i8_1024", sample(dtypes.INT8, (1024,), 2)),
        ("c.u8_1025", sample(dtypes.UINT8, (5, 205), 3)),
        ("c.bf16_1026", sample(dtypes.BFLOAT16, (513,), 4)),
        ("c.f64_3000", sample(dtypes.FLOAT64, (3, 5, 25), 5)),
        ("c.small", sample(dtypes.INT32, (2,), 6)),
    ]
    return {
        "dtypes": {"tensors": every, "append": []},
        "scalars_append": {"tensors": scalars, "append": APPEND},
        "crc": {"tensors": every[:4], "append": APPEND[:2], "crc": True},
        "chunks": {"tensors": chunky, "append": APPEND[:1], "slice": 1},
        "chunks_crc": {"tensors": chunky[:2], "append": [], "slice": 1, "crc": True},
        # MindSpore's sync save drops empty tensors (we keep them): compared without "e" below.
        "empty_dropped": {"tensors": [every[0], ("e", np.zeros((0, 3), np.float32)), every[1]], "append": []},
        # Encrypted: random IVs, so MindSpore's plaintext is compared with ours, and each side reads the other.
        **{
            f"enc_{mode}": {"tensors": every[:3] + chunky[:1], "append": APPEND, "enc": [mode, key.hex()]}
            for mode, key in KEYS.items()
        },
    }


def append_value(kind: str, value: Any) -> np.ndarray | str:
    """What MindSpore makes of an append_dict value (docs/formats.md §1.5)."""
    if kind == "str":
        return value
    return np.array(value, {"int": np.int64, "float": np.float32, "bool": np.bool_}[kind])


def our_items(case: dict[str, Any], drop_empty: bool = False) -> list[tuple[str, np.ndarray | str]]:
    items = [(n, a) for n, a in case["tensors"] if not (drop_empty and a.size == 0)]
    return items + [(n, append_value(k, v)) for n, k, v in case["append"]]


ORACLE = """
import mindspore.train.serialization as ser

def tensor(t):
    raw = bytes.fromhex(t["hex"])
    if t["dtype"] == "BFloat16":
        f32 = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        return ms.Tensor(f32.reshape(t["shape"]), ms.bfloat16)
    np_type = {"Bool": np.bool_, "Float16": np.float16, "Float32": np.float32, "Float64": np.float64}.get(
        t["dtype"], t["dtype"].lower())
    return ms.Tensor(np.frombuffer(raw, np_type).reshape(t["shape"]))

saved = {}
default_slice = ser.SLICE_SIZE
for name, case in ARGS["save"].items():
    ser.SLICE_SIZE = case.get("slice") or default_slice
    path = os.path.join(ARGS["dir"], "ms_" + name + ".ckpt")
    append = {n: v for n, _, v in case["append"]} or None
    enc = {"enc_key": bytes.fromhex(case["enc"][1]), "enc_mode": case["enc"][0]} if case.get("enc") else {}
    ms.save_checkpoint([{"name": t["name"], "data": tensor(t)} for t in case["tensors"]], path,
                       append_dict=append, crc_check=case.get("crc", False), **enc)
    saved[name] = open(path, "rb").read().hex()
ser.SLICE_SIZE = default_slice

def describe(value):
    if isinstance(value, str):
        return {"str": value}
    arr = value.asnumpy()
    return {"dtype": str(value.dtype), "shape": list(value.shape), "hex": arr.tobytes().hex()}

loaded = {}
for name, how in ARGS["load"].items():
    dec = {"dec_key": bytes.fromhex(how["enc"][1]), "dec_mode": how["enc"][0]} if how.get("enc") else {}
    params = ms.load_checkpoint(os.path.join(ARGS["dir"], name), crc_check=how.get("crc", False), **dec)
    loaded[name] = [[key, describe(value)] for key, value in params.items()]

q = ms.Tensor(np.array([[1, 2], [3, 4]], np.int8), ms.qint4x2)
ms.save_checkpoint([{"name": "q", "data": q}], os.path.join(ARGS["dir"], "ms_int4.ckpt"))
out({"saved": saved, "loaded": loaded, "int4": open(os.path.join(ARGS["dir"], "ms_int4.ckpt"), "rb").read().hex()})
"""


def expected_load(items: list[tuple[str, np.ndarray | str]]) -> list[list[Any]]:
    return [
        [n, {"str": v}]
        if isinstance(v, str)
        else [n, {"dtype": dtypes.from_numpy(v.dtype).ms_name, "shape": list(v.shape), "hex": v.tobytes().hex()}]
        for n, v in items
    ]


def save_ours(path: Path, case: dict[str, Any], drop_empty: bool = False, plain: bool = False) -> None:
    """Our save of a case; MindSpore's patched ``SLICE_SIZE = 1`` (KiB) is ``chunk_bytes=1024``."""
    options: dict[str, Any] = {"write_crc": case.get("crc", False)}
    if case.get("slice"):
        options["chunk_bytes"] = 1024 * case["slice"]
    if case.get("enc") and not plain:
        options.update(enc_key=bytes.fromhex(case["enc"][1]), enc_mode=case["enc"][0])
    save_ckpt(path, our_items(case, drop_empty), **options)


def test_bytes_and_loads_match_mindspore(tmp_path: Path, oracle: Any) -> None:
    cases = build_cases()
    load: dict[str, dict[str, Any]] = {}
    for name, case in cases.items():
        save_ours(tmp_path / f"ours_{name}.ckpt", case)
        load[f"ours_{name}.ckpt"] = {"crc": case.get("crc", False), "enc": case.get("enc")}
    extras = [
        ("e0", np.zeros((0, 3), np.float32)),
        ("e1", np.zeros((2, 0), ml_dtypes.bfloat16)),
        ("blank", ""),
        ("w", sample(dtypes.FLOAT16, (2, 3), 9)),
    ]
    save_ckpt(tmp_path / "ours_extras.ckpt", extras)
    load["ours_extras.ckpt"] = {}

    save = {name: {**case, "tensors": [wire(n, a) for n, a in case["tensors"]]} for name, case in cases.items()}
    args = {"dir": str(tmp_path), "save": save, "load": load}
    result = oracle(ORACLE, args)

    for name, case in cases.items():  # 1. MindSpore's bytes (plaintext bytes if encrypted) == ours
        save_ours(tmp_path / "cmp.ckpt", case, drop_empty=True, plain=True)
        theirs = bytes.fromhex(result["saved"][name])
        if case.get("enc"):
            plaintext = io.BytesIO()
            crypto.decrypt_stream(theirs, plaintext, bytes.fromhex(case["enc"][1]), case["enc"][0])
            theirs = plaintext.getvalue()
        assert theirs == (tmp_path / "cmp.ckpt").read_bytes(), name

    for name, case in cases.items():  # 2. MindSpore loads ours with identical values and order
        assert result["loaded"][f"ours_{name}.ckpt"] == expected_load(our_items(case)), name
    assert result["loaded"]["ours_extras.ckpt"] == expected_load(extras)

    layout = ckpt_layout([TensorSpec("q", dtypes.INT4, (2, 2))])  # 3. qint4x2: dims as given, 1 byte each
    write_file(tmp_path / "q.ckpt", layout, fill_from_values({"q": np.array([[1, 2], [3, 4]], np.int8)}))
    assert result["int4"] == (tmp_path / "q.ckpt").read_bytes().hex()

    for name, case in cases.items():  # 4. we read MindSpore's files back to the same values
        dec = {"dec_key": bytes.fromhex(case["enc"][1]), "dec_mode": case["enc"][0]} if case.get("enc") else {}
        with read_ckpt(tmp_path / f"ms_{name}.ckpt", verify_crc=case.get("crc", False), **dec) as index:
            got = [[n, {"str": index.value(n)}] if index.entries[n].is_string else
                   [n, {"dtype": index.entries[n].dtype.ms_name, "shape": list(index.entries[n].shape),
                        "hex": bytes(index.raw(n)).hex()}] for n in index]  # fmt: skip
        assert got == expected_load(our_items(case, drop_empty=True)), name
