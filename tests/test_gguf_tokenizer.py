"""The GGUF tokenizer's bulk steps (tokenizer.py) give what the per-token steps gave."""
from __future__ import annotations

import pytest

from pyengine.tokenizer import Tokenizer, _merge_pairs

MERGE_CASES = {
    "byte_level": ["Ġ t", "Ġt he", "i n", "é ĠÃ", "a b"],
    "one": ["x y"],
    "none": [],
    "two_spaces_and_none": ["a b c", "de"],  # total spaces == count: only a per-merge check tells
    "newline": ["a\nb c", "d e"],
    "leading_space": [" a", "b "],
    "no_space": ["ab", "c d"],
}


@pytest.mark.parametrize("case", sorted(MERGE_CASES))
def test_merge_pairs_split_at_the_first_space(case):
    merges = MERGE_CASES[case]
    assert _merge_pairs(merges) == [tuple(m.split(" ", 1)) for m in merges]


def test_default_model_tokenizer_ids(smollm2_path):
    """Built from the file's vocabulary, merges and token types: control tokens whole, the chat
    markers as single ids, text through the merges."""
    from pyengine.loader.gguf_reader import GGUFFile

    with GGUFFile(smollm2_path) as f:
        fields = dict(f.fields)
    tok = Tokenizer.from_gguf_fields(fields)
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    control = [i for i, k in enumerate(types) if k == 3]
    assert control and all(tok.encode(tokens[i], add_special_tokens=False) == [i] for i in control)
    assert tok.vocab_size == len(tokens)
    merges = fields["tokenizer.ggml.merges"]
    for m in merges[:50] + merges[-50:]:  # each merge's result is one token, the merge of its halves
        left, right = m.split(" ", 1)
        assert tok.backend.token_to_id(left + right) is not None
    text = "The capital of France is Paris. Ünïcödé 日本語"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
