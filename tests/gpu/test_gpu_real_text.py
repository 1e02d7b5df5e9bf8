"""Real text on a GPU, as docs/data.md has a user do it: a SentencePiece tokenizer and
`data prepare` on the shared tinyshakespeare text, then a few hundred training iterations with the
default optimizer (Megatron's), saved at the end and evaluated from the checkpoint. Skipped without
CUDA."""

import json

import pytest
import torch

from tests.helpers import read_metrics, run_cli, run_cli_in_process

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ITERS = 300
# the validation loss at iteration 300 must fall below this: 3.99 was measured on the H200 at eb01ed1
# (a calibration run), 4.1 leaves room; every run's losses are recorded in the result file of
# scripts/gpu_tests.sh (the test's val_loss_by_iteration property)
VAL_LOSS_BELOW = 4.1


def test_shakespeare_trains_saves_and_evaluates_on_gpu(corpus, tmp_path, record_property):
    proc = run_cli("tokenizer", "train", "--input", corpus, "--vocab-size", "1024", "--output", tmp_path / "tok")
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run_cli("data", "prepare", "--input", corpus, "--tokenizer", tmp_path / "tok", "--output",
                   tmp_path / "data" / "shk", "--append-eod")
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    proc = run_cli("train", "--size", "tiny", "--device", "cuda", "--metrics-file", metrics, "--save", ck,
                   "model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4", "model.seq_length=256",
                   "model.vocab_size=1024", f"data.paths={tmp_path / 'data' / 'shk_text_document'}",
                   f"data.tokenizer={tmp_path / 'tok'}", f"data.cache_path={tmp_path / 'cache'}", "data.split=949,50,1",
                   "train.micro_batch_size=16", "train.global_batch_size=32", f"train.train_iters={ITERS}",
                   "train.eval_interval=100", "train.eval_iters=4", "optim.lr=1e-3", "optim.min_lr=1e-4",
                   "optim.lr_warmup_iters=30", "logging.log_interval=50", timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    val = [(r["iteration"], r["val_loss"]) for r in read_metrics(metrics) if r.get("val_loss") is not None]
    record_property("val_loss_by_iteration", json.dumps(val))  # into the gpu-tests result file
    assert [i for i, _ in val] == [100, 200, 300]
    assert val[-1][1] < val[0][1] and val[-1][1] < VAL_LOSS_BELOW, val
    assert (ck / "iter_0000300").is_dir()
    result = json.loads(run_cli_in_process("eval", "--load", ck, "--json").stdout)
    assert result["iteration"] == ITERS and result["loss"] == pytest.approx(val[-1][1], rel=2e-2), (result, val)
