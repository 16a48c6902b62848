"""Per-token logprobs (and entropy) from hidden states and the LM head, chunked over tokens.

``log softmax(h W^T / T)[target]`` for every token without ever holding the
``tokens x vocab`` fp32 logits: a custom autograd function computes the logits of
``chunk_tokens`` tokens at a time, keeps only ``logsumexp`` per token (and the entropy), and
recomputes each chunk's logits in the backward pass. Peak memory is a few
``chunk_tokens x vocab`` fp32 buffers plus one fp32 gradient of the head weight, independent
of the number of tokens. This is the "fused / chunked linear cross-entropy" idea of Liger
Kernel's ``LigerFusedLinearCrossEntropy`` and of Cut Cross-Entropy (Wijmans et al. 2024,
arXiv:2411.09009), applied to RL token logprobs (the ProRL / PPO loss needs logprobs and
entropy of the sampled tokens, never the distribution itself).

Numerics follow the unchunked reference ``log_softmax((h @ W.T).float() / T)``: the matmul
runs in the inputs' dtype (bf16 stays bf16), softmax statistics in fp32, and the gradient of
the logits is cast back to the inputs' dtype before the two backward matmuls, as autograd
does for the reference. Deviation: the head-weight gradient of each chunk is a matmul in the
inputs' dtype (as the reference's), summed over chunks in fp32 and cast once, which is at least
as accurate as the reference's single bf16 matmul (and keeps bf16 matmuls on bf16 hardware).
"""

from __future__ import annotations

from typing import Optional

import torch

from prorl_async.algo._checks import check_shape


def _chunk_stats(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], temperature: float):
    z = h @ weight.t()
    if bias is not None:
        z = z + bias
    z = z.float()
    if temperature != 1.0:
        z = z / temperature
    return z


def _forward_chunk(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                   temperature: float, with_entropy: bool):
    """One chunk's ``(logsumexp, logp of the targets, entropy or None)``."""
    z = _chunk_stats(h, weight, bias, temperature)
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return lse, logp, None
    z.sub_(lse[:, None])  # log p, in place: one chunk buffer
    return lse, logp, -(z.exp() * z).sum(-1)


