"""The CuPy backend's autotuner: how a contraction or a run of contractions into one buffer runs
is decided once per (contraction, shapes, strides, dtype, room the plan leaves), by the cost
models (:mod:`chainexec.runtime.backends.costmodel`) and, among the candidates they cannot tell
apart, by timing, and kept for the process (``CupyBackend.choices``) and across processes
(:class:`TuningCache`). A shape whose close candidates include the method decided for its nearest
classmate (:mod:`~chainexec.runtime.backends.shapeclass`) takes it untimed.

The candidates of a single contraction are its methods that apply
(:mod:`chainexec.runtime.backends.methods`), the GETT model's top
:data:`~chainexec.runtime.backends.methods.TUNE_TOP`
configurations each with its staged-epilogue twin (:func:`~chainexec.kernels.gett.candidates`);
those of a run of terms are the candidates of the strategies registered in
:mod:`chainexec.runtime.backends.termruns` (the terms one by one, each by its own tuned method;
the sum kernels of :data:`~chainexec.runtime.backends.termruns.TIMED_SUM_KINDS` for the whole run
and for each split; the stacks). Only the candidates predicted within :attr:`margin`
(``CHAINEXEC_TUNE_MARGIN``, default :data:`~chainexec.runtime.backends.costmodel.MARGIN`) of the
best (a single contraction's also within it of their own method's best, where that is within
:data:`~chainexec.runtime.backends.costmodel.WIDE` of the best) are compiled and timed; one left
is chosen untimed. Each is timed on
the real operands or on a probe of them (:func:`_probe`): one untimed warm-up and the best of
:data:`TIMED_RUNS` CUDA-event-timed runs (:meth:`Autotuner._timed`); the fastest is kept
(:meth:`Autotuner._decide`). The environment variable ``CHAINEXEC_GPU_METHOD`` (one of
:data:`METHODS`) forces a method for benchmarks; a method that does not apply falls back to
``ttgt``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from chainexec import diskstore
from chainexec.errors import ChainexecError
from chainexec.kernels import batchedgemm, stacking
from chainexec.planner.plan import Contraction
from chainexec.runtime import uselog
from chainexec.runtime.backends import costmodel, shapeclass, termruns
from chainexec.runtime.backends.common import (address, element_strides, index_extents, scratch_like, span, spread,
                                               within)
from chainexec.runtime.backends.methods import REGISTRY

METHODS = ("auto", *REGISTRY, *(name for name in termruns.REGISTRY if name != "terms"))
"""Values of ``CHAINEXEC_GPU_METHOD``: ``auto`` (tune), a contraction method
(:data:`chainexec.runtime.backends.methods.REGISTRY`), or a strategy of a run of terms into one
buffer (:data:`chainexec.runtime.backends.termruns.REGISTRY`: ``sum`` / ``summma``, ``split``,
``stack``), whose first candidate that fits then runs without timing the others; a run of terms
under a forced contraction method runs term by term, and a single contraction under a forced
strategy is tuned."""
TIMED_RUNS = 2
"""CUDA-event-timed runs per method in the one-time comparison (the best one counts)."""
PROBE_FLOOR = 1 << 20
"""Output bytes below which probes are not cut even when the plan leaves less room (only the
methods timed in place, :attr:`Method.in_place <chainexec.runtime.backends.methods.Method.in_place>`,
are then timed within the room)."""
TUNE_BYTES = 512 << 20
"""Output bytes above which the autotuner times a probe instead of the whole contraction. A probe
cut too far changes the methods' shapes, not just their sizes: cut along a long (virtual) index,
a (T) tile's batched GEMMs shrink to a few rows and lose to GETT on the probe while they win on
the real tile. The limit is large enough that a (T) tile is cut along its short (occupied)
indices, not its long ones."""


PROBE_CUT = 8
"""A probe's first pass keeps at least ``extent // PROBE_CUT`` elements of each index it cuts
(and 2; :func:`_probe`)."""


def _cut_order(c: Contraction, out, a, b) -> list[int]:
    """``out``'s dimensions in the order :func:`_probe` cuts them: slowest first, except that the
    modes of the in-place batched GEMM's m, n and k (:func:`chainexec.kernels.batchedgemm.plan`)
    come after the others (cut, those change how many GEMMs there are, not their shape), the
    outermost mode of each GEMM dimension, the largest dimension's first, before the inner ones
    (cut, an inner one splits its dimension in two)."""
    sizes = index_extents(c, a, b) | dict(zip(c.out_indices, out.shape))
    strides = tuple(dict(zip(idx, element_strides(x))) for idx, x in
                    ((c.out_indices, out), (c.a_indices, a), (c.b_indices, b)))
    g = batchedgemm.plan(c.out_indices, c.a_indices, c.b_indices, sizes, strides)
    rank = {}
    for n, group in enumerate(sorted(g.dims if g else (), key=lambda group: -math.prod(sizes[i] for i in group))):
        rank |= {i: (2, n) for i in group[:-1]} | {group[-1]: (1, n)}
    slowest = sorted(range(out.ndim), key=lambda d: -out.strides[d])
    return sorted(slowest, key=lambda d: rank.get(c.out_indices[d], (0, 0)))


def _probe(c: Contraction, out, a, b, limit: int = TUNE_BYTES) -> tuple:
    """Views of ``out``, ``a`` and ``b`` cut along ``out``'s slowest indices (the same index in
    the inputs) until the output is at most ``limit`` bytes (:data:`TUNE_BYTES`): the strides, and
    so the memory-access pattern every method sees, stay those of the real operands, at a fraction
    of the cost of timing six methods on a multi-GiB tile. A first pass cuts each index to no fewer
    than ``extent // PROBE_CUT`` elements before it cuts the next, a second (where the first was
    not enough) as far as needed: one index cut to a few elements changes the shape, not just its
    size, where it is one of a GEMM's dimensions (AO→MO's ``out[a, b, cd] = Σ_p x[p, b, cd]
    C[p, a]`` of 352 functions, cut along ``a`` alone, is a GEMM of three columns, on which the
    direct kernel beats cuBLAS, while on the whole tile cuBLAS is far faster). A cut index keeps
    at least 2 elements. Within each pass the in-place GEMM's batch modes are cut first, then the
    outermost mode of its largest dimension (:func:`_cut_order`): a (T) tile's stacked term, W
    in the order ijkabc, ``W[ijkabc] += L[f,i,k,a]·R[f,j,b,c]`` is GEMMs of (bc)×(ka); cut along
    ``a``, the slowest index left, they are GEMMs of (bc)×a, on which TTGT wins the probe and
    loses the tile; cut along ``b``, of (bc/3)×(ka)."""
    views = [out, a, b]
    for capped in (True, False):
        for d in _cut_order(c, out, a, b):
            if views[0].nbytes <= limit:
                return tuple(views)
            name, n = c.out_indices[d], views[0].shape[d]
            keep = max(2, n * limit // views[0].nbytes, n // PROBE_CUT if capped else 0)
            for v, idx in enumerate((c.out_indices, c.a_indices, c.b_indices)):
                if name in idx and keep < n:
                    cut = [slice(None)] * views[v].ndim
                    cut[idx.index(name)] = slice(0, keep)
                    views[v] = views[v][tuple(cut)]
    return tuple(views)


@dataclass
class Choice:
    """How :class:`CupyBackend` contracts one (contraction, shapes, strides, dtype): ``method``
    is ``gett``, ``packed``, ``splitk``, ``batched``, ``relayout``, ``kernel``, ``ttgt``,
    ``einsum``, ``cutensor`` or ``direct``; for a run of contractions into
    one buffer ``sum`` or ``summma`` (a sum kernel), ``terms`` (one by one), ``split`` (some terms in
    a sum kernel, the others one by one) or ``stack`` (the terms that stack as one contraction per
    stack, :mod:`chainexec.kernels.stacking`, the others one by one); ``seconds`` the best timed run of every candidate
    compared (empty when the method was forced, the cost models left one, or a classmate's was
    taken); ``config`` the GETT order (GETT's, packed and split GETT's)
    and configuration (:class:`~chainexec.kernels.gett.GettConfig` fields; split GETT's with its
    ``parts``) or the sum kernel's
    (:class:`~chainexec.kernels.sumkernel.SumConfig`, :class:`~chainexec.kernels.summma.MmaConfig`),
    for ``split`` ``{"kind", "config", "terms"}`` (the kernel, its configuration, the positions of
    its terms), else None."""

    method: str
    seconds: dict = field(default_factory=dict)
    config: dict | None = None


TUNING_VERSION = 22
"""The tuning cache's format version, the first part of every key: raised when methods, GETT
configurations, the probes decisions are made on (:func:`_probe`) or the layout of the store's
files (:class:`chainexec.diskstore.Store`) change, so that decisions recorded by older code are
not read back (nor, in a cache shared with older code, written over by it)."""


def _choice(found, methods) -> Choice | None:
    """The decision ``found`` (a :class:`Choice`'s fields, as its JSON holds them) where it names
    one of ``methods`` (names) with its seconds a mapping and its configuration a mapping or None;
    else None: a decision of another version or program, which a lookup takes as none (the
    contraction is tuned again) rather than fail on later."""
    if not isinstance(found, dict):
        return None
    try:
        choice = Choice(**found)
    except TypeError:
        return None
    fits = (isinstance(choice.method, str) and choice.method in methods and isinstance(choice.seconds, dict)
            and (choice.config is None or isinstance(choice.config, dict)))
    return choice if fits else None


class TuningCache:
    """The autotuner's decisions, kept across processes in ``<kernel cache>/tuning/``, a
    :class:`chainexec.diskstore.Store` readable by the node's other users: one file per decision,
    named by the SHA-256 of its key (the version, the device name, and the contraction, shapes,
    strides, dtype and room), holding the key and the :class:`Choice`. A lookup reads one small
    file: its cost does not grow with the decisions kept, a process reads only the decisions it
    needs, and another process's decision is seen at once. A file whose key is not the one looked
    up, that is damaged (:meth:`chainexec.diskstore.Store.load`) or whose decision does not fit
    (:func:`_choice`) is no decision. A decision found only in the older one-file layout
    (``tuning.json`` beside the folder, read once, on the first miss) is moved to a file of its
    own. Beside them, one file per class of shapes (:mod:`~chainexec.runtime.backends.shapeclass`)
    holds the class's decided shapes (:meth:`classmates`, :meth:`classify`)."""

    def __init__(self, device: str, path: Path):
        self.device = device
        self.store = diskstore.Store(path, TUNING_VERSION, mode=diskstore.SHARED)
        self._legacy: dict | None = None  # the older tuning.json, once read

    @property
    def path(self) -> Path:
        """The folder of the decisions."""
        return self.store.folder

    @classmethod
    def for_device(cls, cupy) -> "TuningCache":
        """The cache of the current CuPy device, in the kernel cache's folder."""
        from chainexec.runtime.kernelcache import made

        return cls(uselog.device_name(cupy), made() / "tuning")

    def _key(self, key: tuple) -> str:
        return self.store.key(self.device, *key)

    def get(self, key: tuple, methods) -> Choice | None:
        """The decision kept for ``key`` where it names one of ``methods`` (the contraction
        methods, or the strategies of a run of terms: :func:`_choice`); else None."""
        text = self._key(key)

        def decision(raw: str) -> Choice | None:
            entry = json.loads(raw)
            ours = isinstance(entry, dict) and entry.get("key") == text
            return _choice(entry.get("choice"), methods) if ours else None

        choice = self.store.load(diskstore.digest(text), decision)
        if choice is not None:
            return choice
        if self._legacy is None:
            found = diskstore.read(self.path.parent / "tuning.json", json.loads)
            self._legacy = found if isinstance(found, dict) else {}
        choice = _choice(self._legacy.get(text), methods)
        if choice is not None:
            self.put(key, choice)
        return choice

    def put(self, key: tuple, choice: Choice) -> None:
        text = self._key(key)
        self.store.save(diskstore.digest(text), json.dumps({"key": text, "choice": asdict(choice)}))

    def classmates(self, signature: list) -> list[tuple[dict[str, int], str]]:
        """The shapes decided in the class ``signature``
        (:mod:`~chainexec.runtime.backends.shapeclass`), as (extents, decision) pairs, oldest
        first; none where the file is absent, damaged or another key's."""
        text = self._key(("class", signature))

        def decided(raw: str) -> list | None:
            entry = json.loads(raw)
            if not isinstance(entry, dict) or entry.get("key") != text:
                return None
            return [({str(i): int(n) for i, n in e.items()}, str(d)) for e, d in entry["shapes"]]

        return self.store.load(diskstore.digest(text), decided) or []

    def classify(self, signature: list, extents: dict[str, int], decision: str) -> list:
        """Add the shape ``extents`` decided as ``decision`` to the class ``signature``'s file (its
        entry for those extents replaced), read again first so that what other processes added
        since is kept (two writing at the same moment can still lose one's shape: a cache, it
        then times that shape again); the latest :data:`~chainexec.runtime.backends.shapeclass.KEPT`
        stay. The class's decided shapes, as :meth:`classmates` reads them."""
        text = self._key(("class", signature))
        shapes = [(e, d) for e, d in self.classmates(signature) if e != extents] + [(extents, decision)]
        shapes = shapes[-shapeclass.KEPT:]
        self.store.save(diskstore.digest(text), json.dumps({"key": text, "shapes": shapes}))
        return shapes


class Autotuner:
    """The autotuner's part of :class:`~chainexec.runtime.backends.cupy.CupyBackend`: it contracts
    (:meth:`contract`, :meth:`contract_sum`) by the decision it makes once and keeps. Its state
    (``method``, ``choices``, ``tuning``, ``workspace``) is made in the backend's ``__init__``."""

    def contract_sum(self, cs: list[Contraction], out, operands: list[tuple], fresh: bool = False) -> None:
        """As :meth:`Backend.contract_sum`: by the strategy
        (:mod:`chainexec.runtime.backends.termruns`: the terms one by one, one sum kernel, a split,
        stacks) decided once per (terms, shapes, strides, dtype, room the plan leaves) and kept
        (:class:`TuningCache`). Deciding times each term on its own (by its own tuned method) on a
        scratch output where the plan leaves room for one, else once for real on ``out``
        (:meth:`_time_terms`), then every timed strategy's candidates whose workspace fits the
        room (:meth:`_tune_run`); the fastest is kept. ``CHAINEXEC_GPU_METHOD`` naming a strategy
        forces its first candidate that fits (the terms one by one where none does); any other
        forced method runs the terms one by one."""
        from chainexec.kernels import sumkernel

        if self.method != "auto" and self.method not in termruns.REGISTRY:
            with self._reusing():
                self.term_by_term(cs, out, operands, fresh)
            return

        def view(arr, indices):
            return sumkernel.View(tuple(indices), tuple(arr.shape), element_strides(arr))

        prob = sumkernel.problem(view(out, cs[0].out_indices),
                                 [sumkernel.Term(view(a, c.a_indices), view(b, c.b_indices), float(c.factor))
                                  for c, (a, b) in zip(cs, operands)], str(out.dtype))
        # the kernels timed are part of the key: a decision made without one is not reused once it joins
        key = (("sum", repr(prob), termruns.TIMED_SUM_KINDS, "stack")
               + (() if self.workspace is None else (self.workspace,)))
        run = termruns.Run(cs, out, operands, prob, key)
        choice = self.choices.get(key) or (self.tuning.get(key, termruns.REGISTRY) if self.method == "auto" else None)
        done = False
        if choice is None:
            if self.method != "auto":
                choice = self._forced_run(run)
            else:
                kept = self._predicted_run(run)
                like = self._like([(v.indices, v.shape, v.strides)
                                   for v in [prob.out, *(x for t in prob.terms for x in (t.a, t.b))]],
                                  prob.dtype, "run " + ",".join(termruns.TIMED_SUM_KINDS))
                choice = self._untimed_run(run, kept, like) or self._reused_run(run, kept, like)
                if choice is None:
                    if fresh:  # timing a term may add it to ``out`` for real
                        self.clear(out)
                        fresh = False
                    each, done = self._time_terms(cs, out, operands)
                    choice = self._tune_run(run, each, kept, like)
        self.choices[key] = choice
        if done:  # timing the terms on ``out`` added them already
            return
        strategy = termruns.REGISTRY[choice.method]
        with self._reusing():
            if fresh and strategy.clears_fresh:
                self.clear(out)
                fresh = False
            strategy.run(self, run, choice.config, fresh)

    def _fits_run(self, strategy, run, config, timing: bool) -> bool:
        """Whether ``strategy``'s workspace for ``config`` (and, ``timing`` it, its scratch output)
        fits in the room the plan leaves (always, without a limit)."""
        if self.workspace is None:
            return True
        scratch = 2 * run.out.nbytes if timing and strategy.timed_on_scratch else 0
        return strategy.workspace(self, run, config) + scratch <= self.workspace

    def _forced_run(self, run) -> Choice:
        """The forced strategy's first candidate that fits, else the terms one by one."""
        strategy = termruns.REGISTRY[self.method]
        for config in strategy.configurations(self, run).values():
            if self._fits_run(strategy, run, config, False):
                return Choice(strategy.name, config=config)
        return Choice("terms")

    def _predicted_run(self, run) -> list:
        """The timed strategies (:mod:`chainexec.runtime.backends.termruns`) whose cost model
        (:meth:`~chainexec.runtime.backends.termruns.Strategy.predicted`, each term on its own at
        its best library method's prediction) is within :attr:`margin` of the best, best first;
        a stack that does not fit the room the plan leaves is not among them."""
        out, terms = run.views
        each = [costmodel.library(out, a, b, run.out.itemsize) for a, b in terms]
        predicted = {name: strategy.predicted(self, run, each) for name, strategy in termruns.REGISTRY.items()
                     if strategy.timed() and self._fits_run(strategy, run, None, False)}
        return [termruns.REGISTRY[name] for name in costmodel.ambiguous(predicted, self.margin)]

    def _fitting(self, strategies, run, timing: bool) -> list[tuple]:
        """(strategy, candidate name, configuration) of each configuration of ``strategies`` that
        fits the room the plan leaves (:meth:`_fits_run`), in their order."""
        return [(strategy, name, config) for strategy in strategies
                for name, config in strategy.configurations(self, run).items()
                if self._fits_run(strategy, run, config, timing)]

    def _untimed_run(self, run, kept: list, like: tuple) -> Choice | None:
        """Where the cost models leave one strategy (``kept``, :meth:`_predicted_run`), it
        (:meth:`_untimed`), kept for the run's classmates too (``like``, :meth:`_like`) where the
        room turned none away (:meth:`_roomy`); else None."""
        return self._untimed(run, kept, like if self._roomy(run) else None) if len(kept) == 1 else None

    def _roomy(self, run) -> bool:
        """Whether the room the plan leaves holds what any strategy could need beside the run:
        a scratch output to time on and a product (4 outputs) and copies of every operand, twice
        (the stacks' copies, a term's relayout or TTGT copies). Only a decision made where the
        room turned nothing away is one for the run's classmates, which may have more room; the
        bound is checked instead of each strategy's configurations, whose search (the sum
        kernels') would cost more than the decision it guards."""
        need = 4 * run.out.nbytes + 2 * sum(x.nbytes for pair in run.operands for x in pair if x is not None)
        return self.workspace is None or need <= self.workspace

    def _reused_run(self, run, kept: list, like: tuple) -> Choice | None:
        """Where the strategies ``kept`` (:meth:`_predicted_run`) include the one decided for the
        run's nearest classmate (:meth:`_alike`), it (:meth:`_untimed`); else None."""
        alike = self._alike(like)
        return self._untimed(run, [s for s in kept if s.name == alike], None)

    def _untimed(self, run, strategies: list, like: tuple | None) -> Choice | None:
        """The first of ``strategies`` with a configuration that fits, at its model's best one,
        kept in the tuning cache untimed (and for the classmates of ``like``); None where none
        fits."""
        found = self._fitting(strategies, run, False)
        if not found:
            return None
        strategy, _, config = found[0]
        return self._decide(run.key, {}, {strategy.name: (strategy.name, config)}, like)

    def _tune_run(self, run, each: list[float], kept: list, like: tuple) -> Choice:
        """Time the candidates that fit of the strategies ``kept`` (:meth:`_predicted_run`; of
        every timed strategy where none of theirs fits; their generated kernels compiled first,
        together) and keep the fastest under the run's key and, where the room turned none away
        (:meth:`_roomy`), for its classmates (``like``); ``each``: the seconds of each term on its
        own."""
        cands = (self._fitting(kept, run, True)
                 or self._fitting([s for s in termruns.REGISTRY.values() if s.timed()], run, True))
        self._compile([k for strategy, _, config in cands for k in strategy.kernels(run, config)])
        seconds = {name: strategy.seconds(self, run, config, each) for strategy, name, config in cands}
        return self._decide(run.key, seconds, {name: (strategy.name, config) for strategy, name, config in cands},
                            like if self._roomy(run) else None)

    @staticmethod
    def _stacks(cs: list[Contraction], out, operands: list[tuple]) -> list:
        """:func:`chainexec.kernels.stacking.groups` of a run's terms at these extents."""
        extents = [dict(zip(c.out_indices, out.shape)) | index_extents(c, a, b) for c, (a, b) in zip(cs, operands)]
        return stacking.groups(tuple(cs[0].out_indices), [(tuple(c.a_indices), tuple(c.b_indices)) for c in cs],
                               extents)

    def _stacked(self, stacks: list, cs: list[Contraction], out, operands: list[tuple], fresh: bool = False) -> None:
        """Add each stack's terms to ``out`` as one contraction (:mod:`chainexec.kernels.stacking`)
        on copies of their operands concatenated along a new summed index, each term's factor
        in its ``L`` rows; that contraction is tuned as any other (:meth:`contract`), the first
        ``fresh`` where ``out`` is. While it runs the copies count against :attr:`workspace`.
        A copy the next stack would make again (the same views of the same memory, the same
        factors: in a (T) tile, ``ovvv[i,a,f,b] ⊕ -t2[m,i,b,a]`` is also ``ovvv[i,a,f,c] ⊕
        -t2[m,i,c,a]``) is kept for it instead of dropped, so no more than one stack's copies
        exist at a time, beside those held across runs (:meth:`_stack_side`), which stay while
        they fit: in (T) the next tile's stacks read those over ``ovvv[j]`` and ``ovvv[k]`` again
        while ``i`` moves on, and a later row of tiles those over the ``ovvv[i]`` of the rows
        before."""
        extent = dict(zip(cs[0].out_indices, out.shape))
        sides = [self._stack_sides(st, cs, operands, extent) for st in stacks]
        owner = tuple(c.id for c in cs)
        read = {("stack", owner, key) for side in sides for key, _, _ in side}
        kept: dict[tuple, object] = {}
        for n, st in enumerate(stacks):
            self._drop_kept()  # no earlier term's relayout copy held beside this stack's
            left, right = (self._stack_side(("stack", owner, key), parts, shape, out.dtype, kept, read)
                           for key, parts, shape in sides[n])
            following = {key for key, _, _ in sides[n + 1]} if n + 1 < len(stacks) else set()
            kept = {key: copy for (key, _, _), copy in zip(sides[n], (left, right)) if key in following}
            name = next(f"stacked{k}" for k in range(len(cs[0].out_indices) + 1)
                        if f"stacked{k}" not in cs[0].out_indices)
            merged = replace(cs[st.terms[0]], a="stacked", a_indices=[name, *st.left], b="stacked",
                             b_indices=[name, *st.right], factor=1.0)
            room = self.workspace
            if room is not None:
                self.workspace = room - left.nbytes - right.nbytes
            try:
                self.contract(merged, out, left, right, fresh and st is stacks[0])
            finally:
                self.workspace = room
            del left, right  # freed before the next stack's copies, unless kept for it or held

    def _stack_side(self, slot: tuple, parts: list[tuple], shape: tuple, dtype, kept: dict, read: set):
        """One side of a stack (``slot``: ("stack", the run's contraction ids, the key of
        :meth:`_stack_sides`); its ``parts``): the copy ``kept`` from the previous stack or held
        from an earlier run where either holds the same, else a new one (:meth:`_stack_copy`). A
        new copy whose parts all lie in :meth:`steady` arrays is held across runs, as relayout
        copies are, where it fits in the room :meth:`steady` sets aside for held copies once the
        held stack sides least recently read that no stack of this run reads (``read``: the
        run's slots) are dropped (:meth:`~chainexec.runtime.backends.methods.Methods._room_for`;
        where the plan sets no room, every held side stays until :meth:`steady` ends)."""
        key = slot[2]
        if key in kept:
            return kept[key]
        if slot in self._held:
            self._held[slot] = self._held.pop(slot)  # the most recently read last
            return self._held[slot][1]
        reach = tuple(span(x) for _, x, _ in parts)
        hold = bool(self._steady) and within(reach, self._steady) and self._room_for(
            math.prod(shape) * self.xp.dtype(dtype).itemsize, read)
        copy = self._stack_copy(parts, shape, dtype)
        if hold:
            self._held[slot] = (key, copy, reach)
        return copy

    @staticmethod
    def _stack_sides(st, cs: list[Contraction], operands: list[tuple], extent: dict) -> list[tuple]:
        """A stack's ``L`` and ``R`` operands as (key, parts, shape): each part a term's factor
        (1 on ``R``), its operand viewed over the summed indices then the side's indices, and the
        number of summed ones; the key says what the copy holds (the parts' factors, memory,
        shapes, strides, dtypes and summed indices, and the copy's shape)."""
        lefts, rights = [], []
        for n, side in zip(st.terms, st.sides):
            c, (a, b) = cs[n], operands[n]
            (x, xi), (y, yi) = ((a, c.a_indices), (b, c.b_indices))[::1 if side else -1]
            ks = [i for i in xi if i in yi and i not in c.out_indices]
            lefts.append((c.factor, spread(x, xi, ks + list(st.left)), len(ks)))
            rights.append((1.0, spread(y, yi, ks + list(st.right)), len(ks)))
        depth = sum(math.prod(x.shape[:nk]) for _, x, nk in lefts)
        shapes = [(depth,) + tuple(extent[i] for i in names) for names in (st.left, st.right)]
        return [(tuple((f, address(x), x.shape, x.strides, x.dtype.str, nk) for f, x, nk in parts) + (shape,), parts,
                 shape) for parts, shape in zip((lefts, rights), shapes)]

    def _stack_copy(self, parts: list[tuple], shape: tuple, dtype):
        """One side of a stack (:meth:`_stack_sides`): its parts copied one after another along
        the stacked summed index, each times its factor."""
        copy = self.xp.empty(shape, dtype)
        at = 0
        for factor, x, nk in parts:
            k = math.prod(x.shape[:nk])
            self.assign(copy[at:at + k].reshape(x.shape), x, factor)
            at += k
        return copy

    def _time_terms(self, cs: list[Contraction], out, operands: list[tuple]) -> tuple[list[float], bool]:
        """Seconds of each term on its own, and whether ``out`` got them: timed on a scratch
        output (:func:`scratch_like`) after a warm-up where the plan leaves room for two outputs, else
        run once on ``out`` itself (their first run, a little slower than later ones)."""
        keys = [self._kept_key(c, out, a, b) for c, (a, b) in zip(cs, operands)]
        pending = {}  # the terms still to tune: (contraction, probe, candidates), kernels compiled together first
        for key, c, (a, b) in zip(keys, cs, operands):
            if key in self.choices or key in pending:
                continue
            found = self.tuning.get(key, REGISTRY)
            if found is not None:
                self.choices[key] = found
            else:
                pending[key] = (c, *self._timed_candidates(c, out, a, b))
        self._precompile(list(pending.values()))
        hows = [self._choose(c, out, a, b, pending[key][1:] if key in pending else None)  # tuned on probes
                for key, c, (a, b) in zip(keys, cs, operands)]
        if self.workspace is None or 2 * out.nbytes <= self.workspace:
            scratch = scratch_like(self.xp, out)
            return [self._timed(lambda: self._run(how, c, scratch, a, b))
                    for how, c, (a, b) in zip(hows, cs, operands)], False
        events = [self.xp.cuda.Event() for _ in range(len(cs) + 1)]
        events[0].record()
        for how, c, (a, b), end in zip(hows, cs, operands, events[1:]):
            self._run(how, c, out, a, b)
            end.record()
        events[-1].synchronize()
        return [self.xp.cuda.get_elapsed_time(s, e) / 1e3 for s, e in zip(events, events[1:])], True

    def contract(self, c: Contraction, out, a, b, fresh: bool = False) -> None:
        """``out += c.factor · a·b`` on the GPU by the chosen method; see :class:`Backend`. A
        ``fresh`` output is written by cuBLAS with β = 0 where batched GEMM runs it (no zero fill
        and no read of ``out``: each is a pass over the whole tile), else cleared first
        (:meth:`_run`).

        When the chosen method's workspace does not fit in the device memory left (CuPy's
        OutOfMemoryError, also under a pool limit), the contraction runs through GETT where it
        applies, else the direct kernel: neither needs any (``out`` is untouched by the failed
        attempt: every method adds its product only once it is complete, but pipelined TTGT,
        which adds chunk by chunk and raises :class:`ChainexecError` where it runs short after
        a chunk's add)."""
        if b is None or c.pointwise():
            self.contract_terms([c], out, [(a, b)], fresh)
        else:
            how = self._choose(c, out, a, b)
            try:
                self._run(how, c, out, a, b, fresh)
            except self.xp.cuda.memory.OutOfMemoryError:
                if REGISTRY[how[0]].in_place and not REGISTRY[how[0]].workspace(out, a, b):
                    raise ChainexecError(f"device memory: none left for {c.out}[{','.join(c.out_indices)}] += "
                                         f"{c.a}·{c.b} ({how[0]}, tile {'x'.join(map(str, out.shape))}); "
                                         f"lower machine.device_memory") from None
                gp = self._problem(c, out, a, b)
                fallback = ("direct", None) if gp is None else ("gett", {"order": gp[1][0][0], **asdict(gp[1][0][1])})
                self._run(fallback, c, out, a, b, fresh)
                self.choices[self._kept_key(c, out, a, b)] = Choice(fallback[0], config=fallback[1])
        pool = self.xp.get_default_memory_pool()
        if self.memory is not None and pool.total_bytes() > self.memory and pool.free_bytes():
            # the pool caches the temporaries of differently shaped tiles: kept, they outgrow
            # the room the plan leaves even where every choice fits in it
            pool.free_all_blocks()

    def _choose(self, c: Contraction, out, a, b, prepared: tuple | None = None) -> tuple:
        """(method, GETT config or None) for these operands, decided once: forced by
        ``CHAINEXEC_GPU_METHOD``, else read from the tuning cache, else timed (the model
        proposes the GETT configurations; the fastest candidate wins) and recorded. Large
        operands are timed on a probe (:func:`_probe`): the same strides over fewer elements.
        ``prepared``: the probe and candidates of a contraction known to need timing
        (:meth:`_time_terms` found them and compiled their kernels)."""
        kept = self._kept_key(c, out, a, b)
        choice = self.choices.get(kept)
        if choice is None:
            if self.method in REGISTRY:  # under a forced strategy of runs, single contractions are tuned
                cands = self._candidates(c, out, a, b)
                forced = [m for m in cands if m.split(":")[0] == self.method] or ["ttgt"]
                choice = Choice(forced[0].split(":")[0], config=cands[forced[0]])
            else:
                choice = None if prepared is not None else self.tuning.get(kept, REGISTRY)
                if choice is None:
                    self._drop_kept()  # no relayout copy of an earlier term held while tuning this one
                    if prepared is None:
                        prepared = self._timed_candidates(c, out, a, b)
                        self._precompile([(c, *prepared)])
                    (po, pa, pb), cands, like = prepared
                    seconds = ({} if len(cands) == 1 else  # one left (by the models or a classmate): untimed
                               {m: self._time((m.split(":")[0], cfg), c, po, pa, pb) for m, cfg in cands.items()})
                    choice = self._decide(kept, seconds, {m: (m.split(":")[0], cfg) for m, cfg in cands.items()},
                                          like)
                    # the candidates' temporaries and scratch outputs, cached by CuPy's pool, are
                    # not needed again: left there, they hold the pool above the plan's buffers
                    self.xp.get_default_memory_pool().free_all_blocks()
            self.choices[kept] = choice
        return choice.method, choice.config

    def _timed_candidates(self, c: Contraction, out, a, b) -> tuple[tuple, dict, tuple | None]:
        """The probe (:func:`_probe`, at least :data:`PROBE_FLOOR` output bytes: smaller ones
        change every method's shape) a contraction's candidates are timed on, those candidates
        (name -> configuration), and the class (:meth:`_like`) their decision is kept for. The
        candidates: of the ones whose temporaries fit the room the plan leaves (else those that
        make none, else all), those the cost models predict on the probe within :attr:`margin` of
        the best (:func:`chainexec.runtime.backends.costmodel.ambiguous`); where several are and
        the method decided for the nearest classmate (:meth:`_alike`) is among them, only its
        best-predicted candidate, and no class (a reused decision is not one to reuse). No class
        either where the room turned candidates away: a classmate may have more. One candidate
        left is chosen untimed."""
        limit = TUNE_BYTES if self.workspace is None else min(TUNE_BYTES, max(PROBE_FLOOR, self.workspace // 4))
        po, pa, pb = _probe(c, out, a, b, limit)
        every = self._candidates(c, po, pa, pb)
        fitting = {m: cfg for m, cfg in every.items() if self._fits(m.split(":")[0], (out, a, b), (po, pa, pb))}
        cands = (fitting or {m: cfg for m, cfg in every.items() if not REGISTRY[m.split(":")[0]].workspace(out, a, b)}
                 or every)
        close = costmodel.ambiguous(self._predicted(c, po, pa, pb, cands), self.margin, costmodel.WIDE)
        like = self._like([(c.out_indices, out.shape, element_strides(out)), (c.a_indices, a.shape, element_strides(a)),
                           (c.b_indices, b.shape, element_strides(b))], str(out.dtype), "one")
        alike = self._alike(like) if len(close) > 1 else None
        same = [m for m in close if m.split(":")[0] == alike]
        if same:
            return (po, pa, pb), {same[0]: cands[same[0]]}, None
        return (po, pa, pb), {m: cands[m] for m in close}, like if len(fitting) == len(every) else None

    def _predicted(self, c: Contraction, out, a, b, cands: dict) -> dict[str, float]:
        """Candidate -> the cost model's seconds for these operands
        (:func:`chainexec.runtime.backends.costmodel.predict`)."""
        ops = [costmodel.operand(i, x) for i, x in ((c.out_indices, out), (c.a_indices, a), (c.b_indices, b))]
        gett = any(m.split(":")[0] in ("gett", "packed", "splitk") for m in cands)  # only GETT's models count the SMs
        sm_count = self.xp.cuda.Device().attributes["MultiProcessorCount"] if gett else 0
        return {m: costmodel.predict(m.split(":")[0], cfg, *ops, out.itemsize, sm_count) for m, cfg in cands.items()}

    def _precompile(self, timings: list[tuple]) -> None:
        """Compile together the generated kernels of every contraction candidate about to be
        timed (:meth:`_compile`): ``timings`` holds (contraction, its probe's (out, a, b),
        candidates, class)."""
        self._compile([k for c, (po, pa, pb), cands, _ in timings for name, config in cands.items()
                       for k in REGISTRY[name.split(":")[0]].kernels(self, config, c, po, pa, pb)])

    @staticmethod
    def _compile(kernels: list[tuple[str, str, tuple]]) -> None:
        """Compile ``kernels`` ((name, CUDA source, compiler options)) together, in threads, per
        set of options (:func:`chainexec.runtime.kernelcache.precompile`; those in the disk cache
        are skipped). Loaded one by one at their first timed launch, their NVRTC seconds would
        add up, candidate after candidate."""
        from chainexec.runtime import kernelcache, launch

        groups: dict[tuple, list] = {}
        for name, source, options in kernels:
            groups.setdefault(options, []).append((name, source))
        if groups:
            capability = launch.device_model().compute_capability
            for options, sources in groups.items():
                kernelcache.precompile(sources, capability, options)

    def _decide(self, key: tuple, seconds: dict, how: dict, like: tuple | None = None) -> Choice:
        """The fastest of the timed candidates (``seconds``: candidate -> best seconds; ``how``:
        candidate -> (method, configuration)), or the only candidate where none was timed, kept in
        the tuning cache under ``key`` and, where ``like`` names the shape's class
        (:meth:`_like`), for its classmates."""
        method, config = how[min(seconds, key=seconds.get) if seconds else next(iter(how))]
        choice = Choice(method, seconds, config)
        self.tuning.put(key, choice)
        if like is not None:
            self._learn(like, method)
        return choice

    @staticmethod
    def _like(views, dtype: str, kind: str) -> tuple:
        """The class of a shape (:mod:`~chainexec.runtime.backends.shapeclass`) as the autotuner
        keeps it: the signature of ``views`` ((indices, shape, strides) each), its JSON text, and
        the extents."""
        signature = shapeclass.signature(views, dtype, kind)
        return signature, json.dumps(signature), shapeclass.extents(views)

    def _classmates(self, like: tuple) -> list:
        """The decided shapes of the class ``like`` (:meth:`_like`): this process's list, read
        from the tuning cache once per class."""
        signature, text, _ = like
        shapes = self.classes.get(text)
        if shapes is None:
            shapes = self.classes[text] = self.tuning.classmates(signature)
        return shapes

    def _alike(self, like: tuple) -> str | None:
        """The method (or run strategy) decided for the nearest classmate of the shape ``like``
        (:func:`~chainexec.runtime.backends.shapeclass.nearest`), or None."""
        return shapeclass.nearest(self._classmates(like), like[2])

    def _learn(self, like: tuple, method: str) -> None:
        """Keep ``method`` as the decision for the shape ``like``, for its later classmates in this
        process and in others (:meth:`TuningCache.classify`, which also brings in what other
        processes decided in the class since this one read it)."""
        signature, text, extents = like
        self.classes[text] = self.tuning.classify(signature, extents, method)

    def _kept_key(self, c: Contraction, out, a, b) -> tuple:
        """The key a method choice is kept under, in this process and in the tuning cache alike:
        :meth:`_key` and the room the plan leaves now (:attr:`workspace`). A choice made within
        less room is not read where a run leaves more: it tunes again. The process keys its
        own choices by the room too: a stack's contractions are tuned first while the stack
        itself is timed (within the room less a scratch tile); keyed without the room, the run
        would reuse that choice and never record one under the room it runs in, and each later
        process would tune them again."""
        key = self._key(c, out, a, b)
        return key if self.workspace is None else key + (self.workspace,)

    def _fits(self, method: str, tile: tuple, probe: tuple) -> bool:
        """Whether ``method``'s temporaries for the ``tile`` operands (out, a, b) — and, timing
        it on ``probe``, the probe's temporaries plus its scratch output (at most twice the
        probe's output, :func:`scratch_like`; GETT times in place) —
        fit in the memory the plan leaves (:meth:`limit_memory`; always, without a limit)."""
        if self.workspace is None:
            return True
        strategy = REGISTRY[method]
        scratch = 0 if strategy.in_place else 2 * probe[0].nbytes
        return max(strategy.workspace(*tile), strategy.workspace(*probe) + scratch) <= self.workspace

    def _time(self, how: tuple, c: Contraction, out, a, b) -> float:
        """Seconds of one contraction by ``how = (method, config)`` (best of :data:`TIMED_RUNS`
        after one warm-up, CUDA events). The methods timed in place (GETT and the direct kernel,
        :attr:`~chainexec.runtime.backends.methods.Method.in_place`) run in place
        with a factor of 0 (their cost does not depend on it, and ``out`` keeps its strides, which
        their speed depends on; a finite result is unchanged); the others write a scratch output with ``out``'s strides
        where its span is at most twice its size (:func:`scratch_like`), so that layouts that depend on
        strides, as batched GEMM's do, are timed as they will run."""
        strategy = REGISTRY[how[0]]
        if strategy.in_place:
            def run():
                strategy.add(self, how[1], c, out, a, b, 0.0)
        else:
            scratch = []

            def run():
                if not scratch:
                    scratch.append(scratch_like(self.xp, out))
                self._run(how, c, scratch[0], a, b)
        return self._timed(run)

    @uselog.paused()  # a candidate's kernels and calls are no use to a later warm-up
    def _timed(self, run) -> float:
        """Seconds of ``run()`` on the device: one untimed warm-up, then the best of
        :data:`TIMED_RUNS` CUDA-event-timed runs; ``inf`` if it cannot launch here (resources).
        No relayout copy is kept between the runs (:meth:`_reusing`, :meth:`steady`): each pays
        for its own."""
        cp = self.xp
        kept, self._kept = self._kept, None
        steady, self._steady = self._steady, None
        if kept:
            kept.clear()
        self._held.clear()
        began = time.perf_counter()
        self._timing += 1
        try:
            try:
                run()
            except Exception:  # a candidate that cannot launch here is not chosen
                return math.inf
            start, end = cp.cuda.Event(), cp.cuda.Event()
            best = math.inf
            for _ in range(TIMED_RUNS):
                start.record()
                run()
                end.record()
                end.synchronize()
                best = min(best, cp.cuda.get_elapsed_time(start, end) / 1e3)
            return best
        finally:
            self._timing -= 1
            if not self._timing:
                self.tuned_seconds += time.perf_counter() - began
            self._kept = kept
            self._steady = steady
