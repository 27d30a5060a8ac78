"""GPU recurrent-state kernels (hipkernels/ssm/causal_conv1d.hip and ssm_state.hip via the pyengine.ops facade) against the PyTorch
references on random mixed batches (verify rows with random acceptance, T = 1 rows, PAD rows, slot
pools with unowned slots), and Mamba2 spec == plain end to end on the GPU. Skipped without a GPU."""
from __future__ import annotations

import random

import pytest
import torch

from pyengine import ops
from pyengine.ops import reference as ref

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)
try:
    from pyengine.ops import cuda as cuda_ops
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def random_rows(rng: random.Random, num_rows: int, k: int, num_slots: int, pad_rows: int = 1):
    """Slot rows (distinct slots, some PAD rows), acceptance a in [1, 1+k], T in {1, 1+k} per row."""
    per = 1 + k
    slots = rng.sample(range(num_slots), num_rows * per)
    idx = [slots[i * per:(i + 1) * per] for i in range(num_rows)] + [[ref.PAD] * per] * pad_rows
    lens = [rng.choice([1, per]) for _ in idx]
    acc = [rng.randint(1, per) for _ in idx]
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    dev = "cuda"
    return (torch.tensor(qsl, dtype=torch.int32, device=dev), torch.tensor(idx, dtype=torch.int32, device=dev),
            torch.tensor(acc, dtype=torch.int32, device=dev), qsl[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width,k,dim", [(4, 3, 200), (4, 0, 200), (2, 0, 64), (6, 7, 33), (6, 3, 64), (4, 5, 96),
                                         (3, 1, 5120), (4, 1, 36)])
