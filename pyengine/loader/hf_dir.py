"""HF directory: config.json + *.safetensors (single or sharded) + tokenizer files.

Pickle checkpoints (.bin/.pt/.pth) are refused: unpickling runs arbitrary code."""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from pyengine.config import ModelConfig
from pyengine.models import build_model, model_config_from_hf
from pyengine.tokenizer import Tokenizer

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def read_json(path: str) -> Any:
    """A JSON file's contents; ValueError naming the file for unreadable or malformed JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index} has no \"weight_map\" object of tensor name -> shard file")
        files = [os.path.join(path, s) for s in sorted(set(weight_map.values()))]
        missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"{index} names shard {missing[0]}, which is not in {path}"
                             + (f" ({len(missing)} shards missing)" if len(missing) > 1 else ""))
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        return files
    if any(name.endswith(_PICKLE_SUFFIXES) for name in os.listdir(path)):
        raise ValueError(
            f"{path} holds only pickle checkpoints (.bin/.pt/.pth), which are refused for safety; "
            "convert them to safetensors"
        )
    raise ValueError(f"no *.safetensors weights in {path}")


def _bad_safetensors(file: str, exc: Exception) -> ValueError:
    msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return ValueError(f"not a valid safetensors file: {file} ({msg})")


def check_safetensors_headers(files: list[str]) -> None:
    """Open every file's header (cheap: no tensor data is read), so a corrupt or truncated file is
    refused before the model is built. safetensors checks that the header's offsets cover the file."""
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                f.keys()
        except Exception as exc:  # SafetensorError, OSError, ...: one line naming the file
            raise _bad_safetensors(file, exc) from None


def iter_safetensors(files: list[str], dtype: torch.dtype, num_layers: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every file. With num_layers, a tensor of a layer index beyond it is refused."""
    for file in files:
        try:
            handle = safe_open(file, framework="pt")
        except Exception as exc:  # SafetensorError, OSError: one line naming the file
            raise _bad_safetensors(file, exc) from None
        with handle as f:
            for name in f.keys():
                parts = name.split(".")
                if (num_layers is not None and len(parts) > 3 and parts[1] == "layers" and parts[2].isdigit()
                        and int(parts[2]) >= num_layers):
                    raise ValueError(f"{file}: tensor {name} is for layer {int(parts[2])}, but config.json has "
                                     f"num_hidden_layers={num_layers}")
                try:
                    tensor = f.get_tensor(name)
                except Exception as exc:
                    raise _bad_safetensors(file, exc) from None
                # fp8 weights keep their codes until dequantize_fp8_blocks pairs them with their scales.
                yield name, tensor if tensor.dtype in _FP8_DTYPES else tensor.to(dtype)


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_BLOCK = 128


def dequantize_fp8_blocks(weights: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """DeepSeek-V3's fp8 checkpoints: an e4m3 `X.weight` [N, K] with `X.weight_scale_inv`
    [ceil(N/128), ceil(K/128)] (one fp32 scale per 128x128 block) becomes X.weight = codes * scale
    in `dtype`. A weight or scale whose partner never comes is refused by name."""
    codes: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(".weight_scale_inv"):
            scales[name[:-len("_scale_inv")]] = tensor
        elif tensor.dtype in _FP8_DTYPES:
            codes[name] = tensor
        else:
            yield name, tensor
            continue
        key = name[:-len("_scale_inv")] if name.endswith(".weight_scale_inv") else name
        if key in codes and key in scales:
            w, scale = codes.pop(key), scales.pop(key).float()
            rows, cols = w.shape
            blocks = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
            if w.dim() != 2 or tuple(scale.shape) != blocks:
                raise ValueError(f"{key}_scale_inv: shape {tuple(scale.shape)} != {blocks}, the 128x128 blocks of "
                                 f"{key} {tuple(w.shape)}")
            full = scale.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
            yield key, (w.float() * full).to(dtype)
    if codes:
        raise ValueError(f"fp8 tensor {next(iter(codes))} has no {next(iter(codes))}_scale_inv (unsupported quantisation)")
    if scales:
        raise ValueError(f"{next(iter(scales))}_scale_inv has no fp8 weight {next(iter(scales))}")


def _eos_from_generation_config(path: str) -> list[int]:
    gen_file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(gen_file):
        return []
    gen = read_json(gen_file)
    eos = gen.get("eos_token_id") if isinstance(gen, dict) else None
    eos_list = [] if eos is None else (eos if isinstance(eos, list) else [eos])
    if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos_list):
        raise ValueError(f"{gen_file}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return eos_list


def model_config_from_file(cfg_file: str) -> ModelConfig:
    """config.json -> a validated ModelConfig; every problem is a ValueError naming the file."""
    raw = read_json(cfg_file)
    if not isinstance(raw, dict):
        raise ValueError(f"{cfg_file} must hold a JSON object, got a JSON {type(raw).__name__}")
    try:
        config = model_config_from_hf(raw)
        config.validate()
    except KeyError as e:
        raise ValueError(f"{cfg_file} has no {e.args[0]!r}") from None
    except (TypeError, ValueError, ArithmeticError) as e:
        raise ValueError(f"{cfg_file}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return config


def load_hf_dir(path: str, dtype: torch.dtype, load_mtp: bool = False) -> tuple[nn.Module, ModelConfig, Tokenizer]:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"no config.json in {path}")
    files = safetensors_files(path)  # refuse pickle-only dirs before any other work
    config = model_config_from_file(cfg_file)
    mtp_layers = int(getattr(config, "num_nextn_predict_layers", 0))
    if load_mtp:
        if not hasattr(config, "load_mtp") or mtp_layers < 1:
            raise ValueError(f"{path}: speculative method 'mtp' needs a model with MTP layers; {config.architecture} "
                             f"{'has none (num_nextn_predict_layers is 0)' if hasattr(config, 'load_mtp') else 'has no MTP support'}")
        config.load_mtp = True
    check_safetensors_headers(files)
    tokenizer = Tokenizer.from_dir(path)  # a broken tokenizer is refused before the weights are read
    model = build_model(config, dtype)
    try:
        weights = dequantize_fp8_blocks(iter_safetensors(files, dtype, config.num_hidden_layers + mtp_layers), dtype)
        model.load_weights(weights)  # type: ignore[operator]
    except ValueError as e:  # a missing tensor or a wrong shape: name the checkpoint
        msg = str(e).splitlines()[0]
        raise ValueError(msg if path in msg else f"{path}: {msg}") from None
    # Stop on every eos any of the three files names (instruct models list several).
    eos = config.eos_token_ids + _eos_from_generation_config(path) + tokenizer.eos_token_ids
    config.eos_token_ids = list(dict.fromkeys(eos))
    tokenizer.eos_token_ids = config.eos_token_ids
    if tokenizer.bos_token_id is None:
        tokenizer.bos_token_id = config.bos_token_id
    return model, config, tokenizer
