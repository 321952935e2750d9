"""The Plan: plain data that the runtime interprets.

A plan is a list of binary contractions plus, for each, a loop-nest tree of tiled loops and data
statements. Every statement is tagged with its level (``disk``, ``global``, ``device``); every loop
runs over tiles of one or more indices at one level.

Region rule (what a buffer covers): a buffer of tensor X at level L spans, for each index i of X,
the range of the innermost enclosing loop over i whose level is at or above L (``global`` loops set
global and device ranges, ``device`` loops only device ranges), else the whole extent.

Statements (``Op.op``):

- ``alloc``/``free`` X at a level: a zero-filled buffer over the current region.
- ``load`` X: disk → global (read from X's source or stored version ``version``).
- ``store`` X: global → disk (write version ``version`` of X).
- ``get`` X: global → device. ``accumulate`` X: device → global, added element-wise.
- ``compute`` contraction k on the device buffers: ``out += factor · a · b``.
- ``fused`` the contractions ``group`` as one statement into ``tensor``: the point-wise producers
  of the intermediates ``inlined`` substituted into the terms that read them, never stored
  (:mod:`chainexec.planner.inline`).

A sequential global loop or a device loop with ``depth`` 2 is double-buffered
(:mod:`chainexec.planner.pipeline`).

Loops flagged ``parallel`` share their iterations among ranks; everything else runs on all ranks,
each doing its own part of the global array (collective).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import asdict, dataclass, field
from functools import cached_property

from chainexec import expr

LEVELS = ("disk", "global", "device")
CATEGORIES = ("disk->global", "global->disk", "global->device", "device->global")
CATEGORY = {"load": "disk->global", "store": "global->disk", "get": "global->device", "accumulate": "device->global"}
"""The category of bytes each moving statement counts in (runtime and cost model alike)."""
LEVEL_TIMES = ("disk", "global<->device", "compute")
"""The levels a plan's predicted and measured seconds are given for."""
MOVE_LEVEL = {"load": "disk", "store": "disk", "get": "global<->device", "accumulate": "global<->device"}
"""The level of :data:`LEVEL_TIMES` whose seconds each moving statement counts in."""


@dataclass
class TensorInfo:
    """A tensor as the plan sees it. ``role`` is input, intermediate or output; ``source`` mirrors
    :class:`chainexec.spec.Source` for inputs (as a dict); ``output`` is ``{file, dataset}``."""

    name: str
    indices: list[str]
    shape: list[int]
    dtype: str
    itemsize: int
    role: str
    source: dict | None = None
    output: dict | None = None
    # Indices the output is summed over and symmetric in (:class:`chainexec.spec.Output`).
    symmetric: list[str] = field(default_factory=list)
    # A packed tensor (:mod:`chainexec.planner.packed`): PySCF's name of its layout, and its
    # indices as the config declares them (``indices`` are then its pair indices).
    layout: str | None = None
    dense: list[str] | None = None

    def computed(self) -> bool:
        """Whether it is made from an expression over other tensors (``source: {expr}``)."""
        return self.source is not None and "expr" in self.source

    def from_file(self) -> bool:
        """Whether it is an input read from an HDF5 dataset (``source: {file, dataset}``)."""
        return self.role == "input" and self.source is not None and "file" in self.source


