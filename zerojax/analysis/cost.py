"""What a configuration costs in time: a stated model of one train step.

The planner's lowest time layer (memory.py and report.py give the bytes, this module
the seconds; plan.py searches and recommends above both, the CLI prints on top). One
step of a configuration is predicted as::

    compute  = FLOPs / (peak x achievable)
    FLOPs    = tokens x (6 Psi + 12 L h s) x remat factor     (per device: / mp)
    comm     = bytes inside a node / intra_bw + bytes across nodes / inter_bw
               (x devices per node for one ring over every device: its NIC hops
               carry one device's volume; HSDP/hpZ's per-device shards share them)
               (+ Megatron's activation all-reduces when mp > 1, inside the node)
    exposed  = the part of comm the stage cannot hide under compute
    PCIe     = offload's transfers (:class:`PcieTraffic`), each direction at
               pcie_bw (full duplex where the program lets the two directions run
               at once: the streamed gradients beside the fetches; not the update's):
      under    = the streamed gradients (device to host, under the backward;
                 offload_gradients) and, where they overlap compute, the per-layer
                 param fetches (host to device; 2 x accum_steps x the shards):
                 max(fetch, gradients) / pcie_bw
      host     = what nothing hides: the fetches that do not overlap (the
                 whole-shard fetch at the step's start; the per-layer fetch too, as
                 measured: plan.FETCH_OVERLAPS_COMPUTE), a global norm's second pass
                 over host gradients, and the update's (state in with the
                 gradients, state out with the new params, after the backward; no
                 delayed update): fetch / pcie_bw + (update in + update out) / pcie_bw.
                 The update's two directions do not overlap: on one H200 the 1.28B
                 GPT's whole-leaf offloaded update added 612 ms at 64K tokens
                 (benchmarks/README.md, issue 50), 15.4 GB each way: 0.56 s one after
                 the other at 55 GB/s, 0.28 s overlapped; and in place a piece's read
                 waits for the write before it (tiers/offload.py, IN_PLACE)
    disk     = NVMe tier (offload_optimizer="nvme"): the node's state (with
               offload_params="nvme" its param shards too) read once and written
               once per step, read / disk_read_bw + write / disk_write_bw (one disk
               serves both), overlapped with the buckets' PCIe transfers
    step     = max(compute, under) + exposed + max(host, disk)

``6 Psi`` per token is the forward (2 Psi) and backward (4 Psi) matmuls; ``12 L h s``
the attention's two ``s x s`` matmuls (``QK^T`` and ``AV``: 4 s h per token and layer
forward, x 3 with the backward; Kaplan et al. 2020, the PaLM paper's appendix B).
The remat factor is 4/3 with full rematerialisation (``remat=True``, policy
``"full"``: a second forward), 1 without or with ``"dots"``/``"projections"`` (the
matmuls are kept; the elementwise recompute is not counted).

Overlap, as zerojax's stages allow it (XLA's latency-hiding scheduler runs a
collective beside independent compute): stage 0's all-reduce and stages 1-2's
gradient reduce-scatter run under the backward (the backward is 2/3 of the step's
FLOPs, 3/4 with full remat); stages 1-2's all-gather of the updated parameters comes
after the optimizer and is exposed; stage 3's gathers are prefetched (the next
layer's under this layer's compute) and its reduce-scatter runs under the backward,
so all of its traffic may hide under the whole step's compute. Tensor parallelism's
all-reduces sit on the critical path (exposed). ``overlap=False`` exposes all (the
planner passes it for stage 3 with ``prefetch=False``). Not modelled: bucket sizes,
collective latency (bandwidth only), small-GEMM efficiency, the host's optimizer
compute under offload (only its PCIe transfers), the update's device arithmetic
(bandwidth-bound: hidden under its own transfers), several GPUs sharing a PCIe
switch (each device is given its own x16 link at ``pcie_bw``).

The disk bandwidths (per node, bytes/s) default to one local PCIe Gen4 NVMe SSD:
the Samsung PM1733 datasheet's 7.0 GB/s sequential read and 3.8 GB/s sequential
write (DGX A100's data drives), assumed 6 and 3.5 GB/s reachable, on every preset
(a node's RAID-0 of several drives is faster: ``disk_bandwidth=`` / ``zerojax plan
--disk-bandwidth``; not checked against a measured NVMe run: benchmarks/README.md's
NVMe figures are this machine's page-cached disk).

The ``achievable`` fraction of each preset is a measured model-FLOPs utilisation
(MFU) of a dense transformer on that accelerator, from the source stated with it;
the link bandwidths are the bus bandwidths a ring collective reaches (nominal per
direction, as stated). ``benchmarks/published_runs.py`` checks the model against
published runs (table in benchmarks/README.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["ACCELERATORS", "Accelerator", "PcieTraffic", "StepTime", "accelerator",
           "link_traffic", "model_flops", "moe_all_to_all_bytes", "step_time"]


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One accelerator and the links of the node it sits in (bytes/s per device, one
    direction; FLOP/s dense bf16/fp16)."""

    name: str
    peak_flops: float  # dense bf16 (fp16 tensor core on V100) FLOP/s
    achievable: float  # measured MFU of a dense transformer: the fraction of peak reached
    intra_bw: float  # per device inside a node (NVLink / NVSwitch / ICI), bytes/s
    inter_bw: float  # per device between nodes (the node's NICs / its devices), bytes/s
    pcie_bw: float  # device <-> host, bytes/s
    per_node: int  # devices per node (a TPU slice's ICI domain)
    memory: float  # bytes per device (the card)
    source: str = ""
    disk_read_bw: float = 6e9  # per node: local NVMe, bytes/s (the module's docstring)
    disk_write_bw: float = 3.5e9

    @property
    def rate(self) -> float:
        """The achievable FLOP/s: peak x achievable."""
        return self.peak_flops * self.achievable

    def replace(self, **kw) -> Accelerator:
        return dataclasses.replace(self, **kw)


