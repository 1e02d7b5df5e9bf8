"""The run's tokenizer as a transformers tokenizer that ``AutoTokenizer.from_pretrained`` loads offline.

    from angelgpt.export.hf_tokenizer import save_tokenizer
    ids = save_tokenizer("runs/tok", "out")   # writes tokenizer.json, tokenizer_config.json, tokenizer.model
    ids                                        # {"bos": 1, "eos": 2, "unk": 0, "pad": None}

A SentencePiece model of ``angelgpt tokenizer train`` (identity normalisation, no dummy prefix, byte
fallback) becomes a ``tokenizers`` tokenizer with the same pieces, scores and ids: the SentencePiece
model (unigram: its Viterbi over the whole text; BPE: merges ordered by the merged piece's score, from
transformers' SentencePieceExtractor), spaces replaced by U+2581 and no pre-tokenizer, because
SentencePiece itself segments the whole normalised text (no piece crosses a word boundary but
whitespace-only ones); decoding maps U+2581 back to spaces and byte pieces back to bytes. So
``AutoTokenizer`` encodes text to the ids SentencePiece gives and decodes them back to the text, with
one exception: text that spells a control or byte piece's name (``<s>``, ``</s>``, ``<unk>``,
``<0x41>``) becomes that piece, where SentencePiece encodes its characters. No BOS/EOS is added to
encoded text (angelgpt's data has none; prepared documents end with ``</s>`` only with --append-eod).
``tokenizer.model`` is copied beside it for tools that read SentencePiece directly.

A HuggingFace tokenizer (``data.tokenizer`` naming one available offline) is saved as it is.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from angelgpt.config import ConfigError


def _bpe_merges(vocab: Dict[str, int], scores: Dict[str, float]) -> List[Tuple[str, str]]:
    """BPE merges of a SentencePiece BPE model: every split of a piece into two pieces, the merges of
    higher-scored (earlier learned) pieces first, as transformers' SentencePieceExtractor orders them."""
    merges = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _sentencepiece_tokenizer(model_file: Path):
    import sentencepiece as spm
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers.convert_slow_tokenizer import import_protobuf

    proto = import_protobuf().ModelProto.FromString(model_file.read_bytes())
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    if proto.normalizer_spec.add_dummy_prefix or proto.normalizer_spec.name not in ("identity", ""):
        raise ConfigError(f"tokenizer {model_file}: only angelgpt's SentencePiece models (identity normalisation, "
                          f"no dummy prefix) are exported; this one has normalizer "
                          f"'{proto.normalizer_spec.name}', add_dummy_prefix {proto.normalizer_spec.add_dummy_prefix}")
    unk = sp.unk_id()
    model_type = proto.trainer_spec.model_type  # 1 unigram, 2 bpe
    if model_type == 1:
        model = models.Unigram([(p.piece, p.score) for p in proto.pieces], unk_id=unk,
                               byte_fallback=proto.trainer_spec.byte_fallback)
    elif model_type == 2:
        vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
        merges = _bpe_merges(vocab, {p.piece: p.score for p in proto.pieces})
        model = models.BPE(vocab, merges, unk_token=sp.id_to_piece(unk), byte_fallback=proto.trainer_spec.byte_fallback,
                           fuse_unk=True)
    else:
        raise ConfigError(f"tokenizer {model_file}: SentencePiece model type {model_type} is not exported "
                          f"(unigram and BPE are)")
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])

    def piece(i: int) -> Optional[str]:
        return sp.id_to_piece(i) if i >= 0 else None

    return tok, {"bos": sp.bos_id(), "eos": sp.eos_id(), "unk": unk, "pad": sp.pad_id()}, \
        {"bos_token": piece(sp.bos_id()), "eos_token": piece(sp.eos_id()), "unk_token": piece(unk),
         "pad_token": piece(sp.pad_id())}


def tokenizer_source(spec: str) -> Optional[Path]:
    """The SentencePiece model file of a data.tokenizer value (a directory or a .model file), else None."""
    from angelgpt.data.tokenizer import MODEL_FILE

    path = Path(spec)
    model_file = path / MODEL_FILE if path.is_dir() else path
    return model_file if model_file.is_file() else None


def _hf_tokenizer(spec: str, what: str):
    from transformers import AutoTokenizer

    if Path(spec).is_dir() and not (Path(spec) / "tokenizer_config.json").is_file():
        raise ConfigError(f"{what} {spec} holds neither tokenizer.model nor a HuggingFace tokenizer (pass --tokenizer DIR)")
    try:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except Exception:
        raise ConfigError(f"{what} '{spec}' is neither a tokenizer directory of angelgpt's nor a HuggingFace "
                          f"tokenizer available offline (pass --tokenizer DIR)") from None


def check_tokenizer(spec: str, what: str) -> None:
    """Raises ConfigError when the tokenizer cannot be exported (a moved directory, an unknown name)."""
    model_file = tokenizer_source(spec)
    if model_file is not None:
        try:
            _sentencepiece_tokenizer(model_file)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"{what} {model_file} cannot be read: {str(exc).splitlines()[0][:200]}") from None
        return
    _hf_tokenizer(spec, what)


def save_tokenizer(spec: str, out_dir, model_max_length: Optional[int] = None) -> Dict[str, Optional[int]]:
    """Writes the tokenizer of data.tokenizer ``spec`` into out_dir; returns its bos/eos/unk/pad ids
    (None where it has none)."""
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    model_file = tokenizer_source(spec)
    if model_file is not None:
        from angelgpt.data.tokenizer import MODEL_FILE

        tok, ids, special = _sentencepiece_tokenizer(model_file)
        extra = {"model_max_length": model_max_length} if model_max_length else {}
        hf = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False,
                                     **{k: v for k, v in special.items() if v is not None}, **extra)
        hf.save_pretrained(str(out))
        # the class name transformers 4 and 5 both know (5 writes its own, TokenizersBackend)
        config_file = out / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        shutil.copyfile(model_file, out / MODEL_FILE)
        return {k: (v if v is not None and v >= 0 else None) for k, v in ids.items()}
    hf = _hf_tokenizer(spec, "data.tokenizer")
    hf.save_pretrained(str(out))
    return {"bos": hf.bos_token_id, "eos": hf.eos_token_id, "unk": hf.unk_token_id, "pad": hf.pad_token_id}
