"""The record layer of MindSpore's encrypted ``.ckpt`` files (docs/formats.md §1.7).

An encrypted ``.ckpt`` is the plaintext of an ordinary save (docs/formats.md §1.2-§1.5) cut into 64 MiB blocks,
each block encrypted on its own into one *record*; the file is the records back to back. All
integers are int32 little-endian::

    magic       4   0x7F3A5ED8 AES-GCM | 0x7F3A5ED9 AES-CBC | 0x7F3A5EDA SM4-CBC
    [tag]      16   AES-GCM only: the GCM authentication tag, stored *before* block_size
    block_size  4   = 4 + iv_len + 4 + cipher_len
    iv_len      4   = 16
    iv         16   random
    cipher_len  4
    cipher          cipher_len bytes

Why it is built this way:

* **The GCM nonce quirk.** MindSpore stores a 16-byte IV, but its C++ code re-initialises the
  OpenSSL context after setting the IV length, so the nonce actually used is ``iv[:12]``. We
  decrypt with ``iv[:12]`` and, when writing, draw 16 random bytes, encrypt with the first 12 and
  store all 16, so MindSpore reads our files and we read its files (checked by the oracle tests).
  No AAD; 16-byte tag. CBC modes use the full 16-byte IV and PKCS#7 padding.
* **Records are independent**, so decryption streams: one record is parsed, checked, decrypted
  and written to ``dst`` before the next one is touched. Peak memory is one record's plaintext
  (the ciphertext is a zero-copy view of the caller's mmap). Every length field is validated
  against the bytes that remain before it is used, so a truncated or lying file is a
  ``FormatError`` naming the offset, never an ``IndexError`` or a huge allocation.
* **Authenticate before release.** A GCM record's plaintext reaches ``dst`` only after its tag
  verified; a CBC record's only after its padding checked. CBC has no authentication: a wrong key
  almost always (255/256) breaks the padding; when it does not, the protobuf parser of the
  plaintext fails later. Both errors therefore say "wrong key or mode".
* **Primitives come from ``cryptography``** (OpenSSL); nothing here implements a cipher.
* **Empty plaintext writes nothing.** MindSpore 2.10 encrypting an empty save produces a 0-byte
  file (verified), and a plaintext that is an exact multiple of 64 MiB gets no trailing empty
  record (verified with a shrunken block size), so ``encrypt_stream`` emits one record per
  non-empty block and ``decrypt_stream`` of an empty buffer writes nothing.
* **crc and encryption are exclusive (docs/formats.md §1.6).** We never write both. MindSpore 2.10 given
  ``crc_check=True`` with ``enc_key`` appends ``b"crc_num" + 10 zero bytes`` after the records
  (the crc is never accumulated) and then cannot load its own file. Because that trailer carries
  no checksum and every record is verified on its own, ``decrypt_stream`` ignores exactly that
  zero trailer when it follows the last complete record, which rescues such files; any other
  trailing bytes are a ``FormatError``.

Keys are raw bytes, no derivation (AES 16/24/32 bytes, SM4 16). ``load_key`` reads them for the
CLI from a file or from an environment variable holding hex, never from a command-line value, and
no message ever contains key material.
"""

from __future__ import annotations

import functools
import os
import string
import struct
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers import CipherAlgorithm, modes

from reshard.errors import CryptoError, FormatError, UnsupportedError, UsageError

MODES = ("AES-GCM", "AES-CBC", "SM4-CBC")
BLOCK_BYTES = 64 * 1024 * 1024  # plaintext per record: MindSpore's ENCRYPT_BLOCK_SIZE (64 Ki) * 1024

MAGIC_AES_GCM = 0x7F3A5ED8
MAGIC_AES_CBC = 0x7F3A5ED9
MAGIC_SM4_CBC = 0x7F3A5EDA

_MAGIC_OF_MODE = {"AES-GCM": MAGIC_AES_GCM, "AES-CBC": MAGIC_AES_CBC, "SM4-CBC": MAGIC_SM4_CBC}
_MODE_OF_MAGIC = {magic: mode for mode, magic in _MAGIC_OF_MODE.items()}

