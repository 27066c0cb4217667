"""NaN and Inf inputs: where each may go (one definition for the forward, backward and API tests).

The rule (reference.py states it): a row that reads a NaN in q, k or an ALiBi slope, or an Inf in q or a
slope, has a NaN output and a NaN LSE; a row that reads a NaN or Inf in v has a NaN output (its LSE does not
read v). Every other row, and every gradient that depends on no such row, is exact. Rows that see no key keep
output 0 and LSE -inf. (An Inf in k is left out: IEEE arithmetic makes it NaN or a key of weight 0 by sign.)
"""

import math

import torch

from flashtile.reference import visible

SETUPS = {
    # causal, square, GQA, nothing else: the options torch's CPU kernel can serve
    "causal-gqa": dict(shape=(2, 48, 48, 4, 2, 16), options={"causal": True}),
    # first 16 rows see no key; softcap and ALiBi: the chunked loop
    "blind-rows-alibi": dict(shape=(1, 40, 24, 2, 1, 8), options={"causal": True, "softcap": 5.0, "alibi": True}),
    # first 16 rows see no key, GQA, nothing else: host.cpp's own kernel serves it (not square under a causal mask)
    "blind-rows-gqa": dict(shape=(1, 40, 24, 4, 2, 8), options={"causal": True}),
    # causal, square, GQA, past the own kernel's limits: torch's kernel serves it (host.cpp checks q by its LSE)
    "square-torch": dict(shape=(1, 300, 300, 4, 2, 16), options={"causal": True}),
    # decoding: 3 queries of 4 heads over 1100 keys of one kv head, causal: host.cpp's decode path, its keys split
    # in parts; the poisoned key is seen by the last query alone, the poisoned value by the last two
    "decode-gqa": dict(shape=(1, 3, 1100, 4, 1, 8), options={"causal": True},
                       poison_at={"q": (0, 1, 3), "k": (0, 1099, 0), "v": (0, 1098, 0)}),
}
POISON_AT = {"q": (0, 30, 1), "k": (0, 17, 0), "v": (0, 20, 0), "slope": 1}  # (batch, position, head) or head
POISONS = [("q", math.nan), ("k", math.nan), ("v", math.nan), ("slope", math.nan),
           ("q", math.inf), ("q", -math.inf), ("v", math.inf), ("slope", math.inf), ("slope", -math.inf)]


def _poison_at(setup: str, where: str):
    """Where `where` is poisoned in this setup: its own positions, else POISON_AT's."""
    return SETUPS[setup].get("poison_at", POISON_AT)[where]


def _applies(setup: str, poison) -> bool:
    return poison[0] != "slope" or SETUPS[setup]["options"].get("alibi", False)


NONFINITE_CASES = [(setup, poison) for setup in SETUPS for poison in POISONS if _applies(setup, poison)]


def case_id(case) -> str:
    setup, (where, value) = case
    return f"{setup}-{where}={value}"


def make(setup: str, poison, dtype=torch.float32, seed=0):
    """Clean and poisoned (q, k, v, options), and dout. A NaN poisons one element, an Inf a whole vector."""
    batch, sq, sk, hq, hkv, d = SETUPS[setup]["shape"]
    options = dict(SETUPS[setup]["options"])
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, sq, hq, d, generator=g, dtype=dtype)
    k = torch.randn(batch, sk, hkv, d, generator=g, dtype=dtype)
    v = torch.randn(batch, sk, hkv, d, generator=g, dtype=dtype)
    dout = torch.randn(batch, sq, hq, d, generator=g, dtype=dtype)
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(hq, generator=g) * 0.5
    clean = (q, k, v, options)
    where, value = poison
    q, k, v = q.clone(), k.clone(), v.clone()
    options = dict(options)
    if where == "slope":
        options["alibi_slopes"] = options["alibi_slopes"].clone()
        options["alibi_slopes"][_poison_at(setup, "slope")] = value
    else:
        b, pos, h = _poison_at(setup, where)
        target = {"q": q, "k": k, "v": v}[where][b, pos, h]
        if math.isnan(value):
            target[0] = value
        else:
            target.fill_(value)
    return clean, (q, k, v, options), dout


def expected_nan(setup: str, poison) -> dict[str, torch.Tensor]:
    """Boolean masks of the NaN entries the rule allows and requires: out/dq (batch, seqlen_q, heads_q),
    lse (batch, heads_q, seqlen_q), dk/dv (batch, seqlen_k, heads_kv). Everything else must be exact."""
    batch, sq, sk, hq, hkv, _ = SETUPS[setup]["shape"]
    options = SETUPS[setup]["options"]
    seen = visible(torch.arange(sq), torch.arange(sk), sq, sk, -1, 0 if options.get("causal") else -1)
    group = hq // hkv
    # reads[b, h, i, j]: query row i of head h reads key j
    reads = seen.expand(batch, hq, sq, sk).clone()
    reads_qks = torch.zeros(batch, hq, sq, dtype=torch.bool)   # rows that read a poisoned q, k or slope
    reads_v = torch.zeros(batch, hq, sq, dtype=torch.bool)     # rows that read a poisoned v
    where = poison[0]
    if where == "slope":
        slope = _poison_at(setup, "slope")
        reads_qks[:, slope] = reads[:, slope].any(-1)
    else:
        b, pos, h = _poison_at(setup, where)
        if where == "q":
            reads_qks[b, h, pos] = reads[b, h, pos].any()
        else:
            heads = slice(h * group, (h + 1) * group)
            (reads_qks if where == "k" else reads_v)[b, heads] = reads[b, heads, :, pos]
    nan_out = reads_qks | reads_v
    grouped = reads.view(batch, hkv, group, sq, sk)
    nan_dk = (grouped & nan_out.view(batch, hkv, group, sq, 1)).any(dim=(2, 3))
    nan_dv = (grouped & reads_qks.view(batch, hkv, group, sq, 1)).any(dim=(2, 3))
    return {"out": nan_out.transpose(1, 2), "lse": reads_qks, "dq": nan_out.transpose(1, 2),
            "dk": nan_dk.transpose(1, 2), "dv": nan_dv.transpose(1, 2)}


def blind_rows(setup: str) -> torch.Tensor:
    """(batch, heads_q, seqlen_q) rows that see no key."""
    batch, sq, sk, hq, _, _ = SETUPS[setup]["shape"]
    causal = SETUPS[setup]["options"].get("causal")
    seen = visible(torch.arange(sq), torch.arange(sk), sq, sk, -1, 0 if causal else -1)
    return (~seen.any(-1)).expand(batch, hq, sq)


def check(name: str, got: torch.Tensor, want: torch.Tensor, nan: torch.Tensor, atol: float) -> None:
    """NaN exactly where `nan` says (every element of those rows), `want` within atol everywhere else."""
    while nan.dim() < got.dim():
        nan = nan[..., None]
    nan = nan.expand_as(got)
    assert torch.isnan(got[nan]).all(), f"{name}: a value that reads a NaN or Inf is not NaN"
    assert not torch.isnan(got[~nan]).any(), f"{name}: NaN where nothing non-finite is read"
    torch.testing.assert_close(got[~nan].double(), want[~nan].double(), rtol=0, atol=atol, msg=name)
