"""After training: `angelgpt export` to transformers GPT-2, `angelgpt generate`, `angelgpt eval`.

Tiny models trained here (shared by the tests through module-scoped fixtures): TP 2 on two gloo ranks
with Megatron's optimizer (stacked layer keys) and with ZeRO-Cache (per-layer keys), PP 2 where this
checkout runs pipelines on CPU, one on tinyshakespeare with a real SentencePiece tokenizer, and two of
Llama's architecture (exported as LlamaForCausalLM): llama-tiny's at TP 2 with Megatron's optimizer,
and at PP 2 with ZeRO-Cache and linear biases, tied embeddings, a head size other than hidden / heads
and RoPE base 500000. Each exported model's logits equal angelgpt's own forward (build_gpt at TP 1 loading the same checkpoint,
as generate and eval do), greedy decoding agrees token for token, the exported tokenizer encodes as
the run's, eval gives the validation loss training logged, and bad input gets one line and exit 2
with no output directory left behind.
"""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import CORPUS, check_one_line_error, run_cli, run_cli_in_process, train_tiny

pytestmark = pytest.mark.distributed

ITERS = 3
LLAMA = ["model.num_query_groups=2", "model.swiglu=true", "model.ffn_hidden_size=128", "model.normalization=RMSNorm",
         "model.position_embedding_type=rope"]  # with the tiny preset: llama-tiny's architecture


def _train(root, name, *overrides, nproc=1):
    records = train_tiny(root, name, f"--save={root / name}", f"train.train_iters={ITERS}",
                         f"train.eval_interval={ITERS}", *overrides, nproc=nproc)
    return SimpleNamespace(ck=root / name, records=records)


def _pipelines_on_cpu():
    from angelgpt.config import ConfigError, parse

    try:
        parse("tiny", None, ["parallel.pipeline_model_parallel_size=2"]).check_device(False)
    except ConfigError as exc:
        pytest.skip(f"pipeline parallelism does not run on CPU here: {exc}")


@pytest.fixture(scope="module")
def megatron_tp2(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("meg"), "ck", "parallel.tensor_model_parallel_size=2",
                  "optim.optimizer=megatron", nproc=2)


@pytest.fixture(scope="module")
def llama_tp2(tmp_path_factory):
    """The tiny preset made the llama-tiny architecture (SwiGLU's linear_fc1 is saved as its gate and up
    halves, each sharded over TP)."""
    return _train(tmp_path_factory.mktemp("llama"), "ck", "parallel.tensor_model_parallel_size=2", *LLAMA,
                  "model.add_bias_linear=false", "model.untie_embeddings_and_output_weights=true", nproc=2)


@pytest.fixture(scope="module")
def llama_pp2_zero_cache(tmp_path_factory):
    """Llama's architecture with what llama-tiny leaves out: biased linears (attention_bias, mlp_bias),
    tied embeddings, head size 32 x 4 heads for hidden 64, RoPE base 500000, a vocabulary of 500 padded
    to 512."""
    _pipelines_on_cpu()
    return _train(tmp_path_factory.mktemp("llama_pp"), "ck", "parallel.pipeline_model_parallel_size=2",
                  "optim.optimizer=zero_cache", *LLAMA, "model.add_bias_linear=true", "model.kv_channels=32",
                  "model.rotary_base=500000", "model.vocab_size=500", nproc=2)


@pytest.fixture(scope="module")
def zero_cache_tp2(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("zc"), "ck", "parallel.tensor_model_parallel_size=2",
                  "optim.optimizer=zero_cache", nproc=2)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    _pipelines_on_cpu()
    return _train(tmp_path_factory.mktemp("pp"), "ck", "parallel.pipeline_model_parallel_size=2", nproc=2)


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory):
    from angelgpt.data.prepare import prepare
    from angelgpt.data.tokenizer import train_tokenizer

    if not CORPUS.is_file():
        pytest.skip(f"{CORPUS} not present")
    root = tmp_path_factory.mktemp("sp")
    train_tokenizer([str(CORPUS)], str(root / "tok"), vocab_size=600, progress=False)
    data = prepare(str(CORPUS), str(root / "tok"), str(root / "shk"), append_eod=True, progress=False)
    run = _train(root, "ck", f"data.paths={data.prefix}", f"data.tokenizer={root / 'tok'}", "model.vocab_size=600",
                 f"data.cache_path={root / 'cache'}")
    run.tokenizer = root / "tok"
    return run


def _export(run, out, **kwargs):
    from angelgpt.export import quiet
    from angelgpt.export.export import export

    with quiet():
        return export(str(run.ck), str(out), dtype="fp32", progress=False, **kwargs)


