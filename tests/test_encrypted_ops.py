"""Encryption through every operation: encrypted sources and outputs for transform, convert and
split (unify's safetensors have no encrypted form, so it is tested in a chain), keys from a file
or an environment variable, wrong keys and modes as one line, and the MindSpore oracle both ways."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reshard import api, manifest, verify
from reshard.errors import CryptoError, UsageError
from reshard.execute import local
from reshard.execute.options import WriteOptions
from reshard.formats import crypto
from reshard.formats.ckpt import read_ckpt
from tests.trust_helpers import make_job, run_cli, snapshot

KEYS = {"AES-GCM": bytes(range(32)), "AES-CBC": bytes(range(24)), "SM4-CBC": bytes(range(16, 32))}
ENV = "RESHARD_TEST_KEY"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_job(str(tmp_path_factory.mktemp("job")))


def _key_file(folder: Path, key: bytes, hex_text: bool = False) -> str:
    path = folder / ("key.hex" if hex_text else "key.bin")
    if hex_text:
        path.write_text(key.hex() + "\n")
    else:
        path.write_bytes(key)
    return str(path)


def _all_encrypted(folder: str, mode: str) -> bool:
    files = [os.path.join(f, n) for f, _, names in os.walk(folder) for n in names if n.endswith(".ckpt")]
    heads = []
    for path in files:
        with open(path, "rb") as fh:
            heads.append(crypto.encrypted_mode(fh.read(4)))
    return bool(files) and all(h == mode for h in heads)


def _same(
    a: str,
    b: str,
    a_strategy: str | None = None,
    b_strategy: str | None = None,
    key: bytes | None = None,
    mode: str = "AES-GCM",
) -> bool:
    read = api.ReadOptions(dec_key=key, dec_mode=mode)
    return verify.verify(a, b, a_strategy=a_strategy, b_strategy=b_strategy, read=read).ok


@pytest.mark.parametrize("mode", list(KEYS))
def test_transform_both_ways_cli_key_file_and_env(job, tmp_path, mode: str) -> None:
    key = KEYS[mode]
    key_file = _key_file(tmp_path, key, hex_text=mode == "AES-CBC")
    enc = str(tmp_path / "enc4")
    before = snapshot(job["r8"])
    proc = run_cli(
        "transform",
        "--src",
        job["r8"],
        "--dst",
        enc,
        "--src-strategy",
        job["s8"],
        "--dst-strategy",
        job["s4"],
        "--enc-key-file",
        key_file,
        "--enc-mode",
        mode,
    )
    assert proc.returncode == 0, proc.stderr
    assert _all_encrypted(enc, mode)
    assert manifest.read_manifest(enc)["encryption"] == mode
    assert _same(job["full"], enc, None, job["s4"], key, mode)
    back = str(tmp_path / "back8")
    proc = run_cli(
        "transform",
        "--src",
        enc,
        "--dst",
        back,
        "--src-strategy",
        job["s4"],
        "--dst-strategy",
        job["s8"],
        "--dec-key-env",
        ENV,
        "--dec-mode",
        mode,
        env={ENV: key.hex()},
    )
    assert proc.returncode == 0, proc.stderr
    assert not _all_encrypted(back, mode)
    assert _same(job["r8"], back, job["s8"], job["s8"])
    assert snapshot(job["r8"]) == before


def test_convert_unify_split_chain(job, tmp_path) -> None:
    """encrypted full -> (decrypting convert) safetensors -> unify is n/a for a single file, so:
    encrypted 8-rank .ckpt -> convert -> unify -> split into encrypted .ckpt ranks -> verify."""
    key = KEYS["SM4-CBC"]
    write_enc = WriteOptions(enc_key=key, enc_mode="SM4-CBC")
    enc8 = str(tmp_path / "enc8")
    api.transform(job["full"], enc8, None, job["s8"], write=write_enc)
    assert _all_encrypted(enc8, "SM4-CBC")
    st8 = str(tmp_path / "st8")
    api.convert(enc8, st8, "safetensors", read=api.ReadOptions(dec_key=key, dec_mode="SM4-CBC"))
    unified = str(tmp_path / "unified")
    api.unify(st8, job["s8"], unified)
    split4 = str(tmp_path / "split4")
    api.split(unified, job["s4"], split4, write=write_enc, output=api.OutputSpec(format="ckpt"))
    assert _all_encrypted(split4, "SM4-CBC")
    assert _same(job["full"], split4, None, job["s4"], key, "SM4-CBC")
    # and back to a plain .ckpt file, encrypted, through convert
    one = str(tmp_path / "one")
    api.convert(os.path.join(unified, "part0.safetensors"), one, "ckpt", write=write_enc)
    with read_ckpt(os.path.join(one, "part0.ckpt"), dec_key=key, dec_mode="SM4-CBC") as index:
        assert len(index) > 0


def test_cli_convert_encrypts_and_decrypts(job, tmp_path) -> None:
    key = KEYS["AES-GCM"]
    st = str(tmp_path / "st")
    assert run_cli("convert", job["full"], st, "--to", "safetensors").returncode == 0
    enc = str(tmp_path / "enc")
    proc = run_cli(
        "convert",
        os.path.join(st, "model.safetensors"),
        enc,
        "--to",
        "ckpt",
        "--enc-key-env",
        ENV,
        env={ENV: key.hex()},
    )
    assert proc.returncode == 0, proc.stderr
    assert _all_encrypted(enc, "AES-GCM")
    plain = str(tmp_path / "plain")
    proc = run_cli(
        "convert",
        os.path.join(enc, "model.ckpt"),
        plain,
        "--to",
        "safetensors",
        "--dec-key-file",
        _key_file(tmp_path, key),
    )
    assert proc.returncode == 0, proc.stderr
    assert _same(job["full"], os.path.join(plain, "model.safetensors"))


def _enc_tree(job: dict[str, str], tmp_path: Path) -> str:
    enc = str(tmp_path / "enc8")
    api.transform(job["full"], enc, None, job["s8"], write=WriteOptions(enc_key=KEYS["AES-CBC"], enc_mode="AES-CBC"))
    return enc


BAD = [
    ("wrong key", ["--dec-key-env", ENV, "--dec-mode", "AES-CBC"], {ENV: bytes(24).hex()}, "wrong key"),
    ("wrong mode", ["--dec-key-env", ENV, "--dec-mode", "AES-GCM"], {ENV: KEYS["AES-CBC"].hex()}, "AES-"),
    ("no key", [], {}, "encrypted"),
    ("key of wrong length", ["--dec-key-env", ENV, "--dec-mode", "SM4-CBC"], {ENV: KEYS["AES-CBC"].hex()}, "16-byte"),
    ("unset variable", ["--dec-key-env", "RESHARD_NO_SUCH_VAR"], {}, "not set"),
    ("missing key file", ["--dec-key-file", "/nonexistent/key"], {}, "key file"),
    ("mode without key", ["--dec-mode", "AES-CBC"], {}, "needs a key"),
    (
        "enc with crc",
        ["--dec-key-env", ENV, "--dec-mode", "AES-CBC", "--enc-key-env", ENV, "--crc"],
        {ENV: KEYS["AES-CBC"].hex()},
        "mutually exclusive",
    ),
    (
        "enc of safetensors",
        ["--dec-key-env", ENV, "--dec-mode", "AES-CBC", "--enc-key-env", ENV, "--output-format", "safetensors"],
        {ENV: KEYS["AES-CBC"].hex()},
        "only .ckpt",
    ),
]


@pytest.mark.parametrize(("flags", "env", "text"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_keys_one_line(job, tmp_path, flags: list[str], env: dict[str, str], text: str) -> None:
    enc = _enc_tree(job, tmp_path)
    before = snapshot(enc)
    dst = tmp_path / "out"
    proc = run_cli(
        "transform",
        "--src",
        enc,
        "--dst",
        str(dst),
        "--src-strategy",
        job["s8"],
        "--dst-strategy",
        job["s4"],
        *flags,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reshard: error:") and text in lines[0], proc.stderr
    for key in KEYS.values():
        assert key.hex() not in proc.stderr
    assert not dst.exists()
    assert snapshot(enc) == before


def test_no_key_on_the_command_line() -> None:
    for flag in ("--enc-key", "--dec-key", "--key"):
        proc = run_cli("transform", "--src", "x", "--dst", "y", flag, "00" * 16)
        assert proc.returncode == 2 and "reshard: error:" in proc.stderr


def test_api_refusals_before_writing(job, tmp_path) -> None:
    dst = tmp_path / "out"
    with pytest.raises(UsageError, match="needs a 16-byte key"):
        api.transform(
            job["r8"], str(dst), job["s8"], job["s4"], write=WriteOptions(enc_key=b"short", enc_mode="SM4-CBC")
        )
    with pytest.raises(CryptoError, match="not an encrypted checkpoint"):
        api.transform(job["r8"], str(dst), job["s8"], job["s4"], read=api.ReadOptions(dec_key=KEYS["AES-GCM"]))
    assert not dst.exists()
    assert "kkkk" not in repr(WriteOptions(enc_key=b"k" * 16))
    assert "kkkk" not in repr(api.ReadOptions(dec_key=b"k" * 16))


def test_resume_with_another_key_redoes_files(job, tmp_path, monkeypatch) -> None:
    dst = str(tmp_path / "out")
    real, calls = local.run_file, {"n": 0}

    def flaky(*args: Any, **kwargs: Any) -> None:
        if calls["n"] == 2:
            raise KeyboardInterrupt
        calls["n"] += 1
        real(*args, **kwargs)

    monkeypatch.setattr(local, "run_file", flaky)
    with pytest.raises(KeyboardInterrupt):
        api.transform(job["r8"], dst, job["s8"], job["s4"], write=WriteOptions(enc_key=KEYS["AES-GCM"]))
    monkeypatch.setattr(local, "run_file", real)
    other = bytes(32)
    report = api.transform(
        job["r8"],
        dst,
        job["s8"],
        job["s4"],
        write=WriteOptions(enc_key=other),
        destination=api.Destination(resume=True),
    )
    assert not any("kept" in n for n in report.notes)
    assert _same(job["r8"], dst, job["s8"], job["s4"], other, "AES-GCM")


# ------------------------------------------------------------------------------------ oracle

ORACLE = """
import hashlib
result = {"ours": {}, "saved": []}
for case in ARGS["ours"]:
    loaded = ms.load_checkpoint(case["path"], dec_key=bytes.fromhex(case["key"]), dec_mode=case["mode"])
    result["ours"][case["path"]] = {k: hashlib.sha256(v.asnumpy().tobytes()).hexdigest() for k, v in loaded.items()}