def test_causal_conv1d_update_matches_reference(dtype, width: int, k: int, dim: int) -> None:
    """Covers the kernel's paths: 8-byte channel vectors (dim a multiple of 4) or one channel per
    thread (dim 33), W == 4 (vector weight loads) or not; for W == 4 rows of up to 4 tokens
    without a chunk loop (k = 0, 1, 3) and rows of more than 4 tokens (k = 5: the inputs are
    loaded 4 tokens at a time; k = 7 at W = 6)."""
    rng, gen = random.Random(width * 10 + k), torch.Generator(device="cuda").manual_seed(k)
    qsl, idx, acc, ntok = random_rows(rng, 12, k, 12 * (1 + k) + 5)
    pool = torch.randn(12 * (1 + k) + 5, width - 1 + k, dim, device="cuda", generator=gen).to(dtype)
    x = torch.randn(ntok, dim, device="cuda", generator=gen).to(dtype)
    w = torch.randn(dim, width, device="cuda", generator=gen).to(dtype)
    b = torch.randn(dim, device="cuda", generator=gen).to(dtype)
    pool_ref = pool.clone()
    y = ops.causal_conv1d_update(x, pool, w, b, qsl, idx, acc)
    y_ref = ref.causal_conv1d_update(x, pool_ref, w, b, qsl, idx, acc)
    torch.testing.assert_close(y.float(), y_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(pool, pool_ref), "state windows differ (a pure copy: must be bit-identical)"


def test_causal_conv1d_update_pdl_launch_and_converted_weights() -> None:
    """The CUDA launch is a programmatic dependent launch by default (the kernel may start while
    the kernel before it finishes, and reads nothing before that one's writes are visible): fp32
    weights and bias with bf16 inputs are converted by the wrapper right before the launch, and the
    result equals an ordinary launch (pdl=False) and the reference, bit for bit where it must."""
    rng, gen = random.Random(3), torch.Generator(device="cuda").manual_seed(3)
    W, k, dim, dtype = 4, 3, 5120, torch.bfloat16
    qsl, idx, acc, ntok = random_rows(rng, 64, k, 64 * (1 + k) + 5)
    pool = torch.randn(64 * (1 + k) + 5, W - 1 + k, dim, device="cuda", generator=gen).to(dtype)
    x = torch.randn(ntok, dim, device="cuda", generator=gen).to(dtype)
    w = torch.randn(dim, W, device="cuda", generator=gen)  # fp32: converted per call
    b = torch.randn(dim, device="cuda", generator=gen)
    pool_plain, pool_ref = pool.clone(), pool.clone()
    y = ops.causal_conv1d_update(x, pool, w, b, qsl, idx, acc)
    y_plain = cuda_ops.causal_conv1d_update(x, pool_plain, w, b, qsl, idx, acc, pdl=False)
    y_ref = ref.causal_conv1d_update(x, pool_ref, w.to(dtype), b.to(dtype), qsl, idx, acc)
    assert torch.equal(y, y_plain) and torch.equal(pool, pool_plain)
    torch.testing.assert_close(y.float(), y_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(pool, pool_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows,k", [(40, 3), (100, 0), (100, 3)])
def test_causal_conv1d_update_batch_invariant_and_empty_rows(dtype, num_rows: int, k: int) -> None:
    """Each row's output and window are bit-identical whether it runs alone or in a batch; a row
    with no tokens (and a PAD row) leaves its window untouched, as in the reference (the last of
    the rows is PAD)."""
    rng, gen = random.Random(5 + num_rows + k), torch.Generator(device="cuda").manual_seed(5)
    W, dim = 4, 5120
    qsl, idx, acc, ntok = random_rows(rng, num_rows, k, num_rows * (1 + k) + 3)
    lens = (qsl[1:] - qsl[:-1]).tolist()
    lens[7] = 0  # an empty row
    qsl = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    ntok = int(qsl[-1])
    pool = torch.randn(num_rows * (1 + k) + 3, W - 1 + k, dim, device="cuda", generator=gen).to(dtype)
    x = torch.randn(ntok, dim, device="cuda", generator=gen).to(dtype)
    w = torch.randn(dim, W, device="cuda", generator=gen).to(dtype)
    b = torch.randn(dim, device="cuda", generator=gen).to(dtype)
    pool_batch, pool_ref = pool.clone(), pool.clone()
    y = ops.causal_conv1d_update(x, pool_batch, w, b, qsl, idx, acc)
    y_ref = ref.causal_conv1d_update(x, pool_ref, w, b, qsl, idx, acc)
    torch.testing.assert_close(y.float(), y_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(pool_batch, pool_ref)
    for n in range(idx.shape[0]):
        s, e = int(qsl[n]), int(qsl[n + 1])
        pool_one = pool.clone()
        qsl_one = torch.tensor([0, e - s], dtype=torch.int32, device="cuda")
        y_one = ops.causal_conv1d_update(x[s:e], pool_one, w, b, qsl_one, idx[n:n + 1], acc[n:n + 1])
        assert torch.equal(y_one, y[s:e]), f"row {n}: output depends on the batch"
        line = int(idx[n, 0])
        if line >= 0:
            assert torch.equal(pool_one[line], pool_batch[line]), f"row {n}: window depends on the batch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_fn_matches_reference(dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    W, k, dim, lens = 4, 3, 96, [1, 2, 9, 40, 3]
    qsl = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    idx = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [ref.PAD] * 4, [8, 9, 10, 11], [12, 13, 14, 15]],
                       dtype=torch.int32, device="cuda")
    acc = torch.tensor([1, 3, 1, 4, 2], dtype=torch.int32, device="cuda")
    init = torch.tensor([True, True, False, False, True], device="cuda")
    pool = torch.randn(18, W - 1 + k, dim, device="cuda", generator=gen).to(dtype)
    x = torch.randn(sum(lens), dim, device="cuda", generator=gen).to(dtype)
    w, b = torch.randn(dim, W, device="cuda", generator=gen).to(dtype), torch.randn(dim, device="cuda").to(dtype)
    pool_ref = pool.clone()
    y = ops.causal_conv1d_fn(x, pool, w, b, qsl, idx, acc, init)
    y_ref = ref.causal_conv1d_fn(x, pool_ref, w, b, qsl, idx, acc, init)
    torch.testing.assert_close(y.float(), y_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(pool, pool_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,P,N,G,k,with_z", [(8, 16, 16, 2, 3, True), (80, 64, 128, 1, 3, False),
                                              (4, 5, 40, 4, 0, True), (4, 6, 18, 2, 1, False),
                                              (2, 8, 256, 1, 2, True)])
def test_selective_state_update_matches_reference(dtype, H, P, N, G, k, with_z) -> None:
    rng, gen = random.Random(H + k), torch.Generator(device="cuda").manual_seed(N)
    qsl, idx, acc, ntok = random_rows(rng, 9, k, 9 * (1 + k) + 4)
    state = torch.randn(9 * (1 + k) + 4, H, P, N, device="cuda", generator=gen)
    x = torch.randn(ntok, H, P, device="cuda", generator=gen).to(dtype)
    dt = torch.randn(ntok, H, device="cuda", generator=gen).to(dtype)
    B, C = (torch.randn(ntok, G, N, device="cuda", generator=gen).to(dtype) for _ in range(2))
    z = torch.randn(ntok, H, P, device="cuda", generator=gen).to(dtype) if with_z else None
    A = -torch.rand(H, device="cuda", generator=gen) - 0.1
    D, dt_bias = torch.randn(H, device="cuda", generator=gen), torch.randn(H, device="cuda", generator=gen)
    state_ref = state.clone()
    y = ops.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, qsl, idx, acc)
    y_ref = ref.selective_state_update(state_ref, x, dt, A, B, C, D, z, dt_bias, qsl, idx, acc)
    tol = TOL[dtype]
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol * 10, rtol=tol)
    torch.testing.assert_close(state, state_ref, atol=1e-4, rtol=1e-4)
    untouched = torch.ones(state.shape[0], dtype=torch.bool)
    untouched[idx[idx >= 0].long().cpu()] = False
    assert torch.equal(state[untouched.cuda()], state_ref[untouched.cuda()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,P,N,G", [(8, 16, 16, 2), (80, 64, 128, 1), (3, 5, 18, 1)])
def test_prefill_scan_matches_chunked_reference(dtype, H, P, N, G) -> None:
    """The GPU prefill scan (final state only) against the chunked reference: varlen rows with and
    without an initial state read at offset a - 1, an empty row and a PAD row."""
    gen = torch.Generator(device="cuda").manual_seed(H * N)
    lens = [1, 37, 0, 300, 5, 64]
    qsl = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    idx = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [ref.PAD] * 3, [12, 13, 14]],
                       dtype=torch.int32, device="cuda")
    acc = torch.tensor([1, 3, 1, 2, 1, 1], dtype=torch.int32, device="cuda")
    init = torch.tensor([True, True, True, False, True, True], device="cuda")
    ntok = sum(lens)
    state = torch.randn(17, H, P, N, device="cuda", generator=gen)
    x = torch.randn(ntok, H, P, device="cuda", generator=gen).to(dtype)
    dt = torch.randn(ntok, H, device="cuda", generator=gen).to(dtype)
    B, C = (torch.randn(ntok, G, N, device="cuda", generator=gen).to(dtype) for _ in range(2))
    A = -torch.rand(H, device="cuda", generator=gen) - 0.1
    D, dt_bias = torch.randn(H, device="cuda", generator=gen), torch.randn(H, device="cuda", generator=gen)
    state_ref = state.clone()
    y = ops.ssd_chunk_scan(x, dt, A, B, C, D, None, dt_bias, qsl, state, idx, acc, init, 16)
    y_ref = ref.ssd_chunk_scan(x, dt, A, B, C, D, None, dt_bias, qsl, state_ref, idx, acc, init, 16)
    tol = TOL[dtype]
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol * 10, rtol=tol)
    torch.testing.assert_close(state, state_ref, atol=1e-3, rtol=1e-3)
    # only the first slot of each non-empty, non-PAD row was written
    written = torch.zeros(17, dtype=torch.bool)
    written[[0, 3, 9, 12]] = True
    assert torch.equal(state[~written.cuda()], state_ref[~written.cuda()])
    assert not torch.equal(state[9], torch.zeros_like(state[9])), "final state of the long row not written"


