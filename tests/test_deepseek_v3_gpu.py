"""DeepSeek-V3 on the GPU: a tiny random model at the real MLA widths (kv_lora_rank 512, rope 64),
so every attention call runs the hipkernels MLA kernel, against the same checkpoint on the CPU
(fp32, the PyTorch/C++ references); MTP speculation end to end in bf16. Skips without CUDA."""
from __future__ import annotations

import gc

import pytest
import torch

from pyengine import LLM, SamplingParams
from pyengine.loader import load_model

from tests.tiny_models import make_deepseek_checkpoint, make_prompts
from tests.utils_paged import make_meta

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REAL_MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, num_attention_heads=8,
                hidden_size=128, q_lora_rank=96)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("dsv3_gpu"))
    make_deepseek_checkpoint(path, mtp_agreement=0.01, layer_scale=0.003, **REAL_MLA)  # ~70% accepted
    return path


@torch.inference_mode()
def _prefill_logits(path: str, device: str, dtype: torch.dtype, prompt: list[int]) -> torch.Tensor:
    model, config, _ = load_model(path, device, dtype)
    block_size = 16
    caches = model.make_kv_caches(8, block_size, torch.device(device))
    meta, positions = make_meta([([5, 2, 7, 1], 0, len(prompt))], block_size, device=device)
    return model.compute_logits(model(torch.tensor(prompt, device=device), positions, meta, caches)).float().cpu()


def test_dense_model_matches_cpu_reference(tmp_path) -> None:
    """All-dense layers (no routing, whose bf16 choices may flip an expert): bf16 on the GPU (MLA
    kernel, cuBLAS, layer-op kernels) vs fp32 on the CPU - logits within bf16 noise, and the same
    argmax wherever the CPU's top-2 gap is clear of it."""
    path = str(tmp_path / "dense")
    make_deepseek_checkpoint(path, first_k_dense_replace=3, **REAL_MLA)
    prompt = make_prompts(3, seed=5)[0] * 2
    gpu = _prefill_logits(path, "cuda", torch.bfloat16, prompt)
    cpu = _prefill_logits(path, "cpu", torch.float32, prompt)
    assert (gpu - cpu).abs().max().item() < 0.1 * cpu.abs().max().item()
    top2 = cpu.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.3
    assert clear.any() and torch.equal(gpu.argmax(-1)[clear], cpu.argmax(-1)[clear])


