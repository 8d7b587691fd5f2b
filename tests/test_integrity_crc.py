"""crc trailers are checked by default on every read path (transform, convert, unify, plan, the
API); ``--no-check-crc`` skips them and ``--check-crc`` is still accepted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from reshard import api
from reshard.errors import IntegrityError
from reshard.formats.ckpt import read_ckpt, save_ckpt
from reshard.synthetic import full_model
from tests.trust_helpers import SMALL, make_job, run_cli


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A full .ckpt with a crc trailer, the same file with one tensor byte flipped, and the small job."""
    root = str(tmp_path_factory.mktemp("crc"))
    good = os.path.join(root, "good", "model.ckpt")
    save_ckpt(good, full_model(SMALL), write_crc=True)
    with read_ckpt(good) as index:
        largest = max(index.entries.values(), key=lambda e: e.nbytes)
        offset, length = largest.segments[0]
    data = bytearray(Path(good).read_bytes())
    data[offset + length // 2] ^= 0x01  # a tensor byte: the records still parse, only the crc can tell
    bad = os.path.join(root, "bad", "model.ckpt")
    os.makedirs(os.path.dirname(bad))
    with open(bad, "wb") as fh:
        fh.write(data)
    return {"root": root, "good": good, "bad": bad, **{f"job_{k}": v for k, v in make_job(f"{root}/job").items()}}


@pytest.mark.parametrize("command", ["convert", "transform", "plan"])
def test_a_damaged_crc_file_is_refused_by_default(files: dict[str, str], tmp_path, command: str) -> None:
    out = str(tmp_path / "out")
    if command == "convert":
        args = ["convert", files["bad"], out, "--to", "safetensors"]
    else:
        args = [command, "--src", files["bad"], "--dst", out, "--dst-strategy", files["job_s4"]]
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert "crc" in proc.stderr and files["bad"] in proc.stderr and "Traceback" not in proc.stderr
    assert not os.path.exists(out)
    skipped = run_cli(*args, "--no-check-crc")
    assert skipped.returncode == 0, skipped.stderr


@pytest.mark.parametrize("flag", [[], ["--check-crc"], ["--no-check-crc"]])
def test_intact_crc_file_passes_with_every_flag(files: dict[str, str], tmp_path, flag: list[str]) -> None:
    proc = run_cli("convert", files["good"], str(tmp_path / "out"), "--to", "safetensors", *flag)
    assert proc.returncode == 0, proc.stderr


def test_unify_accepts_the_crc_flags(files: dict[str, str], tmp_path) -> None:
    for n, flag in enumerate(([], ["--check-crc"], ["--no-check-crc"])):
        proc = run_cli("unify", files["job_r8st"], str(tmp_path / f"u{n}"), "--src-strategy", files["job_s8"], *flag)
        assert proc.returncode == 0, proc.stderr


def test_the_api_checks_by_default(files: dict[str, str], tmp_path) -> None:
    assert api.ReadOptions().verify_crc is True
    with pytest.raises(IntegrityError):
        api.convert(files["bad"], str(tmp_path / "a"), "safetensors")
    with pytest.raises(IntegrityError):
        api.transform(files["bad"], str(tmp_path / "b"), None, files["job_s4"])
    api.convert(files["bad"], str(tmp_path / "c"), "safetensors", read=api.ReadOptions(verify_crc=False))


def test_checking_a_trailer_keeps_rss_flat(tmp_path: Path) -> None:
    """The check reads the whole file, but its pages leave the process's RSS block by block: with
    every source checked by default, 8 indexing threads must not hold 8 whole files (they did: 1 GiB)."""
    import subprocess
    import sys

    import numpy as np

    big = tmp_path / "big.ckpt"
    save_ckpt(str(big), {f"w{i}": np.full((16, 1024, 1024), i, dtype=np.float32) for i in range(4)}, write_crc=True)
    code = (
        "import mmap, os, sys; from reshard.formats import ckpt\n"
        "def rss(): return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')\n"
        "with open(sys.argv[1], 'rb') as fh:\n"
        "    buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)\n"
        "before = rss(); ckpt._crc_of_buffer(buf, len(buf) - ckpt.CRC_TRAILER_BYTES)\n"
        "print((rss() - before) // 2**20)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(big)], capture_output=True, text=True, check=True)
    assert os.path.getsize(big) > 256 * 2**20
    assert int(proc.stdout) < 64, f"checking a 256 MiB file left {proc.stdout.strip()} MiB resident"