@dataclass
class Contraction:
    """``out[out_indices] (+)= factor · a[a_indices] · b[b_indices]`` (``b`` may be None: a permuted
    copy). ``statement`` is the position of the config statement it comes from; ``flops`` counts
    2 per point of the joint index space (1 for a copy); ``order`` says how that statement's
    product was cut into binary contractions: ``optimal`` (the flop-minimal order) or ``greedy``
    (a product of more operands than the exhaustive search takes,
    :func:`chainexec.planner.order.strategy`)."""

    id: int
    out: str
    out_indices: list[str]
    a: str
    a_indices: list[str]
    b: str | None
    b_indices: list[str] | None
    factor: float
    accumulate: bool
    flops: int
    statement: int
    order: str = "optimal"
    # A pack or unpack (:mod:`chainexec.planner.packed`): the pair index and its two members.
    # Unpack: the operand holds the pair, the output its members; pack: the other way round.
    pairs: dict[str, list[str]] | None = None

    def indices(self) -> list[str]:
        seen = list(self.out_indices)
        for i in self.a_indices + (self.b_indices or []):
            if i not in seen:
                seen.append(i)
        return seen

    def whole(self) -> list[str]:
        """Indices no loop around it may cut: a pack's or unpack's operand side of its pair (the
        pair index it unpacks, the members it packs), which a gather reads whole."""
        if not self.pairs:
            return []
        (pair, members), = self.pairs.items()
        return [pair] if pair in self.a_indices else list(members)

    def space(self) -> list[str]:
        """The indices of the points it works on (flops: 2 per point, 1 for a copy): all of its
        indices, a pack's or unpack's output's alone (it gathers one value per output element)."""
        return list(self.out_indices) if self.pairs else self.indices()

    def operands(self) -> list[tuple[str, list[str]]]:
        """(tensor, indices) of ``a``, and of ``b`` when there is one."""
        return [(self.a, self.a_indices)] + ([(self.b, self.b_indices)] if self.b is not None else [])

    def pointwise(self) -> bool:
        """Whether it sums over nothing: a permuted copy, a Hadamard or an outer product (not a
        pack or unpack, which no point-wise kernel expresses)."""
        return not self.pairs and set(self.a_indices) | set(self.b_indices or []) <= set(self.out_indices)

    def einsum(self) -> str:
        if self.pairs:
            (pair, _), = self.pairs.items()
            return f"{','.join(self.a_indices)}->{','.join(self.out_indices)} ({'unpack' if pair in self.a_indices else 'pack'})"
        rhs = "".join(self.a_indices) if self.b is None else f"{''.join(self.a_indices)},{''.join(self.b_indices)}"
        return f"{rhs}->{''.join(self.out_indices)}"


@dataclass(frozen=True)
class Fused:
    """A fused statement as one expression: ``out[out_indices] += Σ value`` summed over the
    ``domain`` indices the output lacks, ``value`` being :attr:`text` (the :mod:`chainexec.expr`
    language, references to device buffers) over ``domain``. ``reduce``: the output is a scalar
    (the sum runs over the whole domain); otherwise the domain is the output's indices."""

    out: str
    out_indices: tuple[str, ...]
    domain: tuple[str, ...]
    text: str
    reduce: bool
    # Reused producers (a full reduction's only): (name, indices, expression over them), each
    # computed once per point of the domain and read by ``text`` as ``name[…]`` at permutations.
    lets: tuple[tuple[str, tuple[str, ...], str], ...] = ()

    @cached_property
    def tree(self) -> ast.expr:
        """:attr:`text` parsed, once per statement: the backends key their generated code on it."""
        return expr.parse(self.text)

    @cached_property
    def leaves(self) -> tuple[expr.Ref, ...]:
        """The distinct buffer references the statement reads (each one view, read once), found
        once per statement: reading them from the text per tile would cost milliseconds of host
        time per (T) tile."""
        names = {name for name, _, _ in self.lets}
        found: list[expr.Ref] = []
        for text in [self.text] + [text for _, _, text in self.lets]:
            found += [r for r in expr.text_refs(text) if r.tensor not in names and r not in found]
        return tuple(found)


@dataclass
class Op:
    op: str
    level: str
    tensor: str | None = None
    # A buffer is known by its tensor and the index names it is used with in this nest: one tensor
    # may appear twice in a contraction (A[i,k]·A[j,k]); a fused intermediate keeps one name.
    indices: list[str] | None = None
    contraction: int | None = None
    version: int | None = None
    # A ``fused`` statement's contractions (the terms into ``tensor`` and the inlined producers'
    # terms, in chain order) and the tensors it computes inline instead of reading buffers; of
    # those, ``lets`` are computed once per element and read at several permutations.
    group: list[int] | None = None
    inlined: list[str] | None = None
    lets: list[str] | None = None
    # The first statement of a run of terms that permutations of its output's indices map onto
    # itself: on tiles those permutations map onto themselves, one term per orbit, then the
    # output symmetrized in place (:mod:`chainexec.planner.symmetry`).
    symmetrized: bool | None = None
    # On tiles of a symmetric loop with equal positions, only the elements ordered like the
    # positions: a fused full reduction sums them, each weighted by its multiplicity; a
    # symmetrized run (first statement) writes its symmetrization there alone
    # (:mod:`chainexec.planner.ordered`).
    ordered: bool | None = None
    # A ``fused`` statement's expression (:func:`chainexec.planner.inline.expression`), what the
    # runtime evaluates and the cost model prices.
    expression: Fused | None = None
    # The first compute statement of a run of terms: how many statements the run adds in one
    # pass (:func:`term_run`; recorded by :mod:`chainexec.planner.record`).
    run: int | None = None
    # A symmetrized run's first statement: per pattern of equal tile positions
    # (:func:`pattern_key`), the terms it runs there, ``[[position, scale], …]``, and the axis
    # permutations its output is then summed over, or None where every term runs
    # (:func:`chainexec.planner.symmetry.schedule`).
    schedule: dict | None = None
    # An ``alloc`` whose buffer is written whole before it is read: False (no zero fill).
    fill: bool | None = None
    # A run's first statement that writes its output first: True (written as if it held zeros).
    fresh: bool | None = None