def test_mla_kernel_inside_the_model_matches_reference(checkpoint: str, monkeypatch) -> None:
    """Every attention call of a GPU prefill and of MTP-speculative decode steps runs the CUDA MLA
    kernel (no reference fallback), and each call's output equals the fp32 reference on the same
    inputs within bf16 rounding."""
    import pyengine.ops.cuda as cuda_ops
    from pyengine.engine.attention_metadata import AttentionMetadata
    from pyengine.ops import reference
    from pyengine.ops.cuda import mla

    kernel, spec, fallbacks, checked = cuda_ops.paged_attention_mla, reference.paged_attention_mla, [], []
    monkeypatch.setattr(mla.reference, "paged_attention_mla", lambda *a, **k: fallbacks.append(1) or spec(*a, **k))

    def checked_kernel(q, kv_cache, meta, scale, return_lse=False, kv_lora_rank=512):
        out = kernel(q, kv_cache, meta, scale, return_lse=return_lse, kv_lora_rank=kv_lora_rank)
        cpu_meta = AttentionMetadata(meta.slot_mapping.cpu(), meta.block_tables.cpu(), meta.query_start_loc.cpu(),
                                     meta.context_lens.cpu(), meta.max_query_len, meta.max_context_len, meta.block_size)
        ref = spec(q.float().cpu(), kv_cache.float().cpu(), cpu_meta, scale, kv_lora_rank=kv_lora_rank)
        got = out[0] if isinstance(out, tuple) else out
        torch.testing.assert_close(got.float().cpu(), ref, atol=3e-2, rtol=3e-2)
        checked.append(int(meta.max_query_len))
        return out

    monkeypatch.setattr(cuda_ops, "paged_attention_mla", checked_kernel)
    llm = LLM(checkpoint, device="cuda", dtype="bfloat16", max_num_batched_tokens=32, enforce_eager=True,  # host copies
              speculative_config={"method": "mtp", "num_speculative_tokens": 2, "adaptive_draft_length": False})
    llm.generate(make_prompts(4, seed=1), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert not fallbacks and len(checked) > 20 and max(checked) > 1


def test_mtp_speculation_end_to_end(checkpoint: str) -> None:
    """MTP k = 1..3 on the GPU in bf16: drafts are proposed and accepted, and greedy outputs equal
    plain decoding's (on this model the top-2 gaps stay clear of bf16 noise)."""
    prompts = make_prompts(8, seed=2)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    graphed = LLM(checkpoint, device="cuda", dtype="bfloat16")
    plain = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    eager = LLM(checkpoint, device="cuda", dtype="bfloat16", enforce_eager=True)
    # decode steps replay CUDA graphs (MLA kernel, grouped MoE) with the eager steps' tokens
    assert graphed.engine.runner.graph_runner.num_replays > 0
    assert [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)] == plain
    del graphed, eager
    # the reference with the speculative runs' prefill chunks: bf16 here is not batch-invariant, so
    # chunking (the GEMMs' row counts) alone moves near-ties
    chunked = LLM(checkpoint, device="cuda", dtype="bfloat16", block_size=16, max_num_batched_tokens=64)
    plain = [o.outputs[0].token_ids for o in chunked.generate(prompts, params, use_tqdm=False)]
    del chunked
    for k in (1, 3):
        llm = LLM(checkpoint, device="cuda", dtype="bfloat16", block_size=16, max_num_batched_tokens=64,
                  speculative_config={"method": "mtp", "num_speculative_tokens": k, "adaptive_draft_length": False})
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        st = llm.stats()
        assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] > 0.3, st
        same = sum(a == b for a, b in zip(outs, plain))
        assert same >= 7, f"k={k}: {same}/8 requests equal plain decoding"
        del llm
        gc.collect()
        torch.cuda.empty_cache()


# Every GEMM width a multiple of 64 (the invariant GEMMs' K granularity): q_lora 128, W_UK's 64
# nope dims, 8 heads of 64 values into o_proj, expert and dense MLP widths 64 / 128.
INVARIANT_DIMS = dict(REAL_MLA, qk_nope_head_dim=64, v_head_dim=64, q_lora_rank=128, intermediate_size=128,
                      moe_intermediate_size=64)


def test_batch_invariant_logits_alone_batched_and_with_mtp(tmp_path) -> None:
    """LLM(batch_invariant=True), bf16, CUDA graphs: every request's logits are bit-identical alone
    and in a batch of 8 (chunked prefills beside decode rows), and with MTP speculation (k 1 and 3,
    verify rows through the grouped expert and per-head GEMMs) and without."""
    from pyengine.check import check_losslessness
    from pyengine.ops.kernel_config import use_kernel_config

    path = str(tmp_path / "invariant")
    make_deepseek_checkpoint(path, mtp_agreement=0.01, layer_scale=0.003, **INVARIANT_DIMS)
    with use_kernel_config(batch_invariant=True):
        model, _, _ = load_model(path, "cuda", torch.bfloat16)
        assert model.supports_cuda_graphs  # the grouped invariant GEMM reads no expert count on the host
    del model
    prompts = make_prompts(8, seed=4)
    for k in (1, 3):
        spec = {"method": "mtp", "num_speculative_tokens": k, "adaptive_draft_length": False}
        report = check_losslessness(prompts, model=path, device="cuda", dtype="bfloat16", speculative_config=spec,
                                    max_tokens=24, alone=k == 1, chat=False, batch_invariant=True,
                                    max_num_batched_tokens=64)
        for name in ["spec", "alone"] if k == 1 else ["spec"]:
            assert report.counts(name)["identical"] == len(prompts), f"k={k} {name}: {report.failures()}"
        assert report.runs["spec"]["stats"]["num_accepted_tokens"] > 0
        gc.collect()
        torch.cuda.empty_cache()