IV_BYTES = 16  # what MindSpore stores (iv_len) and the CBC IV
GCM_NONCE_BYTES = 12  # the quirk: GCM really uses iv[:12]
TAG_BYTES = 16  # GCM tag, stored between magic and block_size
CIPHER_BLOCK_BYTES = 16  # AES and SM4 block size: CBC ciphertext is a positive multiple of it
AES_KEY_BYTES = (16, 24, 32)  # AES-128/192/256
SM4_KEY_BYTES = (16,)

_INT = struct.Struct("<i")  # every length field: int32 little-endian
_MAGIC = struct.Struct("<I")
_SIZES = struct.Struct("<ii")  # block_size, iv_len
# What MindSpore appends after the records when crc_check and enc_key are both set (docs/formats.md §1.6).
_ZERO_CRC_TRAILER = b"crc_num" + bytes(10)


@functools.cache
def _lib() -> SimpleNamespace:
    """``cryptography``'s pieces, imported on first use: a run without encrypted files never loads
    them (19 modules, part of every command's start-up otherwise)."""
    from cryptography.exceptions import InvalidTag, UnsupportedAlgorithm
    from cryptography.hazmat.primitives import padding
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    return SimpleNamespace(
        InvalidTag=InvalidTag,
        UnsupportedAlgorithm=UnsupportedAlgorithm,
        padding=padding,
        Cipher=Cipher,
        algorithms=algorithms,
        modes=modes,
    )


def encrypted_mode(head: bytes) -> str | None:
    """The mode whose record magic the first 4 bytes of ``head`` carry, or None (not encrypted)."""
    if len(head) < _MAGIC.size:
        return None
    (magic,) = _MAGIC.unpack_from(head, 0)
    return _MODE_OF_MAGIC.get(magic)


def check_key(key: bytes, mode: str, path: str | None = None) -> None:
    """Raise ``UsageError`` unless ``mode`` is one of MODES and ``key`` has a length it accepts."""
    if not isinstance(mode, str) or mode not in MODES:
        raise UsageError(f"unknown encryption mode {mode!r}; expected one of {', '.join(MODES)}", path)
    if not isinstance(key, bytes | bytearray):
        raise UsageError(f"the {mode} key must be bytes, got {type(key).__name__}", path)
    allowed = SM4_KEY_BYTES if mode.startswith("SM4") else AES_KEY_BYTES
    if len(key) not in allowed:
        sizes = " or ".join(str(n) for n in allowed)
        raise UsageError(f"{mode} needs a {sizes}-byte key, got {len(key)} bytes", path)


@dataclass(frozen=True)
class _Record:
    """One parsed record: where its ciphertext is and what decrypts it (offsets into the source)."""

    offset: int
    tag: bytes  # empty for CBC modes
    iv: bytes
    cipher_start: int
    cipher_len: int

    @property
    def end(self) -> int:
        return self.cipher_start + self.cipher_len


def decrypt_stream(
    src: Any,
    dst: BinaryIO,
    key: bytes,
    mode: str,
    path: str | None = None,
    done: Callable[[int], None] | None = None,
) -> None:
    """Decrypt the whole encrypted file in buffer ``src`` record by record into ``dst``; ``done`` is
    told where each record ends (the caller hands the pages of a mapped ``src`` back up to there)."""
    check_key(key, mode, path)
    with memoryview(src) as raw, raw.cast("B") as view:
        offset = 0
        while offset < len(view):
            if offset > 0 and _is_zero_crc_trailer(view, offset):
                return
            record = _parse_record(view, offset, mode, path)
            with view[record.cipher_start : record.end] as cipher:
                _decrypt_record(record, cipher, dst, key, mode, path)
            offset = record.end
            if done is not None:
                done(offset)


def _is_zero_crc_trailer(view: memoryview, offset: int) -> bool:
    """True if exactly MindSpore's zero ``crc_num`` trailer (crc_check + enc_key) remains."""
    if len(view) - offset != len(_ZERO_CRC_TRAILER):
        return False
    with view[offset:] as rest:
        return rest == _ZERO_CRC_TRAILER