def _checkpoint(name: str, path: str) -> None:
    if name == "mamba2":
        from tests.test_mamba2 import make_mamba2_checkpoint as make
    elif name == "bamba":
        from tests.test_bamba import make_bamba_checkpoint as make
    else:
        from tests.test_nemotron_h import make_nemotron_h_checkpoint as make
    make(path)


@pytest.mark.parametrize("name", ["mamba2", "bamba", "nemotron_h"])
def test_hybrid_spec_equals_plain_on_gpu(tmp_path, name: str) -> None:
    """Scripted drafts (every acceptance count, steps without drafts) == plain, fp32 on the GPU;
    Mamba2 (no attention layers) replays its decode/verify steps as CUDA graphs, and those give
    the eager path's tokens too."""
    from pyengine import SamplingParams
    from tests.scripted_proposer import make_llm
    from tests.test_spec_decode import make_prompts, scripted

    path = str(tmp_path)
    _checkpoint(name, path)
    prompts = make_prompts(8, seed=1)
    kw = dict(block_size=4, max_model_len=128, device="cuda", dtype="float32")

    def go(spec=None, eager=False):
        llm = make_llm(path, spec, enforce_eager=eager, **kw)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        runner = llm.engine.runner.graph_runner
        return [o.outputs[0].token_ids for o in outs], (runner.num_replays if runner is not None else 0)

    plain, replays = go()
    if name == "mamba2":
        assert replays > 0, "Mamba2 decode steps did not replay CUDA graphs"
        assert go(eager=True)[0] == plain
    reference = {i: (len(p), out) for i, (p, out) in enumerate(zip(prompts, plain))}
    spec, spec_replays = go({"method": "scripted", "num_speculative_tokens": 3,
                             "script": scripted(reference, 3, [0, 3, -1, 2, 1])})
    assert spec == plain
    if name == "mamba2":
        assert spec_replays > 0
