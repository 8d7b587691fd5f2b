"""Rules files (``--rename RULES``): an ordered list of regex renames, in JSON or YAML.

::

    - match: 'model\\.layers\\.(\\d+)\\.(.*)'
      replace: 'decoder.layers.\\1.\\2'
    - {match: 'lm_head\\.weight', replace: 'output_layer.weight'}

A JSON file is the same list. The first rule whose ``match`` matches the WHOLE name renames it;
a name no rule matches is unmatched and kept. Every problem (the file does not parse, is not a
list of ``{match, replace}`` mappings, or holds a bad regex) is one ``UsageError`` naming the
file, raised before anything is read from a checkpoint.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from reshard.errors import UsageError
from reshard.naming.ops import ModelMap, Rename


def parse_rules(text: str, where: str) -> tuple[Rename, ...]:
    """The rename rules in ``text`` (JSON or YAML; ``where`` names it in errors).

    Args:
        text: The file's content.
        where: The file's name, for messages.

    Returns:
        The rules in order.

    Raises:
        UsageError: The text does not parse, has the wrong structure, or holds a bad regex.

    Example:
        from reshard.naming.rules import parse_rules
        (rule,) = parse_rules('[{"match": "a(.*)", "replace": "b\\\\1"}]', "rules.json")
        assert rule.replace == "b\\\\1"
    """
    data = _load(text, where)
    if isinstance(data, dict) and set(data) == {"rules"}:
        data = data["rules"]
    if not isinstance(data, list) or not data:
        raise UsageError(f"{where}: a rules file is a non-empty list of {{match, replace}} rules")
    rules = []
    for k, entry in enumerate(data, 1):
        if not isinstance(entry, dict) or set(entry) != {"match", "replace"}:
            raise UsageError(f"{where}: rule {k} is not a mapping with exactly the keys match and replace")
        match, replacement = entry["match"], entry["replace"]
        if not isinstance(match, str) or not isinstance(replacement, str) or not match:
            raise UsageError(f"{where}: rule {k}: match and replace must be strings (match not empty)")
        try:
            pattern = re.compile(match)
        except re.error as e:
            raise UsageError(f"{where}: rule {k}: bad regular expression {match!r}: {e}") from None
        _check_template(pattern, replacement, where, k)
        rules.append(Rename(match, replacement))
    return tuple(rules)


def _load(text: str, where: str) -> object:
    if where.endswith(".json") or text.lstrip().startswith(("[", "{")):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            if where.endswith(".json"):
                raise UsageError(f"{where}: not valid JSON: {e}") from None
    import yaml  # type: ignore[import-untyped,unused-ignore]

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"{where}: not valid YAML or JSON: {first}") from None


def _check_template(pattern: re.Pattern[str], replacement: str, where: str, k: int) -> None:
    """A replacement may name only groups its pattern has (checked now, not at the first matching name)."""
    try:
        pattern.sub(replacement, "")  # parses the template even when nothing matches
    except (re.error, IndexError) as e:
        raise UsageError(f"{where}: rule {k}: bad replacement {replacement!r}: {e}") from None


def load_rules(path: str) -> ModelMap:
    """The rename rules of file ``path`` as a ``ModelMap``.

    Raises:
        UsageError: The file cannot be read or its rules are bad (see ``parse_rules``).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read rules file: {e.strerror if isinstance(e, OSError) else e}", path) from None
    return ModelMap(parse_rules(text, path), name=Path(path).name)


__all__ = ["load_rules", "parse_rules"]
