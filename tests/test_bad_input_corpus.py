"""Every bad input gets a clean answer from the CLI: exit code 2, one stderr line naming the file and
the problem, no traceback, nothing left behind (no output, no temporary file), inputs unchanged
(content, mode and mtime). Plus the full-disk and unwritable-destination cases on real mounts, and
several candidate files in one rank folder (not an error: said on stderr)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from reshard import api, manifest
from reshard.formats import ckpt
from reshard.formats.ckpt import save_ckpt
from reshard.formats.safetensors import save_safetensors
from reshard.formats.strategy import load_strategy, make_strategy, write_strategy
from reshard.layout import ParamLayout
from reshard.synthetic import ModelShape
from tests import checkpoint2_fixtures as fx
from tests.lowprec_fixtures import EXPERTS, K, Q, fp8_model, fp8_tensors
from tests.test_cp2_read_format import BAD as CHECKPOINT2_BAD
from tests.test_cp2_read_format import ITER as CHECKPOINT2_ITERATION
from tests.trust_helpers import make_job, run_cli, snapshot, temp_files

Case = Callable[[Path, dict[str, str]], tuple[list[str], str]]  # -> (CLI args, text the line must hold)
OUT = "{out}"  # placeholder for the output folder of a case


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("job"))
    job = make_job(root)
    api.unify(job["r8st"], job["s8"], f"{root}/unified")
    job["unified"] = f"{root}/unified"
    return job


def _copy_tree(tmp: Path, src: str, name: str = "src") -> str:
    dst = tmp / name
    shutil.copytree(src, dst, copy_function=shutil.copy2)
    return str(dst)


def _truncate(path: str, keep: float = 0.5) -> None:
    size = os.path.getsize(path)
    os.truncate(path, int(size * keep))


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)


def _transform(src: str, s_src: str, s_dst: str, *extra: str) -> list[str]:
    return ["transform", "--src", src, "--dst", OUT, "--src-strategy", s_src, "--dst-strategy", s_dst, *extra]


def _rank_file(tree: str, rank: int, fmt: str = "ckpt") -> str:
    return os.path.join(tree, f"rank_{rank}", f"checkpoint_{rank}.{fmt}")


# ------------------------------------------------------------------------------------ .ckpt


def ckpt_truncated(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _copy_tree(tmp, job["r8"])
    _truncate(_rank_file(src, 3))
    return _transform(src, job["s8"], job["s4"]), "checkpoint_3.ckpt: truncated"


def ckpt_garbage_header(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _copy_tree(tmp, job["r8"])
    _patch(_rank_file(src, 5), 0, b"\xff" * 16)
    return _transform(src, job["s8"], job["s4"]), "checkpoint_5.ckpt"


def ckpt_bit_flips(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _copy_tree(tmp, job["r8"])
    path = _rank_file(src, 0)
    _patch(path, 1, b"\x80\x80\x80\x80\x0f")  # the first record's length: a huge varint
    return _transform(src, job["s8"], job["s4"]), "checkpoint_0.ckpt"


def ckpt_lying_dims(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    path = tmp / "lie.ckpt"
    path.write_bytes(ckpt._record_head(b"w", [100], b"Float32", 8) + bytes(8))  # dims say 400 bytes
    return ["convert", str(path), OUT, "--to", "safetensors"], "lie.ckpt"


def ckpt_unknown_dtype(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    path = tmp / "dtype.ckpt"
    path.write_bytes(ckpt._record_head(b"w", [2], b"Float99", 8) + bytes(8))
    return ["convert", str(path), OUT, "--to", "safetensors"], "Float99"


def ckpt_crc_mismatch(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    path = tmp / "crc.ckpt"
    save_ckpt(path, {"w": np.arange(32, dtype=np.float32)}, write_crc=True)
    _patch(str(path), os.path.getsize(path) - 30, b"\x01")
    return ["convert", str(path), OUT, "--to", "safetensors", "--check-crc"], "crc mismatch"


def ckpt_encrypted_no_key(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    path = tmp / "enc.ckpt"
    save_ckpt(path, {"w": np.arange(4, dtype=np.float32)}, enc_key=bytes(16))
    return ["convert", str(path), OUT, "--to", "safetensors"], "encrypted"


def ckpt_wrong_key(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    path = tmp / "enc.ckpt"
    save_ckpt(path, {"w": np.arange(4, dtype=np.float32)}, enc_key=bytes(16))
    key = tmp / "key.bin"
    key.write_bytes(b"\x01" * 16)
    return ["convert", str(path), OUT, "--to", "safetensors", "--dec-key-file", str(key)], "wrong key"


def ckpt_empty_file(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _copy_tree(tmp, job["r8"])
    _truncate(_rank_file(src, 6), 0)
    return _transform(src, job["s8"], job["s4"]), "checkpoint_6.ckpt"


# ------------------------------------------------------------------------------------ safetensors


def _st_header(path: str) -> tuple[dict, int]:
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), n


def _st_rewrite(path: str, header: dict, length: int) -> None:
    """Same header length (padded), so the data stays where it was."""
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    _patch(path, 8, text + b" " * (length - len(text)))


def st_truncated(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _copy_tree(tmp, job["r8st"])
    _truncate(_rank_file(src, 2, "safetensors"), 0.7)
    return _transform(src, job["s8"], job["s4"]), "checkpoint_2.safetensors"


def st_lying_offsets(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _copy_tree(tmp, job["r8st"])
    path = _rank_file(src, 1, "safetensors")
    header, n = _st_header(path)
    name = next(k for k in header if k != "__metadata__")
    header.pop("__metadata__", None)  # room for the longer numbers
    header[name]["data_offsets"] = [0, 10**9]
    _st_rewrite(path, header, n)
    return _transform(src, job["s8"], job["s4"]), "checkpoint_1.safetensors"


def st_header_length_too_big(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _copy_tree(tmp, job["r8st"])
    _patch(_rank_file(src, 4, "safetensors"), 0, struct.pack("<Q", 2**40))
    return _transform(src, job["s8"], job["s4"]), "checkpoint_4.safetensors"


def st_unknown_dtype(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _copy_tree(tmp, job["r8st"])
    path = _rank_file(src, 7, "safetensors")
    header, n = _st_header(path)
    name = next(k for k in header if k != "__metadata__")
    header[name]["dtype"] = "Q8"
    _st_rewrite(path, header, n)
    return _transform(src, job["s8"], job["s4"]), "checkpoint_7.safetensors"


def st_bad_json(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _copy_tree(tmp, job["r8st"])
    _patch(_rank_file(src, 0, "safetensors"), 8, b"{{{{")
    return _transform(src, job["s8"], job["s4"]), "checkpoint_0.safetensors"


def st_unify_corrupt_part(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _copy_tree(tmp, job["r8st"])
    _truncate(_rank_file(src, 3, "safetensors"), 0.3)
    return ["unify", src, OUT, "--src-strategy", job["s8"]], "checkpoint_3.safetensors"


def split_corrupt_unified(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _copy_tree(tmp, job["unified"])
    _truncate(os.path.join(src, "part0.safetensors"), 0.5)
    return ["split", src, OUT, "--dst-strategy", job["s4"]], "part0.safetensors"


def split_bad_index(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _copy_tree(tmp, job["unified"])
    shutil.copy2(os.path.join(src, "part0.safetensors"), os.path.join(src, "part1.safetensors"))
    Path(src, "param_name_map.json").write_text("{not json")
    return ["split", src, OUT, "--dst-strategy", job["s4"]], "param_name_map.json"


# ------------------------------------------------------------------------------------ strategies


def strategy_truncated(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    path = tmp / "s8.ckpt"
    shutil.copy2(job["s8"], path)
    _truncate(str(path), 0.6)
    return _transform(job["r8"], str(path), job["s4"]), "s8.ckpt"


def strategy_bad_json(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    path = tmp / "s.json"
    path.write_text('{"parallel_strategy_item": [1, 2')
    return _transform(job["r8"], str(path), job["s4"]), "s.json"


def _wrong_ndim_strategy(tmp: Path, job: dict[str, str]) -> str:
    """The job's strategy, but a 1-D norm weight gets a 2-D tensor map."""
    sf = load_strategy(job["s8"])
    layouts = dict(sf.layouts)
    key = "1-model.norm_out.weight"
    layouts[key] = dataclasses.replace(layouts[key], tensor_map=(0, -1))
    path = tmp / "wrong_ndim.ckpt"
    write_strategy(path, dataclasses.replace(sf, layouts=layouts, path=None))
    return str(path)


