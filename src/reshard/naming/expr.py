"""Sizes given as arithmetic over a model's config (``"num_attention_heads*head_dim"``).

A model map says how long each part of a fused tensor is in terms of the model's config, so one
map serves every size of a family. The expressions are parsed with ``ast`` and only integer
arithmetic over config names is allowed (``+ - * // /`` and parentheses; ``/`` must divide
exactly): nothing is ever ``eval``-ed.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping

from reshard.errors import UsageError

Size = int | str  # an int, or an expression over config names

_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
}


def evaluate(size: Size, config: Mapping[str, object]) -> int:
    """The integer value of ``size`` given the model config ``config``.

    Args:
        size: An int, or an expression such as ``"num_attention_heads*head_dim"``.
        config: The model config's values (a ``config.json``'s top-level keys).

    Returns:
        The value, an int.

    Raises:
        UsageError: The expression does not parse, names a key the config lacks or that is not an
            integer, or divides inexactly.

    Example:
        from reshard.naming.expr import evaluate
        assert evaluate("heads*dim//2", {"heads": 4, "dim": 8}) == 16
    """
    if isinstance(size, bool):
        raise UsageError(f"size {size!r} is not an integer")
    if isinstance(size, int):
        return size
    try:
        tree = ast.parse(str(size).strip(), mode="eval")
    except SyntaxError:
        raise UsageError(f"size expression {size!r} does not parse") from None
    return _value(tree.body, str(size), config)


def _value(node: ast.expr, text: str, config: Mapping[str, object]) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in config:
            raise UsageError(f"size expression {text!r} needs {node.id!r}, which the model config does not give")
        value = config[node.id]
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"model config value {node.id!r} is {value!r}, not an integer (in {text!r})")
        return value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand, text, config)
    if isinstance(node, ast.BinOp):
        left, right = _value(node.left, text, config), _value(node.right, text, config)
        if isinstance(node.op, ast.Div | ast.FloorDiv) and right == 0:
            raise UsageError(f"size expression {text!r} divides by zero")
        if isinstance(node.op, ast.Div):
            if left % right:
                raise UsageError(f"size expression {text!r}: {left}/{right} is not an integer")
            return left // right
        for op_type, fn in _OPS.items():
            if isinstance(node.op, op_type):
                return fn(left, right)
    raise UsageError(f"size expression {text!r}: only integers, config names, + - * / // and ( ) are allowed")


__all__ = ["Size", "evaluate"]
