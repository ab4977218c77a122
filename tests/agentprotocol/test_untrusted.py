"""Untrusted JSON: nesting is bounded before the parser recurses, whatever the text holds."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentprotocol.untrusted import json_depth, json_loads_bounded


@pytest.mark.parametrize("kind", [str, bytes])
@pytest.mark.parametrize(("depth", "allowed"), [(16, True), (17, False), (50_000, False)])
def test_nesting_past_the_bound_is_refused_before_parsing(kind, depth, allowed):
    text = "[" * depth + "]" * depth
    document = text if kind is str else text.encode()
    if allowed:
        assert json_loads_bounded(document, max_depth=16) == json.loads(text)
    else:
        with pytest.raises(ValueError, match="deeper than 16"):
            json_loads_bounded(document, max_depth=16)


def test_many_shallow_brackets_and_brackets_in_strings_are_not_nesting():
    shallow = json.dumps({"a": [[1]] * 50, "b": "[[[[[[[[[[[[[[[[[[[[{{{{{{{{{{{"})
    assert json_loads_bounded(shallow, max_depth=3)["b"].startswith("[[[")
    assert json_loads_bounded(shallow.encode(), max_depth=3)["a"] == [[1]] * 50


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\aé€', max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=30,
)


def _depth(value) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


@given(value=_JSON, max_depth=st.integers(0, 6), ascii_only=st.booleans())
@settings(max_examples=500, deadline=None)
def test_a_document_is_refused_exactly_when_it_nests_past_the_bound(value, max_depth, ascii_only):
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert json_depth(text) == json_depth(text.encode()) == _depth(value)
    if _depth(value) > max_depth:
        with pytest.raises(ValueError, match="deeper than"):
            json_loads_bounded(text, max_depth=max_depth)
    else:
        assert json_loads_bounded(text, max_depth=max_depth) == value


def test_secret_values_are_masked_whole_line_by_line_and_json_escaped_longest_first():
    from agentprotocol.untrusted import MASK, mask_terms, secrets_mask

    terms = mask_terms(["abcd", "abcdefgh", 'pa"ss\nword-two', "xyz"])
    # the short value is not a term; the longer one is tried before the one it contains
    assert "xyz" not in terms and terms.index("abcdefgh") < terms.index("abcd")
    assert secrets_mask("key=abcdefgh; again abcd", terms) == f"key={MASK}; again {MASK}"
    assert secrets_mask("word-two", terms) == MASK  # one line of a multi-line value
    assert secrets_mask('{"v": "pa\\"ss\\nword-two"}', terms) == '{"v": "' + MASK + '"}'
    assert secrets_mask("nothing here", ()) == "nothing here"
