"""JSON mode and structured output (OpenAI's `response_format` json_object and json_schema): the answer is
one JSON object, of a given schema or of any.

`compile_schema` turns a JSON Schema into a `Node` tree, refusing (SchemaError) what it cannot enforce (a
string's pattern or format is a `pattern.Pattern`, run over the string's decoded characters).
`JsonPrefix` is a pushdown automaton over bytes that accepts exactly the prefixes of a JSON text (RFC 8259)
whose value is an object matching the root node, and says when that object is complete. Every prefix it
accepts can be completed (no dead end: a sampler steered by it never runs out of tokens). Strings are checked
for escapes, control characters and well-formed UTF-8 (RFC 3629: no stray continuation byte, overlong form,
surrogate or code point past U+10FFFF; a token may end inside a character, the next must finish it), so the
answer always decodes. An object's keys are unique, and are matched as written: a property name is accepted
in its JSON form without escapes of characters that need none. Outside strings at most MAX_WS whitespace
bytes come in a row: JSON puts no limit, but a model that likes newlines would otherwise never have to write
the object.

`pick` is the sampler's side: given the row's tokens in the order of its race (Engine: the logits after
penalties, temperature and filters, minus the log of the row's exponential noise), the first one whose bytes
keep the text a prefix wins. Where none of the race's leaders fits, `allowed` lists every token that does (a
walk over the sorted vocabulary's prefixes, `Vocabulary`), and the race's leader among them wins. The race's
winner among the allowed tokens is a draw from the model's distribution restricted to them: constraining
changes which tokens can be drawn, not the odds of one allowed token against another.
"""
from __future__ import annotations

import bisect
import functools
import json
import math
from dataclasses import dataclass, field, fields
from fractions import Fraction
from typing import Any, Iterable

from pattern import Pattern, PatternError, utf8_byte

WS = frozenset(b" \t\n\r")
DIGITS = frozenset(b"0123456789")
LITERALS = {ord("t"): b"true", ord("f"): b"false", ord("n"): b"null"}
ESCAPES = frozenset(b'"\\/bfnrtu')
HEX = frozenset(b"0123456789abcdefABCDEF")
SURROGATE_HEX = frozenset(f"d{c}" for c in "89abcdef")  # the first two hex digits of \\uD800-\\uDFFF
ESCAPED = {ord('"'): 0x22, ord("\\"): 0x5C, ord("/"): 0x2F, ord("b"): 8, ord("f"): 12, ord("n"): 10, ord("r"): 13,
           ord("t"): 9}  # a simple escape's character
# JSON Schema formats as patterns (pattern.py): RFC 3339 dates and times (years 0001-9999, the days each month
# has, leap years; upper-case T and Z; up to 6 fraction digits, what Python's datetime reads) and durations
# (its appendix A), UUIDs, IPv4 and IPv6 (RFC 4291's text forms, what Python's ipaddress reads, no zone),
# hostnames (RFC 1123: labels of 1-63 letters, digits and inner hyphens, 253 characters in all), e-mail
# addresses (RFC 5321's Mailbox with a dot-atom local part and a domain of two or more such labels: no quoted
# local part, no address literal) and URIs (RFC 3986's absolute URI; where "//" opens an authority, a host
# name that is not empty and a port of 0-65535 written without leading zeros, as URL readers such as pydantic's
# take them; no IP literal).
_YEAR = r"(?:000[1-9]|00[1-9]\d|0[1-9]\d\d|[1-9]\d\d\d)"
_LEAP = r"(?:\d\d(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DAYS = r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)|02-(?:0[1-9]|1\d|2[0-8]))"
_DATE = rf"(?:{_YEAR}-{_DAYS}|{_LEAP}-02-29)"
_TIME = r"(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d(?:\.\d{1,6})?(?:Z|[+-](?:[01]\d|2[0-3]):[0-5]\d)"
_DUR_TIME = r"T(?:\d+H(?:\d+M(?:\d+S)?)?|\d+M(?:\d+S)?|\d+S)"
_DURATION = rf"P(?:(?:\d+D|\d+M(?:\d+D)?|\d+Y(?:\d+M(?:\d+D)?)?)(?:{_DUR_TIME})?|{_DUR_TIME}|\d+W)"
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = rf"{_OCTET}(?:\.{_OCTET}){{3}}"
_H16 = r"[0-9a-fA-F]{1,4}"


def _ipv6() -> str:
    """RFC 4291 2.2: eight groups, or fewer around one "::" (at least one zero group), the last two groups
    possibly an IPv4 address: one alternative per count of groups before and after the "::"."""
    def groups(n: int) -> str:
        return "" if n == 0 else rf"(?:{_H16}:){{{n - 1}}}{_H16}"
    forms = [rf"(?:{_H16}:){{7}}{_H16}", rf"(?:{_H16}:){{6}}{_IPV4}"]
    forms += [f"{groups(a)}::{groups(b)}" for a in range(8) for b in range(8 - a)]
    forms += [f"{groups(a)}::{rf'(?:{_H16}:){{{b}}}' if b else ''}{_IPV4}" for a in range(6) for b in range(6 - a)]
    return "(?:" + "|".join(forms) + ")"


_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_PCT = r"%[0-9A-Fa-f]{2}"
_PCHAR = rf"(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|{_PCT})"
_PORT = r"(?:6553[0-5]|655[0-2]\d|65[0-4]\d\d|6[0-4]\d{3}|[1-5]\d{4}|[1-9]\d{0,3}|0)"
_AUTHORITY = rf"(?:(?:[A-Za-z0-9._~!$&'()*+,;=:-]|{_PCT})*@)?(?:[A-Za-z0-9._~!$&'()*+,;=-]|{_PCT})+(?::{_PORT}?)?"
_HIER = rf"(?://{_AUTHORITY}(?:/{_PCHAR}*)*|/(?:{_PCHAR}+(?:/{_PCHAR}*)*)?|{_PCHAR}+(?:/{_PCHAR}*)*)?"
FORMATS = {"date": rf"^{_DATE}$", "time": rf"^{_TIME}$", "date-time": rf"^{_DATE}T{_TIME}$",
           "duration": rf"^{_DURATION}$",
           "uuid": r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
           "ipv4": rf"^{_IPV4}$", "ipv6": rf"^{_ipv6()}$",
           "hostname": rf"^{_LABEL}(?:\.{_LABEL})*$", "email": rf"^{_ATOM}(?:\.{_ATOM})*@{_LABEL}(?:\.{_LABEL})+$",
           "uri": rf"^[A-Za-z][A-Za-z0-9+.-]*:{_HIER}(?:\?(?:{_PCHAR}|[/?])*)?(?:#(?:{_PCHAR}|[/?])*)?$"}
