"""flashtile/tma.py without a GPU: which maps are encoded, and when one is reused."""

import torch

from flashtile import tma
from flashtile.specs import KvBox


def test_tensor_maps_are_kept_by_address_shape_strides_and_dtype(monkeypatch):
    """Encoding a map costs ~11 us of host time: the same view of the same memory reuses its map."""
    encoded = []
    monkeypatch.setattr(tma, "_encode",
                        lambda t, box: encoded.append((t.shape, box.rows, box.cols)) or bytes(tma.MAP_BYTES))
    tma._kept.clear()
    k = torch.zeros(2, 64, 4, 128, dtype=torch.bfloat16)
    assert len(tma.kv_maps(k, k, KvBox(64, 32))) == 2 * tma.MAP_BYTES
    assert encoded == [(k.shape, 64, 32)]                 # k and v are the same view here
    tma.kv_maps(k, k[:, :32], KvBox(64, 32))              # same address, another shape: a map of its own
    tma.kv_maps(k, k, KvBox(32, 32))                      # another box
    tma.kv_maps(k, k, KvBox(64, 64))                      # another swizzle (rung 5's 128-byte boxes)
    assert len(encoded) == 4
    tma.kv_maps(k, k, KvBox(64, 32))
    assert len(encoded) == 4
    assert tma.kernel_argument(k, k, None) is None
    assert tma.kernel_argument(k, k, KvBox(0, 32)) == tma.NO_MAPS