@dataclass
class Loop:
    """Tiled loop. ``depth`` 2 marks a sequential global loop whose disk traffic overlaps its work
    (:mod:`chainexec.planner.pipeline`): its own global buffers exist twice, and while iteration n
    computes, iteration n+1's loads and iteration n-1's stores run in the background; or a
    device loop (of one rank's tiles) whose fetched input tiles named in ``ahead`` exist twice,
    tile n+1's copied to the device while tile n computes, and whose accumulated results named
    in ``back`` exist twice, tile n-1's copied to the host while tile n computes.

    ``symmetric``: indices (tiled alike) over which the loop visits only ordered tile tuples
    (position of the first ≤ the second ≤ …); everything accumulated in its body is multiplied by
    the tuple's multiplicity, the number of distinct permutations of its positions (1, 3 or 6
    for three indices). Valid for sums whose summand is symmetric in them (the outputs'
    ``symmetric`` declarations, :meth:`chainexec.planner.nest.Emitter.fused`).

    ``kept``: in a parallel symmetric device loop that tiles only its symmetric indices, device
    tiles ([tensor, indices] each, their indices without the first symmetric one) that stay on
    the device from one tile to the next within a *group*: the consecutive tuples
    (:func:`chainexec.runtime.frame.tuples`) that differ only in that index's position. Such a loop
    hands out whole groups (:func:`chainexec.runtime.frame.groups`); a kept tile's ``alloc`` and
    ``get`` (first in the body) run at a group's first tile and its ``free`` (last) at the
    group's last, so its bytes move once per group (:mod:`chainexec.planner.keep`).

    ``resume``: how a run with ``--checkpoint`` saves the progress of this loop at the top of a
    nest (:mod:`chainexec.planner.resume`): ``accumulate`` (a parallel loop: the tiles handed out
    and its accumulation targets' rows), ``store`` (a sequential global loop: its finished
    iterations, whose stored tiles are durable), None (not saved: it reruns from its start)."""

    level: str
    tiles: dict[str, int]
    parallel: bool = False
    body: list = field(default_factory=list)
    depth: int = 1
    symmetric: list[str] = field(default_factory=list)
    # a double-buffered device loop: the input tiles it fetches one tile ahead, [tensor, indices] each
    ahead: list = field(default_factory=list)
    # a double-buffered device loop: the results it copies back on a stream of their own, [tensor, indices] each
    back: list = field(default_factory=list)
    resume: str | None = None
    # A loop with ``resume`` set: its number of tiles (ordered tuples of a symmetric loop), or of
    # groups where it keeps tiles (the units it hands out).
    count: int | None = None
    # device tiles kept across a group's tiles, [tensor, indices] each
    kept: list = field(default_factory=list)


def ops(body: list, loops: tuple = ()):
    """Every statement of a loop-nest body, depth first, with the loops around it (outermost first)."""
    for node in body:
        if isinstance(node, Loop):
            yield from ops(node.body, loops + (node,))
        else:
            yield node, loops


def stores(body: list) -> dict[str, int]:
    """The version each tensor is stored at in a loop-nest body (``store`` statements; the last
    where one tensor has several): the versions the body writes, closed after its nest."""
    return {op.tensor: op.version for op, _ in ops(body) if op.op == "store"}