def _angelgpt_logits(ck, tokens):
    from angelgpt.export import quiet
    from angelgpt.export.checkpoint_reader import CheckpointReader
    from angelgpt.export.local_model import load_local_model

    with quiet(), load_local_model(CheckpointReader.open(str(ck))) as (model, _), torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)


def _tokens(vocab, seq=64):
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("layout", ["megatron_tp2", "zero_cache_tp2", "pipeline"])
def test_export_logits_equal_angelgpts_forward(layout, request, tmp_path):
    from transformers import GPT2LMHeadModel

    run = request.getfixturevalue(layout)
    out = tmp_path / "hf"
    # ZeRO-Cache's export is sharded (a few KB per file): shards and index as transformers writes them
    summary = _export(run, out, max_shard_size="100KB" if layout == "zero_cache_tp2" else "5GB")
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "angelgpt.json"} <= files
    if layout == "zero_cache_tp2":
        shards = sorted(f for f in files if f.endswith(".safetensors"))
        assert "model.safetensors.index.json" in files and len(shards) > 1, files
        assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors", shards
    else:
        assert "model.safetensors" in files, files
    config = json.loads((out / "config.json").read_text())
    assert config["activation_function"] == "gelu" and config["n_positions"] == 64 and config["vocab_size"] == 512
    assert summary["iteration"] == ITERS

    model = GPT2LMHeadModel.from_pretrained(out).eval()
    assert next(model.parameters()).dtype == torch.float32
    tokens = _tokens(512)
    with torch.no_grad():
        theirs = model(tokens).logits
    ours = _angelgpt_logits(run.ck, tokens)
    assert theirs.shape == ours.shape == (2, 64, 512)
    assert (theirs - ours).abs().max().item() < 1e-4


@pytest.mark.parametrize("layout", ["llama_tp2", "llama_pp2_zero_cache"])
def test_llama_export_logits_equal_angelgpts_forward(layout, request, tmp_path):
    from transformers import LlamaForCausalLM

    run = request.getfixturevalue(layout)
    out = tmp_path / "hf"
    biased = layout == "llama_pp2_zero_cache"
    # the biased one sharded (shards and index as transformers writes them) and its vocabulary trimmed
    summary = _export(run, out, max_shard_size="100KB" if biased else "5GB", trim_vocab=biased)
    vocab = 500 if biased else 512
    assert summary["architecture"] == "LlamaForCausalLM" and summary["iteration"] == ITERS
    files = {p.name for p in out.iterdir()}
    if biased:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"].values()) <= files
    else:
        assert "model.safetensors" in files, files
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_act"] == "silu"
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]) == (4, 2, 128)
    assert config["head_dim"] == (32 if biased else 16) and config["max_position_embeddings"] == 64
    assert config["attention_bias"] == config["mlp_bias"] == biased
    assert config["tie_word_embeddings"] == biased
    assert config["rope_parameters"]["rope_theta"] == (500000 if biased else 10000) and config["vocab_size"] == vocab

    model = LlamaForCausalLM.from_pretrained(out).eval()
    names = {n for n, _ in model.named_parameters()}
    assert ("lm_head.weight" in names) != biased and ("model.layers.1.self_attn.q_proj.bias" in names) == biased
    tokens = _tokens(vocab)
    with torch.no_grad():
        theirs = model(tokens).logits
    ours = _angelgpt_logits(run.ck, tokens)
    assert theirs.shape == (2, 64, vocab) and ours.shape == (2, 64, 512)
    ours = ours[..., :vocab]  # the padded rows dropped
    assert (theirs - ours).abs().max().item() <= 1e-4 * ours.abs().max().item()


def test_llama_greedy_generate_equals_transformers(llama_tp2, tmp_path):
    from transformers import LlamaForCausalLM

    out = tmp_path / "hf"
    done = run_cli_in_process("export", "--load", llama_tp2.ck, "--output", out)
    assert done.returncode == 0 and f"wrote {out}: LlamaForCausalLM, " in done.stdout, done.stdout + done.stderr
    prompt = [5, 17, 300, 42]
    results = []
    for load in (llama_tp2.ck, out):  # angelgpt's model, then the export through transformers
        proc = run_cli_in_process("generate", "--load", load, "--prompt", " ".join(map(str, prompt)),
                                  "--temperature", "0", "--max-new-tokens", "12", "--json")
        assert proc.returncode == 0, proc.stderr
        results.append(json.loads(proc.stdout))
    assert results[0] == results[1] and len(results[0]["new_ids"]) == 12
    model = LlamaForCausalLM.from_pretrained(out).eval()
    theirs = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                            do_sample=False, max_new_tokens=12, pad_token_id=511)
    assert theirs[0, 4:].tolist() == results[0]["new_ids"]


