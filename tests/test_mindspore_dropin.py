"""Unit tests of ``reshard.mindspore``: argument checks, orders, conversions, return types.

MindSpore itself is not needed here; byte-for-byte agreement with it is checked in
``test_mindspore_dropin_oracle.py``. Inputs are tiny and hand-sliced with numpy, so each test
shows the rule it checks.
"""

from __future__ import annotations

import os
import stat
import zlib
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from reshard import mindspore as ms
from reshard.errors import CryptoError, FormatError, IntegrityError, ReshardError, UnsupportedError, UsageError
from reshard.formats.ckpt import read_ckpt, save_ckpt
from reshard.formats.safetensors import read_safetensors, save_safetensors
from reshard.formats.strategy import make_strategy, write_strategy
from reshard.layout import ParamLayout as L

W = np.arange(32, dtype=np.float32).reshape(8, 4)
B = np.array([1.0, 2.0, 3.0, 4.0], np.float16)


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def _entries(path: str) -> list[tuple[str, str, tuple[int, ...]]]:
    reader = read_ckpt if path.endswith("ckpt") else read_safetensors
    with reader(path) as index:
        return [(n, e.dtype.ms_name, e.shape) for n, e in index.entries.items()]


# --------------------------------------------------------------------------------------------
# save_checkpoint


def test_save_spec_vectors(tmp_path: Any) -> None:
    """docs/formats.md §8.1: plain, append_dict and crc vectors, byte for byte."""
    v1 = bytes.fromhex("0a1a0a0177121508021207466c6f617433321a080000803f00000040")
    w = np.array([1.0, 2.0], np.float32)
    ms.save_checkpoint({"w": w}, str(tmp_path / "a"))
    assert _read(str(tmp_path / "a.ckpt")) == v1
    ms.save_checkpoint({"w": w}, str(tmp_path / "b"), append_dict={"epoch_num": 1, "note": "ab"})
    assert _read(str(tmp_path / "b.ckpt")) == v1 + bytes.fromhex(
        "0a1e0a0965706f63685f6e756d12111205496e7436341a080100000000000000"
        "0a190a046e6f74651211080012037374721a086100000062000000"
    )
    ms.save_checkpoint({"w": w}, str(tmp_path / "c"), crc_check=True)
    assert _read(str(tmp_path / "c.ckpt")) == v1 + bytes.fromhex("6372635f6e756d000000000000117599f0")


def test_save_order_list_form_and_choice_func(tmp_path: Any) -> None:
    path = str(tmp_path / "m.ckpt")
    ms.save_checkpoint({"z": W, "a": B, "m": "text"}, path)
    assert [n for n, _, _ in _entries(path)] == ["z", "a", "m"]
    ms.save_checkpoint([{"name": "q", "data": W}, {"name": "p", "data": B}], path)
    assert [n for n, _, _ in _entries(path)] == ["q", "p"]
    # choice_func filters save_obj only; append_dict entries are always kept (as in MindSpore)
    ms.save_checkpoint({"a": W, "b": B}, path, choice_func=lambda n: n != "b", append_dict={"b2": 1, "x": 2})
    assert [n for n, _, _ in _entries(path)] == ["a", "b2", "x"]
    ms.save_checkpoint({"a": W}, path, choice_func=lambda n: 0)  # truthiness, like MindSpore
    assert os.path.getsize(path) == 0


def test_append_dict_conversions(tmp_path: Any) -> None:
    path = str(tmp_path / "m.ckpt")
    append = {
        "i": 7,
        "big": 2**62,
        "f": 0.5,
        "f64": np.float64(2.5),
        "t": True,
        "s": "hé",
        "arr": np.arange(3, dtype=np.int16),
    }
    ms.save_checkpoint({"w": W}, path, append_dict=append)
    assert _entries(path) == [
        ("w", "Float32", (8, 4)),
        ("i", "Int64", ()),
        ("big", "Int64", ()),
        ("f", "Float32", ()),
        ("f64", "Float32", ()),
        ("t", "Bool", ()),
        ("s", "str", (0,)),
        ("arr", "Int16", (3,)),
    ]
    loaded = ms.load_checkpoint(path)
    assert loaded["s"] == "hé" and loaded["big"] == 2**62 and loaded["t"].dtype == np.bool_


@pytest.mark.parametrize(
    ("name", "fmt", "written"),
    [
        ("model", "ckpt", "model.ckpt"),
        ("model.ckpt", "ckpt", "model.ckpt"),
        ("modelckpt", "ckpt", "modelckpt"),  # MindSpore tests endswith("ckpt"), without the dot
        ("model.CKPT", "ckpt", "model.CKPT.ckpt"),
        ("model.safetensors", "ckpt", "model.safetensors.ckpt"),
        ("model", "safetensors", "model.safetensors"),
        ("model.ckpt", "safetensors", "model.ckpt.safetensors"),
    ],
)
def test_save_file_names(tmp_path: Any, name: str, fmt: str, written: str) -> None:
    ms.save_checkpoint({"w": W}, str(tmp_path / name), format=fmt)
    assert os.listdir(tmp_path) == [written]


