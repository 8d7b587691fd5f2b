"""Unit tests of the encrypted-.ckpt record layer (reshard.formats.crypto), no MindSpore needed."""

from __future__ import annotations

import io
import struct

import pytest
from cryptography.exceptions import InvalidTag, UnsupportedAlgorithm
from cryptography.hazmat.primitives import padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.errors import CryptoError, FormatError, ReshardError, UnsupportedError, UsageError
from reshard.formats import crypto
from reshard.formats.base import map_file

KEY_SIZES = {"AES-GCM": (16, 24, 32), "AES-CBC": (16, 24, 32), "SM4-CBC": (16,)}
MODE_KEYS = [(mode, size) for mode, sizes in KEY_SIZES.items() for size in sizes]
SMALL_BLOCK = 64  # monkeypatched plaintext per record: several records from a few hundred bytes
PATH = "/data/rank_0/net.ckpt"


def key_of(size: int, seed: int = 1) -> bytes:
    return bytes((seed * 31 + i * 7) % 256 for i in range(size))


def plaintext(n: int) -> bytes:
    return bytes((i * 13 + 5) % 251 for i in range(n))


def encrypt(data: bytes, key: bytes, mode: str) -> bytes:
    out = io.BytesIO()
    crypto.encrypt_stream(io.BytesIO(data), out, key, mode)
    return out.getvalue()


def decrypt(blob: bytes, key: bytes, mode: str, path: str | None = PATH) -> bytes:
    out = io.BytesIO()
    crypto.decrypt_stream(blob, out, key, mode, path)
    return out.getvalue()


def records(blob: bytes) -> list[dict]:
    """An independent parser of the record layout of docs/formats.md §1.7 (not the module's own)."""
    result, pos = [], 0
    while pos < len(blob):
        magic = struct.unpack_from("<I", blob, pos)[0]
        rec = {"offset": pos, "magic": magic}
        pos += 4
        if magic == 0x7F3A5ED8:
            rec["tag"] = blob[pos : pos + 16]
            pos += 16
        rec["block_size"], rec["iv_len"] = struct.unpack_from("<ii", blob, pos)
        rec["iv"] = blob[pos + 8 : pos + 24]
        (rec["cipher_len"],) = struct.unpack_from("<i", blob, pos + 24)
        pos += 28
        rec["cipher"] = blob[pos : pos + rec["cipher_len"]]
        rec["end"] = pos = pos + rec["cipher_len"]
        result.append(rec)
    return result


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(crypto, "BLOCK_BYTES", SMALL_BLOCK)
    return SMALL_BLOCK


# --- constants and helpers -------------------------------------------------------------------


def test_constants() -> None:
    assert crypto.MODES == ("AES-GCM", "AES-CBC", "SM4-CBC")
    assert crypto.BLOCK_BYTES == 64 * 1024 * 1024
    assert (crypto.MAGIC_AES_GCM, crypto.MAGIC_AES_CBC, crypto.MAGIC_SM4_CBC) == (
        0x7F3A5ED8,
        0x7F3A5ED9,
        0x7F3A5EDA,
    )


@pytest.mark.parametrize("mode", crypto.MODES)
def test_encrypted_mode_recognises_own_output(mode: str) -> None:
    blob = encrypt(b"abc", key_of(16), mode)
    assert crypto.encrypted_mode(blob) == mode
    assert crypto.encrypted_mode(blob[:4]) == mode
    assert crypto.encrypted_mode(memoryview(blob)) == mode


@pytest.mark.parametrize("head", [b"", b"\xd8^:", b"\x0a\x1e\x0a\x01", b"\xd7^:\x7f" + bytes(20)])
def test_encrypted_mode_none(head: bytes) -> None:
    assert crypto.encrypted_mode(head) is None


@pytest.mark.parametrize(("mode", "size"), MODE_KEYS)
def test_check_key_accepts(mode: str, size: int) -> None:
    crypto.check_key(key_of(size), mode)
    crypto.check_key(bytearray(key_of(size)), mode, PATH)


@pytest.mark.parametrize(
    ("key", "mode", "fragment"),
    [
        (b"k" * 16, "aes-gcm", "unknown encryption mode 'aes-gcm'"),
        (b"k" * 16, "AES-CTR", "unknown encryption mode"),
        (b"k" * 16, None, "unknown encryption mode"),
        (b"k" * 20, "AES-GCM", "AES-GCM needs a 16 or 24 or 32-byte key, got 20 bytes"),
        (b"", "AES-CBC", "got 0 bytes"),
        (b"k" * 24, "SM4-CBC", "SM4-CBC needs a 16-byte key, got 24 bytes"),
        (b"k" * 32, "SM4-CBC", "got 32 bytes"),
        ("k" * 16, "AES-GCM", "must be bytes, got str"),
    ],
)
def test_check_key_rejects(key: bytes, mode: str, fragment: str) -> None:
    with pytest.raises(UsageError, match=fragment) as info:
        crypto.check_key(key, mode, PATH)
    assert str(info.value).startswith(PATH)


