"""Tiny random HF checkpoints (safetensors + a word-level tokenizer) for CPU tests."""
from __future__ import annotations

import json
import os
import random

import torch
import transformers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
               num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

CASES = {
    "llama_gqa_untied": (transformers.LlamaConfig, dict(_COMMON, tie_word_embeddings=False)),
    "llama3_rope_tied": (transformers.LlamaConfig, dict(_COMMON, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    # head_dim 16: the CPU layer-stack path (pyengine/models/llama_cpu_stack.py) takes it.
    "llama_head_dim16": (transformers.LlamaConfig, dict(_COMMON, num_attention_heads=4, tie_word_embeddings=False)),
    "qwen2_bias": (transformers.Qwen2Config, dict(_COMMON, tie_word_embeddings=False)),
    "qwen3_qk_norm": (transformers.Qwen3Config, dict(_COMMON, head_dim=16, num_key_value_heads=4, tie_word_embeddings=True)),
}


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Mixed lengths 1..40; for n > 1 some share a 20-token prefix and two are identical, so prefix
    caching hits (whole-prompt hits included) when prompts are admitted over several steps."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(20)]
    prompts = []
    for i in range(n):
        if n > 1 and i % 3 == 1:
            prompts.append(shared + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))])
        else:
            prompts.append([rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 40))])
    if n > 2:
        prompts[-1] = list(prompts[1])
    return prompts


def write_tokenizer(path: str) -> None:
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "t2", "bos_token": "t1"}, f)


def make_checkpoint(case: str, path: str, seed: int = 0) -> torch.nn.Module:
    """Save a random model of `case` (and its tokenizer) to `path`; returns the HF model."""
    config_cls, kwargs = CASES[case]
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(**kwargs), dtype=torch.float32).eval()
    with torch.no_grad():  # larger-than-init weights so logits are well separated for greedy
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    hf.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return hf


def _save_with_mtp(path: str, weights: dict[str, torch.Tensor]) -> None:
    """Rewrite the checkpoint with its MTP layer's tensors and num_nextn_predict_layers = 1."""
    from safetensors.torch import save_file

    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg_file = os.path.join(path, "config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = 1
    with open(cfg_file, "w") as f:
        json.dump(cfg, f, indent=2)


# ---------------------------------------------------------------- DeepSeek-V3 (MLA + MoE + MTP)

DEEPSEEK_V3 = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                   n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
                   qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=16, n_group=4, topk_group=2,
                   num_experts_per_tok=3, first_k_dense_replace=1, max_position_embeddings=512)
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}


def make_deepseek_checkpoint(path: str, seed: int = 0, mtp_agreement: float | None = None,
                             layer_scale: float = 1.0, **overrides) -> torch.nn.Module:
    """A random DeepseekV3ForCausalLM (dense layer 0, MoE after; DEEPSEEK_V3 updated by overrides)
    saved to `path`. layer_scale < 1 shrinks every layer's output projections (o_proj and the
    down projections): the token embedding then dominates the residual stream and the next token
    depends mostly on the current one. mtp_agreement: also store an MTP layer (model.layers.{N}.*) built to agree with
    the target that often-ish: it reads mostly the token (eh_proj = [I ; mtp_agreement-scaled noise]),
    its decoder layer is damped, and its head and norm are the target's. Returns the HF model."""
    from safetensors.torch import load_file

    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**dict(DEEPSEEK_V3, **overrides)),
                                                       dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in list(hf.named_parameters()) + list(hf.named_buffers()):
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "e_score_correction_bias" in name:
                p.normal_(0.0, 0.1)
            elif p.is_floating_point() and "inv_freq" not in name:
                p.normal_(0.0, 0.15 * (layer_scale if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj"))
                                       else 1.0))
    hf.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    if mtp_agreement is not None:
        file = os.path.join(path, "model.safetensors")
        weights = load_file(file)
        n, hidden = hf.config.num_hidden_layers, hf.config.hidden_size
        src, dst = f"model.layers.{n - 1}.", f"model.layers.{n}."
        gen = torch.Generator().manual_seed(seed + 1)
        for name in [k for k in weights if k.startswith(src)]:
            t = weights[name].clone()
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                t *= 0.1
            weights[dst + name[len(src):]] = t
        eye = torch.eye(hidden)
        weights.update({
            dst + "enorm.weight": torch.ones(hidden), dst + "hnorm.weight": torch.ones(hidden),
            dst + "eh_proj.weight": torch.cat([eye, mtp_agreement * torch.randn(hidden, hidden, generator=gen)], 1),
            dst + "shared_head.norm.weight": weights["model.norm.weight"].clone(),
            dst + "shared_head.head.weight": weights["lm_head.weight"].clone(),
            dst + "embed_tokens.weight": weights["model.embed_tokens.weight"].clone()})
        _save_with_mtp(path, weights)
    return hf


