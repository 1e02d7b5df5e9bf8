"""Tokenizers as Megatron's datasets see them: ``vocab_size``, ``eod``, ``pad``, ``tokenize``.

    tok = load_tokenizer("runs/tok")        # a directory holding tokenizer.model (SentencePiece)
    tok = load_tokenizer("gpt2")            # a HuggingFace tokenizer name/path, if available offline
    tok = MockTokenizer(vocab_size=512)     # for Megatron's mock dataset
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import List, Optional

from angelgpt.config import ConfigError
from angelgpt.data.sources import FORMATS, load_source

MODEL_FILE = "tokenizer.model"
SETTINGS_FILE = "tokenizer.json"
PROGRESS_ENV = "ANGELGPT_PROGRESS"  # 1: progress bars even when stderr is not a terminal; 0: none


def show_progress(progress: Optional[bool] = None) -> Optional[bool]:
    """Whether progress bars are drawn, in tqdm's `disable` terms turned round: True or False as asked,
    else $ANGELGPT_PROGRESS (1 or 0) when set, else None: only when stderr is a terminal."""
    if progress is None and os.environ.get(PROGRESS_ENV, "") in ("0", "1"):
        progress = os.environ[PROGRESS_ENV] == "1"
    return progress


def progress_bar(progress: Optional[bool] = None, **kwargs):
    """A tqdm bar on stderr; `progress` as show_progress takes it (None: tqdm's disable=None, drawn only
    when stderr is a terminal, so logs and captured output stay clean)."""
    from tqdm import tqdm

    shown = show_progress(progress)
    return tqdm(file=sys.stderr, disable=None if shown is None else not shown, dynamic_ncols=True, **kwargs)


@contextmanager
def ticking(bar, seconds: float = 0.5):
    """Redraws `bar` (its elapsed time) every `seconds` while a call that reports nothing runs."""
    stop = threading.Event()

    def tick():
        while not stop.wait(seconds):
            bar.refresh()

    thread = None if bar.disable else threading.Thread(target=tick, name="angelgpt-progress", daemon=True)
    if thread:
        thread.start()
    try:
        yield bar
    finally:
        stop.set()
        if thread:
            thread.join()
        bar.close()


class MockTokenizer:
    """Just enough of a tokenizer for Megatron's MockGPTDataset: the last id is end-of-document."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.pad = -1
        self.unique_identifiers = {"class": "MockTokenizer", "vocab_size": vocab_size}

    def tokenize(self, text: str) -> List[int]:
        raise NotImplementedError("the mock tokenizer has no text encoding")


class SentencePieceTokenizer:
    """A SentencePiece model; end-of-document is the model's eos id."""

    def __init__(self, model_file: str):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=model_file)
        self.vocab_size = self.sp.get_piece_size()
        self.eod = self.sp.eos_id()
        self.pad = self.sp.pad_id()  # -1 when the model has none
        self.unique_identifiers = {"class": "SentencePieceTokenizer", "model": str(model_file)}

    def tokenize(self, text: str) -> List[int]:
        return self.sp.encode(text)

    def tokenize_batch(self, texts: List[str]) -> List[List[int]]:
        return self.sp.encode(texts, num_threads=1)

    def detokenize(self, ids: List[int]) -> str:
        return self.sp.decode(ids)


