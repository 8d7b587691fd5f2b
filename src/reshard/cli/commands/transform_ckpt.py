"""``reshard transform --src_checkpoint ...``: MindFormers' offline TransformCkpt tool, flag for flag.

MindFormers 2.1.0's ``tools/ckpt_transform/transform_checkpoint.py`` flags, spelt as it spells them
(they are its spellings, so they print no note), with its output tree and marker files
(``reshard.transform_ckpt``). They are a mode of ``transform``: a flag of reshard's own transform
that the tool has no counterpart for is refused beside them, in one line.
"""

from __future__ import annotations

import argparse
import os
import time

from reshard.cli.flags import flag, say_notes
from reshard.cli.report import count
from reshard.errors import UsageError
from reshard.text import format_size

TITLE = "MindFormers' transform_checkpoint.py flags (its output layout and marker files)"

# Flags of reshard's own transform that MindFormers' tool has no counterpart for: refused beside its flags.
NOT_WITH_TOOL = {
    "src_path": "SRC",
    "dst_path": "DST",
    "src": "--src_ckpt_dir/--src",
    "dst": "--dst_ckpt_dir/--dst",
    "ranks": "--ranks",
    "hf": "--hf",
    "keep_training_state": "--keep-training-state",
    "resume": "--resume",
    "dry_run": "--dry-run",
    "src_format": "--src-format",
    "file_suffix": "--file-suffix",
    "pick": "--pick",
    "crc": "--crc",
    "dec_key_file": "--dec-key-file",
    "dec_key_env": "--dec-key-env",
    "enc_key_file": "--enc-key-file",
    "enc_key_env": "--enc-key-env",
    "json": "--json",
    "name_rules": "--include/--exclude",
    "weights_only": "--weights-only",
    "rename": "--rename",
    "strict": "--strict",
    "dtype": "--dtype",
    "dtype_all": "--dtype-all",
    "dequantize": "--dequantize",
    "block_size": "--block-size",
    "quantize": "--quantize",
    "quantize_include": "--quantize-include",
    "quantize_exclude": "--quantize-exclude",
}
TOOL_FLAGS = ("tool_src", "tool_dst", "rank_id", "world_size", "transform_process_num", "transform_by_rank")


def add_flags(p: argparse.ArgumentParser) -> None:
    """The tool's flags, in a help section of their own and out of the usage line."""
    g = p.add_argument_group(TITLE)
    flags = [
        flag(
            g,
            "--src_checkpoint",
            dest="tool_src",
            help="a .ckpt file, or a folder of rank_<r> folders or of .ckpt files",
        ),
        flag(
            g,
            "--dst_checkpoint_dir",
            dest="tool_dst",
            help="writes DST/<source name>/rank_<r>/<prefix><r>.ckpt (default: ./transformed_checkpoint)",
        ),
        flag(g, "--src_strategy", dest="src_strategy", help="as --src-strategy (None: full weights)"),
        flag(g, "--dst_strategy", dest="dst_strategy", help="as --dst-strategy (None: full weights)"),
        flag(g, "--rank_id", type=int, help="this invocation's rank (default 0: the RANK_ID variable, else 0)"),
        flag(g, "--world_size", type=int, help="ranks of the job (default 1; 0: the RANK_SIZE variable)"),
        flag(
            g,
            "--transform_process_num",
            type=int,
            help="invocations that convert (default 1): ranks 0, W/P, 2W/P, ... each convert W/P destination ranks",
        ),
        flag(
            g,
            "--transform_by_rank",
            nargs="?",
            const="True",
            metavar="BOOL",
            help="convert rank by rank (any non-empty value is true, as in the tool; forced by "
            "--transform_process_num > 1, off for --world_size 1)",
        ),
    ]
    for action in flags:
        action.out_of_usage = True  # type: ignore[attr-defined]  # reshard.cli.help's formatter leaves them out


def asked(args: argparse.Namespace) -> bool:
    """Whether the command line used one of the tool's own flags."""
    return any(vars(args)[name] is not None for name in TOOL_FLAGS)


def run(args: argparse.Namespace) -> None:
    from reshard import transform_ckpt as tool

    if args.tool_src is None:
        raise UsageError("give the source with --src_checkpoint (MindFormers' transform_checkpoint.py flags)")
    given = vars(args)
    for name, spelling in NOT_WITH_TOOL.items():
        if given.get(name) not in (None, False):
            raise UsageError(f"{spelling} does not combine with MindFormers' --src_checkpoint flags")
    if args.output_format not in (None, "ckpt") or args.executor != "local":
        raise UsageError("MindFormers' --src_checkpoint flags write .ckpt on this machine only")
    quiet = args.quiet

    def say(note: str) -> None:
        say_notes([note], quiet)

    note = tool.bool_note(args.transform_by_rank)
    if note:
        say(note)
    defaults = tool.ToolArgs()
    result = tool.run(
        tool.ToolArgs(
            src_checkpoint=args.tool_src,
            dst_checkpoint_dir=args.tool_dst if args.tool_dst is not None else defaults.dst_checkpoint_dir,
            src_strategy=args.src_strategy,
            dst_strategy=args.dst_strategy,
            prefix=defaults.prefix if args.prefix is None else args.prefix,
            rank_id=defaults.rank_id if args.rank_id is None else args.rank_id,
            world_size=defaults.world_size if args.world_size is None else args.world_size,
            transform_process_num=(
                defaults.transform_process_num if args.transform_process_num is None else args.transform_process_num
            ),
            transform_by_rank=args.transform_by_rank is not None and tool.parse_bool(args.transform_by_rank),
        ),
        say,
    )
    seconds = time.monotonic() - args.started
    where = ", ".join(d.rstrip(os.sep) + os.sep for d in result.model_dirs)
    files = count(len(result.written), "file")
    print(f"wrote {files} ({format_size(tool.written_bytes(result.written))}) to {where} in {seconds:.1f} s")


__all__ = ["NOT_WITH_TOOL", "TOOL_FLAGS", "add_flags", "asked", "run"]