ACCELERATORS = {
    "h100": Accelerator(
        "H100 SXM", 989e12, 0.447, 450e9, 50e9, 55e9, 8, 80e9,
        "peak: NVIDIA H100 datasheet (989 TFLOP/s dense bf16); achievable 44.7%: MFU "
        "measured on one H100 for zerojax's 1.28B GPT, cuDNN attention, batch 8 x 1024, "
        "remat dots (benchmarks/gpu.py); NVLink 4: 900 GB/s bidirectional = 450 per "
        "direction; network: 8 x 400 Gb/s NDR InfiniBand per DGX H100 node = 50 GB/s per "
        "GPU; PCIe Gen5 x16: 64 GB/s nominal, 55 assumed reachable"),
    "a100": Accelerator(
        "A100 SXM", 312e12, 0.50, 300e9, 25e9, 25e9, 8, 80e9,
        "peak: NVIDIA A100 datasheet (312 TFLOP/s dense bf16); achievable 50%: "
        "Megatron-LM (Narayanan et al., SC21) reaches 44-52% of peak on 1.7B-1T GPTs; "
        "NVLink 3: 600 GB/s bidirectional = 300 per direction; network: 8 x 200 Gb/s HDR "
        "per DGX A100 = 25 GB/s per GPU; PCIe Gen4 x16: 32 GB/s nominal, 25 assumed reachable"),
    "v100": Accelerator(
        "V100 SXM3 (DGX-2)", 125e12, 0.30, 150e9, 6.25e9, 12e9, 16, 32e9,
        "peak: NVIDIA V100 datasheet (125 TFLOP/s fp16 tensor core); achievable 30%: "
        "Megatron-LM (Shoeybi et al. 2019) sustains 39 TFLOP/s = 30% of peak on one "
        "V100 (1.2B GPT); NVSwitch: 300 GB/s bidirectional = 150 per direction; "
        "network: the ZeRO paper's DGX-2 cluster, 800 Gb/s per node of 16 = 6.25 GB/s "
        "per GPU; PCIe Gen3 x16: 16 GB/s nominal, 12 assumed reachable"),
    "tpu-v5e": Accelerator(
        "TPU v5e", 197e12, 0.55, 200e9, 6.25e9, 16e9, 256, 16e9,
        "peak: Google Cloud TPU v5e spec (197 TFLOP/s bf16, 1600 Gb/s ICI = 200 GB/s "
        "per chip); achievable 55%: MaxText's v5e table (MaxText/configs/v5e/README.md: "
        "46-67% MFU, 16B-128B on 1-32 v5e-256 slices, 56-61% for 16B and 128B on one "
        "slice); a 256-chip slice is one ICI domain; between slices the DCN, "
        "assumed 50 Gb/s per chip = 6.25 GB/s (not sourced); PCIe Gen4 x16 to the host"),
}
ACCELERATORS["h200"] = ACCELERATORS["h100"].replace(
    name="H200 SXM", memory=141e9,
    source="as H100 (same GH100 compute and NVLink 4); 141 GB HBM3e")


