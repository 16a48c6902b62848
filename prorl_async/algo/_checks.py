"""Input checks shared by the learner-math modules.

Every public function in :mod:`prorl_async.algo` validates shapes and refuses non-finite
values at *valid* positions with a ``ValueError`` that names the function and the tensor,
so a NaN reward or an ``inf`` logprob stops the step instead of producing a silent NaN loss.
Padding positions (mask 0) may hold anything and are never inspected.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def valid_positions(mask: torch.Tensor) -> torch.Tensor:
    """Bool view of a loss mask (float 1.0/0.0 or bool): True where the token counts."""
    if mask.dtype == torch.bool:
        return mask
    return mask != 0


def sample_mask(fn: str, valid: Optional[torch.Tensor], n: int, device) -> torch.Tensor:
    """Bool [n] of gradable samples from an optional ``valid`` argument (all True when None)."""
    if valid is None:
        return torch.ones(n, dtype=torch.bool, device=device)
    check_shape(fn, "valid", valid, (n,))
    return valid_positions(valid)


def check_finite(
    fn: str, name: str, x: torch.Tensor, valid: Optional[torch.Tensor] = None
) -> None:
    """Raise ``ValueError`` if ``x`` holds nan/inf where ``valid`` is True (everywhere if None)."""
    if not x.is_floating_point():
        return
    bad = ~torch.isfinite(x)
    if valid is not None:
        bad = bad & valid
    n_bad = int(bad.sum().item())
    if n_bad:
        where = "at valid positions" if valid is not None else "(no mask given, all positions checked)"
        raise ValueError(
            f"{fn}: `{name}` contains {n_bad} non-finite values (nan/inf) {where}"
        )


def check_shape(fn: str, name: str, x: torch.Tensor, shape: Sequence[int]) -> None:
    """Raise ``ValueError`` unless ``x.shape == shape``."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(
            f"{fn}: `{name}` has shape {tuple(x.shape)}, expected {tuple(shape)}"
        )


def check_ndim(fn: str, name: str, x: torch.Tensor, ndim: int) -> None:
    """Raise ``ValueError`` unless ``x`` has ``ndim`` dimensions."""
    if x.dim() != ndim:
        raise ValueError(
            f"{fn}: `{name}` must be {ndim}-D, got shape {tuple(x.shape)}"
        )


def float_dtype(x: torch.Tensor) -> torch.dtype:
    """The floating dtype results should carry: ``x``'s own if floating, else float32."""
    return x.dtype if x.is_floating_point() else torch.float32
