"""How sources are read: one frozen options object shared by every reader of checkpoints.

Reading concerns only (which file of a rank folder, decryption, verifying crc trailers); how
outputs are written and how a run is executed are other objects (``reshard.execute.local``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reshard import arguments
from reshard.errors import UsageError
from reshard.formats import rank_dirs, registry


@dataclass(frozen=True)
class ReadOptions:
    """How to find and open source checkpoints (which file of a rank folder, decryption, crc verifying).

    ``verify_crc=True`` (the default) verifies the crc trailer of every plain ``.ckpt`` source that
    has one, on every read path, while planning (one extra read of the file, which also warms the
    page cache for the copy); files without a trailer are accepted, as MindSpore does.
    ``verify_crc=False`` skips it (``--no-check-crc``). When a rank folder holds several
    checkpoints, ``file_suffix`` takes the one whose name ends in it (MindSpore's ``file_suffix``
    rule), ``pick`` chooses by ``"last-name"`` or ``"newest"`` (mtime; default: MindSpore's rule for
    the format), and ``src_format`` reads ``"ckpt"`` or ``"safetensors"`` files when the folders
    hold both. ``iteration`` picks a MindFormers Checkpoint 2.0 root's ``iteration_*`` folder
    (None: the one ``latest_checkpointed_iteration.txt`` names).
    """

    dec_key: bytes | None = field(default=None, repr=False)  # never printed
    dec_mode: str = "AES-GCM"
    verify_crc: bool = True
    file_suffix: str | None = None
    pick: str | None = None
    src_format: str | None = None
    iteration: int | None = None  # a Checkpoint 2.0 root's iteration (None: the one its tracker names)

    def __post_init__(self) -> None:
        """Each field's type (the values are checked by what reads them: a mode by ``formats.crypto``, a
        pick rule and a format by ``source_choice``, an iteration against the checkpoint's)."""
        if self.dec_key is not None and not isinstance(self.dec_key, bytes):
            what = arguments.describe(self.dec_key, show=False)  # never the key itself
            raise UsageError(f"ReadOptions.dec_key must be bytes or None, not {what}")
        for name in ("dec_mode", "file_suffix", "pick", "src_format"):
            arguments.optional_text(getattr(self, name), f"ReadOptions.{name}")
        arguments.flag(self.verify_crc, "ReadOptions.verify_crc")
        arguments.optional_whole(self.iteration, "ReadOptions.iteration", None)


def source_choice(
    fmt: str | None, rule: str | None, file_suffix: str | None, options: ReadOptions | None
) -> tuple[str | None, str | None, str | None]:
    """The format, pick rule and file suffix asked for, by argument or else by ``options``."""
    if options is None:
        return fmt, rule, file_suffix
    if options.src_format is not None:
        registry.check(options.src_format, "source format")
        if fmt is not None and fmt != options.src_format:
            raise UsageError(
                f"this operation reads .{fmt} files; the source format {options.src_format} does not apply"
            )
    if options.pick is not None and options.pick not in rank_dirs.PICKS:
        raise UsageError(f"unknown pick rule {options.pick!r} (choose {' or '.join(rank_dirs.PICKS)})")
    return (
        fmt or options.src_format,
        rule or rank_dirs.PICKS.get(options.pick or ""),
        file_suffix or options.file_suffix,
    )


__all__ = ["ReadOptions", "source_choice"]
