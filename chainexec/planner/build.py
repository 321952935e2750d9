"""From a validated spec to a Plan: binarize, choose fusion and tiles, emit loop nests, predict.

Pure: no I/O, MPI or GPU. Binarization is :mod:`chainexec.planner.order`; the choice of fused
sub-chains and tile sizes is :mod:`chainexec.planner.choose` (the multi-level paper's model plus
an exhaustive search); the nest shapes are :mod:`chainexec.planner.nest`; predicted movement is
:mod:`chainexec.planner.cost`.
"""

from __future__ import annotations

import math

from chainexec.errors import ChainexecError
from chainexec.planner.cost import buffer_elements, parallel_tiles, predict, predict_nests
from chainexec.planner.layout import relayout
from chainexec.planner.machine import Machine
from chainexec.planner import ordered, record, resume
from chainexec.planner.order import binarize, strategy
from chainexec.planner.choose import choose
from chainexec.planner.pipeline import deepen
from chainexec.planner.plan import Contraction, Nest, Plan, TensorInfo
from chainexec.planner.schedule import Context, split_for_ranks
from chainexec.planner.symmetry import mark
from chainexec.planner.tiling import minimal_footprint
from chainexec.spec import DTYPES, Spec, format_size


def contractions(spec: Spec) -> tuple[list[Contraction], dict[str, TensorInfo]]:
    """Binarize every statement (operation-minimal order, or greedy for many operands:
    :func:`~chainexec.planner.order.binarize`) into contractions; describe every tensor."""
    tensors: dict[str, TensorInfo] = {}
    outputs = spec.output_records()
    symmetric = {o.tensor: list(o.symmetric) for o in spec.outputs}
    for t in spec.tensors.values():
        role = "input" if t.source is not None else "output" if t.name in outputs else "intermediate"
        tensors[t.name] = TensorInfo(t.name, list(t.indices), [spec.extents[i] for i in t.indices], t.dtype,
                                     DTYPES[t.dtype], role, spec.source_record(t.name), outputs.get(t.name),
                                     symmetric.get(t.name, []))
    result: list[Contraction] = []
    for s, st in enumerate(spec.statements):
        dtype = spec.tensors[st.lhs.tensor].dtype
        names = [r.tensor for r in st.operands]
        idx = [r.indices for r in st.operands]
        steps = binarize(list(idx), st.lhs.indices, spec.extents)
        order = strategy(len(idx))
        if not steps:
            result.append(Contraction(len(result), st.lhs.tensor, list(st.lhs.indices), names[0], list(idx[0]),
                                      None, None, st.factor, st.accumulate,
                                      math.prod(spec.extents[i] for i in st.lhs.indices), s, order))
            continue
        for k, step in enumerate(steps):
            last = k == len(steps) - 1
            out = st.lhs.tensor if last else f"_s{s}_{k}"
            if not last:
                tensors[out] = TensorInfo(out, list(step.indices), [spec.extents[i] for i in step.indices], dtype,
                                          DTYPES[dtype], "intermediate")
            names.append(out)
            idx.append(step.indices)
            result.append(Contraction(
                len(result), out, list(step.indices), names[step.left], list(idx[step.left]),
                names[step.right], list(idx[step.right]), st.factor if last else 1.0,
                st.accumulate and last, step.flops, s, order))
    return result, tensors


def make_plan(spec: Spec, machine: Machine | None = None, schedule: str | None = None, ranks: int = 1,
              inline: bool = True) -> Plan:
    """Plan a spec: binarize, choose fusion and tiles for ``spec.machine`` limits, predict
    movement; pure. ``schedule`` forces one of the named alternatives (``unfused``,
    ``paper: disk``, ``paper: disk+global``, ``search``) instead of the cheapest. ``ranks``: the
    chosen schedule's parallel loops are cut into at least that many tiles where they allow
    (:func:`~chainexec.planner.schedule.split_for_ranks`); alternatives are priced for one rank.
    ``inline`` False keeps every point-wise intermediate in a buffer of its own
    (:mod:`chainexec.planner.inline`)."""
    machine = machine or Machine()
    cs, tensors = contractions(spec)
    limits = {"global": spec.machine.global_memory, "device": spec.machine.device_memory}
    for c in cs:
        item = tensors[c.out].itemsize
        for level in ("global", "device"):
            need = minimal_footprint(c, item)
            if limits[level] < need:
                raise ChainexecError(
                    f"machine.{level}_memory = {format_size(limits[level])} is too small for any plan: "
                    f"contraction {c.einsum()} needs at least {format_size(need)}",
                    spec.path, spec.lines.get(("machine", f"{level}_memory")))
    # Disk traffic overlapped with work where the limits leave room for the second buffers;
    # otherwise (only the single-buffered plans fit) the sequential plan.
    for overlap in (True, False):
        ctx = Context(cs, tensors, spec.extents, limits, machine, overlap, inline)
        try:
            chosen, alternatives = choose(ctx, schedule)
            break
        except ValueError as err:
            if not overlap:
                raise ChainexecError(str(err), spec.path) from None
    split_for_ranks(ctx, chosen, ranks)
    nests = ctx.emitter().schedule(chosen)
    relayout(nests, cs, tensors)
    # Host→device copies overlapped with work where the device limit leaves room for the second
    # buffers (the tiles stay those chosen), taking at most half that room: the rest stays for
    # the contractions' temporaries (device.Backend.limit_memory; at 256 MiB the (T) job at
    # o=16, v=120 ran 4.3-5.1 s with its room taken, 4.0-4.2 s without fetching ahead).
    room = (limits["device"] + predict_nests(nests, tensors, spec.extents, cs, None)["memory_peak"]["device"]) // 2

    def fits(body) -> bool:
        peak = predict_nests([Nest([], body)], tensors, spec.extents, cs, None)["memory_peak"]
        return peak["device"] <= room and peak["global"] <= limits["global"]

    def large(op, loops) -> bool:
        """Whether a result's full device tile is worth copying back aside (Machine.aside_copy_bytes)."""
        tile = tensors[op.tensor].itemsize * buffer_elements(op.indices, loops, "device", spec.extents)
        return tile >= machine.aside_copy_bytes

    nests = deepen(nests, spec.extents, cs, fits, large)
    # Runs of terms evaluated once per orbit on the tiles of a symmetric loop that permutations
    # map onto themselves (the tiles stay).
    mark(nests, cs, spec.extents)
    # Full reductions summed over the ordered elements of the tiles with equal positions.
    ordered.mark(nests, cs, tensors)
    # What a run with --checkpoint saves and skips when resumed.
    resume.mark(nests)
    # What the runtime reads besides the statements (runs, fills, streamed inputs, tile counts).
    record.finish(nests, cs, tensors, spec.extents)
    plan = Plan(spec.name, dict(spec.extents), tensors, cs, nests, limits, {}, spec.resolve(spec.scratch),
                alternatives, ranks)
    plan.parallel_tiles = parallel_tiles(plan)
    plan.predicted = predict(plan, machine, ranks)
    return plan