def _parse_record(view: memoryview, offset: int, mode: str, path: str | None) -> _Record:
    """Read and validate one record header at ``offset``; every length is checked before use."""
    _need(view, offset, _MAGIC.size, "the record magic", offset, path)
    (magic,) = _MAGIC.unpack_from(view, offset)
    written = _MODE_OF_MAGIC.get(magic)
    if written is None:
        what = "not an encrypted .ckpt" if offset == 0 else "corrupted encrypted .ckpt"
        raise FormatError(f"{what}: no record magic at offset {offset} (found 0x{magic:08X})", path)
    if written != mode:
        raise CryptoError(f"written with {written}, not {mode} (record at offset {offset})", path)
    pos = offset + _MAGIC.size
    tag = b""
    if mode == "AES-GCM":
        _need(view, pos, TAG_BYTES, "the GCM tag", offset, path)
        tag = bytes(view[pos : pos + TAG_BYTES])
        pos += TAG_BYTES
    _need(view, pos, _SIZES.size, "block_size and iv_len", offset, path)
    block_size, iv_len = _SIZES.unpack_from(view, pos)
    pos += _SIZES.size
    if iv_len != IV_BYTES:
        raise FormatError(f"record at offset {offset}: iv_len is {iv_len}, expected {IV_BYTES}", path)
    _need(view, pos, IV_BYTES + _INT.size, "the IV and cipher_len", offset, path)
    iv = bytes(view[pos : pos + IV_BYTES])
    (cipher_len,) = _INT.unpack_from(view, pos + IV_BYTES)
    pos += IV_BYTES + _INT.size
    _check_cipher_len(cipher_len, block_size, mode, offset, path)
    _need(view, pos, cipher_len, "the ciphertext", offset, path)
    return _Record(offset, tag, iv, pos, cipher_len)


def _need(view: memoryview, pos: int, count: int, what: str, offset: int, path: str | None) -> None:
    """FormatError unless ``count`` bytes remain at ``pos`` (truncated file or lying length)."""
    left = len(view) - pos
    if count > left:
        raise FormatError(
            f"truncated encrypted record at offset {offset}: {what} needs {count} bytes, {left} left", path
        )


def _check_cipher_len(cipher_len: int, block_size: int, mode: str, offset: int, path: str | None) -> None:
    """cipher_len must be non-negative, whole cipher blocks for CBC, and agree with block_size."""
    if cipher_len < 0:
        raise FormatError(f"record at offset {offset}: negative cipher_len {cipher_len}", path)
    if mode != "AES-GCM" and (cipher_len == 0 or cipher_len % CIPHER_BLOCK_BYTES):
        raise FormatError(
            f"record at offset {offset}: {mode} cipher_len {cipher_len} is not a positive "
            f"multiple of {CIPHER_BLOCK_BYTES}",
            path,
        )
    expected = _INT.size + IV_BYTES + _INT.size + cipher_len
    if block_size != expected:
        raise FormatError(
            f"record at offset {offset}: block_size {block_size} disagrees with cipher_len "
            f"{cipher_len} (expected {expected})",
            path,
        )


def _decrypt_record(
    record: _Record, cipher: memoryview, dst: BinaryIO, key: bytes, mode: str, path: str | None
) -> None:
    """Decrypt one record and write its plaintext only once tag or padding has checked out."""
    if mode == "AES-GCM":
        gcm = _lib().modes.GCM(record.iv[:GCM_NONCE_BYTES], record.tag)
        decryptor = _context(key, mode, gcm, path, encrypt=False)
        plain = decryptor.update(cipher)
        try:
            decryptor.finalize()
        except _lib().InvalidTag:
            raise CryptoError(
                f"AES-GCM tag check failed for the record at offset {record.offset}: "
                "wrong key or mode, or the file was modified",
                path,
            ) from None
        dst.write(plain)
        return
    decryptor = _context(key, mode, _lib().modes.CBC(record.iv), path, encrypt=False)
    plain = decryptor.update(cipher)
    decryptor.finalize()
    # Unpad only the last block, so the record's plaintext is never copied a second time.
    unpadder = _lib().padding.PKCS7(CIPHER_BLOCK_BYTES * 8).unpadder()
    try:
        tail = unpadder.update(plain[-CIPHER_BLOCK_BYTES:]) + unpadder.finalize()
    except ValueError:
        raise CryptoError(
            f"{mode} padding invalid in the record at offset {record.offset}: "
            "wrong key or mode, or the file was modified",
            path,
        ) from None
    with memoryview(plain) as body:
        dst.write(body[:-CIPHER_BLOCK_BYTES])
    dst.write(tail)