# ---------------------------------------------------------------- Qwen3-Next (Gated DeltaNet hybrid + MTP)

QWEN3_NEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                  linear_value_head_dim=24, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                  max_position_embeddings=512, full_attention_interval=2)


def make_qwen3_next_checkpoint(path: str, seed: int = 0, mtp_agreement: float | None = None,
                               layer_scale: float = 1.0, **overrides) -> torch.nn.Module:
    """A random Qwen3NextForCausalLM (linear / full attention alternating, MoE every layer;
    QWEN3_NEXT updated by overrides) saved to `path`; layer_scale and mtp_agreement as in
    make_deepseek_checkpoint (the MTP layer: Qwen3-Next's mtp.* names). Returns the HF model."""
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3NextConfig(**dict(QWEN3_NEXT, **overrides)),
                                                       dtype=torch.float32).eval()
    _init_qwen_hybrid(hf, layer_scale)
    hf.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    if mtp_agreement is not None:
        _add_qwen_mtp(path, hf.config, mtp_agreement, seed)
    return hf


@torch.no_grad()
def _init_qwen_hybrid(hf: torch.nn.Module, layer_scale: float) -> None:
    """Qwen3-Next / Qwen3.5 random weights: zero-centred norms near 0 (the gated norm near 1),
    decays in a realistic range, output projections scaled by layer_scale."""
    for name, p in hf.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(0.2 * torch.randn_like(p) + (1.0 if "linear_attn.norm" in name else 0.0))
        elif name.endswith("A_log"):
            p.copy_(torch.log(torch.rand_like(p) * 4 + 0.5))
        elif name.endswith("dt_bias"):
            p.normal_(0.0, 0.5)
        else:
            out = name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj", "out_proj.weight"))
            p.normal_(0.0, 0.15 * (layer_scale if out else 1.0))


QWEN3_5 = {k: v for k, v in QWEN3_NEXT.items() if k != "full_attention_interval"}
QWEN3_5_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2)


def make_qwen3_5_checkpoint(path: str, moe: bool, multimodal: bool, seed: int = 0, layer_scale: float = 1.0,
                            mtp_agreement: float | None = None) -> torch.nn.Module:
    """A random Qwen3.5 text model (Qwen3_5[Moe]ForCausalLM) or a multimodal one with a tiny vision
    tower (Qwen3_5[Moe]ForConditionalGeneration), saved to path; a text model may get an MTP layer
    (mtp_agreement, as make_qwen3_next_checkpoint). Returns the HF model."""
    text = dict(QWEN3_5) if moe else {k: v for k, v in QWEN3_5.items()
                                      if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                   "shared_expert_intermediate_size")}
    torch.manual_seed(seed)
    if multimodal:
        cfg_cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
        model_cls = transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
        hf = model_cls(cfg_cls(text_config=text, vision_config=QWEN3_5_VISION))
    else:
        cfg_cls = transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig
        model_cls = transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM
        hf = model_cls(cfg_cls(**text))
    hf = hf.float().eval()
    _init_qwen_hybrid(hf, layer_scale)
    hf.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    if mtp_agreement is not None:
        assert not multimodal, "the MTP helper writes a text checkpoint's names"
        _add_qwen_mtp(path, hf.config, mtp_agreement, seed)
    return hf


def _add_qwen_mtp(path: str, config, mtp_agreement: float, seed: int) -> None:
    """Store a Qwen3-Next-style MTP layer (mtp.*) in a text checkpoint: a copy of its last
    full-attention layer (output projections damped), fc = [I ; mtp_agreement-scaled noise], the
    target's final norm."""
    from safetensors.torch import load_file

    weights = load_file(os.path.join(path, "model.safetensors"))
    hidden = config.hidden_size
    src = f"model.layers.{[i for i, t in enumerate(config.layer_types) if t == 'full_attention'][-1]}."
    gen = torch.Generator().manual_seed(seed + 1)
    for name in [k for k in weights if k.startswith(src)]:
        t = weights[name].clone()
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t *= 0.1
        weights["mtp.layers.0." + name[len(src):]] = t
    weights.update({
        "mtp.pre_fc_norm_embedding.weight": torch.zeros(hidden), "mtp.pre_fc_norm_hidden.weight": torch.zeros(hidden),
        "mtp.fc.weight": torch.cat([torch.eye(hidden), mtp_agreement * torch.randn(hidden, hidden, generator=gen)], 1),
        "mtp.norm.weight": weights["model.norm.weight"].clone()})
    _save_with_mtp(path, weights)
