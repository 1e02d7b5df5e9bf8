"""angelgpt's benchmarks: the code behind benchmarks/results/*.json and BENCHMARKS.md.

Run from the repository root (this package is not part of the angelgpt wheel; pyproject's package
find takes angelgpt* only). The commands are `python scripts/bench_X.py ...`, thin wrappers, or the
modules themselves:

    results          one writer of result files (NAME.json, a run again NAME-runN.json, never
                     overwritten; with the command, commit, machine and device call) and their reading
    train            python -m benchmarks.train: one `angelgpt train` run, one result file
    deepspeed_peer   python -m benchmarks.deepspeed_peer: peer (c), the same GPT trained by DeepSpeed
    systems          the peers' systems (overrides, labels), shared by the runner and the report
    peers            python -m benchmarks.peers run|report: the side-by-side runner
    figures          one figure of a result file, for the notes of BENCHMARKS.md
    report           python -m benchmarks.report: BENCHMARKS.md from BENCHMARKS.md.template, and peers.png

Imports go one way (tests/unit/test_bench_package.py checks it): results and systems import nothing
of the package; figures imports results; train imports results; report imports results, systems and
figures; peers imports results, systems and report (its `report` command).
"""
