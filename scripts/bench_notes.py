"""The notes of BENCHMARKS.md (scripts/bench_report.py): each note a template whose every figure is
read from a result file by `Figures` and followed by that file's name in backticks.

The rule the test holds them to (tests/unit/test_bench_report.py): every number of a note outside code
spans appears in the first result file named after it. So a figure is written in the unit its file
holds (TFLOP/s, GiB, ms, fractions as fractions), a ratio of two files is left to the goal table, and
a claim no committed file holds is not made. A note names a case (a file's name without `.json`);
the newest run of that case fills it; a file's name with `.json` names that run of its case.
"""

from __future__ import annotations

import re
import statistics

# key: (pattern in the run's settings lines, the prediction's field otherwise, the type)
SETTLED = {"rate": (r"^zero_cache: prefetch_cache_sub_group_rate ([\d.]+)", "predicted.rate", 0.0),
           "device_update_fraction": (r"^zero_cache: .*device_update_fraction ([\d.]+)\)",
                                      "predicted.device_update_fraction", 0.0),
           "planned_step_s": (r"^plan: .*predicted ([\d.]+) s per step", "predicted.step_time_s", 0.0),
           "recomputed": (r"^model.recompute auto: full, the first (\d+) layers", None, 0)}
ALIASES = {"tflops": "tflops_per_gpu_median", "gpu": "peak_gpu_gib", "host": "peak_host_gib",
           "reserved": "peak_gpu_reserved_gib", "step_ms": "elapsed_ms_median"}


def value(r: dict, key: str):
    """One figure of a result file: a field (dotted for nested ones, a list's item by its index; aliases
    above), `arg:KEY` (the
    last value the command gave KEY), `profile.KEY` (median after warm-up of ZeRO-Cache's per-step
    profile), `log:REGEX` (its first group in the log's tail), `refused:gpu`/`refused:host` (what the
    planner found short), `rate`, `device_update_fraction`, `planned_step_s` and `recomputed` (how many
    layers recompute) as the run settled them, or as the planner predicted them in files that predate
    `settings`."""
    if key.startswith("arg:"):
        found = re.findall(rf"(?:^| ){re.escape(key[4:])}=(\S+)", r.get("command", ""))
        if not found:
            raise KeyError(key)
        return found[-1]
    if key.startswith("profile."):
        steady = [x["zero_cache_profile"] for x in r.get("records", [])[r.get("warmup_iters", 0):]
                  if x.get("zero_cache_profile")]
        return statistics.median(p[key[len("profile."):]] for p in steady)
    if key.startswith("log:"):
        return float(re.search(key[4:], r.get("log_tail", "")).group(1))
    if key.startswith("refused:"):
        return float(re.search(rf"{key[8:]} by ([\d.]+) GiB", r["refused"]).group(1))
    if key in SETTLED:  # what the run settled (its `settings` lines) where recorded, else the planner's
        for line in r.get("settings", []):
            found = re.search(SETTLED[key][0], line)
            if found:
                return type(SETTLED[key][2])(found.group(1))
        return value(r, SETTLED[key][1]) if key != "recomputed" else \
            int(re.search(r"first (\d+) layers", r["predicted"]["recompute"]).group(1))
    out = r
    for part in ALIASES.get(key, key).split("."):
        out = out[int(part)] if isinstance(out, list) else out[part]  # records.-1.lm_loss: the last record's
    return out


