"""Anthropic's structured outputs on an OpenAI upstream. Sans-I/O.

Anthropic holds an answer to the schema of ``output_config.format`` always; OpenAI holds it
to a ``json_schema`` response format only with ``strict: true``, and then takes a subset of
JSON Schema: the root an object, every object closed (``additionalProperties: false``) and
listing every property in ``required``, and only the keywords of :data:`_ANY`,
:data:`_KEYWORDS` and :data:`_CONSTRAINTS` (a fine-tuned model: no constraints), so no
``allOf``, ``not``, ``minLength``, ``uniqueItems``, ``default``, ..., within the sizes of
:data:`MAX_OBJECT_DEPTH` and the like. Another schema is refused with a 400 under strict,
where without it the upstream took it as a hint.

:func:`strict_form` gives the schema in the form strict mode takes when every answer to
that form is an answer to the schema as sent: objects closed (Anthropic closes every object
to the properties it lists: the answers are the ones an Anthropic upstream may give), and
an optional property that may be ``null`` made required (the model writes ``null`` where it
would have left it out, which the schema allows). A schema with anything else (an optional
property that may not be null, which the model would have to make up; an open object; a
keyword outside the subset) has no such form: None, and it goes as before, without strict.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_OBJECT_DEPTH", "strict_form"]

MAX_OBJECT_DEPTH = 10
"""OpenAI's limits under strict: objects nested 10 deep, 5,000 properties, 1,000 enum
values, 120,000 characters of property, definition and enum names and constants, and
15,000 of one enum's strings when it has more than 250."""
_MAX_PROPERTIES = 5_000
_MAX_ENUM_VALUES = 1_000
_MAX_NAME_CHARS = 120_000
_LONG_ENUM, _MAX_LONG_ENUM_CHARS = 250, 15_000
_MAX_NODE_DEPTH = 64  # anyOf in anyOf ...: no schema of a client's goes deeper