# What a double-buffered loop's fields name (:mod:`chainexec.planner.pipeline` decides them):
# readers of the plan's data, for the runtime and the cost model alike.

DEPTH = 2
"""Slots of each buffer of a double-buffered loop (:mod:`chainexec.planner.pipeline`)."""


def key(op: Op) -> tuple:
    """How the runtime and the cost model know a buffer: tensor, index names, level."""
    return (op.tensor, tuple(op.indices), op.level)


def staged(loop: Loop) -> list[Op]:
    """The ``alloc`` statements of the buffers a double-buffered loop holds in ``depth`` slots
    from entry to exit (one per buffer): a global loop's own global buffers, a device loop's
    fetched inputs (:func:`fetched`); empty for any other loop."""
    if loop.depth < 2:
        return []
    if loop.level == "device":
        return [op for op in fetched(loop) if op.op == "alloc"] + returned(loop)
    seen: dict[tuple, Op] = {}
    for node in loop.body:
        if isinstance(node, Op) and node.op == "alloc" and node.level == "global":
            seen.setdefault(key(node), node)
    return list(seen.values())


def prefetched(loop: Loop) -> list[Op]:
    """The statements a double-buffered loop runs one iteration ahead: the leading ``alloc``/``load``
    statements of its body, keeping each staged buffer whose ``load`` fills it there (a buffer
    allocated empty, such as an output, is set up only when its own iteration starts: its other
    slot may still be being written to disk)."""
    lead = []
    for node in loop.body:
        if not (isinstance(node, Op) and node.op in ("alloc", "load") and node.level == "global"):
            break
        lead.append(node)
    loaded = {key(op) for op in lead if op.op == "load"}
    own = {key(op) for op in staged(loop)}
    return [op for op in lead if key(op) in loaded and key(op) in own]


def fetched(loop: Loop) -> list[Op]:
    """The statements a double-buffered device loop (:func:`chainexec.planner.pipeline.deepen`) runs one tile ahead, into
    the other slot: the ``alloc`` and ``get`` of each buffer in ``loop.ahead``, in body order;
    empty for any other loop."""
    if loop.depth < 2 or loop.level != "device":
        return []
    keys = {(tensor, tuple(indices), "device") for tensor, indices in loop.ahead}
    return [node for node in loop.body if isinstance(node, Op) and node.op in ("alloc", "get") and key(node) in keys]


def executed(loop: Loop) -> list:
    """``loop.body`` as the executor walks it each tile: without the statements it runs one
    tile ahead (:func:`fetched`), which it runs separately."""
    ahead = fetched(loop)
    return [node for node in loop.body if not any(node is op for op in ahead)]


def returned(loop: Loop) -> list[Op]:
    """The ``alloc`` statements of the results a double-buffered device loop (:func:`chainexec.planner.pipeline.deepen`)
    copies back to the host on a stream of their own (``loop.back``), in body order; empty for
    any other loop."""
    if loop.depth < 2 or loop.level != "device":
        return []
    keys = {(tensor, tuple(indices), "device") for tensor, indices in loop.back}
    return [node for node in loop.body if isinstance(node, Op) and node.op == "alloc" and key(node) in keys]


def pattern_key(pattern: tuple[int, ...]) -> str:
    """How :attr:`Op.schedule` names a pattern of equal tile positions
    (:func:`chainexec.ordering.pattern_of`): ``"0,1,1"``."""
    return ",".join(map(str, pattern))


def pattern_of_key(text: str) -> tuple[int, ...]:
    """The pattern :func:`pattern_key` names."""
    return tuple(int(b) for b in text.split(",")) if text else ()


def statement_name(op: str, tensor: str | None = None, group: list[int] | None = None) -> str:
    """The name a statement is timed by (:attr:`chainexec.runtime.accounting.Counters.by_statement`)
    and predicted under (:func:`chainexec.planner.cost.predict`'s ``by_statement``): ``#k`` for
    contraction k, ``#k-#m`` for a run of terms (``group``: its contractions, timed as one),
    ``OP T`` for a statement of kind ``op`` on tensor T, ``OP T #k-#m`` for a fused statement
    standing for the contractions ``group``."""
    if op == "compute":
        return f"#{group[0]}" + (f"-#{group[-1]}" if len(group) > 1 else "")
    return f"{op} {tensor}" + (f" #{group[0]}-#{group[-1]}" if group else "")


