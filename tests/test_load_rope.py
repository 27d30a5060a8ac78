"""The RoPE tables built at load (RotaryEmbedding.compute assembles them in the model's dtype, for
speed) hold the bits of the float64-assembled tables the engine used before, for every position."""
from __future__ import annotations

import pytest
import torch

from pyengine.models.layers import RotaryEmbedding


def _reference(rope: RotaryEmbedding, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous construction: everything in float64, one cast at the end."""
    d2, r2 = rope.head_dim // 2, rope.inv_freq.shape[0]
    angles = positions.to(torch.float64)[:, None] * rope.inv_freq
    cos = torch.ones(positions.shape[0], rope.head_dim, dtype=torch.float64)
    sin = torch.zeros_like(cos)
    c, s = angles.cos() * rope.attention_factor, angles.sin() * rope.attention_factor
    cos[:, :r2], cos[:, d2:d2 + r2] = c, c
    sin[:, :r2], sin[:, d2:d2 + r2] = -s, s
    return cos.to(rope.dtype), sin.to(rope.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (tells -0.0 from 0.0, which torch.equal does not)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "mscale": 1.0,
        "mscale_all_dim": 0.5}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 1024}
CASES = {  # head_dim, rotary_dim, theta, scaling, dtype, positions
    "smollm2": (64, 64, 100000.0, None, torch.float32, 8192),  # the default model
    "partial_yarn_bf16": (128, 64, 10000.0, YARN, torch.bfloat16, 4096),  # attention factor != 1
    "llama3_fp16": (128, 128, 500000.0, LLAMA3, torch.float16, 4096),
    "partial_fp32": (96, 32, 10000.0, None, torch.float32, 2048),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rope_tables_bit_identical(case):
    head_dim, rotary_dim, theta, scaling, dtype, n = CASES[case]
    rope = RotaryEmbedding(head_dim, rotary_dim, theta, scaling, dtype, max_positions=n)
    if scaling is YARN:
        assert rope.attention_factor != 1.0
    positions = torch.arange(n)
    ref_cos, ref_sin = _reference(rope, positions)
    assert rope.cos_table is not None and rope.sin_table is not None
    assert rope.cos_table.dtype == dtype and rope.cos_table.shape == (n, head_dim)
    assert torch.equal(_bits(rope.cos_table), _bits(ref_cos)) and torch.equal(_bits(rope.sin_table), _bits(ref_sin))
    # Without a table, each call computes its positions' rows: the same bits.
    lazy = RotaryEmbedding(head_dim, rotary_dim, theta, scaling, dtype)
    some = torch.tensor([0, 1, 7, n // 3, n - 1])
    cos, sin = lazy(some)
    assert torch.equal(_bits(cos), _bits(ref_cos[some])) and torch.equal(_bits(sin), _bits(ref_sin[some]))
