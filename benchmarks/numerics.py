"""What ZeRO-Cache's state formats do to training, on real text: one model from one seed, trained on the
same batches with each format, its validation loss curve in one result file per run, the curves side
by side in one plot.

    # the corpus every machine has: this Python's standard library source, one document per file;
    # a SentencePiece tokenizer trained on it and the corpus prepared for Megatron (.bin/.idx)
    python -m benchmarks.numerics prepare --out numerics-data
    # a run per format (the same seed, batches and schedule; --iters 2000 by default)
    python -m benchmarks.numerics run --name numerics-fp32 --data numerics-data
    python -m benchmarks.numerics run --name numerics-bf16-moments --data numerics-data -- \
        optim.exp_avg_dtype=bf16 optim.exp_avg_sq_dtype=bf16
    # the curves (an SVG written without plotting libraries) and each run's end against the first's
    python -m benchmarks.numerics plot benchmarks/results/numerics-*.json --out benchmarks/numerics.svg

The model is the 125m preset's shape (12 x 768, 12 heads, sequence 1024) with the tokenizer's 32,000
tokens: 110M parameters, 8 sequences a step (2,000 steps read 16.4M tokens, under two passes over the
corpus's 9.4M). A result file holds the stamp (command, commit, machine, device call), the
given config, the corpus's manifest, every logged training loss and every validation loss.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import List, Optional

from angelgpt.config.schema import TrainConfig
from benchmarks.results import RESULTS, invocation, stamp, write_result

VOCAB = 32000
MODEL = ["model.vocab_size=32000", "model.seq_length=1024", "train.micro_batch_size=8",
         "train.global_batch_size=8", "optim.optimizer=zero_cache", "optim.lr=6e-4", "optim.min_lr=6e-5",
         "optim.lr_warmup_iters=100", "data.split=949,50,1", "logging.log_interval=10"]
EVAL_INTERVAL, EVAL_ITERS = 100, 20


class BadInput(Exception):
    """Bad input: said in one line, exit 2."""


def corpus_files(stdlib: Path) -> List[Path]:
    """The standard library's Python source files, in a fixed order (installed packages left out)."""
    return sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def prepare(out: Path, stdlib: Path, vocab: int = VOCAB) -> dict:
    """out/corpus.jsonl (a document per file), out/tokenizer, out/data/stdlib_text_document.{bin,idx},
    out/manifest.json; returns the manifest."""
    files = corpus_files(stdlib)
    if not files:
        raise BadInput(f"--stdlib {stdlib}: no Python source there")
    out.mkdir(parents=True, exist_ok=True)
    digest, nbytes = hashlib.sha256(), 0
    corpus = out / "corpus.jsonl"
    with open(corpus, "w") as fh:
        for f in files:
            text = f.read_bytes().decode("utf-8", errors="replace")
            digest.update(text.encode())
            nbytes += len(text.encode())
            fh.write(json.dumps({"text": text}) + "\n")
    angelgpt = [sys.executable, "-m", "angelgpt"]
    subprocess.run([*angelgpt, "tokenizer", "train", "--input", str(corpus), "--vocab-size", str(vocab),
                    "--output", str(out / "tokenizer")], check=True)
    subprocess.run([*angelgpt, "data", "prepare", "--input", str(corpus), "--tokenizer", str(out / "tokenizer"),
                    "--output", str(out / "data" / "stdlib"), "--append-eod"], check=True)
    manifest = {"source": str(stdlib), "python": sysconfig.get_python_version(), "files": len(files),
                "bytes": nbytes, "sha256": digest.hexdigest(), "vocab_size": vocab,
                "dataset": "data/stdlib_text_document"}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def run(name: str, data: Path, iters: int, size: str, device: str, overrides: List[str], out: Path,
        eval_interval: int = EVAL_INTERVAL, time_limit: Optional[float] = None) -> Path:
    """Trains the model on the prepared corpus and writes the result file; returns its path. Past
    `time_limit` seconds the run is stopped (its process group terminated) and the file holds the
    curves so far, with returncode "time limit"."""
    from benchmarks.train import given_config

    if not (data / "manifest.json").is_file():
        raise BadInput(f"--data {data}: no manifest.json (make it with `python -m benchmarks.numerics prepare --out "
                       f"{data}`)")
    manifest = json.loads((data / "manifest.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        given = [*MODEL, f"model.vocab_size={manifest['vocab_size']}", f"data.paths={data / manifest['dataset']}",
                 f"data.tokenizer={data / 'tokenizer'}", f"data.cache_path={Path(tmp) / 'cache'}",
                 f"train.train_iters={iters}", f"train.eval_interval={eval_interval}",
                 f"train.eval_iters={EVAL_ITERS}", *overrides]
        cmd = [sys.executable, "-m", "angelgpt", "train", "--size", size, "--device", device,
               "--metrics-file", str(metrics), *given]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=time_limit)
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            stdout, stderr = _stop(proc)
            returncode = "time limit"
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    result = stamp(name, invocation())
    result.update(
        size=size, device=device, overrides=list(overrides), config=given_config(size, given), corpus=manifest,
        returncode=returncode, time_limit=time_limit, stderr_tail=stderr[-3000:] if returncode else "",
        settings=[line for line in stdout.splitlines() if line.startswith(("resolved:", "zero_cache:", "plan:"))],
        train_loss=[[r["iteration"], r["lm_loss"]] for r in records if r.get("lm_loss") is not None],
        val_loss=[[r["iteration"], r["val_loss"]] for r in records if r.get("val_loss") is not None])
    return write_result(out, result)