def _grad_logits(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                 lse: torch.Tensor, g_logp: torch.Tensor, ent: Optional[torch.Tensor], g_ent: Optional[torch.Tensor],
                 temperature: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One chunk's gradient with respect to its logits (the chunk's logits recomputed), computed
    in fp32 and returned in the inputs' dtype, and its fp32 sum over tokens when there is a
    bias (the bias gradient); one compiled graph does the cast too."""
    z = _chunk_stats(h, weight, bias, temperature)
    z.sub_(lse[:, None])  # log p
    p = z.exp()
    # d logp_target / dz = onehot - p ; d H / dz = -p (log p + H)
    if ent is not None:
        gz = z.add_(ent[:, None]).mul_(p).mul_(-g_ent[:, None])
        gz.sub_(p * g_logp[:, None])
    else:
        gz = p.mul_(-g_logp[:, None])
    gz.scatter_add_(-1, targets[:, None], g_logp[:, None])
    if temperature != 1.0:
        gz.div_(temperature)
    return gz.to(h.dtype), (gz.sum(0) if bias is not None else None)


_COMPILED: dict = {}


def _chunk_fns(compiled: bool):
    """``(forward_chunk, grad_logits)``, eager or through ``torch.compile`` (compiled once per
    process, shapes dynamic): compiled, each chunk's fp32 float / logsumexp / exp / scale
    passes over its ``[chunk, V]`` logits fuse into a few kernels (on a GPU they are most of
    the LM head's time: a bandwidth-bound pass per op at 4,096 x 49,152 fp32)."""
    if not compiled:
        return _forward_chunk, _grad_logits
    if not _COMPILED:
        _COMPILED["fns"] = (torch.compile(_forward_chunk, dynamic=True), torch.compile(_grad_logits, dynamic=True))
    return _COMPILED["fns"]


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_tokens, with_entropy, compiled):
        n = hidden.shape[0]
        fwd, _ = _chunk_fns(compiled)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(n, dtype=torch.float32, device=hidden.device) if with_entropy else None
        with torch.no_grad():
            for s in range(0, n, chunk_tokens):
                e = min(n, s + chunk_tokens)
                lse[s:e], logp[s:e], ent_c = fwd(hidden[s:e], weight, bias, targets[s:e], temperature, with_entropy)
                if with_entropy:
                    ent[s:e] = ent_c
        ctx.set_materialize_grads(False)  # an unused entropy output costs nothing in backward
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.temperature, ctx.chunk_tokens, ctx.with_entropy = temperature, chunk_tokens, with_entropy
        ctx.compiled = compiled
        return logp, (ent if with_entropy else torch.empty(0, device=hidden.device))

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk_tokens
        _, grad_logits = _chunk_fns(ctx.compiled)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n = hidden.shape[0]
        if g_logp is None:
            g_logp = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        g_h = torch.empty_like(hidden) if need_h else None
        g_w = None  # the first chunk's product, then summed in fp32 (no zero-filled [V, H] buffer)
        g_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        use_ent = ctx.with_entropy and g_ent is not None and g_ent.numel() > 0
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            with torch.no_grad():
                gz, gz_sum = grad_logits(hidden[s:e], weight, bias, targets[s:e], lse[s:e], g_logp[s:e],
                                         ent[s:e] if use_ent else None, g_ent[s:e] if use_ent else None, temperature)
                if g_b is not None:
                    g_b += gz_sum
                if need_h:
                    torch.mm(gz, weight, out=g_h[s:e])
                if need_w:  # the matmul in the inputs' dtype (bf16 on AMX / tensor cores), summed in fp32
                    part = gz.t() @ hidden[s:e]
                    g_w = part if g_w is None else g_w.float().add_(part)  # .float(): a no-op once fp32
        return (g_h, g_w.to(weight.dtype) if need_w else None, g_b.to(bias.dtype) if need_b else None,
                None, None, None, None, None)


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                   bias: Optional[torch.Tensor] = None, temperature: float = 1.0, chunk_tokens: int = 1024,
                   with_entropy: bool = False, compiled: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Logprob of ``targets`` (and the entropy) under ``softmax((hidden @ weight.T + bias) / temperature)``.

    hidden: ``[..., H]`` final hidden states (after the model's last norm), any float dtype.
    weight: ``[V, H]`` LM-head weight (the embedding when tied), same dtype as ``hidden``.
    targets: ``[...]`` int token ids (the *next* token of each position), same leading shape.
    bias: optional ``[V]`` head bias. temperature: the sampling temperature (logits / T).
    chunk_tokens: tokens whose ``[chunk, V]`` fp32 logits exist at once (memory bound).
    with_entropy: also return the per-token entropy (differentiable), else ``None``.
    compiled: each chunk's elementwise passes through ``torch.compile`` (same math; the
    ``train.compile`` setting, on by default on a GPU).

    Returns ``(logprobs, entropy)``, float32 tensors of the leading shape. Differentiable in
    ``hidden``, ``weight`` and ``bias``; the backward pass recomputes each chunk's logits.
    """
    fn = "token_logprobs"
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"{fn}: `weight` must be [V, {hidden.shape[-1]}] (the LM head), got {list(weight.shape)}")
    check_shape(fn, "targets", targets, hidden.shape[:-1])
    if chunk_tokens <= 0:
        raise ValueError(f"{fn}: `chunk_tokens` must be positive, got {chunk_tokens}")
    if temperature <= 0:
        raise ValueError(f"{fn}: `temperature` must be positive, got {temperature}")
    lead = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).long()
    if weight.dtype != h.dtype:
        raise ValueError(f"{fn}: `hidden` is {h.dtype} and `weight` {weight.dtype}; cast one (autocast is not "
                         "applied inside the chunked head)")
    logp, ent = _ChunkedTokenLogprobs.apply(h, weight, bias, t, float(temperature), int(chunk_tokens),
                                            bool(with_entropy), bool(compiled))
    return logp.reshape(lead), (ent.reshape(lead) if with_entropy else None)
