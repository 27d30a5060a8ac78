"""Where a SmolLM2- or Llama-8B-shaped decode step spends GPU time, default path vs
LLM(batch_invariant=True): random weights, eager (enforce_eager, so torch.profiler sees every
kernel), batch B, 32-token prompts, 17 new tokens; the top CUDA kernels of each mode by total time.

    python3 benchmarks/profile_invariant_decode.py 64 [smollm2|llama8b]
"""
from __future__ import annotations

import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import LLAMA8B_HF, SMOLLM2_HF, llm_from_model, random_llama  # noqa: E402

from pyengine import SamplingParams  # noqa: E402


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    shape = sys.argv[2] if len(sys.argv) > 2 else "smollm2"
    model, cfg = random_llama(LLAMA8B_HF if shape == "llama8b" else SMOLLM2_HF, torch.bfloat16)
    for invariant in (False, True):
        llm = llm_from_model(model, cfg, device="cuda", num_kv_blocks=4096, max_model_len=1024, max_num_seqs=batch,
                             batch_invariant=invariant, dtype=torch.bfloat16, enforce_eager=True)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, cfg.vocab_size - 1, (32,), generator=g).tolist() for _ in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=17, ignore_eos=True), use_tqdm=False)
        print("==== batch_invariant", invariant)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
