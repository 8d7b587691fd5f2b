"""What the ``reshard`` command teaches: descriptions, examples, defaults, "did you mean".

The flags live in the flag groups and the command modules; what the command says about itself
lives here, so that a person who types ``reshard transform --help`` reads one sentence on what the
command is for, two or three commands that run as written on the files ``reshard demo --dir demo``
leaves, and the default of every flag that takes a value. A misspelled command or flag gets one
line naming the nearest real one (``difflib``) and exit code 2, before argparse's own, less helpful
messages; ``reshard`` alone prints a short overview.

Why a separate module: the tables here change at a different pace from the flags. ``teach(parser)``
walks every subcommand the parser has, so a new subcommand gets the defaults formatter and the
"did you mean" checks without an edit here; its examples belong in ``EXAMPLES``
(``tests/test_teach_help.py`` requires them).
"""

from __future__ import annotations

import argparse
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# What each subcommand is for, in one line (a subcommand missing here uses its ``help=`` text).
DESCRIPTIONS: dict[str, str] = {
    "demo": "Build a small 8-rank LLaMA-like checkpoint and run every operation on it: the files the "
    "examples of every other command use.",
    "inspect": "Show what a checkpoint, a rank folder tree, a MindFormers Checkpoint 2.0 or a strategy file holds.",
    "convert": "Convert .ckpt <-> .safetensors file by file (a file or rank folders), or encrypt, re-encrypt "
    "or decrypt .ckpt files.",
    "merge-strategies": "Merge the per-stage strategy files of a pipelined job into one strategy file.",
    "transform": "Move a checkpoint from one parallel layout to another: N ranks -> M ranks, ranks -> full "
    "weights, full -> ranks, or into a MindFormers 2.x Checkpoint 2.0.",
    "plan": "Print what a transform would read and write, without writing anything.",
    "show": "Draw how a parameter's full tensor is split among ranks (replicas, optimizer shards, pipeline "
    "stages), as SVG/PNG and as text.",
    "unify": "Merge rank shards (safetensors) into full safetensors parts + param_name_map.json, or Hugging "
    "Face shards.",
    "split": "Slice a full model (unified parts, Hugging Face shards or one file) into per-rank files for a strategy.",
    "verify": "Check that two checkpoints hold the same full tensors, whatever their layouts and formats "
    "(exit 0 same, 1 different).",
    "auto-transform": "At job start: convert once for all ranks into a shared cache and print the file this "
    "rank loads.",
    "rank-list": "Say which source ranks (or, with --files, which source files) one destination rank reads.",
}


@dataclass(frozen=True)
class Example:
    """One command of a help page, and what it does."""

    command: str  # as typed, starting with "reshard "
    says: str