FORMAT_MAX_LENGTH = {"hostname": 253}
# formats that bound no string: pydantic's SecretStr ("password"), bytes ("binary") and Path ("path"), and
# OpenAPI's number formats; of these an integer's bound its value (int32, int64: that many bits, two's complement)
OPEN_FORMATS = frozenset({"password", "binary", "path", "float", "double", "int32", "int64"})
INTEGER_BITS = {"int32": 32, "int64": 64}
MAX_WS = 32  # a newline and 31 spaces: indentation eight levels deep at four spaces
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
SCALARS = frozenset(TYPES[2:])
FIRST = {"object": b"{", "array": b"[", "string": b'"', "number": b"-0123456789", "integer": b"-0123456789",
         "boolean": b"tf", "null": b"n"}  # the bytes a value of each type can start with
# (an OpenAPI discriminator names the property that tells oneOf's alternatives apart: the alternatives say it too)
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$comment", "discriminator",
                         "readOnly", "writeOnly", "deprecated"})


@dataclass(frozen=True)
class Range:
    """A number's bounds (minimum, maximum, exclusiveMinimum, exclusiveMaximum) as exact fractions, None where
    unbounded; an integer's as the closed integer bounds they leave. `step`: multipleOf (an integer's: the
    integers that are multiples of it, the multiples of its numerator), the values' spacing from 0."""
    lo: Fraction | None = None
    lo_closed: bool = True
    hi: Fraction | None = None
    hi_closed: bool = True
    step: Fraction | None = None

    def holds(self, v: Fraction) -> bool:
        return self.meets(v, True, v, True)

    def meets(self, a: Fraction | None, a_closed: bool, b: Fraction | None, b_closed: bool) -> bool:
        """Some value between a and b (None: unbounded; closed: the end belongs) is in the range."""
        lo, lo_closed = _tighter(a, a_closed, self.lo, self.lo_closed, max)
        hi, hi_closed = _tighter(b, b_closed, self.hi, self.hi_closed, min)
        if lo is None or hi is None:
            return True
        if self.step is not None:  # the first multiple in the interval stands for its low end
            first = math.ceil(lo / self.step) * self.step
            if first == lo and not lo_closed:
                first += self.step
            lo, lo_closed = first, True
        return lo < hi or lo == hi and lo_closed and hi_closed

    def reachable(self, text: str, integer: bool) -> bool:
        """Can a number whose JSON text starts with `text` (no exponent) end in the range? The text's
        magnitudes: [I.F, I.F + 10^-len(F)) after a point; after the digits I, [I * 10^k, (I + 1) * 10^k) for
        every k >= 0 (more digits), integers only for an integer, just 0 after a leading 0; any after "-"."""
        neg, body = text.startswith("-"), text.lstrip("-")
        if "." in body:
            whole, frac = body.split(".")
            a = Fraction(int(whole + frac or "0"), 10 ** len(frac))
            return self._meets_magnitudes(neg, a, a + Fraction(1, 10 ** len(frac)), False)
        if body in ("", "0"):
            return self._meets_magnitudes(neg, Fraction(0), None if body == "" else Fraction(0 if integer else 1),
                                          integer or body == "")
        start, bound = int(body), max((abs(x) for x in (self.lo, self.hi) if x is not None), default=Fraction(0))
        k = 0
        while start * 10 ** k <= bound:  # (past every finite bound, only an unbounded side can be met)
            a = Fraction(start * 10 ** k)
            if self._meets_magnitudes(neg, a, a + 10 ** k - (1 if integer else 0), integer):
                return True
            k += 1
        return (self.lo if neg else self.hi) is None

    def _meets_magnitudes(self, neg: bool, a: Fraction, b: Fraction | None, b_closed: bool) -> bool:
        """meets for the values whose magnitudes lie in [a, b) ([a, b] if b_closed), negated if neg."""
        if neg:
            return self.meets(None if b is None else -b, b_closed, -a, True)
        return self.meets(a, True, b, b_closed)


def _tighter(x: Fraction | None, x_closed: bool, y: Fraction | None, y_closed: bool, pick) -> tuple:
    """The tighter of two ends (pick = max for lower ends, min for upper ends; None is no end); of equal ends
    the open one."""
    if x is None or y is None:
        return (y, y_closed) if x is None else (x, x_closed)
    if x == y:
        return x, x_closed and y_closed
    return (x, x_closed) if pick(x, y) == x else (y, y_closed)


class SchemaError(ValueError):
    """A schema this module cannot enforce: `path` names where (e.g. "properties.tags.items")."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path or 'the schema'}: {message}")
        self.path, self.reason = path, message


@dataclass(frozen=True, eq=False)
class Node:
    """What a value may be. `types`: its JSON types. For an object: `props` (a property's name as written between the
    quotes -> its node), `required`, `extra`, the node of any other property (None: no other property),
    `min_props`, `max_props` (how many properties). For an array: `prefix_items` (the first items' nodes, a
    tuple's), `items` (the node of each item after them; None: no more), `min_items`, `max_items`, `unique`
    (uniqueItems; `distinct`: how many values its items can take, None: any number). For a string: `min_length`,
    `max_length` (in characters), `pattern` (a compiled pattern or format the string must match; with a length,
    `reach`). For a number: `range` (None: any). `options`: the JSON texts of an enum's values (then only those).
    `alternatives`: anyOf's nodes (a value is read with each that can start with its first byte, until it ends)."""

    types: frozenset[str]
    props: dict[bytes, Node] = field(default_factory=dict)
    required: frozenset[bytes] = frozenset()
    extra: Node | None = None
    min_props: int = 0
    max_props: int | None = None
    items: Node | None = None
    prefix_items: tuple[Node, ...] = ()
    options: tuple[bytes, ...] = ()
    alternatives: tuple[Node, ...] = ()
    min_items: int = 0
    max_items: int | None = None
    unique: bool = False
    distinct: int | None = None
    min_length: int = 0
    max_length: int | None = None
    range: Range | None = None
    pattern: Pattern | None = None
    reach: tuple[int, ...] = ()  # where a length bounds a pattern: its states' `Pattern.lengths`

    @property
    def first(self) -> frozenset[int]:
        """The bytes a value of this node can start with."""
        if self.options:
            return frozenset(t[0] for t in self.options)
        if self.alternatives:  # (a recursive $def's types were not known when its anyOf was compiled)
            return frozenset().union(*(a.first for a in self.alternatives))
        return frozenset(b for k in self.types for b in FIRST[k])

    def item(self, i: int) -> Node | None:
        """The node of an array's item i (from 0); None where the array takes no such item."""
        return self.prefix_items[i] if i < len(self.prefix_items) else self.items


ANY = Node(frozenset(TYPES))
object.__setattr__(ANY, "extra", ANY)  # any value: any property, any items
object.__setattr__(ANY, "items", ANY)
OBJECT = Node(frozenset({"object"}), extra=ANY)  # json_object: an object of anything
KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties", "items", "prefixItems", "enum",
                      "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "minItems", "maxItems",
                      "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                      "multipleOf", "pattern", "format", "uniqueItems", "minProperties", "maxProperties",
                      "propertyNames"})