class Figures:
    """f(case, key, format) is a figure of the newest run of `case`; f.cite(case, ...) names the files
    the figures before it come from; f.layers(case) and f.mb(case) read the command."""

    def __init__(self, cases: dict):
        self.cases = cases  # {case: [(path, result), ...]}, oldest first

    def run(self, case: str):
        if case.endswith(".json"):  # that run of its case, not the newest
            found = [fr for fr in self.cases.get(re.sub(r"-run\d+$", "", case[:-5]), []) if fr[0].name == case]
            if not found:
                raise KeyError(case)
            return found[0]
        if case not in self.cases:
            raise KeyError(case)
        return self.cases[case][-1]

    def __call__(self, case: str, key: str, form: str = "{:.1f}") -> str:
        path, r = self.run(case)
        try:
            return form.format(value(r, key))
        except (LookupError, AttributeError, TypeError, ValueError, statistics.StatisticsError):
            raise KeyError(f"{key} in {path.name}") from None

    def layers(self, case: str) -> str:
        return self(case, "arg:model.num_layers", "{}")

    def mb(self, case: str) -> str:
        return self(case, "arg:train.micro_batch_size", "{}")

    def cite(self, *cases: str) -> str:
        return "(" + ", ".join(f"`{self.run(c)[0].name}`" for c in cases) + ")"


RATE = "arg:zero_cache.prefetch_cache_sub_group_rate"
PEAK_AT_TRAINING = r"training \(host peak ([\d.]+) GiB\)"
DS = "peers-deepspeed_zero3_offload-L{}-mb8-gb32{}"
DSO = "peers-deepspeed_zero{}_offload_opt-L{}-mb8-gb32"  # stage, layers
MEG7, ZC7 = "peers-megatron-L7-mb{}-gb32{}", "peers-zero_cache-L7-mb2-gb32-recomputenone"
MEG7R1 = "peers-megatron-L7-mb2-gb32-recomputenone.json"  # the first run of its case
B11 = "peers-megatron_cpu_offload-L11-mb{}-gb32{}"
ZC11 = "peers-zero_cache-L11-mb1-gb32-recomputenone{}"
ZC19 = "peers-zero_cache-L19-mb2-gb32{}"


def configurations(f) -> str:
    from scripts.bench_peers import LABEL, SYSTEMS

    said = "; ".join(f"{LABEL[s]}: " + ", ".join((["`scripts/bench_deepspeed.py`"] if s.startswith("deepspeed") else [])
                                                  + [f"`{o}`" for o in SYSTEMS[s]]) for s in SYSTEMS)
    return ("Configurations: every case is the `h200-16b` preset (the layer shape of the `55` preset, bf16, mock data) "
            "with `model.num_layers` set, trained by `angelgpt train` with the case's micro and global batch, "
            f"`optim.lr_warmup_iters=1` and these settings: {said}. The settings column of the runs table says "
            "what a case changed; each result file holds its exact command, and the config it was given.")


