"""flashtile: exact attention (FlashAttention) for PyTorch, with CUDA kernels compiled at run time by NVRTC."""

from .api import attention, varlen_attention
from .ladder import RUNGS
from .reference import attention_ref

__version__ = "0.1.0"
__all__ = ["attention", "varlen_attention", "attention_ref", "RUNGS", "__version__"]
