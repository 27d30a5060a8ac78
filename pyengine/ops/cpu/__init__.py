"""The CPU backend: the C++ loops of pyengine._C.cpu behind the ops' signatures (attention: GQA
paged attention; mla: the same kernel over the latent cache; layer: norms, SwiGLU, rope_and_cache;
gemm: PackedLinear), and in PyTorch the recurrent-state ops whose references' bits depend on the
step (ssm: Mamba2 conv and scan; gdn: Gated DeltaNet prefill). Importing it raises ImportError when
the extension lacks the CPU ops. Validation is the facade's (pyengine.ops)."""
from pyengine.ops.cpu.attention import paged_attention, step_tables
from pyengine.ops.cpu.extension import kernels
from pyengine.ops.cpu.gdn import gated_delta_rule_chunked
from pyengine.ops.cpu.gemm import PackedLinear
from pyengine.ops.cpu.mla import paged_attention_mla
from pyengine.ops.cpu.layer import fused_add_rms_norm, rms_norm, rope_and_cache, silu_and_mul
from pyengine.ops.cpu.ssm import causal_conv1d_fn, causal_conv1d_update, selective_state_update, ssd_chunk_scan

__all__ = ["paged_attention", "step_tables", "kernels", "PackedLinear", "fused_add_rms_norm", "rms_norm",
           "rope_and_cache", "silu_and_mul", "paged_attention_mla", "causal_conv1d_update", "causal_conv1d_fn",
           "selective_state_update", "ssd_chunk_scan", "gated_delta_rule_chunked"]
