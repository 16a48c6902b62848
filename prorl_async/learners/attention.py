"""Attention over a packed row: autograd-aware kernels that keep each sequence to itself.

A packed micro-batch (:mod:`prorl_async.learners.packing`) is one row of sequences back to back,
``position_ids`` restarting at 0 for each. transformers' flash attention cuts such a row at the
sequence boundaries with its varlen kernels; for every other attention implementation the
learner swaps in :func:`varlen_sdpa_attention` for the call (:func:`register_varlen_sdpa`,
:func:`attn_implementation`), with the boundaries passed as flash attention's varlen kwargs
(:func:`packed_attention_kwargs`):

* on a GPU in bf16 / fp16: torch's varlen flash attention (:data:`TORCH_VARLEN`);
* otherwise the sequences gathered into right-padded length buckets, one causal attention per
  bucket (:func:`_causal_attention`: sdpa, or on CPU in bf16 / fp16 two matmuls and an fp32
  softmax), with a gather whose backward is a gather too (:class:`_RowGather`);
* with shared prefixes (:func:`~prorl_async.learners.packing.pack_shared_micro_batch`) each
  sequence attends along its own path through the prefix tree.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

if TYPE_CHECKING:
    from prorl_async.learners.packing import PackedMicroBatch

VARLEN_SDPA = "prorl_varlen_sdpa"


def varlen_sdpa_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                          dropout: float = 0.0, scaling: Optional[float] = None, cu_seq_lens_q=None, **kwargs):
    """Causal attention of a packed row, each sequence attending to itself only.

    An HF attention function (``AttentionInterface``) for packed input on hardware without
    flash-attention's varlen kernel (CPU): the sequences of ``[1, heads, N, d]`` q/k/v, cut at
    ``cu_seq_lens_q`` (the boundaries flash-attention's varlen path takes), are gathered into a
    right-padded ``[S, heads, L, d]`` batch and go through one causal attention
    (:func:`_causal_attention`: sdpa, or on CPU in bf16 two matmuls and an fp32 softmax). Right padding needs no mask: under the causal mask a real
    query at position ``i`` sees keys ``0..i`` of its own sequence only, never a pad; pad
    queries' outputs are dropped, so nothing (values or gradients) flows from the pads. Costs
    about ``sum L_i^2`` like varlen flash attention (a block-diagonal ``N x N`` mask through
    sdpa costs ``N^2``), in one kernel call instead of one per sequence (whose slicing made the
    backward zero-fill and add a full ``[1, heads, N, d]`` gradient per sequence). Sequences
    are bucketed (longest first) so that padding at most doubles a bucket's positions.
    Without ``cu_seq_lens_q`` it is plain causal sdpa. With ``prorl_path_index`` / ``prorl_owner``
    (a micro-batch with shared prefixes,
    :func:`~prorl_async.learners.packing.pack_shared_micro_batch`) the sequences are gathered
    along their paths first (``cu_seq_lens_q`` cuts the paths), and every packed position takes
    the output of one path through it; gradients of a shared key / value add up over the paths
    that attend to it.
    Returns ``([1, N, heads, d], None)`` as transformers' sdpa function does. Never traced by
    ``torch.compile`` (``train.compile``; :func:`register_varlen_sdpa` registers it behind
    ``torch.compiler.disable``): its index plan is host-side numpy keyed by the
    sequence boundaries, which a compiled graph would specialise on (a recompilation for every
    new packing); a compiled decoder layer runs the graphs before and after it."""
    if attention_mask is not None:
        raise ValueError(f"{VARLEN_SDPA}: packed input takes no attention_mask (sequences are cut at cu_seq_lens_q)")
    path_index = kwargs.pop("prorl_path_index", None)
    if path_index is not None:  # shared prefixes: every sequence's path through the tree, then each node's output
        owner = kwargs.pop("prorl_owner")
        q, k, v = (x.index_select(2, path_index) for x in (query, key, value))
        out, _ = varlen_sdpa_attention(module, q, k, v, None, dropout, scaling, cu_seq_lens_q=cu_seq_lens_q, **kwargs)
        return out.index_select(1, owner), None
    groups = getattr(module, "num_key_value_groups", 1)
    p = dropout if module.training else 0.0
    if cu_seq_lens_q is not None and _flash_varlen_applies(query, p):
        return _flash_varlen(query, key, value, cu_seq_lens_q, kwargs.get("max_length_q"), scaling, groups), None
    n, heads, kv_heads, d = query.shape[2], query.shape[1], key.shape[1], query.shape[3]
    bounds = np.array([0, n] if cu_seq_lens_q is None else cu_seq_lens_q.tolist(), dtype=np.int64)
    plan = _bucket_plan(bounds.tobytes(), heads, kv_heads, str(query.device))
    # [N * heads, d] rows in memory order (HF's q/k/v are transposed views of [1, N, heads, d])
    q, k, v = (x[0].transpose(0, 1).reshape(n * x.shape[1], d) for x in (query, key, value))
    qs = _RowGather.apply(q, plan.q_index, plan.q_back, False)
    ks = _RowGather.apply(k, plan.kv_index, plan.kv_back, False)
    vs = _RowGather.apply(v, plan.kv_index, plan.kv_back, False)
    outs = []
    for (q0, q1, kv0, kv1, s, length) in plan.buckets:  # [kv_heads * S, groups, L, d] each
        qb = qs[q0:q1].view(kv_heads * s, groups, length, d)
        kb, vb = (x[kv0:kv1].view(kv_heads * s, 1, length, d) for x in (ks, vs))
        outs.append(_causal_attention(qb, kb, vb, p, scaling).reshape(-1, d))
    o = outs[0] if len(outs) == 1 else torch.cat(outs)
    out = _RowGather.apply(o, plan.q_back, plan.q_index_padless, True)  # [N * heads, d] in packed order
    return out.view(1, n, heads, d), None


class _RowGather(torch.autograd.Function):
    """``x.index_select(0, index)`` whose backward is a gather too: ``back[j]`` is the output row
    that reads input row ``j`` (``len(index)``: none, the gradient row is zero when
    ``zero_row``). Exact when every input row is read by at most one output row whose gradient
    can be non-zero; here the only rows read twice are the pads of a right-padded batch, whose
    gradients are zero under the causal mask (no real query sees a pad key, pad queries'
    outputs are dropped). Autograd's own backward of ``index_select`` / indexing is a serial
    ``index_add`` / ``index_put`` with accumulation into a zero-filled tensor: on CPU that was
    most of the packed attention's cost."""

    @staticmethod
    def forward(ctx, x, index, back, zero_row):
        ctx.save_for_backward(back)
        ctx.zero_row = zero_row
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, g):
        (back,) = ctx.saved_tensors
        if ctx.zero_row:
            g = torch.cat([g, g.new_zeros(1, *g.shape[1:])])
        return g.index_select(0, back), None, None, None