def strategy_not_matching_shapes(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _transform(job["r8"], _wrong_ndim_strategy(tmp, job), job["s4"]), "tensor map"


def strategy_rank_count(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _transform(job["r8"], job["s4"], job["s8"]), "rank"


def layout_not_dividing(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    full = tmp / "full.ckpt"
    save_ckpt(full, {"w": np.zeros((8, 4), np.float32)})
    write_strategy(tmp / "s3.ckpt", make_strategy({"w": ParamLayout((3,), (0, -1))}))
    return ["transform", "--src", str(full), "--dst", OUT, "--dst-strategy", str(tmp / "s3.ckpt")], "divid"


def merge_garbage(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    folder = tmp / "stages"
    folder.mkdir()
    shutil.copy2(os.path.join(job["s8dir"], "ckpt_strategy_rank_0.ckpt"), folder)
    (folder / "ckpt_strategy_rank_4.ckpt").write_bytes(b"\x0a\xff\xff\xff\xff\x0fgarbage")
    return ["merge-strategies", str(folder), OUT + "/merged.ckpt"], "ckpt_strategy_rank_4.ckpt"


# ------------------------------------------------------------------------------------ folders and paths


def missing_rank_folder(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _copy_tree(tmp, job["r8"])
    shutil.rmtree(os.path.join(src, "rank_5"))
    return _transform(src, job["s8"], job["s4"]), "src: no folder for rank(s) 5"


def missing_rank_file(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _copy_tree(tmp, job["r8"])
    os.unlink(_rank_file(src, 2))
    return _transform(src, job["s8"], job["s4"]), "rank_2: rank 2's folder is empty"


def missing_source(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _transform(str(tmp / "nowhere"), job["s8"], job["s4"]), "nowhere"


def missing_strategy(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _transform(job["r8"], str(tmp / "nope.ckpt"), job["s4"]), "nope.ckpt"


def dst_inside_source(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _copy_tree(tmp, job["r8"])
    return [
        "transform",
        "--src",
        src,
        "--dst",
        os.path.join(src, "rank_0", "out"),
        "--src-strategy",
        job["s8"],
        "--dst-strategy",
        job["s4"],
    ], "inside the source"


def dst_not_empty(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    out = tmp / "busy"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    args = _transform(job["r8"], job["s8"], job["s4"])
    args[args.index(OUT)] = str(out)
    return args, "not empty"


def dst_under_a_file(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    (tmp / "afile").write_text("x")
    args = _transform(job["r8"], job["s8"], job["s4"])
    args[args.index(OUT)] = str(tmp / "afile" / "out")
    return args, "afile is not a folder"


def convert_wrong_extension(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    path = tmp / "model.bin"
    path.write_bytes(b"x" * 10)
    return ["convert", str(path), OUT, "--to", "safetensors"], "model.bin"


def bad_name_map(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    (tmp / "map.json").write_text("[1, 2]")
    return ["convert", job["full"], OUT, "--to", "safetensors", "--name-map", str(tmp / "map.json")], "map.json"


def rank_out_of_range(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _transform(job["r8"], job["s8"], job["s4"], "--ranks", "4"), "out of range"


def verify_corrupt_side(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    path = tmp / "bad.ckpt"
    shutil.copy2(job["full"], path)
    _truncate(str(path), 0.5)
    return ["verify", job["full"], str(path)], "bad.ckpt"


def inspect_truncated(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _copy_tree(tmp, job["r8"])
    _truncate(_rank_file(src, 1), 0.3)
    return ["inspect", _rank_file(src, 1)], "checkpoint_1.ckpt"


# ------------------------------------------------------------------------------------ flags and commands


def _unify(job: dict[str, str], *extra: str, strategy: str = "s8") -> list[str]:
    return ["unify", job["r8st"], OUT, "--src-strategy", job[strategy], *extra]


def unify_other_rank_count(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _unify(job, strategy="s4"), "s4.ckpt: the strategy describes 4 rank(s)"


def unify_split_not_a_number(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _unify(job, "--split", "x"), "not a part group: 'x'"


def unify_split_three_numbers(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _unify(job, "--split", "1/2/3"), "not a part group: '1/2/3'"


def unify_split_empty_group(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _unify(job, "--split", "2/2"), "--split 2/2: that part group is empty"


def unify_ckpt_rank_folders(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return ["unify", job["r8"], OUT, "--src-strategy", job["s8"]], "hold .ckpt files and unify reads .safetensors"


def unify_missing_rank_folder(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _copy_tree(tmp, job["r8st"])
    shutil.rmtree(os.path.join(src, "rank_5"))
    return ["unify", src, OUT, "--src-strategy", job["s8"]], "src: no folder for rank(s) 5"


def split_given_rank_folders(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return ["split", job["r8st"], OUT, "--dst-strategy", job["s4"]], "holds rank_<r> folders, not a unified model"


def src_is_one_rank_folder(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return (
        _transform(os.path.join(job["r8"], "rank_0"), job["s8"], job["s4"]),
        f"give the folder holding the rank_<r> folders ({job['r8']})",
    )


def prefix_absolute(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    """``--prefix /abs/abs_`` wrote ``/abs/abs_0.ckpt``, outside ``--dst``."""
    return _transform(job["r8"], job["s8"], job["s4"], "--prefix", str(tmp / "abs_")), "contains a path separator"


def prefix_parent(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _transform(job["r8"], job["s8"], job["s4"], "--prefix", "..evil_"), "contains '..'"


def prefix_subfolder(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return (
        ["transform", "--src", job["full"], "--dst", OUT, "--dst-strategy", job["s4"], "--prefix", "a/b_"],
        "may not lead out of it",
    )


def ranks_twice(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _transform(job["r8"], job["s8"], job["s4"], "--ranks", "1,1,1"), "names rank 1 more than once"


def ranks_backwards(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _transform(job["r8"], job["s8"], job["s4"], "--ranks", "3-1"), "runs backwards"


def ranks_empty(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _transform(job["r8"], job["s8"], job["s4"], "--ranks", ""), "names no rank"


def ranks_beyond_destination(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _transform(job["r8"], job["s8"], job["s4"], "--ranks", "0,9"), "out of range 0..3"


def rank_list_beyond_destination(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return (
        ["rank-list", "9", "--src-strategy", job["s8"], "--dst-strategy", job["s4"]],
        "destination rank 9 out of range: the destination strategy has 4 ranks",
    )


def demo_dir_is_a_file(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    (tmp / "afile").write_text("x")
    return ["demo", "--dir", str(tmp / "afile")], "--dir is a file"


def demo_dir_not_empty(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    (tmp / "mine").mkdir()
    (tmp / "mine" / "full").mkdir()
    (tmp / "mine" / "notes.txt").write_text("keep me")
    return ["demo", "--dir", str(tmp / "mine")], "--dir is not empty"


def workers_zero(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _transform(job["r8"], job["s8"], job["s4"], "--workers", "0"), "--workers: '0': must be at least 1"


def max_memory_zero(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _transform(job["r8"], job["s8"], job["s4"], "--max-memory", "0"), "must be more than 0"


def no_shared_disk_without_ray(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _transform(job["r8"], job["s8"], job["s4"], "--no-shared-disk"), "--no-shared-disk applies to --executor ray"


def ray_address_without_ray(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return (
        _transform(job["r8"], job["s8"], job["s4"], "--ray-address", "127.0.0.1:1"),
        "--ray-address applies to --executor ray",
    )


def _plan(job: dict[str, str], *flags: str) -> list[str]:
    return ["plan", "--src", job["r8"], "--dst", OUT, "--src-strategy", job["s8"], "--dst-strategy", job["s4"], *flags]


def plan_resume(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _plan(job, "--resume"), "reshard plan: unknown flag --resume (a flag of "


def plan_picture_exists(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    (tmp / "mine.svg").write_text("<svg/>")  # the user's file: replaced only with --overwrite
    return _plan(
        job, "--picture", str(tmp / "mine.svg")
    ), "mine.svg: the picture (--picture) file exists (use --overwrite"


def plan_progress(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _plan(job, "--progress"), "reshard plan: unknown flag --progress (a flag of "


def verify_rank_folders_without_strategy(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return ["verify", job["full"], job["r8"]], "give --b-strategy"


def file_suffix_matches_nothing(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _transform(job["r8"], job["s8"], job["s4"], "--file-suffix", "-9_9"), "no *-9_9.ckpt file"


def key_format_hex_not_hex(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    path = tmp / "enc.ckpt"
    save_ckpt(path, {"w": np.arange(4, dtype=np.float32)}, enc_key=bytes(16))
    (tmp / "key.bin").write_bytes(b"0123456789ABCDEF")
    return (
        [
            "convert",
            str(path),
            OUT,
            "--to",
            "safetensors",
            "--dec-key-file",
            str(tmp / "key.bin"),
            "--key-format",
            "hex",
        ],
        "--key-format hex: the key file must hold",
    )


def ray_address_nobody_answers(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    address = f"127.0.0.1:{_closed_port()}"
    return (
        _transform(job["r8"], job["s8"], job["s4"], "--executor", "ray", "--ray-address", address),
        "no Ray cluster answers there",
    )


def _closed_port() -> int:
    """A local port nobody listens on (bound, then released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


CASES: list[Case] = [
    ckpt_truncated,
    ckpt_garbage_header,
    ckpt_bit_flips,
    ckpt_lying_dims,
    ckpt_unknown_dtype,
    ckpt_crc_mismatch,
    ckpt_encrypted_no_key,
    ckpt_wrong_key,
    ckpt_empty_file,
    st_truncated,
    st_lying_offsets,
    st_header_length_too_big,
    st_unknown_dtype,
    st_bad_json,
    st_unify_corrupt_part,
    split_corrupt_unified,
    split_bad_index,
    strategy_truncated,
    strategy_bad_json,
    strategy_not_matching_shapes,
    strategy_rank_count,
    layout_not_dividing,
    merge_garbage,
    missing_rank_folder,
    missing_rank_file,
    missing_source,
    missing_strategy,
    dst_inside_source,
    dst_not_empty,
    dst_under_a_file,
    convert_wrong_extension,
    bad_name_map,
    rank_out_of_range,
    verify_corrupt_side,
    inspect_truncated,
    unify_other_rank_count,
    unify_split_not_a_number,
    unify_split_three_numbers,
    unify_split_empty_group,
    unify_ckpt_rank_folders,
    unify_missing_rank_folder,
    split_given_rank_folders,
    src_is_one_rank_folder,
    prefix_absolute,
    prefix_parent,
    prefix_subfolder,
    ranks_twice,
    ranks_backwards,
    ranks_empty,
    ranks_beyond_destination,
    rank_list_beyond_destination,
    demo_dir_is_a_file,
    demo_dir_not_empty,
    workers_zero,
    max_memory_zero,
    no_shared_disk_without_ray,
    ray_address_without_ray,
    plan_resume,
    plan_picture_exists,
    plan_progress,
    verify_rank_folders_without_strategy,
    file_suffix_matches_nothing,
    key_format_hex_not_hex,
]


# ---------------------------------------------------------------------------- MindFormers Checkpoint 2.0


def _checkpoint2(tmp: Path) -> Path:
    root = tmp / "mf2"
    fx.write_checkpoint2(str(root), fx.dp2_tp4_params(), 8)
    return root


def _spoiled_checkpoint2(name: str) -> Case:
    """One of the reader's spoilt trees (tests/test_cp2_read_format.py BAD), through transform."""

    def case(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
        root = _checkpoint2(tmp)
        spoil, expected = CHECKPOINT2_BAD[name]
        spoil(root / CHECKPOINT2_ITERATION)
        return ["transform", "--src", str(root), "--dst", OUT], expected

    case.__name__ = "checkpoint2_" + name.replace("-", "_")
    return case


def checkpoint2_tracker_names_a_missing_iteration(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    root = _checkpoint2(tmp)
    (root / "latest_checkpointed_iteration.txt").write_text("12")
    return ["transform", "--src", str(root), "--dst", OUT], "names iteration 12 but iteration_00000012 is missing"


def checkpoint2_with_a_source_strategy(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    root = _checkpoint2(tmp)
    return ["transform", "--src", str(root), "--src-strategy", job["s8"], "--dst", OUT], "give no source strategy"


def checkpoint2_output_with_hf(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return [
        "transform", "--src", job["r8"], "--src-strategy", job["s8"], "--dst", OUT, "--output-format", "checkpoint2",
        "--hf",
    ], "not a Hugging Face model"  # fmt: skip


def checkpoint2_negative_iteration(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return [
        "transform", "--src", job["r8"], "--src-strategy", job["s8"], "--dst", OUT, "--dst-strategy", job["s4"],
        "--output-format", "checkpoint2", "--dst-iteration", "-3",
    ], "iteration"  # fmt: skip


def checkpoint2_iteration_of_rank_folders(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return [
        "transform", "--src", job["r8"], "--src-strategy", job["s8"], "--dst", OUT, "--src-iteration", "3",
    ], "applies to a MindFormers Checkpoint 2.0 or a Megatron-LM run folder only"  # fmt: skip


def checkpoint2_ranks_read_a_file_not_copied(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    root = _checkpoint2(tmp)  # a node holding rank 0's files only; a full model reads every rank's
    for path in (root / CHECKPOINT2_ITERATION).glob("*-000000[1-7]-0000008.safetensors"):
        path.unlink()
    args = ["transform", "--src", str(root), "--dst", OUT, "--ranks", "0"]
    return args, ", named in metadata.json storage_data, is missing, and destination rank 0 reads"


def checkpoint2_common_json_with_an_unknown_key(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    bad = tmp / "bad_common.json"
    bad.write_text('{"bogus": 1, "global_step": 3}')
    return [
        "transform", "--src", job["r8"], "--src-strategy", job["s8"], "--dst", OUT, "--dst-strategy", job["s4"],
        "--output-format", "checkpoint2", "--common-json", str(bad),
    ], f"{bad}: holds key(s) bogus, which common.json does not have"  # fmt: skip


def checkpoint2_unfinished_reshard_output(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    root = _checkpoint2(tmp)  # what a reshard run stopped before metadata.json leaves: its journal
    os.remove(root / CHECKPOINT2_ITERATION / "metadata.json")
    os.remove(root / "latest_checkpointed_iteration.txt")
    (root / manifest.JOURNAL_NAME).write_text("")
    return ["inspect", str(root)], "an unfinished reshard run"


CASES += [
    _spoiled_checkpoint2(name) for name in sorted(__import__("tests.test_cp2_read_format").test_cp2_read_format.BAD)
]
CASES += [
    checkpoint2_ranks_read_a_file_not_copied,
    checkpoint2_common_json_with_an_unknown_key,
    checkpoint2_unfinished_reshard_output,
    checkpoint2_tracker_names_a_missing_iteration,
    checkpoint2_with_a_source_strategy,
    checkpoint2_output_with_hf,
    checkpoint2_negative_iteration,
    checkpoint2_iteration_of_rank_folders,
]


# ------------------------------------------------------------------------------------ block-scaled low precision


def _dequantize(src: Path) -> list[str]:
    return ["transform", "--src", str(src), "--dst", OUT, "--hf", "--dequantize", "bf16"]


def fp8_weight_without_scale(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _dequantize(fp8_model(tmp / "m", drop=(Q + "_scale_inv",))), f"{Q}: a Float8E4M3FN weight without"


def fp8_scale_without_weight(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _dequantize(fp8_model(tmp / "m", drop=(Q,))), f"{Q}_scale_inv: a block scale without its weight"


def fp8_scale_wrong_shape(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    t = fp8_tensors()
    t[Q + "_scale_inv"] = np.ones((2, 3), dtype=np.float32)
    return _dequantize(fp8_model(tmp / "m", t)), f"{Q}_scale_inv: shape [2, 3] does not fit"


def fp8_block_size_unknown(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _dequantize(fp8_model(tmp / "m", block=None)), "block size unknown"


def fp8_nan_scale(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    t = fp8_tensors()
    t[Q + "_scale_inv"] = t[Q + "_scale_inv"].copy()
    t[Q + "_scale_inv"][2, 1] = np.nan
    return _dequantize(fp8_model(tmp / "m", t)), f"{Q}_scale_inv: 1 block scale(s) are NaN or infinite"


def fp8_inf_scale(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    t = fp8_tensors()
    t[K + "_scale_inv"] = t[K + "_scale_inv"].copy()
    t[K + "_scale_inv"][1, 0] = np.inf  # a BF16 scale
    return _dequantize(fp8_model(tmp / "m", t)), f"{K}_scale_inv: 1 block scale(s) are NaN or infinite"


def _split_k_columns(tmp: Path, src: Path) -> list[str]:
    """Split ``src`` to 2 ranks cutting K's columns at 128 (on the block grid), its pairs moved as pairs."""
    strategy = tmp / "s2.ckpt"
    write_strategy(strategy, make_strategy({K: ParamLayout((2,), (-1, 0))}))
    return ["split", str(src), OUT, "--dst-strategy", str(strategy)]


def fp8_pair_split_scale_wrong_shape(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    t = fp8_tensors()
    t[K + "_scale_inv"] = t[K + "_scale_inv"][:1, :1].copy()
    return _split_k_columns(tmp, fp8_model(tmp / "m", t)), f"{K}_scale_inv: shape [1, 1] does not fit weight"


def fp8_pair_split_block_size_unknown(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _split_k_columns(tmp, fp8_model(tmp / "m", block=None)), f"{K}: the destination strategy cuts"


def mxfp4_nan_scale(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    t = fp8_tensors()
    t[EXPERTS + "_scales"] = t[EXPERTS + "_scales"].copy()
    t[EXPERTS + "_scales"][0, 0, 0] = 255  # E8M0's NaN
    return _dequantize(fp8_model(tmp / "m", t)), f"{EXPERTS}_scales: 1 block scale(s) are NaN or infinite"


def mxfp4_blocks_without_scales(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return _dequantize(fp8_model(tmp / "m", drop=(EXPERTS + "_scales",))), "MXFP4 blocks without their scales"


def dequantize_unknown_dtype(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return [*_dequantize(fp8_model(tmp / "m"))[:-1], "int8"], "unknown --dequantize 'int8'"


def quantize_nan_weight(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = tmp / "m"
    src.mkdir()
    w = np.ones((200, 200), dtype=np.float32)
    w[150, 3] = np.nan
    save_safetensors(src / "model.safetensors", {"a.weight": w})
    args = ["transform", "--src", str(src), "--dst", OUT, "--hf", "--quantize", "fp8-block"]
    return args, "a.weight: block [1, 0] holds NaN or infinite values"


def quantize_infinite_bf16_weight(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    """A bf16 weight's scales are computed on its bits: an infinity in a partial edge block is found there."""
    import ml_dtypes

    src = tmp / "m"
    src.mkdir()
    w = np.ones((200, 300), dtype=np.float32)
    w[150, 290] = -np.inf
    save_safetensors(src / "model.safetensors", {"a.weight": w.astype(ml_dtypes.bfloat16)})
    args = ["transform", "--src", str(src), "--dst", OUT, "--hf", "--quantize", "fp8-block"]
    return args, "a.weight: block [1, 2] holds NaN or infinite values"


def quantize_a_quantized_model(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    args = ["transform", "--src", str(fp8_model(tmp / "m")), "--dst", OUT, "--hf", "--quantize", "fp8-block"]
    return args, "already block-quantized"


def quantize_an_mxfp4_model(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    """Its expert pairs stay MXFP4 while the floats would become FP8 under one quantization_config: refused."""
    t = {k: v for k, v in fp8_tensors().items() if k not in (Q, K, Q + "_scale_inv", K + "_scale_inv")}
    args = ["transform", "--src", str(fp8_model(tmp / "m", t)), "--dst", OUT, "--hf", "--quantize", "fp8-block"]
    return args, f"{EXPERTS}_blocks: already block-quantized"


def quantize_unknown_scheme(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    args = ["transform", "--src", str(fp8_model(tmp / "m")), "--dst", OUT, "--hf", "--quantize", "int4"]
    return args, "unknown --quantize 'int4'"


def quantize_and_dequantize(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return [*_dequantize(fp8_model(tmp / "m")), "--quantize", "fp8-block"], "exclude each other"


def fp8_pair_dcp_ranks_without_a_block_size(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = str(fp8_model(tmp / "m", block=None))
    args = ["transform", "--src", src, "--dst", OUT, "--output-format", "dcp", "--dcp-ranks", "2"]
    return args, f"{Q}: --dcp-ranks 2 cuts this FP8 weight's rows, and its block size is unknown"


def fp8_dcp_source_dequantized(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    from reshard import api

    api.transform(str(fp8_model(tmp / "m")), str(tmp / "dcp"), output=api.OutputSpec(format="dcp"))
    (tmp / "dcp" / "config.json").unlink()  # as torch saves it: reshard writes the block size beside .metadata
    # dequantized like its safetensors (test_lowprec_dcp_source), but this DCP folder has no config.json
    return _dequantize(tmp / "dcp"), "FP8 block size unknown: no config.json beside the source gives"


CASES += [
    fp8_pair_dcp_ranks_without_a_block_size,
    fp8_dcp_source_dequantized,
    quantize_nan_weight,
    quantize_infinite_bf16_weight,
    quantize_a_quantized_model,
    quantize_an_mxfp4_model,
    quantize_unknown_scheme,
    quantize_and_dequantize,
    fp8_weight_without_scale,
    fp8_scale_without_weight,
    fp8_scale_wrong_shape,
    fp8_block_size_unknown,
    fp8_nan_scale,
    fp8_inf_scale,
    fp8_pair_split_scale_wrong_shape,
    fp8_pair_split_block_size_unknown,
    mxfp4_nan_scale,
    mxfp4_blocks_without_scales,
    dequantize_unknown_dtype,
]

# ------------------------------------------------------------------------------------ PyTorch DCP sources


def _dcp(tmp: Path, job: dict[str, str]) -> Path:
    """The job's full model as a DCP folder of two ranks (dim 0 split unevenly), written by reshard."""
    from reshard.formats import dcp
    from reshard.sources import open_checkpoint
    from tests.test_dcp_ops import chunked_files

    with open_checkpoint(job["full"]) as index:
        tensors = {name: np.array(index.array(name)) for name in index.entries}
    dcp.save_dcp(tmp / "dcp", tensors, chunked_files(tensors), {"extra_state": b"opaque"})
    return tmp / "dcp"


def dcp_truncated_distcp(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _dcp(tmp, job)
    _truncate(str(src / "__1_0.distcp"), 0.5)
    return ["transform", str(src), OUT, "--output-format", "safetensors"], "__1_0.distcp"


def dcp_metadata_names_a_missing_file(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _dcp(tmp, job)
    os.remove(src / "__2_0.distcp")
    return ["unify", str(src), OUT], "__2_0.distcp"


def dcp_with_a_source_strategy(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _dcp(tmp, job)
    return ["transform", str(src), OUT, "--src-strategy", job["s4"]], "carries its layouts in .metadata"


def dcp_dst_iteration_for_dcp(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    args = ["transform", str(_dcp(tmp, job)), OUT, "--output-format", "dcp", "--dst-iteration", "5"]
    return args, "--dst-iteration applies to --output-format checkpoint2 or torch_dist only, not to dcp"


def dcp_dst_iteration_for_safetensors(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    args = ["transform", str(_dcp(tmp, job)), OUT, "--output-format", "safetensors", "--dst-iteration", "5"]
    return args, "--dst-iteration applies to --output-format checkpoint2 or torch_dist only, not to safetensors"


def dst_iteration_not_a_number(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    args = ["transform", job["full"], OUT, "--output-format", "torch_dist", "--dst-iteration", "abc"]
    return args, "argument --dst-iteration: not an iteration number: 'abc'"


def src_iteration_not_a_number(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    return ["inspect", job["full"], "--src-iteration", "x1"], "argument --src-iteration: not an iteration number: 'x1'"


_NO_METADATA = "the folder holds .distcp data files but no .metadata: an unfinished or partial PyTorch DCP save"


def dcp_without_metadata_transform(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _dcp(tmp, job)
    os.remove(src / ".metadata")  # torch writes it last: a save that never finished
    return ["transform", str(src), OUT, "--output-format", "safetensors"], f"{src}: {_NO_METADATA}"


def dcp_without_metadata_inspect(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _dcp(tmp, job)
    os.remove(src / ".metadata")
    return ["inspect", str(src)], _NO_METADATA


def dcp_without_metadata_verify(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _dcp(tmp, job)
    os.remove(src / ".metadata")
    return ["verify", job["full"], str(src)], _NO_METADATA


def dcp_one_data_file_without_metadata(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _dcp(tmp, job)
    for path in [src / ".metadata", *src.glob("__*.distcp")]:  # one data file left: not "several checkpoints"
        if path.name != "__0_0.distcp":
            os.remove(path)
    return ["unify", str(src), OUT], _NO_METADATA


def dcp_data_file_without_metadata(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _dcp(tmp, job)
    os.remove(src / ".metadata")
    args = ["transform", str(src / "__0_0.distcp"), OUT, "--output-format", "safetensors"]
    return args, "__0_0.distcp: no .metadata beside it: an unfinished or partial PyTorch DCP save"


def dcp_given_to_convert(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    args = ["convert", str(_dcp(tmp, job)), OUT, "--to", "torch_dist"]
    pointer = "use reshard transform SRC DST --output-format torch_dist"
    return args, f"is a PyTorch DCP checkpoint, which convert does not read: {pointer}"


def hf_model_given_to_convert(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    hf = api.OutputSpec(format="hf", max_shard_size="1KB")  # sharded: an index and several files
    api.transform(job["full"], str(tmp / "hf"), output=hf, destination=api.Destination(manifest=False))
    args = ["convert", str(tmp / "hf"), OUT, "--to", "safetensors", "--hf"]
    return args, "is a Hugging Face model, which convert does not read: use reshard transform SRC DST --hf"


CASES += [
    dcp_truncated_distcp,
    dcp_metadata_names_a_missing_file,
    dcp_with_a_source_strategy,
    dcp_dst_iteration_for_dcp,
    dcp_dst_iteration_for_safetensors,
    dst_iteration_not_a_number,
    src_iteration_not_a_number,
    dcp_without_metadata_transform,
    dcp_without_metadata_inspect,
    dcp_without_metadata_verify,
    dcp_one_data_file_without_metadata,
    dcp_data_file_without_metadata,
    dcp_given_to_convert,
    hf_model_given_to_convert,
]

# ------------------------------------------------------------------------------------ Megatron torch_dist sources


def _torch_dist(tmp: Path, job: dict[str, str], folder: str = "td") -> Path:
    """The job's full model as a Megatron-core torch_dist folder of two data files, written by reshard."""
    spec = api.OutputSpec(format="torch_dist", dcp_ranks=2)
    api.transform(job["full"], str(tmp / folder), None, None, output=spec, destination=api.Destination(manifest=False))
    return tmp / folder


def megatron_garbled_metadata_json(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _torch_dist(tmp, job)
    (src / "metadata.json").write_text('{"sharded_backend": ')
    return ["transform", str(src), OUT, "--output-format", "torch_dist"], "metadata.json does not parse"


def megatron_zarr_backend(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _torch_dist(tmp, job)
    (src / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1}))
    return ["unify", str(src), OUT], "'zarr' sharded backend is not supported"


def megatron_missing_common_pt(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _torch_dist(tmp, job)
    os.remove(src / "common.pt")
    return ["transform", str(src), OUT, "--output-format", "safetensors"], "no common.pt"


def megatron_missing_metadata_json(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    _torch_dist(tmp, job, "run/iter_0000010")
    os.remove(tmp / "run" / "iter_0000010" / "metadata.json")
    (tmp / "run" / "latest_checkpointed_iteration.txt").write_text("10")
    return ["transform", str(tmp / "run"), OUT, "--output-format", "torch_dist"], "no metadata.json"


def megatron_iteration_missing(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    _torch_dist(tmp, job, "run/iter_0000010")
    return ["verify", str(tmp / "run"), job["full"], "--src-iteration", "20"], "no iteration 20"


def megatron_without_metadata(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    src = _torch_dist(tmp, job)
    os.remove(src / ".metadata")
    return ["transform", str(src), OUT, "--output-format", "dcp"], f"{src}: {_NO_METADATA}"


def megatron_run_given_to_convert(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    _torch_dist(tmp, job, "run/iter_0000010")
    (tmp / "run" / "latest_checkpointed_iteration.txt").write_text("10")
    args = ["convert", str(tmp / "run"), OUT, "--to", "ckpt"]
    pointer = "use reshard transform SRC DST --output-format ckpt"
    return args, f"is a Megatron-core torch_dist checkpoint, which convert does not read: {pointer}"


def megatron_tracker_names_a_missing_folder(tmp: Path, job: dict[str, str]) -> tuple[list[str], str]:
    _torch_dist(tmp, job, "run/iter_0000010")
    (tmp / "run" / "latest_checkpointed_iteration.txt").write_text("20")
    return ["transform", str(tmp / "run"), OUT, "--output-format", "torch_dist"], "names iter_0000020 but"


CASES += [
    megatron_garbled_metadata_json,
    megatron_zarr_backend,
    megatron_missing_common_pt,
    megatron_missing_metadata_json,
    megatron_iteration_missing,
    megatron_tracker_names_a_missing_folder,
    megatron_without_metadata,
    megatron_run_given_to_convert,
]

try:
    import ray  # noqa: F401  (the test extra installs it)

    CASES.append(ray_address_nobody_answers)
except ImportError:
    pass


def assert_clean_failure(proc: subprocess.CompletedProcess[str], text: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("reshard: error:") and "Traceback" not in proc.stderr, proc.stderr
    assert "internal error" not in lines[0]
    assert text in lines[0], f"{text!r} not in {lines[0]!r}"


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_bad_input_clean_answer(job: dict[str, str], tmp_path: Path, case: Case) -> None:
    case_dir = tmp_path / "case"
    case_dir.mkdir()
    args, text = case(case_dir, job)
    out = tmp_path / "out"
    args = [a.replace(OUT, str(out)) for a in args]
    inputs = [snapshot(str(case_dir)), snapshot(job["root"])]
    proc = run_cli(*args)
    assert_clean_failure(proc, text)
    assert not out.exists()
    assert not temp_files(str(tmp_path)) and not temp_files(job["root"])
    assert [snapshot(str(case_dir)), snapshot(job["root"])] == inputs


def test_strategy_mismatch_names_the_strategy_file(job: dict[str, str], tmp_path: Path) -> None:
    args = _transform(job["r8"], _wrong_ndim_strategy(tmp_path, job), job["s4"])
    proc = run_cli(*[a.replace(OUT, str(tmp_path / "out")) for a in args])
    assert_clean_failure(proc, "wrong_ndim.ckpt")
    assert "model.norm_out.weight" in proc.stderr


def test_several_candidate_files_are_reported(job: dict[str, str], tmp_path: Path) -> None:
    src = _copy_tree(tmp_path, job["r8"])
    stale = os.path.join(src, "rank_2", "checkpoint_0-old.ckpt")
    shutil.copy2(_rank_file(src, 2), stale)
    proc = run_cli(*[a.replace(OUT, str(tmp_path / "out")) for a in _transform(src, job["s8"], job["s4"])])
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if "rank 2" in line]
    assert notes == [
        "reshard: note: rank 2: using checkpoint_2.ckpt (the last name, MindSpore's rule for .ckpt), "
        "ignoring checkpoint_0-old.ckpt"
    ], proc.stderr


# ------------------------------------------------------------------------------------ full disk, read-only


@contextlib.contextmanager
def _tmpfs(folder: Path, options: str) -> Iterator[bool]:
    """Mount a tmpfs on ``folder``; yields False when mounting is not permitted here."""
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
    try:
        yield proc.returncode == 0
    finally:
        if proc.returncode == 0:
            subprocess.run(["umount", "-l", str(folder)], check=False)


def _limit_file_size(limit: int) -> Callable[[], None]:
    def apply() -> None:  # in the child: writes past ``limit`` fail with EFBIG instead of killing it
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.fixture(scope="module")
def mid_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """~7 MB, so that a 3 MB disk fills up in the middle of the run."""
    return make_job(str(tmp_path_factory.mktemp("mid")), ModelShape(vocab=256, hidden=128, ffn=512, layers=2))


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
def test_full_disk(mid_job: dict[str, str], tmp_path: Path, encrypted: bool) -> None:
    disk = tmp_path / "disk"
    args = _transform(mid_job["full"], "None", mid_job["s8"])
    env = {}
    if encrypted:  # plaintext temp file + records: twice the space, same clean failure
        args += ["--enc-key-env", "RESHARD_TEST_KEY"]
        env["RESHARD_TEST_KEY"] = bytes(16).hex()
    inputs = snapshot(mid_job["root"])
    with _tmpfs(disk, "size=3m") as mounted:
        out = disk / "out"
        argv = [a.replace(OUT, str(out)) for a in args]
        if mounted:
            proc = run_cli(*argv, env=env)
            assert_clean_failure(proc, "not enough free space")  # statvfs says so before the first byte
            assert os.listdir(disk) == []
            # the disk fills up anyway (the free-space reading is made to miss it, as another writer
            # would): the finished files stay journaled and --resume goes on once there is room
            one_by_one = [*argv, "--workers", "1"]  # (outputs started together all fail before one finishes)
            proc = run_cli(*one_by_one, env={**env, "RESHARD_TEST_FREE_BYTES": str(10**12)})
            assert_clean_failure(proc, "no space left on the device")
            assert "--resume" in proc.stderr and not temp_files(str(disk))
            finished = len(manifest.read_journal(str(out)))
            subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
            proc = run_cli(*one_by_one, "--resume", env=env)
            assert proc.returncode == 0, proc.stderr
            assert finished > 0 and f"kept {finished} from the interrupted run" in proc.stdout, proc.stdout
            key = ["--dec-key-env", "RESHARD_TEST_KEY"] if encrypted else []
            same = run_cli("verify", str(out), mid_job["full"], "--a-strategy", mid_job["s8"], *key, env=env)
            assert same.returncode == 0, same.stdout + same.stderr
        else:  # no mount permission: the same code path through a file-size limit (EFBIG)
            proc = subprocess.run(
                [sys.executable, "-m", "reshard.cli", *argv],
                capture_output=True,
                text=True,
                env={**os.environ, **env},
                preexec_fn=_limit_file_size(3 * 1024 * 1024),
                timeout=300,
            )
            assert_clean_failure(proc, "write failed")
            assert os.listdir(disk) == []  # nothing half-written, no temp file, not even the folder
    assert snapshot(mid_job["root"]) == inputs


def test_read_only_destination(job: dict[str, str], tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    with _tmpfs(ro, "size=1m,ro") as mounted:
        if not mounted:
            pytest.skip("mount is not permitted here; the path-under-a-file case covers unwritable destinations")
        proc = run_cli(*[a.replace(OUT, str(ro / "out")) for a in _transform(job["r8"], job["s8"], job["s4"])])
        assert_clean_failure(proc, "is read-only")
        assert os.listdir(ro) == []


@pytest.mark.parametrize("flag", ["--overwrite", "--resume"])
def test_read_only_existing_destination(job: dict[str, str], tmp_path: Path, flag: str) -> None:
    """A previous run's folder on a read-only mount: "read-only", not "cannot remove reshard-manifest.json"."""
    ro = tmp_path / "ro"
    with _tmpfs(ro, "size=1m") as mounted:
        if not mounted:
            pytest.skip("mount is not permitted here")
        out = ro / "out"
        argv = [a.replace(OUT, str(out)) for a in _transform(job["r8"], job["s8"], job["s4"])]
        assert run_cli(*argv).returncode == 0
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        before = snapshot(str(ro))
        proc = run_cli(*argv, flag)
        assert_clean_failure(proc, "out: destination folder is read-only")
        assert snapshot(str(ro)) == before


@pytest.mark.parametrize("prefix", ["/abs/abs_", "../x_", "a/b_", "nul\x00_", "..", "a\\b"])
def test_api_prefix_never_leaves_the_destination(job: dict[str, str], tmp_path: Path, prefix: str) -> None:
    """The API refuses what the CLI refuses, NUL included (argv cannot carry one), before reading a source."""
    from reshard import api
    from reshard.errors import UsageError

    with pytest.raises(UsageError, match="may not lead out of it"):
        api.transform(job["r8"], str(tmp_path / "out"), job["s8"], job["s4"], output=api.OutputSpec(prefix=prefix))
    assert not (tmp_path / "out").exists() and not os.path.exists("/abs")