def test_save_scalars_bf16_and_non_contiguous(tmp_path: Any) -> None:
    values = {"s": np.array(1.5, np.float32), "bf": np.array([1.0, -3.5], ml_dtypes.bfloat16), "t": W.T}
    for fmt in ("ckpt", "safetensors"):
        path = str(tmp_path / f"m.{fmt}")
        ms.save_checkpoint(values, path, format=fmt)
        loaded = ms.load_checkpoint(path, format=fmt)
        assert loaded["s"].shape == () and loaded["s"] == 1.5
        assert loaded["bf"].dtype == ml_dtypes.bfloat16 and loaded["bf"].tolist() == [1.0, -3.5]
        assert np.array_equal(loaded["t"], W.T)
    with read_ckpt(str(tmp_path / "m.ckpt")) as index:
        assert bytes(index.raw("bf")) == bytes.fromhex("803f60c0")  # docs/formats.md §1.3


def test_save_safetensors_metadata(tmp_path: Any) -> None:
    path = str(tmp_path / "m.safetensors")
    ms.save_checkpoint({"w": W, "b": B}, path, format="safetensors")
    with read_safetensors(path) as index:
        assert index.metadata == {"format": "ms"}
    ms.save_checkpoint({"w": W, "b": B}, path, format="safetensors", remove_redundancy=True, crc_check=True)
    crc = 0
    for name, array in (("b", B), ("w", W)):  # sorted names, name bytes then data bytes
        crc = zlib.crc32(array.tobytes(), zlib.crc32(name.encode(), crc))
    with read_safetensors(path) as index:
        assert index.metadata == {"format": "ms", "remove_redundancy": "True", "crc_num": str(crc)}
    ms.save_checkpoint({"w": W}, path, format="safetensors", choice_func=lambda n: False, remove_redundancy=False)
    assert _read(path) == (8).to_bytes(8, "little") + b"{}      "  # empty dict: no metadata at all


def test_save_never_chmods_and_replaces_read_only_output(tmp_path: Any) -> None:
    path = str(tmp_path / "m.ckpt")
    other = tmp_path / "keep.txt"
    other.write_text("untouched")
    ms.save_checkpoint({"w": W}, path)
    os.chmod(path, 0o400)  # as MindSpore leaves its files
    ms.save_checkpoint({"w": W + 1}, path)
    assert stat.S_IMODE(os.stat(path).st_mode) != 0o400
    assert np.array_equal(ms.load_checkpoint(path)["w"], W + 1)
    assert sorted(os.listdir(tmp_path)) == ["keep.txt", "m.ckpt"] and other.read_text() == "untouched"


def test_save_encrypted_round_trip(tmp_path: Any) -> None:
    path = str(tmp_path / "m.ckpt")
    key = bytes(range(16))
    ms.save_checkpoint({"w": W, "s": "x"}, path, enc_key=key, enc_mode="AES-CBC")
    loaded = ms.load_checkpoint(path, dec_key=key, dec_mode="AES-CBC")
    assert np.array_equal(loaded["w"], W) and loaded["s"] == "x"
    with pytest.warns(UserWarning, match="encrypted"):  # MindSpore never checks a crc of encrypted files
        ms.load_checkpoint(path, dec_key=key, dec_mode="AES-CBC", crc_check=True)
    with pytest.raises(FormatError):
        ms.load_checkpoint(path)
    with pytest.raises(CryptoError):
        ms.load_checkpoint(path, dec_key=bytes(16), dec_mode="AES-CBC")


BAD_SAVES: list[tuple[str, dict[str, Any], type[ReshardError]]] = [
    ("format", {"format": "npz"}, UsageError),
    ("save_obj int", {"save_obj": 3}, UsageError),
    ("list without data", {"save_obj": [{"name": "w", "value": W}]}, UsageError),
    ("python scalar value", {"save_obj": {"w": 3}}, UsageError),
    ("list value", {"save_obj": {"w": [1, 2]}}, UsageError),
    ("name not str", {"save_obj": {1: W}}, UsageError),
    ("append not dict", {"append_dict": [1]}, UsageError),
    ("append None", {"append_dict": {"a": None}}, UsageError),
    ("append numpy int", {"append_dict": {"a": np.int64(1)}}, UsageError),
    ("append key int", {"append_dict": {1: 1}}, UsageError),
    ("append int too big", {"append_dict": {"a": 2**70}}, UsageError),
    ("duplicate name", {"append_dict": {"w": 1}}, UsageError),
    ("crc with enc", {"crc_check": True, "enc_key": bytes(16)}, UsageError),
    ("enc_key str", {"enc_key": "0" * 16}, UsageError),
    ("st enc_key", {"format": "safetensors", "enc_key": bytes(16)}, UsageError),
    ("st enc_mode", {"format": "safetensors", "enc_mode": "AES-CBC"}, UsageError),
    ("st incremental", {"format": "safetensors", "incremental": True}, UsageError),
    ("st global_step_num", {"format": "safetensors", "global_step_num": 3}, UsageError),
    ("st string", {"format": "safetensors", "save_obj": {"s": "x"}}, UsageError),
    ("remove_redundancy str", {"format": "safetensors", "remove_redundancy": "yes"}, UsageError),
    ("crc int", {"crc_check": 1}, UsageError),
    ("integrated_save int", {"integrated_save": 3}, UsageError),
    ("async_save int", {"async_save": 3}, UsageError),
    ("choice_func int", {"choice_func": 3}, UsageError),
    ("name int", {"ckpt_file_name": 3}, UsageError),
    ("ckpt incremental", {"incremental": True}, UnsupportedError),
]


