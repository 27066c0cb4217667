import sys, os, torch, faulthandler
faulthandler.enable()
import flashtile
from flashtile.reference import attention_ref, varlen_apply
torch.manual_seed(0)
def err(a, b): return f"{(a.double() - b).abs().max().item():.4f}"
for d, n, causal, det in [(128, 256, False, False), (64, 300, True, False), (256, 200, False, False), (128, 1000, True, True)]:
    q, k, v = (torch.randn(2, n, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flashtile.attention(q, k, v, causal=causal, deterministic=det)
    g = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    torch.cuda.synchronize()
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention_ref(qr, kr, vr, causal=causal)[0]
    rq, rk, rv = torch.autograd.grad(ref, (qr, kr, vr), g.double())
    print(d, n, causal, det, [err(a, b) for a, b in ((dq, rq), (dk, rk), (dv, rv))], flush=True)
lengths = [70, 200, 33, 129]
cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.int32)
for d in (64, 128, 256):
    q, k, v = (torch.randn(sum(lengths), 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flashtile.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    g = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = varlen_apply(lambda *a, **o: attention_ref(*a, **o), qr, kr, vr, cu, cu, causal=True)
    ref = ref[0] if isinstance(ref, tuple) else ref
    rq, rk, rv = torch.autograd.grad(ref, (qr, kr, vr), g.double())
    print("varlen", d, [err(a, b) for a, b in ((dq, rq), (dk, rk), (dv, rv))], flush=True)