@dataclass(frozen=True)
class _BucketPlan:
    """Index arrays of one packed row's attention (:func:`_bucket_plan`)."""

    q_index: torch.Tensor
    q_back: torch.Tensor
    q_index_padless: torch.Tensor
    kv_index: torch.Tensor
    kv_back: torch.Tensor
    buckets: tuple


@functools.lru_cache(maxsize=16)
def _bucket_plan(bounds: bytes, heads: int, kv_heads: int, device: str) -> _BucketPlan:
    """Where every row of the right-padded attention batches comes from in the packed
    ``[N * heads, d]`` rows (memory order: position-major), and back.

    Sequences (cut at ``bounds``) go into length buckets (:func:`_length_buckets`); bucket
    ``b`` of ``S`` sequences padded to ``L`` holds queries as ``[kv_heads, S, groups, L]`` rows
    (the ``groups`` query heads of one key/value head side by side: grouped-query attention
    without repeating keys and values) and keys / values as ``[kv_heads, S, L]`` rows. A pad
    repeats its sequence's last token. ``q_back`` / ``kv_back``: for every packed row, its
    real slot; ``q_index_padless``: ``q_index`` with pads pointing past the end (a zero row).
    Computed once per packed row and reused by every layer (the cache key is the boundaries)."""
    b = np.frombuffer(bounds, dtype=np.int64)
    starts, lens = b[:-1], np.diff(b)
    n, groups = int(b[-1]), heads // kv_heads
    q, kv = _Rows(n * heads), _Rows(n * kv_heads)
    buckets = []
    for seqs in _length_buckets(lens):
        s, length = len(seqs), int(lens[seqs].max())
        ar = np.arange(length)
        real = ar[None, :] < lens[seqs][:, None]  # [S, L]
        pos = np.minimum(starts[seqs][:, None] + ar, (starts[seqs] + lens[seqs] - 1)[:, None])  # [S, L]
        q0, kv0 = q.size, kv.size
        q.add(pos, real, heads, groups, kv_heads)  # [kv, S, g, L]: query head j * groups + i
        kv.add(pos, real, kv_heads, 1, kv_heads)  # [kv, S, 1, L]: key / value head j
        buckets.append((q0, q.size, kv0, kv.size, s, length))

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    return _BucketPlan(t(np.concatenate(q.index)), t(q.back), t(np.concatenate(q.padless)), t(np.concatenate(kv.index)),
                       t(kv.back), tuple(buckets))


