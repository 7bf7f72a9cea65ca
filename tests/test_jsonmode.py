"""jsonmode.py: the JSON-object prefix automaton against Python's json module, and the pick."""
import datetime
import ipaddress
import itertools
import json
import random
import re
import string
import uuid
from fractions import Fraction

import pytest

import jsonmode
import pattern

OBJECTS = [{}, {"a": 1}, {"key": "value", "n": -0.5e+10, "t": True, "f": False, "z": None},
           {"nested": {"list": [1, 2.25, [], {}, [{"x": "y"}]], "empty": ""}, "e": 0, "big": 12345678901234567890},
           {"esc": "quote \" backslash \\ slash / \b\f\n\r\t \u0001 \u20ac é 😀", "k\u00e9y": [True, None]}]


def texts():
    for obj in OBJECTS:
        yield json.dumps(obj)  # with spaces after separators, \u escapes for non-ASCII
        yield json.dumps(obj, separators=(",", ":"), ensure_ascii=False)  # compact, raw UTF-8
        yield " \n" + json.dumps(obj, indent=2) + ""  # leading whitespace, newlines and indentation
    yield '{"n": [0, -0, 1e5, 1E-5, 2.5E+3, -12.75]}'
    yield '{"u": "\\u00E9\\uabcd"}'


def _unique(pairs: list) -> dict:
    if len({k for k, _ in pairs}) < len(pairs):
        raise ValueError("a key twice")  # the automaton refuses a key an object already has
    return dict(pairs)


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text, object_pairs_hook=_unique), dict)
    except ValueError:
        return False


@pytest.mark.parametrize("text", list(texts()))
def test_every_prefix_of_a_json_object_is_accepted_and_only_the_whole_is_done(text):
    data = text.encode()
    s = jsonmode.JsonPrefix()
    for i, b in enumerate(data):
        assert s.feed(bytes([b])), (text, i, data[:i + 1])
        assert s.done == (i == len(data) - 1), (text, i)
    assert not s.copy().feed(b" ") and not s.copy().feed(b"{")  # nothing follows the object


@pytest.mark.parametrize("text", ['[1]', '"s"', '1', 'x', '{"a":01}', '{"a":1,}', '{,}', '{"a" 1}', '{"a":tru}',
                                  '{"a":"\x01"}', '{"a":"\\x"}', '{"a":1}}', '{"a":-}', '{"a":1.}', '{"a":1e}',
                                  '{"a":[1,]}', '{"a":[1}', '{"a":{]}', "{'a':1}", '{"a":nul}', '{"a":"\\u12g4"}',
                                  '{"a":.5}', '{"a":+1}', '{a:1}', '{"a":1 2}'])
def test_what_no_json_object_starts_with_is_refused(text):
    s = jsonmode.JsonPrefix()
    assert not (s.feed(text.encode()) and s.done)
    assert not _is_object(text)


def _mutated(rng: random.Random, text: str, alphabet: str) -> str:
    """text after 1 to 3 random deletions, insertions or replacements from alphabet (no trailing whitespace)."""
    chars = list(text)
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(chars) + 1)
        op = rng.random()
        if op < 0.4 and chars:
            del chars[min(at, len(chars) - 1)]
        elif op < 0.8:
            chars.insert(at, rng.choice(alphabet))
        elif chars:
            chars[min(at, len(chars) - 1)] = rng.choice(alphabet)
    return "".join(chars).rstrip()


def test_agrees_with_the_json_module_on_mutated_texts():
    """A text is accepted whole and done exactly when json.loads reads it as an object (no trailing
    whitespace: the automaton stops at the object's end)."""
    rng = random.Random(0)
    alphabet = '{}[]",:.-+eE0123456789 \\tuabfnrlsx\n'
    seen = [0, 0]
    for _ in range(20000):
        text = _mutated(rng, rng.choice(list(texts())).strip(), alphabet)
        ok = _is_object(text)
        s = jsonmode.JsonPrefix()
        assert (s.feed(text.encode()) and s.done) == ok, text
        seen[ok] += 1
    assert min(seen) > 1000, seen  # both outcomes were exercised


@pytest.mark.parametrize("data, at", [(b'{"a":"\x80"}', 6), (b'{"a":"\xc3"}', 7), (b'{"a":"\xc0\xaf"}', 6),
                                      (b'{"a":"\xe0\x9f\xbf"}', 7), (b'{"a":"\xed\xa0\x80"}', 7),
                                      (b'{"a":"\xf0\x8f\xbf\xbf"}', 7), (b'{"a":"\xf4\x90\x80\x80"}', 7),
                                      (b'{"a":"\xf5\x80\x80\x80"}', 6), (b'{"a":"\xff"}', 6), (b'{"\xe2\x82":1}', 4),
                                      (b'{"a":"\xc3\xa9\xa9"}', 8)])
def test_strings_are_well_formed_utf8(data, at):
    """A stray continuation byte, a character cut short, overlong forms, surrogates, code points past U+10FFFF
    and bytes no UTF-8 has are refused, in values and keys, at their first byte that cannot be UTF-8."""
    with pytest.raises(UnicodeDecodeError):
        data.decode("utf-8")
    assert jsonmode.JsonPrefix().feed(data[:at])
    assert not jsonmode.JsonPrefix().feed(data[:at + 1])


def test_agrees_with_strict_utf8_and_the_json_module_on_mutated_bytes():
    """Texts with 2-, 3- and 4-byte characters, mutated byte by byte with lead, continuation and invalid bytes:
    accepted whole and done exactly when they decode as UTF-8 and json.loads reads an object."""
    rng = random.Random(1)
    sources = [json.dumps(o, ensure_ascii=False).encode() for o in
               ({"é": "\u20ac 漢字 😀 ß", "k": ["ü", "\U0010ffff"]}, {"a": "\ud7ff\ue000\U00010000 ÿ"})]
    alphabet = [bytes([b]) for b in (0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC2, 0xDF, 0xE0, 0xE2, 0xED, 0xEF,
                                     0xF0, 0xF4, 0xF5, 0xFF)] + [b'"', b"a", b"}"]
    seen = [0, 0]
    for _ in range(20000):
        data = bytearray(rng.choice(sources))
        for _ in range(rng.randint(1, 2)):
            at, op = rng.randrange(len(data)), rng.random()
            if op < 0.3:
                del data[at]
            elif op < 0.7:
                data[at:at] = rng.choice(alphabet)
            else:
                data[at:at + 1] = rng.choice(alphabet)
        try:
            ok = _is_object(bytes(data).decode("utf-8"))
        except UnicodeDecodeError:
            ok = False
        s = jsonmode.JsonPrefix()
        assert (s.feed(bytes(data)) and s.done) == ok, bytes(data)
        seen[ok] += 1
    assert min(seen) > 1000, seen


def test_allowed_lists_exactly_the_tokens_that_keep_a_prefix():
    """jsonmode.allowed's walk over the sorted vocabulary equals trying every token, at every third prefix of
    object texts and schema instances, over a vocabulary of all single bytes, pieces cut from the texts
    (structure, keys, escapes, UTF-8 characters and halves of them) and random strings."""
    rng = random.Random(3)
    plain, instances = [t.encode() for t in texts()], [t.encode() for t in dumped(VALID)]
    sources = plain + instances
    pieces = {bytes([b]) for b in range(256)}
    for data in sources:
        for _ in range(40):
            at = rng.randrange(len(data))
            pieces.add(data[at:at + rng.randint(2, 6)])
    alphabet = b'{}[]":, \n0123456789aetrufl\\\xc3\xa9'
    pieces |= {bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(300)}
    vocab_bytes = [None, b""] + sorted(pieces)
    vocab = jsonmode.Vocabulary.of(vocab_bytes)
    checked = 0
    for root, data in [(jsonmode.OBJECT, t) for t in plain] + [(jsonmode.object_schema(SCHEMA), t) for t in instances]:
        s = jsonmode.JsonPrefix(root)
        for i in range(len(data)):
            if i % 3 == 0:
                want = {t for t, b in enumerate(vocab_bytes) if b and s.copy().feed(b)}
                assert set(jsonmode.allowed(s, vocab)) == want, data[:i]
                checked += 1
            assert s.feed(data[i:i + 1])
    assert checked > 200, checked


