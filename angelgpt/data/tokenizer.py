"""Tokenizers as Megatron's datasets see them: ``vocab_size``, ``eod``, ``pad``, ``tokenize``.

    tok = load_tokenizer("runs/tok")        # a directory holding tokenizer.model (SentencePiece)
    tok = load_tokenizer("gpt2")            # a HuggingFace tokenizer name/path, if available offline
    tok = MockTokenizer(vocab_size=512)     # for Megatron's mock dataset
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

from angelgpt.config import ConfigError

MODEL_FILE = "tokenizer.model"
SETTINGS_FILE = "tokenizer.json"


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
    """A tokenizer directory (or .model file) of angelgpt's, else a HuggingFace name available offline."""
    if not spec:
        raise ConfigError("data.tokenizer is not set: give a directory from `angelgpt tokenizer train`")
    path = Path(spec)
    model_file = path / MODEL_FILE if path.is_dir() else path
    if model_file.is_file():
        try:
            return SentencePieceTokenizer(str(model_file))
        except Exception as exc:
            raise ConfigError(f"tokenizer {model_file} cannot be loaded: {str(exc).splitlines()[0]}") from None
    if path.is_dir():
        raise ConfigError(f"tokenizer directory {path} has no {MODEL_FILE}")
    try:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return HFTokenizer(spec)
    except Exception:
        raise ConfigError(f"tokenizer not found: '{spec}' is neither a tokenizer directory nor a HuggingFace "
                          f"tokenizer available offline") from None


def write_settings(output: Path, settings: dict) -> None:
    (output / SETTINGS_FILE).write_text(json.dumps(settings, indent=2) + "\n")
