"""The CPU layer stack (csrc/cpu/cpu_llama_stack.h, one C++ call for every decoder layer) against the
op-by-op layer loop of pyengine/models/llama.py: same hidden states and KV caches, bit for bit.
KernelConfig.cpu_layer_stack switches between them at each step."""
from __future__ import annotations

import pytest
import torch

from pyengine.loader import load_model
from pyengine.models.llama_cpu_stack import CpuLlamaStack
from pyengine.ops import cpu as cpu_ops
from pyengine.ops.kernel_config import use_kernel_config
from tests.test_cpu_ops import AVX2_FMA_CPU, GEMM_CPU
from tests.tiny_models import make_checkpoint
from tests.utils_paged import PagedCache, make_meta

needs_packed_gemm = pytest.mark.skipif(not GEMM_CPU, reason="CPU has neither AVX-512 nor AVX2 + FMA for the packed GEMM")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("llama_head_dim16"))
    make_checkpoint("llama_head_dim16", path, seed=3)
    return path


def _step(model, rows, cache: PagedCache, tokens: torch.Tensor) -> torch.Tensor:
    meta, positions = make_meta(rows, cache.block_size)
    return model(tokens, positions, meta, cache.kv_caches)


@needs_packed_gemm
@pytest.mark.parametrize("avx2_kernels", [False, True], ids=["best_kernels", "avx2_kernels"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_stack_equals_the_layer_loop(checkpoint: str, dtype: torch.dtype, avx2_kernels: bool,
                                           monkeypatch) -> None:
    """Also with KernelConfig.cpu_avx2_kernels (the linears packed for the AVX2 kernels, the stack's
    attention calls told to use its AVX2 kernel)."""
    if avx2_kernels and not AVX2_FMA_CPU:
        pytest.skip("the AVX2 kernels need AVX2 and FMA")
    with use_kernel_config(cpu_avx2_kernels=avx2_kernels):
        model, config, _ = load_model(checkpoint, "cpu", dtype)
    assert not avx2_kernels or model.packed_lm_head.isa == "avx2"
    assert model.cpu_stack is not None
    stack_steps = []  # the steps the C++ stack ran, so the comparison cannot pass with the loop twice
    stack_call = CpuLlamaStack.__call__
    monkeypatch.setattr(CpuLlamaStack, "__call__", lambda self, *a: stack_steps.append(1) or stack_call(self, *a))
    gen = torch.Generator().manual_seed(0)
    caches = {}
    outs: dict[str, list[torch.Tensor]] = {}
    for mode in ("stack", "loop"):
        cache = caches[mode] = PagedCache(config, 40, 4, dtype, seed=1)
        tables: list[list[int]] = [[], [], []]
        for t, n in zip(tables, (13, 9, 30)):
            cache.grow(t, n + 8)
        gen.manual_seed(0)
        # A mixed step (two prefills and a 3-token chunk), then decode and verify-shaped steps.
        steps = [[(tables[0], 0, 13), (tables[1], 0, 9), (tables[2], 0, 3)],
                 [(tables[0], 13, 1), (tables[1], 9, 4), (tables[2], 3, 27)],
                 [(tables[0], 14, 1), (tables[1], 13, 1), (tables[2], 30, 2)]]
        outs[mode] = []
        with use_kernel_config(cpu_layer_stack=mode == "stack", cpu_avx2_kernels=avx2_kernels):
            for rows in steps:
                tokens = torch.randint(0, config.vocab_size, (sum(q for _, _, q in rows),), generator=gen)
                outs[mode].append(_step(model, rows, cache, tokens))
        assert len(stack_steps) == len(steps)  # every step of "stack", none of "loop"
    for a, b in zip(outs["stack"], outs["loop"]):
        assert torch.equal(a, b)
    for (ka, va), (kb, vb) in zip(caches["stack"].kv_caches, caches["loop"].kv_caches):
        torch.testing.assert_close(ka, kb, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(va, vb, rtol=0, atol=0, equal_nan=True)


@needs_packed_gemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_stack_takes_long_prefills_bit_identical_to_the_loop(checkpoint: str, dtype: torch.dtype,
                                                                  monkeypatch) -> None:
    """A step with a 200-token prefill (40000 query-key pairs: before, such steps left the stack
    for the op loop and its SDPA attention) next to a decode row runs in the stack, with the pool
    splitting the long row, and equals the op loop bit for bit; the decode row's hidden state is
    the one it gets in a step of its own."""
    model, config, _ = load_model(checkpoint, "cpu", dtype)
    stack_tokens: list[int] = []  # tokens of the steps the C++ stack ran
    stack_call = CpuLlamaStack.__call__
    monkeypatch.setattr(CpuLlamaStack, "__call__",
                        lambda self, h, *a: stack_tokens.append(h.shape[0]) or stack_call(self, h, *a))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as inside an engine step: the C++ pool (2 threads) splits the work
    cpu_ops.kernels.set_num_threads(2)
    try:
        outs = {}
        for mode in ("stack", "loop", "alone"):
            cache = PagedCache(config, 80, 4, dtype, seed=1)
            long_table: list[int] = []
            short_table: list[int] = []
            cache.grow(long_table, 200)
            cache.grow(short_table, 30)
            gen = torch.Generator().manual_seed(0)
            prompt = torch.randint(0, config.vocab_size, (29,), generator=gen)
            tokens = torch.randint(0, config.vocab_size, (201,), generator=gen)
            with use_kernel_config(cpu_layer_stack=mode != "loop"):
                _step(model, [(short_table, 0, 29)], cache, prompt)
                rows = [(short_table, 29, 1)] + ([(long_table, 0, 200)] if mode != "alone" else [])
                outs[mode] = _step(model, rows, cache, tokens[:sum(q for _, _, q in rows)])
        assert stack_tokens == [29, 201, 29, 1]  # "stack" and "alone" ran in the stack, "loop" never
        assert torch.equal(outs["stack"], outs["loop"])
        assert torch.equal(outs["alone"][:1], outs["stack"][:1])
    finally:
        torch.set_num_threads(threads)
        cpu_ops.kernels.set_num_threads(threads)


@needs_packed_gemm
def test_layer_stack_applies_to_every_step_and_rejects_bad_caches(checkpoint: str) -> None:
    model, config, _ = load_model(checkpoint, "cpu", torch.float32)
    stack = model.cpu_stack
    cache = PagedCache(config, 80, 4, torch.float32)
    table: list[int] = []
    cache.grow(table, 200)
    long_meta, _ = make_meta([(table, 0, 200)], 4)  # 200 x 200 query-key pairs: the kernel's too
    assert stack.applies(long_meta, cache.kv_caches)
    short_meta, positions = make_meta([(table, 0, 5)], 4)
    assert stack.applies(short_meta, cache.kv_caches)
    bf16_cache = PagedCache(config, 80, 4, torch.bfloat16)
    assert not stack.applies(short_meta, bf16_cache.kv_caches)  # a cache of another dtype: the op loop
    h = torch.randn(5, config.hidden_size)
    cos, sin = model.rotary_emb(positions)
    with pytest.raises(ValueError, match="KV caches for 2 layers"):
        stack(h, cos, sin, short_meta, cache.kv_caches[:1])
    bad_table = [t + 1000 for t in table]
    bad_meta, _ = make_meta([(bad_table, 0, 5)], 4)
    with pytest.raises(ValueError, match="outside the cache"):
        stack(h, cos, sin, bad_meta, cache.kv_caches)
