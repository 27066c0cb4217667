"""Front doors: other libraries' attention APIs served by flashtile.

* :mod:`.flash_attn`: FlashAttention-2's functions (``flash_attn_func`` and friends), same signatures.
* :mod:`.kvcache`: FlashAttention-2's decoding call, ``flash_attn_with_kvcache`` (in-place append, rotary, paged).
* :mod:`.sdpa`: ``torch.nn.functional.scaled_dot_product_attention``'s signature and semantics.
* :mod:`.hf`: ``attn_implementation="flashtile"`` for Hugging Face transformers, after :func:`register_hf`.

None of them imports transformers until :func:`register_hf` is called.
"""

from ._warn import FallbackWarning
from .flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .hf import register_hf
from .kvcache import flash_attn_with_kvcache
from .sdpa import sdpa

__all__ = [
    "FallbackWarning",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "register_hf",
    "sdpa",
]
