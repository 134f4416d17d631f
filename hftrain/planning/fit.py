"""How a recipe fits the memory at hand, and what its run takes in time and money: `hftrain plan`'s advice,
and `parallelism.fit_memory: true` in `hftrain train`.

The fit keeps the recipe's global batch (micro-batch x accumulation x processes) and searches, fastest first:
strategy (DDP before FSDP before ZeRO-3; CPU offload last), gradient checkpointing off before on (it recomputes
the forward: about a third more compute), then the largest micro-batch that divides each process's share of the
global batch; the evaluation batch is capped at the micro-batch (its logits are often the larger peak). A choice fits
when its predicted peak (memory.py) leaves MARGIN of the device's memory free.

A layout that cannot fit is told apart from one that might: the calibration's errors are (predicted - measured) /
measured, within PLAN_ERROR, so a peak predicted at P is measured at P / (1 + PLAN_ERROR) or more. When that is
still over the process's whole memory (not the margin-reduced limit), the run would certainly run out of memory:
`train` refuses it before it loads anything, with the numbers and what would fit (parallelism.memory_check: warn
trains anyway). Between the limit and that bound is a near miss: warned, and trained.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hftrain.errors import HftrainError
from hftrain.parallel.batch import BatchPart, global_batch
from hftrain.planning.memory import GB, PeakPrediction, RunShape, library_footprint, predict_peak, run_shape
from hftrain.planning.part import PlanPart

MARGIN = 0.10  # of each device's memory kept free: allocator fragmentation, and what the prediction leaves out
# The prediction's error bound, (predicted - measured) / measured: at worst 11.6% over the CPU calibration grid's 14
# configurations, within 0.4% on a GPU (docs/planning.md, Calibration). A peak predicted over the whole memory by
# more than this is a certain out-of-memory (certain_oom).
PLAN_ERROR = 0.12
INSIST = "parallelism.memory_check: warn"  # the recipe key that trains anyway
SEQ_STEP = 128  # what_would_fit's data.seq_len: a multiple of this
GPU_MFU = (
    0.35  # assumed when nothing was measured: large-model training reaches 21-46% (PaLM, arXiv 2204.02311, Table 3)
)
# assumed on a CPU before a run of the recipe measured it (pythia-160m steps here: 0.39-0.65 of the measured matmul
# peak, docs/planning.md)
CPU_MFU = 0.50
GPU_STRATEGIES = ("ddp", "fsdp", "zero3", "zero3_offload")


@dataclass(frozen=True)
class Machine:
    """Where the recipe would run: data-parallel processes of one device kind, and the memory of each."""

    device: str  # cpu | cuda
    processes: int
    memory_per_process: float  # bytes
    description: str


@dataclass
class Fit:
    shape: RunShape
    accumulation: int
    peak: PeakPrediction
    limit: float  # bytes a process may use: its memory less the margin
    reason: str

    @property
    def fits(self) -> bool:
        return self.peak.total <= self.limit


def gpus(count: int, memory_gb: float) -> Machine:
    return Machine("cuda", count, memory_gb * GB, f"{count} x {memory_gb:g} GB GPU{'s' if count > 1 else ''}")


def this_machine(processes: int = 1) -> Machine:
    """The machine at hand: its GPUs when torch sees any, else its RAM shared by `processes` CPU processes."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        count = torch.cuda.device_count()
        return Machine(
            "cuda", count, float(props.total_memory), f"{count} x {props.name} ({props.total_memory / GB:.0f} GB)"
        )
    import psutil

    total = float(psutil.virtual_memory().total)
    what = f"this CPU machine ({total / GB:.0f} GB RAM" + (
        f", shared by {processes} processes)" if processes > 1 else ")"
    )
    return Machine("cpu", processes, total / processes, what)