@pytest.mark.parametrize(("case", "kwargs", "error"), BAD_SAVES, ids=[c[0] for c in BAD_SAVES])
def test_save_argument_errors(tmp_path: Any, case: str, kwargs: dict[str, Any], error: type[ReshardError]) -> None:
    args = {"save_obj": {"w": W}, "ckpt_file_name": str(tmp_path / "m")} | kwargs
    with pytest.raises(error) as info:
        ms.save_checkpoint(**args)
    assert "\n" not in str(info.value)
    assert not [n for n in os.listdir(tmp_path) if not n.startswith(".")] or case == "name int"


def test_save_refuses_networks_and_directories(tmp_path: Any) -> None:
    class Cell:
        def parameters_and_names(self) -> list[Any]:
            return []

    with pytest.raises(UnsupportedError, match="no networks"):
        ms.save_checkpoint(Cell(), str(tmp_path / "m"))
    (tmp_path / "d.ckpt").mkdir()
    with pytest.raises(UsageError, match="directory"):
        ms.save_checkpoint({"w": W}, str(tmp_path / "d"))


def test_save_unknown_keyword_warns(tmp_path: Any) -> None:
    with pytest.warns(UserWarning, match="foo"):
        ms.save_checkpoint({"w": W}, str(tmp_path / "m"), foo=1)
    assert os.path.isfile(tmp_path / "m.ckpt")


# --------------------------------------------------------------------------------------------
# load_checkpoint


@pytest.fixture
def ckpt_file(tmp_path: Any) -> str:
    path = str(tmp_path / "p.ckpt")
    values = {"a.x": W, "a.y": B, "b.x": W[:2], "bb": np.array(3, np.int32), "c": "note"}
    ms.save_checkpoint(values, path)
    return path


def test_load_returns_owned_copies_in_file_order(ckpt_file: str) -> None:
    loaded = ms.load_checkpoint(ckpt_file)
    assert list(loaded) == ["a.x", "a.y", "b.x", "bb", "c"]
    assert loaded["c"] == "note"
    for name in ("a.x", "a.y", "b.x", "bb"):
        assert isinstance(loaded[name], np.ndarray) and loaded[name].flags.owndata and loaded[name].flags.writeable
    loaded["a.x"][0, 0] = 99  # a copy: the file is not touched
    assert ms.load_checkpoint(ckpt_file)["a.x"][0, 0] == 0


def test_load_safetensors_sorted(tmp_path: Any) -> None:
    path = str(tmp_path / "m.safetensors")
    ms.save_checkpoint({"z": W, "a": B, "m": W[:1]}, path, format="safetensors")
    assert list(ms.load_checkpoint(path, format="safetensors")) == ["a", "m", "z"]
    assert list(ms.load_checkpoint(path, format="safetensors", specify_prefix="z")) == ["z"]  # MindSpore ignores it


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"specify_prefix": "a."}, ["a.x", "a.y"]),
        ({"specify_prefix": ["a.", "c"]}, ["a.x", "a.y", "c"]),
        ({"specify_prefix": ("c",)}, ["c"]),
        ({"filter_prefix": "a."}, ["b.x", "bb", "c"]),
        ({"filter_prefix": ["a.", "b"]}, ["c"]),
        ({"specify_prefix": "a", "filter_prefix": "a.y"}, ["a.x"]),
        ({"specify_prefix": "b", "filter_prefix": "b."}, ["bb"]),
        ({"specify_prefix": "a", "choice_func": lambda n: n == "c"}, ["a.x", "a.y"]),  # prefixes win
        ({"choice_func": lambda n: n.startswith("b")}, ["b.x", "bb"]),
        ({"choice_func": lambda n: 1 if n == "c" else 0}, ["c"]),
    ],
)
def test_load_prefix_and_choice_rules(ckpt_file: str, kwargs: dict[str, Any], names: list[str]) -> None:
    assert list(ms.load_checkpoint(ckpt_file, **kwargs)) == names


BAD_LOADS: list[tuple[str, dict[str, Any], type[ReshardError]]] = [
    ("net", {"net": object()}, UnsupportedError),
    ("format", {"format": "npz"}, UsageError),
    ("format mismatch", {"format": "safetensors"}, UsageError),
    ("empty prefix", {"specify_prefix": ""}, UsageError),
    ("empty prefix in list", {"filter_prefix": ["a", ""]}, UsageError),
    ("empty list", {"specify_prefix": []}, UsageError),
    ("prefix int", {"specify_prefix": 3}, UsageError),
    ("prefix list of int", {"specify_prefix": ["a", 3]}, UsageError),
    ("nothing left", {"specify_prefix": "zzz"}, UsageError),
    ("choice rejects all", {"choice_func": lambda n: None}, UsageError),
    ("crc int", {"crc_check": 1}, UsageError),
    ("remove_redundancy int", {"remove_redundancy": 1}, UsageError),
    ("dec_key str", {"dec_key": "k"}, UsageError),
    ("dec_key on plain file", {"dec_key": bytes(16)}, CryptoError),
    ("choice not callable", {"choice_func": "a"}, UsageError),
]


