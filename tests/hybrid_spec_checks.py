"""Losslessness checks shared by the recurrent-state (hybrid) model tests: Mamba2, Bamba and
NemotronH run the same speculative paths through the state pool."""
from __future__ import annotations

import functools
from typing import Any

import torch

from pyengine import LLM, SamplingParams
from pyengine.engine.state_cache import StateCache

from tests.spec_harness import assert_lossless, run
from tests.test_spec_decode import make_prompts, scripted
from tests.tiny_models import write_tokenizer


def make_hybrid_checkpoint(path: str, hf_class: type, hf_config: Any, seed: int, out_proj_names: tuple[str, ...],
                           out_std: float, dt_bias_mean: float = 0.0, dt_bias_std: float = 0.5) -> torch.nn.Module:
    """A tiny random HF model of hf_class (weights: init_hybrid_weights) saved to path with the
    test tokenizer; returns the HF model, the oracle."""
    torch.manual_seed(seed)
    hf = hf_class(hf_config).eval()
    init_hybrid_weights(hf, out_proj_names, out_std, dt_bias_mean, dt_bias_std)
    hf.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return hf


def state_pool_llm(path: str) -> tuple[LLM, StateCache]:
    """An ngram (k = 3) LLM over a hybrid model with 4 sequences and prefix caching: the state pool
    holds 1 + k slots per sequence, then 8 checkpoint slots (slots 16..23)."""
    llm = LLM(model=path, device="cpu", max_model_len=64, max_num_seqs=4, enable_prefix_caching=True,
              num_state_checkpoints=8,
              speculative_config={"method": "ngram", "adaptive_draft_length": False, "num_speculative_tokens": 3})
    assert llm.engine.cfg.enable_prefix_caching is True
    assert llm.engine.cfg.num_state_slots == 4 * (1 + 3) and llm.engine.cfg.num_state_checkpoints == 8
    assert llm.engine.cfg.state_checkpoint_interval == 256  # the default, in whole 16-token blocks
    cache = llm.engine.runner.state_cache
    assert isinstance(cache, StateCache) and (cache.num_running_slots, cache.num_checkpoints, cache.num_slots) == (16, 8, 24)
    return llm, cache


@torch.no_grad()
def init_hybrid_weights(hf: torch.nn.Module, out_proj_names: tuple[str, ...], out_std: float,
                        dt_bias_mean: float = 0.0, dt_bias_std: float = 0.5) -> None:
    """Random weights for a tiny Mamba2-family model: decays in a realistic range, well separated
    logits for greedy, and small mixer outputs (the parameters ending in out_proj_names), so greedy
    decoding falls into near-bigram loops where prompt lookup finds matches while the state still
    moves the logits."""
    for name, p in hf.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 4.0)))
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn_like(p) * dt_bias_std + dt_bias_mean)
        elif "norm" in name or name.endswith(".D"):
            p.copy_(1.0 + 0.2 * torch.randn_like(p))
        elif name.endswith(out_proj_names):
            p.normal_(0.0, out_std)
        else:
            p.normal_(0.0, 0.2)


def check_greedy_matches_hf_generate(path: str, hf: torch.nn.Module) -> None:
    """Greedy tokens (chunked prefill, block size 4) equal HF transformers' generate."""
    prompts = [[5, 9, 33, 2, 71, 14], [40], [8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 12]]
    llm = LLM(model=path, device="cpu", max_model_len=128, block_size=4, max_num_batched_tokens=8)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    hf.generation_config.eos_token_id = None  # like ignore_eos: EOS neither stops nor is suppressed
    for prompt, out in zip(prompts, outs):
        gen = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        assert out.outputs[0].token_ids == gen[0, len(prompt):].tolist()


SCRIPTED_CASES = [
    ("every_acceptance_count", [0, 1, 2, 3], 64),
    ("no_drafts_right_after_an_accepted_run", [3, -1, 1, -1, 2], 64),
    ("mixed_prefill_and_verify", [2, 3, 0], 12),
]


@functools.lru_cache(maxsize=None)
def plain(path: str, n: int, max_tokens: int, seed: int = 0) -> tuple[list[list[int]], ...]:
    prompts = make_prompts(n, seed)
    return tuple(run(path, prompts, max_tokens=max_tokens, block_size=4, max_model_len=128)[0])


def plain_from(path: str, prompts: list[list[int]]) -> list[list[int]]:
    return run(path, prompts, max_tokens=24, block_size=4, max_model_len=128)[0]


def check_ngram_ragged(path: str) -> None:
    """ngram spec == plain at batch 8, block size 4, k = 3, with ragged steps."""
    # Prompts that end in the model's own greedy continuation: rows that fell into a loop get
    # prompt-lookup hits, the others none (ragged steps).
    prompts = [p + out[:16] for p, out in zip(make_prompts(8), plain(path, 8, 24))]
    spec = {"method": "ngram", "adaptive_draft_length": False, "num_speculative_tokens": 3,
            "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    outs, stats, rec, llm = run(path, prompts, max_tokens=24, spec=spec, block_size=4, max_model_len=128,
                                max_num_batched_tokens=32)
    assert_lossless(llm, prompts, plain_from(path, prompts), outs)
    assert stats["num_accepted_tokens"] > 0, "speculation never accepted anything: the test proves nothing"
    assert rec.had_ragged_step(), "no step mixed rows with drafts and rows without"


def check_scripted(path: str, name: str, pattern: list[int], budget: int) -> None:
    """Scripted drafts force acceptance patterns; the output must equal plain decoding."""
    k = 3
    prompts = make_prompts(8, seed=1)
    ref = list(plain(path, 8, 24, 1))
    reference = {i: (len(p), out) for i, (p, out) in enumerate(zip(prompts, ref))}
    spec = {"method": "scripted", "num_speculative_tokens": k, "script": scripted(reference, k, pattern)}
    outs, _, rec, _ = run(path, prompts, max_tokens=24, spec=spec, block_size=4, max_model_len=128,
                          max_num_batched_tokens=budget)
    assert outs == ref
    full = [c for _, _, d, c in rec.verify_rows() if d == k]
    if name == "every_acceptance_count":
        assert {c - 1 for c in full} == set(range(k + 1)), "not every acceptance count 0..k occurred"
    if name == "no_drafts_right_after_an_accepted_run":
        assert rec.had_ragged_step()
        assert any(c == k + 1 for c in full)
    if name == "mixed_prefill_and_verify":
        assert rec.had_mixed_step(), "no step mixed prefill chunks with verify rows"