def accelerator(name: str | Accelerator) -> Accelerator:
    """A preset by name (``ACCELERATORS``: h100, h200, a100, v100, tpu-v5e), or the
    given :class:`Accelerator`."""
    if isinstance(name, Accelerator):
        return name
    key = str(name).lower().replace("_", "-")
    if key not in ACCELERATORS:
        raise ValueError(f"accelerator {name!r} is not a preset; use one of "
                         f"{', '.join(ACCELERATORS)} (or an Accelerator)")
    return ACCELERATORS[key]


def remat_factor(remat: bool = True, remat_policy: str | None = None) -> float:
    """Executed over model FLOPs: 4/3 for full rematerialisation (a second forward),
    1 with no remat or a policy that keeps the matmuls (``dots``, ``projections``);
    ``qkv_proj`` keeps one of the four projections: 1 + (1/3)(3/4) = 1.25."""
    if not remat or remat_policy in ("none", "dots", "projections"):
        return 1.0
    if remat_policy == "qkv_proj":
        return 1.25
    return 4 / 3


def model_flops(num_params: int, tokens: int, *, layers: int = 0, hidden: int = 0,
                seq: int = 0) -> float:
    """Model FLOPs of a train step over ``tokens`` tokens: ``tokens x (6 Psi + 12 L h s)``
    (matmuls forward and backward plus attention's two ``s x s`` matmuls; no remat)."""
    return float(tokens) * (6.0 * num_params + 12.0 * layers * hidden * seq)