# Two or three examples per subcommand, runnable as written after ``reshard demo --dir demo``
# (tests/test_teach_help.py parses every one with its parser and runs the runnable ones).
EXAMPLES: dict[str, tuple[Example, ...]] = {
    "demo": (
        Example("reshard demo", "run the example in a temporary folder"),
        Example("reshard demo --dir demo", "keep its files in ./demo (the other commands' examples use them)"),
    ),
    "inspect": (
        Example("reshard inspect demo/full/model.ckpt", "tensors, dtypes and shapes of one file"),
        Example(
            "reshard inspect demo/ckpt_8ranks --strategy demo/strategy_8 --params",
            "the job's summary, then every parameter over all ranks: full shape, layout, ranks",
        ),
        Example("reshard inspect demo/mf2_8ranks --json", "a MindFormers Checkpoint 2.0, as JSON"),
    ),
    "convert": (
        Example("reshard convert demo/ckpt_8ranks st_8ranks --to safetensors", "every rank file to safetensors"),
        Example(
            "reshard convert demo/full/model.ckpt hf_from_ckpt --to safetensors --hf", "one full .ckpt to Hugging Face"
        ),
        Example(
            "reshard convert demo/ckpt_8ranks enc_8ranks --to ckpt --enc-key-file weights.key",
            "encrypt every rank file (AES-GCM; weights.key holds the key in hex)",
        ),
    ),
    "merge-strategies": (
        Example("reshard merge-strategies demo/strategy_8 strategy_8.ckpt", "2 stage files -> one strategy"),
        Example("reshard merge-strategies demo/strategy_4 strategy_4.ckpt", "the same for the 4-rank job"),
    ),
    "transform": (
        Example(
            "reshard transform demo/ckpt_8ranks ckpt_4ranks --src-strategy demo/strategy_8 "
            "--dst-strategy demo/strategy_4",
            "8 ranks -> 4 ranks",
        ),
        Example(
            "reshard transform demo/ckpt_8ranks full --src-strategy demo/strategy_8 --output-format safetensors",
            "8 ranks -> one full file (no destination strategy)",
        ),
        Example(
            "reshard transform demo/ckpt_8ranks hf_llama --src-strategy demo/strategy_8 --hf "
            "--preset llama --weights-only --dtype bf16 --hf-config demo/config.json",
            "8 ranks -> Hugging Face names and shards, weights only, bf16, with the model's config.json",
        ),
        Example(
            "reshard transform --src_ckpt_dir demo/ckpt_8ranks --src_ckpt_strategy demo/merged/src_strategy.ckpt "
            "--dst_ckpt_dir ckpt_4ranks_mf --dst_ckpt_strategy demo/merged/dst_strategy.ckpt",
            "MindFormers' transform_ckpt.py flags, verbatim",
        ),
    ),
    "plan": (
        Example(
            "reshard plan demo/ckpt_8ranks plan_out --src-strategy demo/strategy_8 --dst-strategy demo/strategy_4",
            "the files, tensors and bytes of an 8 -> 4 transform",
        ),
        Example(
            "reshard plan demo/mf2_8ranks plan_out --ranks 0 --json",
            "rank 0 of a Checkpoint 2.0 merged to full, as JSON",
        ),
        Example(
            "reshard plan demo/ckpt_8ranks plan_out --src-strategy demo/strategy_8 "
            "--dst-strategy demo/strategy_4 --picture plan.svg",
            "which source ranks feed which destination ranks, with bytes, drawn and printed",
        ),
    ),
    "show": (
        Example(
            "reshard show demo/merged/src_strategy.ckpt model.tok_embeddings.embedding_weight -o emb.svg",
            "the embedding both pipeline stages hold, each with its layout, drawn",
        ),
        Example(
            "reshard show demo/ckpt_8ranks --strategy demo/strategy_8",
            "the first parameter of each distinct layout, as grids of rank numbers",
        ),
        Example(
            "reshard show demo/mf2_8ranks model.layers.0.attention.wq.weight",
            "a Checkpoint 2.0's layout: ranks holding the same block are replicas",
        ),
    ),
    "unify": (
        Example(
            "reshard unify demo/st_8ranks unified --src-strategy demo/strategy_8", "8 safetensors ranks -> full parts"
        ),
        Example(
            "reshard unify demo/st_8ranks hf_shards --src-strategy demo/strategy_8 --hf --max-shard-size 4MB",
            "-> Hugging Face shards of at most 4 MB",
        ),
        Example("reshard unify demo/mf2_8ranks unified_mf2", "a Checkpoint 2.0 needs no strategy"),
    ),
    "split": (
        Example("reshard split demo/full/model.ckpt st_4ranks --dst-strategy demo/strategy_4", "full model -> 4 ranks"),
        Example(
            "reshard split demo/full/model.ckpt ckpt_rank_1 --dst-strategy demo/strategy_4 --ranks 1 "
            "--output-format ckpt",
            "only rank 1, as .ckpt",
        ),
    ),
    "verify": (
        Example(
            "reshard verify demo/full/model.ckpt demo/ckpt_8ranks --b-strategy demo/strategy_8",
            "the 8 ranks hold the full model",
        ),
        Example(
            "reshard verify demo/ckpt_8ranks demo/ckpt_4ranks --a-strategy demo/strategy_8 "
            "--b-strategy demo/strategy_4 --all",
            "two layouts, every tensor listed",
        ),
        Example("reshard verify demo/full/model.ckpt demo/mf2_8ranks --json", "against a Checkpoint 2.0, as JSON"),
    ),
    "auto-transform": (
        Example(
            "reshard auto-transform demo/full/model.ckpt --dst-strategy demo/strategy_4 --rank-id 0 --cache-dir cache",
            "rank 0's file, converted once into ./cache",
        ),
        Example(
            "reshard auto-transform demo/ckpt_8ranks --src-strategy demo/strategy_8 --dst-strategy demo/strategy_4 "
            "--rank-id 1 --local-ranks 0-3 --cache-dir cache",
            "this node's ranks 0-3 converted together; rank 1's file printed",
        ),
    ),
    "rank-list": (
        Example(
            "reshard rank-list 0 --src-strategy demo/strategy_8 --dst-strategy demo/strategy_4",
            "the source ranks destination rank 0 needs (0 2 4 6)",
        ),
        Example(
            "reshard rank-list 0 --src demo/ckpt_8ranks --src-strategy demo/strategy_8 "
            "--dst-strategy demo/strategy_4 --files",
            "the files it reads",
        ),
    ),
}