class _Rows:
    """The gather of one of :func:`_bucket_plan`'s padded batches (queries, or keys / values),
    built bucket by bucket: ``index`` (slot -> packed row), ``back`` (packed row -> its real
    slot), ``padless`` (``index`` with pads pointing at row ``rows``, a zero row)."""

    def __init__(self, rows: int):
        self.rows, self.size = rows, 0
        self.index, self.padless = [], []
        self.back = np.empty(rows, np.int64)

    def add(self, pos: np.ndarray, real: np.ndarray, heads: int, groups: int, kv_heads: int) -> None:
        """One bucket: ``[S, L]`` packed positions and real flags -> ``[kv_heads, S, groups, L]`` slots
        of the packed ``[N * heads]`` rows (position-major) of head ``j * groups + i``."""
        head = np.arange(kv_heads)[:, None] * groups + np.arange(groups)[None, :]  # [kv, g]
        rows = pos[None, :, None, :] * heads + head[:, None, :, None]
        is_real = np.broadcast_to(real[None, :, None, :], rows.shape)
        slots = self.size + np.arange(rows.size).reshape(rows.shape)
        self.back[rows[is_real]] = slots[is_real]
        self.index.append(rows.ravel())
        self.padless.append(np.where(is_real, rows, self.rows).ravel())
        self.size += rows.size


#: packed bf16 / fp16 rows on a GPU go through torch's varlen flash attention
#: (``torch.nn.attention.varlen``, no padding, no gather); False: the bucketed sdpa above
#: (benchmarks/bench_learner.py --gpu-attention compares the two)
TORCH_VARLEN = True


