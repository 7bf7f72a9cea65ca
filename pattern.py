"""JSON Schema's `pattern` (and the `format`s written as one) for structured output: a regular expression
compiled to a Thompson NFA over code points, run one character at a time so that jsonmode can refuse a
string's character as soon as no continuation of the string can match.

The subset: literals and escapes (\\d \\w \\s and their negations, \\. \\\\ \\t \\n ..., \\uXXXX), classes
[a-z0-9_] and [^...], `.` (any character but a line break), groups (...) and (?:...), alternation |,
quantifiers * + ? {n} {n,} {n,m} (lazy ones match the same strings), and ^ / $ at the start and the end. A
pattern matches anywhere in the string unless anchored (ECMA-262 `test`, as JSON Schema says). Anything
else (lookaround, backreferences, \\b, classes that name no character) is a PatternError, not ignored.

Every state of such an NFA can still reach the match (a class names at least one character, and the NFA
has no other way to fail), so a non-empty set of states is never a dead end.

The same engine holds a whole answer to a regular expression (vLLM's structured outputs `regex` and `choice`):
`Pattern(source, whole=True)` matches the whole text, as Python's `re.fullmatch`, and `RegexPrefix` runs it over
the answer's UTF-8 bytes, refusing a byte as soon as no continuation can match.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

MAX_REPEAT = 1000  # {n,m} copies its atom m times: bounds on the NFA's size
MAX_STATES = 20000
MAX_LENGTH_WORK = 4_000_000  # states x lengths that `lengths` may walk (a string's length bounds its pattern)


class PatternError(ValueError):
    """A pattern outside the subset: says what and where."""


@dataclass(frozen=True)
class CharSet:
    """Characters as ranges of code points (inclusive; a class's may overlap), or their complement."""
    ranges: tuple[tuple[int, int], ...]
    negated: bool = False

    def __contains__(self, c: int) -> bool:
        return any(lo <= c <= hi for lo, hi in self.ranges) != self.negated

    def meets(self, lo: int, hi: int) -> bool:
        """Some code point of lo..hi is in the set."""
        if not self.negated:
            return any(a <= hi and lo <= b for a, b in self.ranges)
        for a, b in sorted(self.ranges):  # the first point of lo..hi no range covers
            if a > lo:
                break
            lo = max(lo, b + 1)
        return lo <= hi


DIGIT = ((48, 57),)
WORD = ((48, 57), (65, 90), (95, 95), (97, 122))
SPACE = ((9, 13), (32, 32), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F),
         (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))
LINE_BREAKS = ((10, 10), (13, 13), (0x2028, 0x2029))
CLASS_ESCAPES = {"d": (DIGIT, False), "D": (DIGIT, True), "w": (WORD, False), "W": (WORD, True), "s": (SPACE, False),
                 "S": (SPACE, True)}
CHAR_ESCAPES = {"t": 9, "n": 10, "v": 11, "f": 12, "r": 13, "0": 0}
SYNTAX = set("^$\\.*+?()[]{}|/-")  # characters an escape may stand for as themselves
UTF8_BITS = {1: 0x1F, 2: 0x0F, 3: 0x07}  # a lead byte's bits of its code point, by continuation bytes after it
# A UTF-8 lead byte -> (continuation bytes after it, the range of the first of them); the others are 80..BF.
# E0, ED, F0 and F4 narrow the first one: no overlong forms, no surrogates, nothing past U+10FFFF.
UTF8_LEADS = ({b: (1, 0x80, 0xBF) for b in range(0xC2, 0xE0)} | {b: (2, 0x80, 0xBF) for b in range(0xE1, 0xF0)}
              | {b: (3, 0x80, 0xBF) for b in range(0xF1, 0xF4)}
              | {0xE0: (2, 0xA0, 0xBF), 0xED: (2, 0x80, 0x9F), 0xF0: (3, 0x90, 0xBF), 0xF4: (3, 0x80, 0x8F)})
STOP = 0xFE  # a stop token, as toolmode.tagged_bytes writes it (UTF-8 never has the byte)