@pytest.mark.parametrize(("case", "kwargs", "error"), BAD_LOADS, ids=[c[0] for c in BAD_LOADS])
def test_load_argument_errors(ckpt_file: str, case: str, kwargs: dict[str, Any], error: type[ReshardError]) -> None:
    with pytest.raises(error) as info:
        ms.load_checkpoint(ckpt_file, **kwargs)
    assert "\n" not in str(info.value)


def test_load_missing_and_wrong_files(tmp_path: Any) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        ms.load_checkpoint(str(tmp_path / "nope.ckpt"))
    (tmp_path / "d.ckpt").mkdir()
    with pytest.raises(UsageError):
        ms.load_checkpoint(str(tmp_path / "d.ckpt"))
    (tmp_path / "empty.ckpt").write_bytes(b"")
    with pytest.raises(FormatError):
        ms.load_checkpoint(str(tmp_path / "empty.ckpt"))
    with pytest.raises(UsageError):
        ms.load_checkpoint(3)  # type: ignore[arg-type]


def test_load_crc(tmp_path: Any, ckpt_file: str) -> None:
    with pytest.warns(UserWarning, match="no crc trailer"):
        assert list(ms.load_checkpoint(ckpt_file, crc_check=True))
    path = str(tmp_path / "crc.ckpt")
    ms.save_checkpoint({"w": W}, path, crc_check=True)
    assert np.array_equal(ms.load_checkpoint(path, crc_check=True)["w"], W)
    data = bytearray(_read(path))
    data[-30] ^= 1  # a data byte
    with open(path, "wb") as fh:
        fh.write(data)
    with pytest.raises(IntegrityError):
        ms.load_checkpoint(path, crc_check=True)
    assert ms.load_checkpoint(path)["w"].shape == (8, 4)  # the trailer is only checked on request


def test_load_safetensors_crc(tmp_path: Any) -> None:
    path = str(tmp_path / "m.safetensors")
    ms.save_checkpoint({"w": W, "b": B}, path, format="safetensors", crc_check=True)
    assert list(ms.load_checkpoint(path, format="safetensors", crc_check=True)) == ["b", "w"]
    save_safetensors(path, {"w": W}, {"format": "ms", "crc_num": "12345"})
    with pytest.raises(IntegrityError):
        ms.load_checkpoint(path, format="safetensors", crc_check=True)
    save_safetensors(path, {"w": W}, {"format": "ms", "crc_num": "x"})
    with pytest.raises(FormatError):
        ms.load_checkpoint(path, format="safetensors", crc_check=True)
    with pytest.raises(UsageError, match="dec_key"):
        ms.load_checkpoint(path, format="safetensors", dec_key=bytes(16))


# --------------------------------------------------------------------------------------------
# ckpt_to_safetensors / safetensors_to_ckpt


def test_convert_file_mode_round_trip_keeps_strings(tmp_path: Any) -> None:
    src = str(tmp_path / "m.ckpt")
    ms.save_checkpoint({"w": W, "note": "hello", "b": B}, src)
    ms.ckpt_to_safetensors(src, str(tmp_path / "st"), name_map={"w": "model.w"})
    out = str(tmp_path / "st" / "m.safetensors")
    assert list(ms.load_checkpoint(out, format="safetensors")) == ["b", "model.w"]
    ms.safetensors_to_ckpt(out, str(tmp_path / "back"))
    back = ms.load_checkpoint(str(tmp_path / "back" / "m.ckpt"))
    assert list(back) == ["b", "model.w", "note"] and back["note"] == "hello"


def test_convert_dir_mode_names_and_regex(tmp_path: Any) -> None:
    for folder in ("rank_0", "rankx", "other"):
        save_ckpt(str(tmp_path / "src" / folder / "net.ckpt"), {"w": W})
        save_ckpt(str(tmp_path / "src" / folder / "opt.ckpt.ckpt"), {"m": W})
    ms.ckpt_to_safetensors(str(tmp_path / "src"), str(tmp_path / "out"), file_name_regex="^opt")
    assert sorted(os.listdir(tmp_path / "out")) == ["rank_0", "rankx"]
    assert os.listdir(tmp_path / "out" / "rank_0") == ["opt.safetensors.safetensors"]  # every ".ckpt" replaced


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"save_path": "out.x"}, "directory"),
        ({"name_map": [1]}, "name_map"),
        ({"file_name_regex": "("}, "regular expression"),
        ({"file_name_regex": "zzz"}, "does not match"),
        ({"file_name_regex": 3}, "str"),
        ({"processes_num": 0}, "processes_num"),
        ({"processes_num": "2"}, "processes_num"),
    ],
)
def test_convert_argument_errors(tmp_path: Any, kwargs: dict[str, Any], match: str) -> None:
    src = str(tmp_path / "m.ckpt")
    ms.save_checkpoint({"w": W}, src)
    if "save_path" in kwargs:
        kwargs = {"save_path": str(tmp_path / kwargs["save_path"])}
    with pytest.raises(UsageError, match=match):
        ms.ckpt_to_safetensors(src, **kwargs)


