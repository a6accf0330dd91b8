"""The planner's text: what ``zerojax plan`` and ``zerojax estimate --table1`` print.

The layers run one way (issue 32): :mod:`zerojax.analysis.cost`,
:mod:`~zerojax.analysis.memory` and :mod:`~zerojax.analysis.report` say what a
configuration costs (time, bytes, the step's peak); :mod:`zerojax.analysis.plan`
searches the configurations and picks the recommendation, returning dataclasses
(:class:`~zerojax.analysis.plan.Plan`, :class:`~zerojax.analysis.plan.ModelPlan`,
:class:`~zerojax.analysis.plan.DeviceMemory`); this module, on top, turns them into
tables and sentences. Nothing below imports it.

    from zerojax.analysis.plan import plan_model
    from zerojax.cli.plan_text import format_model_plan
    print(format_model_plan(plan_model("llama2-7b", devices=8, budget_bytes=59 * 10**9,
                                       seq=2048, batch=8)))
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from zerojax.analysis.plan import (
    STAGE_NAMES,
    DeviceMemory,
    ExpertPlan,
    ModelPlan,
    ModelShape,
    Plan,
    PlanRow,
    SeqPlan,
    Table1Row,
    paper_table1,
)

__all__ = ["NOT_COUNTED", "describe_shape", "format_expert_plan", "format_memory",
           "format_model_plan",
           "format_plan", "format_seq_plan", "format_table1", "human", "recommendation",
           "size_columns", "table1"]

GB = 1e9  # the paper's GB

NOT_COUNTED = ("not counted: XLA temporaries beyond the terms above (fusion buffers), "
               "allocator fragmentation beyond --runtime-reserve (use --reserve). "
               "Checked against compiled steps on CPU (benchmarks/memory_model.py): the "
               "reference GPT within 10% on 48 of 48 cells, 6 shapes x stages 0-3 x fp32 "
               "and bf16 (0.94-1.08 on jax 0.10.2, 0.92-1.06 on jax 0.12.0.1; on jax "
               "0.12.1 37 of 48, 0.78-1.06: its XLA:CPU fuses the softmax, one s^2 "
               "buffer fewer than counted, over-predicting fp32 cells at long "
               "sequences); zerojax's "
               "Llama (the llama presets' shape) within 10% on 24 of 24 fp32 cells, bf16 "
               "over-predicted up to 1.47x (benchmarks/llama_memory.py); the "
               "flash-attention terms are not checked (the CPU has no cuDNN)")


# --- cells ------------------------------------------------------------------------------


def human(n: float) -> str:
    """A count with three significant figures and a unit: 6.74B, 128B, 1T."""
    if n == math.inf:
        return "unbounded"
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


SIZE_UNITS = (("GB", GB), ("MB", 1e6), ("KB", 1e3), ("bytes", 1.0))


def _column_unit(values: Sequence[float | None]) -> tuple[str, float]:
    """The one unit of a size column: GB (1e9 bytes, the paper's) when its largest value
    is at least 0.01 GB (or all are 0), else the largest of MB, KB, bytes (decimal) in
    which it is at least 1."""
    top = max((abs(v) for v in values if v), default=0.0)
    if top == 0 or top >= 0.01 * GB:
        return SIZE_UNITS[0]
    return next(u for u in SIZE_UNITS[1:] if top >= u[1] or u[0] == "bytes")


def _size_cell(n: float | None, scale: float) -> str:
    """``n`` bytes in a column of ``scale`` bytes per unit: two decimals; three
    significant figures below 0.01 units (0.00123, never an exponent); below 1e-4 units
    (a 4-byte scalar in a GB column) in its own unit, named: '4 bytes', '6.65 KB';
    '-' for nothing."""
    if n is None:
        return "-"
    if n == 0:
        return "0"
    x = n / scale
    if scale == 1.0:
        return f"{x:,.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    if abs(x) >= 0.01:
        return f"{x:,.2f}"
    if abs(x) >= 1e-4:
        return f"{x:.{2 - math.floor(math.log10(abs(x)))}f}"
    unit, own = _column_unit([n])
    return f"{_size_cell(n, own)} {unit}"


def size_columns(header: list[str], rows: list[list], columns: Sequence[int]) -> None:
    """Format the size columns of a table in place: each of ``columns`` (indices; its
    cells bytes or None) gets one unit, from its largest value, named in its heading
    (``params`` -> ``params (GB)``, or ``(MB)`` / ``(KB)`` / ``(bytes)`` for a column of
    small sizes; a 4-byte optimizer state reads ``4`` there, or ``4 bytes`` in a column
    of GB, not ``4e-09``)."""
    for i in columns:
        unit, scale = _column_unit([r[i] for r in rows])
        header[i] = f"{header[i]} ({unit})"
        for r in rows:
            r[i] = _size_cell(r[i], scale)


def _size(n: float) -> str:
    """A size in a sentence, with its unit: GB from 0.01 GB, MiB from 0.01 MiB, bytes
    below."""
    if n == 0:
        return "0 GB"
    if abs(n) >= 0.01 * GB:
        return f"{n / GB:,.2f} GB"
    return f"{n / 2**20:,.2f} MiB" if abs(n) >= 0.01 * 2**20 else f"{n:.3g} bytes"


def _ms(seconds: float) -> str:
    """A step time in ms: whole from 10 ms, three significant figures below."""
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 10 else f"{ms:.3g}"


def _time(r: PlanRow) -> str:
    """A row's predicted step: seconds and tokens/s."""
    return f"{_ms(r.step_time)} ms/step, {r.tokens_per_s:,.0f} tokens/s"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


# --- the memory a JAX process gets, a model's shape ---------------------------------------


def format_memory(m: DeviceMemory) -> str:
    """One line: the card, the fraction JAX takes (and where it came from), the runtime
    reserve, what the plan fills."""
    alloc = ("preallocated" if m.preallocate else
             "preallocation off (XLA_PYTHON_CLIENT_PREALLOCATE=false): grown on demand "
             "up to the same fraction")
    return (f"memory per device: {_size(m.card)} card x {m.fraction:g} "
            f"({m.fraction_source}; {alloc}) - {_size(m.runtime_reserve)} runtime "
            f"reserve (CUDA/NCCL/cuBLAS workspaces; --runtime-reserve) = "
            f"{_size(m.usable)} planned")


def describe_shape(s: ModelShape) -> str:
    """``gpt2-1.5b: 48 layers x hidden 1600, 25 heads, vocab 50304, ...``."""
    out = ((f"{s.name}: " if s.name else "")
           + f"{s.layers} layers x hidden {s.hidden}, {s.heads} heads")
    if s.kv_heads not in (None, s.heads):
        out += f" ({s.kv_heads} key-value)"
    if s.head_dim is not None:
        out += f" of width {s.head_dim}"
    if s.experts:
        out += (f", {s.experts} experts (top-{s.experts_per_token}) of SwiGLU "
                f"{s.moe_hidden or s.mlp_hidden}"
                + (f" + a shared expert of {s.shared_expert_hidden}"
                   if s.shared_expert_hidden else "")
                + ("" if s.capacity_factor is None else
                   f", capacity factor {s.capacity_factor:g}"))
    elif not s.gpt_shaped or s.mlp_hidden is not None:
        f = s.mlp_hidden if s.mlp_hidden is not None else s.mlp_ratio * s.hidden
        out += f", {'SwiGLU' if s.gated else 'GELU'} MLP {f}"
    out += f", vocab {s.vocab}"
    if not s.tied:
        out += ", untied head"
    if s.positions == 0:
        out += ", rotary positions"
    elif s.positions is not None:
        out += f", {s.positions} learned positions"
    if s.norm == "rmsnorm":
        out += ", RMSNorm"
    if not s.bias:
        out += ", no biases"
    if s.vocab_tiles:
        out += f", LM head in {s.vocab_tiles} tiles"
    return out


# --- the paper's formula: zerojax.plan(num_params, dp=, budget_bytes=) ---------------------


def format_plan(p: Plan) -> str:
    """A readable table of ``p`` (GB = 1e9 bytes, as the paper)."""
    head = (f"plan: budget {p.budget_bytes / GB:,.2f} GB per device, N = {p.dp} data-parallel"
            + (f", M = {p.mp} model-parallel" if p.mp > 1 else "")
            + f"; bytes per parameter {p.param_bytes:.4g} + {p.grad_bytes:.4g} + "
            f"{p.optimizer_bytes:.4g}"
            + (f"; Psi = {human(p.num_params)} ({p.num_params:,})"
               if p.num_params is not None else ""))
    header = ["stage", "params", "grads", "optim", "act+buf", "total", "fits", "comm/step",
              "comm", "largest model"]
    rows = []
    for s in p.stages:
        m = s.model_states
        rows.append([
            f"{s.stage} {s.name}",
            m.params if m else None, m.grads if m else None,
            m.optimizer_state if m else None, s.activations + s.buffers + s.reserve,
            s.total, "-" if s.fits is None else ("yes" if s.fits else "no"),
            "-" if s.comm_elements is None else f"{3 if s.stage == 3 else 2} Psi",
            s.comm_bytes, human(s.max_params)])
    size_columns(header, rows, (1, 2, 3, 4, 5, 8))
    out = head + "\n" + _table(header, rows)
    out += ("\n(total = params + grads + optim + act+buf: the paper's model states, each "
            "whole for the step, plus --activations, one --bucket-size buffer and "
            "--reserve; largest model: the Psi whose total fills the budget)")
    if p.note:
        out += f"\n({p.note})"
    return out


def format_table1(rows: Sequence[Table1Row] | None = None) -> str:
    """``paper_table1()`` as a text table, numbers rounded as the paper prints them."""
    rows = paper_table1() if rows is None else rows
    keys = list(rows[0].gb) if rows else []
    header = ["DP"] + [f"{name} {STAGE_NAMES[s]}" for name, s in keys]
    body = [[str(r.dp)] + [_paper_round(r.gb[k]) for k in keys] for r in rows]
    return ("Table 1 (Rajbhandari et al., SC20): model-state GB per device, mixed-precision "
            "Adam (2 + 2 + 12 bytes per parameter)\n" + _table(header, body)
            + "\n(printed as computed, 3 significant figures, half to even, whole GB from "
            "1000 GB; the paper prints the same below 100 GB but for 41.25, which it "
            "rounds up to 41.3 (here 41.2), and from 100 GB it truncates: 4187 for "
            "4187.5, 257 for 257.75)")


def table1() -> str:
    """The text of ``format_table1(paper_table1())``."""
    return format_table1(paper_table1())


def _paper_round(gb: float) -> str:
    """Three significant figures, whole numbers from 1000 (52.5, 0.469, 4188: the paper
    prints 0.47 and truncates 4187.5 to 4187)."""
    if gb >= 1000:
        return f"{gb:.0f}"
    return f"{gb:.3g}"


# --- the question as asked: plan_model ------------------------------------------------------


def recommendation(p: ModelPlan) -> str:
    """The recommendation and why: the fastest fitting row, its time, traffic, peak and
    headroom, the memory-leanest beside it; or, when nothing fits, the smallest row's
    needs and what to change."""
    best, leanest, budget = p.recommendation, p.leanest, p.budget_bytes
    if best is not None:
        fitting = p.fitting
        others = len(fitting) - 1
        accel = p.accelerator.name if p.accelerator is not None else "the accelerator"
        return (f"{best.label}: the fastest of the {len(fitting)} option set(s) that "
                f"fit on {accel}, {_time(best)} ({_size(best.traffic_bytes)} over "
                + ("the data x seq axes (ZeRO spans both)" if p.seq_parallel > 1
                   else "the data axis")
                + (f" + {_size(best.alltoall_bytes)} of all-to-alls over seq"
                   if best.alltoall_bytes else "")
                + (f" + {_size(best.host_traffic_bytes)} to and from host memory"
                   if best.host_traffic_bytes else "")
                + (f", its {_size(best.disk_bytes)} per node read and written on disk"
                   if best.nvme else "")
                + f"), peak {_size(best.peak)} of {_size(budget)} per device, "
                f"{_size(budget - best.peak)} ({(budget - best.peak) / budget:.0%}) headroom"
                + (f"; the memory-leanest: {leanest.label}, peak {_size(leanest.peak)}, "
                   f"{_time(leanest)}" if leanest is not best else
                   "; it is also the memory-leanest")
                + (f"; {others} other(s) fit" if others else ""))
    least = p.smallest
    return (f"nothing fits: the smallest, {least.label}, needs {_size(least.peak)} "
            f"per device of {_size(budget)}"
            + (f" and {_size(least.host_bytes)} of host memory per node of "
               f"{_size(p.host_memory_bytes)}" if not least.host_fits else "")
            + (f" and {_size(least.disk_bytes)} of disk per node of "
               f"{_size(p.disk_bytes)}" if not least.disk_fits else "")
            + f"; add devices, shorten --seq or --batch-per-device (activations "
            f"{_size(least.activations)}), or use a smaller model")


def format_model_plan(p: ModelPlan, memory_note: str = "") -> str:
    """A readable table of ``p`` (GB = 1e9 bytes): the setting, one row per option set
    with the peak by part, fits, traffic, host memory and the predicted step, how the
    columns make the peak, the largest models and hierarchical rows when planned, the
    recommendation. ``memory_note``: printed with the setting (where ``budget_bytes``
    came from: :func:`format_memory`, the host memory's source)."""
    import jax.numpy as jnp

    precision = "fp32" if p.param_dtype is None else jnp.dtype(p.param_dtype).name
    out = "\n".join(_plan_head(p, memory_note, precision)) + "\n"
    table, nvme = _plan_table(p)
    out += table + _plan_columns(p, nvme) + _plan_assumptions(p)
    if p.largest:
        out += "\n\nlargest model that fits (layers = L, hidden = 128 L family):\n"
        out += _table(["option set", "layers", "hidden", "heads", "Psi"],
                      [[label, str(s.layers) if s else "-", str(s.hidden) if s else "-",
                        str(s.heads) if s else "-", human(psi) if s else "none"]
                       for label, s, psi in p.largest])
    if p.links:
        out += _plan_links(p, precision)
    out += f"\n\nrecommendation: {recommendation(p)}\n({NOT_COUNTED})"
    return out


def _plan_head(p: ModelPlan, memory_note: str, precision: str) -> list[str]:
    """The model plan's setting: the mesh and memory, the model, its attention."""
    nodes = ""
    if p.devices_per_node:
        n_nodes = -(-p.devices // p.devices_per_node)
        nodes = (f" ({n_nodes} node(s) of {p.devices_per_node}"
                 + ("; every step's data-axis traffic crosses the network)" if n_nodes > 1
                    else "; all traffic within the node)"))
    sp = p.seq_parallel
    data = (f"{p.devices // sp} data x {sp} seq" if sp > 1 else f"{p.devices} data")
    x = p.expert_parallel
    if x > 1:
        data = f"{p.devices // x} data x {x} expert"
    mesh = (f"{data} x {p.mp} model = {p.devices * p.mp} devices" if p.mp > 1
            else f"{data} = {p.devices} devices" if sp > 1 or x > 1
            else f"{p.devices} devices")
    extra = "".join(f", {k}={v!r}" for k, v in p.options.items())
    head = [f"plan: {mesh} x {_size(p.budget_bytes)} usable{nodes}, seq {p.seq}"
            + (f" ({p.seq // sp} tokens a device)" if sp > 1 else "")
            + f", batch {p.batch} per data shard, optimizer {p.optimizer}, params in "
            f"{precision} (fp32 master weights and optimizer state){extra}"]
    if p.shape is not None:
        head.append(f"model: {describe_shape(p.shape)}; Psi = {human(p.num_params)} "
                    f"({p.num_params:,})" + (f"\n({p.note})" if p.note else ""))
        from zerojax.analysis.report import flash_attention

        flash = flash_attention(p.shape.config(p.seq, p.param_dtype, p.attention))
        head.append(f"attention: {p.attention}: " + (
            "cuDNN flash attention on a CUDA GPU (no s x s scores in memory)" if flash
            else "blockwise (pure JAX, blocks of 128 queries and keys: no s x s scores in "
            "memory)" if p.attention == "blockwise"
            else "explicit, float32 s x s scores materialised per layer being recomputed"))
    if memory_note:
        head.append(memory_note)
    return head


def _plan_table(p: ModelPlan) -> tuple[str, bool]:
    """The model plan's rows (one per option set), and whether an =nvme row is
    among them."""
    header = ["option set", "step (ms)", "tokens/s", "params", "grads", "optim", "act",
              "other", "peak", "fits", "traffic", "host", "host/node"]
    nvme = any(r.nvme for r in p.rows)
    if nvme:
        header.append("disk/node")
    rows = []
    for r in p.rows:
        s = r.states
        other = r.peak - s.params - s.optimizer_state - r.activations
        fits = "yes" if r.fits else ("no" if r.peak > p.budget_bytes else
                                     "no: host" if not r.host_fits else "no: disk")
        rows.append([r.label, _ms(r.step_time) if r.time else "-",
                     f"{r.tokens_per_s:,.0f}" if r.time else "-",
                     s.params, s.grads, s.optimizer_state, r.activations, other, r.peak,
                     fits, r.traffic_bytes, r.host_traffic_bytes, r.host_bytes]
                    + ([r.disk_bytes if r.nvme else None] if nvme else []))
    size_columns(header, rows, [3, 4, 5, 6, 7, 8, 10, 11, 12] + ([13] if nvme else []))
    return _table(header, rows), nvme


def _plan_columns(p: ModelPlan, nvme: bool) -> str:
    """How the columns make the peak: what each holds, host and disk."""
    host_note = (f"host memory {_size(p.host_memory_bytes)} per node, "
                 f"{p.node_devices} devices per node" if p.host_memory_bytes is not None
                 else "host memory not checked")
    disk_note = ""
    if nvme:
        read, write = p.disk_bandwidth or (
            (p.accelerator.disk_read_bw, p.accelerator.disk_write_bw)
            if p.accelerator is not None else (float("nan"),) * 2)
        disk_note = (
            "; =nvme rows (ZeRO-Infinity's NVMe tier): the optimizer state and fp32 master "
            "weights (+ offload_params=nvme: and the param shards, fetched to the device "
            "as the host rows fetch them) in files on the node's disk, disk/node (the node's "
            f"{p.node_devices} devices' shards; "
            + (f"disk {_size(p.disk_bytes)} per node, 'no: disk' beyond it"
               if p.disk_bytes is not None else "disk not checked: --disk") + "), "
            "host/node only their buffers, nvme_buffer_count x nvme_buffer_size per "
            "process (one process per device counted; with the per-layer fetch the param "
            "shards read from disk too); their device work the host rows' (the same "
            "buckets); their step adds the state read "
            f"once at {read / GB:.1f} GB/s and written once at {write / GB:.1f} GB/s per "
            "node" + (" (--disk-bandwidth)" if p.disk_bandwidth else
                      " (one local NVMe SSD; a RAID of k drives: --disk-bandwidth)")
            + ", overlapped with the PCIe transfers: max(PCIe, disk)")
    return ("\n(peak = params + optim + act + other; grads is not added in: the gradient's "
            "bytes at the peak are inside other. params/optim: what init_state places on "
            "the device; grads: the gradient handed to the update; other: gradients in "
            "flight, working copies, the offloaded update's two buckets of bucket_size "
            "state, the batch and --reserve at the step's peak (+ offload_params: the "
            "param shards the step fetches: the leaves outside the scan and two layers' "
            "shards, or every shard with param_fetch=whole); offload_gradients: each "
            "gradient shard streamed to host memory in the backward (grads then in host "
            "memory, not on the device); host: bytes over PCIe per step (the state in and "
            "out, the streamed gradients out and back, the fetched params: per-layer "
            "fetch twice per micro-batch); host/node: the pinned host memory the node's "
            f"offloaded state and streamed gradients take ({host_note}); 'no: host': fits "
            f"the device, not the host{disk_note})")


def _plan_assumptions(p: ModelPlan) -> str:
    """What the step times assume (the accelerator preset), and Ulysses' all-to-alls."""
    out, sp = "", p.seq_parallel
    if p.accelerator is not None:
        a = p.accelerator
        out += (f"\n(step, tokens/s: predicted for {a.name} by zerojax.analysis.cost: "
                f"tokens x (6 Psi + 12 L h s) x remat at {a.peak_flops / 1e12:.0f} TFLOP/s "
                f"x {a.achievable:.1%} achievable, collectives at {a.intra_bw / GB:.0f} GB/s "
                f"in a node and {a.inter_bw / GB:.2f} GB/s across nodes per device, hidden "
                "under compute as the stage allows, offload at "
                f"{a.pcie_bw / GB:.0f} GB/s PCIe each way (the streamed gradients under "
                "the backward; the fetches, as measured, and the update's transfers after "
                "the backward, in then out, exposed); tokens/s of the whole job)")
    if sp > 1:
        a2a = p.rows[0].alltoall_bytes
        out += (f"\n(sequence parallel, Ulysses over {sp} devices (arXiv:2309.14509): "
                f"activations of seq / {sp} tokens a device, the attention on whole "
                f"sequences for heads / {sp}; traffic is ZeRO's over all {p.devices} "
                f"devices; the all-to-alls of q, k, v and the attention output add "
                f"{_size(a2a)} per device per step (4 per layer forward, (P - 1) / P "
                "of each; x 2 with the backward, x 3 with full remat), in the step time: "
                "zerojax.analysis.report.ulysses_bytes)")
    return out


def _plan_links(p: ModelPlan, precision: str) -> str:
    """The hierarchical rows: peak and traffic by link, at stage 3."""
    import jax.numpy as jnp

    unit = p.num_params * jnp.dtype(p.param_dtype or jnp.float32).itemsize
    out = (f"\n\nhierarchical sharding at stage 3: the step's peak and the traffic by "
           f"link, per device per step "
           f"({p.devices // p.devices_per_node} nodes x {p.devices_per_node}; "
           "zerojax.analysis.plan.link_traffic; Psi: the params' bytes in "
           f"{precision}):\n")
    peaks = {r.label: r for r in p.link_rows}
    header = ["option set", "peak", "fits", "inside a node", "across nodes",
              "inside (Psi)", "across (Psi)", "step (ms)"]
    rows = [[label, peaks[label].peak if label in peaks else None,
             ("yes" if peaks[label].fits else "no") if label in peaks else "-",
             inside, across, f"{inside / unit:.3f}", f"{across / unit:.3f}",
             _ms(peaks[label].step_time) if label in peaks and peaks[label].time
             else "-"] for label, inside, across in p.links]
    size_columns(header, rows, (1, 3, 4))
    out += _table(header, rows)
    out += ("\n(qwZ int8: 1 byte + a 4-byte scale per 2048 elements; qgZ int4: zero()'s "
            "default, block 256 + stochastic rounding, half a byte + a 4-byte scale per "
            "256 (1/8 + 1/256 of fp32's bytes); measured loss cost on the demo's "
            "char-level task (benchmarks/README.md, 'ZeRO++ convergence', 3 seeds, 1,000 "
            "steps): held-out +0.008 nats against exact stage 3, int8's level "
            "(block 2048 + round-to-nearest: 1/8 + 1/2048 of the bytes, +0.063))")
    return out


def format_seq_plan(p: SeqPlan, memory_note: str = "",
                    published: dict | None = None) -> str:
    """The longest sequence per option set (:func:`~zerojax.analysis.plan.largest_seq`):
    the setting, one row per option set with the sequence, its peak by part and its
    host memory per node, and ``published`` (``{devices: tokens}``, e.g. ALST's) beside
    the longest when it names this device count."""
    sp = p.seq_parallel
    zero = ", ".join([f"stage {p.stage}"] + [f"{k}={v!r}" for k, v in p.zero_options.items()])
    mesh = (f"{p.devices // sp} data x {sp} seq" + (f" x {p.mp} model" if p.mp > 1 else ""))
    head = [f"longest sequence: {describe_shape(p.shape)}",
            f"on {p.devices * p.mp} devices ({mesh}) x {_size(p.budget_bytes)} usable, "
            f"{p.batch} sequence(s) per data rank, {zero}; searched in steps of {p.unit:,} "
            f"tokens; tiles of {p.tile_tokens:,} tokens"]
    if memory_note:
        head.append(memory_note)
    rows = []
    for r in p.rows:
        row = r.row
        if row is None:
            rows.append([r.label, "none", "-", None, None, None, None, None, None])
            continue
        other = row.peak - row.states.params - row.states.optimizer_state - row.activations
        seq = f"{r.seq:,}" + (" (limit)" if r.capped else "")
        rows.append([r.label, seq, f"{r.seq // sp:,}",
                     row.states.params + row.states.optimizer_state, row.activations,
                     other, row.peak, row.host_bytes, row.alltoall_bytes])
    header = ["option set", "longest seq", "tokens/device", "states", "act", "other",
              "peak", "host/node", "all-to-all"]
    size_columns(header, rows, (3, 4, 5, 6, 7, 8))
    out = "\n".join(head) + "\n" + _table(header, rows)
    host = (f"host memory {_size(p.host_memory_bytes)} per node" if p.host_memory_bytes
            else "host memory not checked")
    out += ("\n(tiled MLP: the MLP's intermediates for one tile of the device's tokens "
            "(ALST's TiledMLP); tiled loss: one tile's float32 logits (vocab_tiles); "
            "checkpoints on host: every layer's checkpoint in pinned host memory, one "
            "layer's working set on the device (remat_policy='partitioned_host'); "
            f"host/node: the node's offloaded state and checkpoints ({host}); all-to-all: "
            "Ulysses' bytes per device per step; peak = states + act + other)")
    if published and p.devices * p.mp in published:
        best = p.longest
        theirs = published[p.devices * p.mp]
        out += (f"\npublished (ALST, arXiv:2506.13996, Llama-8B on {p.devices * p.mp} "
                f"H100s): {theirs:,} tokens; planned here: {best.seq:,} "
                f"({best.seq / theirs:.2f}x)")
    return out


# --- a mixture of experts: zerojax.plan_experts -------------------------------------------


def format_expert_plan(p: ExpertPlan, memory_note: str = "") -> str:
    """A readable table of ``p`` (GB = 1e9 bytes): the setting, the model's total and
    active params, a row per expert degree X and stage (experts and their states per
    device, the peak, fits, ZeRO's traffic, the all-to-alls, the predicted step), the
    buffer convention and the recommendation."""
    import jax.numpy as jnp

    first = p.plans[0]
    precision = "fp32" if first.param_dtype is None else jnp.dtype(first.param_dtype).name
    c = p.shape.counts(p.seq)
    accel = first.accelerator.name if first.accelerator is not None else "the accelerator"
    out = [f"plan: {p.devices} devices (data x expert) x {_size(p.budget_bytes)} usable, "
           f"seq {p.seq}, batch {p.batch} per device, optimizer {first.optimizer}, params "
           f"in {precision} (fp32 master weights and optimizer state), on {accel}",
           f"model: {describe_shape(p.shape)}; Psi = {human(c.total)} total ({c.total:,}), "
           f"{human(c.active)} active a token, {human(c.expert)} in the routed experts"]
    if memory_note:
        out.append(memory_note)
    header = ["X", "data", "option set", "experts/device", "states", "peak", "fits",
              "ZeRO traffic", "all-to-all", "ms/step", "tokens/s"]
    rows = [[str(r.expert_parallel), str(p.devices // r.expert_parallel), r.label,
             str(p.shape.experts // r.expert_parallel), r.states.total, r.peak,
             "yes" if r.fits else "no", r.traffic_bytes, r.expert_alltoall_bytes,
             _ms(r.step_time), f"{r.tokens_per_s:,.0f}"] for r in p.rows]
    size_columns(header, rows, (4, 5, 7, 8))
    out.append(_table(header, rows))
    out.append("X: the expert axis (each device E / X experts, their states ZeRO-split over "
               "the data devices that hold them; the dense states over data x expert). "
               "all-to-all: the experts' dispatch and combine a device sends per step "
               "(dropless: each destination's block sized for the worst case, every "
               "token's k rows, static shapes: zerojax.analysis.cost.moe_all_to_all_bytes)")
    best = p.recommendation
    if best is not None:
        leanest = p.leanest
        out.append(f"\nrecommendation: X = {best.expert_parallel}, {best.label}: the "
                   f"fastest fitting row, {_time(best)}, peak {_size(best.peak)} of "
                   f"{_size(p.budget_bytes)}"
                   + (f"; the memory-leanest: X = {leanest.expert_parallel}, "
                      f"{leanest.label}, peak {_size(leanest.peak)}, {_time(leanest)}"
                      if leanest is not best else "; it is also the memory-leanest"))
    else:
        least = min(p.rows, key=lambda r: r.peak)
        out.append(f"\nrecommendation: nothing fits: the smallest, X = "
                   f"{least.expert_parallel}, {least.label}, needs {_size(least.peak)} per "
                   f"device of {_size(p.budget_bytes)} (model states "
                   f"{_size(least.states.total)}); add devices, shorten --seq or "
                   "--batch-per-device, or plan one X with the offload rows "
                   "(--expert-parallel X)")
    out.append(f"({NOT_COUNTED})")
    return "\n".join(out)
