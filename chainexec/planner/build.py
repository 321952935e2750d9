"""From a validated spec to a Plan: binarize, choose fusion and tiles, emit loop nests, predict.

Pure: no I/O, MPI or GPU. Binarization is :mod:`chainexec.planner.order`; the choice of fused
sub-chains and tile sizes is :mod:`chainexec.planner.choose` (the multi-level paper's model plus
an exhaustive search); the nest shapes are :mod:`chainexec.planner.nest`; predicted movement is
:mod:`chainexec.planner.cost`.
"""

from __future__ import annotations

import math

from chainexec.errors import ChainexecError
from chainexec.planner.cost import buffer_elements, parallel_tiles, pinned, predict, predict_nests
from chainexec.planner.layout import relayout
from chainexec.planner.machine import Machine
from chainexec.planner import ordered, packed, record, resume
from chainexec.planner.order import binarize, strategy
from chainexec.planner.choose import choose, least_limit
from chainexec.planner.keep import keep
from chainexec.planner.pipeline import deepen
from chainexec.planner.plan import Contraction, Nest, Plan, TensorInfo
from chainexec.planner.schedule import Context, split_for_ranks
from chainexec.planner.symmetry import mark
from chainexec.planner.tiling import minimal_footprint
from chainexec.spec import DTYPES, Spec, format_size
from chainexec.spectypes import MAX_SIZE


def contractions(spec: Spec) -> tuple[list[Contraction], dict[str, TensorInfo], dict[str, int]]:
    """Binarize every statement (operation-minimal order, or greedy for many operands:
    :func:`~chainexec.planner.order.binarize`) into contractions, statements over packed tensors
    into contractions over their pair indices (:mod:`chainexec.planner.packed`); describe every
    tensor. Returns the contractions, the tensors and every index's extent (the pair indices'
    too)."""
    extents = dict(spec.extents)
    names = set(extents)
    kinds = {t.name: t.layout for t in spec.tensors.values() if t.layout != "dense"}
    tensors: dict[str, TensorInfo] = {}
    outputs = spec.output_records()
    symmetric = {o.tensor: list(o.symmetric) for o in spec.outputs}
    for t in spec.tensors.values():
        role = "input" if t.source is not None else "output" if t.name in outputs else "intermediate"
        own = packed.form(t.indices, kinds.get(t.name), names, extents)
        tensors[t.name] = TensorInfo(t.name, list(own.indices), [extents[i] for i in own.indices], t.dtype,
                                     DTYPES[t.dtype], role, spec.source_record(t.name), outputs.get(t.name),
                                     symmetric.get(t.name, []), kinds.get(t.name),
                                     list(t.indices) if t.name in kinds else None)
    result: list[Contraction] = []

    def add(s: int, step: packed.Step | None, out: str, out_indices, a: str, a_indices, b=None, b_indices=None,
            factor: float = 1.0, accumulate: bool = False, flops: int = 0, order: str = "optimal") -> None:
        """One contraction of statement ``s``; a temporary output gets its tensor."""
        if out not in tensors:
            tensors[out] = TensorInfo(out, list(out_indices), [extents[i] for i in out_indices],
                                      spec.tensors[spec.statements[s].lhs.tensor].dtype,
                                      DTYPES[spec.tensors[spec.statements[s].lhs.tensor].dtype], "intermediate")
        result.append(Contraction(len(result), out, list(out_indices), a, list(a_indices), b,
                                  list(b_indices) if b_indices is not None else None, factor, accumulate,
                                  step.flops(extents) if step is not None else flops, s, order,
                                  step.pairs if step is not None else None))

    def run_steps(s: int, st, steps: list[packed.Step], last: bool) -> str:
        """Contractions of ``steps`` (each reading the one before where ``a`` is None); the last
        writes the statement's result where ``last``, else a temporary (returned)."""
        previous = None
        for k, step in enumerate(steps):
            final = last and k == len(steps) - 1
            out = st.lhs.tensor if final else f"_s{s}_p{len(result)}"
            add(s, step, out, step.out, step.a if step.a is not None else previous, step.a_indices, step.b,
                step.b_indices, st.factor if final else 1.0, st.accumulate and final)
            previous = out
        return previous

    for s, st in enumerate(spec.statements):
        forms = [packed.form(r.indices, kinds.get(r.tensor), names, extents) for r in st.operands]
        result_form = packed.form(st.lhs.indices, kinds.get(st.lhs.tensor), names, extents)
        steps = _transform(st, forms, result_form, kinds)
        if steps is not None:
            run_steps(s, st, steps, True)
            continue
        names_ = [r.tensor for r in st.operands]
        idx = [r.indices for r in st.operands]
        for n, (ref, own) in enumerate(zip(st.operands, forms)):
            if own.pairs:  # read unpacked whole
                names_[n] = run_steps(s, st, packed.unpacked(ref.tensor, own), False)
        pack = packed.packed(tuple(st.lhs.indices), result_form)
        lhs = f"_s{s}_d" if pack else st.lhs.tensor
        if pack:
            tensors[lhs] = TensorInfo(lhs, list(st.lhs.indices), [extents[i] for i in st.lhs.indices],
                                      spec.tensors[st.lhs.tensor].dtype, DTYPES[spec.tensors[st.lhs.tensor].dtype],
                                      "intermediate")
        factor, accumulate = (1.0, False) if pack else (st.factor, st.accumulate)
        steps_ = binarize(list(idx), st.lhs.indices, extents)
        order = strategy(len(idx))
        if not steps_:
            add(s, None, lhs, st.lhs.indices, names_[0], idx[0], factor=factor, accumulate=accumulate,
                flops=math.prod(extents[i] for i in st.lhs.indices), order=order)
        for k, step in enumerate(steps_):
            last = k == len(steps_) - 1
            out = lhs if last else f"_s{s}_{k}"
            names_.append(out)
            idx.append(step.indices)
            add(s, None, out, step.indices, names_[step.left], idx[step.left], names_[step.right], idx[step.right],
                factor if last else 1.0, accumulate and last, step.flops, order)
        if pack:
            pack[0].a = lhs
            run_steps(s, st, pack, True)
    return result, tensors, extents


