"""The SSM ops for CUDA tensors under their former module name, until pyengine/models/mamba2.py
calls the facade (pyengine.ops.<op>). Importing it raises ImportError when the kernels are not
built, as before."""
from pyengine.ops import cuda as _cuda_backend  # noqa: F401  (the ImportError of an unbuilt extension)
from pyengine.ops import (causal_conv1d_fn, causal_conv1d_update, copy_state, normalize_state, selective_state_update,
                          ssd_chunk_scan)

__all__ = ["causal_conv1d_fn", "causal_conv1d_update", "copy_state", "normalize_state", "selective_state_update",
           "ssd_chunk_scan"]
