"""tiny on prepared tinyshakespeare: validation loss falls below the corpus's unigram entropy."""

import math

import numpy as np
import pytest

from tests.helpers import train_tiny

pytestmark = pytest.mark.distributed


def test_validation_loss_below_unigram_entropy(tmp_path, corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from angelgpt.data.prepare import prepare
    from angelgpt.data.tokenizer import train_tokenizer

    train_tokenizer([str(corpus)], str(tmp_path / "tok"), vocab_size=2048)
    summary = prepare(str(corpus), str(tmp_path / "tok"), str(tmp_path / "shk"), append_eod=True, progress=False)
    ds = IndexedDataset(summary.prefix)
    counts = np.bincount(np.concatenate([ds[i] for i in range(len(ds))]))
    p = counts[counts > 0] / counts.sum()
    unigram_entropy = float(-(p * np.log(p)).sum())  # nats per token

    records = train_tiny(tmp_path, "real", f"data.paths={summary.prefix}", f"data.tokenizer={tmp_path / 'tok'}",
                         "model.vocab_size=2048", "train.train_iters=150", "train.eval_interval=50",
                         f"data.cache_path={tmp_path / 'cache'}")
    val = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    assert len(val) == 3
    assert val[0] > val[-1]
    assert val[-1] < unigram_entropy, (val, unigram_entropy)
    assert math.isfinite(records[-1]["lm_loss"])