def test_bad_key_rejected_before_any_io() -> None:
    dst = io.BytesIO()
    with pytest.raises(UsageError):
        crypto.encrypt_stream(io.BytesIO(b"x"), dst, b"short", "AES-GCM")
    with pytest.raises(UsageError):
        crypto.decrypt_stream(encrypt(b"x", b"k" * 16, "AES-GCM"), dst, b"k" * 16, "AES-XYZ")
    assert dst.getvalue() == b""


# --- round trips and the exact record layout -------------------------------------------------


@pytest.mark.parametrize(("mode", "size"), MODE_KEYS)
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 1000])
def test_round_trip(mode: str, size: int, n: int) -> None:
    data = plaintext(n)
    blob = encrypt(data, key_of(size), mode)
    assert decrypt(blob, key_of(size), mode) == data
    assert decrypt(bytearray(blob), key_of(size), mode) == data
    if n == 0:
        assert blob == b""  # MindSpore writes a 0-byte file for an empty plaintext (oracle-verified)


@pytest.mark.parametrize(("mode", "size"), MODE_KEYS)
def test_layout_is_decryptable_by_plain_cryptography(mode: str, size: int) -> None:
    """Record fields per docs/formats.md §1.7, decrypted with the plain primitives (incl. the GCM iv[:12] quirk)."""
    key, data = key_of(size), plaintext(100)
    [rec] = records(encrypt(data, key, mode))
    assert rec["magic"] == {"AES-GCM": 0x7F3A5ED8, "AES-CBC": 0x7F3A5ED9, "SM4-CBC": 0x7F3A5EDA}[mode]
    assert rec["iv_len"] == 16
    assert rec["block_size"] == 4 + 16 + 4 + rec["cipher_len"]
    if mode == "AES-GCM":
        assert rec["cipher_len"] == 100
        aead = AESGCM(key)
        assert aead.decrypt(rec["iv"][:12], rec["cipher"] + rec["tag"], None) == data
        with pytest.raises(InvalidTag):  # the full 16-byte IV is not the nonce
            aead.decrypt(rec["iv"], rec["cipher"] + rec["tag"], None)
    else:
        assert rec["cipher_len"] == 112  # PKCS#7 pads 100 to 112
        algorithm = algorithms.SM4(key) if mode == "SM4-CBC" else algorithms.AES(key)
        dec = Cipher(algorithm, modes.CBC(rec["iv"])).decryptor()
        unpadder = padding.PKCS7(128).unpadder()
        assert unpadder.update(dec.update(rec["cipher"]) + dec.finalize()) + unpadder.finalize() == data


def test_ivs_are_random() -> None:
    a, b = encrypt(b"same", b"k" * 16, "AES-GCM"), encrypt(b"same", b"k" * 16, "AES-GCM")
    assert records(a)[0]["iv"] != records(b)[0]["iv"]