class HFTokenizer:
    """A HuggingFace tokenizer loaded offline; end-of-document is its eos token."""

    def __init__(self, name_or_path: str):
        from transformers import AutoTokenizer  # optional dependency

        self.tok = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
        self.vocab_size = len(self.tok)
        self.eod = self.tok.eos_token_id
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else -1
        self.unique_identifiers = {"class": "HFTokenizer", "name": name_or_path}

    def tokenize(self, text: str) -> List[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def tokenize_batch(self, texts: List[str]) -> List[List[int]]:
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def detokenize(self, ids: List[int]) -> str:
        return self.tok.decode(ids)


def load_tokenizer(spec: Optional[str]):
    """A tokenizer directory (or .model file) of angelgpt's, else a transformers tokenizer directory or a
    HuggingFace name available offline."""
    if not spec:
        raise ConfigError("data.tokenizer is not set: give a directory from `angelgpt tokenizer train`")
    path = Path(spec)
    model_file = path / MODEL_FILE if path.is_dir() else path
    if model_file.is_file():
        try:
            return SentencePieceTokenizer(str(model_file))
        except Exception as exc:
            raise ConfigError(f"tokenizer {model_file} cannot be loaded: {str(exc).splitlines()[0]}") from None
    hf_files = ("tokenizer.json", "tokenizer_config.json", "vocab.json")  # a transformers tokenizer's
    if path.is_dir() and not any((path / f).is_file() for f in hf_files):
        raise ConfigError(f"tokenizer directory {path} has no {MODEL_FILE} (nor a transformers tokenizer)")
    try:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return HFTokenizer(spec)
    except Exception:
        raise ConfigError(f"tokenizer not found: '{spec}' is neither a tokenizer directory nor a HuggingFace "
                          f"tokenizer available offline") from None


def check_vocabulary(tokenizer, cfg) -> None:
    """Refuses a model whose vocabulary (padded) is smaller than the tokenizer's."""
    if tokenizer.vocab_size > cfg.padded_vocab_size():
        raise ConfigError(f"tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is "
                          f"{cfg.model.vocab_size}; set model.vocab_size={tokenizer.vocab_size}")


def train_tokenizer(inputs: List[str], output: str, vocab_size: int = 32000, model_type: str = "unigram",
                    input_sentence_size: int = 2_000_000, text_key: str = "text",
                    progress: Optional[bool] = None) -> dict:
    """Trains a SentencePiece model that round-trips any text exactly (identity normalisation, byte
    fallback, no dummy prefix, whitespace kept) and writes tokenizer.model and tokenizer.json.
    Progress (documents read per input, then SentencePiece's training time) goes to stderr as
    progress_bar draws it."""
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram"):
        raise ConfigError(f"--model-type must be 'bpe' or 'unigram', got '{model_type}'")
    if vocab_size < 260:
        raise ConfigError(f"--vocab-size must be at least 260 (256 byte-fallback pieces + specials), got {vocab_size}")
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output {out} exists and is not a directory")
    with tempfile.TemporaryDirectory(prefix="angelgpt-tok-") as scratch_dir:
        scratch = Path(scratch_dir)
        files = []
        for spec in inputs:
            if not Path(spec).is_file():
                raise ConfigError(f"--input: no such file: {spec}")
            if Path(spec).suffix.lower() not in FORMATS:
                raise ConfigError(f"--input: unsupported file type '{Path(spec).suffix}'; use {', '.join(FORMATS)}")
            ds, _ = load_source(spec, "train", scratch)
            if text_key not in ds.column_names:
                raise ConfigError(f"--text-key: column '{text_key}' not in {spec}")
            text_file = scratch / f"text{len(files)}.txt"
            reading = progress_bar(progress, total=len(ds), unit=" docs", unit_scale=True,
                                   desc=f"reading {Path(spec).name}")
            with open(text_file, "w", encoding="utf-8") as fh, reading as bar:
                for batch in ds.iter(batch_size=4096):
                    for row in batch[text_key]:
                        if row:
                            fh.write(row.replace("\r", "") + "\n")
                    bar.update(len(batch[text_key]))
            files.append(str(text_file))
        if not any(Path(f).stat().st_size for f in files):
            raise ConfigError("--input holds no text")
        settings = dict(
            vocab_size=vocab_size, model_type=model_type, byte_fallback=True, split_digits=True,
            normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True, split_by_whitespace=True, input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True, num_threads=os.cpu_count() or 1, character_coverage=0.9995,
            max_sentence_length=16384, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, hard_vocab_limit=False,
        )
        out.mkdir(parents=True, exist_ok=True)
        tmp_prefix = out / f".tokenizer.tmp{os.getpid()}"
        try:
            with ticking(progress_bar(progress, desc=f"training SentencePiece ({model_type}, {vocab_size} pieces)",
                                      bar_format="{desc}: {elapsed}")):
                spm.SentencePieceTrainer.train(input=files, model_prefix=str(tmp_prefix), minloglevel=2, **settings)
        except Exception as exc:
            raise ConfigError(f"tokenizer training failed: {str(exc).splitlines()[0][:200]}") from None
        finally:
            vocab_file = Path(f"{tmp_prefix}.vocab")
            if vocab_file.exists():
                vocab_file.unlink()
        os.replace(f"{tmp_prefix}.model", out / MODEL_FILE)
    settings.update(inputs=[str(Path(p).resolve()) for p in inputs],
                    actual_vocab_size=SentencePieceTokenizer(str(out / MODEL_FILE)).vocab_size)
    (out / SETTINGS_FILE).write_text(json.dumps(settings, indent=2) + "\n")
    return settings