_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
_FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"}
)
_NUMBER_CONSTRAINTS = frozenset(
    {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
)
_KEYWORDS: dict[str, frozenset[str]] = {
    # a type: the keywords strict mode takes beside it
    "array": frozenset({"items"}),
    "object": frozenset({"properties", "required", "additionalProperties"}),
}
_CONSTRAINTS: dict[str, frozenset[str]] = {
    # a type: the constraints strict mode takes beside it (a fine-tuned model: none)
    "string": frozenset({"pattern", "format"}),
    "number": _NUMBER_CONSTRAINTS,
    "integer": _NUMBER_CONSTRAINTS,
    "array": frozenset({"minItems", "maxItems"}),
}
_ANY = frozenset({"type", "description", "title", "enum", "const", "anyOf"})
_DEFINITIONS = ("$defs", "definitions")


class _NoStrictForm(Exception):
    """The schema has no form that OpenAI's strict mode takes and that holds its answers."""


class _Count:
    """What the walk saw so far, against strict mode's limits; and which keywords it takes."""

    __slots__ = ("constraints", "enum_values", "name_chars", "properties")

    def __init__(self, constraints: bool) -> None:
        self.constraints = constraints
        self.properties = self.enum_values = self.name_chars = 0

    def names(self, names: Any) -> None:
        self.name_chars += sum(len(name) for name in names if isinstance(name, str))
        if self.name_chars > _MAX_NAME_CHARS:
            raise _NoStrictForm


def strict_form(schema: dict[str, Any], constraints: bool = True) -> dict[str, Any] | None:
    """``schema`` as OpenAI's strict mode takes it, allowing no answer that ``schema``
    does not (see the module's docstring); None when it has no such form. Without
    ``constraints`` (a fine-tuned model's strict mode) a schema with a type's constraint
    (``pattern``, ``format``, ``minimum``, ``minItems``, ...) has none. ``schema`` is not
    changed."""
    if schema.get("type") != "object" or "anyOf" in schema:
        return None  # strict mode wants an object at the root, and not a union
    count = _Count(constraints)
    try:
        out = {k: v for k, v in schema.items() if k not in _DEFINITIONS}
        out = _node(out, count, 0, 0)
        for key in _DEFINITIONS:
            defs = schema.get(key)
            if defs is None:
                continue
            if type(defs) is not dict:
                return None
            count.names(defs)
            out[key] = {name: _node(sub, count, 1, 0) for name, sub in defs.items()}
    except _NoStrictForm:
        return None
    return out


def _node(node: Any, count: _Count, depth: int, objects: int) -> dict[str, Any]:
    """One schema in strict form (a copy); :class:`_NoStrictForm` if it has none.
    ``objects``: the objects it is nested in."""
    if type(node) is not dict or depth > _MAX_NODE_DEPTH:
        raise _NoStrictForm
    ref = node.get("$ref")
    if ref is not None:  # alone: strict mode refuses keywords beside a reference
        if len(node) != 1 or type(ref) is not str or not ref.startswith("#"):
            raise _NoStrictForm
        return dict(node)
    types = _types(node)
    if not types and not any(key in node for key in ("anyOf", "enum", "const")):
        raise _NoStrictForm  # a schema of any value: strict mode has none
    allowed = _ANY.union(*(_KEYWORDS.get(kind, ()) for kind in types))
    if count.constraints:
        allowed = allowed.union(*(_CONSTRAINTS.get(kind, ()) for kind in types))
    if not node.keys() <= allowed:
        raise _NoStrictForm
    out = dict(node)
    for key in ("description", "title", "pattern"):
        if key in node and type(node[key]) is not str:
            raise _NoStrictForm
    if "format" in node and (type(node["format"]) is not str or node["format"] not in _FORMATS):
        raise _NoStrictForm
    _literals(node, count)
    if "anyOf" in node:
        variants = node["anyOf"]
        if type(variants) is not list or not variants:
            raise _NoStrictForm
        out["anyOf"] = [_node(v, count, depth + 1, objects) for v in variants]
    if "items" in node:
        out["items"] = _node(node["items"], count, depth + 1, objects)
    elif "array" in types:
        raise _NoStrictForm  # an array of any values: strict mode wants its items' schema
    if "object" in types:
        _object(node, out, count, depth, objects + 1)
    return out


def _types(node: dict[str, Any]) -> list[str]:
    kind = node.get("type")
    kinds = [kind] if isinstance(kind, str) else kind
    if kind is None:
        return []
    if type(kinds) is not list or not kinds or not all(type(k) is str for k in kinds):
        raise _NoStrictForm
    if not _TYPES.issuperset(kinds):
        raise _NoStrictForm
    return kinds


def _literals(node: dict[str, Any], count: _Count) -> None:
    """``enum`` and ``const``: JSON scalars, within strict mode's counts."""
    if "enum" in node:
        values = node["enum"]
        if type(values) is not list or not values or not all(map(_scalar, values)):
            raise _NoStrictForm
        count.enum_values += len(values)
        if count.enum_values > _MAX_ENUM_VALUES:
            raise _NoStrictForm
        count.names(values)
        if (
            len(values) > _LONG_ENUM
            and sum(len(v) for v in values if isinstance(v, str)) > _MAX_LONG_ENUM_CHARS
        ):
            raise _NoStrictForm
    if "const" in node:
        if not _scalar(node["const"]):
            raise _NoStrictForm
        count.names([node["const"]])


def _scalar(value: Any) -> bool:
    return value is None or type(value) in (str, int, float, bool)


def _object(
    node: dict[str, Any], out: dict[str, Any], count: _Count, depth: int, objects: int
) -> None:
    """An object closed, every property required; :class:`_NoStrictForm` if it is open,
    lists no properties, or leaves out one that may not be null."""
    properties = node.get("properties")
    if objects > MAX_OBJECT_DEPTH or type(properties) is not dict:
        raise _NoStrictForm
    if node.get("additionalProperties", False) is not False:
        raise _NoStrictForm  # an open object: its answers are more than a closed one's
    required = node.get("required", [])
    if type(required) is not list or not all(type(name) is str for name in required):
        raise _NoStrictForm
    if not set(required) <= properties.keys():
        raise _NoStrictForm
    count.properties += len(properties)
    if count.properties > _MAX_PROPERTIES:
        raise _NoStrictForm
    count.names(properties)
    out["properties"] = {
        name: _node(sub, count, depth + 1, objects) for name, sub in properties.items()
    }
    for name, sub in properties.items():
        if name not in required and not _nullable(sub):
            raise _NoStrictForm  # present, it must be a value the model would make up
    out["required"] = list(properties)
    out["additionalProperties"] = False


def _nullable(node: dict[str, Any]) -> bool:
    """Whether ``node`` (checked by :func:`_node`) allows ``null``: its type, enum, const
    and union each do. A reference is taken not to (its target is not followed)."""
    kind = node.get("type")
    if kind is not None and kind != "null" and not (type(kind) is list and "null" in kind):
        return False
    if "enum" in node and None not in node["enum"]:
        return False
    if ("const" in node and node["const"] is not None) or "$ref" in node:
        return False
    variants = node.get("anyOf")
    return variants is None or any(_nullable(v) for v in variants)