OVERVIEW_EXAMPLE = (  # the overview's and ``reshard --help``'s: make the demo's files, reshard 8 ranks to 4
    "reshard demo --dir demo",
    "reshard transform demo/ckpt_8ranks ckpt_4ranks --src-strategy demo/strategy_8 --dst-strategy demo/strategy_4",
)
_NO_DEFAULT = (None, False, argparse.SUPPRESS)  # compared by identity: a default of 0 or 0.0 is shown


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, with "(default: X)" after every flag that takes a value and has a default
    its help text does not already state, and the description and epilog kept as written (examples
    are one per line)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if text is argparse.SUPPRESS or action.nargs == 0 or any(action.default is v for v in _NO_DEFAULT):
            return action.help
        if "default" in text.lower() or not action.option_strings:
            return action.help
        return f"{text} (default: {_shown_default(action)})".lstrip()

    def _format_usage(self, usage: Any, actions: Any, groups: Any, prefix: Any) -> str:
        """The usage line without the flags of another tool's mode (MindFormers' own, shown in their section)."""
        shown = [a for a in actions if not getattr(a, "out_of_usage", False)]
        return super()._format_usage(usage, shown, groups, prefix)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(_fill_paragraph(part, width, indent) for part in text.split("\n"))


def _fill_paragraph(line: str, width: int, indent: str) -> str:
    """A line starting with spaces is kept as written (an example); others are wrapped."""
    if not line.strip() or line.startswith(" "):
        return indent + line if line.strip() else ""
    return textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent)


