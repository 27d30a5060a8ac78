"""EAGLE-3 speculation (method "eagle3") on a tiny random Llama target (6 layers, head_dim 16: the CPU
C++ layer stack runs it, in segments cut at the aux layers) with a head trained here by
scripts/train_eagle3.py's own functions (self-distillation on the target's greedy outputs), so that
drafts are often but not always right: greedy spec output equals plain output bit for bit (tokens
and every committed token's logits) at batch 1 and 8 with heterogeneous prompts, k = 1..4, block
sizes 1 / 16; random sampling keeps the target distribution (chi-square); the script's training-time
test computes what the proposer drafts; bad checkpoints are refused with a ValueError naming the
problem."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pyengine import LLM
from pyengine.models.eagle3_train import TrainHead, head_config, load_head, save_head
from pyengine.ops.kernel_config import KernelConfig, use_kernel_config
from tests.spec_harness import RecordingScheduler, check_second_token_follows_target, plain_greedy, spec_equals_plain
from tests.tiny_models import _COMMON, make_prompts, write_tokenizer

MAX_TOKENS = 24
LAYER_SCALE, NUM_TRAIN_PROMPTS, TRAIN_STEPS = 0.05, 128, 200
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script():
    spec = importlib.util.spec_from_file_location("train_eagle3", os.path.join(ROOT, "scripts", "train_eagle3.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _make_target(path: str) -> None:
    """Output projections damped (the next token depends mostly on the current one): a head can
    learn it in a few hundred steps."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**dict(_COMMON, num_attention_heads=4, num_hidden_layers=6, tie_word_embeddings=False))
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15 * (LAYER_SCALE if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0))
    hf.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)


def _train_head(target: str, out: str, steps: int) -> None:
    """scripts/train_eagle3.py's pipeline on token prompts: greedy answers, aux states, draft
    vocabulary (64 of the 96 ids: d2t is exercised), training-time test over 3 steps."""
    s = _script()
    llm = LLM(target, device="cpu")
    prompts = make_prompts(NUM_TRAIN_PROMPTS, seed=1)
    answers = s.generate_answers(llm, prompts, 32, ignore_eos=True)
    seqs = [p + a for p, a in zip(prompts, answers)]
    layers = (2, 3, 3)  # vLLM's default (2, L // 2, L - 3) for L = 6
    aux = s.aux_states(llm.model, llm.engine.runner.build_metadata, seqs, layers, torch.device("cpu"), 512)
    ids = s.pick_draft_vocab(answers, 96, 64)
    t2d = torch.full((96,), -1, dtype=torch.long)
    t2d[ids] = torch.arange(len(ids))
    c = head_config(llm.model, layers, len(ids), 96)
    head = TrainHead(c, llm.model.embed(torch.arange(96)).detach())
    batches = s.make_batches(seqs, [len(p) for p in prompts], aux, t2d, 1024, torch.device("cpu"))
    s.train(head, batches, 0.0, 3, steps, 3e-3, 0, log_every=10**9)
    save_head(head, ids, 96, out)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("eagle3_target"))
    _make_target(path)
    return path


@pytest.fixture(scope="module")
def head(target: str, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("eagle3_head"))
    _train_head(target, path, steps=TRAIN_STEPS)
    return path


def _spec_run(target: str, head: str, batch: int, k: int, block_size: int, **kw) -> tuple[dict, RecordingScheduler]:
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": k, "adaptive_draft_length": False}
    kw.setdefault("max_num_batched_tokens", 64)  # prompts admitted over several steps: mixed steps, prefix hits
    return spec_equals_plain(target, spec, batch, MAX_TOKENS, block_size=block_size, **kw)


@pytest.mark.parametrize("batch,k,block_size", [(1, 1, 16), (1, 4, 1), (8, 2, 1), (8, 3, 16), (8, 4, 16)])
def test_greedy_eagle3_equals_plain(target: str, head: str, batch: int, k: int, block_size: int) -> None:
    st, rec = _spec_run(target, head, batch, k, block_size)
    # the trained head is right often, not always: accepted and rejected drafts both occur
    assert st["num_draft_tokens"] > 0 and 0.2 < st["per_position_acceptance"][0] and st["acceptance_rate"] < 1, st
    rows = rec.verify_rows()  # verify rows that kept a draft and rows that rejected one
    assert any(c > 1 for _, _, d, c in rows) and any(c - 1 < d for _, _, d, c in rows)
    if batch > 1:
        assert rec.had_mixed_step(), "no step verified drafts next to a prefill"


