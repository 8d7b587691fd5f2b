"""Drop-in functions with MindSpore 2.10's names, parameters and defaults, without MindSpore.

``from reshard import mindspore as ms`` lets existing conversion scripts run unchanged on a machine
without the 2.8 GB framework: ``ms.transform_checkpoints(...)``, ``ms.unified_safetensors(...)``,
``ms.save_checkpoint(...)`` and friends take the same arguments and write files with the same names
and the same bytes (checked against MindSpore 2.10 by ``tests/test_mindspore_dropin_oracle.py``).
``reshard.mindspore.parallel`` does the same for ``mindspore.parallel``'s checkpoint functions
(``from reshard.mindspore.parallel import convert_checkpoints``); ``ms.parallel`` works after
``from reshard import mindspore as ms``, as ``ms.parallel`` does after ``import mindspore as ms``.
The conversions live in ``dropin``, ``save_checkpoint`` / ``load_checkpoint`` in ``saveload``, their
argument checks in ``arguments``, ``Parameter`` in ``parameter``, the ``mindspore.parallel`` ones in
``parallel``; the names both MindSpore modules export are the same objects in both, as in MindSpore.
Each is imported when one of its names is first used (``import reshard.mindspore`` loads neither
numpy nor ``reshard.api``), as the command loads ``reshard.api`` on its first use.

How it is built: every function only *validates and translates*. Argument checks reproduce
MindSpore's (docs/formats.md §1.5, §1.9, §3.7-§3.9, §4.1, §4.3, §5) but raise reshard's one-line errors
(``UsageError`` for bad arguments, ``UnsupportedError`` for what reshard deliberately does not do)
instead of a traceback from deep inside; the work is done by the native layers (``api`` plans and
executes, ``formats`` read and write), so the drop-in inherits their bounded memory and atomic
outputs. Tensors go in and come out as numpy arrays (bf16 via ``ml_dtypes``), never as
MindSpore ``Tensor``/``Parameter`` objects; where MindSpore's signature needs a named tensor
(``merge_sliced_parameter``), ``Parameter`` is reshard's own: a name and a numpy array.

Deliberate differences from MindSpore 2.10, the same list as docs/differences.md (valid inputs
otherwise give MindSpore's names and bytes):

* device counts that do not divide each other (4 → 6, 8 → 6 ranks: MindSpore refuses), also from a
  pipelined source whose shared parameters have a different layout in each stage;
* pipeline-shared parameters with a different layout per stage come out right in the
  safetensors-output transform, where MindSpore mixes one stage's data with another's layout;
* a full ``.safetensors`` model transformed to ``.safetensors`` ranks gets the right slice of
  column-split tensors, where MindSpore copies a contiguous run of elements (its ``.ckpt`` output is
  right);
* ``.ckpt`` files holding strings convert to safetensors (kept in the metadata as
  ``reshard.str:<name>``) and back, also with ``ckpt_to_safetensors`` / ``safetensors_to_ckpt``
  (MindSpore fails);
* sources saved with ``remove_redundancy=True`` unify whatever ``merge_with_redundancy`` says
  (MindSpore needs the flag or the metadata to find the copies);
* empty tensors are kept (MindSpore's ``save_checkpoint`` silently drops them), so such files are
  the one place our ``.ckpt`` bytes differ from MindSpore's;
* ``reshard unify`` packs parts from the rank folders in rank order and ``reshard merge-strategies``
  merges per-stage files in name order, so outputs never depend on the directory listing order
  (MindSpore's order, which the drop-in's ``unified_safetensors`` and ``merge_pipeline_strategys``
  keep);
* ``reshard transform`` always plans MindSpore's all-stage mode (``{prefix}{r}`` names); its
  by-stage mode (``{prefix}{r}_part{stage}.ckpt``, chosen when both strategies have one stage and
  the source's names, optimizer states left out on both sides, are a strict subset of the
  destination's) is the drop-in ``transform_checkpoints``'s;
* reading is stricter: chunk sizes must add up to the shape, a crc check of a file without a crc
  trailer is an error (MindSpore, and the drop-in's ``load_checkpoint``, only warn), malformed bytes
  are reported with their byte offset, and ``MapTensor`` entries are refused; the crc trailer of a
  ``.ckpt`` source is checked whenever it has one, on every read path but the drop-in's
  ``load_checkpoint`` (which keeps ``crc_check``), so a damaged file is refused instead of converted
  (``--no-check-crc`` skips; MindSpore checks only with ``crc_check=True``);
* inputs are never modified, chmodded or deleted: no command writes into, onto or around its
  source, or replaces a file it did not write without ``--overwrite``; every path a run writes
  and the free space it needs are checked before the first byte
  ([docs/checks.md](docs/checks.md)); outputs appear atomically (temporary name, then rename); an
  interrupted run resumes (``--resume``) to byte-identical output; every run of the CLI and
  ``api`` ends by writing ``reshard-manifest.json`` (size and checksum of every output: XXH128
  by default, checked with ``xxhsum -H2``, or BLAKE3 / SHA-256 with ``--checksum blake3|sha256`` for
  ``b3sum`` / ``sha256sum``; each record names its algorithm);
* bad input gets one line on stderr and exit code 2, never a traceback or a half-written folder;
  when a rank folder holds several checkpoints, stderr says which one was used and which ignored;
* the drop-in's outputs keep the normal permissions of new files (MindSpore chmods every checkpoint
  0o400 and creates folders 0o700), missing parent folders are created, a failing run removes what
  it wrote, no ``reshard-manifest.json`` is added (the folders hold MindSpore's files only), and
  nothing but the named outputs is ever replaced, chmodded or deleted;
* process counts (``process_num``, ``processes_num``, ``max_process_num``) must be ints >= 1 and do
  not size reshard's IO: the drop-in runs with the CLI's default worker count, as fast as the CLI
  (MindSpore's ``transform_checkpoints`` ignores ``process_num`` for ``.ckpt`` sources, takes
  floats, and fails on counts below 1 elsewhere);
* ``save_checkpoint(format="safetensors", crc_check=True)`` also works for float16/bfloat16 tensors
  (MindSpore fails: "cannot include dtype 'E' in a buffer");
* ``save_checkpoint`` always writes the tensor path (``integrated_save`` / ``async_save`` are
  accepted and checked, but there are no devices to gather from and no background thread); a name
  appearing twice, ``crc_check`` together with ``enc_key`` and python ints outside int64 raise
  ``UsageError`` (MindSpore writes unreadable files or crashes);
* ``load_checkpoint`` returns ``{name: numpy array | str}`` (owned copies); ``specify_prefix`` /
  ``filter_prefix`` also apply to ``.safetensors`` files (MindSpore 2.10 silently ignores them
  there);
* ``transform_checkpoints`` refuses a prefix containing a path separator or an absolute path
  (MindSpore writes outside the destination), a source folder with several ranks but no source
  strategy (MindSpore silently treats rank 0 as the full model), and an unknown ``output_format``;
* ``merge_pipeline_strategys`` never merges the destination file into itself (MindSpore re-merges a
  merged file left in the folder) and refuses an empty folder, a per-stage file whose names hold
  ``-`` and a merged file whose extension does not match its content;
* ``unified_safetensors`` with a ``split_dst_file`` that selects no part raises ``UsageError``
  (MindSpore fails with "number sections must be larger than 0" after creating the folder);
* ``load_distributed_checkpoint`` with a network, with the legacy ``.ckpt`` path or without
  ``predict_strategy`` raises ``UnsupportedError`` (there are no networks without MindSpore).
* ``merge_sliced_parameter`` takes and returns ``reshard.mindspore.Parameter`` (a name and a numpy
  array as ``data``, built by ``Parameter(default_input, name=None, requires_grad=True,
  layerwise_parallel=False)``; any object with ``.name`` and ``.data`` is accepted), ``load_segmented_checkpoints``
  returns ``load_checkpoint``'s ``{name: numpy array | str}``, ``sync_pipeline_shared_parameters`` and
  ``set_op_strategy_config`` raise ``UnsupportedError``, and ``mindspore.parallel``'s ``shard``,
  ``Layout``, ``parameter_broadcast``, ``set_algo_parameters`` / ``get_algo_parameters`` /
  ``reset_algo_parameters`` and its submodules (``nn``, ``function``, ...) are not provided (they
  configure or run a parallel job, with no file to work on): reading one, ``from
  reshard.mindspore.parallel import shard`` included, raises ``UnsupportedError`` saying what reshard
  offers instead, where MindSpore's name would otherwise be a bare ``ImportError``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names as a type checker sees them; at run time __getattr__ imports them
    from reshard.mindspore import parallel as parallel
    from reshard.mindspore.dropin import (
        build_searched_strategy,
        ckpt_to_safetensors,
        load_distributed_checkpoint,
        merge_pipeline_strategys,
        rank_list_for_transform,
        safetensors_to_ckpt,
        transform_checkpoint_by_rank,
        transform_checkpoints,
        unified_safetensors,
    )
    from reshard.mindspore.parallel import (
        load_segmented_checkpoints,
        merge_sliced_parameter,
        restore_group_info_list,
        sync_pipeline_shared_parameters,
    )
    from reshard.mindspore.parameter import Parameter
    from reshard.mindspore.saveload import load_checkpoint, save_checkpoint

# Where each name lives: its module is imported on the name's first use.
_HOMES = {
    "Parameter": "reshard.mindspore.parameter",
    "load_checkpoint": "reshard.mindspore.saveload",
    "save_checkpoint": "reshard.mindspore.saveload",
    **dict.fromkeys(
        (
            "build_searched_strategy",
            "ckpt_to_safetensors",
            "load_distributed_checkpoint",
            "merge_pipeline_strategys",
            "rank_list_for_transform",
            "safetensors_to_ckpt",
            "transform_checkpoint_by_rank",
            "transform_checkpoints",
            "unified_safetensors",
        ),
        "reshard.mindspore.dropin",
    ),
    **dict.fromkeys(
        (
            "load_segmented_checkpoints",
            "merge_sliced_parameter",
            "restore_group_info_list",
            "sync_pipeline_shared_parameters",
        ),
        "reshard.mindspore.parallel",
    ),
}


def __getattr__(name: str) -> object:
    """``ms.<name>``: imported from its module when first used (``ms.parallel``: the module)."""
    if name == "parallel":
        return importlib.import_module("reshard.mindspore.parallel")
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'reshard.mindspore' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "parallel"})


__all__ = [
    "Parameter",
    "build_searched_strategy",
    "ckpt_to_safetensors",
    "load_checkpoint",
    "load_distributed_checkpoint",
    "load_segmented_checkpoints",
    "merge_pipeline_strategys",
    "merge_sliced_parameter",
    "rank_list_for_transform",
    "restore_group_info_list",
    "safetensors_to_ckpt",
    "save_checkpoint",
    "sync_pipeline_shared_parameters",
    "transform_checkpoint_by_rank",
    "transform_checkpoints",
    "unified_safetensors",
]
