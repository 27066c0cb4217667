"""flashtile/tma.py without a GPU: which maps are encoded, and when one is reused."""

import torch

from flashtile import tma


def test_tensor_maps_are_kept_by_address_shape_strides_and_dtype(monkeypatch):
    """Encoding a map costs ~11 us of host time: the same view of the same memory reuses its map."""
    encoded = []
    monkeypatch.setattr(tma, "_encode", lambda t, block_n: encoded.append((t.shape, block_n)) or bytes(tma.MAP_BYTES))
    tma._kept.clear()
    k = torch.zeros(2, 64, 4, 128, dtype=torch.bfloat16)
    assert len(tma.kv_maps(k, k, 64)) == 2 * tma.MAP_BYTES
    assert encoded == [(k.shape, 64)]                     # k and v are the same view here
    tma.kv_maps(k, k[:, :32], 64)                         # same address, another shape: a map of its own
    tma.kv_maps(k, k, 32)                                 # another box
    assert len(encoded) == 3
    tma.kv_maps(k, k, 64)
    assert len(encoded) == 3
