"""benchmarks/spec_copy_ceiling.py: its oracle and its replay of the proposers on hand-worked
sequences (the figures behind docs/speculation.md's bounds on the copying methods)."""
from __future__ import annotations

import pytest

from benchmarks import spec_copy_ceiling as ceiling

PROMPT = [7, 1, 2, 3, 4, 5]
OUT = [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("cap,min_match,steps,copied", [
    # step 1: the prompt's last token recurs nowhere with a token after it -> the verify's own token;
    # step 2: "1" recurs in the prompt, followed by 2 3 4 5 -> 4 drafts, then the verify's token
    (None, 1, 2, 4),
    (2, 1, 3, 3),   # drafts capped at 2: 2 3, then "4" recurs followed by 5 -> 1 draft
    (None, 2, 3, 3),  # "5 1" recurs nowhere; "1 2" does, followed by 3 4 5
])
def test_the_oracle_on_a_worked_sequence(cap: int | None, min_match: int, steps: int, copied: int) -> None:
    assert ceiling.oracle_steps(PROMPT, OUT, [], cap, min_match) == (steps, copied)


def test_the_oracle_reads_other_outputs_but_not_the_future_of_its_own() -> None:
    out = [8, 9, 8, 9, 8]
    # its own output counts only up to the position drafted for: "8" and "9" have no successor
    # yet at positions 1 and 2 (three verify-only steps), then "8" leads to 9 8, capped to the one
    # draft before the last token
    assert ceiling.oracle_steps([], out, [], None, 1) == (4, 1)
    # another request's output holding the whole run: one step of 3 drafts and the verify's token
    assert ceiling.oracle_steps([8], out[1:], [[8, 9, 8, 9, 8]], None, 1) == (1, 3)


def test_the_proposers_replayed_on_a_worked_sequence() -> None:
    # the lookup from one token drafts 2 3 4 5 after "1", as the oracle does; from two it cannot
    assert ceiling.proposer_steps([PROMPT], [OUT], "ngram", 4, min_n=1) == [2]
    assert ceiling.proposer_steps([PROMPT], [OUT], "ngram", 4, min_n=2) == [3]
    assert ceiling.proposer_steps([PROMPT], [OUT], "ngram", 2, min_n=1) == [3]
