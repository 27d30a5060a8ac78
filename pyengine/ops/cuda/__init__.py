"""The CUDA backend: the kernels of hipkernels/ behind the ops' signatures, one module per kernel
family (attention: GQA, mla, layer, gemm, ssm, gdn). Importing it raises ImportError when pyengine._C
was built without the kernels. Validation is the facade's (pyengine.ops); these functions take
validated arguments, prepare layouts and pointers, and fall back to the reference for dtypes the
kernels do not take."""
from pyengine.ops.cuda.attention import paged_attention
from pyengine.ops.cuda.gdn import gated_delta_rule_chunked, gated_delta_rule_materialise, gated_delta_rule_update
from pyengine.ops.cuda.gemm import grouped_gemm, grouped_linear, invariant_gemm, linear, skinny_gemm, skinny_linear
from pyengine.ops.cuda.layer import fused_add_rms_norm, rms_norm, rope_and_cache, silu_and_mul
from pyengine.ops.cuda.mla import paged_attention_mla, reshape_and_cache_mla
from pyengine.ops.cuda.ssm import causal_conv1d_fn, causal_conv1d_update, selective_state_update, ssd_chunk_scan

__all__ = ["paged_attention", "grouped_gemm", "grouped_linear", "invariant_gemm", "linear", "skinny_gemm", "skinny_linear", "fused_add_rms_norm", "rms_norm", "rope_and_cache",
           "silu_and_mul", "paged_attention_mla", "reshape_and_cache_mla", "causal_conv1d_fn", "causal_conv1d_update",
           "selective_state_update", "ssd_chunk_scan", "gated_delta_rule_update", "gated_delta_rule_chunked",
           "gated_delta_rule_materialise"]
