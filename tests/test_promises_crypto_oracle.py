"""``convert SRC DST --to ckpt`` re-encrypts in one step, checked by MindSpore 2.10 itself.

A plain full ``.ckpt`` is encrypted (AES-GCM), re-encrypted from that (AES-CBC with a 32-byte
key, then SM4-CBC), and decrypted; the rank folders of an 8-rank job are encrypted too. One oracle
call loads every output with ``load_checkpoint`` and its new key and mode (the decrypted ones
without a key) and compares each tensor with the original's, and checks that a wrong key is
refused.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.trust_helpers import make_job
from tests.trust_helpers import run_cli as run

LOAD = """
orig = {k: v.asnumpy() for k, v in ms.load_checkpoint(ARGS["original"]).items()}
result = {}
for case in ARGS["cases"]:
    key = bytes.fromhex(case["key"]) if case["key"] else None
    kwargs = {"dec_key": key, "dec_mode": case["mode"]} if key else {}
    loaded = {k: v.asnumpy() for k, v in ms.load_checkpoint(case["path"], **kwargs).items()}
    want = orig if case["reference"] is None else {
        k: v.asnumpy() for k, v in ms.load_checkpoint(case["reference"]).items()}
    same = set(loaded) == set(want) and all(
        loaded[k].dtype == want[k].dtype and loaded[k].shape == want[k].shape and np.array_equal(loaded[k], want[k])
        for k in want)
    refused = None
    if key:
        try:
            ms.load_checkpoint(case["path"], dec_key=bytes(b ^ 1 for b in key), dec_mode=case["mode"])
            refused = False
        except Exception:
            refused = True
    result[case["name"]] = {"same": same, "count": len(loaded), "wrong_key_refused": refused}
out(result)
"""


def convert(src: str, dst: str, *flags: str, env: dict[str, str] | None = None) -> None:
    proc = run("convert", src, dst, "--to", "ckpt", *flags, env=env)
    assert proc.returncode == 0, proc.stderr


def test_mindspore_loads_reencrypted_outputs(oracle, tmp_path: Path) -> None:
    job = make_job(str(tmp_path / "job"))
    keys = {"gcm": b"g" * 16, "cbc": b"x" * 32, "sm4": b"s" * 16}  # not hex digits: key files hold raw bytes
    files = {}
    for name, key in keys.items():
        files[name] = tmp_path / f"{name}.key"
        files[name].write_bytes(key)
    env = {"PROMISES_SM4": keys["sm4"].hex()}
    convert(job["full"], str(tmp_path / "gcm"), "--enc-key-file", str(files["gcm"]))
    convert(
        str(tmp_path / "gcm"),
        str(tmp_path / "cbc"),
        "--dec-key-file",
        str(files["gcm"]),
        "--enc-key-file",
        str(files["cbc"]),
        "--enc-mode",
        "AES-CBC",
    )
    convert(
        str(tmp_path / "cbc" / "model.ckpt"),
        str(tmp_path / "sm4"),
        "--dec-key-file",
        str(files["cbc"]),
        "--dec-mode",
        "AES-CBC",
        "--enc-key-env",
        "PROMISES_SM4",
        "--enc-mode",
        "SM4-CBC",
        env=env,
    )
    convert(
        str(tmp_path / "sm4"),
        str(tmp_path / "plain"),
        "--dec-key-env",
        "PROMISES_SM4",
        "--dec-mode",
        "SM4-CBC",
        env=env,
    )
    convert(job["r8"], str(tmp_path / "r8gcm"), "--enc-key-file", str(files["gcm"]))
    rank3 = os.path.join(job["r8"], "rank_3", "checkpoint_3.ckpt")
    cases = [
        {
            "name": "gcm",
            "path": str(tmp_path / "gcm" / "model.ckpt"),
            "key": keys["gcm"].hex(),
            "mode": "AES-GCM",
            "reference": None,
        },
        {
            "name": "cbc",
            "path": str(tmp_path / "cbc" / "model.ckpt"),
            "key": keys["cbc"].hex(),
            "mode": "AES-CBC",
            "reference": None,
        },
        {
            "name": "sm4",
            "path": str(tmp_path / "sm4" / "model.ckpt"),
            "key": keys["sm4"].hex(),
            "mode": "SM4-CBC",
            "reference": None,
        },
        {
            "name": "plain",
            "path": str(tmp_path / "plain" / "model.ckpt"),
            "key": "",
            "mode": "AES-GCM",
            "reference": None,
        },
        {
            "name": "rank3",
            "path": str(tmp_path / "r8gcm" / "rank_3" / "checkpoint_3.ckpt"),
            "key": keys["gcm"].hex(),
            "mode": "AES-GCM",
            "reference": rank3,
        },
    ]
    result = oracle(LOAD, {"original": job["full"], "cases": cases})
    assert all(r["same"] for r in result.values()), result
    assert all(r["wrong_key_refused"] in (True, None) for r in result.values()), result
    assert result["plain"]["wrong_key_refused"] is None and result["gcm"]["count"] > 10
    assert (tmp_path / "plain" / "model.ckpt").read_bytes() == Path(job["full"]).read_bytes()
