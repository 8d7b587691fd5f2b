"""Rules files (``--rename RULES``): an ordered list of regex renames, in JSON or YAML.

::

    - match: 'model\\.layers\\.(\\d+)\\.(.*)'
      replace: 'decoder.layers.\\1.\\2'
    - {match: 'lm_head\\.weight', replace: 'output_layer.weight'}

A JSON file is the same list. The first rule whose ``match`` matches the WHOLE name renames it;
a name no rule matches is unmatched and kept. Every problem (the file does not parse, is not a
list of ``{match, replace}`` mappings, or holds a bad regex) is one ``UsageError`` naming the
file, raised before anything is read from a checkpoint.

A rule with an ``op`` key is any operation of ``reshard.naming.ops`` with its fields as keys
(``op: split``, ``match``, ``outputs``, ``axis``, ``sizes``, ``groups``; ``op: stack``, ...), and
the file may be a mapping ``{rules: [...], config: {...}}`` whose config values the sizes use.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from reshard.errors import UsageError
from reshard.naming.ops import Join, ModelMap, Op, Rename, Split, Stack, Transpose, Unstack

# Per op: the class, its required fields and its optional ones, each with the kind of value it takes.
_OPS: dict[str, tuple[type, dict[str, str], dict[str, str]]] = {
    "rename": (Rename, {"match": "regex", "replace": "str"}, {}),
    "transpose": (Transpose, {"match": "regex", "replace": "str", "perm": "ints"}, {}),
    "split": (Split, {"match": "regex", "outputs": "strs", "axis": "int", "sizes": "sizes"}, {"groups": "size"}),
    "join": (Join, {"inputs": "regexes", "output": "str", "axis": "int"}, {"groups": "size"}),
    "stack": (Stack, {"match": "regex", "output": "str"}, {"axis": "int", "perm": "ints", "fold": "bool"}),
    "unstack": (Unstack, {"match": "regex", "output": "str"}, {"axis": "int", "perm": "ints", "experts": "size"}),
}


def parse_rules(text: str, where: str) -> tuple[Op, ...]:
    """The rules in ``text`` (JSON or YAML; ``where`` names it in errors), in order.

    Args:
        text: The file's content.
        where: The file's name, for messages.

    Returns:
        The operations in order (``Rename`` for plain ``{match, replace}`` rules).

    Raises:
        UsageError: The text does not parse, has the wrong structure, or holds a bad regex.

    Example:
        from reshard.naming.rules import parse_rules
        (rule,) = parse_rules('[{"match": "a(.*)", "replace": "b\\\\1"}]', "rules.json")
        assert rule.replace == "b\\\\1"
    """
    return parse_map(text, where).ops


def parse_map(text: str, where: str) -> ModelMap:
    """The rules and config values in ``text`` as a ``ModelMap`` (see ``parse_rules``).

    Raises:
        UsageError: The text does not parse, has the wrong structure, or holds a bad regex.
    """
    data = _load(text, where)
    config: dict[str, object] = {}
    if isinstance(data, dict) and "rules" in data and set(data) <= {"rules", "config"}:
        if not isinstance(data.get("config", {}), dict):
            raise UsageError(f"{where}: config is a mapping of names to values")
        config = dict(data.get("config") or {})
        data = data["rules"]
    if not isinstance(data, list) or not data:
        raise UsageError(f"{where}: a rules file is a non-empty list of {{match, replace}} rules")
    ops = tuple(_rule(entry, where, k) for k, entry in enumerate(data, 1))
    return ModelMap(ops, config, Path(where).name)


def _rule(entry: object, where: str, k: int) -> Op:
    if isinstance(entry, dict) and "op" not in entry and set(entry) != {"match", "replace"}:
        raise UsageError(f"{where}: rule {k} is not a mapping with exactly the keys match and replace")
    if not isinstance(entry, dict):
        raise UsageError(f"{where}: rule {k} is not a mapping with exactly the keys match and replace")
    op = entry.get("op", "rename")
    if op not in _OPS:
        raise UsageError(f"{where}: rule {k}: unknown op {op!r} (one of {', '.join(_OPS)})")
    cls, required, optional = _OPS[op]
    fields = {key: value for key, value in entry.items() if key != "op"}
    missing = [key for key in required if key not in fields]
    unknown = [key for key in fields if key not in required and key not in optional]
    if missing or unknown:
        what = f"lacks {', '.join(missing)}" if missing else f"has unknown keys {', '.join(unknown)}"
        raise UsageError(f"{where}: rule {k} ({op}) {what}")
    values = {key: _value(fields[key], {**required, **optional}[key], where, k, key) for key in fields}
    if op in ("rename", "transpose"):
        _check_template(re.compile(str(values["match"])), str(values["replace"]), where, k)
    rule: Op = cls(**values)
    return rule


def _value(value: object, kind: str, where: str, k: int, key: str) -> object:
    def bad(expected: str) -> UsageError:
        return UsageError(f"{where}: rule {k}: {key} must be {expected}, not {value!r}")

    def is_size(v: object) -> bool:
        return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, str) and bool(v))

    if kind in ("regex", "str"):
        if not isinstance(value, str) or (kind == "regex" and not value):
            raise bad("a string" if kind == "str" else "a non-empty regular expression")
        if kind == "regex":
            _compile(value, where, k)
        return value
    if kind in ("strs", "regexes"):
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise bad("a non-empty list of strings")
        for v in value if kind == "regexes" else ():
            _compile(v, where, k)
        return tuple(value)
    if kind == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad("an integer")
        return value
    if kind == "ints":
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise bad("a list of integers")
        return tuple(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if kind == "size":
        if not is_size(value):
            raise bad("an integer or a size expression")
        return value
    if not isinstance(value, list) or not value or not all(is_size(v) for v in value):  # sizes
        raise bad("a non-empty list of integers or size expressions")
    return tuple(value)


def _compile(pattern: str, where: str, k: int) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise UsageError(f"{where}: rule {k}: bad regular expression {pattern!r}: {e}") from None


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
    """The rules of file ``path`` as a ``ModelMap`` (named after the file).

    Raises:
        UsageError: The file cannot be read or its rules are bad (see ``parse_rules``).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read rules file: {e.strerror if isinstance(e, OSError) else e}", path) from None
    return parse_map(text, path)


__all__ = ["load_rules", "parse_map", "parse_rules"]
