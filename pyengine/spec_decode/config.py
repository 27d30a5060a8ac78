"""Speculative-decoding configuration (vLLM's names)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SpeculativeConfig:
    # "ngram", "suffix", "draft_model", "mtp" (the target's own multi-token-prediction layers) or
    # "eagle3" (an EAGLE-3 head: model is its directory; None: the head shipped for the default model)
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int | None = None  # None: by device (lookup_min)
    model: str | None = None
    adaptive_draft_length: bool = True  # False: always propose up to k (tests pin every path)
    # The adaptive policy's decode-step cost a + b * tokens fed (only b / a matters); None: modelled
    # from the model's weights and the device (pyengine.spec_decode.step_cost.modelled_step_cost)
    step_cost: tuple[float, float] | None = None
    # method "suffix" (pyengine/spec_decode/suffix.py): longest context indexed, drafts per matched
    # context token, the least share of a context's continuations a draft may have, and the finished
    # requests' tokens kept for other requests (vLLM's suffix_decoding_* names)
    suffix_max_depth: int = 24
    suffix_max_spec_factor: float = 1.0
    suffix_min_token_prob: float = 0.1
    suffix_max_cached_tokens: int = 1 << 20

    def lookup_min(self, device_type: str) -> int:
        """The lookup's shortest match: prompt_lookup_min if set, else one token on CUDA (vLLM's
        documented default; a verify token is nearly free on a graph step: Spec-Bench 1.49x against
        1.41x from two tokens at batch 1 on the H100) and two elsewhere (a verify token costs the
        CPU compute, and one-token matches are accepted less often: 0.99-1.00x against 1.04-1.08x on
        a 2-vCPU Xeon; docs/speculation.md)."""
        if self.prompt_lookup_min is not None:
            return self.prompt_lookup_min
        return min(1 if device_type == "cuda" else 2, self.prompt_lookup_max)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
                 "adaptive_draft_length", "step_cost", *SUFFIX_KEYS}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)} (known: {sorted(known)})")
        method = d.get("method") or ("draft_model" if d.get("model") else None)
        if method == "draft":
            method = "draft_model"
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be 'ngram', 'suffix', 'draft_model', 'mtp' or 'eagle3', "
                             f"got {method!r}")
        k = d.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 32:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an int in 1..32, got {k!r}")
        adaptive = d.get("adaptive_draft_length", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config.adaptive_draft_length must be a bool, got {adaptive!r}")
        step_cost = d.get("step_cost")
        if step_cost is not None:
            from pyengine.spec_decode.step_cost import check_step_cost

            step_cost = check_step_cost(step_cost, "speculative_config.step_cost")
        cfg = cls(method=method, num_speculative_tokens=k, model=d.get("model"), adaptive_draft_length=adaptive,
                  step_cost=step_cost)
        if method in ("ngram", "suffix"):
            # suffix: the lookup that stands in for the suffix tree in steps built on the device
            # (engine/device_verify.py); unset, the minimum follows the device (lookup_min)
            cfg.prompt_lookup_max = _lookup_len(d, "prompt_lookup_max", 4)
            if "prompt_lookup_min" in d:
                cfg.prompt_lookup_min = _lookup_len(d, "prompt_lookup_min", 1)
            if cfg.prompt_lookup_min is not None and not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
                raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                                 f"{cfg.prompt_lookup_min}..{cfg.prompt_lookup_max}")
        elif set(d) & {"prompt_lookup_min", "prompt_lookup_max"}:
            raise ValueError(f"speculative_config: {sorted(set(d) & {'prompt_lookup_min', 'prompt_lookup_max'})} "
                             f"apply to methods 'ngram' and 'suffix' only")
        if method == "suffix":
            _suffix_settings(cfg, d)
        elif set(d) & SUFFIX_KEYS.keys():
            raise ValueError(f"speculative_config: {sorted(set(d) & SUFFIX_KEYS.keys())} apply to method 'suffix' only")
        if method in ("ngram", "suffix") and cfg.model is not None:
            raise ValueError(f"speculative_config.model is not used by method {method!r}")
        if method == "draft_model" and not cfg.model:
            raise ValueError("speculative_config.model (the draft model's path) is required for a draft model")
        if method == "mtp" and cfg.model is not None:
            raise ValueError("speculative_config.model is not used by method 'mtp' (the target's own MTP layers draft)")
        if cfg.model is not None and not isinstance(cfg.model, str):
            raise ValueError(f"speculative_config.model must be a path (str), got {cfg.model!r}")
        return cfg


METHODS = ("ngram", "suffix", "draft_model", "mtp", "eagle3")
MAX_LOOKUP_LEN = 2**31 - 1  # the ngram lookup's lengths are int32 in the scheduler
# speculative_config key -> (field, type, lowest, highest)
SUFFIX_KEYS = {"suffix_decoding_max_tree_depth": ("suffix_max_depth", int, 1, 1024),
               "suffix_decoding_max_spec_factor": ("suffix_max_spec_factor", float, 0.0, 1e6),
               "suffix_decoding_min_token_prob": ("suffix_min_token_prob", float, 0.0, 1.0),
               "suffix_decoding_max_cached_tokens": ("suffix_max_cached_tokens", int, 0, 2**62)}


def _suffix_settings(cfg: SpeculativeConfig, d: dict[str, Any]) -> None:
    for key, (name, kind, low, high) in SUFFIX_KEYS.items():
        if key not in d:
            continue
        value = d[key]
        ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
        if not ok or not low <= value <= high:
            raise ValueError(f"speculative_config.{key} must be {'a number' if kind is float else 'an int'} in "
                             f"[{low}, {high}], got {value!r}")
        setattr(cfg, name, kind(value))


def _lookup_len(d: dict[str, Any], key: str, default: int) -> int:
    value = d.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_LOOKUP_LEN:
        raise ValueError(f"speculative_config.{key} must be an int in 1..{MAX_LOOKUP_LEN}, got {value!r}")
    return value
