"""`angelgpt generate`: continue a prompt with a checkpoint (angelgpt's own GPT) or an exported directory.

    angelgpt generate --load runs/ck --prompt "ROMEO:" --max-new-tokens 50 --temperature 0.8 --top-k 40
    angelgpt generate --load runs/hf --prompt "ROMEO:" --temperature 0          # greedy, via transformers
    angelgpt generate --load runs/mock-ck --prompt "5 17 300" --json           # mock data: token ids

With a checkpoint directory the model is angelgpt's GPT at TP 1 in this one process
(local_model.py), its weights read from any layout; with a transformers directory (from
`angelgpt export`) it is ``AutoModelForCausalLM`` and ``AutoTokenizer``. The prompt is encoded with the
run's tokenizer (no BOS added, as in training); a run on mock data has none, so the prompt is token
ids separated by spaces and the output is ids. Sampling: logits / temperature, the top k kept (all when
--top-k is not given), one draw from a generator seeded with --seed; --temperature 0 is greedy (argmax).
Generation stops at the end-of-document token or at the model's context (seq_length tokens in all).
angelgpt's own model recomputes the whole sequence at each step (no KV cache): fine for checking a
model, slow for long outputs.

Prints the prompt and its continuation (text, or ids for mock data) and, on stderr, one line saying why it
stopped; --json prints {"prompt_ids", "new_ids", "text", "stop_reason"}, stop_reason being "eod" (the
end-of-document token), "max_new_tokens" (--max-new-tokens reached) or "context" (the model's context
reached first).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import torch

from angelgpt.config import ConfigError


def parse_ids(prompt: str, vocab: int) -> List[int]:
    try:
        ids = [int(x) for x in prompt.split()]
    except ValueError:
        raise ConfigError(f"this model has no tokenizer (mock data): --prompt must be token ids separated by "
                          f"spaces, got '{prompt[:40]}'") from None
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ConfigError(f"--prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})")
    return ids


def pick(logits: torch.Tensor, temperature: float, top_k: Optional[int], generator) -> int:
    """The next id from one position's logits [vocab]."""
    logits = logits.float()
    if temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


STOP_NOTES = {"eod": "the end-of-document token", "max_new_tokens": "--max-new-tokens reached",
              "context": "the model's context reached"}


def stop_reason(new: List[int], eod_ids, budget: int, max_new: int) -> str:
    """Why generation stopped: "eod", "max_new_tokens" or "context" (budget: the new tokens allowed,
    max_new less what the context leaves out)."""
    if new and new[-1] in eod_ids:
        return "eod"
    return "max_new_tokens" if budget == max_new else "context"


def _budget(prompt_len: int, max_new: int, context: int) -> int:
    if prompt_len == 0:
        raise ConfigError("--prompt is empty")
    if prompt_len >= context:
        raise ConfigError(f"--prompt is {prompt_len} tokens; the model's context is {context}")
    n = min(max_new, context - prompt_len)
    if n < max_new:
        print(f"angelgpt: note: {n} new tokens, not {max_new}: the model's context is {context} tokens",
              file=sys.stderr, flush=True)
    return n


@torch.no_grad()
def sample_local(model, ids: List[int], max_new: int, temperature: float, top_k: Optional[int], seed: int,
                 eod: Optional[int], device) -> List[int]:
    """angelgpt's GPT: one full forward per new token."""
    generator = torch.Generator().manual_seed(seed)
    seq = list(ids)
    for _ in range(max_new):
        tokens = torch.tensor([seq], dtype=torch.long, device=device)
        position_ids = torch.arange(len(seq), dtype=torch.long, device=device).unsqueeze(0)
        logits = model(tokens, position_ids, None)[0, -1]
        nxt = pick(logits, temperature, top_k, generator)
        seq.append(nxt)
        if eod is not None and nxt == eod:
            break
    return seq[len(ids):]


