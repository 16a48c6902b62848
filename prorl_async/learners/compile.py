"""``train.compile``: ``torch.compile`` on the learner's hot loops (regional compilation).

On a GPU a small model's learner step is bound by elementwise kernels, not matmuls: RMSNorm,
rotary embeddings, SwiGLU and residual adds each read and write the whole activation once,
and the chunked LM head makes several fp32 passes over every ``[chunk, vocab]`` logits
block. Measured on one H100 (SmolLM2-135M shape, bf16, 164,655 packed tokens per step):
the eager step spent 18% of its GPU time in matmuls. Compiling each decoder layer (one
graph, reused by all layers: parameters are graph inputs) and the LM head's per-chunk math
fuses those passes (benchmarks/RESULTS.md, "GPU"). Values: :data:`prorl_async.config.COMPILE_CHOICES`. ``auto`` compiles on CUDA only: on CPU
the inductor backend needs a C++ toolchain and its first step compiles for minutes, which a
short CPU run never wins back.
"""

from __future__ import annotations

import torch


def compile_applies(setting: str, device) -> bool:
    """Whether ``train.compile = setting`` compiles a learner on ``device``."""
    return setting == "always" or (setting == "auto" and torch.device(device).type == "cuda")


def decoder_layers(model) -> list:
    """The decoder layers of an HF causal LM (``model.model.layers`` for Llama-like models)."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if layers is None:
        raise ValueError(f"train.compile: found no decoder layers in {type(model).__name__}; "
                         "set train.compile=never")
    return list(layers)


def compile_decoder_layers(model) -> int:
    """Each decoder layer compiled in place (shapes dynamic: packed lengths vary); their count.
    A graph the compiler fails on runs eager instead (``suppress_errors``, set for this
    process): compilation is an optimisation, a run never dies of it."""
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)
