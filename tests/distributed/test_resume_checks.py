"""Resuming, as a user types it: the checkpoint a run resumes from (--load, or a --save directory that holds
one) is checked in the launcher before torchrun starts (missing, empty, unfinished, another model, nothing
left to train), as `export`, `eval` and `generate` check their --load before torch is imported; and a run
extended past the iterations it was saved at follows the learning-rate schedule of the new length.

One tiny run of N iterations, saved at N (module-scoped), serves every test.
"""

import json
import shutil
import time

import pytest

from tests.helpers import check_one_line_error, run_cli, train_tiny

pytestmark = pytest.mark.distributed

N, EXTENDED = 6, 9
SCHEDULE = ("optim.lr_warmup_iters=2",)
# a refusal before launch is the CLI's start-up and a few file reads; torchrun and its workers importing
# torch and Megatron take longer than this on the machines the tests run on
BEFORE_LAUNCH_S = 4.0


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    ck = root / "ck"
    train_tiny(root, "first", *SCHEDULE, f"train.train_iters={N}", f"checkpoint.save={ck}")
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == str(N)
    return ck


def _train(*args):
    started = time.perf_counter()
    proc = run_cli("train", "--size", "tiny", "--device", "cpu", *SCHEDULE, *args)
    return proc, time.perf_counter() - started


def _refused_before_launch(proc, seconds, needle):
    check_one_line_error(proc, needle)
    assert seconds < BEFORE_LAUNCH_S, seconds


