"""HF directory: config.json + *.safetensors (single or sharded) + tokenizer files.

Pickle checkpoints (.bin/.pt/.pth) are refused: unpickling runs arbitrary code."""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn

from pyengine.config import ModelConfig
from pyengine.models import build_model, model_config_from_hf
from pyengine.tokenizer import Tokenizer

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        return files
    if any(name.endswith(_PICKLE_SUFFIXES) for name in os.listdir(path)):
        raise ValueError(
            f"{path} holds only pickle checkpoints (.bin/.pt/.pth), which are refused for safety; "
            "convert them to safetensors"
        )
    raise ValueError(f"no *.safetensors weights in {path}")


def iter_safetensors(files: list[str], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).to(dtype)


def _eos_from_generation_config(path: str) -> list[int]:
    gen_file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(gen_file):
        return []
    with open(gen_file, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token_id")
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def load_hf_dir(path: str, dtype: torch.dtype) -> tuple[nn.Module, ModelConfig, Tokenizer]:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"no config.json in {path}")
    files = safetensors_files(path)  # refuse pickle-only dirs before any other work
    with open(cfg_file, encoding="utf-8") as f:
        config = model_config_from_hf(json.load(f))
    model = build_model(config, dtype)
    model.load_weights(iter_safetensors(files, dtype))  # type: ignore[operator]
    tokenizer = Tokenizer.from_dir(path)
    # Stop on every eos any of the three files names (instruct models list several).
    eos = config.eos_token_ids + _eos_from_generation_config(path) + tokenizer.eos_token_ids
    config.eos_token_ids = list(dict.fromkeys(eos))
    tokenizer.eos_token_ids = config.eos_token_ids
    if tokenizer.bos_token_id is None:
        tokenizer.bos_token_id = config.bos_token_id
    return model, config, tokenizer
