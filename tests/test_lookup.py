"""The lookup index returns the continuation of the longest, then most recent, earlier match."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smc_sd.engine.lookup import LookupIndex


def brute_force(prompt, generated, max_len, max_ngram, min_ngram):
    """The lookup answer by definition: for n from max_ngram down, the latest earlier start j."""
    text = prompt + generated
    size = len(text)
    for n in range(max_ngram, min_ngram - 1, -1):
        if size < n:
            continue
        suffix = text[size - n :]
        for start in range(size - n - 1, -1, -1):
            if text[start : start + n] == suffix:
                return text[start + n : start + n + max_len]
    return []


@st.composite
def cases(draw):
    alphabet = draw(st.integers(1, 4))
    tokens = st.lists(st.integers(0, alphabet - 1), max_size=30)
    max_ngram = draw(st.integers(1, 6))
    min_ngram = draw(st.integers(1, max_ngram))
    return draw(tokens), draw(tokens), draw(st.integers(0, 12)), max_ngram, min_ngram


@settings(max_examples=3000, deadline=None)
@given(cases())
def test_propose_equals_brute_force(case):
    prompt, generated, max_len, max_ngram, min_ngram = case
    index = LookupIndex(prompt, max_ngram=max_ngram, min_ngram=min_ngram)
    assert index.propose(generated, max_len) == brute_force(prompt, generated, max_len, max_ngram, min_ngram)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2), max_size=20), st.lists(st.lists(st.integers(0, 2), max_size=15), min_size=2, max_size=4))
def test_one_index_serves_many_sequences(prompt, sequences):
    """The index keeps no per-sequence state: answers do not depend on the calls before them."""
    index = LookupIndex(prompt, max_ngram=4)
    for generated in sequences + sequences[::-1]:
        assert index.propose(generated, 5) == brute_force(prompt, generated, 5, 4, 1)


def test_match_inside_generated_text_is_the_most_recent():
    # "7 8" occurs in the prompt (followed by 1) and in the generated text (followed by 2)
    index = LookupIndex([5, 7, 8, 1, 6], max_ngram=4)
    assert index.propose([7, 8, 2, 3, 7, 8], 3) == [2, 3, 7]


def test_longer_match_in_prompt_beats_more_recent_shorter_one():
    index = LookupIndex([4, 7, 8, 1], max_ngram=4)
    # suffix "4 7 8" matches the prompt's start (length 3); "7 8" alone also matches in generated
    assert index.propose([7, 8, 9, 4, 7, 8], 2) == [1, 7]


def test_continuation_runs_from_prompt_into_generated_and_stops_at_the_end():
    index = LookupIndex([1, 2, 3], max_ngram=3)
    assert index.propose([1, 2], 10) == [3, 1, 2]
    assert index.propose([], 10) == []


def test_overlapping_match():
    # in "0 0 0 0" the suffix "0 0 0" occurs at start 0, overlapping itself
    index = LookupIndex([0, 0, 0], max_ngram=3)
    assert index.propose([0], 5) == [0]
    assert index.propose([], 5) == [0]


def test_no_match_and_min_ngram():
    assert LookupIndex([1, 2, 3]).propose([4], 5) == []
    # "3" occurs earlier but a 2-token match is required
    assert LookupIndex([3, 1, 2], min_ngram=2).propose([3], 5) == []
    assert LookupIndex([3, 1, 2], min_ngram=2).propose([3, 1], 5) == [2, 3, 1]


def test_max_len_cuts_the_continuation():
    index = LookupIndex([1, 2, 3, 4, 5, 6, 1])
    assert index.propose([], 3) == [2, 3, 4]
    assert index.propose([], 0) == []


@pytest.mark.parametrize(
    "build, call, message",
    [
        (dict(max_ngram=2, min_ngram=3), None, "min_ngram <= max_ngram"),
        (dict(min_ngram=0), None, "1 <= min_ngram"),
        ({}, ((1, 2), 3), "list of ints"),
        ({}, ([1], -1), "max_len must be >= 0"),
    ],
)
def test_bad_input(build, call, message):
    with pytest.raises(ValueError, match=message):
        index = LookupIndex([1, 2, 1], **build)
        index.propose(*call)
