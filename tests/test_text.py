"""reshard.text: one meaning of a size everywhere, sizes printed in binary units, one-line messages."""

from __future__ import annotations

import subprocess
import sys

import pytest

from reshard.errors import UsageError
from reshard.text import first_line, format_size, indefinite, one_line, parse_size


@pytest.mark.parametrize(
    ("text", "size"),
    [
        # decimal units, as Hugging Face means them
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("3kb", 3000),
        ("1TB", 10**12),
        ("1.5GB", 1_500_000_000),
        # binary units, spelled out or as a bare suffix (GNU's K/M/G)
        ("2GiB", 2 * 2**30),
        ("64 KiB", 65536),
        ("2G", 2 * 2**30),
        ("512M", 512 * 2**20),
        ("1k", 1024),
        ("1.5G", int(1.5 * 2**30)),
        ("2gib", 2 * 2**30),
        ("1T", 2**40),
        ("1TiB", 2**40),
        # bytes
        ("1000", 1000),
        ("10B", 10),
        (" 7 ", 7),
        ("+8", 8),
        (123, 123),
    ],
)
def test_parse_size(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "not a size"),
        ("GB", "not a size"),
        ("5XB", "not a size"),
        ("five", "not a size"),
        ("1e9", "not a size"),
        ("1.5", "not a whole number of bytes"),
        ("1.5B", "not a whole number of bytes"),
        ("0", "must be more than 0"),
        ("0G", "must be more than 0"),
        ("-1", "must be more than 0"),
        ("-1G", "must be more than 0"),
        (0, "must be more than 0"),
        (-5, "must be more than 0"),
        ("0.0001K", "must be more than 0"),
    ],
)
def test_parse_size_refusals_are_one_line(text: str | int, message: str) -> None:
    with pytest.raises(UsageError, match=message) as err:
        parse_size(text, "the memory bound")
    assert "\n" not in str(err.value)


def test_parse_size_names_what_it_read() -> None:
    with pytest.raises(UsageError, match=r"the shard size must be more than 0, not '-2GB'"):
        parse_size("-2GB", "the shard size")


def test_bool_is_not_a_size() -> None:
    with pytest.raises(UsageError):
        parse_size(True)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (2**20, "1.00 MiB"),
        (int(1.13 * 2**30), "1.13 GiB"),
        (2**40, "1.00 TiB"),
        (5 * 2**50, "5120.00 TiB"),
        (-2048, "-2.00 KiB"),
    ],
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text


def test_one_line_escapes_line_breaks() -> None:
    assert one_line("a\nb\rc") == "a\\nb\\rc"
    assert one_line("plain") == "plain"


@pytest.mark.parametrize(
    ("message", "line"),
    [
        ("one line", "one line"),
        ("\n  first   line \nsecond\nthird", "first line"),
        ("Expecting value: line 1 column 1 (char 0)", "Expecting value: line 1 column 1 (char 0)"),
    ],
)
def test_first_line(message: str, line: str) -> None:
    assert first_line(ValueError(message)) == line


def test_first_line_of_a_silent_exception_is_its_class() -> None:
    assert first_line(KeyError()) == "KeyError"
    assert first_line(RuntimeError("  \n ")) == "RuntimeError"


def test_text_imports_nothing_of_reshard_but_errors() -> None:
    code = "import sys, reshard.text; print(sorted(m for m in sys.modules if m.startswith('reshard')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['reshard', 'reshard.errors', 'reshard.text']"


@pytest.mark.parametrize(("flag", "value"), [("--max-memory", "2G"), ("--max-memory", "2GB")])
def test_cli_memory_flag_reads_sizes_the_same_way(flag: str, value: str) -> None:
    from reshard.cli import build_parser

    args = build_parser().parse_args(["transform", "--src", "a", "--dst", "b", flag, value])
    assert args.max_memory == parse_size(value)


def test_cli_refuses_a_negative_memory_bound_in_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "reshard.cli", "transform", "--src", "a", "--dst", "b", "--max-memory=-1G"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "the memory bound must be more than 0" in lines[0], proc.stderr


@pytest.mark.parametrize(
    ("value", "said"),
    [(8, "an 8"), (4, "a 4"), (11, "an 11"), (18, "an 18"), (80, "an 80"), (110, "a 110"), (1100, "a 1100"),
     (8192, "an 8192"), (18000, "an 18000"), (16, "a 16"), ([8, 128], "an [8, 128]"), ([4, 4], "a [4, 4]")],
)  # fmt: skip
def test_indefinite_article_as_the_number_is_read(value: object, said: str) -> None:
    assert indefinite(value) == said
