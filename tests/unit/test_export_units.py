"""angelgpt export's pieces without a checkpoint: the qkv reordering against Megatron's own split, the
streaming safetensors writer against the safetensors library, sizes, and the staged output directory
that leaves nothing behind on failure or SIGTERM, and why generate stopped."""

import json
import os
import signal

import pytest
import torch

from angelgpt.config import ConfigError
from angelgpt.export.export import staged_directory
from angelgpt.export.generate import render, sample_local, stop_reason
from angelgpt.export.gpt2 import qkv_to_gpt2
from angelgpt.export.safetensors_writer import INDEX, SINGLE, parse_size, write_safetensors


@pytest.mark.parametrize("heads,groups", [(4, 4), (8, 2), (6, 1)])
def test_qkv_to_gpt2_matches_megatrons_split(heads, groups):
    """Megatron's SelfAttention.get_query_key_value_tensors: view [groups, (heads/groups + 2) * d], split
    into the group's queries, key, value; GPT-2 wants all queries, then keys, then values."""
    d, hidden = 3, 5
    w = torch.randn(groups * (heads // groups + 2) * d, hidden)
    x = torch.randn(7, hidden)
    mixed = (x @ w.t()).view(7, groups, (heads // groups + 2) * d)
    q, k, v = torch.split(mixed, [heads // groups * d, d, d], dim=2)
    expected = torch.cat([q.reshape(7, heads * d), k.reshape(7, groups * d), v.reshape(7, groups * d)], dim=1)
    assert torch.equal(x @ qkv_to_gpt2(w, heads, groups, d).t(), expected)
    b = torch.randn(w.shape[0])
    mixed_b = b.view(groups, -1)
    qb, kb, vb = torch.split(mixed_b, [heads // groups * d, d, d], dim=1)
    assert torch.equal(qkv_to_gpt2(b, heads, groups, d), torch.cat([qb.reshape(-1), kb.reshape(-1), vb.reshape(-1)]))


def _specs():
    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(40, 30, generator=g), "a.bias": torch.randn(30, generator=g),
               "b.weight": torch.randn(100, 20, generator=g).to(torch.bfloat16), "c": torch.randn(3, 4, 5, generator=g)}
    made = []

    def maker(name):
        def make():
            made.append(name)
            return tensors[name].clone()
        return make

    return tensors, [(n, tuple(t.shape), t.dtype, maker(n)) for n, t in tensors.items()], made


def test_one_file_reads_with_safetensors(tmp_path):
    from safetensors.torch import load_file

    tensors, specs, made = _specs()
    assert write_safetensors(tmp_path, specs, parse_size("1GB")) == [SINGLE]
    loaded = load_file(tmp_path / SINGLE)
    assert loaded.keys() == tensors.keys() and made == list(tensors)  # each made once, in order
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t)


def test_shards_and_index_as_transformers_writes_them(tmp_path):
    from safetensors.torch import load_file

    tensors, specs, _ = _specs()
    files = write_safetensors(tmp_path, specs, 5000)  # a.weight alone is 4800 bytes
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and files[-1] == INDEX
    assert shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    index = json.loads((tmp_path / INDEX).read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for shard in shards:
        part = load_file(tmp_path / shard)
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 5000 or len(part) == 1
        for name, t in part.items():
            assert index["weight_map"][name] == shard and torch.equal(t, tensors[name])


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("1.5KB") == 1500
    assert parse_size("123") == 123
    for bad in ("", "5XB", "-1GB", "0"):
        with pytest.raises(ConfigError):
            parse_size(bad)


def _leftovers(parent):
    return sorted(p.name for p in parent.iterdir())


def test_staged_directory_renames_only_when_complete(tmp_path):
    out = tmp_path / "hf"
    with staged_directory(out, overwrite=False) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith("hf.tmp-") and not out.exists()
        (tmp / "f").write_text("x")
    assert (out / "f").read_text() == "x" and _leftovers(tmp_path) == ["hf"]
    with pytest.raises(ConfigError, match="already exists"):
        with staged_directory(out, overwrite=False):
            pass
    with staged_directory(out, overwrite=True) as tmp:
        (tmp / "g").write_text("y")
    assert _leftovers(out) == ["g"] and _leftovers(tmp_path) == ["hf"]


def test_staged_directory_leaves_nothing_on_failure_or_sigterm(tmp_path):
    out = tmp_path / "hf"
    with pytest.raises(RuntimeError):
        with staged_directory(out, overwrite=False) as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("conversion failed")
    with pytest.raises(ConfigError, match="writing failed"):
        with staged_directory(out, overwrite=False) as tmp:
            raise OSError(28, "No space left on device")
    with pytest.raises(SystemExit):
        with staged_directory(out, overwrite=False) as tmp:
            (tmp / "half").write_text("x")
            os.kill(os.getpid(), signal.SIGTERM)
    assert _leftovers(tmp_path) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        with staged_directory(tmp_path / "file" / "hf", overwrite=False):
            pass


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077], ids=oct)
def test_staged_directory_mode_follows_the_umask(tmp_path, mask):
    """The output is readable as any other new directory and file (0777 / 0666 less the umask), not
    mkdtemp's private 0700."""
    out = tmp_path / "hf"
    previous = os.umask(mask)
    try:
        with staged_directory(out, overwrite=False) as tmp:
            (tmp / "config.json").write_text("{}")
    finally:
        os.umask(previous)
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask
    assert (out / "config.json").stat().st_mode & 0o777 == 0o666 & ~mask


class _Fixed(torch.nn.Module):
    """A "model" whose next token after any sequence is script[len(sequence)]."""

    def __init__(self, script):
        super().__init__()
        self.script = script

    def forward(self, tokens, position_ids, mask):
        logits = torch.zeros(1, tokens.shape[1], 10)
        logits[0, -1, self.script[tokens.shape[1]]] = 1.0
        return logits


def test_generate_says_why_it_stopped(capsys):
    model = _Fixed([0, 0, 3, 4, 9, 5, 6])  # prompt of 2, then 3 4 9(eod) ...
    new = sample_local(model, [1, 2], 5, 0.0, None, 0, 9, "cpu")
    assert new == [3, 4, 9] and stop_reason(new, {9}, 5, 5) == "eod"
    new = sample_local(model, [1, 2], 2, 0.0, None, 0, 9, "cpu")
    assert new == [3, 4] and stop_reason(new, {9}, 2, 2) == "max_new_tokens"
    assert stop_reason(new, {9}, 2, 50) == "context"  # the context allowed 2 of the 50 asked for
    assert stop_reason([9], {None}, 1, 1) == "max_new_tokens"  # a model without an end-of-document id

    result = {"prompt_ids": [1, 2], "new_ids": [3, 4, 9], "text": "1 2 3 4 9", "stop_reason": "eod"}
    assert json.loads(render(result, as_json=True))["stop_reason"] == "eod"
    assert capsys.readouterr().err == ""
    assert render(result, as_json=False) == "1 2 3 4 9"
    assert capsys.readouterr().err == "angelgpt: stopped after 3 new tokens: the end-of-document token\n"
    assert render(dict(result, stop_reason="max_new_tokens"), as_json=False) == "1 2 3 4 9"
    assert capsys.readouterr().err == "angelgpt: stopped after 3 new tokens: --max-new-tokens reached\n"