def deepspeed(f) -> str:
    L5, L6, L7, L7N, L8 = DS.format(5, ""), DS.format(6, ""), DS.format(7, ""), DS.format(7, "-recomputenone"), \
        DS.format(8, "")
    P6, P7, P8 = (f"deepspeed-L{n}-pinned-host-oom" for n in (6, 7, 8))
    return ("(c) DeepSpeed ZeRO-3 offload (`scripts/bench_deepspeed.py`, its CPU Adam built on the machine at "
            "first use) trains a plain PyTorch GPT of the same shapes, parameter count (tested against "
            "Megatron's GPTModel), initial scale and FLOP count, with parameters and optimizer states offloaded "
            "to CPU and DeepSpeed's default buckets and prefetch. With pinned host memory (DeepSpeed's default) "
            f"it fits {f.layers(L5)} layers at {f(L5, 'tflops')} TFLOP/s and {f(L5, 'host')} GiB host "
            f"{f.cite(L5)}; at {f.layers(P6)} layers its engine start-up alone reached "
            f"{f(P6, 'log:' + PEAK_AT_TRAINING)} GiB of host memory and the kernel's out-of-memory killer "
            f"stopped it in the first step {f.cite(P6)}, as it did one and two layers more {f.cite(P7, P8)}. "
            f"With pageable host memory (`pin_memory: false`) its whole {f.layers(L6)}-layer run peaked at "
            f"{f(L6, 'host')} GiB host and made {f(L6, 'tflops')} TFLOP/s {f.cite(L6)}, where ZeRO-Cache made "
            f"{f('peers-zero_cache-L6-mb4-gb32', 'tflops')} {f.cite('peers-zero_cache-L6-mb4-gb32')}; "
            f"{f.layers(L7)} layers made {f(L7, 'tflops')} with full recompute {f.cite(L7)} and "
            f"{f(L7N, 'tflops')} without, at {f(L7N, 'gpu')} GiB GPU and {f(L7N, 'host')} GiB host {f.cite(L7N)}: "
            "the parameters cross PCIe from pageable memory every micro batch, so recomputing costs it little. "
            f"{f.layers(L8)} layers ran out of host memory {f.cite(L8)}. These runs predate commit 81eaaa6, "
            "from which `scripts/bench_deepspeed.py` trains what angelgpt trains: Megatron's mock-dataset batches "
            "through angelgpt's data path (it had drawn uniform random tokens), angelgpt's LR schedule (the LR "
            "had stayed constant), biases and norms without weight decay, the loss over the loss mask and "
            "Megatron's fused QKV row order; so their losses are not comparable with angelgpt's: on random "
            f"tokens the {f.layers(L7)}-layer run ended at {f(L7, 'records.-1.lm_loss', '{:.2f}')} "
            f"{f.cite(L7)} where (a) ended at {f(MEG7R1, 'records.-1.lm_loss', '{:.2f}')} after as many steps "
            f"{f.cite(MEG7R1)}. DeepSpeed's two optimizer-offload configurations (ZeRO-Offload: the parameters "
            "on the GPU, the optimizer states and the update on the CPU, host buffers pinned), run after 81eaaa6 "
            "by `scripts/deepspeed_best.sh` in one device call: ZeRO-3 (`deepspeed_config=zero3_offload_opt`) "
            f"made {f(DSO.format(3, 7), 'tflops')} TFLOP/s at {f.layers(DSO.format(3, 7))} layers, "
            f"{f(DSO.format(3, 7), 'gpu')} GiB GPU and {f(DSO.format(3, 7), 'host')} GiB host, its loss going "
            f"from {f(DSO.format(3, 7), 'records.0.lm_loss', '{:.3f}')} to "
            f"{f(DSO.format(3, 7), 'records.-1.lm_loss', '{:.3f}')} over its "
            f"{f(DSO.format(3, 7), 'arg:train.train_iters', '{}')} steps {f.cite(DSO.format(3, 7))}, where (a)'s "
            f"went from {f(MEG7R1, 'records.0.lm_loss', '{:.3f}')} to {f(MEG7R1, 'records.-1.lm_loss', '{:.3f}')} "
            f"on the same batches and schedule {f.cite(MEG7R1)} (micro batches of 8 against 2, and another system's kernels "
            f"and sums); at {f.layers(DSO.format(3, 8))} layers its engine start-up reached "
            f"{f(DSO.format(3, 8), 'log:' + PEAK_AT_TRAINING)} GiB of host memory and it ran out of host memory "
            f"{f.cite(DSO.format(3, 8))}. ZeRO-2 (`deepspeed_config=zero2_offload_opt`) ran out of host memory "
            f"already at {f.layers(DSO.format(2, 7))} layers, its start-up at "
            f"{f(DSO.format(2, 7), 'log:' + PEAK_AT_TRAINING)} GiB {f.cite(DSO.format(2, 7))}.")


def recompute(f) -> str:
    A2, A1, A4 = MEG7.format(2, "-recomputenone"), MEG7.format(1, "-recomputenone"), MEG7.format(4, "")
    B1, B2 = B11.format(1, "-recomputenone"), B11.format(2, "")
    return ("Recompute and micro batch: every system may pick its micro batch and `model.recompute` (the "
            "preset recomputes every layer); the speed ratios take each side's fastest run at a size within "
            "the newest device call that has runs on both sides. "
            f"At {f.layers(A2)} layers (a) made {f(A2, 'tflops')} TFLOP/s at micro batch {f.mb(A2)} without "
            f"recompute {f.cite(A2)}, {f(A1, 'tflops')} at micro batch {f.mb(A1)} {f.cite(A1)} and "
            f"{f(A4, 'tflops')} recomputing every layer at micro batch {f.mb(A4)} {f.cite(A4)}; (d) made "
            f"{f(ZC7, 'tflops')} at micro batch {f.mb(ZC7)} without recompute {f.cite(ZC7)}. At {f.layers(B1)} "
            f"layers (b) made {f(B1, 'tflops')} at micro batch {f.mb(B1)} without recompute, offload fraction "
            f"{f(B1, 'arg:optim.offload_fraction', '{}')} {f.cite(B1)}, and {f(B2, 'tflops')} recomputing every "
            f"layer at micro batch {f.mb(B2)} {f.cite(B2)}.")


