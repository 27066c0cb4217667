"""flashtile: exact attention (FlashAttention) for PyTorch, with CUDA kernels compiled at run time by NVRTC."""

from .api import attention, varlen_attention
from .explain import explain
from .compat import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    register_hf,
    sdpa,
)
from .ladder import RUNGS
from .reference import attention_ref

__version__ = "0.1.0"
__all__ = ["attention", "varlen_attention", "attention_ref", "explain", "RUNGS", "__version__",
           "flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache", "sdpa",
           "register_hf"]
