"""Chunked token logprobs vs the full-logits reference: values and gradients (fp32, bf16),
entropy, temperature, and peak memory bounded by the chunk (measured in fresh processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from prorl_async.algo.token_logprobs import token_logprobs


def _reference(h, w, b, t, temperature):
    z = h @ w.t()
    if b is not None:
        z = z + b
    logp_all = torch.log_softmax(z.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, t[..., None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


def _inputs(dtype, n=37, hdim=16, vocab=101, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hdim, generator=g).to(dtype).requires_grad_()
    w = (0.5 * torch.randn(vocab, hdim, generator=g)).to(dtype).requires_grad_()
    b = (0.1 * torch.randn(vocab, generator=g)).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, vocab, (n,), generator=g)
    cl = torch.randn(n, generator=g)  # arbitrary upstream gradients
    ce = torch.randn(n, generator=g)
    return h, w, b, t, cl, ce


def _grads(fn, h, w, b, t, cl, ce, temperature):
    logp, ent = fn(h, w, b, t, temperature)
    ((logp * cl).sum() + (ent * ce).sum()).backward()
    out = (logp.detach(), ent.detach(), h.grad.clone(), w.grad.clone(), None if b is None else b.grad.clone())
    for x in (h, w, b):
        if x is not None:
            x.grad = None
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("temperature,bias,chunk", [(1.0, False, 8), (0.7, True, 5), (1.3, False, 1000)])
def test_values_and_gradients_equal_the_full_logits_reference(dtype, tol, temperature, bias, chunk):
    h, w, b, t, cl, ce = _inputs(dtype, bias=bias)
    ref = _grads(_reference, h, w, b, t, cl, ce, temperature)
    got = _grads(lambda *a: token_logprobs(*a[:2], a[3], bias=a[2], temperature=a[4], chunk_tokens=chunk,
                                           with_entropy=True), h, w, b, t, cl, ce, temperature)
    assert got[0].dtype == torch.float32 and got[0].shape == (37,)
    for name, r, g in zip(["logprobs", "entropy", "grad hidden", "grad weight", "grad bias"], ref, got):
        if r is None:
            assert g is None
            continue
        assert g.dtype == r.dtype, name
        scale = max(1.0, float(r.float().abs().max()))
        err = float((g.float() - r.float()).abs().max())
        assert err <= tol * scale, f"{name}: max error {err:.2e} > {tol * scale:.2e}"
    assert float(ref[2].float().abs().max()) > 0.1  # the gradients compared are not trivially zero


def test_compiled_chunks_equal_the_full_logits_reference():
    """``compiled=True`` (``train.compile``; on by default on a GPU) runs the same per-chunk math
    through torch.compile: same values and gradients, a short last chunk included."""
    module = sys.modules[token_logprobs.__module__]

    h, w, b, t, cl, ce = _inputs(torch.float32, bias=True)
    ref = _grads(_reference, h, w, b, t, cl, ce, 0.7)
    got = _grads(lambda *a: token_logprobs(*a[:2], a[3], bias=a[2], temperature=a[4], chunk_tokens=8,
                                           with_entropy=True, compiled=True), h, w, b, t, cl, ce, 0.7)
    assert module._COMPILED, "the compiled chunk functions were not used"
    for name, r, g in zip(["logprobs", "entropy", "grad hidden", "grad weight", "grad bias"], ref, got):
        err = float((g - r).abs().max())
        assert err <= 1e-4 * max(1.0, float(r.abs().max())), f"{name}: max error {err:.2e}"


def test_logprobs_alone_match_and_leading_dims_are_kept():
    h, w, _, t, cl, _ = _inputs(torch.float32, n=24)
    h3 = h.detach().reshape(2, 12, -1).requires_grad_()
    logp, ent = token_logprobs(h3, w, t.reshape(2, 12), chunk_tokens=7)
    assert ent is None and logp.shape == (2, 12)
    (logp.reshape(-1) * cl).sum().backward()
    ref, _ = _reference(h.detach().requires_grad_(), w, None, t, 1.0)
    w_grad = w.grad.clone()
    w.grad = None
    h_ref = h.detach().requires_grad_()
    ref, _ = _reference(h_ref, w, None, t, 1.0)
    (ref * cl).sum().backward()
    torch.testing.assert_close(logp.detach().reshape(-1), ref.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(h3.grad.reshape(24, -1), h_ref.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(w_grad, w.grad, rtol=0, atol=1e-5)
    assert logp.max() <= 0


def test_bad_inputs_name_the_argument():
    h, w, _, t, _, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="`weight` must be"):
        token_logprobs(h, w.t(), t)
    with pytest.raises(ValueError, match="`targets` has shape"):
        token_logprobs(h, w, t[:-1])
    with pytest.raises(ValueError, match="chunk_tokens"):
        token_logprobs(h, w, t, chunk_tokens=0)
    with pytest.raises(ValueError, match="cast one"):
        token_logprobs(h, w.bfloat16(), t)


_PEAK = r"""
import json, sys, torch
from prorl_async.algo.token_logprobs import token_logprobs
torch.set_num_threads(1)
n, hdim, vocab, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
g = torch.Generator().manual_seed(0)
h = torch.randn(n, hdim, generator=g).requires_grad_()
w = torch.randn(vocab, hdim, generator=g).mul_(0.1).requires_grad_()
t = torch.randint(0, vocab, (n,), generator=g)
w.grad = torch.zeros_like(w); w.grad = None
def status_kb(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))
# the peak from here on: the kernel's high-water mark reset (ru_maxrss keeps the import's peak)
open("/proc/self/clear_refs", "w").write("5")
base = status_kb("VmRSS:")
if mode == "full":
    logp = torch.log_softmax((h @ w.t()).float(), -1).gather(-1, t[:, None]).squeeze(-1)
else:
    logp, _ = token_logprobs(h, w, t, chunk_tokens=int(mode))
logp.sum().backward()
print(json.dumps({"peak_mb": (status_kb("VmHWM:") - base) / 1024,
                  "logp_sum": float(logp.sum())}))
"""


def _peak(n, hdim, vocab, mode) -> dict:
    # large blocks mmapped and unmapped on free: the peak RSS is what was live, not what malloc kept
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", _PEAK, str(n), str(hdim), str(vocab), mode],
                         capture_output=True, text=True, timeout=300, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_peak_memory_is_bounded_by_the_chunk_not_by_tokens_times_vocab():
    n, hdim, vocab = 2048, 32, 32768  # full fp32 logits: 256 MiB per copy
    full = _peak(n, hdim, vocab, "full")
    chunked = _peak(n, hdim, vocab, "128")  # a chunk of logits: 16 MiB
    longer = _peak(2 * n, hdim, vocab, "128")
    print(f"peak above inputs: full {full['peak_mb']:.0f} MiB, chunked {chunked['peak_mb']:.0f} MiB "
          f"({2 * n} tokens: {longer['peak_mb']:.0f} MiB)")
    assert chunked["logp_sum"] == pytest.approx(full["logp_sum"], rel=1e-4)
    # the reference holds at least two 256 MiB tokens x vocab fp32 tensors at once (measured
    # 480-770 MiB: how many are live at the peak varies with the allocator and the machine)
    assert full["peak_mb"] > 1.5 * 256
    assert chunked["peak_mb"] < 0.15 * full["peak_mb"]
    assert longer["peak_mb"] < chunked["peak_mb"] + 32  # twice the tokens, about the same peak
