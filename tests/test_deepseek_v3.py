"""DeepSeek-V3 (MLA + MoE): tiny random HF checkpoints as the oracle - logits and greedy tokens ==
transformers with dense and MoE layers, group-limited routing, q_lora on and off, YaRN; fp8 block-
scaled checkpoints; loading errors that name the tensor."""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pyengine import LLM, SamplingParams
from pyengine.loader import load_model
from pyengine.models.moe import MoEConfig, route
from tests.tiny_models import DEEPSEEK_V3, YARN_ROPE, make_deepseek_checkpoint
from tests.utils_paged import make_meta

CASES = {
    "moe_q_lora": {},
    "no_q_lora_yarn": dict(q_lora_rank=None, rope_parameters=YARN_ROPE, rope_interleave=False),
    "dense_only": dict(first_k_dense_replace=3),
}
PROMPT = [5, 17, 3, 88, 41, 41, 9, 60, 2, 33, 71, 12, 7, 50, 29, 94, 18, 3, 66, 40, 21]


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = make_deepseek_checkpoint(path, **CASES[request.param])
    return request.param, path, hf


def _latent_caches(config, num_blocks: int, block_size: int) -> list[torch.Tensor]:
    width = config.kv_lora_rank + config.qk_rope_head_dim
    return [torch.full((num_blocks, block_size, width), float("nan")) for _ in range(config.num_hidden_layers)]


def test_prefill_logits_match(pair) -> None:
    case, path, hf = pair
    model, config, _ = load_model(path, "cpu", torch.float32)
    meta, positions = make_meta([([7, 2, 11, 0, 5, 3], 0, len(PROMPT))], 4)
    logits = model.compute_logits(model(torch.tensor(PROMPT), positions, meta, _latent_caches(config, 16, 4)))
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=2e-4)
    assert (config.first_k_dense_replace >= config.num_hidden_layers) == (case == "dense_only")
    assert (config.q_lora_rank is None) == (case == "no_q_lora_yarn")


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_greedy_matches_hf(pair, block_size: int) -> None:
    case, path, hf = pair
    prompts = [PROMPT, PROMPT[3:9], [4]]
    llm = LLM(path, device="cpu", block_size=block_size, max_num_batched_tokens=8)  # chunked prefill
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref, case


def test_group_limited_routing_matches_hf() -> None:
    """route() == transformers' router on logits where group limits change the choice."""
    cfg = transformers.DeepseekV3Config(**DEEPSEEK_V3)
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(cfg)
    torch.manual_seed(0)
    hidden = torch.randn(64, cfg.hidden_size)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(0, 0.5)
        _, ref_w, ref_ids = router(hidden)
    ours = MoEConfig(num_experts=8, top_k=3, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                     n_shared_experts=1, moe_intermediate_size=32)
    ids, w = route(hidden @ router.weight.t(), router.e_score_correction_bias, ours)
    order_ref, order = ref_ids.argsort(-1), ids.argsort(-1)
    assert torch.equal(ref_ids.gather(1, order_ref), ids.gather(1, order))
    torch.testing.assert_close(ref_w.gather(1, order_ref), w.gather(1, order), atol=1e-6, rtol=1e-6)
    # the group limit matters: plain top-3 over all experts picks differently for some tokens
    plain = (torch.sigmoid(hidden @ router.weight.t()) + router.e_score_correction_bias).topk(3).indices
    assert not torch.equal(plain.sort(-1).values, ids.sort(-1).values)