def runs(body: list, loop: Loop | None, length=None) -> list[list[int]]:
    """The positions in ``body`` (a nest's, or ``loop``'s) of each run of compute statements, in
    the order the executor meets them (:func:`executed`: without the statements a
    double-buffered loop runs one tile ahead, which may stand between two runs in the body).
    A run starts at each compute statement and is as long as :attr:`Op.run` records, or, with
    ``length``, as ``length(view, n)`` finds for the statement at ``n`` of that order (the
    planner's :func:`term_run`, before the runs are recorded)."""
    view = executed(loop) if loop is not None else body
    position = {id(node): k for k, node in enumerate(body)}
    found, n = [], 0
    while n < len(view):
        node, m = view[n], 0
        if isinstance(node, Op) and node.op == "compute":
            m = (length(view, n) if length is not None else node.run) or 0
        if m:
            found.append([position[id(op)] for op in view[n:n + m]])
        n += max(m, 1)
    return found


@dataclass
class Nest:
    """The loop nest that computes a sub-chain of contractions (one, or several fused).
    ``checkpoint_after``: no global buffer lives past its end, so that what it made is all in
    its stored versions and a run with ``--checkpoint`` may checkpoint there
    (:func:`chainexec.planner.resume.mark`)."""

    contractions: list[int]
    body: list
    checkpoint_after: bool = False
    # Inputs read in rows while the nest's symmetric tile loop already runs
    # (:func:`chainexec.planner.pipeline.streamed`): ``{"loop": its position in body, "rows":
    # {tensor: rows per chunk}}``, or None.
    streamed: dict | None = None


@dataclass
class Plan:
    name: str
    extents: dict[str, int]
    tensors: dict[str, TensorInfo]
    contractions: list[Contraction]
    nests: list[Nest]
    memory_limit: dict[str, int]
    predicted: dict
    scratch: str
    # Every schedule the planner weighed, with its predicted record and whether it was chosen.
    alternatives: list = field(default_factory=list)
    # MPI ranks the parallel loops are spread over and the predicted seconds shared by.
    ranks: int = 1
    # Parallel-loop iterations (device tiles handed to ranks) of the whole plan: what a progress
    # report counts toward.
    parallel_tiles: int = 0
    # Each memory limit and rate planned with: {"value", "from", "detail"} (chainexec.api sets it).
    machine: dict = field(default_factory=dict)
    # Whether the run uses page-locked host buffers and locks its global arrays where they lie
    # (:func:`chainexec.planner.cost.pinned`): what a GPU backend does and the prediction prices.
    pinned: bool = False
    # Inputs mapped from their files whose mapping a pinned run locks in place too, read-only, so
    # that their tiles move to the device by DMA (:func:`chainexec.planner.cost.locked_inputs`).
    locked: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(to_dict(self), indent=1)

    @staticmethod
    def from_json(text: str) -> "Plan":
        return from_dict(json.loads(text))


def _node_to_dict(node) -> dict:
    if isinstance(node, Loop):
        return {"loop": {"level": node.level, "tiles": node.tiles, "parallel": node.parallel,
                         "depth": node.depth, "symmetric": node.symmetric, "ahead": node.ahead,
                         "back": node.back, "resume": node.resume, "count": node.count, "kept": node.kept,
                         "body": [_node_to_dict(n) for n in node.body]}}
    return {"op": {k: v for k, v in asdict(node).items() if v is not None}}


def _node_from_dict(d: dict):
    if "loop" in d:
        loop = d["loop"]
        return Loop(loop["level"], dict(loop["tiles"]), loop["parallel"], [_node_from_dict(n) for n in loop["body"]],
                    int(loop.get("depth", 1)), list(loop.get("symmetric", [])),
                    [[tensor, list(indices)] for tensor, indices in loop.get("ahead", [])],
                    [[tensor, list(indices)] for tensor, indices in loop.get("back", [])], loop.get("resume"),
                    loop.get("count"), [[tensor, list(indices)] for tensor, indices in loop.get("kept", [])])
    op = dict(d["op"])
    if "expression" in op:
        e = op["expression"]
        op["expression"] = Fused(e["out"], tuple(e["out_indices"]), tuple(e["domain"]), e["text"], e["reduce"],
                                 tuple((name, tuple(ix), text) for name, ix, text in e["lets"]))
    return Op(**op)


