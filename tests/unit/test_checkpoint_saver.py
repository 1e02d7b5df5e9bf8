"""checkpoint.Saver on one gloo rank: one save in flight (a second finalizes the first before it
starts), an asynchronous save without host memory for its copy written synchronously with one line, and
an asynchronous write holding what was staged, tensors and objects, whatever changes after."""

import logging

import pytest
import torch


@pytest.fixture
def tiny(megatron_single_rank):
    from angelgpt.config import parse
    from angelgpt.planner import MACHINES, resolve_config
    from angelgpt.train.worker import build

    cfg, _ = resolve_config(parse("tiny", overrides=["train.device=cpu"]), MACHINES["h200"], 1, 1, on_gpu=False)
    torch.manual_seed(0)
    return build(cfg, on_gpu=False)


def test_a_second_save_waits_for_the_first(tiny, tmp_path):
    from angelgpt.train import checkpoint

    model, optimizer, scheduler = tiny
    saver = checkpoint.Saver(str(tmp_path), {}, None, True, torch.device("cpu"))
    saver.save(1, 8, model, optimizer, scheduler, asynchronous=True)
    assert saver.pending[0] == 1 and saver.pending[2].thread is not None  # staged, written by the thread
    assert checkpoint.latest_iteration(str(tmp_path)) is None and (tmp_path / "iter_0000001.tmp").is_dir()
    saver.save(2, 16, model, optimizer, scheduler, asynchronous=True)
    assert checkpoint.latest_iteration(str(tmp_path)) == 1 and checkpoint.verify(tmp_path / "iter_0000001") is None
    assert saver.pending[0] == 2
    saver.finalize(blocking=True)
    assert saver.pending is None and checkpoint.latest_iteration(str(tmp_path)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "iter_0000002", checkpoint.TRACKER]
    events = saver.take_events()
    assert events["save_iteration"] == 2 and events["async"] == 1 and events["staged_gib"] > 0
    assert events["stall_s"] > 0 and events["write_s"] > 0 and events["finalize_s"] > 0


def test_async_save_without_room_for_the_copy_is_written_synchronously(tiny, tmp_path, monkeypatch, caplog):
    from angelgpt.train import checkpoint

    model, optimizer, scheduler = tiny
    monkeypatch.setattr(checkpoint, "host_memory_available", lambda: 1024)  # a host with 1 KiB to spare
    saver = checkpoint.Saver(str(tmp_path), {}, None, True, torch.device("cpu"))
    with caplog.at_level(logging.WARNING):
        saver.save(1, 8, model, optimizer, scheduler, asynchronous=True)
        saver.save(2, 16, model, optimizer, scheduler, asynchronous=True)
    lines = [r.getMessage() for r in caplog.records if "host-memory copy" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "written synchronously" in lines[0], lines
    assert saver.pending[2].thread is None and saver.pending[2].done()  # written already, nothing staged
    saver.finalize(blocking=False)  # finalized with the other ranks' at the next boundary
    assert checkpoint.latest_iteration(str(tmp_path)) == 2 and checkpoint.verify(tmp_path / "iter_0000002") is None
    events = saver.take_events()
    assert events["async"] == 0 and events["staged_gib"] == 0


def test_async_saves_stage_into_one_buffer_kept_from_save_to_save(tiny, tmp_path):
    """The second save allocates nothing: it stages into the first one's buffer, and what it writes is
    the second save's state (the loaded checkpoint equals the model at that save)."""
    from angelgpt.train import checkpoint

    model, optimizer, scheduler = tiny
    saver = checkpoint.Saver(str(tmp_path), {}, None, True, torch.device("cpu"))
    saver.save(1, 8, model, optimizer, scheduler, asynchronous=True)
    buffer = saver.staging.buffer
    assert buffer is not None and buffer.numel() >= saver.pending[2].staging_bytes()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    expected = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    saver.save(2, 16, model, optimizer, scheduler, asynchronous=True)
    assert saver.staging.buffer.data_ptr() == buffer.data_ptr()
    with torch.no_grad():  # the step after the save changes the model in place, not what is written
        for p in model.parameters():
            p.add_(1.0)
    saver.finalize(blocking=True)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(tmp_path / "iter_0000002"), str(tmp_path / "flat.pt"))
    written = torch.load(tmp_path / "flat.pt", weights_only=False)
    compared = [k for k in expected if k in written and k.startswith(("embedding.", "decoder.final_layernorm"))]
    assert len(compared) >= 3, sorted(written)
    assert all(torch.equal(written[k], expected[k]) for k in compared)


def test_async_save_told_at_start_that_its_buffer_will_not_fit_saves_synchronously(tiny, tmp_path, caplog):
    from angelgpt.train import checkpoint

    model, optimizer, scheduler = tiny
    saver = checkpoint.Saver(str(tmp_path), {}, None, True, torch.device("cpu"))
    with caplog.at_level(logging.WARNING):
        assert not saver.room_for(1 << 60, asynchronous=True)  # the planner's figure, before any save
        saver.save(1, 8, model, optimizer, scheduler, asynchronous=True)
    lines = [r.getMessage() for r in caplog.records if "host-memory copy" in r.getMessage()]
    assert len(lines) == 1 and "written synchronously" in lines[0], lines
    assert saver.pending[2].thread is None and saver.staging.buffer is None


def _staged_then_changed(tmp_path):
    """A save of one tensor and one object, staged, then both changed (the next step) before the
    background write; what the checkpoint holds, read back."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from angelgpt.train.checkpoint_writer import HostStaging, ShardsStrategy, WriteJob

    weight, counters = torch.arange(6, dtype=torch.float32), {"step": 1}
    state = {"w": ShardedTensor.from_rank_offsets("w", weight), "c": ShardedObject("c", counters, (1,), (0,))}
    strategy = ShardsStrategy()
    dist_checkpointing.save(state, str(tmp_path), sharded_strategy=strategy)
    job, staging = WriteJob(strategy.shards, tmp_path), HostStaging()
    job.stage(staging)
    weight.add_(100.0)
    counters["step"] = 2
    job.start(dist.new_group(backend="gloo"))
    job.finish()
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(6)), "c": ShardedObject("c", None, (1,), (0,))}
    return dist_checkpointing.load(request, str(tmp_path))


def test_an_async_write_holds_tensors_and_objects_as_they_were_when_staged(megatron_single_rank, tmp_path):
    loaded = _staged_then_changed(tmp_path)
    assert torch.equal(loaded["w"], torch.arange(6, dtype=torch.float32)) and loaded["c"] == {"step": 1}