@pytest.mark.parametrize("mode", crypto.MODES)
@pytest.mark.parametrize("n", [1, 63, 64, 65, 128, 200])
def test_multi_record(small_blocks: int, mode: str, n: int) -> None:
    data = plaintext(n)
    blob = encrypt(data, key_of(16), mode)
    recs = records(blob)
    assert len(recs) == -(-n // small_blocks)  # exact multiples get no trailing empty record
    assert recs[-1]["end"] == len(blob)
    plain_lens = [small_blocks] * (len(recs) - 1) + [n - small_blocks * (len(recs) - 1)]
    for rec, plain_len in zip(recs, plain_lens, strict=True):
        expected = plain_len if mode == "AES-GCM" else (plain_len // 16 + 1) * 16
        assert rec["cipher_len"] == expected
    assert decrypt(blob, key_of(16), mode) == data


class Dribble(io.RawIOBase):
    """A raw stream that returns at most 7 bytes per read, like a pipe."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray) -> int:  # type: ignore[override]
        chunk = self.data[self.pos : self.pos + min(7, len(b))]
        b[: len(chunk)] = chunk
        self.pos += len(chunk)
        return len(chunk)


def test_short_reads_still_make_full_blocks(small_blocks: int) -> None:
    data = plaintext(300)
    out = io.BytesIO()
    crypto.encrypt_stream(Dribble(data), out, b"k" * 16, "AES-GCM")  # type: ignore[arg-type]
    assert [r["cipher_len"] for r in records(out.getvalue())] == [64, 64, 64, 64, 44]
    assert decrypt(out.getvalue(), b"k" * 16, "AES-GCM") == data


def test_decrypt_from_mmap(tmp_path, small_blocks: int) -> None:
    data = plaintext(500)
    file = tmp_path / "enc.ckpt"
    file.write_bytes(encrypt(data, key_of(32), "AES-CBC"))
    buf, close, size = map_file(file)
    try:
        assert size == file.stat().st_size
        assert decrypt(buf, key_of(32), "AES-CBC") == data
    finally:
        close()  # fails with BufferError if decrypt_stream left a view of the map alive


@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=400), mode=st.sampled_from(crypto.MODES), block=st.integers(1, 100))
def test_round_trip_property(data: bytes, mode: str, block: int) -> None:
    old = crypto.BLOCK_BYTES
    crypto.BLOCK_BYTES = block
    try:
        blob = encrypt(data, b"q" * 16, mode)
        assert len(records(blob)) == -(-len(data) // block)
        assert decrypt(blob, b"q" * 16, mode) == data
    finally:
        crypto.BLOCK_BYTES = old


# --- wrong key / wrong mode ------------------------------------------------------------------


@pytest.mark.parametrize("size", [16, 24, 32])
def test_wrong_key_gcm(size: int) -> None:
    blob = encrypt(plaintext(100), key_of(size), "AES-GCM")
    with pytest.raises(CryptoError, match=r"offset 0.*wrong key or mode") as info:
        decrypt(blob, key_of(size, seed=2), "AES-GCM")
    assert str(info.value).startswith(PATH)


@pytest.mark.parametrize("mode", ["AES-CBC", "SM4-CBC"])
def test_wrong_key_cbc(mode: str) -> None:
    """A wrong CBC key fails the padding check unless the garbage happens to end in valid padding
    (about 1 in 256); then the plaintext is garbage, which the .ckpt parser rejects later."""
    data = plaintext(100)
    failures = 0
    for seed in range(2, 10):
        try:
            assert decrypt(encrypt(data, key_of(16), mode), key_of(16, seed), mode) != data
        except CryptoError as error:
            assert "padding invalid" in str(error) and "wrong key or mode" in str(error)
            failures += 1
    assert failures >= 6


def test_no_partial_plaintext_after_a_bad_record(small_blocks: int) -> None:
    """Records before the bad one are released; the bad record's plaintext never is."""
    blob = bytearray(encrypt(plaintext(200), b"k" * 16, "AES-GCM"))
    second = records(bytes(blob))[1]
    blob[second["end"] - 1] ^= 1
    out = io.BytesIO()
    with pytest.raises(CryptoError, match=f"offset {second['offset']}"):
        crypto.decrypt_stream(bytes(blob), out, b"k" * 16, "AES-GCM", PATH)
    assert out.getvalue() == plaintext(64)


@pytest.mark.parametrize("written", crypto.MODES)
@pytest.mark.parametrize("asked", crypto.MODES)
def test_wrong_mode(written: str, asked: str) -> None:
    if written == asked:
        return
    blob = encrypt(b"payload", b"k" * 16, written)
    with pytest.raises(CryptoError, match=f"written with {written}, not {asked}"):
        decrypt(blob, b"k" * 16, asked)


def test_mixed_modes_in_one_file(small_blocks: int) -> None:
    blob = encrypt(plaintext(64), b"k" * 16, "AES-GCM") + encrypt(b"x", b"k" * 16, "AES-CBC")
    with pytest.raises(CryptoError, match=r"written with AES-CBC, not AES-GCM.*offset 112"):
        decrypt(blob, b"k" * 16, "AES-GCM")


# --- corrupted and lying files ---------------------------------------------------------------


def test_not_encrypted() -> None:
    with pytest.raises(FormatError, match=r"not an encrypted \.ckpt: no record magic at offset 0"):
        decrypt(b"\x0a\x1e\x0a\x01w" + bytes(40), b"k" * 16, "AES-GCM")


def test_empty_buffer_decrypts_to_nothing() -> None:
    assert decrypt(b"", b"k" * 16, "SM4-CBC") == b""


def patched(blob: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(blob)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"cipher_len": 1 << 30, "block_size": (1 << 30) + 24}, "needs 1073741824 bytes"),
        ({"cipher_len": 48, "block_size": 72}, "the ciphertext needs 48 bytes"),
        ({"cipher_len": -16, "block_size": 8}, "negative cipher_len -16"),
        ({"cipher_len": 64}, "block_size (44|56) disagrees with cipher_len 64"),
        ({"block_size": 1 << 30}, "block_size 1073741824 disagrees"),
        ({"block_size": -5}, "block_size -5 disagrees"),
        ({"iv_len": 12}, "iv_len is 12, expected 16"),
        ({"iv_len": -1}, "iv_len is -1"),
    ],
)
@pytest.mark.parametrize("mode", ["AES-GCM", "AES-CBC"])
def test_lying_length_fields(mode: str, changes: dict[str, int], fragment: str) -> None:
    blob = encrypt(plaintext(20), b"k" * 16, mode)
    base = 20 if mode == "AES-GCM" else 4  # where block_size sits
    where = {"block_size": base, "iv_len": base + 4, "cipher_len": base + 24}
    for field, value in changes.items():
        blob = patched(blob, where[field], "<i", value)
    with pytest.raises(FormatError, match=f"offset 0.*({fragment})|({fragment}).*offset 0") as info:
        decrypt(blob, b"k" * 16, mode)
    assert str(info.value).startswith(PATH)


