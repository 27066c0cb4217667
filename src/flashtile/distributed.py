"""Context parallelism: one sequence split over the ranks of a process group (ring attention).

Each rank holds a shard of q, k and v along the sequence (`shard` / `unshard`). K and V travel round the ring by
point-to-point sends (over NCCL on its own stream, while the step before them computes); at every step a rank
attends each of its query chunks to each key/value chunk it holds with `flashtile.attention` (which returns the
log-sum-exp), and the partial outputs merge in fp32 by their LSE. The sends are an autograd op whose backward
sends the gradients back the other way, and the merge is ordinary torch arithmetic on differentiable outputs and
LSEs, so autograd yields dQ, dK and dV on the ranks that own them.

Masks: the whole sequence's causal mask and sliding window become, for each pair of chunks, the rows and keys of
the pair that the band reaches and a window shifted to their bottom-right alignment (`_pair_bounds`); a pair
the band misses is skipped. `ring_varlen_attention` runs the same ring over a packed batch of documents, each
pair of chunks as one varlen call over the documents' pieces in the two chunks.

Layouts (how a sequence of n tokens is split over W ranks):
  "contiguous": rank r holds tokens [r n / W, (r + 1) n / W).
  "zigzag": the sequence is cut into 2W chunks and rank r holds chunks r and 2W - 1 - r, so that under a causal
  mask every rank has the same work.
Works with NCCL on GPUs and gloo on CPUs, for any number of ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import api

LAYOUTS = ("zigzag", "contiguous")


def _world(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _chunks_of(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The sequence chunks rank `rank` holds: of 2W chunks (zigzag) or W (contiguous)."""
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def shard(x: torch.Tensor, group=None, layout: str = "zigzag", seq_dim: int = 1) -> torch.Tensor:
    """This rank's shard of a full sequence `x` (the same tensor on every rank), split along `seq_dim`."""
    _check_layout(layout)
    world, rank = _world(group)
    parts = 2 * world if layout == "zigzag" else world
    if x.shape[seq_dim] % parts:
        raise ValueError(f"the sequence length ({x.shape[seq_dim]}) must be a multiple of {parts} to split over "
                         f"{world} ranks in the {layout!r} layout")
    chunks = x.chunk(parts, dim=seq_dim)
    return torch.cat([chunks[c] for c in _chunks_of(rank, world, layout)], dim=seq_dim).contiguous()


