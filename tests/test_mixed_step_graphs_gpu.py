"""Steps with prefill rows on CUDA graphs (one prefill-graph replay: decode rows and prefill chunks
in one graph, the attention grid over the rows' own query tiles) on the GPU. Tiny DeepSeek-V3 at
the real MLA widths (graphs on), 64-token prefill chunks so that decode rows share steps with
prefill chunks: tokens equal the eager engine's. Skips without CUDA."""
from __future__ import annotations

import pytest
import torch

from pyengine import LLM, SamplingParams
from tests.test_deepseek_v3_gpu import REAL_MLA
from tests.tiny_models import make_deepseek_checkpoint, make_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dense", [False, True])
def test_mixed_steps_on_graphs_equal_eager(tmp_path, dense: bool) -> None:
    extra = dict(first_k_dense_replace=REAL_MLA.get("num_hidden_layers", 3)) if dense else {}
    make_deepseek_checkpoint(str(tmp_path), layer_scale=0.003, **REAL_MLA, **extra)
    prompts = make_prompts(8, seed=2)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(device="cuda", dtype="bfloat16", block_size=16, max_num_batched_tokens=64)
    eager = [o.outputs[0].token_ids for o in LLM(str(tmp_path), enforce_eager=True, **kw).generate(prompts, params,
                                                                                                use_tqdm=False)]
    graphed = LLM(str(tmp_path), **kw)
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    assert graphed.engine.runner.graph_runner.num_mixed > 0, "no step with prefill rows replayed graphs"
    assert got == eager
