"""Bounds on the JSON a request may carry, checked before anything walks it recursively.

Free-form JSON in a request (a ``response_format`` JSON schema, a tool's ``parameters``, an escalation's body, a
device's runtime facts) reaches code that recurses over it: ``json.dumps``, ``copy.deepcopy``, pydantic's
serialiser, a grammar compiler. A value nested a few thousand levels deep would exhaust Python's stack there (a
``RecursionError``, answered as a 500). ``check_json`` walks a value with an explicit stack, so it cannot
recurse itself, and refuses one nested deeper than ``max_depth`` or holding more than ``max_nodes`` values (a
``ValueError`` naming the limit, which the request schemas turn into a 400 naming the field).

A body nested deeper than the JSON decoder itself can go (about 1,000 levels: msgspec and ``json`` stop at the
interpreter's recursion limit) never becomes a value: ``shared.request_body.BoundedRequest`` answers it with a 400.
"""

from __future__ import annotations

from typing import Any

MAX_JSON_DEPTH = 64  # levels of objects and arrays in one free-form value (the value itself is level 1)
_CONTAINERS = (dict, list, tuple)


def check_json(value: Any, *, max_depth: int = MAX_JSON_DEPTH, max_nodes: int | None = None) -> int:
    """The number of values in ``value`` (objects, arrays and scalars; keys not counted); ``ValueError`` naming
    the limit when it is nested deeper than ``max_depth`` levels or holds more than ``max_nodes`` values.
    Iterative, so any depth is safe to check; a long array of scalars (a tensor's rows) costs one pass in C."""
    num_nodes = 1
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, _CONTAINERS) else []
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        num_nodes += len(children)
        if max_nodes is not None and num_nodes > max_nodes:
            raise ValueError(f"holds more than {max_nodes} values (the limit is {max_nodes})")
        kinds = set(map(type, children))
        if kinds.isdisjoint(_CONTAINERS) and not any(issubclass(k, _CONTAINERS) for k in kinds):
            continue
        if depth >= max_depth:
            raise ValueError(
                f"nested more than {max_depth} levels deep (the limit is {max_depth} levels of objects and arrays)"
            )
        stack.extend((child, depth + 1) for child in children if isinstance(child, _CONTAINERS))
    return num_nodes
