"""Megatron-core ``torch_dist`` checkpoints: the files around the DCP data, read and written without torch.

What megatron-core 0.16.1's ``dist_checkpointing.save`` writes (seen by running it): a PyTorch DCP
folder (``.metadata`` + ``__<r>_<k>.distcp``, ``reshard.formats.dcp``) plus ``metadata.json``
(``{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
"common_backend_version": 1}``: which backends wrote the sharded and the common state) and
``common.pt``, a ``torch.save`` of the non-sharded state (``{}`` for a model's state dict; Megatron-LM
puts its args and iteration there). The ``ShardedObject`` s of a state dict (``_extra_state``) are
DCP byte items in ``.metadata``. A Megatron-LM training run keeps each save in ``iter_<7 digits>/``
(``release/`` for a released model) beside ``latest_checkpointed_iteration.txt``, which names the
latest (a number, or ``release``).

``common.pt`` is never unpickled (it is arbitrary pickled Python): it is carried byte for byte.
A new one (an output from another kind of source) is ``empty_common()``: the bytes ``torch.save({},
"common.pt")`` writes, built here (a ZIP of stored members aligned to 64 bytes, with data descriptors
and ZIP64 end records, as torch's file writer lays them out), the one field torch makes up per save
(``.data/serialization_id``) set to a fixed value so reshard's outputs are reproducible.
"""

from __future__ import annotations

import json
import os
import re
import struct
import zlib
from collections.abc import Mapping

from reshard.errors import FormatError, UnsupportedError, UsageError
from reshard.formats.tracker import read_tracker_text