def _stop(proc: subprocess.Popen) -> tuple:
    """Ends a run past its time limit: SIGTERM to its process group (the launcher stops its workers),
    SIGKILL after 60 s; returns its (stdout, stderr)."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            return proc.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return "", ""


def svg(curves: dict, title: str) -> str:
    """Validation loss against iteration, one polyline per run (name -> [[iteration, loss], ...])."""
    points = [p for c in curves.values() for p in c]
    if not points:
        return "<svg xmlns='http://www.w3.org/2000/svg'/>"
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1e-3)
    w, h, m = 720, 420, 60
    sx = lambda x: m + (x - x0) / (x1 - x0) * (w - 2 * m)  # noqa: E731
    sy = lambda y: h - m - (y - y0) / (y1 - y0) * (h - 2 * m)  # noqa: E731
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-family='sans-serif' "
             f"font-size='12'>", f"<text x='{m}' y='24'>{title}</text>",
             f"<line x1='{m}' y1='{h - m}' x2='{w - m}' y2='{h - m}' stroke='black'/>",
             f"<line x1='{m}' y1='{m}' x2='{m}' y2='{h - m}' stroke='black'/>",
             f"<text x='{m}' y='{h - m + 18}'>{x0:g}</text><text x='{w - m - 30}' y='{h - m + 18}'>{x1:g}</text>",
             f"<text x='{w / 2 - 20}' y='{h - 20}'>iteration</text>",
             f"<text x='4' y='{h - m}'>{y0:.3f}</text><text x='4' y='{m + 4}'>{y1:.3f}</text>",
             f"<text x='4' y='{h / 2}'>val loss</text>"]
    for i, (name, curve) in enumerate(curves.items()):
        colour = colours[i % len(colours)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in curve)
        parts.append(f"<polyline fill='none' stroke='{colour}' stroke-width='1.5' points='{path}'/>")
        parts.append(f"<text x='{w - m - 200}' y='{m + 16 * i}' fill='{colour}'>{name}</text>")
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def compare(results: List[dict]) -> List[str]:
    """A line per run: its last validation loss and how far it is from the first run's at that iteration
    (a run stopped early is compared where it stopped)."""
    base = dict((it, loss) for it, loss in results[0]["val_loss"]) if results else {}
    lines = []
    for r in results:
        if not r["val_loss"]:
            lines.append(f"{r['name']}: no validation loss (exit {r['returncode']})")
            continue
        it, loss = r["val_loss"][-1]
        ref = base.get(it)
        rel = f", {100 * (loss - ref) / ref:+.2f}% against {results[0]['name']}" if ref else \
            f", {results[0]['name']} has no loss at iteration {it}"
        stopped = f" (stopped: {r['returncode']})" if r.get("returncode") not in (0, None) else ""
        lines.append(f"{r['name']}: validation loss {loss:.4f} at iteration {it}{rel}{stopped}")
    return lines


def _seed(result: dict) -> int:
    """The run's train.seed (its last override, else the config's default)."""
    seeds = [o.split("=", 1)[1] for o in result.get("overrides", []) if o.startswith("train.seed=")]
    return int(seeds[-1]) if seeds else TrainConfig().seed


def spread(results: List[dict]) -> List[str]:
    """Markdown lines: each format's last validation loss at every seed, its seed-to-seed range, and its
    difference from the first format's run of the same seed (the format: a run's overrides other than
    train.seed and those every run has; "-": none). Only runs that completed count; a format missing a seed
    is said so."""
    done = [r for r in results if r.get("returncode") == 0 and r.get("val_loss")]
    common = set.intersection(*(set(r.get("overrides", [])) for r in done)) if done else set()
    formats: dict = {}
    for r in done:
        fmt = " ".join(o for o in r.get("overrides", []) if not o.startswith("train.seed=") and o not in common) or "-"
        formats.setdefault(fmt, {})[_seed(r)] = r["val_loss"][-1]
    if not formats:
        return ["no completed run"]
    base = next(iter(formats.values()))
    seeds = sorted({s for runs in formats.values() for s in runs})
    lines = [f"| format | {' | '.join(f'seed {s}' for s in seeds)} | seed-to-seed range | against "
             f"the first, same seed (mean; min to max) |", "|---" * (len(seeds) + 3) + "|"]
    for fmt, runs in formats.items():
        losses = [runs[s][1] for s in seeds if s in runs]
        cells = [f"{runs[s][1]:.4f} (it {runs[s][0]})" if s in runs else "not run" for s in seeds]
        rng = f"{100 * (max(losses) - min(losses)) / (sum(losses) / len(losses)):.2f}%"
        diffs = [100 * (runs[s][1] - base[s][1]) / base[s][1] for s in seeds if s in runs and s in base
                 and runs[s][0] == base[s][0]]
        against = (f"{sum(diffs) / len(diffs):+.2f}%; {min(diffs):+.2f}% to {max(diffs):+.2f}%" if diffs
                   else "no run of the same seed and length")
        lines.append(f"| {fmt} | {' | '.join(cells)} | {rng} | {against} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.numerics", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="the corpus, its tokenizer and the prepared dataset")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    p.add_argument("--vocab-size", type=int, default=VOCAB)
    r = sub.add_parser("run", help="one training run, one result file")
    r.add_argument("--name", required=True)
    r.add_argument("--data", type=Path, required=True)
    r.add_argument("--iters", type=int, default=2000)
    r.add_argument("--size", default="125m")
    r.add_argument("--device", default="cuda")
    r.add_argument("--eval-interval", type=int, default=EVAL_INTERVAL)
    r.add_argument("--time-limit", type=float, default=None, help="seconds; past them the run is stopped and "
                   "its curves so far written")
    r.add_argument("--out", type=Path, default=Path(os.environ.get("ANGELGPT_BENCH_OUT", RESULTS)))
    r.add_argument("overrides", nargs="*")
    q = sub.add_parser("plot", help="the validation curves of result files, side by side")
    q.add_argument("files", nargs="+", type=Path)
    q.add_argument("--out", type=Path, required=True)
    d = sub.add_parser("spread", help="each format's last validation loss at every seed, and its seed-to-seed "
                       "range (a markdown table)")
    d.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    try:
        return _main(args)
    except BadInput as exc:
        print(f"numerics: {exc}", file=sys.stderr)
        return 2


def _result(path: Path) -> dict:
    """A result file of `run` (a JSON object with its name and validation curve), else BadInput."""
    if not path.is_file():
        raise BadInput(f"no result file {path}")
    try:
        result = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError):
        result = None
    if not isinstance(result, dict) or not {"name", "val_loss"} <= result.keys():
        raise BadInput(f"{path} is not a result file of `python -m benchmarks.numerics run`")
    return result


def _main(args) -> int:
    if args.cmd == "prepare":
        print(json.dumps(prepare(args.out, args.stdlib, args.vocab_size)))
    elif args.cmd == "run":
        path = run(args.name, args.data, args.iters, args.size, args.device, args.overrides, args.out,
                   args.eval_interval, args.time_limit)
        result = json.loads(path.read_text())
        print(f"{path}: " + compare([result])[0])
        return 0 if result["returncode"] == 0 else 1
    else:
        results = [_result(f) for f in args.files]
        if args.cmd == "spread":
            print("\n".join(spread(results)))
            return 0
        args.out.write_text(svg({r["name"]: r["val_loss"] for r in results}, "validation loss, same seed and batches"))
        print("\n".join(compare(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
