"""The greedy_rows kernel (hipkernels/sampling/greedy_rows.h) against torch: each fp32 logits row's
argmax (the first maximum; a NaN above every number) and its finite flag, on rows with ties, NaN and
+-inf, vocabularies with and without the 16-byte path, strided and misaligned rows; a row's result
is the same alone as in any batch."""
from __future__ import annotations

import pytest
import torch

from pyengine.engine.sampler import finite_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from pyengine.ops.cuda.sampling import greedy_rows_into

    out = torch.full((2 * logits.shape[0],), -7, dtype=torch.int64, device=logits.device)
    assert greedy_rows_into(logits, out)
    n = logits.shape[0]
    return out[:n].cpu(), out[n:].cpu()


def special_rows(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Random rows, then: ties of the maximum, a NaN, +inf (twice), -inf, all equal, bf16-like coarse values."""
    x = torch.randn(rows, vocab, generator=gen)
    if rows >= 8 and vocab >= 8:
        top = x[0].max()
        x[0, [vocab // 3, vocab - 1, 5 % vocab]] = top + 1.0  # three ties: the first index wins
        x[1, vocab // 2] = float("nan")
        x[1, vocab - 1] = float("nan")
        x[2, [vocab // 4, vocab // 2]] = float("inf")
        x[3, vocab // 5] = float("-inf")
        x[4] = 0.25
        x[5] = torch.round(x[5] * 4) / 4  # many exact ties
        x[6, 0] = float("inf")
        x[6, 1] = float("nan")
        x[7, vocab - 1] = 1e30
    return x


@pytest.mark.parametrize("vocab", [49152, 49153, 7, 1])
@pytest.mark.parametrize("rows", [1, 8, 65])
def test_greedy_rows_equals_torch(vocab: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(vocab + rows)
    x = special_rows(rows, vocab, gen).cuda()
    tok, fin = run(x)
    assert torch.equal(tok, x.argmax(-1).cpu())
    assert torch.equal(fin.bool(), finite_rows(x).cpu())
    assert set(fin.tolist()) <= {0, 1}
    if rows >= 8 and vocab >= 8:
        assert fin[:8].tolist() == [1, 0, 0, 0, 1, 1, 0, 1]


def test_strided_and_misaligned_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    wide = special_rows(9, 49160, gen).cuda()
    strided = wide[:, :49152]  # row stride 49160, 16-byte aligned rows
    flat = torch.randn(9 * 49152 + 1, generator=gen).cuda()
    misaligned = flat[1:].view(9, 49152)  # 4 bytes off: the one-element path
    for x in (strided, misaligned):
        tok, fin = run(x)
        assert torch.equal(tok, x.argmax(-1).cpu())
        assert torch.equal(fin.bool(), finite_rows(x).cpu())


def test_a_row_alone_equals_the_row_in_a_batch() -> None:
    gen = torch.Generator().manual_seed(5)
    x = special_rows(16, 49152, gen).cuda()
    tok, fin = run(x)
    for r in range(16):
        one_tok, one_fin = run(x[r:r + 1])
        assert one_tok.item() == tok[r].item() and one_fin.item() == fin[r].item()


def test_other_dtypes_are_declined() -> None:
    from pyengine.ops.cuda.sampling import greedy_rows_into

    out = torch.zeros(4, dtype=torch.int64, device="cuda")
    assert not greedy_rows_into(torch.zeros(2, 8, dtype=torch.bfloat16, device="cuda"), out)
    assert not greedy_rows_into(torch.zeros(8, 2, device="cuda").t(), out)  # last dim not contiguous
