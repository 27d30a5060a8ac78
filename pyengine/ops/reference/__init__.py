"""The PyTorch references of every op: the executable spec the CPU and CUDA backends are tested
against, and what runs where no backend takes a call. One module per kernel family: attention (GQA
paged attention, KV write), mla, layer (norms, SwiGLU, rope_and_cache), ssm (Mamba2 state ops)."""
from pyengine.ops.reference.attention import paged_attention, reshape_and_cache
from pyengine.ops.reference.gdn import (gated_delta_rule_chunked, gated_delta_rule_materialise,
                                        gated_delta_rule_update)
from pyengine.ops.reference.layer import fused_add_rms_norm, rms_norm, rope_and_cache, silu_and_mul
from pyengine.ops.reference.mla import paged_attention_mla, reshape_and_cache_mla
from pyengine.ops.reference.ssm import (PAD, causal_conv1d_fn, causal_conv1d_update, copy_state, normalize_state,
                                        selective_state_update, ssd_chunk_scan)

__all__ = ["paged_attention", "reshape_and_cache", "fused_add_rms_norm", "rms_norm", "rope_and_cache", "silu_and_mul",
           "paged_attention_mla", "reshape_and_cache_mla", "PAD", "causal_conv1d_fn", "causal_conv1d_update",
           "copy_state", "normalize_state", "selective_state_update", "ssd_chunk_scan",
           "gated_delta_rule_chunked", "gated_delta_rule_update", "gated_delta_rule_materialise"]
