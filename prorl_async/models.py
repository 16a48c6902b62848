"""Model loading, and the built-in ``tiny-arith`` policy the default run trains.

No model hub is reachable on the machines this project is developed on, so the default run
uses a small Llama the project builds itself: a character-level tokenizer
(``PreTrainedTokenizerFast``), a 2-layer Llama config, and a short supervised warm-up on the
built-in arithmetic task's *train* split so that the starting policy has partial success
(RL needs some correct samples to have any signal). The result is a plain HF folder cached
under ``model.cache_dir`` (default ``$PRORL_ASYNC_CACHE`` or ``~/.cache/prorl-async``), keyed
by everything that shapes it, and loaded like any other local model afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from pathlib import Path

import torch

from prorl_async.tracking import bar

BUILTIN_PREFIX = "builtin:"
CHARS = list("0123456789+-*=() ")
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def default_cache_dir(cfg_dir: str = "") -> Path:
    return Path(cfg_dir or os.environ.get("PRORL_ASYNC_CACHE") or Path.home() / ".cache" / "prorl-async")


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
                       max_position_embeddings=64, tie_word_embeddings=True,
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
                      "chars": CHARS}, sort_keys=True)
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
    tmp.rename(out) if not out.exists() else None
    return out


REQUIRED_FILES = ("config.json",)


def resolve_model_path(model_cfg, seed: int = 0, log=print) -> str:
    """A local HF folder for ``model.path``: built-in names are built, folders are checked."""
    path = model_cfg.path
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX):]
        if name != "tiny-arith":
            raise ValueError(f"model.path: unknown built-in model {path!r}; the built-in is builtin:tiny-arith")
        return str(build_tiny_arith(model_cfg, seed=seed, log=log))
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


def load_model(path: str, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per actor per load is noise in the run's log

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model
