"""The names a DCP checkpoint's files and serializations go by: constants only, no numpy.

Apart from ``records`` (whose chunk tables are numpy columns) so that code which only names a DCP
folder's files (the output checks of every convert, the format registry) loads nothing heavy.
"""

from __future__ import annotations

FORMAT = "dcp"
METADATA_NAME = ".metadata"
DATA_SUFFIX = ".distcp"
DCP_VERSION = "1.0.0"  # torch 2.13's CURRENT_DCP_VERSION
TORCH_SAVE = "torch_save"
SAFETENSORS = "safetensors"
SHARDING_INFO_KEY = "DCP_SHARDING_INFO"  # the safetensors serialization's per-tensor saved_offsets
# what data files without .metadata are (torch renames .metadata.tmp into place after every data file)
UNFINISHED = "an unfinished or partial PyTorch DCP save (torch writes .metadata last)"
NO_METADATA = f"the folder holds {DATA_SUFFIX} data files but no {METADATA_NAME}: {UNFINISHED}"

__all__ = [
    "DATA_SUFFIX",
    "DCP_VERSION",
    "FORMAT",
    "METADATA_NAME",
    "NO_METADATA",
    "SAFETENSORS",
    "SHARDING_INFO_KEY",
    "TORCH_SAVE",
    "UNFINISHED",
]