def compile_schema(schema: Any) -> Node:
    """The Node of a JSON Schema: type (one or a list), properties, required, additionalProperties (a boolean or a
    schema; absent means allowed, as JSON Schema says), minProperties / maxProperties, propertyNames (an enum of
    strings), items (false: none), prefixItems, minItems / maxItems, uniqueItems (over scalar items: `_unique`),
    minLength / maxLength, pattern (pattern.py's subset) or format (FORMATS, OPEN_FORMATS), with or without a
    length, minimum / maximum / exclusiveMinimum / exclusiveMaximum and multipleOf (such a number is written
    without an exponent), enum and const (of strings, numbers, booleans or null, matched as json.dumps writes
    them), anyOf (pydantic's Optional and Union: a value is read with every alternative that can start with its
    first byte), oneOf whose alternatives no value meets two of (`_disjoint`: pydantic's discriminated unions;
    then it is their anyOf), $ref to the root's $defs / definitions (what the openai client sends for pydantic
    models; recursive ones too, where a finite value meets them), allOf of one schema. ANNOTATIONS are read past.
    Anything else is a SchemaError, not ignored."""
    defs = schema.get("$defs", schema.get("definitions", {})) if isinstance(schema, dict) else {}
    compiler = _Compiler(defs if isinstance(defs, dict) else {})
    root = compiler.node(schema, "")
    compiler.check_finite(root)
    compiler.check_one_of()
    return root