def megatron_cpu_offload(f) -> str:
    B2, F5 = B11.format(2, ""), "megatron_cpu_offload-L12-fraction0.5-gpu-oom"
    F6, F7, F10 = ("peers-megatron_cpu_offload-L12-mb2-gb32", "megatron_cpu_offload-L12-fraction0.7-host-oom",
                   "megatron_cpu_offload-L8-fraction1.0-host-oom")
    frac = lambda c: f(c, "arg:optim.offload_fraction", "{}")  # noqa: E731
    return ("(b) Megatron CPU offload keeps the fraction `optim.offload_fraction` of its optimizer states "
            f"and their update on the CPU. {f.layers(B2)} layers ran at fraction {frac(B2)} {f.cite(B2)}. At "
            f"{f.layers(F5)} layers it ran out of GPU memory while creating its GPU Adam states at fraction "
            f"{frac(F5)} {f.cite(F5)} and {frac(F6)} {f.cite(F6)}, and the kernel's out-of-memory killer "
            f"stopped it at {frac(F7)} {f.cite(F7)}, as it did {f.layers(F10)} layers at {frac(F10)} "
            f"{f.cite(F10)}: a larger fraction needs more host memory, a smaller one more GPU memory.")


def zero_cache_11(f) -> str:
    R78, R81, R79 = ZC11.format("-rate0.78"), "zero_cache-L11-rate0.81-allocator-retries", ZC11.format("-rate0.79")
    DEV, AUTO = ZC11.format("-devupdate0.45"), ZC11.format("") + ".json"
    return (f"(d) at {f.layers(AUTO)} layers without recompute, in runs that added up the micro batches' "
            "gradients in bf16 (before commit da83288), keeps the share "
            "`zero_cache.prefetch_cache_sub_group_rate` "
            "of the states on the GPU and updates the share `zero_cache.device_update_fraction` of the "
            "host-resident states on the GPU, the CPU the rest; the host update starts once backward has given "
            "the global norm (clipping needs it), so what shortens the wait for it is fewer host-resident "
            "parameters. While every released gradient was also held by the transfer stream, higher rates "
            f"made the caching allocator retry allocations every step: {f(R78, 'tflops')} TFLOP/s at rate "
            f"{f(R78, RATE, '{}')} with {f(R78, 'reserved')} GiB reserved {f.cite(R78)}, "
            f"{f(R81, 'tflops')} at the planner's {f(R81, 'rate', '{}')} with {f(R81, 'reserved')} GiB "
            "reserved "
            f"{f.cite(R81)}. With a gradient held only by the stream that reads it, rate "
            f"{f(R79, RATE, '{}')} made {f(R79, 'tflops')} with {f(R79, 'reserved')} GiB reserved "
            f"{f.cite(R79)}. With each host chunk's running sum brought up to its device slot while the layer's "
            f"backward runs and device_update_fraction {f(DEV, 'arg:zero_cache.device_update_fraction', '{}')} "
            f"it made {f(DEV, 'tflops')} {f.cite(DEV)}; with the planner's placement and split (rate "
            f"{f(AUTO, 'rate', '{}')}, device_update_fraction "
            f"{f(AUTO, 'device_update_fraction', '{}')}) {f(AUTO, 'tflops')}, the CPU's share of the "
            f"host update taking {f(AUTO, 'profile.update_thread_ms', '{:.0f}')} ms a step, the GPU's "
            f"{f(AUTO, 'profile.device_update_thread_ms', '{:.0f}')} ms, and the step waiting "
            f"{f(AUTO, 'profile.exposed_wait_update_ms', '{:.0f}')} ms for them {f.cite(AUTO)}.")