def test_bf16_and_trimmed_vocabulary(megatron_tp2, tmp_path):
    from transformers import GPT2LMHeadModel

    from angelgpt.export import quiet
    from angelgpt.export.export import export

    with quiet():
        export(str(megatron_tp2.ck), str(tmp_path / "bf16"), dtype="bf16", trim_vocab=True, progress=False)
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    assert model.config.vocab_size == 512  # tiny's vocabulary is already a multiple of 128 x TP
    tokens = _tokens(512)
    with torch.no_grad():
        diff = (model(tokens).logits - _angelgpt_logits(megatron_tp2.ck, tokens)).abs().max().item()
    assert 0 < diff < 0.1  # bf16 weights


def test_greedy_generate_equals_transformers(megatron_tp2, tmp_path):
    from transformers import GPT2LMHeadModel

    out = tmp_path / "hf"
    _export(megatron_tp2, out)
    prompt = [5, 17, 300, 42]
    proc = run_cli("generate", "--load", megatron_tp2.ck, "--prompt", " ".join(map(str, prompt)),
                   "--temperature", "0", "--max-new-tokens", "12", "--json")
    assert proc.returncode == 0, proc.stderr
    ours = json.loads(proc.stdout)
    assert ours["prompt_ids"] == prompt and len(ours["new_ids"]) == 12
    assert ours["stop_reason"] == ("eod" if ours["new_ids"][-1] == 511 else "max_new_tokens")
    assert ours["text"] == " ".join(map(str, prompt + ours["new_ids"]))
    model = GPT2LMHeadModel.from_pretrained(out).eval()
    theirs = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                            do_sample=False, max_new_tokens=12, pad_token_id=511)
    assert theirs[0, 4:].tolist() == ours["new_ids"]
    # sampling with a seed repeats itself
    again = [json.loads(run_cli_in_process("generate", "--load", megatron_tp2.ck, "--prompt", "5 17", "--temperature", "0.9",
                                    "--top-k", "20", "--max-new-tokens", "6", "--seed", "7", "--json").stdout)
             for _ in range(2)]
    assert again[0] == again[1]
    # text mode: the text on stdout, why it stopped on stderr
    text = run_cli_in_process("generate", "--load", megatron_tp2.ck, "--prompt", "5 17", "--temperature", "0",
                              "--max-new-tokens", "3")
    assert text.returncode == 0 and text.stdout.startswith("5 17 "), text.stderr
    assert "angelgpt: stopped after " in text.stderr, text.stderr