@dataclass
class _Compiler:
    defs: dict
    done: dict[str, Node] = field(default_factory=dict)  # compiled $defs, shared by every $ref to them
    open: set[str] = field(default_factory=set)  # $defs being compiled (a $ref back to one is recursion)
    # a recursive $def's node, handed to the $refs inside it before it is compiled and filled in after
    holders: dict[str, Node] = field(default_factory=dict)
    one_of: list[tuple[Node, str]] = field(default_factory=list)  # oneOf's nodes and paths, checked once all are

    def node(self, schema: Any, path: str) -> Node:
        if schema is True or schema == {}:
            return ANY
        if not isinstance(schema, dict):
            raise SchemaError(path, f"a schema is an object; got {json.dumps(schema)[:60]}")
        unknown = sorted(set(schema) - ANNOTATIONS - KEYWORDS)
        if unknown:
            raise SchemaError(path, f"{unknown} not supported ({', '.join(sorted(KEYWORDS))} are)")
        if "$ref" in schema:
            return self._ref(schema, path)
        if "anyOf" in schema or "oneOf" in schema:
            return self._any_of(schema, path)
        if "allOf" in schema:  # of one schema: how pydantic once wrapped a $ref to give it a description
            if not (isinstance(schema["allOf"], list) and len(schema["allOf"]) == 1) or \
                    set(schema) - ANNOTATIONS - {"allOf"}:
                raise SchemaError(_join(path, "allOf"), "allOf of one schema, with no other keyword beside it, is "
                                                        "supported")
            return self.node(schema["allOf"][0], _join(path, "allOf", "0"))
        if "enum" in schema or "const" in schema:
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            if not isinstance(values, list) or not values or not all(
                    isinstance(v, (str, bool, int)) or v is None or isinstance(v, float) and math.isfinite(v)
                    for v in values):
                raise SchemaError(path, "enum and const take strings, finite numbers, booleans and null")
            texts = tuple(json.dumps(v, ensure_ascii=False).encode() for v in values)
            return Node(frozenset(json_type(v) for v in values), options=texts)
        kinds = schema.get("type", list(TYPES))
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not isinstance(kinds, list) or not kinds or not all(k in TYPES for k in kinds):
            raise SchemaError(path, f"type must be one of {list(TYPES)} or a list of them")
        return Node(frozenset(kinds), range=_range(schema, path, "number" not in kinds), **self._object(schema, path),
                    **self._array(schema, path), **_string(schema, path))

    def _object(self, schema: dict, path: str) -> dict[str, Any]:
        """An object's Node fields: properties, required, additionalProperties, minProperties / maxProperties,
        and propertyNames of an enum (pydantic's dict with Literal or Enum keys): the object may then have
        those names, each with its property's node or else additionalProperties', and no other."""
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise SchemaError(path, "properties must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(r in props for r in required):
            raise SchemaError(path, "required must list names in properties")
        extra = schema.get("additionalProperties", True)
        nodes = {name: self.node(s, _join(path, "properties", name)) for name, s in props.items()}
        other = None if extra is False else self.node(extra, _join(path, "additionalProperties"))
        if "propertyNames" in schema:
            names = self._names(schema["propertyNames"], _join(path, "propertyNames"))
            if not set(required) <= set(names):
                raise SchemaError(_join(path, "propertyNames"), f"required {sorted(set(required) - set(names))} "
                                                                "not among its names")
            nodes = {n: nodes.get(n, other) for n in names if n in nodes or other is not None}
            other = None
        low, high = _limits(schema, path, "minProperties", "maxProperties")
        if high is not None and high < len(set(required)):
            raise SchemaError(_join(path, "maxProperties"), f"{high}, fewer than the {len(set(required))} required")
        if other is None and low > len(nodes):
            raise SchemaError(_join(path, "minProperties"), f"{low}, more than the {len(nodes)} properties it may have")
        return dict(props={_key(n): v for n, v in nodes.items()}, required=frozenset(_key(r) for r in required),
                    extra=other, min_props=low, max_props=high)

    def _names(self, schema: Any, path: str) -> list[str]:
        """propertyNames' names: an enum or const of strings (through a $ref too)."""
        node = self.node(schema, path)
        if not node.options or node.types != {"string"}:
            raise SchemaError(path, "propertyNames is held as an enum or const of strings (pydantic's Literal or "
                                    "Enum keys)")
        return [json.loads(t) for t in node.options]

    def _array(self, schema: dict, path: str) -> dict[str, Any]:
        """An array's Node fields: prefixItems (a tuple's items, in order), items (each after them; false: none),
        minItems / maxItems."""
        low, high = _limits(schema, path, "minItems", "maxItems")
        prefix = schema.get("prefixItems", [])
        if not isinstance(prefix, list):
            raise SchemaError(_join(path, "prefixItems"), "must be a list of schemas")
        items = schema.get("items", True)
        firsts = tuple(self.node(x, _join(path, "prefixItems", str(i))) for i, x in enumerate(prefix))
        fields = dict(items=None if items is False else self.node(items, _join(path, "items")), prefix_items=firsts,
                      min_items=low, max_items=high)
        if items is False and low > len(prefix):
            raise SchemaError(_join(path, "minItems"), f"{low} items, where prefixItems and items false allow "
                                                       f"{len(prefix)}")
        if schema.get("uniqueItems", False) is not False:
            fields |= _unique(schema, fields["items"], low, path)
        return fields

    def _ref(self, schema: dict, path: str) -> Node:
        ref = schema["$ref"]
        others = sorted(set(schema) - ANNOTATIONS - {"$ref", "$defs", "definitions"})
        prefix = next((p for p in ("#/$defs/", "#/definitions/") if isinstance(ref, str) and ref.startswith(p)), None)
        name = ref[len(prefix):] if prefix else None
        if others or name not in self.defs:
            raise SchemaError(_join(path, "$ref"), f"{json.dumps(ref)} must name one of the root's $defs "
                                                   f"{sorted(self.defs)}, with no other keyword beside it")
        if name in self.open:
            return self.holders.setdefault(name, Node(frozenset()))
        if name not in self.done:
            self.open.add(name)
            node = self.node(self.defs[name], _join("$defs", name))
            self.open.discard(name)
            if name in self.holders:  # the $refs inside it hold the holder: it becomes the node
                holder = self.holders[name]
                for f in fields(Node):
                    object.__setattr__(holder, f.name, getattr(node, f.name))
                node = holder
            self.done[name] = node
        return self.done[name]

    def check_finite(self, root: Node) -> None:
        """Refuse a recursive $def that no finite value meets (it requires itself): the automaton could go
        into it and never come out. A node has a finite value where one of its types or alternatives does: an
        object whose required properties all do, an array that may be empty or whose items do, any other
        type; found by growing the set of such nodes until it stops growing."""
        nodes, todo = {}, [root]
        while todo:
            n = todo.pop()
            if id(n) not in nodes:
                nodes[id(n)] = n
                todo += [*n.props.values(), *n.alternatives, *n.prefix_items,
                         *(c for c in (n.extra, n.items) if c is not None)]
        finite: set[int] = set()
        grew = True
        while grew:
            grew = False
            for key, n in nodes.items():
                if key not in finite and _has_finite_value(n, finite):
                    finite.add(key)
                    grew = True
        for name, holder in self.holders.items():
            if id(holder) not in finite:
                raise SchemaError(_join("$defs", name), "no finite value meets it: it requires itself")
            if _in_alternatives(holder, holder, set()):
                raise SchemaError(_join("$defs", name), "it is one of its own anyOf alternatives")

    def _any_of(self, schema: dict, path: str) -> Node:
        """anyOf, or oneOf (held the same: check_one_of refuses one whose alternatives may overlap)."""
        word = "anyOf" if "anyOf" in schema else "oneOf"
        alts, others = schema[word], sorted(set(schema) - ANNOTATIONS - {word})
        if others or not isinstance(alts, list) or not alts:
            raise SchemaError(_join(path, word), f"{word} takes a list of schemas, with no other keyword beside it")
        nodes = tuple(self.node(a, _join(path, word, str(i))) for i, a in enumerate(alts))
        node = Node(frozenset(k for n in nodes for k in n.types), alternatives=nodes)
        if word == "oneOf":
            self.one_of.append((node, _join(path, word)))
        return node

    def check_one_of(self) -> None:
        """A value of a oneOf meets exactly one alternative. The automaton reads it as anyOf (at least one), so
        a oneOf is held only where no value can meet two of its alternatives; once every $def is compiled
        (a recursive one's node is filled in last)."""
        for node, path in self.one_of:
            alts = node.alternatives
            for i, j in ((i, j) for i in range(len(alts)) for j in range(i + 1, len(alts))):
                if not _disjoint(alts[i], alts[j], {}):
                    raise SchemaError(path, f"alternatives {i} and {j} may both meet a value, which oneOf forbids; "
                                            "a oneOf is held where its alternatives are of different types or "
                                            "objects that require a property whose values differ (a "
                                            "discriminator); anyOf takes any")


def _in_alternatives(target: Node, n: Node, seen: set[int]) -> bool:
    """target is among n's anyOf alternatives, or theirs, and so on (a value of it would start with itself)."""
    for a in n.alternatives:
        if a is target:
            return True
        if id(a) not in seen:
            seen.add(id(a))
            if _in_alternatives(target, a, seen):
                return True
    return False


def _disjoint(a: Node, b: Node, known: dict[tuple[int, int], bool]) -> bool:
    """No value meets both nodes, by a sufficient rule (False where it cannot tell): of no common type, or enums
    of no common value, or objects where one requires a property the other, closed, cannot have, or both
    require a property whose nodes are disjoint (a discriminator's consts). `known`: pairs compared so far (one
    being compared counts as not disjoint: recursive $defs)."""
    pair = (id(a), id(b))
    if pair not in known:
        known[pair] = False
        known[pair] = _disjoint_now(a, b, known)
    return known[pair]


def _disjoint_now(a: Node, b: Node, known: dict[tuple[int, int], bool]) -> bool:
    if a.alternatives or b.alternatives:
        return all(_disjoint(x, y, known) for x in a.alternatives or (a,) for y in b.alternatives or (b,))
    common = _kinds(a) & _kinds(b)
    if not common:
        return True
    if a.options or b.options:
        return bool(a.options and b.options) and not {_value(t) for t in a.options} & {_value(t) for t in b.options}
    if common != {"object"}:
        return False
    return any(x.extra is None and y.required - x.props.keys() for x, y in ((a, b), (b, a))) or any(
        _disjoint(a.props[k], b.props[k], known) for k in a.required & b.required)


def _kinds(n: Node) -> frozenset[str]:
    """The JSON types of n's values, a number's "integer" among them (an integer is a number too)."""
    return n.types | {"integer"} if "number" in n.types else n.types


def _value(text: bytes) -> tuple[str, Any]:
    """An enum value as a validator compares them: 1 and 1.0 equal, true and 1 not."""
    v = json.loads(text)
    return ("number", Fraction(v)) if json_type(v) in ("integer", "number") else (json_type(v), v)


def _has_finite_value(n: Node, finite: set[int]) -> bool:
    """check_finite's step: a value of n exists whose parts are in `finite` (ids of nodes known to have one)."""
    if n.options:
        return True
    if n.alternatives:
        return any(id(a) in finite for a in n.alternatives)
    for kind in n.types:
        if kind == "object" and all(id(n.props[k]) in finite for k in n.required) and (
                n.extra is not None and id(n.extra) in finite
                or sum(id(p) in finite for p in n.props.values()) >= n.min_props):
            return True
        if kind == "array" and all(n.item(i) is not None and id(n.item(i)) in finite for i in range(n.min_items)):
            return True
        if kind not in ("object", "array"):
            return True
    return False


def _limits(schema: dict, path: str, low: str, high: str) -> tuple[int, int | None]:
    """A count's bounds (minItems / maxItems, minLength / maxLength): non-negative integers, low <= high."""
    lo, hi = schema.get(low, 0), schema.get(high)
    if not _is_count(lo) or hi is not None and not (_is_count(hi) and hi >= lo):
        raise SchemaError(_join(path, low if not _is_count(lo) else high),
                          f"{low} and {high} must be integers >= 0, {low} <= {high}")
    return lo, hi


def _string(schema: dict, path: str) -> dict[str, Any]:
    """A string's Node fields: minLength / maxLength, a pattern or a format (a format's own limit,
    FORMAT_MAX_LENGTH, joins maxLength) and, where a length bounds the pattern, the pattern's `lengths` under it:
    a string may then take a character only where the pattern can still match in as many characters as the
    length leaves."""
    lo, hi = _limits(schema, path, "minLength", "maxLength")
    pattern = _pattern(schema, path)
    if schema.get("format") in FORMAT_MAX_LENGTH:
        hi = min(FORMAT_MAX_LENGTH[schema["format"]], hi if hi is not None else math.inf)
    fields = dict(min_length=lo, max_length=hi, pattern=pattern)
    if pattern is None or lo == 0 and hi is None:
        return fields
    try:
        reach = tuple(pattern.lengths(hi if hi is not None else lo + len(pattern.states)))
    except PatternError as e:
        raise SchemaError(_join(path, "pattern"), str(e)) from None
    node = Node(frozenset({"string"}), reach=reach, **fields)
    if not _length_fits(node, pattern.begin(), 0):
        raise SchemaError(path, f"no string of {lo} to {hi if hi is not None else 'any number of'} characters "
                                f"matches the {'format' if 'format' in schema else 'pattern'}")
    return fields | {"reach": reach}


def _unique(schema: dict, items: Node | None, low: int, path: str) -> dict[str, Any]:
    """uniqueItems' Node fields. Held over items of an enum, or of strings, numbers, booleans and null with no
    bound or pattern: there a prefix of an item can always go on to a value the array has not had (another
    character or digit), or its literal is left out once had; a repeat is refused where it ends."""
    where = _join(path, "uniqueItems")
    if schema["uniqueItems"] is not True:
        raise SchemaError(where, "must be a boolean")
    open_scalar = items is not None and not items.alternatives and items.types <= SCALARS and \
        items.pattern is None and items.max_length is None and items.range is None
    if "prefixItems" in schema or not (open_scalar or items is not None and items.options):
        raise SchemaError(where, "uniqueItems is held over items of an enum, or of strings, numbers, booleans "
                                 "and null with no bound, length limit or pattern")
    if items.options:
        distinct = len({_value(t) for t in items.options})
    elif items.types & {"string", "number", "integer"}:
        distinct = None
    else:
        distinct = 2 * ("boolean" in items.types) + ("null" in items.types)
    if distinct is not None and low > distinct:
        raise SchemaError(_join(path, "minItems"), f"{low} distinct items, of {distinct} values")
    return dict(unique=True, distinct=distinct)


def _length_fits(node: Node, states: Iterable[int], consumed: int) -> bool:
    """A string of `consumed` characters, its pattern in `states`, can still match within node's lengths. With
    no maxLength, minLength + (the pattern's states) characters are as many as need looking at: a longer match
    has a loop that can be left out."""
    if not node.reach:
        return True
    top = (node.max_length if node.max_length is not None else node.min_length + len(node.reach)) - consumed
    bottom = max(node.min_length - consumed, 0)
    window = (1 << top + 1) - (1 << bottom) if top >= bottom else 0
    return any(node.reach[i] & window for i in states)


def _pattern(schema: dict, path: str) -> Pattern | None:
    """A string's pattern, or its format's."""
    fmt = schema.get("format")
    fmt = None if isinstance(fmt, str) and fmt in OPEN_FORMATS else fmt
    if "pattern" not in schema and fmt is None:
        return None
    if "pattern" in schema and fmt is not None:
        raise SchemaError(path, "pattern and format: one of them at a time is supported")
    if fmt is not None and fmt not in FORMATS:
        raise SchemaError(_join(path, "format"), f"{json.dumps(fmt)} is not supported "
                                                 f"({sorted(FORMATS.keys() | OPEN_FORMATS)} are)")
    source = FORMATS[fmt] if fmt is not None else schema["pattern"]
    if not isinstance(source, str):
        raise SchemaError(_join(path, "pattern"), "must be a string")
    try:
        return _compiled(source)
    except PatternError as e:
        raise SchemaError(_join(path, "pattern"), str(e)) from None


@functools.lru_cache(maxsize=256)
def _compiled(source: str) -> Pattern:
    """Pattern(source), built once: a request's schema is compiled up to four times, and formats recur."""
    return Pattern(source)


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _range(schema: dict, path: str, integer: bool) -> Range | None:
    """The bounds of minimum, maximum, exclusiveMinimum, exclusiveMaximum (numbers, as draft 2020-12 writes
    them), closed integer bounds for an integer, and multipleOf; None without any. An empty range is a
    SchemaError."""
    given = {k: schema[k] for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "multipleOf")
             if k in schema}
    bits = INTEGER_BITS.get(schema.get("format")) if isinstance(schema.get("format"), str) else None
    if not given and bits is None:
        return None
    bad = [k for k, v in given.items()
           if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)]
    if bad:
        raise SchemaError(_join(path, bad[0]), "must be a finite number")
    step = _end(given, "multipleOf")[0]
    if step is not None and step <= 0:
        raise SchemaError(_join(path, "multipleOf"), "must be greater than 0")
    lo, lo_closed = _tighter(*_end(given, "minimum"), *_end(given, "exclusiveMinimum", False), max)
    hi, hi_closed = _tighter(*_end(given, "maximum"), *_end(given, "exclusiveMaximum", False), min)
    if bits is not None:
        lo, lo_closed = _tighter(lo, lo_closed, Fraction(-2 ** (bits - 1)), True, max)
        hi, hi_closed = _tighter(hi, hi_closed, Fraction(2 ** (bits - 1) - 1), True, min)
    if integer:  # the integers in the range, as closed bounds
        if lo is not None:
            lo, lo_closed = Fraction(math.ceil(lo) if lo_closed else math.floor(lo) + 1), True
        if hi is not None:
            hi, hi_closed = Fraction(math.floor(hi) if hi_closed else math.ceil(hi) - 1), True
    r = Range(lo, lo_closed, hi, hi_closed, Fraction(step.numerator) if integer and step is not None else step)
    if lo is not None and hi is not None and not r.meets(lo, lo_closed, hi, hi_closed):
        raise SchemaError(path, f"no {'integer' if integer else 'number'} meets "
                                f"{json.dumps(given | ({'format': schema['format']} if bits else {}))}")
    return r