def test_a_copy_shares_no_state_with_its_original():
    """copy (field by field) gives the copy its own frames, keys had and unique items seen."""
    s = jsonmode.JsonPrefix(jsonmode.compile_schema(UNIQUE))
    assert s.feed(b'{"tags": ["a", ')
    c = s.copy()
    assert c.feed(b'"b"], "ns": [1') and not c.copy().feed(b", 1,")
    assert s.stack[-1].seen == {("string", "a")} and s.stack[0].used == {b"tags"} and len(s.stack) == 2
    assert s.feed(b'"b", "c"], "ns": [1, 2]}') and s.done and not c.done


def test_pick_takes_the_first_token_in_race_order_that_keeps_a_prefix():
    vocab = [b"{", b"}", b'"a"', b":", b"1", None, b"", b"]", b' {"b": 2}']
    s = jsonmode.JsonPrefix()
    assert jsonmode.pick([1, 7, 5, 6, 0, 2], s, vocab) == 0  # "}" and "]" cannot start; no bytes never counts
    assert s.feed(b"{") and jsonmode.pick([0, 4, 2, 1], s, vocab) == 2
    assert jsonmode.pick([4, 3], s, vocab) is None
    assert jsonmode.pick([8], jsonmode.JsonPrefix(), vocab) == 8  # a token may hold a whole object


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"], "properties": {
    "name": {"type": "string", "description": "who"}, "age": {"type": "integer"}, "score": {"type": "number"},
    "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}},
    "kind": {"enum": ["cat", "dog", None]},
    "owner": {"type": ["object", "null"], "properties": {"id": {"type": "integer"}}, "required": ["id"],
              "additionalProperties": False},
    "meta": {"type": "object"}}}
VALID = [{"name": "Rex", "age": 3}, {"age": -1, "name": "", "score": 2.5e-3, "ok": False, "tags": [], "kind": None},
         {"name": "a\"b", "age": 0, "tags": ["x", "y z"], "kind": "cat", "owner": {"id": 7}, "meta": {"any": [1, {}]}},
         {"name": "Tom", "age": 12, "owner": None, "score": -4, "kind": "dog", "ok": True}]


# A bounded-number schema for the new keywords: integer and number bounds (inclusive and exclusive), string
# lengths, array lengths (maxItems 0 too) and an enum of numbers, one a prefix of another (1 and 12).
BOUNDED = {"type": "object", "additionalProperties": False, "required": ["n"], "properties": {
    "n": {"type": "integer", "minimum": -5, "exclusiveMaximum": 120},
    "x": {"type": "number", "exclusiveMinimum": 0, "maximum": 2.5},
    "s": {"type": "string", "minLength": 2, "maxLength": 4},
    "l": {"type": "array", "items": {"enum": [1, 12, 2.5, "a"]}, "minItems": 1, "maxItems": 3},
    "e": {"type": "array", "maxItems": 0},
    "m": {"type": "number", "multipleOf": 0.25, "maximum": 3}, "k": {"type": "integer", "multipleOf": 15},
    "t": {"type": "array", "prefixItems": [{"type": "integer"}, {"enum": ["a", "b"]}], "items": False, "minItems": 1},
    "u": {"type": "array", "prefixItems": [{"type": "boolean"}], "items": {"type": "string"}, "maxItems": 3},
    "o": {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1, "maxProperties": 2},
    "r": {"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a"], "maxProperties": 2}}}
BOUNDED_VALID = [{"n": 0}, {"n": -5, "x": 2.5, "s": "ab", "l": [1]}, {"e": [], "x": 0.001, "n": 119, "s": "wxyz",
                 "l": [12, 2.5, "a"]}, {"n": 7, "s": "é中", "l": [12, 1]}, {"n": -0, "x": 1.25, "s": "\t\"x"},
                 {"n": 1, "m": 2.75, "k": -45}, {"m": -10, "k": 0, "n": 2}, {"k": 150, "n": 3, "m": 3},
                 {"n": 4, "t": [5], "u": []}, {"t": [-1, "b"], "u": [False, "x", "y"], "n": 5}, {"u": [True], "n": 6},
                 {"n": 8, "o": {"x": 1}, "r": {"a": 1}}, {"n": 9, "o": {"x": 1, "y": 2}, "r": {"q": 1, "a": None}}]


# Patterns and formats: matched on the decoded characters (escapes and UTF-8 alike).
PATTERNED = {"type": "object", "additionalProperties": False, "required": ["code"], "properties": {
    "code": {"type": "string", "pattern": "^[A-Z]{2}\\d{2}$"}, "word": {"type": "string", "pattern": "é+"},
    "day": {"type": "string", "format": "date"}, "at": {"type": "string", "format": "date-time"},
    "id": {"type": "string", "format": "uuid"},
    "ip": {"anyOf": [{"type": "string", "format": "ipv4"}, {"type": "null"}]},
    "slug": {"type": "string", "pattern": "^[a-z]+(-[a-z]+)*$", "minLength": 3, "maxLength": 8},
    "mail": {"type": "string", "format": "email"}, "url": {"type": "string", "format": "uri", "maxLength": 40},
    "wait": {"type": "string", "format": "duration"}}}
PATTERNED_VALID = [{"code": "AB12"}, {"code": "ZZ00", "word": "xéy", "day": "2024-02-29", "ip": None},
                   {"at": "1999-12-31T23:59:59.123456+05:30", "code": "QQ99",
                    "id": "123e4567-e89b-12d3-a456-426614174000", "ip": "255.0.10.1", "word": "\u00e9"},
                   {"code": "AA11", "day": "0001-01-01", "at": "2000-02-29T00:00:00Z"},
                   {"code": "AB12", "slug": "ab-cd", "mail": "a@b.co", "url": "https://x.org/a?b#c", "wait": "PT5M"},
                   {"wait": "P1W", "slug": "abc", "code": "CD34", "url": "a:b"}]


class Num(Fraction):
    """A number with the text it was written as (`loads`): the automaton reads a number's text exactly, matches
    an enum's numbers as json.dumps writes them, and takes no exponent in a bounded number."""
    text: str


def _num(text: str) -> Num:
    n = Num(text)
    n.text = text
    return n


def loads(text: str):
    return json.loads(text, object_pairs_hook=_unique, parse_int=_num, parse_float=_num)