def _shown_default(action: argparse.Action) -> str:
    """A byte count as a size (``256M``), a value as its text, a list joined by commas."""
    value = action.default
    if isinstance(value, int) and not isinstance(value, bool) and "memory" in action.dest:
        return _size(value)
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def _size(nbytes: int) -> str:
    for unit, factor in (("T", 1024**4), ("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return str(nbytes)


def examples_text(name: str) -> str:
    """The "examples:" block of subcommand ``name``'s help (empty when it has none)."""
    examples = EXAMPLES.get(name, ())
    if not examples:
        return ""
    lines = ["examples (after `reshard demo --dir demo`):"]
    for example in examples:
        lines.append(f"  # {example.says}")
        lines.append(f"  {example.command}")
    return "\n".join(lines)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``{name: parser}`` of every subcommand of the ``reshard`` parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _summaries(parser: argparse.ArgumentParser) -> dict[str, str]:
    """The ``help=`` line each subcommand was added with."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def teach(parser: argparse.ArgumentParser, exit_codes: str) -> None:
    """Give every subcommand of ``parser`` its description, examples, exit codes and defaults formatter
    (an epilog a subcommand already has is kept, after the examples).

    Args:
        parser: the ``reshard`` parser, with all its subcommands added.
        exit_codes: the exit-code line every help page ends with.
    """
    summaries = _summaries(parser)
    for name, sub in subcommands(parser).items():
        sub.formatter_class = HelpFormatter
        sub.description = DESCRIPTIONS.get(name) or sub.description or summaries.get(name, "")
        sub.epilog = "\n\n".join(part for part in (examples_text(name), sub.epilog or exit_codes) if part)
    parser.formatter_class = HelpFormatter
    example = "\n".join(f"  {line}" for line in OVERVIEW_EXAMPLE)
    parser.epilog = f"example:\n{example}\n\n{exit_codes}"


def overview(parser: argparse.ArgumentParser) -> str:
    """What ``reshard`` alone prints: the commands, one example, where to read more."""
    summaries = _summaries(parser)
    width = max(len(name) for name in summaries) if summaries else 0
    lines = [f"{parser.prog}: {parser.description}", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {text}" for name, text in summaries.items()]
    lines += [
        "",
        "try:",
        *(f"  {line}" for line in OVERVIEW_EXAMPLE),
        "",
        f"`{parser.prog} COMMAND --help` shows a command's flags, defaults and examples; "
        f"`{parser.prog} --version` the version.",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ did you mean

_NUMBER_LIKE = re.compile(r"^-[\d.]")  # -1, -0.5, -1e-3: a value (argparse says what is wrong with it)


def _nearest(word: str, choices: Sequence[str]) -> str:
    """`` (did you mean X?)`` for the closest of ``choices``, or nothing."""
    import difflib  # only when something was misspelled: start-up stays light

    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _known_flag(token: str, parser: argparse.ArgumentParser) -> bool:
    """Whether argparse will take ``token`` as one of ``parser``'s flags (exactly, ``--flag=value``, a
    prefix it abbreviates, or a short flag with its value attached)."""
    flags = parser._option_string_actions
    name = token.split("=", 1)[0]
    if name in flags or _NUMBER_LIKE.match(token):
        return True
    if token.startswith("--"):
        return parser.allow_abbrev and any(flag.startswith(name) for flag in flags if flag.startswith("--"))
    return token[:2] in flags  # -q, -qv, -j4


def _unknown_flag(tokens: Sequence[str], parser: argparse.ArgumentParser) -> str | None:
    """The first token of ``tokens`` that looks like a flag ``parser`` does not have, or a long flag written
    with one dash (``-hf``: argparse reads ``-h`` with ``f`` attached, and says so in its own words)."""
    for token in tokens:
        if token == "--":
            return None
        if token.startswith("-") and token != "-" and (_one_dash_long(token, parser) or not _known_flag(token, parser)):
            return token
    return None


def _one_dash_long(token: str, parser: argparse.ArgumentParser) -> bool:
    """Whether ``token`` is one of ``parser``'s long flags written with a single dash (``-hf``, ``-src=a``)."""
    name = token.split("=", 1)[0]
    return not name.startswith("--") and len(name) > 2 and "-" + name in parser._option_string_actions


def _flag_error(parser: argparse.ArgumentParser, token: str, commands: dict[str, argparse.ArgumentParser]) -> None:
    """``unknown flag --resume (a flag of convert, split, transform, unify)`` when other commands have it,
    else the nearest flag of this command."""
    name = token.split("=", 1)[0]
    if _one_dash_long(token, parser):
        parser.error(f"unknown flag {name} (did you mean -{name}?)")
    own = _own_spelling(name, parser)
    if own is not None:  # this command's flag, one slip away: said before what other commands have
        parser.error(f"unknown flag {name} (did you mean {own}?)")
    owners = sorted(c for c, sub in commands.items() if sub is not parser and name in sub._option_string_actions)
    if owners:
        parser.error(f"unknown flag {name} (a flag of {', '.join(owners)})")
    parser.error(f"unknown flag {name}{_nearest(name, _suggestable(name, parser))}")


_VERY_CLOSE = 0.85  # difflib ratio of a one-letter slip in a flag of 8 letters or more


def _unified(flag: str) -> str:
    """A long flag with ``_`` read as ``-`` (``--rank_id`` and ``--rank-id`` are one spelling here)."""
    return flag.replace("_", "-")


def _own_spelling(name: str, parser: argparse.ArgumentParser) -> str | None:
    """The flag of ``parser`` that ``name`` differs from only by ``_`` for ``-`` or by a slip (a ratio of at
    least ``_VERY_CLOSE``, ``_`` and ``-`` read alike): its documented spelling, else its hidden one in the
    style ``name`` is written in; None when none is that near."""
    import difflib

    if not name.startswith("--"):
        return None
    underscored = "_" in name
    by_unified: dict[str, str] = {}
    for flag in _suggestable(name, parser) + sorted(
        parser._option_string_actions, key=lambda f: ("_" in f) != underscored
    ):
        if flag.startswith("--"):
            by_unified.setdefault(_unified(flag), flag)  # the first spelling of each flag wins
    close = difflib.get_close_matches(_unified(name), list(by_unified), n=1, cutoff=_VERY_CLOSE)
    return by_unified[close[0]] if close else None


def _suggestable(name: str, parser: argparse.ArgumentParser) -> list[str]:
    """The flags a suggestion for ``name`` may name: the documented long spellings, and, for a name written
    with ``_`` (MindFormers' style), the hidden ``_`` spellings the command also takes (``--dst_ckpt_strategy``)."""
    actions = parser._option_string_actions
    shown = [f for f, a in actions.items() if a.help is not argparse.SUPPRESS]
    flags = [f for f in shown if f.startswith("--")] or shown  # the documented spellings, not aliases
    if "_" in name:
        flags += [f for f, a in actions.items() if a.help is argparse.SUPPRESS and f.startswith("--") and "_" in f]
    return flags


def _print_help(
    parser: argparse.ArgumentParser, commands: dict[str, argparse.ArgumentParser], topic: Sequence[str]
) -> None:
    """``reshard help [COMMAND]``: that command's help (or the overview's), exit 0."""
    if topic and topic[0] not in commands:
        parser.error(f"help: unknown command {topic[0]!r}{_nearest(topic[0], list(commands))}")
    (commands[topic[0]] if topic else parser).print_help()
    raise SystemExit(0)


def check_argv(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Before argparse parses ``argv``: ``reshard`` alone prints the overview (exit 2), a misspelled
    command or an unknown flag is one line naming the nearest real one (exit 2, via ``parser.error``).

    Args:
        parser: the ``reshard`` parser, taught by ``teach``.
        argv: the command line without the program name.

    Raises:
        SystemExit: 2, after printing the overview or the one-line error.
    """
    if not argv:
        print(overview(parser))
        raise SystemExit(2)
    commands = subcommands(parser)
    if argv[0] == "help" and "help" not in commands:  # `reshard help transform`, as git and pip answer it
        _print_help(parser, commands, argv[1:])
    position = next((i for i, token in enumerate(argv) if not token.startswith("-")), len(argv))
    if any(token in ("-h", "--help") for token in argv[:position]):
        return
    flag = _unknown_flag(argv[:position], parser)
    if flag is not None:
        _flag_error(parser, flag, commands)
    if position == len(argv):
        return
    command = argv[position]
    if command not in commands:
        parser.error(f"unknown command {command!r}{_nearest(command, list(commands))}")
    sub = commands[command]
    flag = _unknown_flag(argv[position + 1 :], sub)
    if flag is not None:
        _flag_error(sub, flag, commands)


__all__ = [
    "DESCRIPTIONS",
    "EXAMPLES",
    "Example",
    "HelpFormatter",
    "check_argv",
    "examples_text",
    "overview",
    "subcommands",
    "teach",
]