def test_convert_missing_and_wrong_inputs(tmp_path: Any) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        ms.ckpt_to_safetensors(str(tmp_path / "nope"))
    src = str(tmp_path / "m.ckpt")
    ms.save_checkpoint({"w": W}, src)
    with pytest.raises(UsageError):
        ms.safetensors_to_ckpt(src)
    (tmp_path / "norank").mkdir()
    with pytest.raises(UsageError, match="rank"):
        ms.ckpt_to_safetensors(str(tmp_path / "norank"))


# --------------------------------------------------------------------------------------------
# strategies


@pytest.fixture
def strategies(tmp_path: Any) -> dict[str, str]:
    """a: 4 ranks (2x2), w rows over the outer axis, b over the inner; b: 2 ranks, w columns; pp: 2 stages of 2."""
    paths = {k: str(tmp_path / "strategy" / f"{k}.ckpt") for k in ("a", "b")}
    write_strategy(paths["a"], make_strategy({"w": L((2, 2), (1, -1)), "b": L((2, 2), (0,))}))
    write_strategy(paths["b"], make_strategy({"w": L((2,), (-1, 0)), "b": L((2,), (-1,))}))
    write_strategy(str(tmp_path / "strategy" / "a.json"), make_strategy({"w": L((2, 2), (1, -1))}))
    for stage, layouts in enumerate(({"w": L((2,), (0, -1))}, {"b": L((2,), (0,))})):
        write_strategy(str(tmp_path / "stages" / f"s{stage}.ckpt"), make_strategy(layouts, stage=stage))
    ms.merge_pipeline_strategys(str(tmp_path / "stages"), str(tmp_path / "strategy" / "pp.ckpt"))
    paths["pp"] = str(tmp_path / "strategy" / "pp.ckpt")
    paths["json"] = str(tmp_path / "strategy" / "a.json")
    return paths