def _context(key: bytes, mode: str, cipher_mode: modes.Mode, path: str | None, encrypt: bool) -> Any:
    """A ``cryptography`` encryptor/decryptor for ``mode``; SM4 may be missing from the OpenSSL build."""
    lib = _lib()
    algorithm: CipherAlgorithm = lib.algorithms.SM4(key) if mode == "SM4-CBC" else lib.algorithms.AES(key)
    try:
        cipher = lib.Cipher(algorithm, cipher_mode)
        return cipher.encryptor() if encrypt else cipher.decryptor()
    except lib.UnsupportedAlgorithm:
        raise UnsupportedError(f"{mode} is not supported by this cryptography/OpenSSL build", path) from None


def encrypt_stream(src: BinaryIO, dst: BinaryIO, key: bytes, mode: str) -> None:
    """Encrypt the plaintext read from ``src`` into ``dst``: one record per BLOCK_BYTES block."""
    check_key(key, mode)
    while block := _read_block(src, BLOCK_BYTES):
        _write_record(dst, block, key, mode)


def _read_block(src: BinaryIO, size: int) -> bytes:
    """Up to ``size`` bytes, short only at end of input (pipes may return less per read)."""
    first = src.read(size)
    if not first or len(first) == size:
        return first
    parts = [first]
    got = len(first)
    while got < size and (more := src.read(size - got)):
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _write_record(dst: BinaryIO, block: bytes, key: bytes, mode: str) -> None:
    """Encrypt one block exactly as MindSpore does and write the record."""
    iv = os.urandom(IV_BYTES)
    if mode == "AES-GCM":
        encryptor = _context(key, mode, _lib().modes.GCM(iv[:GCM_NONCE_BYTES]), None, encrypt=True)
        cipher = encryptor.update(block)
        encryptor.finalize()
        dst.write(_MAGIC.pack(MAGIC_AES_GCM) + encryptor.tag + _header_tail(iv, len(cipher)))
        dst.write(cipher)
        return
    whole = len(block) - len(block) % CIPHER_BLOCK_BYTES
    padder = _lib().padding.PKCS7(CIPHER_BLOCK_BYTES * 8).padder()
    last = padder.update(block[whole:]) + padder.finalize()
    encryptor = _context(key, mode, _lib().modes.CBC(iv), None, encrypt=True)
    dst.write(_MAGIC.pack(_MAGIC_OF_MODE[mode]) + _header_tail(iv, whole + len(last)))
    with memoryview(block) as view:
        dst.write(encryptor.update(view[:whole]))
    dst.write(encryptor.update(last) + encryptor.finalize())


def _header_tail(iv: bytes, cipher_len: int) -> bytes:
    """block_size, iv_len, iv, cipher_len: the part of the header after magic (and GCM tag)."""
    block_size = _INT.size + len(iv) + _INT.size + cipher_len
    return _SIZES.pack(block_size, len(iv)) + iv + _INT.pack(cipher_len)


_HEX_KEY_CHARS = frozenset(string.hexdigits)
_HEX_KEY_LENGTHS = tuple(2 * n for n in AES_KEY_BYTES)  # 32/48/64 hex digits = a 16/24/32-byte key


KEY_FORMATS = ("auto", "raw", "hex")


