"""The `angelgpt` commands around training: presets, tokenizers, data preparation (Typer sub-apps that
angelgpt.cli.app adds)."""

from __future__ import annotations

import json
from typing import List

import typer
import yaml

from angelgpt.config import parse, preset_names, to_dict

presets_app = typer.Typer(no_args_is_help=True, help="List and show size presets.")
tokenizer_app = typer.Typer(no_args_is_help=True, help="Train a SentencePiece tokenizer.")
data_app = typer.Typer(no_args_is_help=True, help="Turn raw text into Megatron indexed datasets.")


def _summary(cfg) -> dict:
    from angelgpt.model.flops import num_params

    return {"config": to_dict(cfg), "params": num_params(cfg), "padded_vocab_size": cfg.padded_vocab_size()}



@presets_app.command("list")
def presets_list() -> None:
    """One line per preset: name, layers x hidden, heads, parameters."""
    from angelgpt.model.flops import format_params, num_params

    width = max(10, *(len(name) for name in preset_names()))
    print(f"{'preset':<{width}} {'layers':>6} {'hidden':>6} {'heads':>5} {'seq':>5} {'params':>9}  optimizer")
    for name in preset_names():
        cfg = parse(name)
        m = cfg.model
        print(f"{name:<{width}} {m.num_layers:>6} {m.hidden_size:>6} {m.num_attention_heads:>5} {m.seq_length:>5} "
              f"{format_params(num_params(cfg)):>9}  {cfg.optim.optimizer}")


@presets_app.command("show")
def presets_show(name: str = typer.Argument(..., help="preset name"),
                 as_json: bool = typer.Option(False, "--json", help="print JSON (config and params)")) -> None:
    """The resolved config of a preset and the exact parameter count of its GPT."""
    summary = _summary(parse(name))
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        print(yaml.safe_dump(summary["config"], sort_keys=False).rstrip())
        print(f"params: {summary['params']:,}")


@tokenizer_app.command("train")
def tokenizer_train(
    inputs: List[str] = typer.Option(..., "--input", help="text files (.txt/.jsonl/.json/.parquet/.csv); repeatable"),
    output: str = typer.Option(..., "--output", help="directory for tokenizer.model and tokenizer.json"),
    vocab_size: int = typer.Option(32000, "--vocab-size"),
    model_type: str = typer.Option("unigram", "--model-type", help="unigram (SentencePiece's default; encodes about 1.6x faster) or bpe"),
    input_sentence_size: int = typer.Option(2_000_000, "--input-sentence-size", help="sample cap (lines)"),
    text_key: str = typer.Option("text", "--text-key"),
) -> None:
    """SentencePiece with byte fallback, digit splitting and identity normalisation (exact round trip)."""
    from angelgpt.data.tokenizer import train_tokenizer

    settings = train_tokenizer(inputs, output, vocab_size, model_type, input_sentence_size, text_key)
    print(f"wrote {output}/tokenizer.model ({settings['actual_vocab_size']} pieces, {model_type})")


@data_app.command("prepare")
def data_prepare(
    input_spec: str = typer.Option(..., "--input", help="file, glob or dataset name"),
    tokenizer: str = typer.Option(..., "--tokenizer", help="tokenizer directory or HuggingFace name"),
    output: str = typer.Option(..., "--output", help="output prefix; writes PREFIX_text_document.bin/.idx"),
    split: str = typer.Option("train", "--split"),
    text_key: str = typer.Option("text", "--text-key"),
    workers: int = typer.Option(1, "--workers", min=1),
    append_eod: bool = typer.Option(False, "--append-eod", help="end every document with the eod token"),
) -> None:
    """Tokenize in parallel and write Megatron's indexed format."""
    from angelgpt.data.prepare import prepare

    print(prepare(input_spec, tokenizer, output, split, text_key, workers, append_eod).line())


def import_command(
    hf: str = typer.Option(..., "--hf", help="local transformers model directory (LlamaForCausalLM, "
                      "Qwen2ForCausalLM, GPT2LMHeadModel)"),
    save: str = typer.Option(..., "--save", help="new checkpoint directory to write"),
) -> None:
    """A Hugging Face transformers model as a checkpoint of iteration 0, to train with `train --load`."""
    from angelgpt.export import quiet
    from angelgpt.export.hf_import import import_hf

    with quiet():
        s = import_hf(hf, save)
    print(yaml.safe_dump(s["config"], sort_keys=False).rstrip())
    print(f"wrote {s['save']}: {s['architecture']}, {s['parameters']:,} parameters (fp32) at iteration 0, "
          f"its config in {s['save']}/config.yaml")
    print(f"train it: angelgpt train --config {s['save']}/config.yaml --load {s['save']} --save RUN_DIR")
