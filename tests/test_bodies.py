"""Request bodies: the JSON nesting limit is measured right (against a reference walk of the parsed value)."""
import json

from hypothesis import given, settings, strategies as st

from deployments.bodies import nesting

SCALARS = st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ ab,:\n', max_size=8)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(alphabet='[]{}"\\ ab', max_size=4), inner, max_size=4), max_leaves=40)


def depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(VALUES, st.sampled_from([None, 0, 2]))
def test_nesting_matches_the_parsed_value(value, indent):
    text = json.dumps(value, indent=indent).encode()
    assert nesting(text) == depth(value)


def test_nesting_of_bodies_too_deep_to_parse():
    assert nesting(b"[" * 5000 + b"]" * 5000) == 5000
    assert nesting(b'{"a": "' + b"[" * 5000 + b'"}') == 1     # brackets in a string do not count
