"""The decode loop: one step at a time.

    propose drafts -> schedule (C++) -> forward -> verify / sample -> commit (C++) -> detokenize

Steps launched while the step before them waits for its result (async decode, verify ahead):
pyengine/engine/launch_ahead.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pyengine import _C
from pyengine.config import ModelConfig
from pyengine.engine.device_verify import DeviceVerifyLoop
from pyengine.engine.greedy_sampler import GreedySampler
from pyengine.engine.host_arrays import draft_token_ids
from pyengine.engine.launch_ahead import LaunchAhead
from pyengine.engine.model_runner import ModelRunner
from pyengine.engine.output_processor import OutputProcessor, Request
from pyengine.ops.kernel_config import KernelConfig, use_kernel_config
from pyengine.spec_decode.rejection_sampler import RejectionSampler
from pyengine.engine.sampler import RequestGenerators
from pyengine.engine.step_records import TokenTexts, record_logits, record_logprobs
from pyengine.engine.verify_ahead import VerifyAhead
from pyengine.sampling_params import SamplingParams
from pyengine.spec_decode.config import SpeculativeConfig
from pyengine.spec_decode.draft_length import DraftLengthPolicy
from pyengine.spec_decode.proposer import Proposer, build_proposer
from pyengine.tokenizer import Tokenizer


@dataclass
class EngineConfig:
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    seed: int
    speculative: SpeculativeConfig | None = None
    num_state_slots: int = 0  # hybrid models: recurrent-state slot pool (1 + k per request)
    # hybrid models with prefix caching: checkpoints of the state every state_checkpoint_interval tokens
    num_state_checkpoints: int = 0
    state_checkpoint_interval: int = 0
    async_decode: bool = True  # launch the next greedy decode step before this one's tokens arrive
    kernel_config: KernelConfig = field(default_factory=KernelConfig)  # the kernels this engine's steps run
    record_logits: bool = False  # keep each committed token's logits (Request.logits): the losslessness checker
    device_verify: bool = True  # ngram / suffix on graphs: verify steps built and launched from the device (device_verify.py)


class LLMEngine(LaunchAhead):
    def __init__(self, runner: ModelRunner, model_config: ModelConfig, tokenizer: Tokenizer, cfg: EngineConfig,
                 draft_model: tuple | None = None) -> None:
        self.runner, self.model_config, self.tokenizer, self.cfg = runner, model_config, tokenizer, cfg
        spec = cfg.speculative
        self.k = spec.num_speculative_tokens if spec else 0
        sc = _C.SchedulerConfig()
        sc.max_num_seqs = cfg.max_num_seqs
        sc.max_num_batched_tokens = cfg.max_num_batched_tokens
        sc.max_model_len = cfg.max_model_len
        sc.block_size = cfg.block_size
        sc.num_kv_blocks = cfg.num_kv_blocks
        sc.enable_prefix_caching = cfg.enable_prefix_caching
        sc.num_spec_tokens = self.k
        sc.num_state_slots = cfg.num_state_slots
        sc.num_state_checkpoints = cfg.num_state_checkpoints
        sc.state_checkpoint_interval = cfg.state_checkpoint_interval
        # A draft model (or MTP layer, EAGLE-3 head) writes k - 1 positions past the verify tokens before the next append.
        sc.drafter_lookahead = self.k if spec is not None and spec.method in ("draft_model", "mtp", "eagle3") else 0
        # async decode: the next position's block reserved a step early, so a launch ahead is not
        # stopped by a row crossing into a new block (every step of a large batch has such a row)
        self.decode_lookahead = sc.decode_lookahead = bool(cfg.async_decode and runner.graph_runner is not None)
        self.scheduler = _C.Scheduler(sc)
        self.proposer: Proposer | None = None
        self.draft_model = draft_model  # a draft model's (model, config) or EAGLE-3's (head, config)
        if spec is not None:
            self.proposer = build_proposer(spec, runner, lambda sid: self.requests[sid], cfg.seed, cfg.max_model_len,
                                           draft=draft_model)
        self.rejection_sampler = RejectionSampler()
        self.generators = RequestGenerators(cfg.seed)
        self.eos_token_ids = list(dict.fromkeys(tokenizer.eos_token_ids + model_config.eos_token_ids))
        self.requests: dict[int, Request] = {}  # unfinished requests; a finished one leaves once returned
        self.outputs = OutputProcessor()
        self.next_id = 0
        self.counters = {"prompt_tokens": 0, "generated_tokens": 0, "prefill_tokens": 0, "decode_tokens": 0}
        self.prefill_time = self.decode_time = 0.0
        # async decode (module docstring): the launched next step, if any
        self.async_decode = cfg.async_decode
        self._pending = None
        self.num_async_steps = 0  # steps that used a forward launched by the step before
        self.num_async_discarded = 0  # launched forwards whose step was not the predicted one
        self.greedy = GreedySampler(cfg.max_num_seqs)  # all-greedy steps: argmax where the logits are
        self._next_plan: tuple[np.ndarray, np.ndarray] | None = None  # (seq ids, draft lengths) planned ahead
        self._lengths: tuple[np.ndarray, np.ndarray] | None = None  # (seq ids, the last plan's draft lengths)
        # verify ahead (module docstring): graph steps, no recurrent state, a proposer that predicts
        graphs = runner.graph_runner
        self.verify_ahead = VerifyAhead() if (
            self.decode_lookahead and graphs.state_cache is None and hasattr(self.proposer, "predict")) else None
        # ngram, suffix, MTP, EAGLE-3: the next verify step built on the device from a step's argmax
        # (device_verify.py)
        self.device_verify = DeviceVerifyLoop.for_engine(graphs, cfg.max_num_seqs, spec, self.proposer) \
            if self.decode_lookahead and graphs.state_cache is None and cfg.device_verify else None
        adaptive = spec is not None and spec.adaptive_draft_length
        # its step cost: spec.step_cost, else modelled from the model and device (never timed), the
        # forwards of its drafting module (MTP / EAGLE-3 layer, draft model; ngram and suffix: none)
        # and which steps the device loop builds
        drafter = getattr(self.proposer, "drafting_module", None)
        self.draft_length = DraftLengthPolicy.for_runner(
            self.k, runner, spec.step_cost, drafter=drafter, drafter_graphs=getattr(self.proposer, "graphs", None),
            built_rows=self._built_rows) if adaptive else None
        self._observed = False  # this step's rows were shown to the draft-length policy already
        self.num_logprob_requests = 0  # unfinished requests that asked for logprobs
        self.token_texts = TokenTexts(tokenizer)  # token id -> its text, for Logprob.decoded_token

    def _built_rows(self) -> int:
        """The most rows of a step the device loop builds (0: none): the policy's step costs."""
        return self.device_verify.max_rows if self.device_verify is not None else 0

    def capture_graphs(self) -> int:
        """Capture every CUDA graph a step may replay, now (start-up, a benchmark's warm-up): the
        target's (CudaGraphRunner.capture_all) and a drafting layer's (MtpProposer.capture_graphs).
        Otherwise each is captured on first use, inside the step that needs it. Returns how many."""
        g = self.runner.graph_runner
        if g is None:
            return 0
        capture = getattr(self.proposer, "capture_graphs", None)
        with use_kernel_config(self.cfg.kernel_config):
            return g.capture_all() + (capture(self._built_rows()) if capture is not None else 0)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    stream: bool = False) -> Request:
        """Queue a request. A request that cannot run (too long) is returned finished with an error.
        stream: its tokens and text grow every step (else they are filled when it finishes)."""
        rid = self.next_id
        self.next_id += 1
        req = Request(rid, prompt, list(prompt_token_ids), params, self.tokenizer.incremental_detokenizer(),
                      stream=stream or bool(params.stop))
        try:
            if any(not 0 <= t < self.model_config.vocab_size for t in req.prompt_token_ids):
                raise ValueError(f"request {rid}: token ids must be in [0, {self.model_config.vocab_size})")
            self.scheduler.add_request(rid, req.prompt_token_ids, params.max_tokens, self.eos_token_ids,
                                       params.stop_token_ids or [], params.ignore_eos, 0, bool(params.stop))
        except ValueError as e:
            req.finish_reason, req.error = "error", str(e)
            return req
        self.requests[rid] = req
        if params.logprobs is not None:
            req.logprobs = []
            self.num_logprob_requests += 1
        self.outputs.add(req)
        self.generators.get(rid, params.seed)
        self.counters["prompt_tokens"] += len(req.prompt_token_ids)
        return req

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_request(self, request_id: int) -> bool:
        """End an unfinished request between steps (a client that went away): its blocks are freed
        at once, and the output processor, the proposer and its generator release it like a finished
        request. It ends with finish_reason "abort" and is not returned by a later step. Returns
        False for an unknown or already finished request."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.num_logprob_requests -= req.logprobs is not None
        self.scheduler.abort_request(request_id)
        self.outputs.abort(req)
        self.generators.release(request_id)
        if self.proposer is not None:
            self.proposer.forget([request_id], finished=True)
        return True

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one step; returns the requests that received tokens (or finished) in it. A finished
        request is returned once and then forgotten."""
        with self.runner.step_threads(), use_kernel_config(self.cfg.kernel_config):
            return self._step()

    def _step(self) -> list[Request]:
        t0 = time.perf_counter()
        if self.proposer is not None:
            self._propose()
        batch = self.scheduler.schedule()
        assert batch.num_rows > 0, "the scheduler made no progress with requests pending"
        if self.proposer is not None and batch.preempted_seq_ids:
            self.proposer.forget(batch.preempted_seq_ids, finished=False)
        pending, self._pending = self._pending, None
        greedy = True  # every row's tokens are its argmax (the steps that may launch the next one)
        if pending is not None and pending.matches(batch):
            self.num_async_steps += 1
            self.runner.adopt_launched(batch, pending.key)
            logits = pending.logits
            if pending.expected is not None:
                self.verify_ahead.num_used += 1
            if pending.from_device:
                self.device_verify.num_used += 1
            if batch.num_draft_tokens.any():  # verify ahead
                tokens, counts, first_bad = self._verify_greedy(batch, logits, pending.key)
            else:
                tokens, counts, first_bad = self._sample_greedy(batch, logits, pending.key)
        else:
            self.num_async_discarded += pending is not None
            drafts = getattr(self.proposer, "device_drafts", None)  # drafts still on the device
            patch = drafts.patch_for(batch) if drafts is not None else None
            logits = self.runner.execute(batch, *(() if patch is None else (patch,)))
            if patch is not None:
                drafts.resolve(self.scheduler, batch)
            if self._all_greedy_single(batch, logits):
                tokens, counts, first_bad = self._sample_greedy(batch, logits, self.runner.last_graph_key)
            elif self._all_greedy(batch):
                tokens, counts, first_bad = self._verify_greedy(batch, logits, self.runner.last_graph_key)
            else:
                greedy = False
                tokens, counts, first_bad = self._sample(batch, logits)
        if first_bad is not None:
            # NaN / inf logits where a row's token would be committed: the row commits the tokens
            # before (a filler where there are none) and its request ends with an error in _commit.
            # A step launched ahead ran on this step's tokens, the bad rows' too: it is dropped.
            tokens, counts, filler_rows = self.outputs.hold_back_nonfinite(batch, tokens, counts, first_bad)
            if self._pending is not None:
                self._pending = None
                self.num_async_discarded += 1
        elif (self._pending is not None and self._pending.expected is not None
              and not self.verify_ahead.confirm(self._pending, tokens, counts)):
            self._pending = None  # launched for tokens this step did not commit
            self.num_async_discarded += 1
        num_committed, reasons = self.scheduler.update(tokens, counts)
        if self.device_verify is not None:
            self.device_verify.committed(num_committed)
        if first_bad is None and self._pending is None and greedy and not reasons.any():
            self._launch_committed(batch, tokens, counts)
        if first_bad is not None:
            num_committed[filler_rows] = 0  # a filler token is not output
        if self.cfg.record_logits:
            record_logits(self.requests, batch, logits, num_committed)
        if self.num_logprob_requests:
            record_logprobs(self.requests, batch, logits, tokens, counts, num_committed, self.token_texts)
        touched = self._commit(batch, tokens, counts, num_committed, reasons)
        elapsed = time.perf_counter() - t0
        num_prefill = int(batch.num_tokens - (batch.query_start_loc[batch.num_decode_rows]))
        if num_prefill:
            self.prefill_time += elapsed
            self.counters["prefill_tokens"] += num_prefill
        else:
            self.decode_time += elapsed
            self.counters["decode_tokens"] += int(num_committed.sum())
        if self.draft_length is not None and not self._observed:
            rows = batch.num_decode_rows
            self.draft_length.observe_rows(batch.request_slots[:rows], batch.num_draft_tokens[:rows], counts[:rows])
        self._observed = False
        return touched

    def _propose(self) -> None:
        """Drafts for this step's decode rows: one decode view from the scheduler, one length per
        row (k, or the draft-length policy's), one call into the proposer."""
        view = self.scheduler.decode_view()
        if not view.num_rows:
            return
        pending = self._pending
        if pending is not None:
            pending.complete()  # a drafting layer's drafts built on the device
        if pending is not None and pending.drafts is not None:  # verify ahead, confirmed
            if np.array_equal(view.seq_ids, pending.seq_ids):
                self.scheduler.set_draft_tokens_batch(pending.seq_ids, *pending.drafts)
                if pending.from_device:
                    self.device_verify.adopted()  # its drafting layer's catch-up stands
                self._next_plan = None
                return
            self._pending = None
            self.num_async_discarded += 1
        plan, self._next_plan = self._next_plan, None
        if self.draft_length is None:
            max_drafts = np.full(view.num_rows, self.k, dtype=np.int32)
        elif plan is not None and np.array_equal(plan[0], view.seq_ids):
            max_drafts = plan[1]
        else:
            if self._pending is not None:  # launched for the planned rows, which this step does not run
                self._pending = None
                self.num_async_discarded += 1
            max_drafts = self.draft_length.draft_lengths(view.request_slots, view.seq_ids, self._can_finish_last(view))
        self._lengths = (np.array(view.seq_ids), max_drafts)
        self.proposer.propose(self.scheduler, view, max_drafts)

    @staticmethod
    def _can_finish_last(view) -> np.ndarray | None:
        """Per decode row (view: the scheduler's DecodeView): can it still be the last running
        request to finish? None while requests wait for admission (a row that finishes early is
        replaced, so every committed token counts). A request has at most tokens_left tokens to go
        and at least its fewest tokens left (the same if only the length can stop it, else 1: EOS or a
        stop may come any time); one whose most is below another running request's fewest
        finishes first."""
        if view.num_waiting or view.num_rows < 2:
            return None
        return view.tokens_left >= view.max_fewest_tokens_left

    def _sample(self, batch, logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(tokens, counts per row, first_bad): first_bad None when every logits row that gave a
        token was finite, else per row the first of its tokens whose logits were not (-1: none)."""
        num_logits = batch.num_logits
        rows = np.nonzero(num_logits)[0]
        counts = np.zeros(batch.num_rows, dtype=np.int32)
        if len(rows) == 0:
            return np.zeros(0, dtype=np.int32), counts, None
        num_drafts = batch.num_draft_tokens[rows]
        seq_ids = batch.seq_ids[rows].tolist()
        params = [self.requests[s].params for s in seq_ids]
        gens = [None if p.is_greedy else self.generators.get(s, p.seed) for s, p in zip(seq_ids, params)]
        # q of each draft (draft models); None: one-hot drafters (ngram)
        get_q = getattr(self.proposer, "draft_probs", None)
        draft_probs = get_q(seq_ids, num_drafts.tolist()) if get_q is not None and num_drafts.any() else None
        # left on the CPU: the verifier moves them where it works
        draft_ids = torch.from_numpy(draft_token_ids(batch))
        out = self.rejection_sampler(logits, draft_ids, torch.from_numpy(num_drafts.astype(np.int64)), draft_probs,
                                     params, gens)
        counts[rows] = out.num_tokens.cpu().numpy()
        first_bad = None
        bad = out.first_nonfinite.numpy()
        if (bad >= 0).any():
            first_bad = np.full(batch.num_rows, -1, dtype=np.int64)
            first_bad[rows] = bad
        return out.flat_tokens.cpu().numpy().astype(np.int32), counts, first_bad

    def _all_greedy(self, batch) -> bool:
        reqs = self.requests
        return all(reqs[s].params.is_greedy for s in batch.seq_ids.tolist())

    def _all_greedy_single(self, batch, logits: torch.Tensor) -> bool:
        """Every row wants one token (num_logits 1, no drafts) and is greedy: the rejection
        sampler's plain-greedy case, where each row's token is its argmax."""
        rows = batch.num_rows
        if logits.shape[0] != rows or batch.num_draft_tokens.any() or not (batch.num_logits == 1).all():
            return False
        return self._all_greedy(batch)

    def _commit(self, batch, tokens: np.ndarray, counts: np.ndarray, num_committed: np.ndarray,
                reasons: np.ndarray) -> list[Request]:
        """Outputs for this step (pyengine/engine/output_processor.py); a finished request leaves
        the engine once returned."""
        touched, num_dropped = self.outputs.process(self.scheduler, self.requests, batch, tokens, counts,
                                                    num_committed, reasons)
        self.counters["generated_tokens"] += int(num_committed.sum()) - num_dropped
        finished = [req.request_id for req in touched if req.finished]
        for req in touched:
            if req.finished:  # tokens dropped after a stop string drop their logits and logprobs
                del req.logits[len(req.output_token_ids):]
                if req.logprobs is not None:
                    del req.logprobs[len(req.output_token_ids):]
                    self.num_logprob_requests -= 1
        for rid in finished:
            self.generators.release(rid)
            self.outputs.release(rid)
            del self.requests[rid]
        if finished and self.proposer is not None:
            self.proposer.forget(finished, finished=True)
        return touched

    # ---- reporting -------------------------------------------------------------------------------
    def stats(self) -> dict:
        s = self.scheduler.stats()
        drafted, accepted = s["num_draft_tokens"], s["num_accepted_tokens"]
        out = {
            "num_steps": s["num_steps"],
            "num_preemptions": s["num_preemptions"],
            "prefix_cache_hit_tokens": s["prefix_cache_hit_tokens"],
            "prefix_cache_hit_rate": (s["prefix_cache_hit_tokens"] / s["prefix_cache_query_tokens"]
                                      if s["prefix_cache_query_tokens"] else 0.0),
            **self.counters,
            "prefill_tokens_per_s": self.counters["prefill_tokens"] / self.prefill_time if self.prefill_time else 0.0,
            "decode_tokens_per_s": self.counters["decode_tokens"] / self.decode_time if self.decode_time else 0.0,
        }
        if self.cfg.num_state_checkpoints:
            out.update({"num_state_checkpoints_saved": s["num_state_checkpoints_saved"],
                        "num_state_restores": s["num_state_restores"]})
        if self.k:
            out.update({
                "num_draft_tokens": drafted,
                "num_accepted_tokens": accepted,
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "mean_acceptance_length": s["num_verify_committed"] / s["num_verify_rows"] if s["num_verify_rows"] else 0.0,
                "per_position_acceptance": [a / d if d else 0.0 for a, d in
                                            zip(s["accepted_per_position"], s["drafted_per_position"])],
            })
        return out
