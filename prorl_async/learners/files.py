"""The learner's files in a checkpoint: written and read by the learners' side, not the driver.

Inside a checkpoint directory (whose atomic mechanics live in :mod:`prorl_async.checkpoint`)::

    policy/           the policy as a HF folder (safetensors weights, config, tokenizer)
    learner/          reference weights (``reference.safetensors``) and, for the torch learner,
                      ``state.pt`` (optimizer, LR scheduler, algo state, counters, RNG states);
                      with DeepSpeed instead DeepSpeed's own checkpoint in ``learner/deepspeed/``
                      (:meth:`DeepSpeedLearner.save_state`, ZeRO-partitioned, RNG states per rank)

Each learner's ``save_checkpoint`` / ``load_checkpoint`` (:class:`prorl_async.learners.base.Learner`)
calls its own writer here: :func:`write_torch_learner`, :func:`write_deepspeed_learner`. Every
file is fsynced before the directory is sealed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from prorl_async.checkpoint import fsync_tree

if TYPE_CHECKING:
    from prorl_async.learners.deepspeed import DeepSpeedLearner
    from prorl_async.learners.torch_learner import TorchLearner


def _dedup(tensors: dict) -> dict:
    """Drop tensors that share storage with an earlier one (tied weights; safetensors refuses them)."""
    out, seen = {}, set()
    for n, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out[n] = t.detach().contiguous().cpu()
    return out


def _write_policy(model, path: Path, tensors: dict, tokenizer_path: str) -> None:
    """``path/policy``: the HF folder of ``model`` with ``tensors`` as its weights (+ tokenizer)."""
    policy = path / "policy"
    model.save_pretrained(policy, state_dict=_dedup(tensors))
    if tokenizer_path:
        from prorl_async.models import load_tokenizer

        try:
            load_tokenizer(tokenizer_path).save_pretrained(policy)
        except (OSError, ValueError):
            pass  # a model folder without a tokenizer; generators then need model.path's


def write_torch_learner(learner: TorchLearner, path: str | Path, tokenizer_path: str = "") -> None:
    """The torch learner's state into checkpoint directory ``path``: ``policy/`` (HF folder,
    safetensors), ``learner/`` (reference weights as safetensors, the rest as ``state.pt``);
    every file fsynced. :func:`read_learner` reads it back."""
    import torch

    path = Path(path)
    sd = learner.state_dict()
    _write_policy(learner.model, path, sd.pop("model"), tokenizer_path)
    (path / "learner").mkdir(parents=True, exist_ok=True)
    ref = sd.pop("reference")
    torch.save(sd, path / "learner" / "state.pt")
    _write_reference(path, ref)
    fsync_tree(path / "policy")
    fsync_tree(path / "learner")


def write_deepspeed_learner(learner: DeepSpeedLearner, path: str | Path, tokenizer_path: str = "") -> None:
    """A DeepSpeed learner's state into checkpoint directory ``path``: DeepSpeed's own
    (partitioned) checkpoint in ``learner/deepspeed/`` (:meth:`DeepSpeedLearner.save_state`, a
    collective every rank calls), and from rank 0 ``policy/`` (HF folder, safetensors) and the
    reference weights; every file fsynced."""
    path = Path(path)
    named = dict(learner.named_tensors())  # gathered under ZeRO-3: every rank calls it
    learner.save_state(path)
    if learner.rank != 0:
        return
    _write_policy(learner.model, path, named, tokenizer_path)
    _write_reference(path, dict(learner.ref.state_dict()) if learner.ref is not None else None)
    fsync_tree(path / "policy")
    fsync_tree(path / "learner")


def _write_reference(path: Path, ref: dict | None) -> None:
    """``path/learner/reference.safetensors`` (nothing for a run without a reference)."""
    from safetensors.torch import save_file

    if ref is not None:
        save_file(_dedup(ref), str(path / "learner" / "reference.safetensors"))


def read_learner(path: str | Path) -> dict:
    """The torch learner's state dict :func:`write_torch_learner` wrote (policy weights from ``policy/*.safetensors``)."""
    import torch
    from safetensors.torch import load_file

    path = Path(path)
    sd = torch.load(path / "learner" / "state.pt", map_location="cpu", weights_only=False)
    sd["model"] = {}
    for f in sorted((path / "policy").glob("*.safetensors")):
        sd["model"].update(load_file(str(f)))
    ref = path / "learner" / "reference.safetensors"
    sd["reference"] = load_file(str(ref)) if ref.is_file() else None
    return sd