INTERMEDIATE = re.compile(r"_s[0-9]+_(?:p[0-9]+|d|[0-9]+)")
"""Names the planner gives a statement's intermediates (:func:`chainexec.planner.build.make_plan`:
``_s<statement>_<step>``, ``_s<statement>_p<step>`` of a packed transform, ``_s<statement>_d`` for
a packed result computed dense): a leading ``_``, which no config's name has, so they never
clash with one."""

FORMAT = 4
"""Version of the plan's JSON layout: a plan of another version is not read
(:func:`from_dict`; the plan cache then plans again)."""


def to_dict(plan: Plan) -> dict:
    return {
        "format": FORMAT,
        "name": plan.name,
        "extents": plan.extents,
        "tensors": {k: asdict(v) for k, v in plan.tensors.items()},
        "contractions": [asdict(c) for c in plan.contractions],
        "nests": [{"contractions": n.contractions, "body": [_node_to_dict(x) for x in n.body],
                   "checkpoint_after": n.checkpoint_after, "streamed": n.streamed} for n in plan.nests],
        "memory_limit": plan.memory_limit,
        "predicted": plan.predicted,
        "scratch": plan.scratch,
        "alternatives": plan.alternatives,
        "ranks": plan.ranks,
        "parallel_tiles": plan.parallel_tiles,
        "machine": plan.machine,
        "pinned": plan.pinned,
        "locked": plan.locked,
    }


def from_dict(d: dict) -> Plan:
    """The plan of :func:`to_dict`'s data; raises :class:`ValueError` for another :data:`FORMAT`."""
    if d.get("format") != FORMAT:
        raise ValueError(f"a plan of format {d.get('format')!r}, not {FORMAT}")
    return Plan(
        name=d["name"],
        extents=dict(d["extents"]),
        tensors={k: TensorInfo(**v) for k, v in d["tensors"].items()},
        contractions=[Contraction(**c) for c in d["contractions"]],
        nests=[Nest(list(n["contractions"]), [_node_from_dict(x) for x in n["body"]], bool(n["checkpoint_after"]),
                    n["streamed"]) for n in d["nests"]],
        memory_limit=dict(d["memory_limit"]),
        predicted=d["predicted"],
        scratch=d["scratch"],
        alternatives=list(d.get("alternatives", [])),
        ranks=int(d["ranks"]),
        parallel_tiles=int(d["parallel_tiles"]),
        machine=dict(d["machine"]),
        pinned=bool(d["pinned"]),
        locked=list(d.get("locked", [])),
    )


def term_run(body: list, k: int, contractions: list[Contraction]) -> int:
    """How many compute statements from ``body[k]`` on the device adds in one pass: the statement
    and the ones right after it that add terms of the same kind into the same buffer without
    reading it. Point-wise terms (V's twelve outer products in (T)) run as one point-wise kernel;
    contractions each summing over indices of both operands (W's twelve terms) as one kernel
    that accumulates them in registers (:mod:`chainexec.planner.sumkernel`) or one by one,
    whichever the backend measures faster. The cost model counts one pass over the buffer for a
    point-wise run and one per term for a run of contractions."""
    first = contractions[body[k].contraction]
    n = 1
    for node in body[k + 1:]:
        c = contractions[node.contraction] if isinstance(node, Op) and node.op == "compute" else None
        if not (c and _summand(first) and _summand(c) == _summand(first)
                and (c.out, c.out_indices) == (first.out, first.out_indices)
                and first.out not in (c.a, c.b, first.a, first.b)):
            break
        n += 1
    return n


def _summand(c: Contraction) -> str | None:
    """The kind of term ``c`` is in a run: ``pointwise`` (sums over nothing), ``contraction``
    (sums over indices that both operands hold), else None (not part of a run)."""
    if c.pointwise():
        return "pointwise"
    if c.b is not None and (set(c.a_indices) | set(c.b_indices)) - set(c.out_indices) <= (
            set(c.a_indices) & set(c.b_indices)):
        return "contraction"
    return None