@dataclass(eq=False)  # a state is itself (the graph has cycles: no field-wise comparison)
class State:
    """An NFA state: a character test (`chars`, then `out`), a split (epsilon moves to `out`, no `chars`), or
    the match (neither)."""
    chars: CharSet | None = None
    out: list[State] = field(default_factory=list)


@dataclass
class Fragment:
    start: State
    ends: list[State]  # states whose `out` the next fragment is appended to


class Pattern:
    """A compiled pattern: its states numbered 0.. (`states`). `begin()` is the set of states before a string's
    first character; `step` moves a set over one character (empty: no continuation can match); `matches` says
    whether a set ends a match."""

    def __init__(self, source: str, whole: bool = False):
        self.source = source
        frag = _Parser(source, whole).parse()
        self.match = State()
        for s in frag.ends:
            s.out.append(self.match)
        self.states = _reachable(frag.start)
        if len(self.states) > MAX_STATES:
            raise PatternError(f"pattern {source!r}: {len(self.states)} NFA states, more than {MAX_STATES}")
        self.index = {id(s): i for i, s in enumerate(self.states)}
        self.start = frag.start
        self._lengths: dict[int, list[int]] = {}

    def begin(self) -> frozenset[int]:
        return self._closure([self.start])

    def step(self, states: frozenset[int], c: int) -> frozenset[int]:
        moved = [n for i in states for n in self.states[i].out if self.states[i].chars is not None
                 and c in self.states[i].chars]
        return self._closure(moved)

    def can_step(self, states: frozenset[int], lo: int, hi: int) -> bool:
        """Some character of lo..hi moves the set on (a character still being written: its possible values)."""
        return any(self.states[i].chars is not None and self.states[i].chars.meets(lo, hi) for i in states)

    def matches(self, states: frozenset[int]) -> bool:
        return self.index[id(self.match)] in states

    def lengths(self, cap: int) -> list[int]:
        """Per state, how many more characters (up to `cap`) it can read to a match, as a bit mask: bit L of
        lengths[i] is set where state i reaches the match after exactly L characters (the match itself: bit 0).
        Layer L+1 is the states that read a character into layer L; the layers repeat once one comes again."""
        if cap not in self._lengths:
            if len(self.states) * (cap + 1) > MAX_LENGTH_WORK:
                raise PatternError(f"pattern {self.source!r}: {len(self.states)} NFA states under a length of up to "
                                   f"{cap} characters: more than {MAX_LENGTH_WORK} states x lengths to follow")
            into: list[set[int]] = [set() for _ in self.states]  # state -> the states that read a character into it
            for i, s in enumerate(self.states):
                if s.chars is not None:
                    for t in self._closure(list(s.out)):
                        into[t].add(i)
            layers = [frozenset({self.index[id(self.match)]})]
            first = {layers[0]: 0}
            while len(layers) <= cap:
                layer = frozenset(i for t in layers[-1] for i in into[t])
                if layer in first:  # from here the layers cycle
                    period_start = first[layer]
                    period = len(layers) - period_start
                    layers += [layers[period_start + k % period] for k in range(cap + 1 - len(layers))]
                    break
                first[layer] = len(layers)
                layers.append(layer)
            masks = [0] * len(self.states)
            for n, layer in enumerate(layers):
                for i in layer:
                    masks[i] |= 1 << n
            self._lengths[cap] = masks
        return self._lengths[cap]

    def test(self, text: str) -> bool:
        """Does the whole of `text` match (as ECMA-262's `test` reads the pattern: anchored or not)?"""
        states = self.begin()
        for ch in text:
            states = self.step(states, ord(ch))
            if not states:
                return False
        return self.matches(states)

    def _closure(self, todo: list[State]) -> frozenset[int]:
        """The states reached from `todo` by splits (epsilon moves), the splits left out: a set holds the
        states that read a character, and the match."""
        seen, out = set(), set()
        while todo:
            s = todo.pop()
            if id(s) in seen:
                continue
            seen.add(id(s))
            if s.chars is None and s is not self.match:
                todo.extend(s.out)
            else:
                out.add(self.index[id(s)])
        return frozenset(out)