class _RotaryWithoutTables(torch.nn.Module):
    """The model's rotary rows without its tables: the C++ stack's path that takes cos / sin rows."""

    cos_table = sin_table = None

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, positions: torch.Tensor):
        return self.inner(positions)


def test_aux_states_same_on_every_cpu_path(target: str) -> None:
    """The residual streams the C++ stack keeps (the whole step in one call, the stream before the
    final norm included; and the call that takes rotary rows) equal the per-layer loop's, and the
    hidden states are those of a forward without aux states, bit for bit."""
    from pyengine.ops.kernel_config import use_kernel_config
    from pyengine.spec_decode.draft_model import rows_batch

    llm = LLM(target, device="cpu")
    model = llm.model
    assert model.cpu_stack is not None, "head_dim 16: the C++ stack must run this target"
    assert model.rotary_emb.cos_table is not None, "the whole-step path needs the rotary tables"
    seqs = make_prompts(3)
    results = []
    rotary = model.rotary_emb
    for layers, stack, tables in [(None, True, True), ((0, 2, 3, 6), True, True), ((0, 2, 3, 6), True, False),
                                  ((0, 2, 3, 6), False, True), ((6, 1), True, True), ((6, 1), False, True)]:
        model.set_aux_layers(layers)
        model.rotary_emb = rotary if tables else _RotaryWithoutTables(rotary)
        with use_kernel_config(cpu_layer_stack=stack):
            shape = (16, 16, 2, 16)
            caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(6)]
            batch = rows_batch([(list(range(4 * r, 4 * r + 4)), 0, p) for r, p in enumerate(seqs)], 16)
            hidden = model(torch.from_numpy(batch.input_ids), torch.from_numpy(batch.positions),
                           llm.engine.runner.build_metadata(batch), caches)
        results.append((hidden, model.last_aux))
    model.rotary_emb = rotary
    model.set_aux_layers(None)
    assert all(torch.equal(results[0][0], r[0]) for r in results[1:])
    assert torch.equal(results[1][1], results[3][1]) and torch.equal(results[2][1], results[3][1])
    assert torch.equal(results[1][1][:, :64], model.embed(torch.from_numpy(batch.input_ids)))
    assert torch.equal(results[4][1], results[5][1]), "columns in the order asked, on both paths"
    assert torch.equal(results[4][1][:, :64], results[1][1][:, 3 * 64:]), "the stream before the final norm"
    assert not torch.equal(results[4][1][:, 64:], results[1][1][:, :64])