def zero_cache_19(f) -> str:
    AUTO, DEV, S56, S61 = (ZC19.format(s) for s in ("-recomputeauto.json", "-recomputeauto-devupdate0.45",
                                                     "-recomputeauto-split0.56", "-recomputeauto-split0.61"))
    FULL, PLAIN = ZC19.format("-recomputefull"), ZC19.format("")
    return (f"(d) at {f.layers(AUTO)} layers and global batch {f(AUTO, 'arg:train.global_batch_size', '{}')} "
            "with the micro batches' gradients added up in bf16, as every run before commit da83288 added them "
            "up and as the opt-out `optim.accumulate_grads_in_fp32=false` still does: "
            "the activations fit only with recompute"
            + (", and the micro batches' gradients accumulate in the store (`zero_cache.accumulate_in_store`), "
               "each host chunk's running sum going up to a device slot, getting the new gradients added and "
               "coming back down" if in_store(f.run(AUTO)[1]) else "")
            + ". With "
            f"`model.recompute=auto` the planner recomputes the first {f(AUTO, 'recomputed', '{}')} of "
            f"{f.layers(AUTO)} layers (Megatron's `block` recompute) and pays for the others' activations with "
            f"states moved to the host: at rate {f(AUTO, 'rate', '{}')} and "
            f"device_update_fraction {f(AUTO, 'device_update_fraction', '{}')} it made "
            f"{f(AUTO, 'tflops')} TFLOP/s, a "
            f"{f(AUTO, 'step_ms', '{:.0f}')} ms step (the planner expected "
            f"{f(AUTO, 'planned_step_s', '{:.2f}')} s) of which "
            f"{f(AUTO, 'profile.exposed_wait_update_ms', '{:.0f}')} ms waiting for the host update, the CPU's "
            f"share taking {f(AUTO, 'profile.update_thread_ms', '{:.0f}')} ms and the GPU's "
            f"{f(AUTO, 'profile.device_update_thread_ms', '{:.0f}')} ms {f.cite(AUTO)}. At commit "
            f"{f(DEV, 'commit', '{:.7}')}, device_update_fraction "
            f"{f(DEV, 'arg:zero_cache.device_update_fraction', '{}')} made {f(DEV, 'tflops')} {f.cite(DEV)} and "
            f"the planner's split then, {f(S56, 'device_update_fraction', '{}')}, "
            f"{f(S56, 'tflops')} {f.cite(S56)}. Before, with the one-pass CPU AdamW and device_update_fraction "
            f"{f(S61, 'device_update_fraction', '{}')}: {f(S61, 'tflops')} {f.cite(S61)}; recomputing "
            f"every layer: {f(FULL, 'tflops')} {f.cite(FULL)}; before `recompute=auto` and the one-pass CPU "
            f"AdamW: {f(PLAIN, 'tflops')} {f.cite(PLAIN)}.")


def in_store(r: dict) -> bool:
    """Whether a run accumulated its micro batches' gradients in ZeRO-Cache's store, as it settled it
    or, in files that predate `settings`, as given or planned."""
    said = [line for line in r.get("settings", []) if "accumulate_in_store" in line]
    if said:
        return "accumulate_in_store=true" in said[-1] or "accumulate_in_store True" in said[-1]
    return "zero_cache.accumulate_in_store=true" in r.get("command", "") or \
        (r.get("predicted") or {}).get("accumulate_in_store") is True