def utf8_byte(s, b: int, read: Callable[[int], bool], may_read: Callable[[int, int], bool]) -> bool:
    """A byte of a multi-byte UTF-8 character into s.utf8_left, s.utf8_next and s.code (the character being
    read): read(code) once the character is whole, else may_read(lo, hi) with the code points it can still
    become; False for a byte no UTF-8 text has there. (JsonPrefix's strings and RegexPrefix read text so.)"""
    if s.utf8_left:
        lo, hi = s.utf8_next
        s.utf8_left, s.utf8_next = s.utf8_left - 1, (0x80, 0xBF)
        s.code = s.code << 6 | b & 0x3F
        if not lo <= b <= hi:
            return False
        if s.utf8_left == 0:
            return read(s.code)
        low = s.code << 6 * s.utf8_left
        return may_read(low, low + (1 << 6 * s.utf8_left) - 1)
    if b not in UTF8_LEADS:
        return False
    s.utf8_left, lo, hi = UTF8_LEADS[b]
    s.utf8_next, s.code = (lo, hi), b & UTF8_BITS[s.utf8_left]
    rest = 6 * (s.utf8_left - 1)  # the bits after the first continuation byte
    low = (s.code << 6 | lo & 0x3F) << rest
    return may_read(low, (s.code << 6 | hi & 0x3F) << rest | (1 << rest) - 1)


def choice_regex(choices: list[str]) -> str:
    """A pattern that matches exactly one of `choices` (each written with its syntax characters escaped)."""
    return "|".join("".join("\\" + c if c in SYNTAX else c for c in choice) for choice in choices)


class RegexPrefix:
    """The state after some bytes of an answer that must match `pattern` whole (compiled with whole=True): UTF-8
    text, then possibly a stop token (the byte STOP), taken only where the text so far matches. `feed` returns
    False (and leaves the state unusable) at the first byte that no such answer can have there. `done`: nothing
    more can come (a stop was read, or the text matches and no character can follow)."""

    def __init__(self, pattern: Pattern):
        self.pattern = pattern
        self.states = pattern.begin()
        self.utf8_left = 0  # continuation bytes left in the character being read
        self.utf8_next = (0x80, 0xBF)  # the range the next of them must be in
        self.code = 0  # the character's bits so far
        self.stopped = False

    def copy(self) -> RegexPrefix:
        new = object.__new__(RegexPrefix)
        new.__dict__ = self.__dict__.copy()  # (every field is immutable)
        return new

    @property
    def done(self) -> bool:
        if self.stopped:
            return True
        p = self.pattern
        return self.utf8_left == 0 and p.matches(self.states) and all(p.states[i].chars is None for i in self.states)

    def feed(self, data: bytes) -> bool:
        return all(self._byte(b) for b in data)

    def _byte(self, b: int) -> bool:
        if self.stopped:
            return False
        if b == STOP:
            self.stopped = self.utf8_left == 0 and self.pattern.matches(self.states)
            return self.stopped
        if b < 0x80 and not self.utf8_left:
            return self._read(b)
        return utf8_byte(self, b, self._read, lambda lo, hi: self.pattern.can_step(self.states, lo, hi))

    def _read(self, code: int) -> bool:
        self.states = self.pattern.step(self.states, code)
        return bool(self.states)


def _reachable(start: State) -> list[State]:
    seen, order, todo = set(), [], [start]
    while todo:
        s = todo.pop()
        if id(s) not in seen:
            seen.add(id(s))
            order.append(s)
            todo.extend(s.out)
    return order


