"""A tiny CPU run with the optional sinks and traces: an offline Weights & Biases run holds every
iteration's loss and the resolved config, torch.profiler leaves a TensorBoard trace of the chosen
iterations, and a memory snapshot asked for on CPU is a one-line notice."""

import json
import struct

import pytest

from tests.helpers import read_metrics, run_cli

pytestmark = pytest.mark.distributed

ITERS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pytest.importorskip("wandb")
    tmp = tmp_path_factory.mktemp("observed")
    proc = run_cli("train", "--size", "tiny", "--device", "cpu", "--metrics-file", tmp / "m.jsonl",
                   f"train.train_iters={ITERS}", "logging.log_interval=1", f"logging.tensorboard_dir={tmp / 'tb'}",
                   "logging.profile_steps=2,3", "logging.wandb_project=t", "logging.wandb_mode=offline",
                   f"logging.wandb_dir={tmp / 'wb'}", f"logging.memory_snapshot={tmp / 'mem.pickle'}",
                   env={"WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp, proc


def wandb_records(path):
    """The records of a .wandb file (LevelDB log format: 7-byte file header, 32 KiB blocks of chunks,
    each chunk a CRC32C, a length, a type), parsed as wandb's own protobuf Record."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, header = 32768, 7
    records, pending, i = [], b"", 7
    while i + header <= len(data):
        if block - i % block < header:  # the block's tail is padding
            i += block - i % block
            continue
        _, length, kind = struct.unpack("<IHB", data[i:i + header])
        i += header
        if kind == 0 and length == 0:
            break
        pending += data[i:i + length]
        i += length
        if kind in (1, 4):  # FULL or LAST chunk: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_offline_wandb_run_holds_the_loss_of_every_iteration_and_the_resolved_config(run):
    tmp, _ = run
    files = list((tmp / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    records = wandb_records(files[0])
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            history[row["_step"]] = row
    metrics = {m["iteration"]: m for m in read_metrics(tmp / "m.jsonl")}
    assert sorted(history) == sorted(metrics) == list(range(1, ITERS + 1))
    for step, row in history.items():
        assert row["train/lm_loss"] == pytest.approx(metrics[step]["lm_loss"])
        assert row["train/lr"] == pytest.approx(metrics[step]["lr"])
    run_record = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run_record.project == "t"
    config = {item.key: json.loads(item.value_json) for item in run_record.config.update}
    assert config["model"]["transformer_impl"] == "local"  # resolved, not 'auto'
    assert config["train"]["train_iters"] == ITERS and config["logging"]["wandb_project"] == "t"


def test_profile_steps_leave_a_tensorboard_trace_of_those_iterations(run):
    tmp, proc = run
    traces = list((tmp / "tb" / "profile").glob("*.pt.trace.json"))
    assert len(traces) == 1 and "_rank0." in traces[0].name, traces
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert len(events) > 100
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}
    assert any(e.get("name", "").startswith("aten::") for e in events)
    assert "profile of iterations 2-3 written under" in proc.stdout


def test_memory_snapshot_on_cpu_is_a_one_line_notice(run):
    tmp, proc = run
    assert not (tmp / "mem.pickle").exists()
    notices = [line for line in proc.stdout.splitlines() if "applies to GPUs" in line]
    assert len(notices) == 1 and notices[0].startswith("logging.memory_snapshot ("), notices