def largest(f) -> str:
    G2, Q, M2, M1 = ("peers-zero_cache-L20-mb2-gb2", "zero_cache-L20-gb2-one-hardware-queue",
                     "peers-zero_cache-L20-mb2-gb32", "peers-zero_cache-L20-mb1-gb32")
    earlier = [("every host state updated by the CPU", "accumulate-L19-cpu-update"),
               ("the sums added by the CPU", "accumulate-L19-host-add"),
               ("the host layers' weights offloaded too", "accumulate-L19-offloaded-weights"),
               ("device updates with two accumulation slots", "device-update-L19-two-slots")]
    W = "zero_cache-L12-fetched-weights"
    return (f"(d) at {f.layers(G2)} layers trains one micro batch per step: the host layers' weights are "
            "offloaded then, so their states are updated by the CPU (device updates write weights in place on "
            f"the GPU), and the step waits {f(G2, 'profile.exposed_wait_update_ms', '{:.0f}')} ms of its "
            f"{f(G2, 'step_ms', '{:.0f}')} ms for that update, at {f(G2, 'tflops')} TFLOP/s {f.cite(G2)}; "
            f"{f(Q, 'tflops')} with one CUDA hardware queue {f.cite(Q)}. At global batch "
            f"{f(M2, 'arg:train.global_batch_size', '{}')} with bf16 sums, {f.layers(M2)} layers were refused "
            "before launch: "
            f"the planner's closest placement was short of {f(M2, 'refused:gpu')} GiB GPU and "
            f"{f(M2, 'refused:host')} GiB host memory at micro batch {f.mb(M2)} {f.cite(M2)}, of "
            f"{f(M1, 'refused:gpu')} and {f(M1, 'refused:host')} GiB at micro batch {f.mb(M1)} {f.cite(M1)}: "
            "accumulating in the store needs every parameter's bf16 weight and gradient and fp32 master weight "
            "and moments in GPU or host memory, beside activations, workspace, gradients in flight and the "
            "accumulation slots. Earlier versions of the 19-layer run: "
            + ", ".join(f"{what} {f(c, 'tflops')} {f.cite(c)}" for what, c in earlier)
            + f"; and {f.layers(W)} layers with offloaded weights fetched every micro batch, "
              f"{f(W, 'tflops')} {f.cite(W)}.")


def fp32_sums(f) -> str:
    A, D7, B, D11 = (MEG7.format(2, "-recomputenone"), ZC7, B11.format(1, "-recomputenone"),
                     ZC11.format(""))
    OLD, R19, D16 = ZC11.format("") + ".json", ZC19.format("-recomputeauto"), "peers-zero_cache-L16-mb2-gb32-recomputeauto"
    return ("The goal runs with fp32 sums (`optim.accumulate_grads_in_fp32`, the default since commit da83288) "
            f"come from one device call, `{f(D16, 'call', '{}')}`, at commit {f(D16, 'commit', '{:.7}')}: at "
            f"{f.layers(A)} layers (a) made {f(A, 'tflops')} TFLOP/s {f.cite(A)} and (d) {f(D7, 'tflops')} "
            f"{f.cite(D7)}; at {f.layers(B)} layers (b) made {f(B, 'tflops')} {f.cite(B)} and (d) "
            f"{f(D11, 'tflops')}, the planner keeping the share {f(D11, 'rate', '{}')} of the states on the GPU, "
            f"so that the CPU's share of the host update took {f(D11, 'profile.update_thread_ms', '{:.0f}')} ms a "
            f"step, the GPU's {f(D11, 'profile.device_update_thread_ms', '{:.0f}')} ms, and the step waited "
            f"{f(D11, 'profile.exposed_wait_update_ms', '{:.0f}')} ms for them, at {f(D11, 'host')} GiB host "
            f"{f.cite(D11)}, where with bf16 sums it had kept {f(OLD, 'rate', '{}')} on the GPU and waited "
            f"{f(OLD, 'profile.exposed_wait_update_ms', '{:.0f}')} ms at {f(OLD, 'host')} GiB host {f.cite(OLD)}. At {f.layers(R19)} layers and global batch "
            f"{f(R19, 'arg:train.global_batch_size', '{}')} the planner refused (d) before launch, short of "
            f"{f(R19, 'refused:gpu')} GiB GPU and {f(R19, 'refused:host')} GiB host memory {f.cite(R19)}; at "
            f"{f.layers(D16)} layers, recomputing the first {f(D16, 'recomputed', '{}')} at rate "
            f"{f(D16, 'rate', '{}')}, it made {f(D16, 'tflops')} TFLOP/s, a {f(D16, 'step_ms', '{:.0f}')} ms step "
            f"(the planner then expected {f(D16, 'planned_step_s', '{:.2f}')} s; since commit 13f5c71 it counts "
            "the fp32 sums' round trips at the rate the two PCIe directions share), "
            f"{f(D16, 'gpu')} GiB GPU and {f(D16, 'host')} GiB host at peak {f.cite(D16)}. That run ran in the "
            "next command on the same held machine, not in the same command: it carries the call of the runs "
            "before it and the same machine and boot, so the goal table takes it as the same call. (a) at "
            f"{f.layers('peers-megatron-L8-mb2-gb32')} layers was refused at micro batch "
            f"{f.mb('peers-megatron-L8-mb2-gb32')}, short of {f('peers-megatron-L8-mb2-gb32', 'refused:gpu')} GiB "
            f"GPU {f.cite('peers-megatron-L8-mb2-gb32')}, and at micro batch {f.mb('peers-megatron-L8-mb1-gb32')} "
            f"{f.cite('peers-megatron-L8-mb1-gb32')}.")


