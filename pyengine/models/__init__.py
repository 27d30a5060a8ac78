"""The model families (one file each), the layers they share (layers.py) and the registry that maps
a HF `architectures` name to a model class and its config builder."""
from pyengine.models.registry import build_model, get_model_class, model_config_from_hf, supported_architectures

__all__ = ["build_model", "get_model_class", "model_config_from_hf", "supported_architectures"]
