"""The recurrent-state references (pyengine/ops/reference/ssm.py) under speculative decoding:
spec == sequential on random streams (each step T = 1 + k, k in {0, num_spec}, random acceptance),
mixed batches of prefill, plain and verify rows, PAD rows and free slots left bit-identical, and a
guard that reading slot 0 / offset 0 after an accepted run gives a different (wrong) result."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pyengine.ops.reference import ssm as ref

PAD = ref.PAD
K = 3  # num_spec
W, DIM = 4, 6  # conv width, conv channels
H, P, N, G = 4, 3, 5, 2  # heads, head dim, state size, groups


class ConvOp:
    """causal_conv1d_update / causal_conv1d_fn against a token-by-token window."""

    def __init__(self, gen: torch.Generator) -> None:
        self.weight = torch.randn(DIM, W, generator=gen)
        self.bias = torch.randn(DIM, generator=gen)

    def new_pool(self, num_slots: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randn(num_slots, W - 1 + K, DIM, generator=gen)

    def token(self, gen: torch.Generator) -> dict:
        return {"u": torch.randn(DIM, generator=gen)}

    def decode(self, pool, toks, qsl, idx, acc):
        return ref.causal_conv1d_update(toks["u"], pool, self.weight, self.bias, qsl, idx, acc)

    def prefill(self, pool, toks, qsl, idx, acc, init):
        return ref.causal_conv1d_fn(toks["u"], pool, self.weight, self.bias, qsl, idx, acc, init)

    def seq_init(self):
        return []  # accepted inputs so far

    def seq_step(self, hist: list, tok: dict) -> torch.Tensor:
        hist.append(tok["u"])
        window = ([torch.zeros(DIM)] * W + hist)[-W:]
        return F.silu(self.bias + sum(self.weight[:, j] * window[j] for j in range(W)))

    def read_state(self, pool, row: list[int], a: int) -> torch.Tensor:
        return pool[row[0], a - 1:a - 1 + W - 1]

    def seq_state(self, hist: list) -> torch.Tensor:
        return torch.stack(([torch.zeros(DIM)] * W + hist)[-(W - 1):])


class SsmOp:
    """selective_state_update / ssd_chunk_scan against the T = 1 recurrence."""

    def __init__(self, gen: torch.Generator) -> None:
        self.A = -torch.rand(H, generator=gen) - 0.2
        self.D = torch.randn(H, generator=gen)
        self.dt_bias = torch.randn(H, generator=gen) * 0.5

    def new_pool(self, num_slots: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randn(num_slots, H, P, N, generator=gen)

    def token(self, gen: torch.Generator) -> dict:
        return {"x": torch.randn(H, P, generator=gen), "dt": torch.randn(H, generator=gen),
                "B": torch.randn(G, N, generator=gen), "C": torch.randn(G, N, generator=gen),
                "z": torch.randn(H, P, generator=gen)}

    def decode(self, pool, t, qsl, idx, acc):
        return ref.selective_state_update(pool, t["x"], t["dt"], self.A, t["B"], t["C"], self.D, t["z"], self.dt_bias,
                                          qsl, idx, acc).flatten(1)

    def prefill(self, pool, t, qsl, idx, acc, init):
        return ref.ssd_chunk_scan(t["x"], t["dt"], self.A, t["B"], t["C"], self.D, t["z"], self.dt_bias, qsl, pool,
                                  idx, acc, init, chunk_size=3).flatten(1)

    def seq_init(self):
        return [torch.zeros(H, P, N)]

    def seq_step(self, box: list, t: dict) -> torch.Tensor:
        d = F.softplus(t["dt"] + self.dt_bias)
        b, c = (t[k].repeat_interleave(H // G, 0) for k in "BC")
        s = box[0] * torch.exp(self.A * d)[:, None, None] + (d[:, None] * b)[:, None, :] * t["x"][:, :, None]
        box[0] = s
        y = (s * c[:, None, :]).sum(-1) + self.D[:, None] * t["x"]
        return (y * F.silu(t["z"])).flatten()

    def read_state(self, pool, row: list[int], a: int) -> torch.Tensor:
        return pool[row[a - 1]]

    def seq_state(self, box: list) -> torch.Tensor:
        return box[0]


def _stack(toks: list[dict]) -> dict:
    return {k: torch.stack([t[k] for t in toks]) for k in toks[0]}


class Stream:
    """One request: a true token stream, consumed by prefill chunks then decode / verify steps."""

    def __init__(self, op, slots: list[int], prompt_len: int, gen: torch.Generator) -> None:
        self.op, self.slots, self.prompt_len = op, slots, prompt_len
        self.tokens = [op.token(gen) for _ in range(prompt_len + 200)]
        self.pos, self.a = 0, 1
        self.seq = op.seq_init()

    def expect(self, n: int) -> list[torch.Tensor]:
        return [self.op.seq_step(self.seq, t) for t in self.tokens[self.pos:self.pos + n]]


def run_streams(op_cls, seed: int, steps: int = 25, num_rows: int = 5, guard: bool = False) -> dict:
    """Random mixed batches; asserts outputs at accepted positions and final states. Returns counters."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    op = op_cls(gen)
    per = 1 + K
    pool = op.new_pool(num_rows * per + 3, gen)  # 3 slots nobody owns: must stay bit-identical
    slots = list(range(pool.shape[0]))
    rng.shuffle(slots)
    free = slots[num_rows * per:]
    streams = [Stream(op, slots[i * per:(i + 1) * per], rng.randint(1, 9), gen) for i in range(num_rows)]
    counters = {"verify": 0, "plain_after_accept": 0, "mixed": 0, "guard_differs": 0, "guard_checked": 0}
    for _ in range(steps):
        free_before = pool[free].clone()
        decode = [s for s in streams if s.pos >= s.prompt_len]
        prefill = [s for s in streams if s.pos < s.prompt_len]
        rng.shuffle(decode)
        counters["mixed"] += bool(decode and prefill)
        # decode rows (and one PAD row) then prefill rows, like the scheduler
        plan = []
        for s in decode:
            T = 1 + rng.choice([0, K])
            a = rng.randint(1, T)
            garbage = [op.token(gen) for _ in range(T - a)]
            plan.append((s, s.tokens[s.pos:s.pos + a] + garbage, a))
        pad_tokens = [op.token(gen) for _ in range(rng.randint(1, 1 + K))]
        if decode:
            toks = [t for _, ts, _ in plan for t in ts] + pad_tokens
            qsl = torch.tensor([0] + [len(ts) for _, ts, _ in plan] + [len(pad_tokens)]).cumsum(0)
            idx = torch.tensor([s.slots for s, _, _ in plan] + [[PAD] * per], dtype=torch.int32)
            acc = torch.tensor([s.a for s, _, _ in plan] + [K + 1], dtype=torch.int32)
            if guard and any(s.a > 1 for s in decode):  # slot 0 / offset 0 must read stale state
                wrong = op.decode(pool.clone(), _stack(toks), qsl, idx, torch.ones_like(acc))
            out = op.decode(pool, _stack(toks), qsl, idx, acc)
            assert torch.all(out[qsl[-2]:] == 0), "a PAD row produced output"
            for r, (s, ts, a) in enumerate(plan):
                exp = torch.stack(s.expect(a))
                got = out[qsl[r]:qsl[r] + a]
                torch.testing.assert_close(got, exp, atol=2e-5, rtol=2e-5)
                if guard and s.a > 1:
                    counters["guard_checked"] += 1
                    counters["guard_differs"] += not torch.allclose(wrong[qsl[r]:qsl[r] + a], exp, atol=1e-3)
                counters["verify"] += len(ts) > 1
                counters["plain_after_accept"] += len(ts) == 1 and s.a > 1
                s.pos, s.a = s.pos + a, a
        if prefill:
            chunks = [(s, rng.randint(1, 5)) for s in prefill]
            chunks = [(s, min(c, s.prompt_len - s.pos)) for s, c in chunks]
            toks = [t for s, c in chunks for t in s.tokens[s.pos:s.pos + c]]
            qsl = torch.tensor([0] + [c for _, c in chunks]).cumsum(0)
            idx = torch.tensor([s.slots for s, _ in chunks], dtype=torch.int32)
            acc = torch.tensor([s.a for s, _ in chunks], dtype=torch.int32)
            init = torch.tensor([s.pos > 0 for s, _ in chunks])
            out = op.prefill(pool, _stack(toks), qsl, idx, acc, init)
            for r, (s, c) in enumerate(chunks):
                torch.testing.assert_close(out[qsl[r]:qsl[r + 1]], torch.stack(s.expect(c)), atol=2e-5, rtol=2e-5)
                s.pos, s.a = s.pos + c, 1
        assert torch.equal(pool[free], free_before), "a step wrote a slot no live row owns"
    for s in streams:
        torch.testing.assert_close(op.read_state(pool, s.slots, s.a), op.seq_state(s.seq), atol=2e-5, rtol=2e-5)
    return counters


