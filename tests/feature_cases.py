"""The feature combinations the GPU forward and backward tests both sweep (one definition for both)."""

import itertools

import torch

FEATURES = [
    {},
    {"causal": True},
    {"window_size": (100, 0)},
    {"window_size": (50, 50)},
    {"softcap": 30.0},
    {"alibi": True},
    {"causal": True, "softcap": 20.0, "alibi": True},
    {"window_size": (64, 16), "alibi": True},
    {"causal": True, "window_size": (300, -1), "softcap": 5.0},
]
HEADS = [(4, 4), (8, 2), (6, 1)]
DTYPES = [torch.float16, torch.bfloat16]


def feature_cases(head_dims, seqlens):
    """(batch, sq, sk, hq, hkv, d, dv, dtype, features): every head dim x dtype x feature set, with the
    sequence lengths and head counts rotated through so each appears with many features."""
    cases = []
    for n, ((d, dv), dtype, features) in enumerate(itertools.product(head_dims, DTYPES, FEATURES)):
        sq, sk = seqlens[(n * 5) % len(seqlens)]
        hq, hkv = HEADS[n % len(HEADS)]
        batch = 1 if sq * sk > 10**6 else 2
        cases.append((batch, sq, sk, hq, hkv, d, dv, dtype, features))
    return cases


def case_id(c) -> str:
    return f"b{c[0]}-sq{c[1]}-sk{c[2]}-h{c[3]}:{c[4]}-d{c[5]}:{c[6]}-{str(c[7])[6:]}-{'+'.join(c[8]) or 'plain'}"


def feature_options(features, hq, batch, per_batch=False):
    """The attention keyword options of a feature set; "alibi" becomes random slopes on the GPU."""
    options = {k: v for k, v in features.items() if k != "alibi"}
    if features.get("alibi"):
        options["alibi_slopes"] = torch.rand((batch, hq) if per_batch else (hq,), device="cuda") * 0.3
    return options