def _fp8_copy(src: str, dst: str) -> dict[str, torch.Tensor]:
    """dst: src with every 2-D linear weight stored as e4m3 codes + 128x128 block scales; returns
    the dequantised values the loader must reproduce."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name != "model.safetensors":
            with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
                g.write(f.read())
    weights, out, expected = load_file(os.path.join(src, "model.safetensors")), {}, {}
    for name, w in weights.items():
        if w.dim() == 2 and ("_proj" in name):  # every linear of the layers (DeepSeek's fp8 set)
            rows, cols = w.shape
            scale = torch.rand(-(-rows // 128), -(-cols // 128)) * 0.01 + 0.005
            full = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
            codes = (w / full).to(torch.float8_e4m3fn)
            out[name], out[name + "_scale_inv"] = codes, scale
            expected[name] = codes.float() * full
        else:
            out[name] = w
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return expected


def test_fp8_block_scaled_checkpoint_loads(tmp_path) -> None:
    src, dst = str(tmp_path / "bf"), str(tmp_path / "fp8")
    make_deepseek_checkpoint(src, kv_lora_rank=160, q_lora_rank=200)  # dims past one 128 block
    expected = _fp8_copy(src, dst)
    model, config, _ = load_model(dst, "cpu", torch.float32)
    attn = model.layers[1].self_attn
    dense = {"q_a_proj": attn.q_a_proj, "kv_a_proj_with_mqa": attn.kv_a_proj}
    with torch.inference_mode():
        x = torch.eye(config.hidden_size)
        for hf_name, ours in dense.items():
            ref = expected[f"model.layers.1.self_attn.{hf_name}.weight"]
            got = ours(x) if not isinstance(ours, torch.Tensor) else x @ ours
            torch.testing.assert_close(got, ref.t(), atol=0, rtol=0)


def test_loading_errors_name_the_tensor(tmp_path) -> None:
    path = str(tmp_path / "m")
    make_deepseek_checkpoint(path)
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    missing = dict(weights)
    del missing["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(missing, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.5\.up_proj"):
        load_model(path, "cpu", torch.float32)
    bad = dict(weights)
    bad["model.layers.0.self_attn.kv_b_proj.weight"] = torch.zeros(3, 3)
    save_file(bad, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"kv_b_proj"):
        load_model(path, "cpu", torch.float32)
    fp8 = dict(weights)
    fp8["model.layers.0.mlp.gate_proj.weight"] = weights["model.layers.0.mlp.gate_proj.weight"].to(torch.float8_e4m3fn)
    save_file(fp8, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"mlp\.gate_proj\.weight has no .*_scale_inv"):
        load_model(path, "cpu", torch.float32)
    save_file(weights, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="unsupported quantization_config"):
        load_model(path, "cpu", torch.float32)


def test_mtp_needs_mtp_layers(tmp_path) -> None:
    path = str(tmp_path / "m")
    make_deepseek_checkpoint(path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = 0
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="needs a model with MTP layers"):
        LLM(path, device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 2})


@pytest.mark.parametrize("rank,rope", [(512, 64), (32, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_mla_attention_matches_reference(rank: int, rope: int, dtype: torch.dtype) -> None:
    """The CPU MLA path (the C++ GQA kernel over the latent cache) == the PyTorch reference, at
    DeepSeek-V3's widths and a tiny one; and a row's bits do not depend on its neighbours."""
    from pyengine import ops
    from pyengine.ops import reference

    torch.manual_seed(0)
    block_size, heads = 16, 8
    cache = torch.randn(12, block_size, rank + rope).to(dtype)
    rows = [([3, 7, 1], 30, 4), ([0, 5, 9, 2], 50, 1), ([11, 4], 0, 20)]
    meta, _ = make_meta(rows, block_size)
    q = torch.randn(meta.num_tokens, heads, rank + rope).to(dtype)
    out, lse = ops.paged_attention_mla(q, cache, meta, 0.05, return_lse=True, kv_lora_rank=rank)
    ref, ref_lse = reference.paged_attention_mla(q, cache, meta, 0.05, return_lse=True, kv_lora_rank=rank)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    alone_meta, _ = make_meta(rows[1:2], block_size)
    alone = ops.paged_attention_mla(q[4:5], cache, alone_meta, 0.05, kv_lora_rank=rank)
    assert torch.equal(alone, out[4:5])


@pytest.mark.parametrize("widths,dtype,expected", [
    (dict(kv_lora_rank=512, qk_rope_head_dim=64), torch.bfloat16, True),
    (dict(kv_lora_rank=512, qk_rope_head_dim=64), torch.float16, True),
    (dict(kv_lora_rank=512, qk_rope_head_dim=64), torch.float32, False),  # MLA reference: torch's GEMMs
    ({}, torch.bfloat16, False),  # the tiny widths: no MLA kernel
])
def test_batch_invariant_on_cuda_only_where_the_mla_kernel_runs(widths: dict, dtype: torch.dtype,
                                                                expected: bool) -> None:
    """LLM(batch_invariant=True) on CUDA reads the model's batch_invariant_on_cuda: every GEMM of
    DeepSeek-V3 has an invariant kernel, attention only at the MLA kernel's widths and dtypes."""
    from pyengine.models.deepseek_v3 import DeepseekV3ForCausalLM, deepseek_v3_model_config

    hf = transformers.DeepseekV3Config(**dict(DEEPSEEK_V3, **widths)).to_dict()
    hf["architectures"] = ["DeepseekV3ForCausalLM"]
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(deepseek_v3_model_config(hf), dtype)
    assert model.batch_invariant_on_cuda is expected