def moe_all_to_all_bytes(*, tokens: int, hidden: int, experts: int,
                         experts_per_token: int, expert_parallel: int, layers: int = 1,
                         value_bytes: int = 2, capacity_factor: float | None = None,
                         remat: bool = True, micro_batches: int = 1,
                         operands: bool = False) -> int:
    """Bytes one device sends in a mixture of experts' all-to-alls over an ``expert``
    axis of X devices in one train step: ``tokens`` the device's tokens per micro-batch
    (``batch x seq / accum_steps``, ``/ P`` with a ``seq`` axis), ``layers`` sparse
    layers, ``micro_batches`` (``accum_steps``) of them per step.

    Per layer and micro-batch, four all-to-alls of one buffer each: the dispatch (token
    rows to their experts' devices) and the combine (the experts' outputs back) in the
    forward, their two transposes in the backward, and two more with a
    rematerialised forward (``remat``: full remat, or a policy that saves neither of
    them) = ``6`` (``4`` without). Each all-to-all's operand is ``X`` blocks, one per
    destination device, of ``R`` rows of ``hidden`` values (``value_bytes`` each, the
    compute dtype):

    * dropless (``capacity_factor`` None), **the worst case's static buffer**: ``R =
      tokens x k`` (all of a device's ``k`` assignments could go to one device's
      experts, and a static shape must hold them; MaxText's dropless ``ragged_all_to_all``
      sizes its receive buffer the same way): the operand is ``X tokens k hidden``,
      X times the rows that carry tokens;
    * capacity mode: ``R = (E / X) x C`` with ``C = ceil(capacity_factor x tokens x k /
      E)`` (:func:`zerojax.models.moe.capacity`, each expert's rows per source
      device): the operand is ``E C hidden``, about ``capacity_factor tokens k hidden``.

    Dropless routing also sends each expert's row count (``E`` int32) with the
    dispatch, once per forward (integers: no transpose in the backward). A device
    keeps its own block, so it sends ``(X - 1) / X`` of each operand (the
    bytes on the wire, what :func:`step_time` times); ``operands=True`` gives the
    operands' bytes instead, what :func:`zerojax.analysis.comm.comm_volume` counts in
    a compiled program (``bytes_by_kind()["all_to_all"]``, all-to-all counted at its
    operand). 0 for X = 1 (no all-to-all).

    The convention (that of the expert-parallel dispatch in
    :mod:`zerojax.models.moe`, ``_dispatch_dropless`` / ``_dispatch_capacity``; the
    compiled steps' all-to-all bytes equal it): one all-to-all of rows per direction
    per layer, in the compute dtype, the router's indices and weights not sent (each
    device keeps its tokens' routing and only the combine's rows come back), no
    ``ragged_all_to_all`` (whose sent bytes would be the routed rows, ``tokens k
    hidden (X - 1) / X`` on balanced routing)."""
    for name, v, lo in (("tokens", tokens, 0), ("hidden", hidden, 1),
                        ("experts", experts, 1), ("experts_per_token", experts_per_token, 1),
                        ("expert_parallel", expert_parallel, 1), ("layers", layers, 0),
                        ("value_bytes", value_bytes, 1), ("micro_batches", micro_batches, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"moe_all_to_all_bytes: {name} must be an int >= {lo}, got "
                             f"{v!r}")
    x = expert_parallel
    if experts % x:
        raise ValueError(f"moe_all_to_all_bytes: expert_parallel {x} does not divide the "
                         f"{experts} experts; pick a divisor of {experts}")
    if x == 1:
        return 0
    k = experts_per_token
    if capacity_factor is None:
        rows = x * tokens * k  # X destinations, each sized for all n k assignments
    else:
        rows = experts * max(1, math.ceil(capacity_factor * tokens * k / experts))
    operand = rows * hidden * value_bytes
    counts = 4 * experts if capacity_factor is None else 0  # int32, once per forward
    per_layer = (6 if remat else 4) * operand + (2 if remat else 1) * counts
    if not operands:
        per_layer = per_layer * (x - 1) // x
    return per_layer * layers * micro_batches


@dataclasses.dataclass(frozen=True)
class PcieTraffic:
    """Offload's device <-> host bytes per device per step, by when they move.

    ``fetch``: param shards host to device (``offload_params``); ``fetch_hidden``: under
    the layers' compute (a per-layer fetch that overlaps it), else exposed (the
    whole-shard fetch before the forward; a per-layer fetch that does not overlap).
    ``grads_out``: the gradient shards device to host during the backward (streamed
    gradients, under the backward; ``grads_in``: with ``accum_steps``, the host
    accumulator's layers read back there, host to device). ``update_in`` /
    ``update_out``: the update's, after the backward: the offloaded state (and the
    streamed gradients) in; the state (and, with ``offload_params``, the new params)
    out; one after the other (measured on an H200: the module's docstring).
    ``other``: exposed bytes moved one after the other (Pa+cpu's checkpoints, out in
    the forward and back in the backward; a global norm's pass over host gradients).
    """

    fetch: int = 0
    fetch_hidden: bool = True
    grads_out: int = 0
    grads_in: int = 0  # host to device in the backward: the host accumulator's layers
    update_in: int = 0
    update_out: int = 0
    other: int = 0

    @property
    def total(self) -> int:
        """Every byte crossing PCIe per step, both directions."""
        return (self.fetch + self.grads_out + self.grads_in + self.update_in
                + self.update_out + self.other)

    def seconds(self, bandwidth: float) -> tuple[float, float]:
        """``(under compute, exposed)`` seconds at ``bandwidth`` bytes/s per direction."""
        under = max((self.fetch if self.fetch_hidden else 0) + self.grads_in,
                    self.grads_out) / bandwidth
        exposed = ((0 if self.fetch_hidden else self.fetch)
                   + self.update_in + self.update_out + self.other) / bandwidth
        return under, exposed


@dataclasses.dataclass(frozen=True)
class StepTime:
    """One predicted step (seconds, per device; every device runs the same)."""

    flops: float  # executed FLOPs per device (model FLOPs x remat factor / mp)
    compute: float
    inside: float  # seconds the inside-node collectives take
    across: float  # seconds the cross-node collectives take
    tensor: float  # Megatron's all-reduces (mp > 1), Ulysses' all-to-alls; exposed
    exposed: float  # collective seconds not hidden under compute (tensor included)
    host: float  # PCIe seconds (offload), exposed
    tokens: int  # tokens per step over the whole job
    disk: float = 0.0  # NVMe tier: the node's reads and writes, overlapped with host
    under: float = 0.0  # PCIe seconds under compute (per-layer fetch, streamed gradients)

    @property
    def io(self) -> float:
        """Seconds the offloaded update adds: PCIe and disk overlapped, max(host, disk)."""
        return max(self.host, self.disk)

    @property
    def total(self) -> float:
        return max(self.compute, self.under) + self.exposed + self.io

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total


def step_time(num_params: int, *, stage: int, tokens_per_device: int, devices: int,
              accel: str | Accelerator = "h100", layers: int = 0, hidden: int = 0,
              seq: int = 0, mp: int = 1, per_node: int | None = None,
              inside_bytes: int | None = None, across_bytes: int | None = None,
              host_bytes: int = 0, remat: bool = True, remat_policy: str | None = None,
              param_bytes: int = 2, overlap: bool = True, disk_bytes: int = 0,
              disk_bandwidth: tuple[float, float] | None = None,
              alltoall_bytes: int = 0, seq_parallel: int = 1,
              pcie: PcieTraffic | None = None, active_params: int | None = None,
              expert_bytes: int = 0, expert_parallel: int = 1,
              **link_options: Any) -> StepTime:
    """The predicted step of ``devices`` data-parallel devices (x ``mp`` model), each
    with ``tokens_per_device`` tokens (batch x seq per data shard), at ZeRO ``stage``.

    The collective bytes per device are ``inside_bytes``/``across_bytes`` when given,
    else :func:`link_traffic` of the stage with ``link_options``
    (``hpz``, ``replica_axis``, ``quantize_weights``, ``quantize_gradients``,
    ``quantize_gradients_block``) on
    ``devices // per_node`` nodes (``per_node``: data devices per node, default the
    preset's devices per node / mp). ``host_bytes``: offloaded bytes over PCIe per
    step moved one after the other, exposed; ``pcie``: offload's transfers by when
    they move (:class:`PcieTraffic`: the per-layer fetches and streamed gradients
    under compute, the rest exposed, each direction at the preset's ``pcie_bw``).
    ``disk_bytes``: with ``offload_optimizer="nvme"``, the NVMe tier's
    state of the node (every device's shard), read once and written once per step at
    ``disk_bandwidth`` = ``(read, write)`` bytes/s per node (default the preset's
    ``disk_read_bw``, ``disk_write_bw``): ``disk = disk_bytes / read + disk_bytes /
    write``, overlapped with the PCIe transfers (the tier reads bucket k+1 and writes
    k-1 while k is updated), so the step adds ``max(host, disk)``.

    ``alltoall_bytes``: sequence parallelism's all-to-alls per device per step
    (:func:`zerojax.analysis.report.ulysses_bytes`), over the ``seq_parallel`` = P
    sequence devices: on the critical path (the attention waits for its q, k, v and
    the next layer for its output), exposed like Megatron's all-reduces, at the
    node's link inside a node (P up to the preset's devices per node), else at the
    network's per-device rate. A mixture of experts: ``num_params`` is what a device's
    ZeRO collectives move (the dense params and its ``E / X`` experts), ``active_params``
    what a token computes (FLOPs; None: ``num_params``), ``expert_bytes`` the
    all-to-alls (:func:`moe_all_to_all_bytes`) over ``expert_parallel`` devices, as P's."""
    acc = accelerator(accel)
    if per_node is None:
        per_node = max(1, acc.per_node // mp)
    per_node = min(per_node, devices)
    psi_shard = -(-int(num_params) // mp)
    nodes = max(1, devices // per_node)
    if inside_bytes is None or across_bytes is None:
        inside_bytes, across_bytes = link_traffic(
            psi_shard, stage, per_node=per_node, nodes=nodes, param_bytes=param_bytes,
            grad_bytes=param_bytes, **link_options)
    if devices == 1:
        inside_bytes = across_bytes = 0
    factor = remat_factor(remat, remat_policy)
    flops = model_flops(num_params if active_params is None else active_params,
                        tokens_per_device, layers=layers, hidden=hidden,
                        seq=seq) * factor / mp
    compute = flops / acc.rate
    inside = inside_bytes / acc.intra_bw
    # one collective over every device (plain ZeRO, stage 0 on nodes): a ring (NCCL's
    # channels, one per NIC) crosses each node boundary once, so the node's NICs carry
    # about one device's volume: the node's bandwidth, inter_bw x per_node. HSDP/hpZ
    # and the hierarchical qgZ run one cross-node collective per device of the node
    # (its own shard), all sharing the NICs: inter_bw each.
    one_ring = nodes > 1 and not any(link_options.get(k) for k in (
        "hpz", "replica_axis", "quantize_gradients"))
    across = across_bytes / (acc.inter_bw * (per_node if one_ring else 1))
    tensor = 0.0
    if mp > 1 and layers and hidden:
        # Megatron: 2 all-reduces of b s h activations per layer forward, 2 backward
        # (+2 with full remat's second forward); a ring moves 2 (mp-1)/mp of each
        per_layer = 6 if factor > 1 else 4
        tensor_bytes = (layers * per_layer * 2 * (mp - 1) / mp * tokens_per_device
                        * hidden * param_bytes)
        # beyond a node: one ring over the model axis, its NIC hops at the node's rate
        link = acc.intra_bw if mp <= acc.per_node else acc.inter_bw * acc.per_node
        tensor = tensor_bytes / link
    # an all-to-all beyond a node: every device's share crosses the network
    for nbytes, group in ((alltoall_bytes, seq_parallel), (expert_bytes, expert_parallel)):
        tensor += nbytes / (acc.intra_bw if group <= acc.per_node else acc.inter_bw)
    comm = inside + across
    if not overlap:
        exposed = comm
    elif stage == 3:
        exposed = max(0.0, comm - compute)
    else:
        backward = compute * (0.75 if factor > 1 else 2 / 3)
        if stage == 0:
            exposed = max(0.0, comm - backward)
        else:  # reduce-scatter (grads) hidden under the backward, gather after the update
            total = inside_bytes + across_bytes
            gather = min(total, _gather_share(psi_shard, param_bytes, devices))
            share = (total - gather) / total if total else 0.0
            exposed = max(0.0, comm * share - backward) + comm * (1 - share)
    exposed += tensor
    under, host = (0.0, 0.0) if pcie is None else pcie.seconds(acc.pcie_bw)
    host += host_bytes / acc.pcie_bw
    read, write = (disk_bandwidth if disk_bandwidth is not None
                   else (acc.disk_read_bw, acc.disk_write_bw))
    disk = disk_bytes / read + disk_bytes / write if disk_bytes else 0.0
    return StepTime(flops, compute, inside, across, tensor, exposed, host,
                    tokens_per_device * devices, disk, under)


def _gather_share(psi: int, param_bytes: int, devices: int) -> int:
    """Stages 1-2: the bytes of the parameter all-gather after the update (Psi)."""
    return psi * param_bytes if devices > 1 else 0


_BITS = {None: None, "int8": 8, "int4": 4}


def link_traffic(num_params: int, stage: int, *, per_node: int, nodes: int,
                 param_bytes: int = 2, grad_bytes: int = 2, replica_axis: str | None = None,
                 hpz: bool = False, quantize_weights: str | None = None,
                 quantize_gradients: str | None = None,
                 quantize_gradients_block: int | None = None) -> tuple[int, int]:
    """``(inside, across)``: the bytes one device moves per step over the links inside
    its node and over the network between nodes, on ``nodes`` x ``per_node`` devices
    (a mesh ``make_mesh(replica=nodes, data=per_node)``), as zerojax's step moves them
    (issue 20; checked against the compiled HLO in tests/test_hierarchical.py).

    Plain ZeRO spans both axes with one collective: all of it counts as across (a ring
    over every device is as slow as its network hops). HSDP (``replica_axis``): the
    stage's traffic inside the node, plus an all-reduce of the Psi/D gradient shard
    across. hpZ (stage 3): the gathers and the first reduce-scatter inside, then the
    second reduce-scatter level (Psi/D) and the secondary copy's refresh (Psi/D,
    exact) across. ``quantize_weights`` (qwZ, stage 3's gathers: int8 blocks plus a
    float32 scale per ``zerojax.quant.DEFAULT_BLOCK`` = 2048 elements) and
    ``quantize_gradients`` (qgZ: int8/int4 blocks plus a float32 scale per
    ``quantize_gradients_block`` elements, None: zero()'s default,
    ``zerojax.quant.GRAD_DEFAULTS``, 256 for int4 (1/8 + 1/256 = 0.1289 of fp32's
    bytes) and 2048 for int8 (0.2505); hierarchical, inside first, where the mesh has
    both axes; HSDP's across all-reduce becomes a quantized reduce-scatter plus an
    exact all-gather) change the bytes per element on the wire."""
    from zerojax.core import quant

    psi, d = int(num_params), int(per_node)
    qw, qg = _BITS[quantize_weights], _BITS[quantize_gradients]
    g_block = quant.grad_quant(qg, quantize_gradients_block).block if qg else None

    def wire(n, bits, exact_bytes, block=quant.DEFAULT_BLOCK):
        n = int(n)
        return quant.wire_bytes(n, bits=bits, block=block) if bits and n else n * exact_bytes

    def gwire(n, bits, exact_bytes):  # the gradients' reduce-scatters (qgZ)
        return wire(n, bits, exact_bytes, g_block)

    shard = -(-psi // d)
    if stage == 0:
        return (0, 2 * psi * grad_bytes) if nodes > 1 else (2 * psi * grad_bytes, 0)
    gathers = wire(psi, qw, param_bytes) * 2 if stage == 3 else psi * param_bytes
    if nodes == 1:
        return gathers + gwire(psi, qg, grad_bytes), 0
    if hpz:
        return (gathers + gwire(psi, qg, grad_bytes),
                gwire(shard, qg, grad_bytes) + shard * param_bytes)
    if replica_axis is not None:
        across = (gwire(shard, qg, grad_bytes) + shard * grad_bytes if qg
                  else 2 * shard * grad_bytes)
        return gathers + gwire(psi, qg, grad_bytes), across
    if qg:  # plain, quantized: the reduce-scatter goes hierarchically, inside first
        return gwire(psi, qg, grad_bytes), gathers + gwire(shard, qg, grad_bytes)
    return 0, gathers + psi * grad_bytes