def _end(given: dict, name: str, closed: bool = True) -> tuple[Fraction | None, bool]:
    # Fraction(repr(x)): the decimal the schema wrote, as a text of the answer would be read, not the binary float
    return (Fraction(repr(given[name])), closed) if name in given else (None, closed)


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def object_schema(schema: dict) -> Node:
    """compile_schema for an answer's schema, whose root must be an object (as OpenAI's structured outputs)."""
    node = compile_schema(schema)
    if node.types != frozenset({"object"}) or node.options:
        raise SchemaError("type", "the answer's schema must be {'type': 'object', ...}")
    return node


def json_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    return "string" if isinstance(v, str) else "integer" if isinstance(v, int) else \
        "number" if isinstance(v, float) else "null"


def _key(name: str) -> bytes:
    return json.dumps(name, ensure_ascii=False).encode()[1:-1]


@dataclass
class Frame:
    """An open container: its opening byte, its node, the keys it has had, the key being read, the items it
    has had (and a uniqueItems array's item values, as `_value` gives them)."""
    open: int
    node: Node
    used: set[bytes] = field(default_factory=set)
    key: bytes = b""
    count: int = 0
    seen: set[tuple[str, Any]] = field(default_factory=set)

    def copy(self) -> Frame:
        new = object.__new__(Frame)
        new.__dict__ = self.__dict__.copy()
        new.used, new.seen = set(self.used), set(self.seen)
        return new

    @property
    def full(self) -> bool:
        """A container that can take no other member (after a comma, or a quote in an object, it would be a
        dead end): an object with no other key it may have or at its maxProperties, an array at its maxItems or
        past its items."""
        if self.open == ord("["):
            n = self.node
            return n.max_items is not None and self.count >= n.max_items or n.item(self.count) is None or \
                n.distinct is not None and len(self.seen) >= n.distinct
        n = self.node
        return n.extra is None and n.props.keys() <= self.used or \
            n.max_props is not None and len(self.used) >= n.max_props

    @property
    def only_required(self) -> bool:
        """An object whose maxProperties leaves room only for the required properties it has not had."""
        n = self.node
        return n.max_props is not None and n.max_props - len(self.used) <= len(n.required - self.used)