def _transform(st, forms: list[packed.Form], result: packed.Form, kinds: dict[str, str]) -> list[packed.Step] | None:
    """The four-index transform's steps (:func:`chainexec.planner.packed.transform`) where
    statement ``st`` is one: its one packed four-index operand times matrices; else None."""
    tensors = [n for n, f in enumerate(forms) if f.pairs]
    if len(tensors) != 1 or len(st.operands[tensors[0]].indices) != 4:
        return None
    at = tensors[0]
    ref = st.operands[at]
    others = [r for n, r in enumerate(st.operands) if n != at]
    if any(len(r.indices) != 2 or r.tensor in kinds for r in others):
        return None
    matrices = [(r.tensor, tuple(r.indices)) for r in others]
    return packed.transform(ref.tensor, forms[at], tuple(ref.indices), matrices, tuple(st.lhs.indices), result)


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
    cs, tensors, extents = contractions(spec)
    limits = {"global": spec.machine.global_memory, "device": spec.machine.device_memory}
    unset = [f"machine.{level}_memory" for level, size in limits.items() if size is None]
    if unset:
        raise ChainexecError(f"{' and '.join(unset)} not set: the planner needs both memory limits in bytes "
                             "(chainexec.api.plan takes them from the machine where the config has none)", spec.path)
    # The contraction whose smallest tiling needs the most: a limit below it fits no plan, and
    # naming a smaller contraction's need would send the user through one refusal per contraction.
    bound = max(minimal_footprint(c, tensors[c.out].itemsize, extents) for c in cs)
    for level in ("global", "device"):
        if limits[level] < bound:
            # the bound leaves out the buffers a computed operand's inputs take: the need named is
            # the least limit with a tiling of every contraction, the other level unbounded
            other = {"global": "device", "device": "global"}[level]
            ctx = Context(cs, tensors, extents, {level: limits[level], other: MAX_SIZE}, machine, False, inline)
            need, largest = max(((least_limit(ctx, c.id, level) or MAX_SIZE), -k) for k, c in enumerate(cs))
            shown = [format_size(limits[level]), format_size(need)]
            if shown[0] == shown[1]:  # equal once rounded: the bytes themselves
                shown = [f"{limits[level]:,} B", f"{need:,} B"]
            elif need >= 1024:  # the rounded size may be below the need: the bytes that plan too
                shown[1] += f" ({need:,} B)"
            raise ChainexecError(
                f"machine.{level}_memory = {shown[0]} is too small for any plan: contraction "
                f"{cs[-largest].einsum()} needs at least {shown[1]}",
                spec.path, spec.lines.get(("machine", f"{level}_memory")))
    # Disk traffic overlapped with work where the limits leave room for the second buffers;
    # otherwise (only the single-buffered plans fit) the sequential plan.
    for overlap in (True, False):
        ctx = Context(cs, tensors, extents, limits, machine, overlap, inline)
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
    # the contractions' temporaries (device.Backend.limit_memory), whose lack would cost more
    # than the overlap wins.
    room = (limits["device"] + predict_nests(nests, tensors, extents, cs, None)["memory_peak"]["device"]) // 2

    def fits(body) -> bool:
        peak = predict_nests([Nest([], body)], tensors, extents, cs, None)["memory_peak"]
        return peak["device"] <= room and peak["global"] <= limits["global"]

    def large(op, loops) -> bool:
        """Whether a result's full device tile is worth copying back aside (Machine.aside_copy_bytes)."""
        tile = tensors[op.tensor].itemsize * buffer_elements(op.indices, loops, "device", extents)
        return tile >= machine.aside_copy_bytes

    # Input tiles of a symmetric loop fetched once per group of its tiles, not once per tile,
    # where they fit in the same room (tiles kept first: they save bytes, fetching ahead only time).
    nests = keep(nests, extents, cs, tensors, fits, ranks)
    nests = deepen(nests, extents, cs, fits, large)
    # Runs of terms evaluated once per orbit on the tiles of a symmetric loop that permutations
    # map onto themselves (the tiles stay).
    mark(nests, cs, extents)
    # Full reductions summed over the ordered elements of the tiles with equal positions.
    ordered.mark(nests, cs, tensors)
    # What a run with --checkpoint saves and skips when resumed.
    resume.mark(nests)
    # What the runtime reads besides the statements (runs, fills, streamed inputs, tile counts).
    record.finish(nests, cs, tensors, extents)
    plan = Plan(spec.name, extents, tensors, cs, nests, limits, {}, spec.resolve(spec.scratch),
                alternatives, ranks)
    plan.parallel_tiles = parallel_tiles(plan)
    plan.predicted = predict(plan, machine, ranks)
    plan.pinned = pinned(plan.predicted["bytes"], machine, ranks)
    if plan.pinned:  # its global arrays' transfers at the page-locked rates
        plan.predicted = predict(plan, machine, ranks)
    return plan
