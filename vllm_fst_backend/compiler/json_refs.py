"""``$ref`` through base URIs (``$id``, ``$anchor``, drafts 4-6's ``id``) → references by JSON pointer.

The JSON-schema converter (:mod:`.json_schema`) reads ``$ref`` as a JSON pointer from the document's root.
A document whose references go through identifiers -- an embedded resource (``"$id": "item.json"`` below the
root, referenced as ``"item.json"`` or ``"item.json#/$defs/x"``), an anchor (``"#foo"``), a relative
reference resolved against an enclosing ``$id`` -- is rewritten here into that form: every ``$ref`` gets
the JSON pointer (from the root) of the schema it resolves to, and the identifiers below the root are
dropped, so that the rewritten document validates exactly the instances the original does. Resolution is
the ``referencing`` library's (the one ``jsonschema`` validates with; JSON Schema Core §8.2 and §9): the
document is one registry resource, its subresources crawled, and each ``$ref`` looked up with the base URI
of its location. References the document does not hold (remote URIs, the meta-schemas) stay unresolved:
:class:`UnsupportedSchemaError` (the server does not fetch them).

A document with no identifier below its root and only ``"#..."`` pointer references is returned as is.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from ..errors import InvalidSchemaError, UnsupportedSchemaError

__all__ = ["localize_refs"]

#: Keywords whose value is one subschema / an array of subschemas / an object of subschemas (drafts 4 to
#: 2020-12); a ``$ref`` anywhere else is never applied by a validator, and is left alone.
_ONE = ("additionalProperties", "additionalItems", "items", "not", "if", "then", "else", "contains",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties", "contentSchema")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")

_DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"


def _pointer(tokens: list) -> str:
    """The URI fragment of a JSON pointer (RFC 6901 §5 and §6): ``~0`` / ``~1`` escapes, percent-encoded."""
    return "#" + quote("".join("/" + str(t).replace("~", "~0").replace("/", "~1") for t in tokens), safe="/~")


def _needs_rewrite(node: Any, top: bool = True) -> bool:
    """Whether a schema dict (or anything below it) holds an identifier below the root or a ``$ref`` that is
    not a plain pointer (``"#"`` or ``"#/..."``)."""
    stack = [(node, top)]
    while stack:
        n, is_root = stack.pop()
        if isinstance(n, dict):
            ref = n.get("$ref")
            if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
                return True
            if not is_root and (isinstance(n.get("$id"), str) or isinstance(n.get("id"), str)):
                return True
            if isinstance(n.get("$anchor"), str):
                return True
            stack.extend((v, False) for v in n.values())
        elif isinstance(n, list):
            stack.extend((v, False) for v in n)
    return False


def _children(node: dict):
    """The subschemas of ``node`` at the keywords above."""
    for k in _ONE:
        v = node.get(k)
        if isinstance(v, (dict, bool)):
            yield v
    for k in _LIST:
        v = node.get(k)
        if isinstance(v, list):
            yield from (s for s in v if isinstance(s, (dict, bool)))
    for k in _MAP:
        v = node.get(k)
        if isinstance(v, dict):
            yield from (s for s in v.values() if isinstance(s, (dict, bool)))


def localize_refs(root: Any) -> Any:
    """``root`` with every ``$ref`` as a JSON pointer from the root and no identifier below the root (module
    docstring); ``root`` itself (not copied) when it needs no rewriting.

    Raises:
        UnsupportedSchemaError: a ``$ref`` the document does not hold (remote, a meta-schema), or one to a
            boolean schema that is not a plain pointer (keyword ``$ref``).
        InvalidSchemaError: a ``$ref`` to an anchor or pointer the document does not have, or a bad
            ``$id`` / ``$schema`` value.
    """
    if not isinstance(root, dict) or not _needs_rewrite(root):
        return root
    from referencing import Registry, Resource
    from referencing.exceptions import NoSuchAnchor, PointerToNowhere, Unresolvable
    from referencing.jsonschema import DRAFT202012, specification_with

    try:
        spec = specification_with(root.get("$schema", _DRAFT_2020_12), default=DRAFT202012)
        resource = spec.create_resource(root)
        base = resource.id() or ""
        registry = Registry().with_resource(base, resource).crawl()
    except Exception as e:  # (a non-string $id, an unknown $schema given as a non-string, ...)
        raise InvalidSchemaError(f"invalid JSON schema: its identifiers cannot be read ({e})", keyword="$id") from None
    where: dict[int, list] = {}  # id(object) -> its path from the root
    stack: list = [(root, [])]
    while stack:
        n, path = stack.pop()
        if isinstance(n, (dict, list)):
            where[id(n)] = path
            items = n.items() if isinstance(n, dict) else enumerate(n)
            stack.extend((v, path + [k]) for k, v in items)

    rewrites: dict[int, str] = {}  # id(schema dict) -> its $ref as a pointer
    strip: set[int] = set()  # id(schema dict) whose identifiers are dropped
    seen: set[int] = set()
    # (schema, resolver at it, whether it may lie in a resource other than the root's); the lexical walk
    # first, then the ref targets it did not reach, with the resolver of their lookup
    lexical: list = [(root, registry.resolver(base_uri=base), False)]
    later: list = []
    while lexical or later:
        node, res, embedded = lexical.pop() if lexical else later.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        if node is not root:
            res = res.in_subresource(Resource.from_contents(node, default_specification=spec))
            if any(isinstance(node.get(k), str) for k in ("$id", "id", "$anchor")):
                strip.add(id(node))
                embedded = embedded or any(isinstance(node.get(k), str) and not node[k].startswith("#")
                                           for k in ("$id", "id"))
        ref = node.get("$ref")
        if isinstance(ref, str):
            at = _pointer(where[id(node)])[1:]
            try:
                found = res.lookup(ref)
            except (NoSuchAnchor, PointerToNowhere) as e:
                raise InvalidSchemaError(f"invalid JSON schema: '$ref' at #{at} does not resolve: {ref!r} ({e})",
                                         keyword="$ref", pointer=at) from None
            except Unresolvable:
                raise UnsupportedSchemaError(
                    f"JSON schema keyword '$ref' at #{at}: {ref!r} is not in the document (remote references "
                    f"are not fetched)", keyword="$ref", pointer=at) from None
            target = found.contents
            path = where.get(id(target)) if isinstance(target, (dict, list)) else None
            if path is not None:
                rewrites[id(node)] = _pointer(path)
                later.append((target, found.resolver, True))
            elif embedded or not (ref == "#" or ref.startswith("#/")):  # (a boolean schema: kept as it is)
                raise UnsupportedSchemaError(f"JSON schema keyword '$ref' at #{at}: {ref!r} names a boolean "
                                             f"schema through an identifier", keyword="$ref", pointer=at)
        lexical.extend((s, res, embedded) for s in _children(node))

    def copy(n: Any) -> Any:
        if isinstance(n, dict):
            out = {k: copy(v) for k, v in n.items()
                   if not (id(n) in strip and k in ("$id", "id", "$anchor") and isinstance(v, str))}
            if id(n) in rewrites:
                out["$ref"] = rewrites[id(n)]
            return out
        if isinstance(n, list):
            return [copy(v) for v in n]
        return n

    return copy(root)