@dataclass
class JsonPrefix:
    """The state after some bytes of a JSON object text matching `root`. `feed` returns False (and leaves the
    state unusable) at the first byte that no such text can have there."""

    root: Node = OBJECT
    stack: list[Frame] = field(default_factory=list)
    # "start" (before the object), "value" (a value must come), "value_or_end" (after "["), "key" (after ","),
    # "key_or_end" (after "{"), "colon", "after" (after a value), "string", "escape", "unicode", "number",
    # "literal", "done"
    mode: str = "start"
    node: Node | None = None  # the value being read (or about to be)
    key: bool = False  # the string being read is an object key
    left: tuple[bytes, ...] = ()  # the literal or enum texts the value can still be, less what was read
    hex_left: int = 0  # hex digits left in a \\u escape
    hex: str = ""  # the \\u escape's hex digits so far
    utf8_left: int = 0  # continuation bytes left in a string's UTF-8 character
    utf8_next: tuple[int, int] = (0x80, 0xBF)  # the range the next of them must be in
    number: str = ""  # "-", "0", "int", ".", "frac", "e", "e+", "exp": what the number's text ends in
    digits: str = ""  # the number's text so far (a bounded number's value is checked against its range)
    chars: int = 0  # characters of the string value being read (minLength, maxLength)
    code: int = 0  # the code point of the UTF-8 character being read
    nfa: frozenset[int] = frozenset()  # the states of the string value's pattern
    ws: int = 0  # whitespace bytes in a row, outside strings
    text: str = ""  # a uniqueItems array's string item, decoded, so far
    literal: bytes = b""  # a uniqueItems array's literal or enum item, so far
    # "union": a value of an anyOf whose first byte several alternatives can start with, read by one automaton
    # per alternative that has fit it so far (JSON's syntax is the same in each: they end at the same byte)
    branches: list[JsonPrefix] = field(default_factory=list)

    def copy(self) -> JsonPrefix:
        # (field by field, not dataclasses.replace, which runs __init__ again: `allowed` copies the state once
        # for each byte it tries, and a copy was most of a walk's time)
        new = object.__new__(JsonPrefix)
        new.__dict__ = self.__dict__.copy()
        new.stack = [f.copy() for f in self.stack]
        new.branches = [b.copy() for b in self.branches]
        return new

    @property
    def done(self) -> bool:
        return self.mode == "done"

    @property
    def complete(self) -> bool:
        """The text is a whole value where nothing follows it: done, or a number (or a number's option, "1" of
        1 and 12) that could also go on."""
        if self.stack or self.mode not in ("number", "literal", "union"):
            return self.done
        if self.mode == "union":
            return any(b.complete for b in self.branches)
        if self.mode == "literal":
            return b"" in self.left
        r = self.node.range
        return self.number in ("0", "int", "frac", "exp") and (r is None or r.holds(Fraction(self.digits)))

    def feed(self, data: bytes) -> bool:
        return all(self._byte(b) for b in data)

    def _byte(self, b: int) -> bool:
        m = self.mode
        if m == "union":
            return self._union_byte(b)
        if m in ("string", "escape", "unicode"):
            return self._string_byte(m, b)
        if m == "literal":
            left = tuple(t[1:] for t in self.left if t and t[0] == b)
            if left:
                self.left, self.literal = left, self.literal + bytes([b])
                return self._value_done() if left == (b"",) else True
            if b"" not in self.left:
                return False
            return self._value_done() and self._byte(b)  # a number option ended (as "1" of 1 and 12): b after it
        if m == "number":
            if self._number(b):
                return True
            if self.number not in ("0", "int", "frac", "exp"):  # "-", "." or an exponent without digits
                return False
            if self.node.range is not None and not self.node.range.holds(Fraction(self.digits)):
                return False
            return self._value_done() and self._byte(b)  # the byte that ended the number
        if b in WS:
            self.ws += 1
            return m != "done" and self.ws <= MAX_WS
        self.ws = 0
        if m == "start":
            self.node = self.root
            return self._value_start(b)
        if m in ("key", "key_or_end"):
            if b == ord("}") and m == "key_or_end":
                return self._close(b)
            if self.stack[-1].full:
                return False  # (only "}")
            self.mode, self.key = "string", True
            return b == ord('"')
        if m == "colon":
            self.mode = "value"
            return b == ord(":")
        if m in ("value", "value_or_end"):
            if b == ord("]") and m == "value_or_end":
                return self._close(b)
            if m == "value_or_end" and self.stack[-1].full:
                return False  # (only "]": maxItems 0)
            return self._value_start(b)
        if m == "after":
            if b == ord(","):
                top = self.stack[-1]
                if top.full:
                    return False
                self.mode, self.node = ("key", None) if top.open == ord("{") else ("value", top.node.item(top.count))
                return True
            return self._close(b)
        return False  # "done": nothing may follow the object

    def _string_byte(self, m: str, b: int) -> bool:
        """A byte of a string (a key or a value): escapes, UTF-8, a value's length and pattern."""
        if self.key and not (m == "string" and b == ord('"')) and not self._key_byte(b):
            return False
        if m == "string":
            if self.utf8_left or b >= 0x80:
                return (self.utf8_left or self._char()) and self._utf8_byte(b)
            if b == ord('"'):
                if self.key:
                    return self._key_done()
                return self.chars >= self.node.min_length and self._matched() and self._value_done()
            if b == ord("\\"):
                self.mode = "escape"
                return self._char() and self._may_read(0, 0xFFFF)
            return b >= 0x20 and self._char() and self._read(b)
        if m == "escape":
            if b not in ESCAPES:
                return False
            self.mode, self.hex_left = ("unicode", 4) if b == ord("u") else ("string", 0)
            return self._may_read(0, 0xFFFF) if b == ord("u") else self._read(ESCAPED[b])
        self.hex_left -= 1
        self.hex = self.hex + chr(b) if self.hex_left < 3 else chr(b)
        if b not in HEX or self._reads_chars() and self.hex[:2].lower() in SURROGATE_HEX:
            return False  # (\\uD800-\\uDFFF where characters are counted or matched: written as themselves)
        if self.hex_left == 0:
            self.mode = "string"
            return self._read(int(self.hex, 16))
        low = int(self.hex, 16) << 4 * self.hex_left
        return self._may_read(low, low + 16 ** self.hex_left - 1)

    def _reads_chars(self) -> bool:
        """The string value's characters are counted (minLength, maxLength) or matched (a pattern)."""
        n = self.node
        return not self.key and (n.min_length > 0 or n.max_length is not None or n.pattern is not None
                                 or self._unique_item())

    def _char(self) -> bool:
        """A character of a string begins: counted against the value's maxLength."""
        if self.key or self.node.min_length == 0 and self.node.max_length is None:
            return True
        self.chars += 1
        return self.node.max_length is None or self.chars <= self.node.max_length

    def _read(self, code: int) -> bool:
        """A character of a string is complete: the value's pattern reads it (a uniqueItems item keeps it)."""
        if self._unique_item():
            self.text += chr(code)
        if self.key or self.node.pattern is None:
            return True
        self.nfa = self.node.pattern.step(self.nfa, code)
        return bool(self.nfa) and _length_fits(self.node, self.nfa, self.chars)

    def _may_read(self, lo: int, hi: int) -> bool:
        """A character still being written will be one of lo..hi (no surrogate): can the pattern read one?"""
        p = None if self.key else self.node.pattern
        if p is None:
            return True
        states = self.nfa if not self.node.reach else frozenset(  # (chars counts the character being written)
            i for i in self.nfa if _length_fits(self.node, (i,), self.chars - 1))
        return p.can_step(states, lo, min(hi, 0xD7FF)) or hi >= 0xE000 and p.can_step(states, max(lo, 0xE000), hi)

    def _matched(self) -> bool:
        return self.node.pattern is None or self.node.pattern.matches(self.nfa)

    def _utf8_byte(self, b: int) -> bool:
        return utf8_byte(self, b, self._read, self._may_read)

    def _key_byte(self, b: int) -> bool:
        """A byte of an object key, as written: the key must stay a prefix of a property the object can still
        have (any key, where other properties are allowed)."""
        top = self.stack[-1]
        top.key += bytes([b])
        if top.only_required:
            return any(k.startswith(top.key) for k in top.node.required - top.used)
        return top.node.extra is not None or any(k.startswith(top.key) and k not in top.used for k in top.node.props)

    def _key_done(self) -> bool:
        top = self.stack[-1]
        key, top.key = top.key, b""
        node = top.node.props.get(key, top.node.extra)
        if node is None or key in top.used or top.only_required and key not in top.node.required:
            return False  # not a property it can have (or has room for), or one it has had
        top.used.add(key)
        self.mode, self.key, self.node = "colon", False, node
        return True

    def _value_start(self, b: int) -> bool:
        node = self.node
        if node.alternatives:
            fits = [a for a in node.alternatives if b in a.first]
            if len(fits) != 1:
                return self._union(fits, b)
            node = self.node = fits[0]
        self.text, self.literal = "", b""
        if node.options:
            self.mode, self.left = "literal", self._unused(node.options)
            return self._byte(b)
        kinds = [k for k in node.types if b in FIRST[k]]
        if not kinds:
            return False
        if b in (ord("{"), ord("[")):
            self.stack.append(Frame(b, node))
            self.mode = "key_or_end" if b == ord("{") else "value_or_end"
            self.node = node.item(0) if b == ord("[") else None
            return True
        if b == ord('"'):
            self.mode, self.key, self.chars = "string", False, 0
            self.nfa = node.pattern.begin() if node.pattern is not None else frozenset()
            return True
        if b in LITERALS:
            self.mode, self.left = "literal", self._unused((LITERALS[b],))
            return self._byte(b)
        self.mode, self.number = "number", "-" if b == ord("-") else "0" if b == ord("0") else "int"
        self.digits = chr(b)
        return self._in_range()

    def _union(self, alternatives: list[Node], b: int) -> bool:
        """Start reading a value with each of these alternatives (those that can start with b)."""
        self.mode, self.branches = "union", [JsonPrefix(a) for a in alternatives]
        return self._union_byte(b)

    def _union_byte(self, b: int) -> bool:
        """b to every branch; those that refuse it drop out. Where every branch refuses it and one has a whole
        value (a number, which only the next byte ends), the value ends and b comes after it; where every branch
        left has a whole value that nothing could extend, the value ends here."""
        ended = any(br.complete for br in self.branches)
        self.branches = [br for br in self.branches if br._byte(b)]
        if not self.branches:
            if not ended:
                return False
            self._value_done()
            return self._byte(b)
        if all(br.done for br in self.branches):
            self.branches = []
            return self._value_done()
        return True

    def _number(self, b: int) -> bool:
        """Extend the number by b if the grammar -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? allows it (an
        integer-only value: without the fraction and exponent; a bounded one: without the exponent) and a
        bounded number can still end in its range."""
        n, whole = self.number, "number" not in self.node.types
        if b in DIGITS:
            nxt = {"-": "0" if b == ord("0") else "int", "int": "int", ".": "frac", "frac": "frac", "e": "exp",
                   "e+": "exp", "exp": "exp"}.get(n)
        elif b == ord("."):
            nxt = "." if n in ("0", "int") and not whole else None
        elif b in (ord("e"), ord("E")):
            nxt = "e" if n in ("0", "int", "frac") and not whole and self.node.range is None else None
        elif b in (ord("+"), ord("-")):
            nxt = "e+" if n == "e" else None
        else:
            nxt = None
        if nxt is None:
            return False
        self.number, self.digits = nxt, self.digits + chr(b)
        return self._in_range()

    def _in_range(self) -> bool:
        r, whole = self.node.range, "number" not in self.node.types
        if self.digits in ("0", "-0") and whole and self._unique_item() and ("number", 0) in self.stack[-1].seen:
            return False  # (an integer 0 cannot go on: another 0 would be a dead end)
        return r is None or r.reachable(self.digits, whole)

    def _unique_item(self) -> bool:
        """The value being read is an item of a uniqueItems array (a scalar: compile_schema holds no other)."""
        return not self.key and bool(self.stack) and self.stack[-1].open == ord("[") and self.stack[-1].node.unique

    def _unused(self, texts: tuple[bytes, ...]) -> tuple[bytes, ...]:
        """Of a literal's or enum's texts, those a uniqueItems array has not had (all, elsewhere)."""
        if not self._unique_item():
            return texts
        return tuple(t for t in texts if _value(t) not in self.stack[-1].seen)

    def _close(self, b: int) -> bool:
        top = self.stack[-1] if self.stack else None
        if top is None or b != top.open + 2:  # "{" + 2 = "}", "[" + 2 = "]"
            return False
        if b == ord("}") and not (top.node.required <= top.used and len(top.used) >= top.node.min_props):
            return False  # a required property is missing, or minProperties not met
        if b == ord("]") and top.count < top.node.min_items:
            return False
        self.stack.pop()
        return self._value_done()

    def _value_done(self) -> bool:
        """A value ended (a uniqueItems array refuses one it has had)."""
        if self._unique_item():
            v = ("number", Fraction(self.digits)) if self.mode == "number" else _value(self.literal) \
                if self.mode == "literal" else ("string", self.text)
            if v in self.stack[-1].seen:
                return False
            self.stack[-1].seen.add(v)
        self.mode = "after" if self.stack else "done"
        if self.stack and self.stack[-1].open == ord("["):
            self.stack[-1].count += 1
        return True


