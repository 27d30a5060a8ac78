"""`LLM`: the vLLM-compatible entry point (a subset of its arguments, the same names)."""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable, Sequence

import torch

from pyengine.engine.llm_engine import EngineConfig, LLMEngine
from pyengine.engine.output_processor import Request
from pyengine.loader import load_model
from pyengine.engine.kv_budget import (CPU_KV_CACHE_BYTES, StatePoolPlan, cache_budget_bytes, default_num_kv_blocks,
                                       kv_bytes_per_block, plan_state_pool)
from pyengine.engine.model_runner import ModelRunner
from pyengine.engine.prefill_graphs import PREFILL_GRAPH_TOKENS
from pyengine.engine.invariance import cpu_invariance_problem, resolve_batch_invariant
from pyengine.ops.kernel_config import KernelConfig, set_kernel_config, use_kernel_config
from pyengine.outputs import CompletionOutput, RequestOutput
from pyengine.sampling_params import SEED_END, SEED_MIN, SamplingParams
from pyengine.spec_decode.config import SpeculativeConfig

Prompt = str | list[int]
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA GPU is available")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":  # fp32 on CPU (exact references), bf16 on GPU
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


_INT32_MAX = 2**31 - 1
MAX_NUM_SEQS = 1 << 16  # rows of a step: the scheduler and CUDA graph buffers are sized by it


def _positive(name: str, value: Any, allow_none: bool = False, limit: int = _INT32_MAX) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if value > limit:
        raise ValueError(f"{name} must be at most {limit}, got {value!r}")


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")