def test_the_head_runs_on_the_packed_gemm_on_the_cpu(target: str, head: str) -> None:
    """The head's linears are pyengine's PackedLinear (the batch-invariant kernels) wherever the
    target's are, not oneDNN's weights."""
    from pyengine.ops.cpu import PackedLinear

    llm = LLM(target, device="cpu", speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 2})
    if not isinstance(llm.model.lm_head, PackedLinear) and not isinstance(getattr(llm.model, "packed_lm_head", None),
                                                                          PackedLinear):
        pytest.skip("no packed GEMM on this CPU")
    drafter = llm.engine.proposer.layer
    linears = (drafter.fc, drafter.lm_head, drafter.layer.qkv_proj, drafter.layer.o_proj, drafter.layer.gate_up_proj,
               drafter.layer.down_proj)
    assert all(isinstance(w, PackedLinear) for w in linears)
    # KernelConfig.cpu_q8_draft_head: rounded to Q8_0 codes on the integer-dot kernels, ~4x fewer bytes
    assert [w.bits_per_weight for w in linears] == [8] * 6 and all(w.int16_dot for w in linears)
    dense = LLM(target, device="cpu", speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 2},
                kernel_config={"cpu_q8_draft_head": False}).engine.proposer.layer
    assert dense.fc.bits_per_weight == 32 and dense.lm_head.bits_per_weight == 32
    assert sum(w.packed_bytes for w in linears) < 0.3 * sum(getattr(dense, n).packed_bytes for n in ("fc", "lm_head")) + \
        0.3 * sum(getattr(dense.layer, n).packed_bytes for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    # the rounded head drafts what the dense one does, nearly always (its logits within Q8_0's error)
    torch.manual_seed(0)
    hidden = torch.randn(256, drafter.config.hidden_size)
    with torch.inference_mode():
        q8, exact = drafter.compute_logits(hidden), dense.compute_logits(hidden)
    assert not torch.equal(q8, exact), "the Q8_0 head should not compute the dense head's bits"
    assert (q8.argmax(-1) == exact.argmax(-1)).float().mean() > 0.9
    torch.testing.assert_close(q8, exact, rtol=0.05, atol=0.05 * float(exact[exact.isfinite()].abs().max()))


def test_greedy_eagle3_equals_plain_per_layer_path(target: str, head: str) -> None:
    _spec_run(target, head, 8, 3, 16, kernel_config={"cpu_layer_stack": False})


@torch.inference_mode()
def test_training_unroll_is_what_the_proposer_drafts(target: str, head: str) -> None:
    """The training-time test computes what the proposer computes: step 0 at position p is the
    catch-up's output there, step j the j-th chained draft after a catch-up up to p - j (its own
    outputs as hidden states, its KV beside the catch-up's)."""
    import numpy as np

    from pyengine.models.eagle3 import load_eagle3
    from pyengine.spec_decode.draft_model import rows_batch

    s = _script()
    llm = LLM(target, device="cpu")
    seq = make_prompts(3, seed=5)[1] + [7, 8, 9, 10, 11, 12]
    aux = s.aux_states(llm.model, llm.engine.runner.build_metadata, [seq], (2, 3, 3), torch.device("cpu"), 512)[0]
    steps = 3
    train_logits = load_head(head, llm.model.embed(torch.arange(96))).unroll(
        torch.tensor(seq[1:] + [0])[None], aux[None], steps)
    with use_kernel_config(KernelConfig(cpu_q8_draft_head=False)):  # the trained weights as they are
        ours, _ = load_eagle3(head, llm.model, llm.model_config, torch.device("cpu"), torch.float32)
    ids = ours.target_ids
    build = llm.engine.runner.build_metadata
    n = len(seq)
    for q in (steps, n // 2, n - 2):  # the last chain step runs at q, its catch-up ended at q - steps + 1
        kv = ours.make_kv_cache(8, 16, torch.device("cpu"))
        end = q - steps + 1  # catch-up over positions 0..end - 1
        feed = rows_batch([(np.arange(8), 0, seq[1:end + 1])], 16)
        out = ours(torch.tensor(seq[1:end + 1]), torch.arange(end), ours.combine(aux[:end]), build(feed), kv)
        torch.testing.assert_close(ours.compute_logits(out)[:, ids], train_logits[0][0, :end], rtol=1e-4, atol=1e-4)
        prev = out[-1:]
        for j in range(1, steps):
            p = end - 1 + j
            feed = rows_batch([(np.arange(8), p, [seq[p + 1]])], 16)
            prev = ours(torch.tensor([seq[p + 1]]), torch.tensor([p]), prev, build(feed), kv)
            torch.testing.assert_close(ours.compute_logits(prev)[0, ids], train_logits[j][0, p], rtol=1e-4, atol=1e-4)


def test_training_keeps_the_best_head_on_held_out_sequences(target: str) -> None:
    """scripts/train_eagle3.py's held-out evaluation: every eval_every steps the unrolled top-1 on
    held-out sequences is recorded; the head returned is the best evaluation's (its top-1 on them
    is that evaluation's, not the last step's); `patience` evaluations without a better one stop
    the run early."""
    s = _script()
    llm = LLM(target, device="cpu")
    prompts = make_prompts(48, seed=3)
    answers = s.generate_answers(llm, prompts, 24, ignore_eos=True)
    seqs = [p + a for p, a in zip(prompts, answers)]
    layers = (2, 3, 3)
    aux = s.aux_states(llm.model, llm.engine.runner.build_metadata, seqs, layers, torch.device("cpu"), 512)
    ids = s.pick_draft_vocab(answers, 96, 64)
    t2d = torch.full((96,), -1, dtype=torch.long)
    t2d[ids] = torch.arange(len(ids))
    lens = [len(p) for p in prompts]
    train_b = s.make_batches(seqs[8:], lens[8:], aux[8:], t2d, 512, torch.device("cpu"))
    val_b = s.make_batches(seqs[:8], lens[:8], aux[:8], t2d, 512, torch.device("cpu"))
    head = TrainHead(head_config(llm.model, layers, len(ids), 96), llm.model.embed(torch.arange(96)).detach())
    # a learning rate high enough to overshoot: later evaluations are not always the best
    stats = s.train(head, train_b, 0.0, 2, 120, 3e-2, 0, log_every=10**9, val=val_b, eval_every=10, patience=0)
    evals = stats["evals"]
    assert len(evals) == 12 and all(len(e["val_top1_by_step"]) == 2 for e in evals)
    best = max(float(sum(e["val_top1_by_step"]) / 2) for e in evals)
    assert stats["best_val_top1_mean"] == pytest.approx(best)
    assert float(sum(evals[-1]["val_top1_by_step"]) / 2) < best, "this run should have overshot (else nothing is restored)"
    assert sum(s.evaluate_batches(head, val_b, 2)) / 2 == pytest.approx(best), "the best evaluation's head is kept"
    assert stats["epochs"] > 0
    early = s.train(TrainHead(head_config(llm.model, layers, len(ids), 96), llm.model.embed(torch.arange(96)).detach()),
                    train_b, 0.0, 2, 400, 3e-2, 0, log_every=10**9, val=val_b, eval_every=10, patience=2)
    assert early["steps"] < 400, "patience should stop a run whose held-out top-1 stopped improving"


def test_graph_static_buffer_path(target: str, head: str) -> None:
    """Decode/verify steps through CudaGraphRunner's static buffers (run eagerly on the CPU, as
    replays would run): the aux states come from the model's fixed aux_out buffer, at the step's
    packed token rows, and greedy output stays plain output."""
    from pyengine import SamplingParams
    from pyengine.engine.cuda_graph_runner import CudaGraphRunner

    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3, "adaptive_draft_length": False}
    llm = LLM(target, device="cpu", speculative_config=spec, max_num_batched_tokens=64)
    r, cfg = llm.engine.runner, llm.engine.cfg
    r.graph_runner = CudaGraphRunner(r.model, r.kv_caches, r.block_size, r.device, cfg.max_num_seqs, 4,
                                     cfg.max_model_len + 4 + r.block_size)
    r.keep_aux_hidden(llm.engine.proposer.head.aux_layers)  # aux_out sized for the graphs' tokens
    assert r.model.aux_out is not None
    outs = llm.generate(make_prompts(8), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert [tuple(o.outputs[0].token_ids) for o in outs] == list(plain_greedy(target, 8, MAX_TOKENS)[0])
    assert r.graph_runner.num_eager > 0 and llm.stats()["per_position_acceptance"][0] > 0.2, llm.stats()


@pytest.mark.parametrize("block_size,period", [(16, 3), (2, 3), (16, 7)])
def test_steps_launched_ahead_keep_the_heads_features(target: str, head: str, block_size: int, period: int) -> None:
    """Async decode with EAGLE-3 (the graph runner's padded path, where a launch computes at once):
    a step without planned drafts launches the next one, whose forward overwrites the static aux
    buffer the proposer has not read yet (the rows defer their catch-up to the step they draft in);
    the runner keeps a copy (hold_hidden). The head then sees the same features as without async
    decode: the same drafts, accepted the same (every stat equal), and plain decoding's tokens.
    Deferred catch-ups outgrow a verify row (k + 1 tokens) and take the head's prefill-shaped graphs."""
    from tests.test_async_decode import drafting_async_equals_sync

    keys = []

    def spy(llm: LLM) -> None:  # each replay's key and its rows' first fed position
        graphs = llm.engine.proposer.graphs
        graph_run = graphs.run
        graphs.run = lambda key, feed, *a: keys.append(
            (key, int((feed.context_lens - np.diff(feed.query_start_loc)).min()))) or graph_run(key, feed, *a)

    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    drafting_async_equals_sync(target, spec, period, MAX_TOKENS, spy, block_size=block_size)
    deferred = [key for key, first in keys if key[1] < 0 and first > 0]  # no prompt's catch-up among the rows
    assert deferred, keys


def test_untrained_head_drafts_rarely_accepted(target: str, head: str, tmp_path) -> None:
    """The same head with fc zeroed (no target features) still keeps greedy output exact, and its
    acceptance falls: the features are what the trained head drafts from."""
    bad = str(tmp_path / "blind")
    shutil.copytree(head, bad)
    w = load_file(os.path.join(bad, "model.safetensors"))
    w["fc.weight"] = torch.zeros_like(w["fc.weight"])
    save_file(w, os.path.join(bad, "model.safetensors"))
    trained = _spec_run(target, head, 8, 3, 16)[0]["acceptance_rate"]
    blind = _spec_run(target, bad, 8, 3, 16)[0]["acceptance_rate"]
    assert blind < trained, (blind, trained)


def test_preemption(target: str, head: str) -> None:
    st, rec = _spec_run(target, head, 8, 3, 4, num_kv_blocks=40, max_num_batched_tokens=16)
    assert st["num_preemptions"] > 0 and rec.had_ragged_step()


def test_random_sampling_keeps_target_distribution(target: str, head: str) -> None:
    st = check_second_token_follows_target(target, {"method": "eagle3", "model": head, "num_speculative_tokens": 2,
                                                    "adaptive_draft_length": False}, [5, 17, 3, 88, 41, 9])
    assert 0.05 < st["acceptance_rate"] < 0.95, st


def _broken(head: str, tmp_path, tensors=None, config=None) -> str:
    path = str(tmp_path / "broken")
    shutil.copytree(head, path)
    if tensors is not None:
        w = load_file(os.path.join(path, "model.safetensors"))
        tensors(w)
        save_file(w, os.path.join(path, "model.safetensors"))
    if config is not None:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        config(cfg)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
    return path


@pytest.mark.parametrize("tensors,config,message", [
    (lambda w: w.pop("midlayer.hidden_norm.weight"), None, "lacks tensor midlayer.hidden_norm.weight"),
    (lambda w: w.update({"fc.weight": torch.zeros(64, 128)}), None, r"tensor fc.weight has shape \(64, 128\)"),
    (lambda w: w.update({"lm_head.weight": torch.zeros(50, 64)}), None, "tensor lm_head.weight has shape"),
    (lambda w: w.pop("d2t"), None, "needs the tensor d2t"),
    (lambda w: w.update({"d2t": torch.full((64,), 90)}), None, "d2t maps draft ids outside"),
    (lambda w: w.update({"extra.weight": torch.zeros(3)}), None, "unexpected tensor extra.weight"),
    (None, lambda c: c.update({"vocab_size": 128}), "vocab_size 128 != the target's 96"),
    (None, lambda c: c.update({"target_hidden_size": 32}), "target_hidden_size 32 != the target's 64"),
    (None, lambda c: c.update({"architectures": ["LlamaForCausalLM"]}), "is not an EAGLE-3 head"),
    (None, lambda c: c.update({"eagle_aux_hidden_state_layer_ids": [2, 9]}), r"must be a list of layer indices in 0..6"),
])
def test_bad_checkpoints_are_refused(target: str, head: str, tmp_path, tensors, config, message: str) -> None:
    path = _broken(head, tmp_path, tensors, config)
    with pytest.raises(ValueError, match=message):
        LLM(target, device="cpu", speculative_config={"method": "eagle3", "model": path, "num_speculative_tokens": 2})


def test_other_targets_need_a_head(target: str) -> None:
    with pytest.raises(ValueError, match="needs speculative_config.model"):
        LLM(target, device="cpu", speculative_config={"method": "eagle3", "num_speculative_tokens": 2})


def test_cli_flags(target: str, head: str) -> None:
    import contextlib
    import io

    from pyengine.entrypoints.generate import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["--model", target, "--device", "cpu", "--prompt", "t5 t6 t7", "--max-tokens", "8", "--no-chat",
              "--spec", "eagle3", "--draft-model", head, "--num-spec-tokens", "3", "--json"])
    assert json.loads(out.getvalue())["stats"]["num_draft_tokens"] > 0


def test_the_draft_length_policy_weighs_the_heads_forwards(target: str, head: str) -> None:
    """The adaptive policy of an EAGLE-3 engine knows what a head forward costs against a target step
    (the modelled share: below one, both mostly the CPU's per-forward overhead at these widths);
    ngram runs none."""
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    share = LLM(target, device="cpu", speculative_config=spec).engine.draft_length.drafter_cost
    assert 0.05 < share < 1.0, share
    ngram = LLM(target, device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert ngram.engine.draft_length.drafter_cost == 0.0