def test_extended_run_follows_the_schedule_of_its_new_length(saved, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    resumed, out = train_tiny(tmp_path, "resumed", *SCHEDULE, f"train.train_iters={EXTENDED}", f"--load={ck}",
                              with_output=True)
    fresh = train_tiny(tmp_path, "fresh", *SCHEDULE, f"train.train_iters={EXTENDED}")
    assert [r["iteration"] for r in resumed] == list(range(N + 1, EXTENDED + 1))
    fresh_lr = {r["iteration"]: r["lr"] for r in fresh}
    for r in resumed:
        assert r["lr"] == pytest.approx(fresh_lr[r["iteration"]], rel=1e-9, abs=0), r["iteration"]
    # (with the checkpoint's decay length every extended iteration would be at min_lr)
    assert resumed[0]["lr"] > 3.0e-4 * 1.01
    assert f"learning-rate schedule: decay over {EXTENDED} iterations (checkpoint: {N})" in out


def test_resume_at_the_same_schedule_says_nothing_about_it(saved, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    _, out = train_tiny(tmp_path, "same", *SCHEDULE, f"train.train_iters={N + 1}", f"optim.lr_decay_iters={N}",
                        f"--load={ck}", with_output=True)
    assert "learning-rate schedule" not in out


def test_nothing_left_to_train_says_how_to_extend_and_launches_nothing(saved, tmp_path):
    metrics = tmp_path / "m.jsonl"
    for where in (f"--load={saved}", f"--save={saved}"):  # a --save directory holding a checkpoint resumes too
        proc, seconds = _train(where, f"train.train_iters={N}", f"--metrics-file={metrics}")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip().splitlines()[-1] == (
            f"angelgpt: nothing to train: the checkpoint is at iteration {N} and train.train_iters is {N}; "
            f"raise train.train_iters to train on")
        assert seconds < BEFORE_LAUNCH_S and not metrics.exists() and "torchrun command" not in proc.stdout


def test_missing_empty_or_unfinished_load_is_refused_before_launch(saved, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    unfinished = tmp_path / "unfinished"
    shutil.copytree(saved, unfinished)
    (unfinished / f"iter_{N:07d}" / "manifest.json").unlink()
    stray = tmp_path / "stray"
    shutil.copytree(saved, stray)
    (stray / "latest_checkpointed_iteration.txt").write_text("99\n")
    for load, needle in [
        (tmp_path / "does-not-exist", f"checkpoint.load {tmp_path / 'does-not-exist'} does not exist"),
        (empty, f"checkpoint.load {empty} holds no checkpoint: no latest_checkpointed_iteration.txt"),
        (unfinished, "is incomplete: it has no manifest.json"),
        (stray, "latest_checkpointed_iteration.txt names iteration 99 but iter_0000099 is missing"),
    ]:
        _refused_before_launch(*_train(f"--load={load}", f"train.train_iters={EXTENDED}"), needle)


@pytest.mark.parametrize("override, line", [
    ("model.hidden_size=128", "model.hidden_size: checkpoint 64, config 128"),
    ("model.num_layers=4", "model.num_layers: checkpoint 2, config 4"),
    ("model.seq_length=128", "model.seq_length: checkpoint 64, config 128"),
    ("model.vocab_size=1024", "model.vocab_size: checkpoint 512, config 1024"),
    ("model.untie_embeddings_and_output_weights=true",
     "model.untie_embeddings_and_output_weights: checkpoint False, config True"),
    ("model.add_bias_linear=false", "model.add_bias_linear: checkpoint True, config False"),
    ("model.normalization=RMSNorm", "model.normalization: checkpoint LayerNorm, config RMSNorm"),
])
def test_load_of_another_model_is_one_line_naming_the_field(saved, override, line):
    proc, seconds = _train(f"--load={saved}", f"train.train_iters={EXTENDED}", override)
    _refused_before_launch(proc, seconds, f"checkpoint.load {saved} holds another model: {line}")
    assert proc.stderr.strip().endswith(line)


def test_fields_that_may_change_on_resume_pass_the_check(saved, tmp_path):
    """Batch sizes, learning rate and recompute change how the same parameters train: the run launches
    (a dry run: checked, not trained)."""
    proc, _ = _train(f"--load={saved}", f"train.train_iters={EXTENDED}", "train.global_batch_size=16",
                     "optim.lr=1e-3", "optim.lr_decay_style=linear", "model.make_vocab_size_divisible_by=64",
                     "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "torchrun command" in proc.stdout


def test_another_optimizers_checkpoint_is_one_line_and_its_weights_carry_over_by_export_and_import(saved, tmp_path):
    """The CPU data-parallel AdamW (optimizer megatron on CPU) and ZeRO-Cache lay out the model and its
    states otherwise: a resume with the other is refused by the workers in one line that names the saving
    optimizer and the way on, export then import, which this test follows to a run that trains."""
    proc, _ = _train(f"--load={saved}", f"--save={tmp_path / 'ck'}", f"train.train_iters={EXTENDED}",
                     "optim.optimizer=zero_cache")
    check_one_line_error(proc, f"checkpoint.load {saved}: iter_{N:07d} lacks what this run loads", in_worker=True)
    assert "it was saved with optim.optimizer=megatron on cpu, and each optimizer lays out" in proc.stderr
    assert f"angelgpt export --load {saved} --output HF_DIR, then angelgpt import --hf HF_DIR" in proc.stderr
    assert not (tmp_path / "ck" / "latest_checkpointed_iteration.txt").exists()
    hf, imported = tmp_path / "hf", tmp_path / "imported"
    for args in (["export", "--load", saved, "--output", hf], ["import", "--hf", hf, "--save", imported]):
        done = run_cli(*args)
        assert done.returncode == 0, done.stderr[-2000:]
    metrics = train_tiny(tmp_path, "carried", f"--config={imported / 'config.yaml'}", f"--load={imported}",
                         "optim.optimizer=zero_cache", "train.train_iters=2")
    assert [r["iteration"] for r in metrics] == [1, 2]


def test_save_directory_of_another_model_is_refused_before_launch(saved, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    proc, seconds = _train(f"--save={ck}", f"train.train_iters={EXTENDED}", "model.hidden_size=128")
    _refused_before_launch(proc, seconds, f"checkpoint.save {ck} holds another model: "
                                          f"model.hidden_size: checkpoint 64, config 128")


@pytest.mark.parametrize("command", [["export", "--output", "OUT"], ["eval"], ["generate", "--prompt", "1 2"]])
def test_after_training_commands_refuse_a_missing_or_empty_load_before_torch(saved, tmp_path, command):
    empty = tmp_path / "empty"
    empty.mkdir()
    args = [str(tmp_path / "hf") if a == "OUT" else a for a in command]
    for load, needle in [(tmp_path / "nope", f"--load {tmp_path / 'nope'} does not exist"),
                         (empty, f"--load {empty} holds no checkpoint")]:
        started = time.perf_counter()
        proc = run_cli(*args, "--load", load)
        check_one_line_error(proc, needle)
        assert time.perf_counter() - started < BEFORE_LAUNCH_S
    assert not (tmp_path / "hf").exists()


def test_eval_override_that_reshapes_the_model_is_refused(saved):
    proc = run_cli("eval", "--load", saved, "model.hidden_size=128")
    check_one_line_error(proc, "holds another model: model.hidden_size: checkpoint 64, config 128")


def test_manifest_config_holds_the_fields_compared(saved):
    """The comparison reads the manifest's config: each field it compares is there."""
    from angelgpt.train.checkpoint_check import SHAPE_FIELDS

    model = json.loads((saved / f"iter_{N:07d}" / "manifest.json").read_text())["config"]["model"]
    assert set(SHAPE_FIELDS) | {"seq_length", "vocab_size", "make_vocab_size_divisible_by"} <= model.keys()