def _total_memory(device: torch.device) -> int:
    """Bytes the KV pool could at most take: the GPU's free memory, or the machine's RAM."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # no sysconf: let the allocator decide
        return 2**63 - 1


def _check_kv_memory(num_kv_blocks: int, configs: list[Any], block_size: int, dtype: torch.dtype,
                     device: torch.device) -> None:
    """An explicit num_kv_blocks whose pool cannot fit the device is refused with what it needs."""
    per_block = kv_bytes_per_block(configs, block_size, dtype)
    need, have = num_kv_blocks * per_block, _total_memory(device)
    if need > have:
        where = "free GPU memory" if device.type == "cuda" else "RAM"
        raise ValueError(f"num_kv_blocks={num_kv_blocks} needs {need / 2**30:.1f} GiB of KV cache ({per_block} bytes "
                         f"per block of {block_size} tokens), more than the {have / 2**30:.1f} GiB of {where}; "
                         f"lower num_kv_blocks")


def _check_same_tokens(draft_path: str, draft: Any, target: Any) -> None:
    """A draft model must mean the same text by every token id (the sizes may match by chance)."""
    ours, theirs = target.backend.get_vocab(with_added_tokens=True), draft.backend.get_vocab(with_added_tokens=True)
    if ours != theirs:
        by_id = {i: t for t, i in theirs.items()}
        token, i = next((t, i) for t, i in sorted(ours.items(), key=lambda x: x[1]) if by_id.get(i) != t)
        raise ValueError(f"draft model {draft_path} has another tokenizer than the target model (token id {i} is "
                         f"{by_id.get(i)!r} there, {token!r} here): a draft model must share the target's vocabulary")


class LLM:
    def __init__(self, model: str | None = None, device: str = "auto", dtype: str | torch.dtype = "auto", seed: int = 0,
                 max_model_len: int | None = None, block_size: int = 16, num_kv_blocks: int | None = None,
                 enable_prefix_caching: bool = True, max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 speculative_config: dict[str, Any] | None = None, gpu_memory_utilization: float = 0.9,
                 enforce_eager: bool = False, async_decode: bool = True,
                 cpu_kv_cache_bytes: int = CPU_KV_CACHE_BYTES,
                 kernel_config: KernelConfig | dict[str, Any] | None = None,
                 batch_invariant: bool | None = None, num_state_checkpoints: int | None = None,
                 state_checkpoint_interval: int | None = None) -> None:
        """vLLM's arguments, plus: async_decode (launch the next greedy decode step before this
        one's tokens reach the host; CUDA graphs only), cpu_kv_cache_bytes (the KV budget on the
        CPU) and kernel_config (the kernel variants this LLM's loading and steps run: a
        KernelConfig or a dict of its fields; another LLM in the process keeps its own).
        batch_invariant: a row's numbers never depend on the rest of the step (None: the
        kernel_config's batch_invariant, whose None picks per model, device and dtype:
        pyengine/engine/invariance.py; `llm.kernel_config.batch_invariant` says what was picked).
        Hybrid (recurrent-state) models with prefix caching keep their state every
        state_checkpoint_interval tokens (a multiple of block_size; default 256) in a pool of
        num_state_checkpoints slots (default: a tenth of the cache memory)."""
        self.kernel_config = KernelConfig.from_value(kernel_config)
        if batch_invariant is not None:
            if not isinstance(batch_invariant, bool):
                raise ValueError(f"batch_invariant must be a bool, got {batch_invariant!r}")
            self.kernel_config = dataclasses.replace(self.kernel_config, batch_invariant=batch_invariant)
        with use_kernel_config(self.kernel_config):  # loading may pick kernels (CPU GEMM packing)
            for name, value, opt in [("block_size", block_size, False), ("max_model_len", max_model_len, True),
                                     ("num_kv_blocks", num_kv_blocks, True),
                                     ("max_num_batched_tokens", max_num_batched_tokens, True)]:
                _positive(name, value, opt)
            _positive("max_num_seqs", max_num_seqs, limit=MAX_NUM_SEQS)
            _positive("state_checkpoint_interval", state_checkpoint_interval, True)
            if num_state_checkpoints is not None and (not isinstance(num_state_checkpoints, int)
                                                      or isinstance(num_state_checkpoints, bool)
                                                      or not 0 <= num_state_checkpoints <= _INT32_MAX):
                raise ValueError(f"num_state_checkpoints must be an int >= 0, got {num_state_checkpoints!r}")
            _positive("cpu_kv_cache_bytes", cpu_kv_cache_bytes, limit=2**63 - 1)
            for name, value in [("enable_prefix_caching", enable_prefix_caching), ("enforce_eager", enforce_eager),
                                ("async_decode", async_decode)]:
                _bool(name, value)
            if (not isinstance(gpu_memory_utilization, (int, float)) or isinstance(gpu_memory_utilization, bool)
                    or not 0.0 < gpu_memory_utilization <= 1.0):
                raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {gpu_memory_utilization!r}")
            if not isinstance(seed, int) or isinstance(seed, bool) or not SEED_MIN <= seed < SEED_END:
                raise ValueError(f"seed must be an int in [-2**63, 2**64) (a 64-bit seed), got {seed!r}")
            if model is not None and not isinstance(model, str):
                raise ValueError(f"model must be a path (str) or None, got {model!r}")
            spec = SpeculativeConfig.from_dict(speculative_config) if speculative_config is not None else None
            self.device = resolve_device(device)
            self.dtype = resolve_dtype(dtype, self.device)
            torch.manual_seed(seed)
            self.model, self.model_config, self.tokenizer = load_model(model, str(self.device), self.dtype,
                                                                       load_mtp=spec is not None and spec.method == "mtp")
            invariant = resolve_batch_invariant(self.model, self.device, self.dtype, self.kernel_config)
            self.kernel_config = dataclasses.replace(self.kernel_config, batch_invariant=invariant)
            set_kernel_config(self.kernel_config)  # the rest of __init__ (prepacking, graph capture) runs it
            if (self.kernel_config.batch_invariant and self.device.type == "cuda"
                    and not getattr(self.model, "batch_invariant_on_cuda", True)):
                raise ValueError(f"{self.model_config.architecture}: batch_invariant is not available on CUDA in "
                                 f"{self.dtype} at this model's widths (DeepSeek-V3 needs fp16/bf16 and the MLA "
                                 "kernel's kv_lora_rank 512 / qk_rope_head_dim 64)")
            draft = None  # draft model: loaded before the KV budget, which then covers both caches
            if spec is not None and spec.method == "draft_model":
                draft_model, draft_config, draft_tokenizer = load_model(spec.model, str(self.device), self.dtype)
                if draft_config.vocab_size != self.model_config.vocab_size:
                    raise ValueError(f"draft model {spec.model} has a vocabulary of {draft_config.vocab_size} tokens, "
                                     f"the target model {self.model_config.vocab_size}: a draft model must share "
                                     "the target's vocabulary")
                _check_same_tokens(spec.model, draft_tokenizer, self.tokenizer)
                draft = (draft_model, draft_config)
            elif spec is not None and spec.method == "eagle3":  # the head's one KV layer joins the budget
                from pyengine.models.eagle3 import default_head, load_eagle3

                draft = load_eagle3(spec.model or default_head(model), self.model, self.model_config, self.device,
                                    self.dtype)
            limit = self.model_config.max_position_embeddings
            if max_model_len is not None and max_model_len > limit:
                raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's context ({limit})")
            max_model_len = max_model_len or min(limit, 8192)
            kv_configs = [self.model_config] + ([] if draft is None else [draft[1]])
            # ---- hybrid (recurrent-state) models: a state slot pool, and checkpoints for prefix caching ----
            state = StatePoolPlan(0, 0, 0, 0)
            if hasattr(self.model, "state_shapes"):
                if self.kernel_config.batch_invariant and self.device.type == "cuda":
                    # a recurrent-state model is invariant on CUDA once prepack_for_cuda puts its projections
                    # onto the invariant GEMM ([in, out] copies of HF [out, in] weights for the Mamba2 family, a
                    # tied lm_head's copy for Qwen3-Next, or a refusal of widths it does not take)
                    if not hasattr(self.model, "prepack_for_cuda"):
                        raise ValueError(f"{self.model_config.architecture}: batch_invariant is not available for "
                                         "this recurrent-state model on CUDA yet (its projections or state ops run "
                                         "torch's batched kernels)")
                    self.model.prepack_for_cuda()
                if spec is not None and spec.method == "draft_model":
                    raise ValueError(f"{self.model_config.architecture}: draft-model speculation is not supported for "
                                     "recurrent-state models (use ngram)")
                k = spec.num_speculative_tokens if spec else 0
                state = plan_state_pool(self.model.state_shapes(k), self.dtype, k, max_num_seqs, block_size,
                                        enable_prefix_caching,
                                        cache_budget_bytes(self.device, gpu_memory_utilization, cpu_kv_cache_bytes),
                                        num_state_checkpoints, state_checkpoint_interval)
            elif num_state_checkpoints is not None or state_checkpoint_interval is not None:
                raise ValueError(f"{self.model_config.architecture} keeps no recurrent state: num_state_checkpoints "
                                 "and state_checkpoint_interval apply to hybrid models only")
            # ---- end hybrid ----
            if num_kv_blocks is not None:
                _check_kv_memory(num_kv_blocks, kv_configs, block_size, self.dtype, self.device)
            else:
                num_kv_blocks = default_num_kv_blocks(kv_configs, block_size, self.dtype, self.device, max_num_seqs,
                                                      max_model_len, gpu_memory_utilization, cpu_kv_cache_bytes,
                                                      reserved_bytes=state.num_bytes)
            if self.kernel_config.batch_invariant and self.device.type == "cpu":
                problem = cpu_invariance_problem(self.model, self.kernel_config)
                if problem is not None:
                    raise ValueError(problem)
            cfg = EngineConfig(
                max_model_len=max_model_len, block_size=block_size, num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens or max(2048, 4 * max_num_seqs),
                enable_prefix_caching=enable_prefix_caching, seed=seed, speculative=spec,
                num_state_slots=state.num_slots, num_state_checkpoints=state.num_checkpoints,
                state_checkpoint_interval=state.checkpoint_interval, async_decode=async_decode,
                kernel_config=self.kernel_config)
            # enforce_eager (vLLM's name): no CUDA graphs; decode/verify steps are captured otherwise (GPU only).
            runner = ModelRunner(self.model, self.model_config, block_size, num_kv_blocks, self.device, self.dtype,
                                 max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                 max_query_len=1 + (spec.num_speculative_tokens if spec else 0),
                                 cuda_graphs=not enforce_eager and self.device.type == "cuda",
                                 num_state_slots=state.num_slots, num_state_checkpoints=state.num_checkpoints,
                                 prefill_graph_tokens=min(cfg.max_num_batched_tokens, PREFILL_GRAPH_TOKENS))
            self.engine = LLMEngine(runner, self.model_config, self.tokenizer, cfg, draft_model=draft)

    # ---- generation ---------------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompt_list = self._prompt_list(prompts)
        params = self._params_list(sampling_params, len(prompt_list))
        encoded = [(p, self.tokenizer.encode(p)) if isinstance(p, str) else (None, list(p)) for p in prompt_list]
        return self._run(encoded, params, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts (or a list of such lists)")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        if not self.tokenizer.has_chat_template:
            raise ValueError("this model has no chat template; use generate() with plain prompts")
        rendered = [self.tokenizer.apply_chat_template(conv, add_generation_prompt=True) for conv in conversations]
        params = self._params_list(sampling_params, len(rendered))
        encoded = [(text, self.tokenizer.encode(text, add_special_tokens=False)) for text in rendered]
        return self._run(encoded, params, use_tqdm)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def run_requests(self, encoded: list[tuple[str | None, list[int]]], params: list[SamplingParams],
                     on_step: Callable[[list[Request]], None] | None = None, stream: bool = False) -> list[Request]:
        """Add requests, step until they finish; on_step sees the requests each step touched (those
        that finished, and with stream=True every request that received tokens, its text grown)."""
        reqs = [self.engine.add_request(ids, p, prompt=text, stream=stream) for (text, ids), p in zip(encoded, params)]
        while self.engine.has_unfinished():
            touched = self.engine.step()
            if on_step is not None:
                on_step(touched)
        return reqs

    def _run(self, encoded: list[tuple[str | None, list[int]]], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        bar = None
        if use_tqdm and len(encoded) > 1 and sys.stderr.isatty():  # a bar's redraws would flood a log file
            from tqdm import tqdm

            bar = tqdm(total=len(encoded), desc="Generating", unit="req")

        def progress(touched: list[Request]) -> None:
            if bar is not None:
                bar.update(sum(r.finished for r in touched))

        reqs = self.run_requests(encoded, params, progress)
        if bar is not None:
            bar.close()
        return [self._output(r) for r in reqs]

    @staticmethod
    def _output(r: Request) -> RequestOutput:
        completion = CompletionOutput(0, r.text, list(r.output_token_ids), r.finish_reason, r.logprobs)
        return RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, [completion], True, r.error)

    @staticmethod
    def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a str, a list of token ids, or a non-empty list of those")
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if not p:
                    raise ValueError(f"prompt {i} is empty")
            elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                continue
            else:
                raise ValueError(f"prompt {i} must be a non-empty str or a non-empty list of int token ids")
        return list(prompts)

    @staticmethod
    def _params_list(sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"sampling_params must be one SamplingParams or a list of {n} of them")
        return params