def as_configured(
    part: PlanPart, info: dict[str, Any], machine: Machine, strategy: str | None = None, libraries: float | None = None
) -> Fit:
    """The recipe's own micro-batch and checkpointing on `machine`."""
    shape = run_shape(part, machine.device, machine.processes, strategy)
    share = global_batch(part.batch, machine.processes) // machine.processes
    peak = predict_peak(part, info, shape, libraries)
    return Fit(
        shape, max(share // shape.micro_batch, 1), peak, machine.memory_per_process * (1 - MARGIN), "as the recipe says"
    )


def choose(
    part: PlanPart,
    info: dict[str, Any],
    machine: Machine,
    libraries: float | None = None,
    strategy: str | None = None,
    total: int | None = None,
) -> Fit:
    """The fastest layout that fits with MARGIN to spare (under `strategy` only, when given: a launched run's);
    if none does, the smallest one, with the reason. `total`: the run's global batch (parallel/dims.py), else the
    recipe's on `machine`."""
    share, rest = divmod(total or global_batch(part.batch, machine.processes), machine.processes)
    share = max(share, 1)
    micro = [m for m in range(share, 0, -1) if share % m == 0]
    strategies = (
        ("single",) if machine.processes == 1 else GPU_STRATEGIES if machine.device == "cuda" else ("ddp", "fsdp")
    )
    strategies = (strategy,) if strategy else strategies
    order = [(s, False) for s in strategies if s != "zero3_offload"] + [
        (s, True) for s in strategies if s != "zero3_offload"
    ]
    order += [(s, c) for s in strategies if s == "zero3_offload" for c in (False, True)]
    limit = machine.memory_per_process * (1 - MARGIN)
    tried: list[Fit] = []
    for strategy, checkpointing in order:
        bigger: Fit | None = None
        for m in micro:
            shape = run_shape(
                part,
                machine.device,
                machine.processes,
                strategy,
                micro_batch=m,
                checkpointing=checkpointing,
                eval_batch=min(m, part.batch.eval_batch),
            )
            fit = Fit(shape, share // m, predict_peak(part, info, shape, libraries), limit, "")
            if fit.fits:
                fit.reason = _reason(fit, machine, bigger, tried, rest)
                return fit
            bigger = fit
            tried.append(fit)
    smallest = min(tried, key=lambda f: f.peak.total)
    smallest.reason = (
        f"nothing fits: the smallest layout ({_describe(smallest)}) needs {smallest.peak.total / GB:,.1f} GB per "
        f"process, over {limit / GB:,.1f} GB; more devices, LoRA/QLoRA or a shorter data.seq_len would"
    )
    return smallest


def _describe(fit: Fit) -> str:
    s = fit.shape
    return (
        f"{s.strategy}, micro-batch {s.micro_batch} x accumulation {fit.accumulation}, gradient checkpointing "
        f"{'on' if s.checkpointing else 'off'}, evaluation batch {s.eval_batch}"
    )


def _reason(fit: Fit, machine: Machine, bigger: Fit | None, tried: list[Fit], rest: int) -> str:
    why = [
        f"{_describe(fit)}: predicted peak {fit.peak.total / GB:,.2f} GB per process, within {fit.limit / GB:,.1f} GB "
        f"({machine.memory_per_process / GB:,.1f} GB less a {MARGIN:.0%} margin)"
    ]
    if bigger is not None:
        why.append(f"micro-batch {bigger.shape.micro_batch} would need {bigger.peak.total / GB:,.2f} GB")
    faster = [
        f for f in tried if f.shape.strategy != fit.shape.strategy or f.shape.checkpointing != fit.shape.checkpointing
    ]
    if faster:
        best = min(faster, key=lambda f: f.peak.total)
        why.append(f"no faster layout fits ({_describe(best)} needs {best.peak.total / GB:,.2f} GB)")
    if rest:
        why.append(
            f"the global batch does not divide over {machine.processes} "
            f"processes: {rest} sequences are dropped per step"
        )
    return "; ".join(why)


def certain_oom(fit: Fit, machine: Machine) -> bool:
    """Whether `fit` runs out of memory even where the prediction over-estimates by the most PLAN_ERROR allows: its
    predicted peak P is over the process's whole memory M (not the margin-reduced limit) by more than the error,
    P > M x (1 + PLAN_ERROR), so the measured peak, P / (1 + PLAN_ERROR) or more, is over M too. A layout over the
    limit but not over this bound is a near miss: it may fit."""
    return fit.peak.total > machine.memory_per_process * (1 + PLAN_ERROR)


def what_would_fit(
    part: PlanPart, info: dict[str, Any], machine: Machine, smallest: Fit, libraries: float | None = None
) -> str:
    """Where nothing fits, what would, each predicted (memory.py) at micro-batch 1, with or without gradient
    checkpointing, with one thing changed: the largest data.seq_len, an adapter (for a model with trained weights to
    start from), more GPUs of this memory under FSDP or ZeRO-3; and always the memory a process would need."""
    memory, limit = part, smallest.limit
    base = replace(smallest.shape, micro_batch=1, eval_batch=1)

    def lowest(m: PlanPart, shape: RunShape) -> float:
        return min(predict_peak(m, info, replace(shape, checkpointing=c), libraries).total for c in (False, True))

    found = []
    # data.seq_len in multiples of SEQ_STEP below the recipe's
    best, low, high = (None, 1, (base.seq_len - 1) // SEQ_STEP)
    while low <= high:  # the largest that fits (the peak grows with it)
        k = (low + high) // 2
        need = lowest(
            replace(memory, data=memory.data.model_copy(update={"seq_len": k * SEQ_STEP})),
            replace(base, seq_len=k * SEQ_STEP),
        )
        if need <= limit:
            best, low = (k * SEQ_STEP, need), k + 1
        else:
            high = k - 1
    if best:
        found.append(f"data.seq_len: {best[0]} ({gb(best[1])})")
    if memory.finetune.method == "full" and part.model.model.from_pretrained:
        for method in ("lora", "qlora"):
            need = lowest(_with_method(memory, method), base)
            if need <= limit:
                found.append(f"finetune.method: {method} ({gb(need)})")
                break
    if machine.device == "cuda":  # sharded over more GPUs (CPU processes share one machine's RAM: no help there)
        for count in (2**k for k in range(1, 11) if 2**k > machine.processes):
            need = lowest(memory, replace(base, processes=count, strategy="fsdp"))
            if need <= limit:
                found.append(f"{count} GPUs of this memory under FSDP or ZeRO-3 ({gb(need)} each)")
                break
    found.append(
        f"a process with {gb(smallest.peak.total / (1 - MARGIN))} of "
        f"memory (the smallest layout with the {MARGIN:.0%} margin free)"
    )
    return "what would fit: " + "; or ".join(found)


def gb(n: float) -> str:
    """Bytes as the refusals print them: GB with two decimals below 10 GB, one above."""
    return f"{n / GB:,.2f} GB" if n < 10 * GB else f"{n / GB:,.1f} GB"


def _with_method(memory: PlanPart, method: str) -> PlanPart:
    return replace(memory, finetune=memory.finetune.model_copy(update={"method": method}))


def _certainly_over(machine: Machine) -> str:
    return (
        f"over the {gb(machine.memory_per_process)} a process has on {machine.description} by more than the "
        f"plan's {PLAN_ERROR:.0%} error (docs/planning.md): it would run out of memory"
    )


def step_time(info: dict[str, Any], fit: Fit, peak_flops: float, mfu: float) -> float:
    """Seconds per optimizer step: the FLOPs of each process's share of the global batch at `mfu` of `peak_flops`
    (gradient checkpointing recomputes the forward: 8/6 of the work)."""
    tokens = fit.shape.micro_batch * fit.accumulation * fit.shape.seq_len
    work = info["train_flops_per_token"] * tokens * (8 / 6 if fit.shape.checkpointing else 1.0)
    return work / (peak_flops * mfu)


def fit_this_run(
    part: PlanPart, info: dict[str, Any], processes: int, local_processes: int, strategy: str, device: str, total: int
) -> tuple[BatchPart, str | None]:
    """The batch `train` runs: with parallelism.fit_memory, plan's micro-batch and gradient checkpointing at the
    run's global batch `total` (parallel/dims.py), and the line that says so; otherwise the recipe's own batch, and a
    warning when its micro-batch will not fit. `strategy`: the launched one (single, ddp, fsdp, zero3). A layout that
    would certainly run out of memory (certain_oom: the recipe's own, or with fit_memory the smallest) is an
    HftrainError with the numbers and what would fit, unless parallelism.memory_check is warn; with fit_memory, a
    smallest layout that does not fit is trained with a warning (a near miss, or insisted on)."""
    batch = part.batch
    if device == "cuda":
        import torch

        mem = float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
        machine = Machine("cuda", processes, mem, f"{torch.cuda.get_device_name()} ({mem / GB:.0f} GB)")
    else:
        here = this_machine(local_processes)
        machine = Machine("cpu", processes, here.memory_per_process, here.description)
    libraries = library_footprint() if device == "cpu" else None
    configured = as_configured(part, info, machine, strategy, libraries)
    refuse = batch.memory_check == "refuse"
    if not batch.fit_memory:
        if configured.fits:
            return batch, None
        chosen = choose(part, info, machine, libraries, strategy)
        needs = (
            f"training.per_device_train_batch_size={configured.shape.micro_batch} with gradient checkpointing "
            f"{'on' if configured.shape.checkpointing else 'off'} needs about {configured.peak.total / GB:,.2f} GB per "
            f"process (predicted peak, at the {configured.peak.phase})"
        )
        if certain_oom(configured, machine) and refuse:
            raise HftrainError(
                f"{needs}, {_certainly_over(machine)}. {_instead(part, info, machine, chosen, libraries)}"
            )
        advice = f"parallelism.fit_memory: true would take {_describe(chosen)}" if chosen.fits else chosen.reason
        warning = (
            f"warning: {needs}, more than the {configured.limit / GB:,.1f} GB usable on {machine.description}; "
            f"`hftrain plan` shows where it goes. {advice}."
        )
        if certain_oom(configured, machine):
            warning += f" It is {_certainly_over(machine)}; training anyway, as {INSIST} says."
        return batch, warning
    chosen = choose(part, info, machine, libraries, strategy, total)
    if not chosen.fits:
        if certain_oom(chosen, machine) and refuse:
            raise HftrainError(
                f"parallelism.fit_memory: nothing fits: the smallest layout ({_describe(chosen)}) needs "
                f"{gb(chosen.peak.total)} per process, {_certainly_over(machine)}; "
                f"{what_would_fit(part, info, machine, chosen, libraries)}. To try anyway: {INSIST}."
            )
        why = (
            f"as {INSIST} says"
            if certain_oom(chosen, machine)
            else f"within the plan's {PLAN_ERROR:.0%} error of the {gb(machine.memory_per_process)} a process has"
        )
        return _fitted(
            batch, chosen, total
        ), f"warning: parallelism.fit_memory: {chosen.reason}; training with that smallest layout, {why}"
    return _fitted(batch, chosen, total), f"memory fit (parallelism.fit_memory): {chosen.reason}"


def _instead(part: PlanPart, info: dict[str, Any], machine: Machine, chosen: Fit, libraries: float | None) -> str:
    """What to do about a recipe's own micro-batch that certainly will not fit: the layout that does, the smallest
    one when it is a near miss, or what would fit when nothing on this machine does."""
    if chosen.fits:
        keys = f"training.per_device_train_batch_size: {chosen.shape.micro_batch}, "
        keys += f"training.gradient_accumulation_steps: {chosen.accumulation}"
        keys += ", training.gradient_checkpointing: true" if chosen.shape.checkpointing else ""
        advice = (
            f"parallelism.fit_memory: true would take {_describe(chosen)} ({gb(chosen.peak.total)}), keeping the "
            f"global batch ({keys})"
        )
    elif not certain_oom(chosen, machine):
        advice = (
            f"Nothing fits within the {MARGIN:.0%} margin; parallelism.fit_memory: true would take the smallest layout "
            f"({_describe(chosen)}: {gb(chosen.peak.total)}), within the plan's error: it may fit"
        )
    else:
        advice = (
            f"Nor would the smallest layout ({_describe(chosen)}: {gb(chosen.peak.total)}); "
            f"{what_would_fit(part, info, machine, chosen, libraries)}"
        )
    return f"{advice}. `hftrain plan` shows where the memory goes; to train as the recipe says anyway: {INSIST}."


def _fitted(batch: BatchPart, chosen: Fit, total: int) -> BatchPart:
    """The recipe's batch with `chosen`'s micro-batch, accumulation and checkpointing at the global batch `total`."""
    return replace(
        batch,
        global_batch_size=total,
        micro_batch=chosen.shape.micro_batch,
        eval_batch=min(chosen.shape.micro_batch, batch.eval_batch),
        accumulation=chosen.accumulation,
        accumulation_given=True,
        gradient_checkpointing=chosen.shape.checkpointing,
    )