plain = ms.load_checkpoint(ARGS["full"])
params = [{"name": k, "data": v} for k, v in plain.items()]
for case in ARGS["theirs"]:
    ms.save_checkpoint(params, case["path"], enc_key=bytes.fromhex(case["key"]), enc_mode=case["mode"])
    result["saved"].append(case["path"])
out(result)
"""


@pytest.mark.oracle
def test_oracle_mindspore_reads_our_encrypted_outputs_and_we_transform_its_files(job, tmp_path, oracle) -> None:
    ours, theirs = [], []
    for mode, key in KEYS.items():
        dst = str(tmp_path / f"ours_{mode}")
        report = api.transform(job["r8"], dst, job["s8"], job["s4"], write=WriteOptions(enc_key=key, enc_mode=mode))
        ours += [{"path": f.path, "key": key.hex(), "mode": mode} for f in report.plan.files]
        theirs.append({"path": str(tmp_path / f"ms_{mode}.ckpt"), "key": key.hex(), "mode": mode})
    got = oracle(ORACLE, {"ours": ours, "theirs": theirs, "full": job["full"]})
    matched = 0
    for case in ours:
        with read_ckpt(case["path"], dec_key=bytes.fromhex(case["key"]), dec_mode=case["mode"]) as index:
            expected = {
                n: hashlib.sha256(np.ascontiguousarray(index.array(n)).tobytes()).hexdigest()
                for n in index
                if not index.entries[n].is_string
            }
        assert got["ours"][case["path"]] == expected
        matched += 1
    assert matched == 12  # 4 ranks x 3 modes loaded by MindSpore, every tensor equal
    for case in theirs:  # MindSpore-encrypted full model -> our 4-rank transform -> same tensors
        key, mode = bytes.fromhex(case["key"]), case["mode"]
        out = str(tmp_path / f"from_ms_{mode}")
        api.transform(case["path"], out, None, job["s4"], read=api.ReadOptions(dec_key=key, dec_mode=mode))
        assert _same(job["full"], out, None, job["s4"])
        assert _same(case["path"], out, None, job["s4"], key, mode)