def hardware_queues(f) -> str:
    pairs = [("device-update-L19-one-hardware-queue", ZC19.format("")),
             ("device-update-L11-one-hardware-queue", "peers-zero_cache-L11-mb2-gb32"),
             ("device-update-L12-one-hardware-queue", "peers-zero_cache-L12-mb2-gb32")]
    return ("(d) runs before commit 4e6d409 used one CUDA hardware queue (`CUDA_DEVICE_MAX_CONNECTIONS=1`, "
            "Megatron's setting, which the launcher now keeps for Megatron's optimizers only): every wait of "
            "ZeRO-Cache's transfer streams then held up the compute kernels queued behind it. Runs with one "
            "queue against the same case with several: "
            + "; ".join(f"{f.layers(one)} layers {f(one, 'tflops')} TFLOP/s {f.cite(one)} against "
                        f"{f(many, 'tflops')} {f.cite(many)}" for one, many in pairs) + ".")


def nvme(f) -> str:
    N = "peers-zero_cache_nvme-L24-mb2-gb2"
    return (f"(e) ZeRO-Cache with the NVMe tier (`zero_cache.nvme_path` on the machine's local disk): "
            f"{f.layers(N)} layers at rate {f(N, 'rate', '{:.2f}')} (`auto`) completed "
            f"{f(N, 'arg:train.train_iters', '{}')} steps at global batch {f(N, 'arg:train.global_batch_size', '{}')}, "
            f"{f(N, 'host')} GiB host and {f(N, 'gpu')} GiB GPU at peak, a {f(N, 'step_ms', '{:.0f}')} ms step "
            f"and {f(N, 'tflops')} TFLOP/s. The step is the NVMe tier's: "
            f"{f(N, 'profile.nvme_gb')} GB read and written a step, and the step waiting "
            f"{f(N, 'profile.exposed_wait_update_ms', '{:.0f}')} ms for the update {f.cite(N)}.")


def losses(f) -> str:
    return ("Losses: runs before commit d0edda7 on the GPU logged the loss divided by the number of micro "
            "batches (Megatron's schedule scales the loss it back-propagates in place, and the logged value "
            "shared its storage); gradients, throughput and memory were not affected.")


def profile(f) -> str:
    return ("The profile's round-trip time runs from when a round trip is queued on the H2D stream, so it "
            "includes that stream's wait for the gradients of the layer still in backward; it is not PCIe "
            "time. The slot wait is the backward thread's wait on the CPU, not idle GPU time.")


NOTES = [configurations, deepspeed, recompute, fp32_sums, megatron_cpu_offload, zero_cache_11, zero_cache_19,
         largest, hardware_queues, nvme, losses, profile]
