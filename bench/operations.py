"""The benchmarked operations: each one as a reshard command and as MindSpore's equivalent.

Both contestants get the same input files and a fresh output folder. reshard runs through its
CLI with default options (what a user gets), and through the drop-in ``reshard.mindspore``
(``dropin_*``): ``transform_checkpoints`` with MindSpore's defaults, and the merge, unify, split and
convert calls with MindSpore's rows' arguments, the calls a MindSpore script makes after swapping its
import, against MindSpore running that very call. Otherwise MindSpore
2.10 runs its public converters with their
parallelism set to the machine's core count (``ms_procs``): ``process_num`` /
``processes_num`` / ``max_process_num`` default to 1 or 64 there, and neither is a better
choice on a 2-core box (64 would fork one loader per file). Each operation names the MindSpore
path it is compared with, because the targets differ (the Checkpoint 2.0 rows have no
MindSpore contestant: neither MindSpore nor MindFormers converts that format offline, so they are
held to the ``cp`` and memory targets only): >= 10x against the ``.ckpt`` path,
>= 4x against the safetensors path.

Which path is which: the ``.ckpt`` path is MindSpore's checkpoint transform machinery on ``.ckpt``
files (``transform_checkpoints`` loading every needed file whole and deep-copying it per
destination rank: ~9 s per GB here). ``ckpt_to_safetensors`` is not part of it: it lives in
MindSpore's safetensors tooling, does no resharding, and runs at the speed of its safetensors path
(one load and one ``safetensors`` save per file, ~1.2 s per GB here), so it is held to the
safetensors target. Against the ``.ckpt``-path target it could not pass on any machine: 10x its
time is less than ``cp`` needs for the same bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workload import Workload

CKPT_PATH_TARGET = 10.0  # MindSpore / reshard time on the .ckpt path (issue 4)
SAFETENSORS_PATH_TARGET = 4.0  # MindSpore / reshard time on the safetensors path
CP_TARGET = 1.25  # reshard / cp -r of the same output bytes
RSS_ALLOWANCE = 300 * 1024**2  # peak RSS <= largest single tensor + this


@dataclass(frozen=True)
class Operation:
    key: str
    title: str
    inputs: tuple[str, ...]  # every file or folder the operation reads (cache state is set on these)
    # output folder -> reshard CLI arguments, or a drop-in call {"dropin": name, "kwargs": {...}} (rs_child.py)
    reshard: Callable[[str], list[str] | dict[str, Any]]
    # output folder, processes -> ms_child job; None: MindSpore has no such operation (Checkpoint 2.0)
    mindspore: Callable[[str, int], dict[str, Any]] | None
    ms_call: str  # what MindSpore runs, for the report
    ms_target: float  # required MindSpore / reshard time ratio
    reference: Callable[[], str]  # what the output must equal (verification)
    grouping: str  # how the output is compared with the reference: workload.GROUPINGS
    # Flags appended to the reshard CLI arguments (run.py adds them before --reshard-flags). The
    # Hugging Face export names its flags here so that more can join them (--preset, --weights-only);
    # with "--weights-only" among them, verification leaves the reference's training state out.
    extra_flags: tuple[str, ...] = ()
    # The dtype (bf16/fp16/fp32) the output's floating model weights were cast to: verification casts
    # the reference's by reshard's own rule (reshard.plan.cast) before comparing bytes.
    cast: str | None = None


MindSporeJob = Callable[[str, int], dict[str, Any]]
DROPIN_PROCS = os.cpu_count() or 1  # the process count the drop-in rows pass, as MindSpore's rows do (--ms-procs)


def dropin(
    key: str,
    title: str,
    inputs: tuple[str, ...],
    job: MindSporeJob,
    ms_call: str,
    ms_target: float,
    reference: Callable[[], str],
    grouping: str,
) -> Operation:
    """An operation run as one MindSpore call, by ``reshard.mindspore`` and by MindSpore alike: the very
    arguments of MindSpore's row (``job``), what a script written for MindSpore passes after swapping its
    import (the process counts, which reshard checks but does not size its threads by, are the core count)."""

    def reshard(out: str) -> dict[str, Any]:
        called = job(out, DROPIN_PROCS)
        return {"dropin": called["fn"], "args": called.get("args", []), "kwargs": called["kwargs"]}

    return Operation(key, title, inputs, reshard, job, ms_call, ms_target, reference, grouping)


def operations(w: Workload) -> list[Operation]:
    s8, s4 = w.strategy8, w.strategy4

    def ms_transform(src: str, dst_strategy: str | None, fmt: str) -> Callable[[str, int], dict[str, Any]]:
        return lambda out, procs: {
            "fn": "transform_checkpoints",
            "kwargs": {
                "src_checkpoints_dir": src,
                "dst_checkpoints_dir": out,
                "ckpt_prefix": "checkpoint_",
                "src_strategy_file": s8,
                "dst_strategy_file": dst_strategy,
                "process_num": procs,
                "output_format": fmt,
            },
        }

    def dropin_transform(out: str) -> dict[str, Any]:
        """One call, run by ``reshard.mindspore`` and by MindSpore alike: MindSpore's defaults
        (``process_num=1``), as a script written for MindSpore calls it."""
        return {
            "src_checkpoints_dir": w.ranks8_ckpt,
            "dst_checkpoints_dir": out,
            "ckpt_prefix": "checkpoint_",
            "src_strategy_file": s8,
            "dst_strategy_file": s4,
        }

    def ms_unify(out: str, procs: int) -> dict[str, Any]:
        kwargs = {"src_dir": w.ranks8_st, "src_strategy_file": s8, "dst_dir": out, "max_process_num": procs}
        return {"fn": "unified_safetensors", "kwargs": kwargs}

    def ms_split(out: str, procs: int) -> dict[str, Any]:
        kwargs = {
            "format": "safetensors",
            "predict_strategy": s8,
            "unified_safetensors_dir": w.unified,
            "dst_safetensors_dir": out,
            "max_process_num": procs,
        }
        return {"fn": "load_distributed_checkpoint", "args": [None], "kwargs": kwargs}

    def ms_convert(out: str, procs: int) -> dict[str, Any]:
        return {
            "fn": "ckpt_to_safetensors",
            "kwargs": {"file_path": w.ranks8_ckpt, "save_path": out, "processes_num": procs},
        }

    merge_job = ms_transform(w.ranks8_ckpt, None, "ckpt")
    return [
        Operation(
            "transform_ckpt",
            "transform 8→4 ranks (.ckpt)",
            (w.ranks8_ckpt, s8, s4),
            lambda out: ["transform", "--src", w.ranks8_ckpt, "--dst", out, "--src-strategy", s8, "--dst-strategy", s4],
            ms_transform(w.ranks8_ckpt, s4, "ckpt"),
            "transform_checkpoints (.ckpt)",
            CKPT_PATH_TARGET,
            lambda: w.ranks4_ckpt,
            "rank",
        ),
        Operation(
            "transform_st",
            "transform 8→4 ranks (.safetensors)",
            (w.ranks8_st, s8, s4),
            lambda out: ["transform", "--src", w.ranks8_st, "--dst", out, "--src-strategy", s8, "--dst-strategy", s4],
            ms_transform(w.ranks8_st, s4, "safetensors"),
            "transform_checkpoints (safetensors)",
            SAFETENSORS_PATH_TARGET,
            lambda: w.ranks4_st,
            "rank",
        ),
        Operation(
            "merge_ckpt",
            "merge 8 ranks→full (.ckpt)",
            (w.ranks8_ckpt, s8),
            lambda out: ["transform", "--src", w.ranks8_ckpt, "--dst", out, "--src-strategy", s8],
            merge_job,
            "transform_checkpoints (.ckpt, dst None)",
            CKPT_PATH_TARGET,
            lambda: w.full_ckpt,
            "model",
        ),
        Operation(
            "unify",
            "unify 8 ranks→full (.safetensors)",
            (w.ranks8_st, s8),
            lambda out: ["unify", w.ranks8_st, out, "--src-strategy", s8],
            ms_unify,
            "unified_safetensors",
            SAFETENSORS_PATH_TARGET,
            lambda: w.full_ckpt,
            "model",
        ),
        Operation(
            "split",
            "split full→8 ranks (.safetensors)",
            (w.unified, s8),
            lambda out: ["split", w.unified, out, "--dst-strategy", s8],
            ms_split,
            "load_distributed_checkpoint (save mode)",
            SAFETENSORS_PATH_TARGET,
            lambda: w.ranks8_st,
            "rank",
        ),
        Operation(
            "dropin_transform",
            "drop-in transform_checkpoints 8→4 ranks (.ckpt)",
            (w.ranks8_ckpt, s8, s4),
            lambda out: {"dropin": "transform_checkpoints", "kwargs": dropin_transform(out)},
            lambda out, procs: {"fn": "transform_checkpoints", "kwargs": dropin_transform(out)},
            "transform_checkpoints (.ckpt, same call)",
            CKPT_PATH_TARGET,
            lambda: w.ranks4_ckpt,
            "rank",
        ),
        Operation(
            "convert",
            "convert .ckpt→.safetensors (8 ranks)",
            (w.ranks8_ckpt,),
            lambda out: ["convert", w.ranks8_ckpt, out, "--to", "safetensors"],
            ms_convert,
            "ckpt_to_safetensors",
            SAFETENSORS_PATH_TARGET,
            lambda: w.ranks8_ckpt,
            "rank",
        ),
        dropin(
            "dropin_merge",
            "drop-in transform_checkpoints 8 ranks→full (.ckpt)",
            (w.ranks8_ckpt, s8),
            merge_job,
            "transform_checkpoints (.ckpt, dst None, same call)",
            CKPT_PATH_TARGET,
            lambda: w.full_ckpt,
            "model",
        ),
        dropin(
            "dropin_unify",
            "drop-in unified_safetensors 8 ranks→full",
            (w.ranks8_st, s8),
            ms_unify,
            "unified_safetensors (same call)",
            SAFETENSORS_PATH_TARGET,
            lambda: w.full_ckpt,
            "model",
        ),
        dropin(
            "dropin_split",
            "drop-in load_distributed_checkpoint full→8 ranks",
            (w.unified, s8),
            ms_split,
            "load_distributed_checkpoint (save mode, same call)",
            SAFETENSORS_PATH_TARGET,
            lambda: w.ranks8_st,
            "rank",
        ),
        dropin(
            "dropin_convert",
            "drop-in ckpt_to_safetensors (8 ranks)",
            (w.ranks8_ckpt,),
            ms_convert,
            "ckpt_to_safetensors (same call)",
            SAFETENSORS_PATH_TARGET,
            lambda: w.ranks8_ckpt,
            "rank",
        ),
        Operation(
            "cp2_to_full",
            "Checkpoint 2.0 8 ranks→full (.safetensors)",
            (w.cp2_8,),
            lambda out: ["transform", "--src", w.cp2_8, "--dst", out],
            None,
            "— (MindFormers reshards only inside a running job)",
            0.0,
            lambda: w.full_ckpt,
            "model",
        ),
        Operation(
            "ranks_to_cp2",
            "rank folders 8 ranks→Checkpoint 2.0 8 ranks",
            (w.ranks8_st, s8),
            lambda out: [
                "transform",
                "--src",
                w.ranks8_st,
                "--src-strategy",
                s8,
                "--dst",
                out,
                "--dst-strategy",
                s8,
                "--output-format",
                "checkpoint2",
            ],
            None,
            "— (no MindSpore or MindFormers converter)",
            0.0,
            lambda: w.cp2_8,
            "file",
        ),
        Operation(
            "cp2_8to4",
            "Checkpoint 2.0 8→4 ranks",
            (w.cp2_8, s4),
            lambda out: [
                "transform",
                "--src",
                w.cp2_8,
                "--dst",
                out,
                "--dst-strategy",
                s4,
                "--output-format",
                "checkpoint2",
            ],
            None,
            "— (MindFormers reshards only inside a running job)",
            0.0,
            lambda: w.cp2_4,
            "file",
        ),
        Operation(
            "hf_bf16",
            "export 8 ranks→Hugging Face bf16 (.safetensors)",
            (w.ranks8_st, s8),
            lambda out: ["transform", "--src", w.ranks8_st, "--src-strategy", s8, "--dst", out, "--hf"],
            None,
            "— (no MindSpore converter to Hugging Face)",
            0.0,
            lambda: w.full_ckpt,
            "model",
            extra_flags=("--dtype", "bf16", "--keep-training-state"),  # the figure measured all 1.13 GB
            cast="bf16",
        ),
        Operation(
            "hf_llama",
            "export 8 ranks→Hugging Face names, weights only, bf16 (--preset llama)",
            (w.ranks8_st, s8),
            lambda out: ["transform", "--src", w.ranks8_st, "--src-strategy", s8, "--dst", out, "--hf"],
            None,
            "— (MindFormers' convert_reversed.py needs torch and MindSpore)",
            0.0,
            lambda: w.full_ckpt,
            "model",
            extra_flags=("--preset", "llama", "--weights-only", "--dtype", "bf16"),
            cast="bf16",
        ),
    ]


OPERATION_KEYS = (
    "transform_ckpt",
    "transform_st",
    "merge_ckpt",
    "unify",
    "split",
    "dropin_transform",
    "convert",
    "dropin_merge",
    "dropin_unify",
    "dropin_split",
    "dropin_convert",
    "cp2_to_full",
    "ranks_to_cp2",
    "cp2_8to4",
    "hf_bf16",
    "hf_llama",
)
