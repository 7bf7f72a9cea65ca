"""JSON mode (OpenAI's `response_format: {"type": "json_object"}`): the answer is one JSON object.

`JsonPrefix` is a pushdown automaton over bytes that accepts exactly the prefixes of a JSON text (RFC 8259)
whose value is an object, and says when that object is complete. Strings are checked for escapes and
control characters; bytes >= 0x80 inside a string pass unchecked (a token may end inside a UTF-8 character,
and the model writes whole characters).

`pick` is the sampler's side: given the row's tokens in the order of its race (Engine: the logits after
penalties, temperature and filters, minus the log of the row's exponential noise), the first one whose bytes
keep the text a prefix wins. The race's winner among the allowed tokens is a draw from the model's
distribution restricted to them, so constraining changes which tokens can be drawn, not their odds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

WS = frozenset(b" \t\n\r")
DIGITS = frozenset(b"0123456789")
LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}
ESCAPES = frozenset(b'"\\/bfnrtu')
HEX = frozenset(b"0123456789abcdefABCDEF")


@dataclass
class JsonPrefix:
    """The state after some bytes of a JSON object text. `feed` returns False (and leaves the state
    unusable) at the first byte that no JSON object text can have there."""

    stack: list[int] = field(default_factory=list)  # open containers: ord("{") or ord("[")
    # "start" (before the object), "value" (a value must come), "value_or_end" (after "["), "key" (after
    # ","), "key_or_end" (after "{"), "colon", "after" (after a value), "string", "escape", "unicode",
    # "number", "literal", "done"
    mode: str = "start"
    key: bool = False  # the string being read is an object key
    left: bytes = b""  # the rest of a literal
    hex_left: int = 0  # hex digits left in a \\u escape
    number: str = ""  # "-", "0", "int", ".", "frac", "e", "e+", "exp": what the number's text ends in

    def copy(self) -> JsonPrefix:
        return JsonPrefix(list(self.stack), self.mode, self.key, self.left, self.hex_left, self.number)

    @property
    def done(self) -> bool:
        return self.mode == "done"

    def feed(self, data: bytes) -> bool:
        return all(self._byte(b) for b in data)

    def _byte(self, b: int) -> bool:
        m = self.mode
        if m == "string":
            if b == ord('"'):
                self.mode = "colon" if self.key else "after"
                if not self.key:
                    return self._value_done()
                return True
            if b == ord("\\"):
                self.mode = "escape"
            return b >= 0x20
        if m == "escape":
            if b not in ESCAPES:
                return False
            self.mode, self.hex_left = ("unicode", 4) if b == ord("u") else ("string", 0)
            return True
        if m == "unicode":
            self.hex_left -= 1
            if self.hex_left == 0:
                self.mode = "string"
            return b in HEX
        if m == "literal":
            if b != self.left[0]:
                return False
            self.left = self.left[1:]
            return self._value_done() if not self.left else True
        if m == "number":
            if self._number(b):
                return True
            if self.number not in ("0", "int", "frac", "exp"):  # "-", "." or an exponent without digits
                return False
            self.mode = "after"
            return self._byte(b)  # the byte that ended the number
        if b in WS:
            return m != "done"
        if m == "start":
            return self._open(b) if b == ord("{") else False
        if m in ("key", "key_or_end"):
            if b == ord("}") and m == "key_or_end":
                return self._close(b)
            self.mode, self.key = "string", True
            return b == ord('"')
        if m == "colon":
            self.mode = "value"
            return b == ord(":")
        if m in ("value", "value_or_end"):
            if b == ord("]") and m == "value_or_end":
                return self._close(b)
            return self._value_start(b)
        if m == "after":
            if b == ord(","):
                self.mode = "key" if self.stack[-1] == ord("{") else "value"
                return True
            return self._close(b)
        return False  # "done": nothing may follow the object

    def _value_start(self, b: int) -> bool:
        if b in (ord("{"), ord("[")):
            return self._open(b)
        if b == ord('"'):
            self.mode, self.key = "string", False
            return True
        if b in LITERALS:
            self.mode, self.left = "literal", LITERALS[b]
            return True
        if b == ord("-") or b in DIGITS:
            self.mode, self.number = "number", "-" if b == ord("-") else "0" if b == ord("0") else "int"
            return True
        return False

    def _number(self, b: int) -> bool:
        """Extend the number by b if the grammar -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? allows it."""
        n = self.number
        if b in DIGITS:
            nxt = {"-": "0" if b == ord("0") else "int", "int": "int", ".": "frac", "frac": "frac", "e": "exp",
                   "e+": "exp", "exp": "exp"}.get(n)
        elif b == ord("."):
            nxt = "." if n in ("0", "int") else None
        elif b in (ord("e"), ord("E")):
            nxt = "e" if n in ("0", "int", "frac") else None
        elif b in (ord("+"), ord("-")):
            nxt = "e+" if n == "e" else None
        else:
            nxt = None
        if nxt is None:
            return False
        self.number = nxt
        return True

    def _open(self, b: int) -> bool:
        self.stack.append(b)
        self.mode = "key_or_end" if b == ord("{") else "value_or_end"
        return True

    def _close(self, b: int) -> bool:
        if not self.stack or b != self.stack[-1] + 2:  # "{" + 2 = "}", "[" + 2 = "]"
            return False
        self.stack.pop()
        return self._value_done()

    def _value_done(self) -> bool:
        self.mode = "after" if self.stack else "done"
        return True


def pick(order: Iterable[int], state: JsonPrefix, vocab_bytes: list[bytes | None]) -> int | None:
    """The first token in `order` whose bytes keep `state` a prefix of a JSON object text (a token of no
    bytes, a special token, is never allowed: it writes nothing); None if none does."""
    for t in order:
        data = vocab_bytes[t] if t < len(vocab_bytes) else None
        if data and state.copy().feed(data):
            return t
    return None