def load_key(key_file: str | None = None, env_var: str | None = None, key_format: str = "auto") -> bytes:
    """The key from a file or from the environment variable named ``env_var`` (hex); see _key_from_file.

    Exactly one source must be given. The key is never taken from a command-line value, so it does
    not show up in shell history or ``ps``; error messages never contain key material.
    ``key_format`` says how to read a key file: ``auto`` (see _key_from_file), ``raw`` (its bytes are
    the key) or ``hex`` (hex digits, whitespace ignored). The environment variable is always hex.
    """
    if key_format not in KEY_FORMATS:
        raise UsageError(f"unknown key format {key_format!r} (choose {', '.join(KEY_FORMATS)})")
    if key_file is not None and env_var is not None:
        raise UsageError("give either a key file or a key environment variable, not both")
    if key_file is not None:
        return _key_from_file(key_file, key_format)
    if env_var is not None:
        if key_format == "raw":
            raise UsageError(f"the key environment variable {env_var} holds hex; --key-format raw is for key files")
        return _key_from_env(env_var)
    raise UsageError("no key given: pass a key file or the name of an environment variable holding hex")


def _read_key_file(key_file: str) -> bytes:
    try:
        with open(key_file, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UsageError(f"cannot read the key file: {e.strerror or e}", key_file) from None
    if not data:
        raise UsageError("the key file is empty", key_file)
    return data


def _hex_digits(data: bytes) -> str | None:
    """The hex digits of a key file that spells a 16/24/32-byte key in hex (whitespace ignored), else None."""
    digits = "".join(data.decode("ascii", errors="replace").split())
    return digits if len(digits) in _HEX_KEY_LENGTHS and set(digits) <= _HEX_KEY_CHARS else None


def ambiguous_key_file(key_file: str) -> bool:
    """True when the file is both a valid raw key and a valid hex key: exactly 32 hex characters, no
    whitespace (a 32-byte AES-256 key as raw bytes, or a 16-byte key in hex). ``auto`` reads it as hex."""
    try:
        with open(key_file, "rb") as f:
            data = f.read(65)
    except OSError:
        return False  # load_key reports it
    return len(data) in AES_KEY_BYTES and _hex_digits(data) is not None


def _key_from_file(key_file: str, key_format: str = "auto") -> bytes:
    """Raw bytes, unless the file is hex text (``key_format="auto"``), or as ``key_format`` says.

    In ``auto`` the file is read as hex when it holds only hex digits and whitespace *and* those
    digits spell a 16, 24 or 32-byte key (32, 48 or 64 digits); otherwise its bytes are the key,
    unchanged (no newline stripping: a binary key may end in 0x0A). The length condition keeps
    MindSpore's documented style of ASCII key, e.g. ``0123456789ABCDEF`` (16 raw bytes), working. An
    ASCII key that is itself 32 hex characters is ambiguous (``ambiguous_key_file``) and read as
    hex; ``key_format="raw"`` takes it as 32 raw bytes.
    """
    data = _read_key_file(key_file)
    if key_format == "raw":
        return data
    digits = _hex_digits(data)
    if digits is not None:
        return bytes.fromhex(digits)
    if key_format == "hex":
        raise UsageError(
            "--key-format hex: the key file must hold 32, 48 or 64 hex digits (a 16, 24 or 32-byte key)", key_file
        )
    return data


def _key_from_env(env_var: str) -> bytes:
    """The key as hex digits (whitespace ignored) in environment variable ``env_var``."""
    value = os.environ.get(env_var)
    if value is None:
        raise UsageError(f"the key environment variable {env_var} is not set")
    digits = "".join(value.split())
    if not digits:
        raise UsageError(f"the key environment variable {env_var} is empty")
    if len(digits) % 2 or not set(digits) <= _HEX_KEY_CHARS:
        raise UsageError(f"the key environment variable {env_var} must hold the key as hex digits")
    return bytes.fromhex(digits)


__all__ = [
    "AES_KEY_BYTES",
    "BLOCK_BYTES",
    "CIPHER_BLOCK_BYTES",
    "GCM_NONCE_BYTES",
    "IV_BYTES",
    "KEY_FORMATS",
    "MAGIC_AES_CBC",
    "MAGIC_AES_GCM",
    "MAGIC_SM4_CBC",
    "MODES",
    "SM4_KEY_BYTES",
    "TAG_BYTES",
    "ambiguous_key_file",
    "check_key",
    "decrypt_stream",
    "encrypt_stream",
    "encrypted_mode",
    "load_key",
]
