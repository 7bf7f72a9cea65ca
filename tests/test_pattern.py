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
