"""pyengine: a compact LLM inference engine whose speculative decoding is lossless and fast."""
from typing import TYPE_CHECKING

__all__ = ["LLM", "SamplingParams"]

if TYPE_CHECKING:
    from pyengine.engine.llm import LLM
    from pyengine.sampling_params import SamplingParams


def __getattr__(name: str):  # lazy: importing pyengine._C or the core must not pull in torch
    if name == "LLM":
        from pyengine.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pyengine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pyengine' has no attribute {name!r}")