@pytest.mark.parametrize("op_cls", [ConvOp, SsmOp], ids=["conv1d", "ssm"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_spec_equals_sequential_in_mixed_batches(op_cls, seed: int) -> None:
    c = run_streams(op_cls, seed)
    assert c["verify"] > 0 and c["mixed"] > 0 and c["plain_after_accept"] > 0, c


@pytest.mark.parametrize("op_cls", [ConvOp, SsmOp], ids=["conv1d", "ssm"])
def test_guard_reading_slot0_offset0_after_accepted_run_is_wrong(op_cls) -> None:
    c = run_streams(op_cls, seed=7, guard=True)
    assert c["guard_checked"] > 0
    assert c["guard_differs"] == c["guard_checked"], "reading slot 0 / offset 0 went unnoticed: the test cannot fail"


def test_pad_rows_leave_both_pools_bit_identical() -> None:
    gen = torch.Generator().manual_seed(3)
    conv, ssm = ConvOp(gen), SsmOp(gen)
    cpool, spool = conv.new_pool(6, gen), ssm.new_pool(6, gen)
    c0, s0 = cpool.clone(), spool.clone()
    qsl = torch.tensor([0, 2, 6])
    idx = torch.full((2, 1 + K), PAD, dtype=torch.int32)
    acc = torch.tensor([2, 4], dtype=torch.int32)
    toks = _stack([{**conv.token(gen), **ssm.token(gen)} for _ in range(6)])
    assert torch.all(conv.decode(cpool, toks, qsl, idx, acc) == 0)
    assert torch.all(conv.prefill(cpool, toks, qsl, idx, acc, torch.tensor([True, False])) == 0)
    assert torch.all(ssm.decode(spool, toks, qsl, idx, acc) == 0)
    assert torch.all(ssm.prefill(spool, toks, qsl, idx, acc, torch.tensor([True, False])) == 0)
    assert torch.equal(cpool, c0) and torch.equal(spool, s0)


@pytest.mark.parametrize("length,chunk", [(1, 4), (7, 3), (16, 4), (33, 8), (20, 64)])
def test_chunk_scan_equals_recurrence(length: int, chunk: int) -> None:
    gen = torch.Generator().manual_seed(length)
    op = SsmOp(gen)
    toks = _stack([op.token(gen) for _ in range(length)])
    init = torch.randn(H, P, N, generator=gen)
    pool_a = torch.zeros(4, H, P, N)
    pool_a[2] = init
    pool_b = pool_a.clone()
    qsl = torch.tensor([0, length])
    # chunked prefill from slot 2 (a = 2) vs the T = 1 recurrence one token at a time
    idx = torch.tensor([[0, 2, 3, 1]], dtype=torch.int32)
    y = ref.ssd_chunk_scan(toks["x"], toks["dt"], op.A, toks["B"], toks["C"], op.D, toks["z"], op.dt_bias, qsl,
                           pool_a, idx, torch.tensor([2]), torch.tensor([True]), chunk_size=chunk)
    box = [init.clone()]
    exp = torch.stack([op.seq_step(box, {k: v[t] for k, v in toks.items()}) for t in range(length)])
    torch.testing.assert_close(y.flatten(1), exp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool_a[0], box[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(pool_a[1:], pool_b[1:]), "the chunk scan wrote a slot other than idx[n, 0]"


def test_normalize_and_copy_state_move_the_valid_state_to_column_0() -> None:
    gen = torch.Generator().manual_seed(5)
    conv_pool = torch.randn(8, W - 1 + K, DIM, generator=gen)
    ssm_pool = torch.randn(8, H, P, N, generator=gen)
    idx = torch.tensor([[4, 1, 6, 2], [3, 0, 7, 5]], dtype=torch.int32)
    acc = torch.tensor([3, 1], dtype=torch.int32)
    want_conv, want_ssm = conv_pool[4, 2:2 + W - 1].clone(), ssm_pool[6].clone()
    untouched = conv_pool[3].clone(), ssm_pool[3].clone()
    ref.normalize_state(conv_pool, ssm_pool, idx, acc, W)
    assert torch.equal(conv_pool[4, :W - 1], want_conv) and torch.equal(ssm_pool[4], want_ssm)
    assert torch.equal(conv_pool[3], untouched[0]) and torch.equal(ssm_pool[3], untouched[1])
    ref.copy_state(ssm_pool, torch.tensor([4, PAD]), torch.tensor([5, 0]))
    assert torch.equal(ssm_pool[5], want_ssm)
