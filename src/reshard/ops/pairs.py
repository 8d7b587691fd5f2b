"""The (input, output) file pairs of the file-by-file operations, ``convert`` and ``recrypt``.

Both read one file, or every matching file of the ``rank*`` folders, and write one file per input
under the same rank folder name; which inputs that are, and whether a source holds only ``.ckpt``
files (then a conversion to ``.ckpt`` is a re-encryption), is decided here once.
"""

from __future__ import annotations

import os

from reshard import arguments
from reshard.arguments import StrPath
from reshard.errors import UsageError
from reshard.formats import rank_dirs
from reshard.sources import (
    CHECKPOINTS,
    RANK_FOLDERS,
    ReadOptions,
    chosen_names,
    full_model_file,
    identify,
    rank_subfolders,
)


def convert_targets(
    src: StrPath,
    dst: StrPath | None,
    to: str,
    file_regex: str | None = None,
    choose: ReadOptions | None = None,
    notes: list[str] | None = None,
) -> list[tuple[str, str]]:
    """The (input, output) pairs of a convert: a file, or every matching file of the ``rank*`` folders.

    With ``choose.file_suffix`` or ``choose.pick``, one file per rank folder (a note names it).

    Args:
        src: A checkpoint file, or a folder of ``rank*`` folders.
        dst: The output folder (None: next to the inputs).
        to: The output format, ``"ckpt"`` or ``"safetensors"``.
        file_regex: Only inputs whose name matches (None: all).
        choose: Read options choosing one file per rank folder (None: every file).
        notes: A list the notes are appended to (None: dropped).

    Returns:
        The pairs, in rank folder order; empty when ``file_regex`` matches nothing.

    Raises:
        UsageError: A missing source, or a file of the wrong extension.

    Example:
        from reshard import api
        pairs = api.convert_targets("demo/ckpt_8ranks", "st_8ranks", "safetensors")
    """
    import re

    src, dst = arguments.path(src, "src"), arguments.optional_path(dst, "dst")
    src_ext = ".ckpt" if to == "safetensors" else ".safetensors"
    dst_ext = "." + to
    pattern = re.compile(file_regex) if file_regex else None
    if identify(src, CHECKPOINTS) is not RANK_FOLDERS:
        src = full_model_file(src) or src
        if not src.endswith(src_ext):
            raise UsageError(f"expected a {src_ext} file", src)
        if pattern and not pattern.findall(src):
            return []
        out_dir = dst or os.path.dirname(os.path.abspath(src))
        return [(src, os.path.join(out_dir, os.path.basename(src).replace(src_ext, dst_ext)))]
    pairs = []
    for sub in rank_subfolders(src):
        folder = os.path.join(src, sub)
        names = chosen_names(folder, src_ext[1:], choose, notes) if choose else sorted(os.listdir(folder))
        for name in names:
            if name.endswith(src_ext) and (pattern is None or pattern.search(name)):
                out_dir = os.path.join(dst, sub) if dst else folder
                pairs.append((os.path.join(folder, name), os.path.join(out_dir, name.replace(src_ext, dst_ext))))
    return pairs


def holds_only_ckpt(src: StrPath) -> bool:
    """Whether ``src`` is a ``.ckpt`` file, or ``rank*`` folders holding ``.ckpt`` files and no ``.safetensors``.

    Args:
        src: A path (it need not exist).

    Returns:
        True for a ``.ckpt`` file or such folders; False otherwise, a missing path included.

    Raises:
        OSError: A folder that cannot be listed (no ReshardError: a missing path is just False).

    Example:
        from reshard import api
        assert api.holds_only_ckpt("demo/ckpt_8ranks") and not api.holds_only_ckpt("demo/st_8ranks")
    """
    src = arguments.path(src, "src")
    if os.path.isfile(src):
        return src.endswith(".ckpt")
    if not os.path.isdir(src):
        return False
    folders = [os.path.join(src, d) for d in rank_subfolders(src)]
    return any(rank_dirs.files_in(f, "ckpt") for f in folders) and not any(
        rank_dirs.files_in(f, "safetensors") for f in folders
    )


__all__ = ["convert_targets", "holds_only_ckpt"]