class _Parser:
    """Recursive descent over the pattern: alternation > sequence > quantified atom."""

    def __init__(self, source: str, whole: bool = False):
        self.src, self.i, self.whole = source, 0, whole
        self.made = 0  # NFA states the counted repeats build (an upper bound)

    def parse(self) -> Fragment:
        """The top-level alternatives, each anchored by its own ^ and $ (ECMA-262: "^a|b$" is (^a)|(b$)); an
        unanchored side may have anything before or after it, unless the pattern matches whole."""
        branches = []
        while True:
            anchored_start = self._eat("^") or self.whole
            frag = self._sequence(top=True)
            anchored_end = self._eat("$") or self.whole
            if not anchored_start:
                frag = _concat(_anything(), frag)
            if not anchored_end:
                frag = _concat(frag, _anything())
            branches.append(frag)
            if not self._eat("|"):
                break
        if self.i != len(self.src):
            raise self._error(f"unexpected {self.src[self.i]!r}")
        return _either(branches)

    def _error(self, what: str) -> PatternError:
        return PatternError(f"pattern {self.src!r} at {self.i}: {what}")

    def _peek(self) -> str | None:
        return self.src[self.i] if self.i < len(self.src) else None

    def _eat(self, c: str) -> bool:
        if self._peek() == c:
            self.i += 1
            return True
        return False

    def _alternation(self) -> Fragment:
        branches = [self._sequence(top=False)]
        while self._eat("|"):
            branches.append(self._sequence(top=False))
        return _either(branches)

    def _sequence(self, top: bool) -> Fragment:
        parts = []
        while self._peek() not in (None, "|", ")") and not (top and self._at_end_anchor()):
            parts.append(self._quantified())
        frag = _empty()
        for p in parts:
            frag = _concat(frag, p)
        return frag

    def _quantified(self) -> Fragment:
        start = self.i
        atom = self._atom()
        c = self._peek()
        if c in ("*", "+", "?"):
            self.i += 1
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif c == "{" and self._looks_like_count():
            lo, hi = self._count()
        else:
            return atom
        self._eat("?")  # lazy: the same strings match
        # The atom parsed once sizes the copies; each copy is parsed again from its source (a fragment links
        # once). Counted before they are built: nested counts multiply.
        self.made += (lo + 1 if hi is None else max(hi, 1)) * (len(_reachable(atom.start)) + 1)
        if self.made > MAX_STATES:
            raise self._error(f"the NFA would take more than {MAX_STATES} states")
        source = self.src[start:self.i]
        return _repeat(lambda: _Parser(source)._atom(), lo, hi)

    def _at_end_anchor(self) -> bool:
        return self._peek() == "$" and self.src[self.i + 1:self.i + 2] in ("", "|")

    def _looks_like_count(self) -> bool:
        j = self.src.find("}", self.i)
        body = self.src[self.i + 1:j] if j > 0 else ""
        return bool(body) and all(ch.isdigit() or ch == "," for ch in body) and body[0].isdigit() \
            and body.count(",") <= 1

    def _count(self) -> tuple[int, int | None]:
        j = self.src.index("}", self.i)
        body, self.i = self.src[self.i + 1:j], j + 1
        lo, _, hi = body.partition(",")
        lo_n, hi_n = int(lo), (int(lo) if "," not in body else int(hi) if hi else None)
        if hi_n is not None and hi_n < lo_n or max(lo_n, hi_n or 0) > MAX_REPEAT:
            raise self._error(f"{{{body}}}: counts must be n <= m <= {MAX_REPEAT}")
        return lo_n, hi_n

    def _atom(self) -> Fragment:
        c = self._peek()
        if c is None or c in "*+?{":
            raise self._error("a quantifier with nothing before it" if c else "an unfinished pattern")
        self.i += 1
        if c == "(":
            if self._eat("?"):
                if not self._eat(":"):
                    raise self._error("lookaround and named groups are not supported (only (?:...))")
            frag = self._alternation()
            if not self._eat(")"):
                raise self._error("an unclosed group")
            return frag
        if c == ")":
            raise self._error("an unmatched ')'")
        if c == "[":
            return _chars(self._class())
        if c == ".":
            return _chars(CharSet(LINE_BREAKS, negated=True))
        if c in "^$":
            raise self._error(f"{c!r} only at the pattern's start or end")
        if c == "\\":
            return _chars(self._escape(in_class=False))
        return _chars(self._char(ord(c)))

    def _char(self, code: int) -> CharSet:
        if 0xD800 <= code <= 0xDFFF:  # (a JSON string of a pattern writes its characters as themselves)
            raise self._error(f"the surrogate code point {code:#06x} is not supported")
        return _one(code)

    def _escape(self, in_class: bool) -> CharSet:
        c = self._peek()
        if c is None:
            raise self._error("a trailing backslash")
        self.i += 1
        if c in CLASS_ESCAPES:
            ranges, negated = CLASS_ESCAPES[c]
            return CharSet(ranges, negated)
        if c in CHAR_ESCAPES:
            return _one(CHAR_ESCAPES[c])
        if c == "u" and len(self.src) >= self.i + 4 and all(h in "0123456789abcdefABCDEF"
                                                             for h in self.src[self.i:self.i + 4]):
            code, self.i = int(self.src[self.i:self.i + 4], 16), self.i + 4
            return self._char(code)
        if c in SYNTAX or not c.isalnum():
            return _one(ord(c))
        raise self._error(f"\\{c} is not supported")

    def _class(self) -> CharSet:
        negated = self._eat("^")
        ranges = []
        while True:
            c = self._peek()
            if c is None:
                raise self._error("an unclosed class")
            if c == "]":  # (ECMA-262: also right after "[", so [] names nothing and [^] everything)
                self.i += 1
                break
            lo = self._class_char()
            if isinstance(lo, CharSet):
                if lo.negated:
                    raise self._error("\\D, \\W, \\S inside a class are not supported")
                ranges.extend(lo.ranges)
                continue
            if self._peek() == "-" and self.src[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self._class_char()
                if isinstance(hi, CharSet) or hi < lo:
                    raise self._error("a bad range in a class")
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
            if 0xD800 <= ranges[-1][0] and ranges[-1][1] <= 0xDFFF:
                raise self._error("surrogate code points are not supported")
        chars = CharSet(tuple(sorted(ranges)), negated)
        if not negated and not ranges:
            raise self._error("a class that names no character")
        return chars

    def _class_char(self) -> int | CharSet:
        c = self.src[self.i]
        self.i += 1
        if c == "\\":
            got = self._escape(in_class=True)
            return got.ranges[0][0] if len(got.ranges) == 1 and got.ranges[0][0] == got.ranges[0][1] \
                and not got.negated else got
        return ord(c)


def _one(code: int) -> CharSet:
    return CharSet(((code, code),))


def _chars(chars: CharSet) -> Fragment:
    s = State(chars)
    return Fragment(s, [s])


def _anything() -> Fragment:
    return _star(_chars(CharSet((), negated=True)))


def _either(branches: list[Fragment]) -> Fragment:
    if len(branches) == 1:
        return branches[0]
    return Fragment(State(out=[b.start for b in branches]), [e for b in branches for e in b.ends])


def _empty() -> Fragment:
    s = State()
    return Fragment(s, [s])


def _concat(a: Fragment, b: Fragment) -> Fragment:
    for e in a.ends:
        e.out.append(b.start)
    return Fragment(a.start, b.ends)


def _star(a: Fragment) -> Fragment:
    split = State(out=[a.start])
    for e in a.ends:
        e.out.append(split)
    return Fragment(split, [split])


def _repeat(atom, lo: int, hi: int | None) -> Fragment:
    """lo copies of the atom, then hi - lo optional ones nested, (x(x(x)?)?)? (or a star for no upper bound);
    `atom` builds a fresh copy (an NFA fragment can be linked once). Nested, a string k copies in is in one of
    them; written x?x?x? it would be in each later one too (it may have skipped any), a set as long as the count."""
    frag = _empty()
    for _ in range(lo):
        frag = _concat(frag, atom())
    if hi is None:
        return _concat(frag, _star(atom()))
    tail = _empty()
    for _ in range(hi - lo):
        body = _concat(atom(), tail)
        skip = State(out=[body.start])
        tail = Fragment(skip, body.ends + [skip])
    return _concat(frag, tail)
