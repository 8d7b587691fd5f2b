"""``recrypt``: ``.ckpt`` files re-written as ``.ckpt`` (encrypt, decrypt, or change the key).

The bytes of every tensor are copied as they are; only the record layer changes (``formats.crypto``).
The inputs are never replaced, so an output folder is required and no output may be an input.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from reshard import arguments
from reshard.arguments import StrPath
from reshard.errors import UsageError
from reshard.execute.options import RunOptions, WriteOptions
from reshard.ops.arguments import check_option_types
from reshard.ops.options import Destination
from reshard.ops.pairs import convert_targets
from reshard.ops.run import Report, Target, run_plan
from reshard.plan import plan_convert
from reshard.sources import ReadOptions, indexed


def recrypt(
    src: StrPath,
    dst: StrPath | None,
    *,
    file_regex: str | None = None,
    destination: Destination | None = None,
    read: ReadOptions | None = None,
    write: WriteOptions | None = None,
    run: RunOptions | None = None,
) -> Report:
    """Re-write ``.ckpt`` files as ``.ckpt``: encrypt, decrypt, or change the key.

    A file or ``rank*`` folders are re-written into ``dst`` under the same names: encrypted with
    ``write.enc_key`` / ``enc_mode`` after decrypting with ``read.dec_key`` when given, or
    decrypted when only ``read.dec_key`` is given. The inputs are never replaced.

    Args:
        src: A ``.ckpt`` file, or a folder of ``rank*`` folders of ``.ckpt`` files (``src`` and ``dst``: a
            ``str`` or an ``os.PathLike`` such as ``pathlib.Path``).
        dst: The output folder (required: the inputs are never replaced).
        file_regex: Only inputs whose name matches (None: all).
        destination: How ``dst`` is treated (``Destination``: overwrite, resume, dry run, manifest).
        read: How sources are read (``ReadOptions``: the decryption key and mode, crc checking).
        write: What the outputs' bytes hold (``WriteOptions``: the encryption key and mode, checksum).
        run: How the run executes (``RunOptions``; a ``RayOptions`` runs on Ray). None: ``RunOptions()``.

    Returns:
        A ``Report``: the plan, notes and the files a resumed run kept.

    Raises:
        UsageError: No key at all, no ``dst``, an output that would replace an input, a bad key or
            mode, ``write.write_crc`` with encryption, or a refused destination (see
            ``check_destination``).
        FormatError: A source file that cannot be read, is truncated or is not what it claims.
        CryptoError: An encrypted source does not decrypt with ``read.dec_key`` / ``dec_mode``.
        IntegrityError: A source's crc trailer does not match its content.
        UnsupportedError: A source holds entries reshard deliberately does not handle (``MapTensor``).
        ReshardError: An output, the journal or the manifest cannot be written (a full disk, say).

    Example:
        from reshard import api
        from reshard.execute.options import WriteOptions
        key = bytes(range(16))
        api.recrypt("demo/full/model.ckpt", "enc", write=WriteOptions(enc_key=key, enc_mode="AES-GCM"))
        api.recrypt("enc/model.ckpt", "plain", read=api.ReadOptions(dec_key=key))
    """
    src, dst = arguments.path(src, "src"), arguments.optional_path(dst, "dst")
    check_option_types(destination=destination, read=read, write=write, run=run)
    out_dir = _recrypt_destination(src, dst, read, write)
    # the .ckpt inputs a conversion to safetensors would read, each written under its own name
    pairs = [
        (i, os.path.join(os.path.dirname(o), os.path.basename(i)))
        for i, o in convert_targets(src, out_dir, "safetensors", file_regex)
    ]
    _check_not_inputs(pairs)
    facts = indexed([(i, 0) for i, _ in pairs], read)
    plan = plan_convert([(f, o, "ckpt") for f, (_, o) in zip(facts, pairs, strict=True)])
    return run_plan(plan, Target(out_dir, [src]), destination, read, write, run, [])


def _recrypt_destination(src: str, dst: str | None, read: ReadOptions | None, write: WriteOptions | None) -> str:
    """The output folder of a re-encryption, which needs a key and an output folder."""
    if (read is None or read.dec_key is None) and (write is None or write.enc_key is None):
        raise UsageError(
            "the source is already .ckpt and no key was given: nothing to do (give --enc-key-file/"
            "--enc-key-env to encrypt, --dec-key-file/--dec-key-env to decrypt)",
            src,
        )
    if not dst:
        raise UsageError("re-encrypting writes new files: give an output folder (the input is never replaced)", src)
    return dst


def _check_not_inputs(pairs: Sequence[tuple[str, str]]) -> None:
    """An output may never be one of the inputs (re-encrypting into the source's own folder)."""
    inputs = {os.path.realpath(i) for i, _ in pairs}
    for _, out in pairs:
        if os.path.realpath(out) in inputs:
            raise UsageError("the output would replace an input file; choose another output folder", out)


__all__ = ["recrypt"]