def test_merge_pipeline_strategys(tmp_path: Any, strategies: dict[str, str]) -> None:
    layouts = ms.build_searched_strategy(strategies["pp"])
    assert sorted(layouts) == ["0-w", "1-b"]
    assert stat.S_IMODE(os.stat(strategies["pp"]).st_mode) == 0o666 & ~_umask()
    with pytest.raises(UsageError, match="not a directory"):
        ms.merge_pipeline_strategys(strategies["a"], str(tmp_path / "x.ckpt"))
    with pytest.raises(UsageError, match="is a directory"):
        ms.merge_pipeline_strategys(str(tmp_path / "stages"), str(tmp_path / "stages"))
    with pytest.raises(UsageError, match="json"):
        ms.merge_pipeline_strategys(str(tmp_path / "stages"), str(tmp_path / "merged.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError):
        ms.merge_pipeline_strategys(str(tmp_path / "empty"), str(tmp_path / "x.ckpt"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_build_searched_strategy(tmp_path: Any, strategies: dict[str, str]) -> None:
    layouts = ms.build_searched_strategy(strategies["a"])
    assert list(layouts) == ["w", "b"]
    w = layouts["w"]
    assert type(w).__name__ == "ParallelLayouts"
    assert list(w.dev_matrix[0].dim) == [2, 2] and list(w.tensor_map[0].dim) == [1, -1]
    assert w.field == 0 and w.opt_weight_shard_step == 0 and w.opt_weight_shard_size == 0
    from_json = ms.build_searched_strategy(strategies["json"])
    assert from_json["w"].SerializeToString() == w.SerializeToString()
    (tmp_path / "empty.ckpt").write_bytes(b"")
    (tmp_path / "garbage.ckpt").write_bytes(b"\xff\xff\xff")
    with pytest.raises(UsageError, match="empty"):
        ms.build_searched_strategy(str(tmp_path / "empty.ckpt"))
    with pytest.raises(FormatError):
        ms.build_searched_strategy(str(tmp_path / "garbage.ckpt"))
    for bad in (str(tmp_path / "nope.ckpt"), str(tmp_path), 3):
        with pytest.raises(UsageError):
            ms.build_searched_strategy(bad)  # type: ignore[arg-type]


def test_rank_list_for_transform(strategies: dict[str, str]) -> None:
    assert ms.rank_list_for_transform(3) == [0]
    assert ms.rank_list_for_transform(5, None, "/no/such/file") == [0]  # MindSpore does not read dst then
    lists = [ms.rank_list_for_transform(r, strategies["a"], strategies["b"]) for r in range(2)]
    assert lists == [[2, 1, 0], [3, 1, 0]]  # docs/formats.md §8.2 L5 for rank 1
    assert all(type(r) is int for r in lists[0])
    assert (
        ms.rank_list_for_transform(1, strategies["a"]) == sorted(ms.rank_list_for_transform(1, strategies["a"]))[::-1]
    )
    for bad in (-1, 2, "1", 1.0):
        with pytest.raises(UsageError, match="rank_id"):
            ms.rank_list_for_transform(bad, strategies["a"], strategies["b"])  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="rank_id"):
        ms.rank_list_for_transform(4, strategies["a"])  # dst None: ranks of the source's device matrix
    with pytest.raises(UsageError, match="no such strategy file"):
        ms.rank_list_for_transform(0, strategies["a"], "/no/such/file")


# --------------------------------------------------------------------------------------------
# transform_checkpoints / transform_checkpoint_by_rank


def _full(tmp_path: Any) -> str:
    folder = str(tmp_path / "full")
    save_ckpt(os.path.join(folder, "rank_0", "model.ckpt"), {"w": W, "b": B, "global_step": np.array([3], np.int64)})
    return folder


def test_transform_checkpoints_writes_mindspore_names(tmp_path: Any, strategies: dict[str, str]) -> None:
    dst = tmp_path / "a"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")  # an existing folder is fine (as in MindSpore); nothing else touched
    ms.transform_checkpoints(_full(tmp_path), str(dst), "checkpoint_", None, strategies["a"])
    assert sorted(os.listdir(dst)) == ["keep.txt", "rank_0", "rank_1", "rank_2", "rank_3"]
    assert os.listdir(dst / "rank_3") == ["checkpoint_3.ckpt"]
    r3 = ms.load_checkpoint(str(dst / "rank_3" / "checkpoint_3.ckpt"))
    assert list(r3) == ["w", "b", "global_step"]
    assert np.array_equal(r3["w"], W[4:]) and np.array_equal(r3["b"], B[2:])  # rank 3 = (1, 1)
    r1 = ms.load_checkpoint(str(dst / "rank_1" / "checkpoint_1.ckpt"))
    assert np.array_equal(r1["w"], W[:4]) and np.array_equal(r1["b"], B[2:])  # rank 1 = (0, 1)
    ms.transform_checkpoints(str(dst), str(tmp_path / "b"), "net_", strategies["a"], strategies["b"], process_num=2)
    r1 = ms.load_checkpoint(str(tmp_path / "b" / "rank_1" / "net_1.ckpt"))
    assert np.array_equal(r1["w"], W[:, 2:]) and np.array_equal(r1["b"], B)
    assert (dst / "keep.txt").read_text() == "mine"


def test_transform_checkpoints_by_stage(tmp_path: Any, strategies: dict[str, str]) -> None:
    """docs/formats.md §3.9: a single-stage source whose names are a strict subset of the destination's."""
    src = tmp_path / "stage1"
    for r in range(2):  # stage 1 of a 2x2 pipeline: ranks 2 and 3 hold b split over 2
        save_ckpt(str(src / f"rank_{2 + r}" / "c.ckpt"), {"b": B[2 * r : 2 * r + 2], "step": np.array([1], np.int32)})
    save_ckpt(str(src / "rank_0" / "c.ckpt"), {"w": W})
    write_strategy(str(tmp_path / "s1.ckpt"), make_strategy({"b": L((2,), (0,))}, stage=1))
    write_strategy(str(tmp_path / "dst.ckpt"), make_strategy({"w": L((2,), (0, -1)), "b": L((2,), (-1,))}))
    ms.transform_checkpoints(
        str(src), str(tmp_path / "out"), "p_", str(tmp_path / "s1.ckpt"), str(tmp_path / "dst.ckpt")
    )
    for k in range(2):
        assert os.listdir(tmp_path / "out" / f"rank_{k}") == [f"p_{k}_part1.ckpt"]
        loaded = ms.load_checkpoint(str(tmp_path / "out" / f"rank_{k}" / f"p_{k}_part1.ckpt"))
        assert list(loaded) == ["b", "step"] and np.array_equal(loaded["b"], B)
    (src / "rank_3" / "c.ckpt").unlink()
    with pytest.raises(UsageError, match="missing"):
        ms.transform_checkpoints(
            str(src), str(tmp_path / "o2"), "p_", str(tmp_path / "s1.ckpt"), str(tmp_path / "dst.ckpt")
        )


@pytest.mark.parametrize("prefix", ["", "  ", "../x", "a//b", "~a", "a/./.b", "./.", "a/b", "/abs", "a\x00", 3, None])
def test_transform_checkpoints_rejects_unsafe_prefixes(tmp_path: Any, strategies: dict[str, str], prefix: Any) -> None:
    with pytest.raises(UsageError, match="ckpt_prefix"):
        ms.transform_checkpoints(_full(tmp_path), str(tmp_path / "out"), prefix, None, strategies["a"])
    assert not os.path.exists(tmp_path / "out")


def test_transform_checkpoints_argument_errors(tmp_path: Any, strategies: dict[str, str]) -> None:
    full = _full(tmp_path)
    out = str(tmp_path / "out")
    with pytest.raises(UsageError, match="output_format"):
        ms.transform_checkpoints(full, out, "p", None, strategies["a"], output_format="npz")
    with pytest.raises(UsageError, match="safetensors"):
        ms.transform_checkpoints(full, out, "p", None, strategies["a"], output_format="safetensors")
    with pytest.raises(UsageError, match="process_num"):
        ms.transform_checkpoints(full, out, "p", None, strategies["a"], process_num=0)
    with pytest.raises(UsageError):
        ms.transform_checkpoints(str(tmp_path / "nope"), out, "p", None, strategies["a"])
    with pytest.raises(UsageError):
        ms.transform_checkpoints(str(tmp_path / "strategy"), out, "p", None, strategies["a"])  # no rank folders
    with pytest.raises(UsageError, match="no such strategy file"):
        ms.transform_checkpoints(full, out, "p", str(tmp_path / "nope.ckpt"), strategies["a"])
    save_ckpt(str(tmp_path / "full" / "rank_1" / "model.ckpt"), {"w": W})
    with pytest.raises(UsageError, match="strategy"):  # MindSpore would treat rank 0 as the full model
        ms.transform_checkpoints(full, out, "p", None, strategies["a"])
    save_safetensors(str(tmp_path / "full" / "rank_1" / "model.safetensors"), {"w": W})
    with pytest.raises(UsageError, match="both"):
        ms.transform_checkpoints(full, out, "p", strategies["b"], strategies["a"])
    assert not os.path.exists(out)


def test_transform_checkpoint_by_rank(tmp_path: Any, strategies: dict[str, str]) -> None:
    ms.transform_checkpoints(_full(tmp_path), str(tmp_path / "a"), "c_", None, strategies["a"])
    files = {r: str(tmp_path / "a" / f"rank_{r}" / f"c_{r}.ckpt") for r in (2, 1, 0)}
    out = str(tmp_path / "by_rank" / "r0.ckpt")
    ms.transform_checkpoint_by_rank(0, files, out, strategies["a"], strategies["b"])
    loaded = ms.load_checkpoint(out)
    assert list(loaded) == ["w", "b", "global_step"] and np.array_equal(loaded["w"], W[:, :2])
    with pytest.raises(UsageError, match="missing"):
        ms.transform_checkpoint_by_rank(0, {0: files[0]}, out, strategies["a"], strategies["b"])
    bad_calls: list[tuple[Any, Any, Any]] = [
        (0, files, str(tmp_path / "r0")),
        (0, files, str(tmp_path / "r0.safetensors")),
        (0, [files[0]], out),
        (0, {"0": files[0]}, out),
        (0, {0: str(tmp_path / "nope.ckpt")}, out),
        ("0", files, out),
        (2, files, out),
        (-1, files, out),
    ]
    for rank, mapping, name in bad_calls:
        with pytest.raises(UsageError):
            ms.transform_checkpoint_by_rank(rank, mapping, name, strategies["a"], strategies["b"])


# --------------------------------------------------------------------------------------------
# unified_safetensors / load_distributed_checkpoint


@pytest.fixture
def sharded(tmp_path: Any, strategies: dict[str, str]) -> str:
    """Strategy a as safetensors rank files, sliced by hand: rank (i, j) holds w rows 4i.., b half j."""
    folder = str(tmp_path / "sharded")
    for rank in range(4):
        i, j = divmod(rank, 2)
        values = {"w": W[4 * i : 4 * i + 4], "b": B[2 * j : 2 * j + 2], "global_step": np.array([5], np.int64)}
        save_safetensors(os.path.join(folder, f"rank_{rank}", "net-1_10.safetensors"), values, {"format": "ms"})
    return folder


def test_unified_safetensors_and_framework_free_load(tmp_path: Any, sharded: str, strategies: dict[str, str]) -> None:
    uni = str(tmp_path / "uni")
    ms.unified_safetensors(sharded, strategies["a"], uni, choice_func=lambda n: "model.w" if n == "w" else True)
    assert sorted(os.listdir(uni)) == ["hyper_param.safetensors", "param_name_map.json", "part0.safetensors"]
    part = ms.load_checkpoint(os.path.join(uni, "part0.safetensors"), format="safetensors")
    assert np.array_equal(part["model.w"], W) and np.array_equal(part["b"], B)
    ms.unified_safetensors(sharded, strategies["a"], str(tmp_path / "plain"))
    loaded = ms.load_distributed_checkpoint(
        None, predict_strategy=strategies["b"], format="safetensors", unified_safetensors_dir=str(tmp_path / "plain"),
        rank_id=1, return_param_dict=True,
    )  # fmt: skip
    assert list(loaded) == ["w", "b", "global_step"]  # strategy order, then hyper parameters (docs/formats.md §4.3)
    assert np.array_equal(loaded["w"], W[:, 2:]) and np.array_equal(loaded["b"], B)
    assert loaded["w"].flags.owndata
    assert not os.path.exists(os.path.join(str(tmp_path / "plain"), "__reshard_not_written__"))
    ms.load_distributed_checkpoint(
        None, predict_strategy=strategies["b"], format="safetensors", unified_safetensors_dir=str(tmp_path / "plain"),
        dst_safetensors_dir=str(tmp_path / "split"), output_format="ckpt",
    )  # fmt: skip
    assert sorted(os.listdir(tmp_path / "split")) == ["rank_0", "rank_1"]
    r0 = ms.load_checkpoint(str(tmp_path / "split" / "rank_0" / "net.ckpt"))
    assert list(r0) == ["w", "b", "global_step"]  # .ckpt: strategy order, then hyper parameters
    assert np.array_equal(r0["w"], W[:, :2])


def test_load_distributed_return_and_write(tmp_path: Any, sharded: str, strategies: dict[str, str]) -> None:
    ms.unified_safetensors(sharded, strategies["a"], str(tmp_path / "uni"))
    loaded = ms.load_distributed_checkpoint(
        None, predict_strategy=strategies["a"], format="safetensors", unified_safetensors_dir=str(tmp_path / "uni"),
        dst_safetensors_dir=str(tmp_path / "out"), rank_id=2, return_param_dict=True,
    )  # fmt: skip
    assert os.listdir(tmp_path / "out") == ["rank_2"]
    on_disk = ms.load_checkpoint(str(tmp_path / "out" / "rank_2" / "net.safetensors"), format="safetensors")
    assert list(on_disk) == sorted(loaded)  # safetensors loads sorted; the returned dict keeps strategy order
    assert all(np.array_equal(on_disk[k], loaded[k]) for k in loaded)


def test_unified_safetensors_argument_errors(tmp_path: Any, sharded: str, strategies: dict[str, str]) -> None:
    a, out = strategies["a"], str(tmp_path / "out")
    bad: list[dict[str, Any]] = [
        {"src_dir": a},
        {"src_strategy_file": str(tmp_path / "nope" / "x.ckpt")},
        {"split_dst_file": (3, 2)},
        {"split_dst_file": (1,)},
        {"split_dst_file": (0, 2)},
        {"split_dst_file": (2, 2)},  # a one-part model has nothing in the second half
        {"max_process_num": 0},
        {"choice_func": 3},
        {"merge_with_redundancy": "no"},
        {"file_suffix": 3},
        {"file_suffix": "zz"},
    ]
    for kwargs in bad:
        args = {"src_dir": sharded, "src_strategy_file": a, "dst_dir": out} | kwargs
        with pytest.raises(UsageError):
            ms.unified_safetensors(**args)
    with pytest.raises(UsageError, match="bool or str"):
        ms.unified_safetensors(sharded, a, out, choice_func=lambda n: 1)
    assert not os.path.exists(out)


def test_load_distributed_argument_errors(tmp_path: Any, sharded: str, strategies: dict[str, str]) -> None:
    uni = str(tmp_path / "uni")
    ms.unified_safetensors(sharded, strategies["a"], uni)
    base = {"predict_strategy": strategies["b"], "format": "safetensors", "unified_safetensors_dir": uni,
            "dst_safetensors_dir": str(tmp_path / "out")}  # fmt: skip
    unsupported: list[tuple[Any, dict[str, Any]]] = [
        (object(), {}),
        (None, {"format": "ckpt"}),
        (None, {"predict_strategy": None}),
        (None, {"predict_strategy": {"w": [[2], [0, -1]]}}),
    ]
    for network, kwargs in unsupported:
        with pytest.raises(UnsupportedError):
            ms.load_distributed_checkpoint(network, **(base | kwargs))
    usage: list[dict[str, Any]] = [
        {"checkpoint_filenames": ["a"]},
        {"train_strategy_filename": "x"},
        {"dec_key": bytes(16)},
        {"strict_load": True},
        {"dec_mode": "AES-CBC"},
        {"unified_safetensors_dir": None},
        {"dst_safetensors_dir": None},
        {"return_param_dict": True, "dst_safetensors_dir": None},  # needs rank_id
        {"rank_id": 2},
        {"rank_id": -1},
        {"output_format": "npz"},
        {"name_map": [1]},
        {"max_process_num": 0},
        {"return_param_dict": 1},
        {"predict_strategy": str(tmp_path / "nope.ckpt")},
    ]
    for kwargs in usage:
        with pytest.raises(UsageError):
            ms.load_distributed_checkpoint(None, **(base | kwargs))
    assert not os.path.exists(tmp_path / "out")


def test_public_names_match_mindspore() -> None:
    assert sorted(ms.__all__) == sorted(
        [
            "build_searched_strategy", "ckpt_to_safetensors", "load_checkpoint", "load_distributed_checkpoint",
            "merge_pipeline_strategys", "rank_list_for_transform", "safetensors_to_ckpt", "save_checkpoint",
            "transform_checkpoint_by_rank", "transform_checkpoints", "unified_safetensors",
            # shared with mindspore.parallel (reshard.mindspore.parallel), and the Parameter they take
            "Parameter", "load_segmented_checkpoints", "merge_sliced_parameter", "restore_group_info_list",
            "sync_pipeline_shared_parameters",
        ]
    )  # fmt: skip
