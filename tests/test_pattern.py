"""pattern.py: the regular-expression subset against Python's re (with ECMA-262's end anchor), and what it
refuses."""
import random
import re

import pytest

import pattern

# (source, a string it matches)
PATTERNS = [("^[a-z]+$", "ab"), ("abc", "xabcx"), ("^a|b$", "ax"), ("^(ab|c){2,3}$", "abcab"),
            (r"^\d{3}-\d{4}$", "555-1234"), ("^[^0-9]*$", "ab-"), (r"^\w+@\w+\.com$", "a@b.com"), ("x?y*z+", "yz"),
            ("^$", ""), ("^(?:a|bc)*d$", "abcd"), (r"^[\-a]$", "-"), ("^.$", "é"), ("^a{0,2}b{2,}$", "abbb"),
            (r"^[\w.]+$", "a.b"), (r"^(a|)+$", "aa"), (r"^\s*\S+$", " \tx"), (r"^[^]$", "\n"), (r"^\u00e9+$", "éé"),
            ("^a*?b+?$", "ab"), (r"^(\d{1,3}\.){3}\d{1,3}$", "10.0.0.255")]


def _ecma(source: str) -> re.Pattern:
    """Python's re with ECMA-262's meanings: $ is the end of the string (Python's also matches before a final
    line break), [^] any character, \\w \\d ASCII only."""
    return re.compile(re.sub(r"\$(?=\||$)", r"\\Z", source).replace("[^]", r"[\s\S]"), re.ASCII)


@pytest.mark.parametrize("source, example", PATTERNS)
def test_matches_what_re_searches(source, example):
    """A string matches exactly when re.search finds the pattern in it (3000 random strings), and every prefix
    of a match keeps some state."""
    p, rx = pattern.Pattern(source), _ecma(source)
    rng = random.Random(0)
    alphabet = "abcdxyz0123-@. \n\té"
    for _ in range(3000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
        assert p.test(s) == (rx.search(s) is not None), (source, s)
    assert rx.search(example) and p.test(example)
    states = p.begin()
    for ch in example:
        assert states, (source, example)
        states = p.step(states, ord(ch))


@pytest.mark.parametrize("source, words", [
    ("(?=a)", "lookaround"), ("(?<n>a)", "lookaround"), (r"\1", r"\1"), (r"\b", r"\b"), ("[]", "names no character"),
    ("a{2,1}", "n <= m"), ("a{5000}", "n <= m"), ("(a", "unclosed group"), ("a)", "unexpected"),
    ("*a", "nothing before"), ("[a", "unclosed class"), ("a^b", "start or end"), (r"[\ud800]", "surrogate"), (r"\ud800", "surrogate"),
    ("((a{1,1000}){1,1000})", "more than"), ("(((a{1,100}){1,100}){1,100})", "more than")])
def test_what_is_outside_the_subset_is_refused(source, words):
    with pytest.raises(pattern.PatternError, match=re.escape(words)):
        pattern.Pattern(source)


# (source, alphabet, characters past a prefix of up to 4 that some match needs at most): whole-answer patterns
WHOLE = [("(ab|c){2,3}", "abcx", 2), (r"\d{1,3}(\.\d)?", "12.x", 2), ("yes|no|ok", "yesnok", 2),
         (r"a+@b\.c", "ab@.c", 4), ("[é-ü]x*", "éüxa", 0), ("a*b?", "ab", 1),
         (pattern.choice_regex(["a.b", "(c)", "a|b", "a"]), "a.b(c)|", 2)]


def _strings(alphabet: str, n: int) -> list[str]:
    out = [""]
    for _ in range(n):
        out += [s + c for s in out if len(s) == len(out[-1]) for c in alphabet]
    return out


@pytest.mark.parametrize("source, alphabet, more", WHOLE)
def test_a_whole_answer_is_held_to_its_pattern(source, alphabet, more):
    """RegexPrefix over every string of up to 4 characters, fed as UTF-8 bytes: takes it exactly when it begins a
    match (re.fullmatch over every string `more` characters longer), takes a stop exactly where it matches, and
    is done only where it matches and no match goes on."""
    rx = re.compile(source)
    matches = [s for s in _strings(alphabet, 4 + more) if rx.fullmatch(s)]
    prefixes = {m[:i] for m in matches for i in range(len(m) + 1)}
    longer = {m[:i] for m in matches for i in range(len(m))}  # prefixes some longer match goes on from
    p = pattern.Pattern(source, whole=True)
    for s in _strings(alphabet, 4):
        state = pattern.RegexPrefix(p)
        assert state.feed(s.encode()) == (s in prefixes), (source, s)
        if s in prefixes:
            assert state.copy().feed(bytes([pattern.STOP])) == (rx.fullmatch(s) is not None), (source, s)
            assert not state.done or (rx.fullmatch(s) and s not in longer), (source, s)
    assert p.test(matches[-1]) and not p.test(matches[-1] + "\x00")


def test_a_whole_answer_reads_utf8_a_byte_at_a_time():
    letters, e_acute = pattern.Pattern("[a-z]+", whole=True), pattern.Pattern("é+", whole=True)
    assert not pattern.RegexPrefix(letters).feed(b"\xc3")  # no character that starts so is a letter
    state = pattern.RegexPrefix(e_acute)
    assert state.feed(b"\xc3") and not state.copy().feed(b"\xa8")  # è, not é
    assert not state.copy().feed(bytes([pattern.STOP]))  # in the middle of a character
    assert state.feed(b"\xa9") and state.copy().feed(bytes([pattern.STOP])) and not state.done
    for bad in (b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\x80"):  # not UTF-8: a stray byte, overlong, a surrogate
        assert not pattern.RegexPrefix(pattern.Pattern("[^a]*", whole=True)).feed(bad), bad
    stopped = pattern.RegexPrefix(e_acute)
    assert stopped.feed("é".encode() + bytes([pattern.STOP])) and stopped.done and not stopped.feed(b"x")


def test_whole_anchors_every_alternative():
    p = pattern.Pattern("ab|^c$|d", whole=True)
    assert [p.test(s) for s in ("ab", "c", "d", "xab", "abx", "dd")] == [True, True, True, False, False, False]
    assert pattern.Pattern("ab|^c$|d").test("xabx")  # (unanchored: found anywhere)
