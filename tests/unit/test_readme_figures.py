"""docs/zero-cache-and-planner.md's figures that come from the planner are what it gives now: the table
of the reference node (each preset as shipped on 8x A100-40G with 1000 GiB host, as `angelgpt plan --size
NAME --machine a100-40gx8 --host-mem 1000` plans it, every system) and the activations at TP 1 beside
it. (The presets table, docs/presets.md: tests/unit/test_presets.py; the bytes a parameter:
tests/unit/test_zero_cache_precision.py.)"""

from angelgpt.config import parse
from angelgpt.model.flops import num_params
from angelgpt.planner import GIB, machine_from, plan
from angelgpt.planner.memory import activation_bytes
from tests.helpers import ROOT

DOC = (ROOT / "docs" / "zero-cache-and-planner.md").read_text()
REFERENCE = "## The planner beside the reference system's node"
SYSTEMS = ("zero_cache", "zero3_offload", "megatron", "megatron_cpu_offload")  # the table's column order
BOUND = {"compute": "compute", "cpu_optimizer": "the host update on the CPU", "pcie_h2d": "PCIe uploads",
         "pcie_d2h": "PCIe downloads", "network": "the network", "activation_offload": "the activation offload"}


def _section(title: str) -> str:
    start = DOC.index(title)
    end = DOC.find("\n#", start + len(title))
    return DOC[start:end if end > 0 else len(DOC)]


def _rows(text: str) -> list:
    """The table rows of `text`, each a list of its cells (header and rule left out)."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|")]
    return [r for r in rows[1:] if not set("".join(r)) <= set("-: ")]


def _layout(cfg) -> str:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    dp = 8 // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
    parts = [f"TP {p.tensor_model_parallel_size}"] + (["sequence parallelism"] if p.sequence_parallel else [])
    parts.append(f"{t.global_batch_size // (t.micro_batch_size * dp)} micro batches of {t.micro_batch_size} a step")
    if m.activation_offload == "checkpoints":
        zc = plan(cfg, _machine(), 8, 1)["zero_cache"]
        layers = m.recompute_num_layers or m.num_layers
        parts.append(f"the {layers} recomputed layers' inputs offloaded "
                     f"({zc.host_bytes['offloaded_activations'] / GIB:.2f} GiB per GPU to pinned host memory)")
    else:
        parts.append("kept inputs on the GPU")
    return ", ".join(parts)


def _cell(p) -> str:
    """A system's plan as the table words it."""
    gpu, host = p.gpu_total / GIB, p.host_total / GIB  # to 0.01, as `angelgpt plan` prints them
    if p.fits:
        offload = p.step_s.get("activation_offload", 0)
        return (f"fits: {gpu:.2f} GiB per GPU (margin +{p.margin['gpu'] / GIB:.2f} GiB), {host:.2f} GiB host per "
                f"node (+{p.margin['host'] / GIB:.2f} GiB); {p.step_time_s:.2f} s per step"
                + (f" ({offload:.2f} s of it the offload's PCIe copies)" if offload else "")
                + f", bound by {BOUND[p.bottleneck]}, {p.tflops_per_gpu:.0f} model TFLOP/s per GPU")
    short = ([f"{gpu:.2f} GiB per GPU"] if p.margin["gpu"] < 0 else []) + (
        [f"host short by {-p.margin['host'] / GIB:.2f} GiB ({host:.2f} GiB per node)"] if p.margin["host"] < 0
        else [])
    return "does not fit: " + ", ".join(short)


def _machine():
    return machine_from("a100-40gx8", host_mem_gib=1000)


def reference_rows() -> dict:
    """The reference-node table's rows as the planner gives them, by preset."""
    rows = {}
    for name in ("28", "55"):
        cfg = parse(name, None, [])
        plans = plan(cfg, _machine(), 8, 1)
        rows[name] = [f"{name} ({num_params(cfg) / 1e9:.2f}B): {_layout(cfg)}"] + [_cell(plans[s]) for s in SYSTEMS]
    return rows


def test_reference_node_table_is_the_planners():
    table = _section(REFERENCE)
    assert "`angelgpt plan --size 28 --machine a100-40gx8 --host-mem 1000`" in table
    header = _rows("| h |\n|---|\n" + "\n".join(line for line in table.splitlines() if line.startswith("| preset")))
    assert header == [["preset as shipped", "ZeRO-Cache", "ZeRO-3 offload", "Megatron's distributed optimizer",
                       "Megatron CPU offload"]]
    written = {row[0].split(" ")[0]: row for row in _rows(table)}
    for name, row in reference_rows().items():
        assert written.get(name) == row, f"docs/zero-cache-and-planner.md's reference-node row of {name}; the planner gives:\n" \
                                         f"| {' | '.join(row)} |"


def test_activations_at_tp_1_are_the_planners():
    """The reference micro batches' activations on one GPU (TP 1, no sequence parallelism), full recompute."""
    text = " ".join(_section(REFERENCE).split())
    figures = {}
    for name in ("28", "55"):
        cfg = parse(name, None, ["parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false"])
        m = cfg.model
        logits = m.seq_length * cfg.train.micro_batch_size * cfg.padded_vocab_size() * 6  # bf16 and fp32 copies
        figures[name] = (activation_bytes(cfg, True, False) / GIB, logits / GIB)
    (a28, l28), (a55, _) = figures["28"], figures["55"]
    sentence = (f"({a28:.1f} GiB a GPU for 28 with full recompute, {l28:.1f} of it the logits; {a55:.1f} GiB for "
                f"55)")
    assert sentence in text, sentence

