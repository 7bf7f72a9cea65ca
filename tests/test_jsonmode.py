"""jsonmode.py: the JSON-object prefix automaton against Python's json module, and the pick."""
import json
import random

import pytest

import jsonmode

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


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
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


def test_agrees_with_the_json_module_on_mutated_texts():
    """A text is accepted whole and done exactly when json.loads reads it as an object (no trailing
    whitespace: the automaton stops at the object's end)."""
    rng = random.Random(0)
    alphabet = '{}[]",:.-+eE0123456789 \\tuabfnrlsx\n'
    seen = [0, 0]
    for _ in range(20000):
        base = rng.choice(list(texts())).strip()
        chars = list(base)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(chars) + 1)
            op = rng.random()
            if op < 0.4 and chars:
                del chars[min(at, len(chars) - 1)]
            elif op < 0.8:
                chars.insert(at, rng.choice(alphabet))
            elif chars:
                chars[min(at, len(chars) - 1)] = rng.choice(alphabet)
        text = "".join(chars).rstrip()
        ok = _is_object(text)
        s = jsonmode.JsonPrefix()
        assert (s.feed(text.encode()) and s.done) == ok, text
        seen[ok] += 1
    assert min(seen) > 1000, seen  # both outcomes were exercised


def test_pick_takes_the_first_token_in_race_order_that_keeps_a_prefix():
    vocab = [b"{", b"}", b'"a"', b":", b"1", None, b"", b"]", b' {"b": 2}']
    s = jsonmode.JsonPrefix()
    assert jsonmode.pick([1, 7, 5, 6, 0, 2], s, vocab) == 0  # "}" and "]" cannot start; no bytes never counts
    assert s.feed(b"{") and jsonmode.pick([0, 4, 2, 1], s, vocab) == 2
    assert jsonmode.pick([4, 3], s, vocab) is None
    assert jsonmode.pick([8], jsonmode.JsonPrefix(), vocab) == 8  # a token may hold a whole object