@pytest.mark.parametrize("cipher_len", [0, 15, 17])
def test_cbc_cipher_len_must_be_whole_blocks(cipher_len: int) -> None:
    body = bytes(cipher_len)
    record = struct.pack("<Iii", crypto.MAGIC_AES_CBC, 24 + cipher_len, 16) + bytes(16)
    record += struct.pack("<i", cipher_len) + body
    with pytest.raises(FormatError, match="not a positive multiple of 16"):
        decrypt(record, b"k" * 16, "AES-CBC")


@pytest.mark.parametrize("mode", crypto.MODES)
def test_every_truncation(small_blocks: int, mode: str) -> None:
    """Cutting the file anywhere gives our error, except at a record boundary, which the record
    format cannot tell from a shorter file: then exactly the earlier records' plaintext comes out."""
    data = plaintext(100)
    blob = encrypt(data, b"k" * 16, mode)
    boundary = records(blob)[0]["end"]
    for cut in range(1, len(blob)):
        if cut == boundary:
            assert decrypt(blob[:cut], b"k" * 16, mode) == data[:SMALL_BLOCK]
            continue
        with pytest.raises(FormatError, match=f"truncated encrypted record at offset (0|{boundary}):"):
            decrypt(blob[:cut], b"k" * 16, mode)


@pytest.mark.parametrize("mode", crypto.MODES)
def test_every_bit_flip(small_blocks: int, mode: str) -> None:
    """Flipping any byte raises only our errors. GCM: every flip is detected except in iv[12:16],
    which the quirk leaves unused. CBC: flips may also just garble (no authentication)."""
    data = plaintext(100)
    blob = encrypt(data, b"k" * 16, mode)
    unused_iv = set()
    if mode == "AES-GCM":
        for rec in records(blob):
            unused_iv |= set(range(rec["offset"] + 40, rec["offset"] + 44))
    for pos in range(len(blob)):
        for mask in (0x01, 0x80):
            bad = bytearray(blob)
            bad[pos] ^= mask
            try:
                out = decrypt(bytes(bad), b"k" * 16, mode)
            except (FormatError, CryptoError) as error:
                assert str(error).startswith(PATH)
                continue
            assert mode != "AES-GCM" or pos in unused_iv, pos
            assert (out == data) == (pos in unused_iv), pos


def test_trailing_garbage() -> None:
    blob = encrypt(b"data", b"k" * 16, "AES-GCM")
    with pytest.raises(FormatError, match=f"truncated encrypted record at offset {len(blob)}"):
        decrypt(blob + b"xy", b"k" * 16, "AES-GCM")
    with pytest.raises(FormatError, match=f"corrupted encrypted .ckpt: no record magic at offset {len(blob)}"):
        decrypt(blob + bytes(60), b"k" * 16, "AES-GCM")


@pytest.mark.parametrize("mode", crypto.MODES)
def test_zero_crc_trailer_is_ignored(mode: str) -> None:
    """What MindSpore appends for crc_check=True with enc_key (docs/formats.md §1.6); it carries no checksum."""
    blob = encrypt(b"data", b"k" * 16, mode)
    assert decrypt(blob + b"crc_num" + bytes(10), b"k" * 16, mode) == b"data"
    with pytest.raises(FormatError, match=f"offset {len(blob)}"):
        decrypt(blob + b"crc_num" + (5).to_bytes(10, "big"), b"k" * 16, mode)
    with pytest.raises(FormatError, match="offset 0"):
        decrypt(b"crc_num" + bytes(10), b"k" * 16, mode)