def test_sentencepiece_run_exports_its_tokenizer(sentencepiece, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from angelgpt.data.tokenizer import load_tokenizer

    out = tmp_path / "hf"
    summary = _export(sentencepiece, out)
    assert summary["tokenizer"] and (out / "tokenizer.model").is_file() and (out / "tokenizer.json").is_file()
    ours = load_tokenizer(str(sentencepiece.tokenizer))
    theirs = AutoTokenizer.from_pretrained(out)
    text = CORPUS.read_text()
    samples = [text[i:i + 2000] for i in range(0, len(text), 50_000)]
    samples += ["  two spaces,\ttab\n\nnew lines 1234567 \u00fc\u4f60\u597d\U0001F600 trailing  ", " Hello", "a  b   c"]
    for s in samples:
        ids = theirs.encode(s)
        assert ids == ours.tokenize(s), s[:80]
        assert theirs.decode(ids) == s
    assert (theirs.eos_token_id, theirs.bos_token_id, theirs.unk_token_id) == (ours.eod, 1, 0)

    # logits and greedy text agree with angelgpt's model (padded vocabulary: 600 -> 640)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.vocab_size == 640
    tokens = torch.tensor([ours.tokenize(text[:400])[:64]])
    with torch.no_grad():
        assert (model(tokens).logits - _angelgpt_logits(sentencepiece.ck, tokens)).abs().max().item() < 1e-4
    texts = []
    for load in (sentencepiece.ck, out):
        proc = run_cli_in_process("generate", "--load", load, "--prompt", "ROMEO:", "--temperature", "0",
                           "--max-new-tokens", "10", "--json")
        assert proc.returncode == 0, proc.stderr
        texts.append(json.loads(proc.stdout))
    assert texts[0] == texts[1] and texts[0]["text"].startswith("ROMEO:")


@pytest.mark.parametrize("layout", ["megatron_tp2", "sentencepiece", "llama_tp2"])
def test_eval_gives_the_loss_training_validated(layout, request):
    run = request.getfixturevalue(layout)
    logged = [r["val_loss"] for r in run.records if r.get("val_loss") is not None]
    assert len(logged) == 1  # at the last iteration, with the weights the checkpoint holds
    proc = run_cli_in_process("eval", "--load", run.ck, "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    # the run's eval_iters (2) global batches (8 samples of 64 tokens), its micro batches in training's order
    assert result["iteration"] == ITERS and result["tokens"] == 2 * 8 * 64
    assert abs(result["loss"] - logged[0]) < 1e-4, (result, logged)
    assert abs(result["perplexity"] - torch.tensor(result["loss"]).exp().item()) < 1e-3


def _edited(run, root, name, **model):
    """A copy of the run's checkpoint whose manifest config says other model settings."""
    ck = root / name
    shutil.copytree(run.ck, ck)
    manifest = ck / f"iter_{ITERS:07d}" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["config"]["model"].update(model)
    manifest.write_text(json.dumps(data))
    return ck


def test_bad_input_one_line_exit_2_nothing_written(megatron_tp2, llama_tp2, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    partial = bad / "partial"
    shutil.copytree(megatron_tp2.ck, partial)
    (partial / f"iter_{ITERS:07d}" / "manifest.json").unlink()
    corrupt = bad / "corrupt"
    shutil.copytree(megatron_tp2.ck, corrupt)
    shard = next((corrupt / f"iter_{ITERS:07d}").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    rope = _edited(megatron_tp2, bad, "rope", position_embedding_type="rope")
    gqa = _edited(megatron_tp2, bad, "gqa", num_query_groups=2)
    untied = _edited(megatron_tp2, bad, "untied", untie_embeddings_and_output_weights=True)
    rms = _edited(megatron_tp2, bad, "rms", normalization="RMSNorm")
    swiglu = _edited(megatron_tp2, bad, "swiglu", swiglu=True)
    layernorm_rope_swiglu = _edited(llama_tp2, bad, "ln_llama", normalization="LayerNorm")
    partial_rotary = _edited(llama_tp2, bad, "partial_rotary", rotary_percent=0.5)
    (bad / "a_file").write_text("")
    out = tmp_path / "out" / "hf"
    cases = [
        (["--load", bad / "missing"], "does not exist"),
        (["--load", bad], "holds no checkpoint"),
        (["--load", partial], "is incomplete: it has no manifest.json"),
        (["--load", corrupt], "is corrupted"),
        (["--load", megatron_tp2.ck, "--iteration", "99"], "has no checkpoint of iteration 99"),
        (["--load", rope], "as Llama: model.normalization is LayerNorm (Llama's norms are RMSNorm); nor as "
                           "GPT-2: it uses rope position embeddings"),
        (["--load", gqa], "nor as GPT-2: it uses grouped-query attention"),
        (["--load", untied], "nor as GPT-2: its output layer has its own weights"),
        (["--load", rms], "as Llama: model.position_embedding_type is learned_absolute"),
        (["--load", swiglu], "as Llama: model.normalization is LayerNorm"),
        (["--load", layernorm_rope_swiglu], "cannot be exported as Llama: model.normalization is LayerNorm"),
        (["--load", partial_rotary], "cannot be exported as Llama: model.rotary_percent is 0.5"),
        (["--load", megatron_tp2.ck, "--dtype", "fp8"], "--dtype must be one of"),
        (["--load", megatron_tp2.ck, "--max-shard-size", "lots"], "--max-shard-size must be a size"),
        (["--load", megatron_tp2.ck, "--tokenizer", bad / "no_tok"], "--tokenizer"),
    ]
    for args, needle in cases:
        check_one_line_error(run_cli_in_process("export", *args, "--output", out), needle)
        assert not out.exists() and not out.parent.exists(), args
    check_one_line_error(run_cli_in_process("export", "--load", megatron_tp2.ck, "--output", bad / "a_file" / "hf"),
                         "is a file, not a directory")
    done = run_cli_in_process("export", "--load", megatron_tp2.ck, "--output", out)
    assert done.returncode == 0, done.stderr
    check_one_line_error(run_cli_in_process("export", "--load", megatron_tp2.ck, "--output", out), "already exists")
    assert sorted(p.name for p in out.parent.iterdir()) == ["hf"]  # no OUTPUT.tmp-* left behind
    # the real command line, once
    check_one_line_error(run_cli("export", "--load", partial, "--output", tmp_path / "cli"), "is incomplete")
    assert not (tmp_path / "cli").exists()

    for args, needle in [
        (["generate", "--load", megatron_tp2.ck, "--prompt", "hello"], "--prompt must be token ids"),
        (["generate", "--load", megatron_tp2.ck, "--prompt", "1 99999"], "outside the vocabulary"),
        (["generate", "--load", partial, "--prompt", "1 2"], "is incomplete"),
        (["eval", "--load", corrupt], "is corrupted"),
        (["eval", "--load", megatron_tp2.ck, "data.paths=/nonexistent/x_text_document"], "nonexistent"),
    ]:
        check_one_line_error(run_cli_in_process(*args), needle)
