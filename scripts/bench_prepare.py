"""Preprocessing benchmark: tokens/s of `angelgpt data prepare` on the shared corpus repeated to >= 50 MB.

    python scripts/bench_prepare.py --workers 2 --vocab-size 8192 [--model-type unigram|bpe]

Writes benchmarks/results/prepare-<workers>workers-<model type>.json (a run again -runN.json;
benchmarks.results writes it) with the command, commit, machine and figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # angelgpt and the benchmarks package of this checkout


def main() -> int:
    from angelgpt.data.prepare import prepare
    from angelgpt.data.tokenizer import train_tokenizer
    from benchmarks.results import RESULTS, invocation, stamp, write_result

    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default=str(ROOT / "tests" / "data" / "tinyshakespeare.txt"))
    ap.add_argument("--min-mb", type=float, default=50.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--model-type", default="unigram", choices=["unigram", "bpe"],
                    help="the tokenizer's model (unigram is the default of `angelgpt tokenizer train`)")
    ap.add_argument("--goal-tokens-per-s-per-core", type=float, default=1.0e6)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()

    text = Path(args.corpus).read_text()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train_tokenizer([args.corpus], str(tmp / "tok"), vocab_size=args.vocab_size, model_type=args.model_type)
        repeats = int(args.min_mb * 1e6 // len(text.encode())) + 1
        big = tmp / "corpus.txt"
        with open(big, "w") as fh:
            for _ in range(repeats):
                fh.write(text)
                fh.write("\n\n")
        size = big.stat().st_size
        t0 = time.perf_counter()
        import datasets  # noqa: F401  (imports are start-up, timed apart from processing)
        from megatron.core.datasets import indexed_dataset  # noqa: F401
        import_seconds = time.perf_counter() - t0
        start = time.perf_counter()
        summary = prepare(str(big), str(tmp / "tok"), str(tmp / "out"), workers=args.workers, progress=False)
        seconds = time.perf_counter() - start
        # the tokenizer alone on one core, over the same documents (the ceiling of the per-core rate)
        from angelgpt.data.tokenizer import load_tokenizer

        docs = [d for d in text.split("\n\n") if d.strip()]
        tok = load_tokenizer(str(tmp / "tok"))
        t0 = time.perf_counter()
        encoded = sum(map(len, tok.tokenize_batch(docs * 10)))
        encode_rate = encoded / (time.perf_counter() - t0)
    rate = summary.tokens / seconds
    result = stamp(f"prepare-{args.workers}workers-{args.model_type}", invocation())
    result.update({
        "tokenizer": {"model_type": args.model_type, "vocab_size": args.vocab_size},
        "corpus_bytes": size,
        "documents": summary.documents,
        "tokens": summary.tokens,
        "seconds": round(seconds, 2),
        "import_seconds_not_counted": round(import_seconds, 2),
        "tokens_per_s": round(rate),
        "tokens_per_s_per_core": round(rate / args.workers),
        "tokenizer_alone_tokens_per_s_one_core": round(encode_rate),
        "goal_tokens_per_s_per_core": args.goal_tokens_per_s_per_core,
        "goal_met": rate / args.workers >= args.goal_tokens_per_s_per_core,
    })
    path = write_result(args.out, result)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
