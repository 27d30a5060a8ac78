"""Re-export of pyengine.ops.reference.ssm under its former name, until pyengine/models/mamba2.py
calls the facade (pyengine.ops.<op>)."""
from pyengine.ops.reference.ssm import (PAD, causal_conv1d_fn, causal_conv1d_update, copy_state, normalize_state,
                                        selective_state_update, ssd_chunk_scan)

__all__ = ["PAD", "causal_conv1d_fn", "causal_conv1d_update", "copy_state", "normalize_state",
           "selective_state_update", "ssd_chunk_scan"]
