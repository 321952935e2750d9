"""How the CuPy backend adds a run of contractions into one buffer (``out += Σ_t f_t·A_t·B_t``, the
(T) ``W`` tile's twelve terms, say): each way a registered strategy (:class:`Strategy`, one class
each, in :data:`REGISTRY`) that says which configurations the autotuner times, the device bytes it
holds beside the output, and how it runs. The autotuner
(:meth:`chainexec.runtime.backends.tuning.Autotuner.contract_sum`) times every strategy's
candidates once per run shape and keeps the fastest; ``CHAINEXEC_GPU_METHOD`` set to a strategy's
name forces its first candidate that fits.

- ``terms``: the terms one by one, each by the contraction method the autotuner picks for it
  (:mod:`chainexec.runtime.backends.methods`).
- ``sum`` / ``summma``: one generated kernel that accumulates every term and adds to ``out`` once
  (:data:`chainexec.runtime.launch.SUM_KINDS`: in registers, :mod:`chainexec.kernels.sumkernel`,
  or on tensor cores into a shared-memory tile, :mod:`chainexec.kernels.summma`).
- ``split``: the terms with short summed ranges in one sum kernel, the others one by one
  (:func:`chainexec.kernels.sumkernel.splits`).
- ``stack``: terms that split the output alike as one contraction over their summed ranges
  concatenated, on copies of their small operands (:mod:`chainexec.kernels.stacking`), the others
  one by one.

No strategy wins everywhere: on a (T) tile the register kernel and the terms one by one (batched
GEMM on tensor cores) are close, and the register kernel wins where the terms sum over short ranges
(``benchmarks/sum_tile.py`` compares them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from chainexec.planner.plan import Contraction
from chainexec.runtime.backends import costmodel
from chainexec.runtime.backends.common import scratch_like

TIMED_SUM_KINDS = ("sum",)
"""The sum kernels (:data:`chainexec.runtime.launch.SUM_KINDS`) whose candidates the autotuner
times against the terms one by one. The tensor-core kernel (``summma``) joins them once it has
run on a GPU: until then it runs only where forced."""


@dataclass
class Run:
    """A run of terms into one buffer as the strategies see it: the contractions ``cs`` (one
    output, one output index order), the output array ``out``, each term's (A, B) ``operands``,
    the run as a sum-kernel problem (:func:`chainexec.kernels.sumkernel.problem`: its views' shapes
    and strides) and the ``key`` its decision is kept under."""

    cs: list[Contraction]
    out: object
    operands: list[tuple]
    problem: object
    key: tuple

    @cached_property
    def views(self) -> tuple:
        """The cost models' view of the run: the output's and each term's operands'
        :class:`~chainexec.runtime.backends.costmodel.Operand` (made once per run)."""
        out = costmodel.operand(self.cs[0].out_indices, self.out)
        return out, [(costmodel.operand(c.a_indices, a), costmodel.operand(c.b_indices, b))
                     for c, (a, b) in zip(self.cs, self.operands)]

    def others(self, part) -> tuple[list[Contraction], list[tuple]]:
        """The terms (contractions, operands) whose positions are not in ``part``."""
        rest = [k for k in range(len(self.cs)) if k not in part]
        return [self.cs[k] for k in rest], [self.operands[k] for k in rest]


class Strategy:
    """One way to add a run of terms into its output: one of the autotuner's candidates for a run.
    ``tuner`` is the :class:`~chainexec.runtime.backends.cupy.CupyBackend` (its autotuner and
    contraction methods); ``each`` the seconds of each term run on its own, the price of the terms
    a strategy leaves to run one by one."""

    name: str
    clears_fresh = False
    """Adds to ``out``: a ``fresh`` output is cleared first."""
    timed_on_scratch = False
    """Timed writing a scratch output shaped as ``out`` (up to twice its bytes,
    :func:`~chainexec.runtime.backends.common.scratch_like`), not on ``out`` itself."""

    def timed(self) -> bool:
        """Whether the autotuner times its candidates unasked (else only a forced method runs it)."""
        return True

    def configurations(self, tuner, run: Run) -> dict:
        """Candidate name -> configuration (plain data, or None), in the order they are timed;
        empty where the strategy does not apply to this run."""
        return {self.name: None}

    def workspace(self, tuner, run: Run, config) -> int:
        """Device bytes it holds beside the run's operands and output while it runs."""
        return 0

    def kernels(self, run: Run, config) -> list[tuple[str, str, tuple]]:
        """The generated kernels (name, CUDA source, compiler options) it launches: compiled
        together, in threads, before any candidate is timed
        (:meth:`~chainexec.runtime.backends.tuning.Autotuner._compile`)."""
        return []

    def predicted(self, tuner, run: Run, each: list[float]) -> float:
        """The cost models' seconds of the whole run this way at its best configuration (a lower
        bound where its configurations are found by a search of their own), ``each`` the predicted
        seconds of each term on its own (:mod:`chainexec.runtime.backends.costmodel`)."""
        raise NotImplementedError

    def seconds(self, tuner, run: Run, config, each: list[float]) -> float:
        """Seconds of the whole run this way (the best of the timed runs of its own part, plus
        the terms it leaves one by one at their ``each``); ``out`` keeps its values."""
        raise NotImplementedError

    def run(self, tuner, run: Run, config, fresh: bool) -> None:
        """``out += Σ_t f_t·A_t·B_t`` (``out = …`` where ``fresh``)."""
        raise NotImplementedError