def generate_checkpoint(load: str, prompt: str, max_new: int, temperature: float, top_k: Optional[int],
                        seed: int, device: str, iteration: Optional[int] = None) -> dict:
    from angelgpt.data.tokenizer import load_tokenizer
    from angelgpt.export.checkpoint_reader import CheckpointReader
    from angelgpt.export.local_model import load_local_model

    reader = CheckpointReader.open(load, iteration)
    with load_local_model(reader, device) as (model, cfg):
        tokenizer = None if cfg.data.is_mock and not cfg.data.tokenizer else load_tokenizer(cfg.data.tokenizer)
        if tokenizer is None:
            ids, eod = parse_ids(prompt, cfg.padded_vocab_size()), cfg.model.vocab_size - 1
        else:
            ids, eod = tokenizer.tokenize(prompt), tokenizer.eod
        n = _budget(len(ids), max_new, cfg.model.seq_length)
        new = sample_local(model, ids, n, temperature, top_k, seed, eod, next(model.parameters()).device)
    text = tokenizer.detokenize(ids + new) if tokenizer is not None else " ".join(map(str, ids + new))
    return {"prompt_ids": ids, "new_ids": new, "text": text, "stop_reason": stop_reason(new, {eod}, n, max_new)}


@torch.no_grad()
def generate_hf(load: str, prompt: str, max_new: int, temperature: float, top_k: Optional[int], seed: int,
                device: str) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but no CUDA GPU is visible")
    try:
        model = AutoModelForCausalLM.from_pretrained(load, local_files_only=True)
    except Exception as exc:
        raise ConfigError(f"--load {load}: transformers cannot load it: {str(exc).splitlines()[0][:200]}") from None
    model.float().to(device).eval()
    has_tokenizer = (Path(load) / "tokenizer_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(load, local_files_only=True) if has_tokenizer else None
    ids = tokenizer.encode(prompt, add_special_tokens=False) if tokenizer is not None \
        else parse_ids(prompt, model.config.vocab_size)
    context = model.config.n_positions if hasattr(model.config, "n_positions") else model.config.max_position_embeddings
    n = _budget(len(ids), max_new, context)
    torch.manual_seed(seed)
    eos = model.generation_config.eos_token_id
    sampling = dict(do_sample=True, temperature=temperature, top_k=top_k or 0, top_p=None) if temperature > 0 \
        else dict(do_sample=False)
    out = model.generate(torch.tensor([ids], device=device),
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                         max_new_tokens=n, eos_token_id=eos, pad_token_id=eos, **sampling)
    new = out[0, len(ids):].tolist()
    text = tokenizer.decode(ids + new) if tokenizer is not None else " ".join(map(str, ids + new))
    eos_ids = set(eos) if isinstance(eos, (list, tuple)) else {eos}
    return {"prompt_ids": ids, "new_ids": new, "text": text, "stop_reason": stop_reason(new, eos_ids, n, max_new)}


def generate(load: str, prompt: str, max_new_tokens: int = 50, temperature: float = 1.0,
             top_k: Optional[int] = None, seed: int = 1234, device: str = "cpu",
             iteration: Optional[int] = None) -> dict:
    from angelgpt.train.checkpoint_check import is_hf_dir

    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be 'cpu' or 'cuda', got '{device}'")
    if temperature < 0:
        raise ConfigError(f"--temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k must be >= 1, got {top_k}")
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not Path(load).is_dir():
        raise ConfigError(f"--load {load} does not exist or is not a directory")
    if is_hf_dir(load):
        if iteration is not None:
            raise ConfigError("--iteration applies to checkpoint directories, not an exported model")
        return generate_hf(load, prompt, max_new_tokens, temperature, top_k, seed, device)
    return generate_checkpoint(load, prompt, max_new_tokens, temperature, top_k, seed, device, iteration)


def render(result: dict, as_json: bool) -> str:
    """The JSON line, or the text; with the text, why generation stopped goes to stderr as one line."""
    if as_json:
        return json.dumps(result)
    print(f"angelgpt: stopped after {len(result['new_ids'])} new tokens: {STOP_NOTES[result['stop_reason']]}",
          file=sys.stderr, flush=True)
    return result["text"]
