"""How a plan's outputs are written, and how the run that writes them goes: two concerns, two types.

``WriteOptions`` change the bytes of the outputs (a crc trailer, encryption, the record chunk size)
and the checksum the manifest records; a resumed run must use the same ones, so the manifest
fingerprints them. ``RunOptions`` change only how the work is done (threads, memory, progress
hooks); ``RayOptions`` adds the Ray executor's fields (defined here, so that choosing an executor
imports neither Ray nor its executor). How sources are read is a
third concern, ``ReadOptions``. The API takes each as its own keyword: ``read=``, ``write=``,
``run=``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reshard import arguments
from reshard.errors import UsageError
from reshard.execute.digest import DEFAULT_ALGORITHM

if TYPE_CHECKING:
    from reshard.plan import FilePlan

# An executor's error with this attribute set to True (a lost Ray node) keeps the finished outputs
# journaled for ``--resume`` instead of rolling the run back.
KEEP_FINISHED = "reshard_keep_finished"
DEFAULT_MAX_MEMORY = 1024**3  # bytes in flight across all workers (staging buffers)
MIN_DEFAULT_WORKERS = 4  # even on 2 cores: on a cold cache the threads mostly wait on the disk
MAX_DEFAULT_WORKERS = 8


def default_workers() -> int:
    """Worker threads when none are asked for: one per core, at least 4, at most 8 (a run that computes
    tensors uses at most one per core: ``local.computing_threads``).

    Measured on 2 cores, cold cache: 4 threads instead of 2 took a merge 8 ranks -> full from
    1.14-1.20 s to 1.05-1.09 s (the disk gets more requests at once); warm, no difference.
    """
    return max(MIN_DEFAULT_WORKERS, min(MAX_DEFAULT_WORKERS, os.cpu_count() or 1))


def _mindspore_chunk_bytes() -> int:
    """``formats.ckpt.SLICE_BYTES``, read when options are made: this module stays numpy-free, so the
    command's parser (which shows these defaults) does not load numpy for ``--help``."""
    from reshard.formats.ckpt import SLICE_BYTES

    return SLICE_BYTES


@dataclass(frozen=True)
class WriteOptions:
    """How outputs are written: what ends up in their bytes, and the checksum recorded for them."""

    write_crc: bool = False  # append MindSpore's crc trailer to .ckpt outputs
    enc_key: bytes | None = field(default=None, repr=False)  # encrypt .ckpt outputs (never printed)
    enc_mode: str = "AES-GCM"
    # .ckpt record size of large tensors (MindSpore's 512 MiB)
    chunk_bytes: int = field(default_factory=_mindspore_chunk_bytes)
    checksum: str = DEFAULT_ALGORITHM  # of the manifest: "xxh128", "blake3" or "sha256" (execute.digest says why)

    def __post_init__(self) -> None:
        """Each field's type (a wrong one failed deep inside a run); the key and mode are checked against
        each other by ``formats.crypto`` once an output is known to be encrypted."""
        arguments.flag(self.write_crc, "WriteOptions.write_crc")
        if self.enc_key is not None and not isinstance(self.enc_key, bytes):
            what = arguments.describe(self.enc_key, show=False)  # never the key itself
            raise UsageError(f"WriteOptions.enc_key must be bytes or None, not {what}")
        arguments.optional_text(self.enc_mode, "WriteOptions.enc_mode")
        arguments.whole(self.chunk_bytes, "WriteOptions.chunk_bytes", 1)
        arguments.optional_text(self.checksum, "WriteOptions.checksum")


@dataclass(frozen=True)
class RunOptions:
    """How a run executes: threads, the memory bound, and hooks called while it writes."""

    workers: int = field(default_factory=default_workers)
    max_memory: int = DEFAULT_MAX_MEMORY
    progress: Callable[[int], None] | None = None  # called with bytes written (from worker threads)
    on_start: Callable[[int], None] | None = None  # called once with the bytes the run will write
    # After each output is renamed into place (and journaled), with its checksum when ``hash_outputs`` had it
    # computed while writing; one call at a time. What it raises stops the run, its finished files kept for
    # a resume (``execute.hooks``).
    on_file_written: Callable[[FilePlan, str | None], None] | None = None
    hash_outputs: bool = False  # checksum each plain output while writing it (encrypted ones: None)
    # Called once an output's bytes are written, before it is renamed into place (from worker threads):
    # what it raises fails the run, which then leaves no output (a check running beside the copy).
    before_commit: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        """``workers`` and ``max_memory`` whole numbers of at least 1 (as ``--workers`` and ``--max-memory``
        take), the hooks functions."""
        arguments.whole(self.workers, f"{type(self).__name__}.workers", 1)
        arguments.whole(self.max_memory, f"{type(self).__name__}.max_memory", 1)
        arguments.flag(self.hash_outputs, f"{type(self).__name__}.hash_outputs")
        for name in ("progress", "on_start", "on_file_written", "before_commit"):
            arguments.hook(getattr(self, name), f"{type(self).__name__}.{name}")


# Bytes fetched from other nodes per writer node and not yet written (execute.ray_nodes), by default.
DEFAULT_IN_FLIGHT = 256 * 1024**2


@dataclass(frozen=True)
class RayOptions(RunOptions):
    """``RunOptions`` plus where and how to run on Ray (``api.execute`` picks Ray for these)."""

    address: str | None = None  # None: the running Ray, RAY_ADDRESS, or a new local cluster
    shared_disk: bool = True
    max_tasks: int | None = None  # at most this many tasks (output files are grouped); None: one per file
    # Sources on the nodes' own disks: "auto" (ask every node) or a placement file (execute.ray_nodes).
    placement: str | None = None
    in_flight: int = DEFAULT_IN_FLIGHT  # with a placement: fetched bytes per writer node not yet written
    # with a placement: called with the schedule (an ``execute.ray_nodes.NodeRun``), then the result
    on_nodes: Callable[[Any], None] | None = None
    # (header-only copy, real source): the plan was made from ``source_from_nodes``' copy
    sources_from: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        """``RunOptions``' checks, then Ray's fields: ``max_tasks`` and ``in_flight`` at least 1, a placement
        ``"auto"`` or a file path (``os.PathLike`` taken), and the two modes without a shared disk kept apart."""
        super().__post_init__()
        arguments.optional_text(self.address, "RayOptions.address")
        arguments.flag(self.shared_disk, "RayOptions.shared_disk")
        arguments.optional_whole(self.max_tasks, "RayOptions.max_tasks", 1)
        arguments.whole(self.in_flight, "RayOptions.in_flight", 1)
        arguments.hook(self.on_nodes, "RayOptions.on_nodes")
        if self.placement is not None:
            object.__setattr__(self, "placement", arguments.path(self.placement, "RayOptions.placement"))
            if not self.shared_disk:
                raise UsageError(
                    "RayOptions: placement (sources on the nodes' own disks, outputs written there) and "
                    "shared_disk=False (the driver ships whole files) are two ways to run without a shared disk: "
                    "give one (--placement or --no-shared-disk)"
                )


__all__ = [
    "DEFAULT_IN_FLIGHT",
    "DEFAULT_MAX_MEMORY",
    "KEEP_FINISHED",
    "RayOptions",
    "RunOptions",
    "WriteOptions",
    "default_workers",
]