def pick(order: Iterable[int], state: JsonPrefix, vocab_bytes: list[bytes | None]) -> int | None:
    """The first token in `order` whose bytes keep `state` a prefix of a JSON object text (or of what another
    automaton with copy and feed accepts: toolmode.ToolCallPrefix); a token of no bytes, a special token, is
    never allowed: it writes nothing. None if none does."""
    for t in order:
        data = vocab_bytes[t] if t < len(vocab_bytes) else None
        if data and state.copy().feed(data):
            return t
    return None


@dataclass
class Vocabulary:
    """The tokens' bytes in sorted order with their ids: a trie without nodes, since the tokens that start with
    a prefix are one run of the sorted list (found by bisection). Tokens of no bytes are left out."""
    pieces: list[bytes]
    ids: list[int]

    @classmethod
    def of(cls, vocab_bytes: list[bytes | None]) -> Vocabulary:
        pairs = sorted((b, i) for i, b in enumerate(vocab_bytes) if b)
        return cls([b for b, _ in pairs], [i for _, i in pairs])


def allowed(state: JsonPrefix, vocab: Vocabulary) -> list[int]:
    """Every token whose bytes keep `state` a prefix of a JSON object text (or another automaton's, as pick),
    in no particular order. A walk
    over the vocabulary's prefixes that feeds each prefix's last byte once and goes no deeper where the
    automaton refuses it: where few tokens fit (outside strings, in a key of a schema) it reads a small part
    of the vocabulary, where pick would try token after token."""
    pieces, found = vocab.pieces, []
    runs = [(0, len(pieces), 0, state)]  # the run of tokens starting with a prefix of length d that fits
    while runs:
        lo, hi, d, st = runs.pop()
        while lo < hi and len(pieces[lo]) == d:  # the prefix itself (sorted first): a token that fits
            found.append(vocab.ids[lo])
            lo += 1
        while lo < hi:
            c = pieces[lo][d]
            end = hi if c == 255 else bisect.bisect_left(pieces, pieces[lo][:d] + bytes([c + 1]), lo, hi)
            nxt = st.copy()
            if nxt.feed(bytes([c])):
                runs.append((lo, end, d + 1, nxt))
            lo = end
    return found