def _valid(v, s, defs: dict | None = None) -> bool:
    """The schema subset's meaning, stated plainly (Python's bool is an int: types are told apart first)."""
    if s is True or s == {}:
        return True
    if "$ref" in s:
        return _valid(v, defs[s["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in s:
        return any(_valid(v, a, defs) for a in s["anyOf"])
    if "oneOf" in s:
        return sum(_valid(v, a, defs) for a in s["oneOf"]) == 1
    if "enum" in s or "const" in s:
        return any(v.text == json.dumps(e) if isinstance(v, Num) else type(v) is type(e) and v == e
                   for e in s.get("enum", [s.get("const")]))
    if isinstance(v, Num):
        kind = "number" if any(c in v.text for c in ".eE") else "integer"
    else:
        kind = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}[type(v)]
    types = s.get("type", list(jsonmode.TYPES))
    types = [types] if isinstance(types, str) else types
    if not (kind in types or kind == "integer" and "number" in types):
        return False
    if kind == "object":
        props, extra = s.get("properties", {}), s.get("additionalProperties", True)
        if "propertyNames" in s and not all(_valid(k, s["propertyNames"], defs) for k in v):
            return False
        return set(s.get("required", [])) <= set(v) and s.get("minProperties", 0) <= len(v) <= s.get(
            "maxProperties", len(v)) and all(
            _valid(x, props[k], defs) if k in props else extra is not False and _valid(x, extra, defs)
            for k, x in v.items())
    if kind == "array" and s.get("uniqueItems") and len({_scalar(x) for x in v}) < len(v):
        return False
    if kind == "array":
        firsts = s.get("prefixItems", [])
        return s.get("minItems", 0) <= len(v) <= s.get("maxItems", len(v)) and all(
            _valid(x, firsts[i], defs) if i < len(firsts) else s.get("items", True) is not False
            and _valid(x, s.get("items", True), defs) for i, x in enumerate(v))
    if kind == "string" and ("minLength" in s or "maxLength" in s) and not (  # (no surrogates escaped in them)
            s.get("minLength", 0) <= len(v) <= s.get("maxLength", len(v))
            and not any(0xD800 <= ord(c) <= 0xDFFF for c in v)):
        return False
    bounds = [(k, Fraction(repr(s[k]))) for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
              if k in s]
    if kind == "string" and ("pattern" in s or "format" in s):  # formats as Python reads them, patterns as re
        return _formatted(v, s["format"]) if "format" in s else \
            re.search(re.sub(r"\$$", r"\\Z", s["pattern"]), v, re.ASCII) is not None
    if kind in ("integer", "number") and (bounds or "multipleOf" in s):
        return not any(c in v.text for c in "eE") and all(
            {"minimum": v >= b, "exclusiveMinimum": v > b, "maximum": v <= b, "exclusiveMaximum": v < b}[k]
            for k, b in bounds) and ("multipleOf" not in s or (v / Fraction(repr(s["multipleOf"]))).denominator == 1)
    return True


def _scalar(v) -> tuple:
    """A scalar as JSON compares them: numbers by value, whatever their text."""
    return ("number", Fraction(v)) if isinstance(v, Num) else (type(v).__name__, v)


def _formatted(v: str, name: str) -> bool:
    if name in PLAIN_FORMATS:
        return PLAIN_FORMATS[name](v)
    read = {"date": datetime.date.fromisoformat, "date-time": datetime.datetime.fromisoformat, "uuid": uuid.UUID,
            "ipv4": ipaddress.IPv4Address}[name]
    try:
        read(v)
    except ValueError:
        return False
    # Python reads more than the format (other separators, no offset, 7+ digits): the format's own shape too
    return pattern_of(name).test(v)


def _hostname(v: str, least: int = 1) -> bool:
    """RFC 1123 2.1 read plainly: `least` or more dot-separated labels of 1-63 letters, digits and hyphens, no
    hyphen first or last."""
    labels = v.split(".")
    return len(labels) >= least and all(
        0 < len(x) <= 63 and x[0] != "-" != x[-1] and all(c.isascii() and (c.isalnum() or c == "-") for c in x)
        for x in labels)


ATEXT = frozenset(string.ascii_letters + string.digits + "!#$%&'*+/=?^_`{|}~-")
UNRESERVED = frozenset(string.ascii_letters + string.digits + "-._~")
SUB_DELIMS = frozenset("!$&'()*+,;=")
PCHAR = UNRESERVED | SUB_DELIMS | {":", "@"}


def _email(v: str) -> bool:
    """A dot-atom, "@", a domain of two or more labels (RFC 5321 4.1.2, the subset the format holds)."""
    local, at, domain = v.rpartition("@")
    return bool(at) and all(part and set(part) <= ATEXT for part in local.split(".")) and _hostname(domain, 2)


def _escaped(text: str, allowed: frozenset) -> bool:
    """Each character allowed, or a % and two hex digits."""
    return re.fullmatch(r"(?:[^%]|%[0-9A-Fa-f]{2})*", text) is not None and set(re.sub("%..", "", text)) <= allowed


def _uri(v: str) -> bool:
    """RFC 3986 4.3's absolute URI read part by part (with the format's host and port: see jsonmode.FORMATS)."""
    scheme, colon, rest = v.partition(":")
    rest, _, fragment = rest.partition("#")
    rest, _, query = rest.partition("?")
    if not (colon and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme) and _escaped(query, PCHAR | {"/", "?"})
            and _escaped(fragment, PCHAR | {"/", "?"})):
        return False
    if not rest.startswith("//"):
        return _escaped(rest, PCHAR | {"/"})
    authority, slash, path = rest[2:].partition("/")
    userinfo, at, host_port = authority.rpartition("@")
    host, _, port = host_port.partition(":")
    port_ok = port == "" or port.isdigit() and int(port) <= 65535 and str(int(port)) == port
    return (_escaped(userinfo, UNRESERVED | SUB_DELIMS | {":"}) and host != ""
            and _escaped(host, UNRESERVED | SUB_DELIMS) and port_ok and _escaped(slash + path, PCHAR | {"/"}))


def _duration(v: str) -> bool:
    """RFC 3339 appendix A read plainly: P, then weeks alone, or date units then T and time units (not both
    empty, no T with nothing after it), each a run of numbers with units in a row of Y M D / H M S."""
    def units(text: str, order: str) -> bool:
        parts = re.findall(r"(\d+)([A-Z])", text)
        return "".join(n + u for n, u in parts) == text and "".join(u for _, u in parts) in order

    date, t, time = v[1:].partition("T")
    return v.startswith("P") and (re.fullmatch(r"\d+W", v[1:]) is not None or (
        (date or time) != "" and not (t and not time) and units(date, "YMD") and units(time, "HMS")))


def _ipv6(v: str) -> bool:
    try:
        ipaddress.IPv6Address(v)
    except ValueError:
        return False
    return "%" not in v  # (a zone is no part of the format)


PLAIN_FORMATS = {"hostname": lambda v: len(v) <= 253 and _hostname(v), "email": _email, "uri": _uri,
                 "duration": _duration, "ipv6": _ipv6}
FORMAT_SEEDS = {
    "hostname": (["a", "example.com", "a-b.c-d.e9", "x" * 63 + ".com", ".".join(["abcdefghi"] * 25) + ".abc",
                  ".".join(["abcdefghi"] * 25) + ".abcd"], "ab-.0Z_"),
    "email": (["a@b.co", "john.doe+x@mail.example.com", "!#$%&'*+/=?^_`{|}~-@x-y.z"], "ab.@-+_0%"),
    "uri": (["ftp://ftp.is.co.za/rfc/rfc1808.txt", "http://www.ietf.org/rfc/rfc2396.txt",
             "mailto:John.Doe@example.com", "news:comp.infosystems.www.servers.unix", "tel:+1-816-555-1212",
             "telnet://192.0.2.16:80/", "urn:oasis:names:specification:docbook:dtd:xml:4.1.2",
             "https://u:p@x.org:65535/a%20b/?q=1&r=/?#frag/?"], "ab:/?#@%.0F5-_~![]= "),
    "duration": (["P1D", "PT1H", "P1Y2M3DT4H5M6S", "P2W", "PT10M", "P3M4DT5S"], "P0123TYMWDHS"),
    "ipv6": (["::", "::1", "1::", "fe80::1:2", "2001:db8::ff00:42:8329", "1:2:3:4:5:6:7:8", "::ffff:192.0.2.128",
              "1:2:3:4:5:6:1.2.3.4", "a:b::c:d:1.2.3.4", "1:2:3:4:5:6:7::"], "0123456789abcdefABCDEF:.%g")}


@pytest.mark.parametrize("name", sorted(FORMAT_SEEDS))
def test_a_format_takes_what_its_rfc_read_plainly_takes(name):
    """Mutated instances of each format, as a string's value: taken exactly where the format's plain reading
    (PLAIN_FORMATS) takes them; the closing quote as well (hostname's 253 characters are a length it holds)."""
    seeds, alphabet = FORMAT_SEEDS[name]
    node = jsonmode.compile_schema({"type": "object", "properties": {"v": {"type": "string", "format": name}}})
    rng = random.Random(3)
    seen = [0, 0]
    assert all(PLAIN_FORMATS[name](v) for v in seeds[:-1])
    for _ in range(2000):
        v = _mutated(rng, rng.choice(seeds), alphabet)
        ok = PLAIN_FORMATS[name](v)
        s = jsonmode.JsonPrefix(node)
        assert (s.feed(b'{"v": "' + v.encode() + b'"}') and s.done) == ok, v
        seen[ok] += 1
    assert min(seen) > 100, seen


def test_durations_and_uris_the_formats_take_are_what_pydantic_reads():
    """Every duration and every URI with an authority ("scheme://") the format takes among mutated instances,
    read by pydantic (timedelta, AnyUrl): a model's answer with such a field validates. (pydantic reads URLs as
    WHATWG does, where http, ftp and a few other schemes must have an authority: RFC 3986's `ftp:x` is not one.)"""
    pydantic = pytest.importorskip("pydantic")
    rng = random.Random(4)
    for name, kind in (("duration", datetime.timedelta), ("uri", pydantic.AnyUrl)):
        seeds, alphabet = FORMAT_SEEDS[name]
        read, form = pydantic.TypeAdapter(kind), pattern_of(name)
        taken = {v for v in (_mutated(rng, rng.choice(seeds), alphabet) for _ in range(1500))
                 if form.test(v) and (name == "duration" or re.match(r"[^:/?#]+://", v))}
        for v in sorted(taken):
            read.validate_python(v)
        assert len(taken) > 50, (name, len(taken))


def pattern_of(name: str) -> pattern.Pattern:
    return pattern.Pattern(jsonmode.FORMATS[name])


def dumped(values: list) -> list[str]:
    """Each value as JSON three ways: spaced, compact, indented."""
    return [t for v in values for t in (json.dumps(v), json.dumps(v, separators=(",", ":")), json.dumps(v, indent=1))]


INSTANCES = {id(SCHEMA): VALID, id(BOUNDED): BOUNDED_VALID, id(PATTERNED): PATTERNED_VALID}


@pytest.mark.parametrize("schema, text", [(schema, t) for schema in (SCHEMA, BOUNDED, PATTERNED)
                                          for t in dumped(INSTANCES[id(schema)])])
def test_a_schemas_instances_are_accepted_prefix_by_prefix(schema, text):
    assert all(_valid(loads(t), schema) for t in dumped(INSTANCES[id(schema)]))
    s = jsonmode.JsonPrefix(jsonmode.compile_schema(schema))
    for i, b in enumerate(text.encode()):
        assert s.feed(bytes([b])), (text, text[:i + 1])
        assert s.done == (i == len(text) - 1)


@pytest.mark.parametrize("text, refused_at", [
    ('{"nam":', '{"nam"'), ('{"nickname"', '{"ni'), ('{"name": 3', '{"name": 3'), ('{"name": "x"}', '{"name": "x"}'),
    ('{"name": "x", "age": 1.5', '{"name": "x", "age": 1.'), ('{"age": 1, "kind": "cow"', '{"age": 1, "kind": "co'),
    ('{"age": 1, "age": 2', '{"age": 1, "a'), ('{"age": 1, "owner": {}', '{"age": 1, "owner": {}'),
    ('{"age": 1, "tags": [1', '{"age": 1, "tags": [1'), ('{"age": 1, "ok": null', '{"age": 1, "ok": n'),
    ('{"age": 1, "owner": {"id": 1, "x"', '{"age": 1, "owner": {"id": 1,')])
def test_what_a_schema_forbids_is_refused_at_its_first_byte(text, refused_at):
    s = jsonmode.JsonPrefix(jsonmode.compile_schema(SCHEMA))
    ok = [s.copy().feed(text[:i].encode()) for i in range(len(text) + 1)]
    assert ok.index(False) == len(refused_at), (text, ok)


@pytest.mark.parametrize("bounds, integer", [
    ({"minimum": 20, "maximum": 20}, True), ({"minimum": -5, "exclusiveMaximum": 120}, True),
    ({"exclusiveMinimum": -31, "maximum": -7}, True), ({"minimum": 0}, True), ({"maximum": 3}, True),
    ({"minimum": 1, "maximum": 5}, True),
    ({"exclusiveMinimum": 0, "maximum": 2.5}, False), ({"minimum": -1.5, "exclusiveMaximum": 0.5}, False),
    ({"minimum": 10}, False), ({"minimum": 0.25, "maximum": 0.25}, False),
    ({"multipleOf": 7}, True), ({"multipleOf": 2.5}, True),
    ({"multipleOf": 3, "minimum": 4, "exclusiveMaximum": 201}, True),
    ({"multipleOf": 0.25, "minimum": -999, "maximum": 999}, False),
    ({"multipleOf": 2.5, "minimum": -10, "maximum": 40}, False),
    ({"multipleOf": 0.05, "exclusiveMinimum": 0, "maximum": 1}, False),
    ({"multipleOf": 30, "minimum": -990, "maximum": 100}, False)])
def test_a_range_reaches_what_some_continuation_ends_in(bounds, integer):
    """Range.reachable against brute force: a number prefix of up to 3 characters is reachable exactly when some
    number text that starts with it (up to 3 integer digits, up to 2 fraction digits; an integer up to 4 digits)
    has a value in range (and a multiple of multipleOf), as the plain statement reads it."""
    schema = {"type": "integer" if integer else "number", **bounds}
    r = jsonmode.compile_schema(schema).range
    texts = [f"{sign}{i}{frac}" for sign in ("", "-") for i in range(10000 if integer else 1000)
             for frac in ([""] if integer else [""] + [f".{f}" for f in range(10)] + [f".{f:02}" for f in range(100)])]
    inside = {t for t in texts if r.holds(Fraction(t))}
    assert inside and all(_valid(loads(t), schema) == (t in inside) for t in [*inside, *texts[::11]])
    reached = {t[:n] for t in inside for n in range(1, 4)}
    for prefix in {t[:n] for t in texts for n in range(1, 4)}:
        assert r.reachable(prefix, integer) == (prefix in reached), (bounds, prefix)


@pytest.mark.parametrize("text", [
    '{"n": 120', '{"n": -6', '{"n": 1e', '{"n": 7.', '{"n": 0, "x": 0,', '{"n": 0, "x": -', '{"n": 0, "x": 2.6',
    '{"n": 0, "x": 3', '{"n": 0, "x": 1e', '{"n": 0, "x": 0.0}', '{"n": 0, "s": "a"', '{"n": 0, "s": "abcde',
    '{"n": 0, "s": "\\ud8', '{"n": 0, "l": []', '{"n": 0, "l": [1, 1, 1,', '{"n": 0, "l": [13',
    '{"n": 0, "l": [2.50', '{"n": 0, "l": [1.', '{"n": 0, "e": [1', '{"x": 1}', '{"n": 0, "m": 0.3',
    '{"n": 0, "m": 3.1', '{"n": 0, "m": 1e', '{"n": 0, "m": 0.755', '{"n": 0, "k": 7}', '{"n": 0, "k": 1.',
    '{"n": 0, "t": []', '{"n": 0, "t": [1, "a",', '{"n": 0, "t": ["', '{"n": 0, "u": [true, 1',
    '{"n": 0, "u": [true, "x", "y",', '{"n": 0, "o": {}', '{"n": 0, "o": {"x": 1, "y": 2,', '{"n": 0, "r": {"q": 1, "z',
    '{"n": 0, "r": {"b": 1, "q', '{"n": 0, "r": {"b": 1, "a": 2,'])
def test_bounds_lengths_and_number_enums_are_refused_at_their_first_byte(text):
    """BOUNDED: each text's last byte is the first refused. An integer's bounds as soon as no continuation can
    meet them (120 past 119, -6 below -5), a number's exclusive bound at its end (0), a bounded number's
    exponent, string and array lengths (a quote before minLength, a comma at maxItems), an escaped surrogate
    where the length is counted, number enums matched as written (2.50 is not 2.5, 1. no option); a multiple's
    digits as soon as no continuation is one (0.3 of quarters, 3.1 past 3, 0.755), an integer's at its end; a
    tuple's items by place (none past a closed one's, an item after the prefix of its items' node); an
    object's count of properties (a close before minProperties, a comma at maxProperties, a key other than a
    missing required one where only those fit)."""
    s = jsonmode.JsonPrefix(jsonmode.compile_schema(BOUNDED))
    assert s.copy().feed(text[:-1].encode()) and not s.copy().feed(text.encode())


@pytest.mark.parametrize("source, low, high", [
    ("^(ab)*$", 3, None), ("^(ab)*$", 0, 5), ("b", 2, 4), ("^a+b?$", 0, 3), ("^(?:a|bb)+$", 4, 5), ("a$", 5, None),
    ("^[ab]{2,3}(?:\\.b)?$", 0, 4), ("^.*$", 1, 1)])
def test_a_length_bounds_a_pattern_exactly(source, low, high):
    """A pattern under minLength / maxLength: a string prefix (up to 5 characters over a, b, .) is taken exactly
    when some string that starts with it (up to 8 characters) matches and has a length in range, against
    Python's re; the closing quote exactly when the string itself does."""
    bounds = {"minLength": low} | ({"maxLength": high} if high is not None else {})
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": source, **bounds}}}
    node = jsonmode.compile_schema(schema)
    strings = ["".join(t) for n in range(9) for t in itertools.product("ab.", repeat=n)]
    inside = [t for t in strings if _valid({"s": t}, schema)]
    assert inside and all(re.search(source, t) and low <= len(t) <= (high or 99) for t in inside)
    for prefix in (t for t in strings if len(t) <= 5):
        fits = any(t.startswith(prefix) for t in inside)
        s = jsonmode.JsonPrefix(node)
        assert s.feed(b'{"s": "' + prefix.encode()) == fits, (source, prefix)
        if fits:
            assert s.feed(b'"') == (prefix in inside), (source, prefix)


@pytest.mark.parametrize("text", [
    '{"code": "a', '{"code": "AB1"', '{"code": "AB123', '{"code": "AB12", "word": "x"',
    '{"code": "AB12", "day": "2023-02-29', '{"code": "AB12", "day": "1900-02-29', '{"code": "AB12", "day": "0000',
    '{"code": "AB12", "day": "2024-04-31', '{"code": "AB12", "day": "2024-13', '{"code": "AB12", "at": "2024-01-01 ',
    '{"code": "AB12", "at": "2024-01-01T24', '{"code": "AB12", "at": "2024-01-01T00:00:00.1234567',
    '{"code": "AB12", "at": "2024-01-01T00:00:00z', '{"code": "AB12", "id": "123e4567-e89b-12d3-a456-42661417400g',
    '{"code": "AB12", "ip": "256', '{"code": "AB12", "ip": "1.2.3.4.', '{"code": "AB12", "word": "\\ud8',
    '{"code": "AB12", "day": "â',
    '{"code": "\\u0041\\u006'])
def test_patterns_and_formats_are_refused_at_their_first_character(text):
    """PATTERNED: each text's last byte is the first refused. A pattern's character where no continuation
    matches, its closing quote before a match; dates that do not exist (Feb 29 of 2023 and 1900, year 0, April
    31, month 13), an hour 24, a space for T, 7 fraction digits, a lower-case z, a UUID's non-hex digit, an
    IPv4 octet over 255 or a fifth one, an escaped surrogate, a UTF-8 lead byte of no digit (at its first byte);
    escapes match what they decode to, as soon as
    their hex digits rule out every character that would match (\\u006_ is no capital)."""
    s = jsonmode.JsonPrefix(jsonmode.compile_schema(PATTERNED))
    assert s.copy().feed(text[:-1].encode()) and not s.copy().feed(text.encode())


@pytest.mark.parametrize("schema, text, ok", [
    ({"type": "integer", "format": "int32"}, "2147483647", True),
    ({"type": "integer", "format": "int32"}, "2147483648", False),
    ({"type": "integer", "format": "int32"}, "-2147483648", True),
    ({"type": "integer", "format": "int32"}, "-2147483649", False),
    ({"type": "integer", "format": "int64", "minimum": 0}, "9223372036854775807", True),
    ({"type": "integer", "format": "int64", "minimum": 0}, "9223372036854775808", False),
    ({"type": "integer", "format": "int64", "minimum": 0}, "-1", False),
    ({"type": "number", "format": "double"}, "1e300", True), ({"type": "number", "format": "float"}, "-0.5", True),
    ({"type": "string", "format": "password", "writeOnly": True}, '"x y"', True),
    ({"type": "string", "format": "binary"}, '"\\u0000"', True), ({"type": "string", "format": "binary"}, "1", False),
    ({"type": "string", "format": "path"}, '"/a b/../c"', True)])
def test_open_formats_bound_no_string_and_integer_formats_bound_their_bits(schema, text, ok):
    """OpenAPI's int32 / int64 are integers of that many bits; float, double, password (pydantic's SecretStr),
    binary (its bytes) and path (its Path) leave a value as its type has it."""
    s = jsonmode.JsonPrefix(jsonmode.compile_schema({"type": "object", "properties": {"v": schema}}))
    assert (s.feed(b'{"v": ' + text.encode() + b"}") and s.done) == ok


def test_formats_accept_only_what_python_reads():
    """date: every day of months 0-13 x days 0-32 in ten years (leap or not: 4, 100, 400, 1900, 2000, 2023,
    2024...) exactly as datetime.date.fromisoformat reads them; date-time: what the format takes of some times,
    fractions and offsets, datetime.fromisoformat reads (it reads more: other separators, no offset)."""
    for year in (1, 4, 100, 400, 1900, 2000, 2023, 2024, 2100, 9999):
        for month in range(0, 14):
            for day in range(0, 33):
                text = f"{year:04}-{month:02}-{day:02}"
                try:
                    datetime.date.fromisoformat(text)
                    ok = True
                except ValueError:
                    ok = False
                assert pattern_of("date").test(text) == ok, text
    taken = 0
    for t in ("00:00:00Z", "23:59:59.5+14:00", "12:30:00.123456-05:30", "24:00:00Z", "12:60:00Z", "12:00:61Z",
              "12:00:00", "12:00:00.Z", "12:00:00+5:00", "12:00:00.1234567Z"):
        text = "2024-02-29T" + t
        if pattern_of("date-time").test(text):
            datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
            taken += 1
    assert taken == 3


@pytest.mark.parametrize("which", ["SCHEMA", "PET", "BOUNDED", "PATTERNED", "UNION", "TREE", "ONE_OF", "UNIQUE"])
def test_a_schema_agrees_with_its_plain_statement_on_mutated_instances(which):
    schema, instances = {"SCHEMA": (SCHEMA, VALID), "PET": (PET, PETS), "BOUNDED": (BOUNDED, BOUNDED_VALID),
                         "PATTERNED": (PATTERNED, PATTERNED_VALID), "UNION": (UNION, UNION_VALID),
                         "TREE": (TREE, TREE_VALID), "ONE_OF": (ONE_OF, ONE_OF_VALID),
                         "UNIQUE": (UNIQUE, UNIQUE_VALID)}[which]
    rng = random.Random(1)
    node = jsonmode.compile_schema(schema)
    texts = dumped(instances)
    alphabet = '{}[]",:.-+eE0123456789 \\tuabfnrlsx\nacdegimnorty'
    seen = [0, 0]
    for _ in range(20000):
        text = _mutated(rng, rng.choice(texts), alphabet)
        try:
            ok = _valid(loads(text), schema, schema.get("$defs"))
        except ValueError:
            ok = False
        s = jsonmode.JsonPrefix(node)
        assert (s.feed(text.encode()) and s.done) == ok, text
        seen[ok] += 1
    assert min(seen) > 500, seen


@pytest.mark.parametrize("schema, path, words", [
    ({"type": "object", "properties": {"x": {"type": "string", "pattern": "(?=a)"}}}, "properties.x.pattern",
     "lookaround"),
    ({"type": "string", "format": "idn-email"}, "format", "not supported"),
    ({"type": "string", "pattern": "a", "format": "date"}, "", "one of them at a time"),
    ({"type": "string", "pattern": "^(ab)+$", "minLength": 3, "maxLength": 3}, "", "no string of 3 to 3"),
    ({"type": "string", "format": "date", "maxLength": 9}, "", "matches the format"),
    ({"type": "object", "required": ["y"]}, "", "required"),
    ({"type": "array", "items": {"enum": [[1]]}}, "items", "enum"), ({"const": {"a": 1}}, "", "enum"),
    ({"type": "integer", "multipleOf": 0}, "multipleOf", "greater than 0"),
    ({"type": "array", "prefixItems": [{}], "items": False, "minItems": 2}, "minItems", "allow 1"),
    ({"type": "integer", "format": "int32", "minimum": 2 ** 40}, "", "no integer meets"),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames", "enum or const of strings"),
    ({"type": "object", "properties": {"a": {}}, "required": ["a"], "propertyNames": {"enum": ["b"]}},
     "propertyNames", "required ['a']"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a", "b"], "maxProperties": 1},
     "maxProperties", "fewer than the 2 required"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": False, "minProperties": 2}, "minProperties",
     "more than the 1"),
    ({"type": "array", "prefixItems": {"type": "string"}}, "prefixItems", "list of schemas"),
    ({"type": "array", "items": {"type": "string", "maxLength": 3}, "uniqueItems": True}, "uniqueItems", "held over"),
    ({"type": "array", "items": {"type": "object"}, "uniqueItems": True}, "uniqueItems", "held over"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems", "held over"),
    ({"type": "array", "items": {"type": "boolean"}, "uniqueItems": True, "minItems": 3}, "minItems", "of 2 values"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": 1}, "uniqueItems", "boolean"),
    ({"type": "integer", "multipleOf": 7, "minimum": 1, "maximum": 6}, "", "no integer meets"),
    ({"type": "number", "multipleOf": 0.5, "exclusiveMinimum": 1, "exclusiveMaximum": 1.5}, "", "no number meets"),
    ({"type": "string", "minLength": -1}, "minLength", ">= 0"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "maxItems", "minItems <= maxItems"),
    ({"type": "integer", "minimum": 0.5, "maximum": 0.7}, "", "no integer meets"),
    ({"type": "number", "minimum": 1, "exclusiveMaximum": 1}, "", "no number meets"),
    ({"type": "number", "exclusiveMinimum": True}, "exclusiveMinimum", "finite number"),
    ({"type": "date"}, "", "type"),
    ({"properties": {"a": {"$ref": "#/$defs/x"}}}, "properties.a.$ref", "$defs"),
    ({"$defs": {"N": {"type": "object", "properties": {"next": {"$ref": "#/$defs/N"}}, "required": ["next"]}},
      "type": "object", "properties": {"n": {"$ref": "#/$defs/N"}}}, "$defs.N", "requires itself"),
    ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "allOf", "one schema"),
    ({"type": "object", "properties": {"a": {"allOf": [{"type": "string", "pattern": "(?<=x)"}]}}},
     "properties.a.allOf.0.pattern", "lookaround"),
    ({"$defs": {"A": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/A"}]}}, "type": "object",
      "properties": {"a": {"$ref": "#/$defs/A"}}}, "$defs.A", "own anyOf"),
    ({"type": "object", "properties": {"n": {"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "number"}]}}},
     "properties.n.oneOf", "alternatives 1 and 2"),
    ({"oneOf": [{"enum": ["a", 1]}, {"enum": [1.0]}]}, "oneOf", "alternatives 0 and 1"),
    ({"oneOf": [{"type": "object"}, {"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]}]},
     "oneOf", "both meet"),
    ({"oneOf": [{"type": "string"}], "type": "string"}, "oneOf", "no other keyword")])
def test_what_cannot_be_enforced_is_refused_by_name(schema, path, words):
    with pytest.raises(jsonmode.SchemaError) as e:
        jsonmode.compile_schema(schema)
    assert e.value.path == path and words in str(e.value)


# what the openai client sends for a pydantic model (openai.lib._pydantic.to_strict_json_schema): $defs, $ref, and
# anyOf for Optional fields
PET = {"$defs": {"Owner": {"properties": {"id": {"title": "Id", "type": "integer"}, "tags": {
    "items": {"type": "string"}, "title": "Tags", "type": "array"}}, "required": ["id", "tags"], "title": "Owner",
    "type": "object", "additionalProperties": False}}, "properties": {"name": {"title": "Name", "type": "string"},
    "kind": {"anyOf": [{"type": "string"}, {"type": "null"}], "title": "Kind"},
    "owner": {"anyOf": [{"$ref": "#/$defs/Owner"}, {"type": "null"}]},
    "friends": {"items": {"$ref": "#/$defs/Owner"}, "title": "Friends", "type": "array"}},
    "required": ["name", "kind", "owner", "friends"], "title": "Pet", "type": "object", "additionalProperties": False}


PETS = [{"name": "Rex", "kind": None, "owner": None, "friends": []},
        {"name": "Rex", "kind": "dog", "owner": {"id": 1, "tags": ["a"]}, "friends": [{"id": 2, "tags": []}]}]


@pytest.mark.parametrize("value, ok", [
    ({"name": "Rex", "kind": None, "owner": None, "friends": []}, True),
    ({"name": "Rex", "kind": "dog", "owner": {"id": 1, "tags": ["a"]}, "friends": [{"id": 2, "tags": []}]}, True),
    ({"name": "Rex", "kind": 3, "owner": None, "friends": []}, False),
    ({"name": "Rex", "kind": None, "owner": {"id": 1}, "friends": []}, False),
    ({"name": "Rex", "kind": None, "owner": None, "friends": [None]}, False),
    ({"name": "Rex", "kind": None, "owner": None}, False)])
def test_pydantic_schemas_through_defs_refs_and_any_of(value, ok):
    text = json.dumps(value).encode()
    s = jsonmode.JsonPrefix(jsonmode.object_schema(PET))
    assert (s.feed(text) and s.done) == ok == _valid_pet(value)


@pytest.mark.parametrize("text", ['{"pair": [1, "a"], "rest": []}', '{"pair": [1, "a", 2], "rest": []}',
                                  '{"pair": [1], "rest": [1]}', '{"pair": ["1", "a"], "rest": []}',
                                  '{"rest": [1, 2, 3], "pair": [-4, ""]}', '{"pair": [1, "a"], "rest": [1, "2"]}'])
def test_pydantic_tuples_are_prefix_items(text):
    """tuple[int, str] (prefixItems, two items) and tuple[int, ...] (items): what the automaton takes is what
    pydantic reads strictly."""
    pydantic = pytest.importorskip("pydantic")

    class T(pydantic.BaseModel):
        pair: tuple[int, str]
        rest: tuple[int, ...]

    try:
        T.model_validate_json(text, strict=True)
        ok = True
    except pydantic.ValidationError:
        ok = False
    s = jsonmode.JsonPrefix(jsonmode.object_schema(T.model_json_schema()))
    assert (s.feed(text.encode()) and s.done) == ok


# anyOf whose alternatives start alike (pydantic's Union of models): read with each until the value ends
UNION = {"type": "object", "properties": {
    "pet": {"anyOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]},
    "n": {"anyOf": [{"type": "integer", "maximum": 5}, {"type": "number", "minimum": 10}, {"enum": [7, 70]}]},
    "s": {"anyOf": [{"type": "string", "maxLength": 2}, {"type": "string", "pattern": "^x+$"}, {"type": "null"}]},
    "l": {"anyOf": [{"type": "array", "items": {"type": "integer"}},
                    {"type": "array", "items": {"type": "string"}, "minItems": 1}]}},
    "required": ["pet"], "additionalProperties": False, "$defs": {
        "Cat": {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                "required": ["kind"], "additionalProperties": False},
        "Dog": {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
                "required": ["kind", "good"], "additionalProperties": False}}}
UNION_VALID = [{"pet": {"kind": "cat"}}, {"pet": {"kind": "dog", "good": True}, "n": 3, "s": "xxxx", "l": []},
               {"pet": {"lives": 9, "kind": "cat"}, "n": 12.5, "s": None, "l": ["a"]},
               {"pet": {"good": False, "kind": "dog"}, "n": 70, "s": "ab", "l": [1, 2]},
               {"n": 7, "pet": {"kind": "cat"}}]


# oneOf whose alternatives no value meets two of: pydantic's discriminated union (Field(discriminator=...)), types
# apart, a closed object beside one that requires a key it lacks
ONE_OF = {"type": "object", "properties": {
    "pet": {"discriminator": {"mapping": {"cat": "#/$defs/Cat", "dog": "#/$defs/Dog"}, "propertyName": "kind"},
            "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}], "title": "Pet"},
    "v": {"oneOf": [{"type": "string", "maxLength": 3}, {"type": "integer", "minimum": 0}, {"type": "null"}]},
    "o": {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
                    {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}]}},
    "required": ["pet"], "additionalProperties": False,
    "$defs": {"Cat": {"type": "object", "properties": {"kind": {"const": "cat", "type": "string"},
                                                       "lives": {"type": "integer"}}, "required": ["kind"],
                      "additionalProperties": False},
              "Dog": {"type": "object", "properties": {"kind": {"const": "dog", "type": "string"},
                                                       "good": {"type": "boolean"}}, "required": ["kind", "good"],
                      "additionalProperties": False}}}
ONE_OF_VALID = [{"pet": {"kind": "cat"}}, {"pet": {"kind": "dog", "good": True}, "v": "abc", "o": {}},
                {"pet": {"lives": 9, "kind": "cat"}, "v": 0, "o": {"a": 1}},
                {"o": {"b": False, "a": "x"}, "v": None, "pet": {"good": False, "kind": "dog"}}]


# uniqueItems (pydantic's sets): strings by their decoded characters, numbers by value; propertyNames of an enum
UNIQUE = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    "ns": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "xs": {"type": "array", "items": {"type": "number"}, "uniqueItems": True, "maxItems": 4},
    "e": {"type": "array", "items": {"enum": ["a", "b", 1, 12]}, "uniqueItems": True},
    "b": {"type": "array", "items": {"type": ["boolean", "null"]}, "uniqueItems": True, "minItems": 1},
    "d": {"type": "object", "additionalProperties": {"type": "integer"}, "propertyNames": {"enum": ["x", "y", "z"]},
          "properties": {"y": {"type": "string"}}}},
    "additionalProperties": False}
UNIQUE_VALID = [{}, {"tags": ["a", "b", "ab", ""], "ns": [0, 1, -1, 10], "xs": [0, 0.5, 1e3, -2.25]},
                {"e": [12, "a", 1, "b"], "b": [None, True, False]}, {"b": [False], "e": [], "tags": ["\u00e9x"]},
                {"d": {"x": 1, "y": "s", "z": 2}}, {"d": {}, "b": [True]}]


# a recursive $def (pydantic's self-referencing model)
TREE = {"$defs": {"Node": {"type": "object", "properties": {
    "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
    "next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}}, "required": ["v"],
    "additionalProperties": False}},
    "type": "object", "properties": {"root": {"$ref": "#/$defs/Node"}}, "required": ["root"],
    "additionalProperties": False}
TREE_VALID = [{"root": {"v": 1}}, {"root": {"v": 2, "kids": [{"v": 3}, {"v": 4, "kids": []}], "next": None}},
              {"root": {"next": {"v": 5, "next": {"v": 6, "kids": [{"v": 7, "next": {"v": 8}}]}}, "v": 0}}]


def test_all_of_one_schema_is_that_schema():
    node = jsonmode.object_schema({"type": "object", "properties": {"owner": {
        "allOf": [{"$ref": "#/$defs/Owner"}], "description": "who"}}, "$defs": PET["$defs"]})
    assert jsonmode.JsonPrefix(node).feed(b'{"owner": {"id": 1, "tags": []}}')
    assert not jsonmode.JsonPrefix(node).feed(b'{"owner": {"id": "1"')


def test_a_recursive_def_is_its_own_value_at_any_depth_even_as_the_root():
    rooted = jsonmode.object_schema({"$defs": TREE["$defs"], "$ref": "#/$defs/Node"})  # pydantic's form of a root
    deep = {"v": 0}
    for i in range(1, 40):  # 40 levels deep
        deep = {"v": i, "kids": [deep, {"v": -i}] if i % 2 else [], "next": None if i % 2 else deep}
    for node, value in ((rooted, deep), (jsonmode.object_schema(TREE), {"root": deep})):
        s = jsonmode.JsonPrefix(node)
        assert s.feed(json.dumps(value).encode()) and s.done
    s = jsonmode.JsonPrefix(rooted)
    assert s.feed(b'{"v": 1, "kids": [{"v": 2, "kids": [{"v": 3, "next": {') and not s.copy().feed(b"}")  # v first


@pytest.mark.parametrize("text, ok", [
    ('{"pet": {"kind": "dog"}}', False), ('{"pet": {"kind": "cat", "good": true}}', False),
    ('{"pet": {"kind": "cat"}, "n": 6}', False), ('{"pet": {"kind": "cat"}, "n": 7}', True),
    ('{"pet": {"kind": "cat"}, "n": 70}', True), ('{"pet": {"kind": "cat"}, "n": 700}', True),
    ('{"pet": {"kind": "cat"}, "n": 9.5}', False), ('{"pet": {"kind": "cat"}, "s": "abc"}', False),
    ('{"pet": {"kind": "cat"}, "l": [1, "a"]}', False), ('{"pet": {"kind": "cat"}, "l": [-1] }', True)])
def test_a_value_is_read_with_every_alternative_that_fits_it(text, ok):
    s = jsonmode.JsonPrefix(jsonmode.object_schema(UNION))
    assert (s.feed(text.encode()) and s.done) == ok == _valid(loads(text), UNION, UNION["$defs"])


@pytest.mark.parametrize("text, ok", [
    ('{"pet": {"kind": "dog"}}', False), ('{"pet": {"kind": "cat", "good": true}}', False),
    ('{"pet": {"kind": "cow"}}', False), ('{"pet": {"kind": "cat"}, "v": "abcd"}', False),
    ('{"pet": {"kind": "cat"}, "v": -1}', False), ('{"pet": {"kind": "cat"}, "v": 1.5}', False),
    ('{"pet": {"kind": "cat"}, "o": {"a": 1, "b": true}}', True), ('{"pet": {"kind": "cat"}, "o": {"c": 1}}', False),
    ('{"pet": {"kind": "cat"}, "o": {"a": "x"}}', False), ('{"pet": {"kind": "dog", "good": false}, "v": 12}', True)])
def test_a_one_of_is_the_one_alternative_a_value_meets(text, ok):
    s = jsonmode.JsonPrefix(jsonmode.object_schema(ONE_OF))
    assert (s.feed(text.encode()) and s.done) == ok == _valid(loads(text), ONE_OF, ONE_OF["$defs"])


SOME = [{"type": "string"}, {"type": "integer"}, {"type": "number", "maximum": 3}, {"type": ["null", "boolean"]},
        {"enum": [1, "a"]}, {"enum": [1.0, None]}, {"enum": [True, "b"]}, {"const": 2.5}, {"type": "array"},
        {"type": "object", "properties": {"k": {"const": "x"}}, "required": ["k"]},
        {"type": "object", "properties": {"k": {"enum": ["y", 2]}, "n": {}}, "required": ["k", "n"]},
        {"type": "object", "properties": {"n": {"type": "integer"}}, "additionalProperties": False},
        {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]},
        {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"k": {"const": "z"}}, "required": ["k"]}]}]
SOME_VALUES = ['"a"', '"b"', '"x"', "1", "1.0", "2.5", "3", "-7", "null", "true", "false", "[]", "[1]", "{}",
               '{"n": 1}', '{"k": "x"}', '{"k": "x", "n": 1}', '{"k": "y", "n": null}', '{"k": 2, "n": 0}',
               '{"k": 2}', '{"k": "z"}', '{"k": 1}', '{"n": "q"}']


@pytest.mark.parametrize("text", [
    '{"ns": [0, 0', '{"ns": [0, 1, 10, -0', '{"ns": [1, 12, 1]', '{"ns": [1, 12, 1 ', '{"e": ["a", "a',
    '{"e": [1, 1]', '{"e": [12, 1, 1', '{"b": [true, false, null,', '{"b": [true, t', '{"b": [null, n',
    '{"tags": ["x", "x"', '{"tags": ["\\u0061", "a"', '{"tags": ["", ""', '{"xs": [1, 1.0,', '{"xs": [1, 10e-1]',
    '{"xs": [0.5, 5e-1 ', '{"tags": ["\\ud8'])
def test_a_unique_arrays_repeat_is_refused_where_it_ends(text):
    """UNIQUE: each text's last byte is the first refused. A repeated string at its closing quote (escapes read
    as what they stand for), a number where it ends (1.0 and 10e-1 are 1), an integer 0 at once (it cannot go
    on), an enum's or literal's repeat at the byte that leaves only it, a comma where every value was had; an
    escaped surrogate (characters compared are written as themselves)."""
    s = jsonmode.JsonPrefix(jsonmode.compile_schema(UNIQUE))
    assert s.copy().feed(text[:-1].encode()) and not s.copy().feed(text.encode())


def test_pydantic_dicts_with_literal_or_enum_keys_take_only_those_keys():
    pydantic = pytest.importorskip("pydantic")
    import enum
    import typing

    class C(enum.Enum):
        R = "r"
        G = "g"

    class D(pydantic.BaseModel):
        a: dict[typing.Literal["x", "y"], int]
        b: dict[C, str]

    node = jsonmode.object_schema(D.model_json_schema())
    for text, ok in (('{"a": {"x": 1, "y": 2}, "b": {"r": "q"}}', True), ('{"a": {"z": 1}, "b": {}}', False),
                     ('{"a": {}, "b": {"g": "1", "r": ""}}', True), ('{"a": {}, "b": {"g": 1}}', False)):
        s = jsonmode.JsonPrefix(node)
        assert (s.feed(text.encode()) and s.done) == ok, text
        if ok:
            D.model_validate_json(text, strict=True)


def test_pydantic_sets_are_unique_items():
    pydantic = pytest.importorskip("pydantic")

    class S(pydantic.BaseModel):
        tags: set[str]
        ids: frozenset[int]

    node = jsonmode.object_schema(S.model_json_schema())
    for text, ok in (('{"tags": ["a", "b"], "ids": [1, 2]}', True), ('{"tags": ["a", "a"], "ids": []}', False),
                     ('{"tags": [], "ids": [3, 3]}', False)):
        s = jsonmode.JsonPrefix(node)
        assert (s.feed(text.encode()) and s.done) == ok
    S.model_validate_json('{"tags": ["a", "b"], "ids": [1, 2]}', strict=True)


def test_a_one_of_is_held_only_where_no_value_meets_two_alternatives():
    """Every pair of SOME as a oneOf: where it is held, no value of SOME_VALUES meets both (the plain
    statement); over half the pairs are held, the pairs of types apart, enums apart and discriminated objects."""
    held = 0
    for a, b in ((a, b) for i, a in enumerate(SOME) for b in SOME[i + 1:]):
        try:
            jsonmode.compile_schema({"oneOf": [a, b]})
        except jsonmode.SchemaError:
            continue
        held += 1
        assert not [t for t in SOME_VALUES if _valid(loads(t), a) and _valid(loads(t), b)], (a, b)
    assert held > len(SOME) * (len(SOME) - 1) // 4, held


def _valid_pet(v) -> bool:
    owner = lambda o: isinstance(o, dict) and set(o) == {"id", "tags"} and isinstance(o["id"], int) and all(
        isinstance(t, str) for t in o["tags"])
    return (set(v) == {"name", "kind", "owner", "friends"} and isinstance(v["name"], str)
            and (v["kind"] is None or isinstance(v["kind"], str)) and (v["owner"] is None or owner(v["owner"]))
            and all(owner(f) for f in v["friends"]))


def test_whitespace_outside_strings_comes_at_most_max_ws_in_a_row():
    run = b" " * jsonmode.MAX_WS
    assert jsonmode.JsonPrefix().feed(run + b'{"a":' + run + b'"' + run * 3 + b'"' + run + b"}")
    assert not jsonmode.JsonPrefix().feed(run + b" ")
    assert not jsonmode.JsonPrefix().feed(b'{"a":' + run + b"\n")


CLOSED = {"type": "object", "properties": {"e": {"type": "object", "additionalProperties": False},
                                          "k": {"type": "object", "properties": {"x": {"enum": [True]}},
                                                "additionalProperties": False}},
          "required": ["e"], "additionalProperties": False}  # objects that take no key, or one


@pytest.mark.parametrize("which", ["OBJECT", "SCHEMA", "PET", "CLOSED", "BOUNDED", "PATTERNED", "UNION", "TREE",
                                   "ONE_OF", "UNIQUE"])
def test_no_accepted_prefix_is_a_dead_end(which):
    """Random walks, each step a byte the automaton accepts there (structural bytes favoured so that objects
    get written and closed): until the object is done, some byte always continues."""
    root = jsonmode.OBJECT if which == "OBJECT" else \
        jsonmode.object_schema({"SCHEMA": SCHEMA, "PET": PET, "CLOSED": CLOSED, "BOUNDED": BOUNDED,
                                "PATTERNED": PATTERNED, "UNION": UNION, "TREE": TREE, "ONE_OF": ONE_OF,
                                "UNIQUE": UNIQUE}[which])
    rng = random.Random(2)
    alphabet = [bytes([b]) for b in range(0x20, 0x7f)] + [b"\n", b"\xc3", b"\xa9", b"\xe2", b"\x82", b"\xf0", b"\x9f"]
    weight = {c: 25 if c in b'{}[],:"tfn0123456789' else 1 for c in range(256)}
    finished = 0
    for _ in range(40):
        s = jsonmode.JsonPrefix(root)
        for _ in range(400):
            nxt = [a for a in alphabet if s.copy().feed(a)]
            assert nxt, "a dead end"
            s.feed(rng.choices(nxt, [weight[a[0]] for a in nxt])[0])
            if s.done:
                finished += 1
                break
    assert finished > 5, finished