def unshard(x: torch.Tensor, group=None, layout: str = "zigzag", seq_dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard `x` (the inverse of :func:`shard`), on every rank."""
    _check_layout(layout)
    world, _ = _world(group)
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x.contiguous(), group=group)
    per_rank = 2 if layout == "zigzag" else 1
    chunks: dict[int, torch.Tensor] = {}
    for rank, part in enumerate(gathered):
        for c, piece in zip(_chunks_of(rank, world, layout), part.chunk(per_rank, dim=seq_dim)):
            chunks[c] = piece
    return torch.cat([chunks[c] for c in sorted(chunks)], dim=seq_dim)


class _RingShift(torch.autograd.Function):
    """Send a tensor to the next rank and receive the previous rank's; the backward sends gradients back.

    The forward only starts the exchange where the backend runs it beside the computation (NCCL: on its own
    stream): it appends the exchange's requests to `pending`, and the caller waits on them once it has queued
    the work that overlaps them, before anything reads the result."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, pending: list) -> torch.Tensor:
        ctx.group = group
        received, requests = _start_exchange(x, group, step=1)
        pending.extend(requests)
        return received

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        received, requests = _start_exchange(grad.contiguous(), ctx.group, step=-1)
        for request in requests:
            request.wait()
        return received, None, None


class _Reaching(torch.autograd.Function):
    """`out` unchanged, with a gradient path to `held`: every rank's backward then reaches every ring shift, also
    where its mask used none of the keys a shift brought (a causal contiguous layout), so that each shift's
    backward exchange has its partner on the neighbouring ranks."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        ctx.held = (held.shape, held.dtype, held.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.held
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def _start_exchange(x: torch.Tensor, group, step: int) -> tuple[torch.Tensor, list]:
    """Send x to rank + step and receive from rank - step (on the ring of `group`): the buffer that receives, and
    the requests to wait on before reading it (none where the exchange has already finished)."""
    world, rank = _world(group)
    received = torch.empty_like(x)

    def peer(r: int) -> int:  # a rank of the group as the global rank P2P calls name
        return r if group is None else dist.get_global_rank(group, r)

    to, frm = peer((rank + step) % world), peer((rank - step) % world)
    if dist.get_backend(group) == dist.Backend.GLOO:
        # Blocking calls in an order that cannot deadlock: even ranks send first, odd ranks receive first (gloo's
        # batched point-to-point calls hung now and then in the 2- and 4-process tests).
        if rank % 2 == 0:
            dist.send(x.contiguous(), to, group)
            dist.recv(received, frm, group)
        else:
            dist.recv(received, frm, group)
            dist.send(x.contiguous(), to, group)
        return received, []
    ops = [dist.P2POp(dist.isend, x.contiguous(), to, group), dist.P2POp(dist.irecv, received, frm, group)]
    return received, dist.batch_isend_irecv(ops)


def _merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """o = sum_i exp(lse_i - lse) o_i and lse = logsumexp_i lse_i, in fp32; parts that saw no key (lse -inf)
    add nothing. Dense parts: out (b, s, h, d), lse (b, h, s); packed: out (t, h, d), lse (h, t)."""
    lse_all = torch.stack(lses)                                    # (parts, ..., h, s)
    lse = torch.logsumexp(lse_all, dim=0)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    weights = torch.exp(lse_all - safe)                            # a row no part saw: every weight 0
    out = sum(w.transpose(-1, -2).unsqueeze(-1) * o.float() for w, o in zip(weights, outs))
    return out, lse


def _ring(q, k, v, group, layout: str, seq_dim: int, attend) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring over this rank's shards (sequence along `seq_dim`): `attend(q_chunk, k_chunk, v_chunk, q_index,
    k_index)` gives one pair of chunks' (out, lse), or None when the mask hides the whole pair; returns this rank's
    merged out (in q's dtype) and LSE."""
    world, rank = _world(group)
    per_rank = 2 if layout == "zigzag" else 1
    if q.shape[seq_dim] % per_rank or k.shape[seq_dim] != q.shape[seq_dim]:
        raise ValueError(f"q, k and v must be shards of one layout: {q.shape[seq_dim]} and {k.shape[seq_dim]} local "
                         f"tokens; the {layout!r} layout holds {per_rank} equal chunk(s) per rank")
    chunk = q.shape[seq_dim] // per_rank
    q_chunks = q.split(chunk, dim=seq_dim)
    my_chunks = _chunks_of(rank, world, layout)
    outs: list[list] = [[] for _ in q_chunks]
    lses: list[list] = [[] for _ in q_chunks]
    kv = torch.cat([k, v], dim=-1)
    head_dim = k.shape[-1]
    for step in range(world):
        owner = (rank - step) % world
        k_held, v_held = kv[..., :head_dim], kv[..., head_dim:]
        # The next step's K and V start travelling now and arrive while this step's attention runs.
        pending: list = []
        arriving = _RingShift.apply(kv, group, pending) if step + 1 < world else None
        k_chunks, v_chunks = k_held.split(chunk, dim=seq_dim), v_held.split(chunk, dim=seq_dim)
        for qi, qc in enumerate(my_chunks):
            for ki, kc in enumerate(_chunks_of(owner, world, layout)):
                found = attend(q_chunks[qi], k_chunks[ki], v_chunks[ki], qc, kc)
                if found is not None:
                    outs[qi].append(found[0])
                    lses[qi].append(found[1])
        for request in pending:  # NCCL: the current stream waits for the exchange, the host does not
            request.wait()
        if arriving is not None:
            kv = arriving
    merged = [_merge(o, lse) for o, lse in zip(outs, lses)]
    out = torch.cat([o for o, _ in merged], dim=seq_dim).to(q.dtype)
    if world > 1:
        out = _Reaching.apply(out, kv)
    return out, torch.cat([lse for _, lse in merged], dim=-1)


def ring_attention(q, k, v, *, group=None, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                   layout="zigzag", return_lse=False, deterministic=False):
    """Attention of this rank's shard of queries over the whole sequence, which the ranks of `group` hold in
    shards along dim 1 (see :func:`shard`).

    Args:
        q, k, v: this rank's shards, (batch, seqlen_local, heads, head_dim); heads_q a multiple of heads_kv.
        causal, softmax_scale, window_size, softcap, deterministic: as in :func:`flashtile.attention`, for the
            whole sequence (a sliding window may reach across shards).
        layout: "zigzag" or "contiguous", as the shards were made.
    Returns:
        this rank's shard of the output (in q's dtype), and of the fp32 LSE (batch, heads, seqlen_local) if
        ``return_lse``. Differentiable in q, k and v.
    """
    _check_layout(layout)
    window = _whole_window(window_size, causal)
    _check_initialized()
    options = dict(softmax_scale=softmax_scale, softcap=softcap, deterministic=deterministic, return_lse=True)

    def attend(qc, kc, vc, q_index, k_index):
        bounds = _pair_bounds(q_index, k_index, qc.shape[1], window)
        if bounds is None:
            return None
        (q0, q1), (k0, k1), pair_window = bounds
        o, lse = api.attention(qc[:, q0:q1], kc[:, k0:k1], vc[:, k0:k1], window_size=pair_window, **options)
        if (q0, q1) == (0, qc.shape[1]):
            return o, lse
        # Rows outside [q0, q1) see no key of this pair: output 0, LSE -inf (they weigh nothing in the merge).
        rows = qc.shape[1]
        o = torch.cat([o.new_zeros(o.shape[0], q0, *o.shape[2:]), o, o.new_zeros(o.shape[0], rows - q1, *o.shape[2:])], 1)
        none = float("-inf")
        lse = torch.cat([lse.new_full((*lse.shape[:2], q0), none), lse, lse.new_full((*lse.shape[:2], rows - q1), none)],
                        2)
        return o, lse

    out, lse = _ring(q, k, v, group, layout, 1, attend)
    return (out, lse) if return_lse else out


def _whole_window(window_size, causal: bool) -> tuple[int, int]:
    """The whole sequence's window (left, right) as two ints >= -1 (-1 unbounded), causal folded in (right 0)."""
    try:
        left, right = (int(b) for b in window_size)
    except (TypeError, ValueError):
        left = right = None
    if left is None or left < -1 or right < -1:
        raise ValueError(f"window_size must be a pair of integers >= -1 (-1 = unbounded), got {window_size!r}")
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def _pair_bounds(q_index: int, k_index: int, chunk: int, window: tuple[int, int]):
    """Where chunk `q_index`'s queries meet chunk `k_index`'s keys (both `chunk` long) under the whole sequence's
    window: (query rows [q0, q1), key rows [k0, k1), the window of that sub-problem for flashtile.attention), or
    None when no query sees a key of the pair.

    Query a of the chunk sees key b when a + delta - left <= b <= a + delta + right, delta = (q_index - k_index) x
    chunk. The rows and keys outside the band are cut off, and the sub-problem's bottom-right-aligned window
    (offset = its keys - its queries) is shifted to the band: both bounds come out >= 0 (or -1, unbounded)."""
    left, right = window
    delta = (q_index - k_index) * chunk
    reach = abs(delta) + 2 * chunk  # an unbounded side: past every key of the pair
    lo = reach if left < 0 else left    # keys before the diagonal a query may see
    hi = reach if right < 0 else right  # keys after it
    q0, q1 = max(0, -delta - hi), min(chunk, chunk - delta + lo)
    if q0 >= q1:
        return None
    k0, k1 = max(0, q0 + delta - lo), min(chunk, q1 + delta + hi)
    if k0 >= k1:
        return None
    shift = (k1 - k0) - (q1 - q0) - (q0 - k0 + delta)  # the sub-problem's offset minus the band's
    pair_left = -1 if left < 0 else left + shift
    pair_right = -1 if right < 0 else right - shift
    return (q0, q1), (k0, k1), (pair_left, pair_right)


def ring_varlen_attention(q, k, v, cu_seqlens, *, group=None, causal=False, softmax_scale=None, softcap=0.0,
                          layout="zigzag", return_lse=False, deterministic=False):
    """Ring attention over a packed batch of documents: the documents, concatenated without padding into one
    sequence of `total` tokens, are split over the ranks like one sequence (:func:`shard` with ``seq_dim=0``),
    and each document attends only within itself.

    Args:
        q, k, v: this rank's shards, (tokens_local, heads, head_dim); heads_q a multiple of heads_kv.
        cu_seqlens: the documents' offsets in the whole packed sequence (documents + 1 integers from 0 to
            `total` = tokens_local x ranks; a tensor or a list, the same on every rank).
        causal, softmax_scale, softcap, deterministic, layout: as in :func:`ring_attention`.
    Returns:
        this rank's shard of the output (tokens_local, heads, head_dim_v) in q's dtype, and of the fp32 LSE
        (heads, tokens_local) if ``return_lse``. Differentiable in q, k and v.
    """
    _check_layout(layout)
    _check_initialized()
    world, _ = _world(group)
    parts = 2 * world if layout == "zigzag" else world
    total = q.shape[0] * world
    offsets = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if (len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != total
            or any(b < a for a, b in zip(offsets, offsets[1:]))):
        raise ValueError(f"cu_seqlens must rise from 0 to the whole packed length {total} (tokens_local x ranks), "
                         f"got {offsets[:8]}...")
    if total % parts:
        raise ValueError(f"the packed length ({total}) must be a multiple of {parts} to split over {world} ranks in "
                         f"the {layout!r} layout")
    span = total // parts
    pieces = {}  # chunk -> (its documents' offsets within the chunk, on q's device, and the longest piece)

    def chunk_offsets(c: int):
        if c not in pieces:
            lo, hi = c * span, (c + 1) * span
            lengths = [max(0, min(b, hi) - max(a, lo)) for a, b in zip(offsets, offsets[1:])]
            cumulative = [0]
            for n in lengths:
                cumulative.append(cumulative[-1] + n)
            pieces[c] = (torch.tensor(cumulative, dtype=torch.int32, device=q.device), max(lengths))
        return pieces[c]

    options = dict(softmax_scale=softmax_scale, softcap=softcap, deterministic=deterministic, return_lse=True)

    def attend(qc, kc, vc, q_index, k_index):
        # Every document of the pair, its piece of either chunk possibly empty; a document's keys in an earlier
        # chunk all precede its queries, and in the same chunk they are the same tokens (the diagonal).
        window = _pair_window(q_index, k_index, causal)
        if window is None:
            return None
        (cu_q, max_q), (cu_k, max_k) = chunk_offsets(q_index), chunk_offsets(k_index)
        return api.varlen_attention(qc, kc, vc, cu_q, cu_k, max_q, max_k, window_size=window, **options)

    out, lse = _ring(q, k, v, group, layout, 0, attend)
    return (out, lse) if return_lse else out


def _check_initialized() -> None:
    if not dist.is_initialized():
        raise RuntimeError("ring attention needs torch.distributed to be initialised (dist.init_process_group)")


def _pair_window(q_chunk: int, k_chunk: int, causal: bool) -> tuple[int, int] | None:
    """The window of q chunk `q_chunk` against k chunk `k_chunk` (equal lengths) under the whole sequence's mask:
    every key before the queries' chunk (-1, -1), the diagonal chunk causal (-1, 0), None when the mask hides the
    whole pair (a later chunk under the causal mask). Square chunks: bottom-right alignment is the diagonal."""
    if not causal or q_chunk > k_chunk:
        return (-1, -1)
    return (-1, 0) if q_chunk == k_chunk else None