@functools.cache
def _varlen_attn():
    """torch's varlen flash attention and its keyword arguments for causal attention (the
    signature changed across torch versions); ``(None, None)`` before torch 2.10."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}  # torch >= 2.11: a window
    return varlen_attn, (causal, "enable_gqa" in params)


def _flash_varlen_applies(q: torch.Tensor, dropout: float) -> bool:
    return (TORCH_VARLEN and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and not dropout
            and _varlen_attn()[0] is not None)


def _flash_varlen(query, key, value, cu: torch.Tensor, longest: Optional[int], scale: Optional[float],
                  groups: int) -> torch.Tensor:
    """Causal attention of the packed ``[1, heads, N, d]`` q/k/v in one varlen flash-attention
    call, each sequence attending to itself; ``[1, N, heads, d]``, the shape the other branches
    of :func:`varlen_sdpa_attention` return (shared prefixes index its dimension 1). ``longest``
    comes from the caller (no device-to-host read per layer)."""
    fn, (causal, has_gqa) = _varlen_attn()
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [N, heads, d]
    kw = {"scale": scale, **causal}
    if groups > 1:
        if has_gqa:
            kw["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if longest is None:
        longest = int((cu[1:] - cu[:-1]).max())
    cu = cu.to(device=q.device, dtype=torch.int32)
    return fn(q, k, v, cu, cu, int(longest), int(longest), **kw).unsqueeze(0)


#: a bf16 / fp16 batch of at most this many attention scores (``B x groups x L x L``) on CPU runs as
#: two matmuls and a softmax (:func:`_causal_attention`); larger ones, fp32 and GPUs use sdpa
BMM_ATTENTION_MAX_SCORES = 1 << 25  # 128 MiB of fp32 scores


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float,
                      scale: Optional[float]) -> torch.Tensor:
    """Causal attention of ``[B, groups, L, d]`` queries over ``[B, 1, L, d]`` keys / values
    (grouped-query attention: the ``groups`` query heads of a batch entry share its key / value
    head); ``[B, groups, L, d]``.

    On CPU in bf16 / fp16 with at most :data:`BMM_ATTENTION_MAX_SCORES` scores: fp32 scores
    (inputs upcast, as flash attention keeps its scores in fp32) of all ``groups x L`` query rows
    against the ``L`` keys in one ``baddbmm`` that also scales them and adds the causal mask
    (one pass over the scores), an fp32 softmax, then the probabilities in the inputs' dtype
    times ``v`` (as flash attention does). Measured here (2-core Xeon, AMX, ``[32, 9, 136, 64]``
    bf16): forward + backward about 5x faster than torch's CPU flash-attention kernel, whose
    bf16 backward was the largest single cost of a SmolLM2 learner step (benchmarks/RESULTS.md).
    Everything else: sdpa (``enable_gqa``)."""
    b, groups, length, d = q.shape
    if (dropout or q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float16)
            or b * groups * length * length > BMM_ATTENTION_MAX_SCORES):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                                                scale=scale, enable_gqa=groups > 1)
    rows = groups * length
    scores = torch.baddbmm(_causal_bias(groups, length, str(q.device)), q.reshape(b, rows, d).float(),
                           k.reshape(b, length, d).float().transpose(1, 2), alpha=d ** -0.5 if scale is None else scale)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.bmm(probs, v.reshape(b, length, d)).view(b, groups, length, d)


@functools.lru_cache(maxsize=64)
def _causal_bias(groups: int, length: int, device: str) -> torch.Tensor:
    """``[groups * L, L]`` fp32: 0 where query row ``r`` (position ``r % L``) may see key ``c``, else -inf."""
    pos = torch.arange(length, device=device)
    allowed = pos[None, :] <= pos.repeat(groups)[:, None]
    return torch.zeros(groups * length, length, device=device).masked_fill_(~allowed, float("-inf"))


def _length_buckets(lens: np.ndarray) -> list[np.ndarray]:
    """Sequence indices in buckets, longest first, each bucket's ``S x L`` padded positions at
    most twice its real tokens; indices ascending inside a bucket (one bucket: packed order)."""
    order = np.argsort(-lens, kind="stable")
    buckets, cur, real = [], [], 0
    for i in order.tolist():
        if cur and (len(cur) + 1) * int(lens[cur[0]]) > 2 * (real + int(lens[i])):
            buckets.append(np.sort(np.asarray(cur)))
            cur, real = [], 0
        cur.append(i)
        real += int(lens[i])
    if cur:
        buckets.append(np.sort(np.asarray(cur)))
    return buckets


@contextlib.contextmanager
def attn_implementation(config, impl: str):
    """``config._attn_implementation`` set to ``impl`` for the duration (the padded path and
    generation keep the model's own)."""
    before = config._attn_implementation
    if before == impl:
        yield
        return
    config._attn_implementation = impl
    try:
        yield
    finally:
        config._attn_implementation = before


def _no_mask(*args, **kwargs):
    return None  # varlen attention cuts sequences itself: no N x N mask is built


@functools.cache
def _not_traced():
    return torch.compiler.disable(varlen_sdpa_attention)


def register_varlen_sdpa() -> str:
    """Register :func:`varlen_sdpa_attention` with transformers (idempotent); returns its name.
    Behind ``torch.compiler.disable`` once ``torch._dynamo`` is loaded (a compiled learner loads it
    when it compiles, before its first step): decorating at import would load dynamo (~1.7 s of CPU)
    into every process that imports this module, the driver's and an eager learner's included."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    fn = _not_traced() if "torch._dynamo" in sys.modules else varlen_sdpa_attention
    AttentionInterface.register(VARLEN_SDPA, fn)
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN_SDPA, _no_mask)
    return VARLEN_SDPA


def packed_attention_kwargs(mb: "PackedMicroBatch", device) -> dict:
    """Sequence boundaries of a packed row in the kwargs transformers hands to its attention
    function (flash-attention's varlen names, also read by :func:`varlen_sdpa_attention`)."""
    cu = mb.cu_seqlens.to(device=device, dtype=torch.int32)
    longest = int((mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).max())
    kw = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    if mb.path_index is not None:  # shared prefixes: only varlen_sdpa_attention reads these
        kw.update(prorl_path_index=mb.path_index.to(device), prorl_owner=mb.owner.to(device))
    return kw