CONFIG_NAME = "metadata.json"  # megatron's name for the backends' record
COMMON_NAME = "common.pt"
TRACKER_NAME = "latest_checkpointed_iteration.txt"  # Megatron-LM's tracker (MindFormers uses the same name)
RELEASE = "release"  # a tracker naming this: the release/ folder
BACKEND = "torch_dist"
# What megatron-core writes, in its key order.
CONFIG: dict[str, object] = {
    "sharded_backend": BACKEND,
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
_ITER = re.compile(r"iter_(\d{7,})")
_LEGACY = re.compile(r"mp_rank_\d{2}(_\d{3})?(_\d{3})?")  # Megatron-LM's legacy per-rank folders


def _names(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def iteration_name(iteration: int) -> str:
    """The folder Megatron-LM saves iteration ``iteration`` in: ``iter_<7 digits>``."""
    return f"iter_{iteration:07d}"


def is_iteration_name(name: str) -> bool:
    """A Megatron-LM save folder's name: ``iter_<7+ digits>`` or ``release``."""
    return _ITER.fullmatch(name) is not None or name == RELEASE


def config_text() -> str:
    """``metadata.json`` as megatron-core writes it (``json.dump`` of ``CONFIG``, no newline)."""
    return json.dumps(CONFIG)


def read_config(folder: str) -> dict[str, object]:
    """``metadata.json`` of a ``torch_dist`` folder, checked: a JSON object naming the torch_dist backend.

    Raises:
        FormatError: It is missing, does not parse, or is not an object with a ``sharded_backend``.
        UnsupportedError: Another sharded backend (zarr) or common backend than torch's.
    """
    path = os.path.join(folder, CONFIG_NAME)
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except FileNotFoundError:
        if any(_LEGACY.fullmatch(n) for n in _names(folder)):
            raise UnsupportedError(
                "Megatron-LM's legacy torch checkpoint (mp_rank_*/model_optim_rng.pt) is not supported; "
                "save with --ckpt-format torch_dist",
                folder,
            ) from None
        raise FormatError(f"no {CONFIG_NAME}: not a Megatron-core distributed checkpoint", folder) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"{CONFIG_NAME} does not parse: {exc}", path) from None
    if not isinstance(config, dict) or not isinstance(config.get("sharded_backend"), str):
        raise FormatError(f"{CONFIG_NAME} is not a Megatron-core record (no sharded_backend)", path)
    backend = config["sharded_backend"]
    if backend != BACKEND:
        raise UnsupportedError(f"Megatron-core's {backend!r} sharded backend is not supported (torch_dist is)", path)
    common = config.get("common_backend", "torch")
    if common != "torch":
        raise UnsupportedError(f"Megatron-core's {common!r} common backend is not supported (torch is)", path)
    return config


def read_tracker(root: str) -> str:
    """The save folder ``latest_checkpointed_iteration.txt`` names (``iter_<7 digits>`` or ``release``).

    Raises:
        FormatError: The tracker cannot be read or holds neither a number nor ``release``.
    """
    path = os.path.join(root, TRACKER_NAME)
    text = read_tracker_text(path)
    if text == RELEASE:
        return RELEASE
    if not text.isdigit():
        raise FormatError(f"the tracker holds {text[:40]!r}, not an iteration number or 'release'", path)
    return iteration_name(int(text))


def iteration_folders(root: str) -> list[str]:
    """The save folders (``iter_*``, ``release``) of a Megatron-LM run folder, sorted by name."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    return [n for n in names if is_iteration_name(n) and os.path.isdir(os.path.join(root, n))]


def resolve_iteration(root: str, iteration: int | None) -> str:
    """The save folder a run folder stands for: ``iter_<iteration>`` if asked, else the tracker's,
    else its only one.

    Raises:
        UsageError: The iteration asked for or the tracker's is missing; no tracker and not one save folder.
        FormatError: The tracker does not parse.
    """
    if iteration is not None:
        folder = os.path.join(root, iteration_name(iteration))
        if not os.path.isdir(folder):
            found = ", ".join(iteration_folders(root)) or "none"
            raise UsageError(f"no iteration {iteration} ({os.path.basename(folder)} is missing; found {found})", root)
        return folder
    if os.path.isfile(os.path.join(root, TRACKER_NAME)):
        name = read_tracker(root)
        folder = os.path.join(root, name)
        if not os.path.isdir(folder):
            raise UsageError(f"names {name} but that folder is missing", os.path.join(root, TRACKER_NAME))
        return folder
    folders = iteration_folders(root)
    if len(folders) != 1:
        many = f"no {TRACKER_NAME} and {len(folders)} iter_* folders"
        raise UsageError(f"{many}: choose one with --src-iteration N", root)
    return os.path.join(root, folders[0])


# ------------------------------------------------------------------------------- common.pt out

_ALIGN = 64  # torch.save aligns every member's data to 64 bytes from the archive's start
_SERIALIZATION_ID = "0" * 40  # torch makes one up per save (40 decimal digits); fixed: reproducible outputs


def empty_common() -> bytes:
    """The ``common.pt`` megatron-core writes for an empty common state: ``torch.save({}, "common.pt")``."""
    return torch_save_file("common", b"\x80\x02}q\x00.")  # pickle protocol 2 of {}, memoised as torch's pickler


def torch_save_file(archive: str, data_pkl: bytes, serialization_id: str = _SERIALIZATION_ID) -> bytes:
    """The bytes ``torch.save`` writes to a file named ``<archive>.pt`` for an object with no tensor
    whose pickle is ``data_pkl``: its members in torch's order, each behind a local header padded with
    an ``FB`` extra field to the 64-byte alignment, followed by a data descriptor; then the central
    directory and ZIP64 end records (always written by torch's file writer)."""
    records: Mapping[str, bytes] = {
        "data.pkl": data_pkl,
        ".format_version": b"1",
        ".storage_alignment": str(_ALIGN).encode(),
        "byteorder": b"little",
        "version": b"3\n",
        ".data/serialization_id": serialization_id.encode("ascii"),
    }
    out = bytearray()
    central = bytearray()
    for name, content in records.items():
        full = f"{archive}/{name}".encode("ascii")
        offset = len(out)
        pad = (-(offset + 30 + len(full) + 4)) % _ALIGN
        extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        crc, size = zlib.crc32(content), len(content)
        out += struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 0, 0x0808, 0, 0, 0, 0, 0, 0, len(full), len(extra))
        out += full + extra + content + struct.pack("<4sIII", b"PK\x07\x08", crc, size, size)
        central += struct.pack(
            "<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 0, 0, 0x0808, 0, 0, 0, crc, size, size, len(full), 0, 0, 0, 0, 0,
            offset,
        ) + full  # fmt: skip
    start, count = len(out), len(records)
    out += central
    end64 = len(out)
    out += struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 0x031E, 45, 0, 0, count, count, len(central), start)
    out += struct.pack("<4sIQI", b"PK\x06\x07", 0, end64, 1)
    out += struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, count, count, len(central), start, 0)
    return bytes(out)


__all__ = [
    "BACKEND",
    "COMMON_NAME",
    "CONFIG",
    "CONFIG_NAME",
    "RELEASE",
    "TRACKER_NAME",
    "config_text",
    "empty_common",
    "is_iteration_name",
    "iteration_folders",
    "iteration_name",
    "read_config",
    "read_tracker",
    "resolve_iteration",
    "torch_save_file",
]