def stacked_bytes(stacks: list, operands: list[tuple], itemsize: int) -> int:
    """Device bytes of the copies :meth:`~chainexec.runtime.backends.tuning.Autotuner._stacked`
    holds at once (one stack's, in the output's dtype of ``itemsize`` bytes)."""
    return itemsize * max((sum(a.size + b.size for k in st.terms for a, b in [operands[k]]) for st in stacks),
                          default=0)


def _candidates(kind: str, problem) -> list:
    """The sum kernel ``kind``'s configurations for ``problem`` the model ranks best, best first;
    none where none fits the device."""
    from chainexec.runtime import launch

    try:
        return launch.SUM_KINDS[kind][0].candidates(problem, launch.device_model())
    except ValueError:
        return []


def _launch(kind: str, problem, config: dict, out, operands: list[tuple], store: bool = True) -> None:
    """The sum kernel ``kind`` of ``config`` (its JSON form) over ``problem``."""
    from chainexec.runtime import launch

    launch.launch_sum(kind, problem, launch.SUM_KINDS[kind][1].from_json(config), out, operands, store)


def _source(kind: str, problem, config: dict) -> tuple[str, str, tuple]:
    """(name, CUDA source, compiler options) of the sum kernel ``kind`` of ``config`` over ``problem``."""
    from chainexec.runtime import kernelcache, launch

    gen, cls = launch.SUM_KINDS[kind]
    return (*gen.generate(problem, cls.from_json(config)), kernelcache.OPTIONS)


class Terms(Strategy):
    """The terms one by one, each by its own tuned method
    (:meth:`~chainexec.runtime.backends.tuning.Autotuner.term_by_term`)."""

    name = "terms"

    def predicted(self, tuner, run, each) -> float:
        return sum(each)

    def seconds(self, tuner, run, config, each) -> float:
        return sum(each)

    def run(self, tuner, run, config, fresh) -> None:
        tuner.term_by_term(run.cs, run.out, run.operands, fresh)


class SumKernel(Strategy):
    """All the terms in one generated sum kernel of kind ``kind``; timed computing without storing
    (one pass over the output fewer than the terms' times hold, so close decisions lean towards
    the kernels)."""

    clears_fresh = True

    def __init__(self, kind: str):
        self.name = kind

    def timed(self) -> bool:
        return self.name in TIMED_SUM_KINDS

    def predicted(self, tuner, run, each) -> float:
        out, terms = run.views
        return costmodel.sum_kernel(out, terms, run.out.itemsize, self.name == "summma")

    def configurations(self, tuner, run) -> dict:
        return {f"{self.name} {cfg.name()}": cfg.to_json() for cfg in _candidates(self.name, run.problem)}

    def kernels(self, run, config) -> list:
        return [_source(self.name, run.problem, config)]

    def seconds(self, tuner, run, config, each) -> float:
        return tuner._timed(lambda: _launch(self.name, run.problem, config, run.out, run.operands, False))

    def run(self, tuner, run, config, fresh) -> None:
        _launch(self.name, run.problem, config, run.out, run.operands)


