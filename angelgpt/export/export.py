"""`angelgpt export`: a checkpoint as a transformers model directory (GPT2LMHeadModel or LlamaForCausalLM).

    angelgpt export --load runs/ck --output runs/hf                    # latest checkpoint, stored dtype
    angelgpt export --load runs/ck --output runs/hf --iteration 200 --dtype bf16 --max-shard-size 2GB

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("runs/hf")
    tok = AutoTokenizer.from_pretrained("runs/hf")          # when the run had a SentencePiece tokenizer

The architecture is the checkpoint's (``architecture``): GPT-2's when GPT-2 expresses it (gpt2.py),
else Llama's when Llama does (llama.py: RMSNorm, SwiGLU, RoPE, untied, grouped-query); a checkpoint
neither expresses (LayerNorm with RoPE, learned positions with RMSNorm, partial rotary...) is refused
with both reasons. Writes config.json, generation_config.json, model.safetensors (or model-0000k-of-0000n.safetensors and
model.safetensors.index.json above --max-shard-size), the tokenizer when the run used one
(tokenizer.json, tokenizer_config.json, tokenizer.model) and angelgpt.json (the source checkpoint, its
iteration and the run's config). The checkpoint is read tensor by tensor (checkpoint_reader.py) and
each tensor is written as it is converted (safetensors_writer.py); no model is built and no process
group is made. Everything goes to ``OUTPUT.tmp-XXXX`` beside OUTPUT, renamed to OUTPUT only once
complete: a failure or a signal leaves no OUTPUT behind (and removes the temporary directory).
OUTPUT gets the mode of any new directory (0777 less the umask), not mkdtemp's private 0700.
Progress: a bar over the tensors on stderr when it is a terminal (ANGELGPT_PROGRESS=1 forces it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch

from angelgpt.config import ConfigError

DTYPE_NAMES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
PROVENANCE = "angelgpt.json"


def umask() -> int:
    """The process umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def parse_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    if name is None:
        return None
    if name not in DTYPE_NAMES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPE_NAMES)}, got '{name}'")
    return DTYPE_NAMES[name]


@contextmanager
def staged_directory(output: Path, overwrite: bool):
    """Yields a fresh OUTPUT.tmp-XXXX beside output; on success it becomes output, on any failure
    (SIGTERM included) it is removed."""
    if output.exists() and not overwrite:
        if output.is_dir() and not any(output.iterdir()):
            pass  # an empty directory is taken over
        else:
            raise ConfigError(f"--output {output} already exists (pass --overwrite to replace it)")
    if output.exists() and not output.is_dir():
        raise ConfigError(f"--output {output} exists and is not a directory")
    parent = output.parent
    blocker = next((p for p in [parent, *parent.parents] if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise ConfigError(f"--output {output}: {blocker} is a file, not a directory")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{output.name}.tmp-", dir=parent))
        tmp.chmod(0o777 & ~umask())  # mkdtemp makes it 0700: readable by others like any other output
    except OSError as exc:
        raise ConfigError(f"--output {output}: cannot write in {parent}: {exc.strerror or exc}") from None
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    try:
        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread: no handler, the finally below still cleans up on errors
        previous = None
    try:
        try:
            yield tmp
        except OSError as exc:
            raise ConfigError(f"--output {output}: writing failed: {exc.strerror or exc}") from None
        if output.exists():
            old = Path(tempfile.mkdtemp(prefix=f"{output.name}.old-", dir=parent))
            os.replace(output, old / "x")
            os.replace(tmp, output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def architecture(reader):
    """("GPT2LMHeadModel" or "LlamaForCausalLM", its config function, its tensors function) for the
    checkpoint; ConfigError naming why when neither expresses it."""
    from angelgpt.export.gpt2 import gpt2_config, gpt2_problem, gpt2_tensors
    from angelgpt.export.llama import llama_config, llama_problem, llama_tensors

    not_gpt2 = gpt2_problem(reader)
    if not_gpt2 is None:
        return "GPT2LMHeadModel", gpt2_config, gpt2_tensors
    not_llama = llama_problem(reader)
    if not_llama is None:
        return "LlamaForCausalLM", llama_config, llama_tensors
    raise ConfigError(f"checkpoint {reader.path} cannot be exported as Llama: {not_llama}; nor as GPT-2: "
                      f"{not_gpt2}")


def export(load: str, output: str, iteration: Optional[int] = None, dtype: Optional[str] = None,
           max_shard_size: str = "5GB", tokenizer: Optional[str] = None, trim_vocab: bool = False,
           overwrite: bool = False, progress: Optional[bool] = None) -> dict:
    """Exports; returns a summary (output, architecture, iteration, files, parameters, dtype). Bad input raises
    ConfigError before anything is written."""
    from transformers import GenerationConfig

    from angelgpt.export.checkpoint_reader import CheckpointReader
    from angelgpt.export.hf_tokenizer import check_tokenizer, save_tokenizer
    from angelgpt.export.safetensors_writer import nbytes, parse_size, write_safetensors

    to_dtype = parse_dtype(dtype)
    max_bytes = parse_size(max_shard_size)
    reader = CheckpointReader.open(load, iteration)
    arch, make_config, make_tensors = architecture(reader)
    cfg = reader.config
    to_dtype = to_dtype or reader.dtype("embedding.word_embeddings.weight")
    spec = tokenizer or cfg["data"].get("tokenizer")
    if spec:
        check_tokenizer(spec, "--tokenizer" if tokenizer else "the run's tokenizer (data.tokenizer)")

    tensors = [(name, shape, to_dtype, make) for name, shape, make in make_tensors(reader, to_dtype, trim_vocab)]
    out = Path(output)
    from angelgpt.data.tokenizer import progress_bar

    with staged_directory(out, overwrite) as tmp:
        ids = {"bos": None, "eos": None, "pad": None}
        if spec:
            ids = save_tokenizer(spec, tmp, cfg["model"]["seq_length"])
        else:  # mock data: angelgpt's MockTokenizer ends documents with the last id
            ids["eos"] = cfg["model"]["vocab_size"] - 1
        config = make_config(reader, trim_vocab, to_dtype, ids["bos"] if ids["bos"] is not None else ids["eos"],
                             ids["eos"])
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        GenerationConfig(bos_token_id=config["bos_token_id"], eos_token_id=ids["eos"],
                         pad_token_id=ids["pad"] if ids.get("pad") is not None else ids["eos"]).save_pretrained(str(tmp))
        (tmp / PROVENANCE).write_text(json.dumps({
            "checkpoint": str(reader.path.resolve()), "iteration": reader.iteration,
            "vocab": "trimmed to model.vocab_size" if trim_vocab else "padded", "config": cfg}, indent=1) + "\n")
        with progress_bar(progress, total=len(tensors), desc=f"export iteration {reader.iteration}",
                          unit=" tensors") as bar:
            files = write_safetensors(tmp, tensors, max_bytes, bar)
    params = sum(nbytes(s, torch.float32) // 4 for _, s, _, _ in tensors)
    return {"output": str(out), "architecture": arch, "iteration": reader.iteration, "files": files, "parameters": params,
            "dtype": str(to_dtype).replace("torch.", ""), "tokenizer": bool(spec)}
