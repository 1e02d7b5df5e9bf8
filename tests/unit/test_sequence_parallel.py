"""parallel.sequence_parallel: its checks, its notice at TP 1, its norm, its activation memory.
(Training with it is checked on real gloo workers in tests/distributed/test_sequence_parallel.py.)"""

import pytest
from megatron.core.transformer.transformer_config import TransformerConfig

from angelgpt.config import parse
from angelgpt.model.norm import SequenceParallelNorm
from angelgpt.planner.plan import activation_bytes
from tests.helpers import check_one_line_error, run_cli

SP = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]


@pytest.mark.subprocess
def test_tp_not_dividing_the_sequence_is_one_line():
    proc = run_cli("train", "--size", "tiny", "--device", "cpu", "--nproc-per-node", "2", *SP, "model.seq_length=63")
    check_one_line_error(proc, "tensor_model_parallel_size (2), which must divide model.seq_length (63)")


@pytest.mark.subprocess
def test_tp1_turns_it_off_with_a_notice():
    proc = run_cli("train", "--size", "tiny", "--device", "cpu", "--dry-run", "parallel.sequence_parallel=true")
    assert proc.returncode == 0, proc.stderr
    resolved = [line for line in proc.stdout.splitlines() if line.startswith("resolved: ")]
    assert len(resolved) == 1 and "parallel.sequence_parallel=false (tensor_model_parallel_size 1" in resolved[0]
    assert "  sequence_parallel: false" in proc.stdout  # the config printed is the one launched
    proc = run_cli("train", "--size", "tiny", "--device", "cpu", "--nproc-per-node", "2", "--dry-run", *SP)
    assert proc.returncode == 0 and "  sequence_parallel: true" in proc.stdout
    assert "parallel.sequence_parallel" not in proc.stdout.split("torchrun command:")[1].split("\n", 2)[1]


def test_norm_marks_its_parameters_for_the_tp_sum():
    for sp in (True, False):
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2,
                                   sequence_parallel=sp)
        norm = SequenceParallelNorm(config, 8)
        assert [getattr(p, "sequence_parallel") for p in norm.parameters()] == [sp, sp]
        assert not any(getattr(p, "tensor_model_parallel", False) for p in norm.parameters())  # TP duplicates


def test_activations_split_over_tp_as_korthikanti_et_al():
    """Per layer 10sbh + 24sbh/t without sequence parallelism, 34sbh/t with it (ffn 4h, no recompute);
    a recomputed layer's kept input 2sbh, 2sbh/t with it (one layer's full set during its backward comes
    after the logits are gone: at 125M's vocabulary the logits' peak is the larger, so only the kept inputs
    differ)."""
    base = ["parallel.tensor_model_parallel_size=2", "model.recompute=none"]
    off, on = parse("125m", overrides=base), parse("125m", overrides=base + ["parallel.sequence_parallel=true"])
    m = off.model
    sbh = m.seq_length * off.train.micro_batch_size * m.hidden_size
    assert activation_bytes(off, False) - activation_bytes(on, False) == m.num_layers * 10 * sbh // 2
    assert activation_bytes(off, True) - activation_bytes(on, True) == m.num_layers * 2 * sbh // 2
