"""The list of deliberate differences from MindSpore is one list: ``docs/differences.md`` and
``reshard.mindspore``'s module docstring hold the same items, in the same order, word for word
(markdown and reST quoting aside, and a link's target: the page links ``docs/checks.md`` as
``checks.md``), so neither can gain or lose a difference alone."""

from __future__ import annotations

import re
from pathlib import Path

import reshard.mindspore

DIFFERENCES = Path(__file__).resolve().parent.parent / "docs" / "differences.md"
PAGE_LEAD = "(a test keeps the two identical):"
DOCSTRING_LEAD = "give MindSpore's names and bytes):"


def _items(text: str, lead: str, bullet: str) -> list[str]:
    """The bullets of the list that follows the line ending with ``lead``, up to the next blank line."""
    after = text.split(lead, 1)[1].lstrip("\n")
    block = after.split("\n\n", 1)[0]
    items = re.split(rf"^{re.escape(bullet)} ", block, flags=re.M)
    items = [re.sub(r"\[([^]]+)\]\([^)]+\)", r"\1", item) for item in items]  # a link is its text
    return [re.sub(r"\s+", " ", item.replace("``", "`")).strip() for item in items if item.strip()]


def test_page_and_docstring_list_the_same_differences() -> None:
    page = _items(DIFFERENCES.read_text(encoding="utf-8"), PAGE_LEAD, "-")
    docstring = _items(reshard.mindspore.__doc__ or "", DOCSTRING_LEAD, "*")
    assert len(page) >= 20
    assert page == docstring


def test_the_list_names_the_exactness_cases() -> None:
    """The differences of issue 9's exactness items are on it."""
    text = " ".join(_items(DIFFERENCES.read_text(encoding="utf-8"), PAGE_LEAD, "-"))
    for phrase in (
        "4 → 6, 8 → 6 ranks",
        "shared parameters have a different layout in each stage",
        "copies a contiguous run of elements",
        "by-stage mode",
        "optimizer states left out on both sides",
        "do not size reshard's IO",
    ):
        assert phrase in text, phrase
