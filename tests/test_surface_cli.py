"""The command's surface, through real processes: exit codes (0/1/2/3), quiet broken pipes, progress
lines in logs, ``--quiet``, the final summary, choosing the source file of a rank folder
(``--file-suffix``, ``--pick``, ``--src-format``), ``--key-format``, and a dead Ray address."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from reshard import api, cli, mindspore
from reshard.cli import progress
from reshard.errors import UsageError
from reshard.formats.ckpt import save_ckpt
from reshard.formats.safetensors import save_safetensors
from reshard.formats.strategy import make_strategy, write_strategy
from reshard.layout import ParamLayout
from tests.trust_helpers import make_job, run_cli, snapshot


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_job(str(tmp_path_factory.mktemp("job")))


def _transform(job: dict[str, str], out: Path, *extra: str, src: str | None = None) -> list[str]:
    return [
        "transform",
        "--src",
        src or job["r8"],
        "--dst",
        str(out),
        "--src-strategy",
        job["s8"],
        "--dst-strategy",
        job["s4"],
        *extra,
    ]


def _two_per_rank(tmp: Path, tree: str, fmt: str = "ckpt") -> str:
    """A copy of ``tree`` whose rank folders hold the good file as ``..._r-1_4`` and a broken, later-named
    ``..._r-2_8`` (MindSpore's default rule would take the broken one)."""
    out = tmp / "two"
    for rank in range(8):
        folder = out / f"rank_{rank}"
        folder.mkdir(parents=True)
        good = os.path.join(tree, f"rank_{rank}", f"checkpoint_{rank}.{fmt}")
        shutil.copy2(good, folder / f"checkpoint_{rank}-1_4.{fmt}")
        (folder / f"checkpoint_{rank}-2_8.{fmt}").write_bytes(b"\x00broken")
        os.utime(folder / f"checkpoint_{rank}-2_8.{fmt}", (1_000_000, 1_000_000))  # older
    return str(out)


# ------------------------------------------------------------------------------------ exit codes


def test_help_documents_exit_codes() -> None:
    for args in (["--help"], ["transform", "--help"], ["verify", "--help"]):
        proc = run_cli(*args)
        assert proc.returncode == 0
        assert "2 bad input or usage, 3 internal error" in " ".join(proc.stdout.split()), proc.stdout


def test_internal_error_is_exit_3(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(api, "convert", broken)
    monkeypatch.delenv("RESHARD_DEBUG", raising=False)
    assert cli.main(["convert", str(tmp_path / "x.ckpt"), "--to", "safetensors"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("reshard: internal error: RuntimeError: a bug") and err.count("\n") == 1


def test_verify_difference_is_exit_1(job: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "other.ckpt"
    save_ckpt(path, {"w": np.zeros(2, np.float32)})
    assert run_cli("verify", job["full"], str(path)).returncode == 1


# ------------------------------------------------------------------------------------ broken pipes


def _many_tensors(tmp: Path) -> str:
    path = tmp / "many.safetensors"
    save_safetensors(path, {f"layer.{i}.weight": np.zeros(2, np.float32) for i in range(3000)})
    return str(path)


@pytest.mark.parametrize("command", ["inspect", "plan"])
def test_output_into_head_ends_quietly(tmp_path: Path, command: str) -> None:
    big = _many_tensors(tmp_path)
    strategy = tmp_path / "s2.ckpt"
    write_strategy(strategy, make_strategy({f"layer.{i}.weight": ParamLayout((2,), (-1,)) for i in range(3000)}))
    args = (
        ["inspect", "--json", big]
        if command == "inspect"
        else ["plan", "--json", "--src", big, "--dst-strategy", str(strategy), "--dst", str(tmp_path / "out")]
    )
    writer = subprocess.Popen(
        [sys.executable, "-m", "reshard.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    head = subprocess.run(["head", "-c", "10"], stdin=writer.stdout, capture_output=True, timeout=120)
    assert writer.stdout is not None and writer.stderr is not None
    writer.stdout.close()
    err = writer.stderr.read().decode()
    writer.stderr.close()
    assert writer.wait(timeout=120) == cli.EXIT_BROKEN_PIPE, err
    assert err == "" and len(head.stdout) == 10
    assert not (tmp_path / "out").exists()


def test_rich_output_into_head_ends_quietly(tmp_path: Path) -> None:
    big = _many_tensors(tmp_path)
    proc = subprocess.run(
        f"{sys.executable} -m reshard.cli inspect {big} --params | head -c 10; exit ${{PIPESTATUS[0]}}",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == cli.EXIT_BROKEN_PIPE and proc.stderr == "", proc.stderr


# ------------------------------------------------------------------------------------ progress, quiet, summary

LINE = re.compile(
    r"^reshard: [\d.]+ (B|KiB|MiB|GiB) / [\d.]+ (B|KiB|MiB|GiB) \(100%\), [\d.]+ (B|KiB|MiB|GiB)/s, "
    r"ETA 0:00$"
)


def test_progress_in_a_log_prints_plain_lines(job: dict[str, str], tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    with open(log, "w") as fh:
        proc = subprocess.run(
            [sys.executable, "-m", "reshard.cli", *_transform(job, tmp_path / "out", "--progress")],
            stdout=subprocess.PIPE,
            stderr=fh,
            text=True,
            timeout=300,
        )
    assert proc.returncode == 0
    lines = log.read_text().splitlines()
    assert len(lines) == 1 and LINE.match(lines[0]), lines


def test_progress_lines_every_few_seconds(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 1.0, 6.0, 7.0, 12.5, 13.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    lines = progress.ProgressLines(every=5.0)
    lines.start(4 * 2**30)  # t=0
    lines.advance(2**30)  # t=1: quiet
    lines.advance(2**30)  # t=6: a line
    lines.advance(2**30)  # t=7: quiet
    lines.advance(2**30)  # t=12.5: a line
    lines.finish()  # t=13: the last line
    out = capsys.readouterr().err.splitlines()
    assert out[0] == "reshard: 2.00 GiB / 4.00 GiB (50%), 341.33 MiB/s, ETA 0:06"
    assert out[1].startswith("reshard: 4.00 GiB / 4.00 GiB (100%)") and len(out) == 3


def test_quiet_silences_notes_and_progress(job: dict[str, str], tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(job["r8"], src)
    shutil.copy2(src / "rank_2" / "checkpoint_2.ckpt", src / "rank_2" / "checkpoint_0-old.ckpt")
    proc = run_cli(*_transform(job, tmp_path / "out", "--progress", "--quiet", src=str(src)))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    proc = run_cli(*_transform(job, tmp_path / "out2", "--progress", src=str(src)))
    assert "reshard: note: rank 2: using" in proc.stderr and "(100%)" in proc.stderr


def test_summary_says_files_bytes_destination_time_and_rate(job: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_cli(*_transform(job, out))
    assert re.fullmatch(
        rf"wrote 4 files \([\d.]+ KiB\) to {re.escape(str(out))}/ in [\d.]+ s, [\d.]+ [KMG]iB/s\n", proc.stdout
    ), proc.stdout
    proc = run_cli("convert", job["full"], str(tmp_path / "one"), "--to", "safetensors")
    assert proc.stdout.startswith("wrote 1 file ("), proc.stdout


def test_summary_says_what_resume_kept(job: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_cli(*_transform(job, out)).returncode == 0
    proc = run_cli(*_transform(job, out, "--resume"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("nothing to do: the 4 files in "), proc.stdout  # nothing was written


# ------------------------------------------------------------------------------------ choosing the source file


def test_file_suffix_with_a_leading_dash(job: dict[str, str], tmp_path: Path) -> None:
    src = _two_per_rank(tmp_path, job["r8"])
    before = snapshot(src)
    assert run_cli(*_transform(job, tmp_path / "default", src=src)).returncode == 2  # MindSpore's rule: the broken one
    reference = tmp_path / "reference"
    assert run_cli(*_transform(job, reference)).returncode == 0
    for spelling in (["--file-suffix", "-1_4"], ["--file-suffix=-1_4"], ["--file_suffix", "-1_4"]):
        out = tmp_path / ("out" + str(len(os.listdir(tmp_path))))
        proc = run_cli(*_transform(job, out, *spelling, src=src))
        assert proc.returncode == 0, proc.stderr
        assert (
            "rank 0: using checkpoint_0-1_4.ckpt (the one ending in -1_4), ignoring checkpoint_0-2_8.ckpt"
            in proc.stderr
        )
        for rank in range(4):
            name = f"rank_{rank}/checkpoint_{rank}.ckpt"
            assert (out / name).read_bytes() == (reference / name).read_bytes()
    assert snapshot(src) == before


def test_pick_newest(job: dict[str, str], tmp_path: Path) -> None:
    src = _two_per_rank(tmp_path, job["r8"])
    proc = run_cli(*_transform(job, tmp_path / "out", "--pick", "newest", src=src))
    assert proc.returncode == 0, proc.stderr
    assert "using checkpoint_3-1_4.ckpt (the newest, by --pick newest)" in proc.stderr
    proc = run_cli(*_transform(job, tmp_path / "out2", "--pick", "last-name", src=src))
    assert proc.returncode == 2 and "checkpoint_0-2_8.ckpt" in proc.stderr


def test_verify_unify_convert_take_the_same_choice(job: dict[str, str], tmp_path: Path) -> None:
    ckpt = _two_per_rank(tmp_path / "c", job["r8"])
    proc = run_cli("verify", job["full"], ckpt, "--b-strategy", job["s8"], "--file-suffix", "-1_4")
    assert proc.returncode == 0, proc.stderr
    st = _two_per_rank(tmp_path / "s", job["r8st"], "safetensors")
    proc = run_cli("unify", st, str(tmp_path / "unified"), "--src-strategy", job["s8"], "--pick", "newest")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("verify", job["full"], str(tmp_path / "unified"))
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("convert", ckpt, str(tmp_path / "conv"), "--to", "safetensors", "--file-suffix", "-1_4")
    assert proc.returncode == 0, proc.stderr
    assert os.listdir(tmp_path / "conv" / "rank_5") == ["checkpoint_5-1_4.safetensors"]


def test_src_format_when_rank_folders_hold_both(job: dict[str, str], tmp_path: Path) -> None:
    src = tmp_path / "both"
    shutil.copytree(job["r8"], src)
    for rank in range(8):
        shutil.copy2(os.path.join(job["r8st"], f"rank_{rank}", f"checkpoint_{rank}.safetensors"), src / f"rank_{rank}")
    proc = run_cli(*_transform(job, tmp_path / "out", src=str(src)))
    assert proc.returncode == 2 and "both .ckpt and .safetensors" in proc.stderr
    proc = run_cli(*_transform(job, tmp_path / "out", "--src-format", "safetensors", src=str(src)))
    assert proc.returncode == 0, proc.stderr
    assert os.listdir(tmp_path / "out" / "rank_1") == ["checkpoint_1.safetensors"]


# ------------------------------------------------------------------------------------ keys


def test_ambiguous_key_file(tmp_path: Path) -> None:
    raw = b"0123456789abcdef0123456789abcdef"  # 32 hex characters: also a raw AES-256 key
    path = tmp_path / "enc.ckpt"
    save_ckpt(path, {"w": np.arange(4, dtype=np.float32)}, enc_key=raw)
    key = tmp_path / "key.txt"
    key.write_bytes(raw)
    args = ["convert", str(path), str(tmp_path / "out"), "--to", "safetensors", "--dec-key-file", str(key)]
    proc = run_cli(*args)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "was read as hex" in proc.stderr and "--key-format raw" in proc.stderr
    assert not (tmp_path / "out").exists()
    assert run_cli(*args, "--key-format", "raw").returncode == 0
    with api.open_checkpoint(str(tmp_path / "out" / "enc.safetensors")) as index:
        assert np.array_equal(index.array("w"), np.arange(4, dtype=np.float32))


def test_key_format_hex(tmp_path: Path) -> None:
    key = bytes(range(16))
    path = tmp_path / "enc.ckpt"
    save_ckpt(path, {"w": np.arange(4, dtype=np.float32)}, enc_key=key)
    (tmp_path / "key.hex").write_text(key.hex() + "\n")
    proc = run_cli(
        "convert",
        str(path),
        str(tmp_path / "out"),
        "--to",
        "safetensors",
        "--dec-key-file",
        str(tmp_path / "key.hex"),
        "--key-format",
        "hex",
    )
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------------------------ Ray address, hints


@pytest.mark.parametrize("address", ["127.0.0.1:{port}", "192.0.2.1:6379"], ids=["closed-port", "unroutable"])
def test_dead_ray_address_fails_fast(job: dict[str, str], tmp_path: Path, address: str) -> None:
    pytest.importorskip("ray")
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.monotonic()
    proc = run_cli(*_transform(job, tmp_path / "out", "--executor", "ray", "--ray-address", address.format(port=port)))
    assert time.monotonic() - start < 30
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no Ray cluster answers there" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_dropin_hint_names_its_parameter(job: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="src_strategy_file is None"):
        mindspore.transform_checkpoints(job["r8"], str(tmp_path / "out"), "checkpoint_", None, job["s4"])
    assert not (tmp_path / "out").exists()