def test_sm4_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise UnsupportedAlgorithm("no SM4 in this OpenSSL")

    monkeypatch.setattr(crypto._lib(), "Cipher", refuse)
    with pytest.raises(UnsupportedError, match="SM4-CBC is not supported"):
        crypto.encrypt_stream(io.BytesIO(b"x"), io.BytesIO(), b"k" * 16, "SM4-CBC")
    monkeypatch.undo()
    blob = encrypt(b"x", b"k" * 16, "SM4-CBC")
    monkeypatch.setattr(crypto._lib(), "Cipher", refuse)
    with pytest.raises(UnsupportedError, match=f"{PATH}: SM4-CBC is not supported"):
        decrypt(blob, b"k" * 16, "SM4-CBC")


# --- key loading -----------------------------------------------------------------------------

SECRET_HEX = "00112233445566778899aabbccddeeff"


def test_key_file_raw(tmp_path) -> None:
    raw = bytes(range(250, 256)) + b"\n\x00" + bytes(range(8)) + b"\n"
    file = tmp_path / "key.bin"
    file.write_bytes(raw)
    assert crypto.load_key(str(file)) == raw  # kept byte for byte, newline included


@pytest.mark.parametrize(
    "text",
    [SECRET_HEX, SECRET_HEX + "\n", SECRET_HEX.upper(), "0011 2233 4455 6677\n8899 aabb ccdd eeff\r\n"],
)
def test_key_file_hex(tmp_path, text: str) -> None:
    file = tmp_path / "key.hex"
    file.write_text(text)
    assert crypto.load_key(str(file)) == bytes.fromhex(SECRET_HEX)


@pytest.mark.parametrize("digits", [48, 64])
def test_key_file_hex_long(tmp_path, digits: int) -> None:
    file = tmp_path / "key.hex"
    file.write_text("ab" * (digits // 2))
    assert crypto.load_key(str(file)) == b"\xab" * (digits // 2)


def test_key_file_ascii_key_in_mindspore_doc_style(tmp_path) -> None:
    """16 hex-looking characters are 16 raw bytes: 8 bytes would be no valid key."""
    file = tmp_path / "key"
    file.write_bytes(b"0123456789ABCDEF")
    assert crypto.load_key(str(file)) == b"0123456789ABCDEF"


@pytest.mark.parametrize("content", [b"", None])
def test_key_file_missing_or_empty(tmp_path, content: bytes | None) -> None:
    file = tmp_path / "key"
    if content is not None:
        file.write_bytes(content)
    with pytest.raises(UsageError, match="key file") as info:
        crypto.load_key(str(file))
    assert str(file) in str(info.value)


def test_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESHARD_TEST_KEY", f" {SECRET_HEX}\n")
    assert crypto.load_key(env_var="RESHARD_TEST_KEY") == bytes.fromhex(SECRET_HEX)
    monkeypatch.setenv("RESHARD_TEST_KEY", "ab" * 24)
    assert crypto.load_key(env_var="RESHARD_TEST_KEY") == b"\xab" * 24


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (None, "is not set"),
        ("", "is empty"),
        ("  \n", "is empty"),
        ("abc", "must hold the key as hex digits"),
        ("zz" * 16, "must hold"),
    ],
)
def test_key_env_bad(monkeypatch: pytest.MonkeyPatch, value: str | None, fragment: str) -> None:
    if value is None:
        monkeypatch.delenv("RESHARD_TEST_KEY", raising=False)
    else:
        monkeypatch.setenv("RESHARD_TEST_KEY", value)
    with pytest.raises(UsageError, match=f"RESHARD_TEST_KEY {fragment}") as info:
        crypto.load_key(env_var="RESHARD_TEST_KEY")
    if value and value.strip():
        assert value.strip() not in str(info.value)  # never echo key material


def test_key_source_count(tmp_path) -> None:
    with pytest.raises(UsageError, match="no key given"):
        crypto.load_key()
    with pytest.raises(UsageError, match="not both"):
        crypto.load_key(str(tmp_path / "k"), "SOME_VAR")


def test_errors_are_one_family() -> None:
    for error in (CryptoError, FormatError, UsageError, UnsupportedError):
        assert issubclass(error, ReshardError)