class Split(Strategy):
    """Each split's terms (:func:`chainexec.kernels.sumkernel.splits`) in one sum kernel of
    :data:`TIMED_SUM_KINDS`, the others one by one; ``config`` is ``{"kind", "config", "terms"}``
    (the kernel, its configuration, the positions of its terms). Forced, the register kernel's
    first configuration of the first split."""

    name = "split"
    clears_fresh = True

    def predicted(self, tuner, run, each) -> float:
        from chainexec.kernels import sumkernel

        out, terms = run.views
        kinds = TIMED_SUM_KINDS if tuner.method == "auto" else ("sum",)
        return min((costmodel.sum_kernel(out, [terms[k] for k in part], run.out.itemsize, kind == "summma")
                    + sum(s for k, s in enumerate(each) if k not in part)
                    for part in sumkernel.splits(run.problem) for kind in kinds), default=math.inf)

    def configurations(self, tuner, run) -> dict:
        from chainexec.kernels import sumkernel

        kinds = TIMED_SUM_KINDS if tuner.method == "auto" else ("sum",)
        return {f"split {kind} {cfg.name()} terms {','.join(map(str, part))}":
                {"kind": kind, "config": cfg.to_json(), "terms": list(part)}
                for part in sumkernel.splits(run.problem) for kind in kinds
                for cfg in _candidates(kind, run.problem.part(part))}

    def kernels(self, run, config) -> list:
        return [_source(config["kind"], run.problem.part(tuple(config["terms"])), config["config"])]

    def seconds(self, tuner, run, config, each) -> float:
        part = config["terms"]
        sub, ops = run.problem.part(tuple(part)), [run.operands[k] for k in part]
        rest = sum(s for k, s in enumerate(each) if k not in part)
        return rest + tuner._timed(lambda: _launch(config["kind"], sub, config["config"], run.out, ops, False))

    def run(self, tuner, run, config, fresh) -> None:
        part = config["terms"]
        _launch(config["kind"], run.problem.part(tuple(part)), config["config"], run.out,
                [run.operands[k] for k in part])
        cs, ops = run.others(part)
        tuner.term_by_term(cs, run.out, ops)


class Stack(Strategy):
    """The terms that stack (:func:`chainexec.kernels.stacking.groups`) as one contraction per
    stack, tuned as any other (:meth:`~chainexec.runtime.backends.tuning.Autotuner._stacked`), the
    others one by one; it holds one stack's operand copies at a time
    (:func:`stacked_bytes`)."""

    name = "stack"
    timed_on_scratch = True

    @staticmethod
    def _found(tuner, run) -> tuple[list, list[int]]:
        """The run's stacks and the positions of the terms in none, found once per run key (kept
        in the backend's ``_stack_runs``), not again for every question or tile."""
        if run.key not in tuner._stack_runs:
            stacks = tuner._stacks(run.cs, run.out, run.operands)
            tuner._stack_runs[run.key] = stacks, [k for k in range(len(run.cs))
                                                  if not any(k in st.terms for st in stacks)]
        return tuner._stack_runs[run.key]

    def predicted(self, tuner, run, each) -> float:
        stacks, alone = self._found(tuner, run)
        if not stacks:
            return math.inf
        out, terms = run.views
        return (sum(costmodel.stacked(out, [terms[k] for k in st.terms], tuple(st.left), tuple(st.right),
                                      run.out.itemsize) for st in stacks)
                + sum(each[k] for k in alone))

    def configurations(self, tuner, run) -> dict:
        return {"stack": None} if self._found(tuner, run)[0] else {}

    def workspace(self, tuner, run, config) -> int:
        return stacked_bytes(self._found(tuner, run)[0], run.operands, run.out.itemsize)

    def seconds(self, tuner, run, config, each) -> float:
        stacks, alone = self._found(tuner, run)
        scratch = scratch_like(tuner.xp, run.out)
        rest = sum(each[k] for k in alone)
        room = tuner.workspace
        # the stacked contractions are first tuned inside this timing, beside the scratch
        tuner.workspace = None if room is None else room - scratch.nbytes
        try:
            return rest + tuner._timed(lambda: tuner._stacked(stacks, run.cs, scratch, run.operands))
        finally:
            tuner.workspace = room

    def run(self, tuner, run, config, fresh) -> None:
        stacks, alone = self._found(tuner, run)
        tuner._stacked(stacks, run.cs, run.out, run.operands, fresh)
        tuner.term_by_term([run.cs[k] for k in alone], run.out, [run.operands[k] for k in alone],
                           fresh and not stacks)


REGISTRY = {s.name: s for s in (Terms(), SumKernel("sum"), SumKernel("summma"), Split(), Stack())}
"""The strategies of a run of terms by name, in the order the autotuner times their candidates."""
