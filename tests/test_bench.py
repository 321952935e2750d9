"""The TCCG bench's CPU-side helpers (the bench itself needs a GPU: ``docs/kernels.md``)."""

import json
import math
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from chainexec.bench import (_contiguous, _in_layout, bound_ms, contenders, load_cases, rounds, summary, time_together,
                             worst)
from chainexec.errors import ChainexecError

from tests.conftest import TCCG, assert_refused, run_cli

CASES = json.loads(TCCG.read_text())


@pytest.mark.parametrize("errors,expected", [((1e-15, 3e-15, 2e-15), 3e-15), ((4e-16,), 4e-16)])
def test_worst_error_is_the_largest(errors, expected):
    assert worst(*errors) == expected


@pytest.mark.parametrize("errors", [(1e-15, math.nan), (math.nan, 1e-15), (2e-15, math.nan, 1e-15)])
def test_an_unwritten_element_is_never_hidden(errors):
    """A NaN-poisoned output that a method left partly unwritten gives a NaN error; combined with
    the other methods' finite errors, in any order, the case still fails (Python's ``max`` would
    keep a finite value met before the NaN)."""
    assert math.isnan(worst(*errors))


def test_results_are_timed_in_the_output_layout():
    """A product handed back as a permuted view is copied into its index order (the values kept);
    one already in that order is used as is, with no copy."""
    rng = np.random.default_rng(5)
    product = rng.standard_normal((3, 4, 5))
    view = product.transpose(2, 0, 1)
    assert not _contiguous(view)
    laid = _in_layout(view)
    assert _contiguous(laid) and laid.shape == view.shape and np.array_equal(laid, view)
    assert _in_layout(product) is product


class _DriftingClock:
    """A device whose every call of any method takes one step longer than the call before (a
    clock throttling under load), and which logs the order of the calls."""

    def __init__(self, step: float = 0.01):
        self.calls, self.step = [], step

    def measure(self, fn) -> float:
        self.calls.append(fn())
        return 1.0 + self.step * len(self.calls)


def test_methods_are_timed_in_turn_within_the_budget():
    clock = _DriftingClock()
    times = rounds({"a": lambda: "a", "b": lambda: "b", "c": lambda: "c"}, clock.measure, 0.0048, min_reps=3)
    # each round starts one further on, in whole cycles of three; a second cycle would pass 4.8 ms a method
    assert clock.calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert times["a"] == (pytest.approx(1.0 + 0.01 * 6), 3) and times["c"] == (pytest.approx(1.0 + 0.01 * 5), 3)


@pytest.mark.parametrize("budget,min_reps,max_reps,reps", [(0.0, 4, 50, 4), (0.0, 7, 50, 8), (1e9, 3, 12, 12),
                                                          (1e9, 3, 11, 12)])
def test_rounds_stop_at_the_fewest_or_the_most_repeats(budget, min_reps, max_reps, reps):
    """Two methods: at least ``min_reps`` rounds, at most ``max_reps``, each rounded up to whole
    cycles of two."""
    times = rounds({"a": lambda: "a", "b": lambda: "b"}, _DriftingClock().measure, budget, min_reps, max_reps)
    assert [n for _, n in times.values()] == [reps, reps]


@pytest.mark.parametrize("hopeless,reps", [(0.5, 1), (1.0, 1), (1.02, 3), (math.inf, 3)])
def test_a_method_slower_than_hopeless_on_its_first_call_is_timed_once(hopeless, reps):
    """The first timed call takes 1.01 ms: timed once where that is more than ``hopeless_ms``,
    else repeated as usual."""
    times = rounds({"a": lambda: "a"}, _DriftingClock().measure, 0.0, min_reps=3, hopeless_ms=hopeless)
    assert times["a"][1] == reps


def _fake_cupy() -> SimpleNamespace:
    """What :func:`time_together` and its stopwatch use of CuPy, on the host: a holding kernel
    that does nothing, flags in plain memory, events that record nothing and elapsed times of
    1 ms."""
    event = lambda: SimpleNamespace(record=lambda: None, synchronize=lambda: None)
    cuda = SimpleNamespace(Device=lambda: SimpleNamespace(synchronize=lambda: None), Event=event,
                           get_elapsed_time=lambda start, stop: 1.0, alloc_pinned_memory=bytearray)
    return SimpleNamespace(cuda=cuda, RawKernel=lambda source, name: lambda grid, block, args: None)


@pytest.mark.parametrize("warm,calls", [(False, 4), (True, 3)])
def test_a_warm_callable_is_timed_without_a_warm_up_call(monkeypatch, warm, calls):
    """Three timed calls, after one warm-up call unless the callable has run already (a GETT
    configuration's checks)."""
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    made = []
    times = time_together({"a": lambda: made.append(1)}, 0.0, min_reps=3, warm=warm)
    assert times["a"] == (1.0, 3) and len(made) == calls


def test_equal_methods_on_a_drifting_clock_time_equal_in_rounds():
    """Two copies of one method on a clock that slows by 1 % a call: timed in rounds their medians
    differ by one call's drift; timed one after the other, by the first one's whole run."""
    same = lambda: "x"
    together = rounds({"a": same, "b": same}, _DriftingClock().measure, 0.0, min_reps=20)
    clock = _DriftingClock()
    alone = [rounds({k: same}, clock.measure, 0.0, min_reps=20)[k] for k in "ab"]
    assert together["b"][0] / together["a"][0] == pytest.approx(1.0, abs=0.011)
    assert alone[1][0] / alone[0][0] > 1.15


def test_equal_methods_on_a_device_rested_between_rounds_time_equal():
    """A device whose first call after a pause (each round's first) runs 1 % faster: equal methods
    in rounds that each start one further on get equal medians; always in the same order, the
    first would be timed 1 % faster in every round."""
    class Rested:
        def __init__(self, methods: int):
            self.methods, self.calls = methods, 0

        def measure(self, fn) -> float:
            self.calls += 1
            return 0.99 if (self.calls - 1) % self.methods == 0 else 1.0

    same = lambda: "x"
    times = rounds({"a": same, "b": same, "c": same}, Rested(3).measure, 0.0, min_reps=4)
    assert times["a"] == times["b"] == times["c"] == (1.0, 6)
    times = rounds({"a": same, "b": same}, Rested(2).measure, 0.0, min_reps=5)
    assert times["a"] == times["b"] == (0.995, 6)


@pytest.mark.parametrize("ours,libs,expected", [
    ({"gett": 1.0, "ttgt": 1.09, "batched": 1.11}, {"cupy_einsum": 2.0, "torch_einsum": 2.21}, ["gett", "ttgt", "cupy_einsum"]),
    ({"ttgt": 6.0, "cupy_einsum": 5.5}, {"cupy_einsum": 5.5, "torch_einsum": 5.7, "cutensor": 6.1},
     ["ttgt", "cupy_einsum", "torch_einsum"]),
    ({"cutensor": 0.6, "gett": 0.9}, {"cutensor": 0.6, "cupy_einsum": 3.0}, ["cutensor"]),
])
def test_each_side_s_methods_near_its_fastest_are_timed_again(ours, libs, expected):
    """Within 10 % of the side's fastest alone, each method once though both sides offer it
    (cupy.einsum, cuTENSOR)."""
    assert contenders(ours, libs) == expected


def test_summary_geomean_per_scale_and_group():
    rows = [{"id": 1, "scale": 1, "group": "ml", "ratio_vs_best_library": 2.0},
            {"id": 2, "scale": 1, "group": "ml", "ratio_vs_best_library": 0.5},
            {"id": 3, "scale": 1, "group": "ccsd_t", "ratio_vs_best_library": 1.5},
            {"id": 3, "scale": 2, "group": "ccsd_t", "ratio_vs_best_library": 3.0},
            {"id": 4, "scale": 1, "group": "ccsd", "skipped": "too large"}]
    s = summary(rows)
    assert set(s) == {"1", "2"}
    assert s["1"]["ml"] == {"cases": 2, "geomean": pytest.approx(1.0), "min": 0.5, "below_1": [2]}
    assert s["1"]["all"]["geomean"] == pytest.approx(1.5 ** (1 / 3))
    assert s["1"]["all"]["below_1"] == [2] and "ccsd" not in s["1"]
    assert s["2"]["all"] == {"cases": 1, "geomean": pytest.approx(3.0), "min": 3.0, "below_1": []}


H100_PEAK = (67_000.0, 3_350.0)
"""The H100 SXM's datasheet FP64 tensor-core rate (GFLOP/s) and HBM3 bandwidth (GB/s): above
anything measured, so bounds made with them are generous."""


@pytest.mark.parametrize("flops,nbytes,expected", [(2 * 8192**3, 3 * 8 * 8192**2, 2 * 8192**3 / 67e12),
                                                   (1e6, 8 * 10**9, 8e9 / 3.35e12)],
                         ids=["gemm-compute-bound", "stream-bandwidth-bound"])
def test_bound_is_the_slower_of_flops_and_compulsory_bytes(flops, nbytes, expected):
    assert bound_ms(flops, nbytes, *H100_PEAK) == pytest.approx(expected * 1e3)


@pytest.mark.parametrize("case", [c for c in CASES if c["group"] == "ccsd_t"], ids=lambda c: f"{c['id']}-{c['name']}")
def test_ccsd_t_cases_cannot_reach_25_tflops_at_their_sizes_on_an_h100(case):
    """Issue 4 asks for 25 TFLOP/s on the CCSD(T) cases at TCCG sizes (scale 1, float64). Each
    writes a 302 MB output (37.7 M float64) for 1.81 GFLOP: writing it once at 3.35 TB/s takes
    0.090 ms, so no method can exceed 20 TFLOP/s there."""
    flops = 2 * math.prod(case["sizes"].values())
    nbytes = sum(8 * math.prod(case["sizes"][i] for i in case[t]) for t in "ABC")
    assert flops / (bound_ms(flops, nbytes, *H100_PEAK) * 1e-3) / 1e12 < 20.1


def test_summary_with_bounds_gives_the_ceiling():
    rows = [{"id": 1, "scale": 1, "group": "ml", "ratio_vs_best_library": 2.0, "bound_ms": 1.0,
             "ceiling_vs_best_library": 4.0, "of_bound": 0.5},
            {"id": 2, "scale": 1, "group": "ml", "ratio_vs_best_library": 1.0, "bound_ms": 1.0,
             "ceiling_vs_best_library": 1.0, "of_bound": 0.5}]
    s = summary(rows)["1"]["ml"]
    assert s["ceiling_geomean"] == pytest.approx(2.0) and s["of_bound_geomean"] == pytest.approx(0.5)


def test_the_shipped_cases_load():
    assert load_cases(TCCG) == CASES and len(CASES) == 48


def test_the_odd_extent_cases_share_no_extent_or_id_with_the_tccg_set():
    """``benchmarks/odd_extents.json``: the four groups again at odd extents none of the TCCG
    cases has (primes mostly), four in index orders it lacks, for ``bench tccg --cases``."""
    odd = load_cases(TCCG.with_name("odd_extents.json"))
    assert len(odd) == 12 and {c["group"] for c in odd} == {c["group"] for c in CASES}
    tccg_extents = {n for c in CASES for n in c["sizes"].values()}
    assert all(n % 2 == 1 and n not in tccg_extents for c in odd for n in c["sizes"].values())
    assert {c["id"] for c in odd}.isdisjoint(c["id"] for c in CASES)
    assert len({(c["C"], c["A"], c["B"]) for c in odd} - {(c["C"], c["A"], c["B"]) for c in CASES}) == 4


GOOD = {"id": 1, "name": "x", "group": "odd", "C": "abc", "A": "acd", "B": "db", "sizes": {"a": 7, "b": 11, "c": 13, "d": 3}}


@pytest.mark.parametrize("cases, needle", [
    ([], "non-empty JSON list"),
    ({"id": 1}, "non-empty JSON list"),
    ([GOOD, GOOD], "case 1: id must be a whole number given once"),
    ([dict(GOOD, id="1")], "id must be a whole number"),
    ([{k: v for k, v in GOOD.items() if k != "B"}], "missing B"),
    ([dict(GOOD, C="a;c")], "C must be distinct lower-case letters"),
    ([dict(GOOD, A="acdd")], "A must be distinct lower-case letters"),
    ([dict(GOOD, B="dB")], "B must be distinct lower-case letters"),
    ([dict(GOOD, sizes={"a": 7, "b": 11, "c": 13})], "sizes must give exactly the indices abcd"),
    ([dict(GOOD, sizes={"a": 7, "b": 11, "c": 13, "d": 0})], "positive whole number"),
    ([dict(GOOD, sizes={"a": 7, "b": 11, "c": 13, "d": 2.5})], "positive whole number"),
    ([dict(GOOD, C="abce", sizes={"a": 7, "b": 11, "c": 13, "d": 3, "e": 2})], "in neither A nor B"),
    ([dict(GOOD, A="acde", sizes={"a": 7, "b": 11, "c": 13, "d": 3, "e": 2})], "must be in both A and B"),
    (["abc"], "case #0: not a JSON object"),
])
def test_a_bad_case_file_is_one_error_naming_the_file_and_case(tmp_path, cases, needle):
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    with pytest.raises(ChainexecError) as err:
        load_cases(path)
    assert needle in str(err.value) and str(path) in str(err.value)


def test_any_list_of_contractions_loads_and_bad_files_fail_before_the_gpu(tmp_path):
    path = tmp_path / "cases.json"
    path.write_text(json.dumps([GOOD, dict(GOOD, id=2, C="ba", A="adc", B="cdb", sizes={"a": 5, "b": 17, "c": 2, "d": 3})]))
    assert [c["id"] for c in load_cases(path)] == [1, 2]
    (tmp_path / "bad.json").write_text("[{")
    proc = run_cli("bench", "tccg", "--out", tmp_path / "r.json", "--cases", tmp_path / "bad.json")
    assert_refused(proc, "not JSON", "bad.json")


@pytest.mark.parametrize("text, needle", [
    ("[" * 100000 + "]" * 100000, "nests its lists or objects deeper"),
    ("[" + " " * (1 << 20) + "]", "longer than 1048576 bytes"),
    ('[{"id": 1, "id": 2}]', "field 'id' is given twice"),
    ("[{]", "case file is not JSON"),
])
def test_a_case_file_too_deep_too_long_or_with_a_key_twice_is_one_error(tmp_path, text, needle):
    path = tmp_path / "cases.json"
    path.write_text(text)
    with pytest.raises(ChainexecError) as err:
        load_cases(path)
    assert needle in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize("options, needle", [
    (["--scales", "0"], "--scales must be positive"),
    (["--scales", "1", "-1"], "--scales must be positive"),
    (["--budget", "-1"], "--budget must be a positive"),
    (["--budget", "nan"], "--budget must be a positive"),
    (["--budget", "inf"], "--budget must be a positive"),
    (["--ids", "1", "99"], "no case has the id 99"),
    (["--out", "{tmp}/none/r.json"], "does not exist"),
    (["--out", "{tmp}"], "names a folder"),
    (["--out", "{tmp}/cases.json"], "is the case file"),
    (["--out", "{tmp}/notes.json"], "is not a result of `chainexec bench tccg`"),
])
def test_options_that_would_fail_or_lose_a_file_are_refused_before_the_gpu(tmp_path, options, needle):
    """Each refused by :func:`chainexec.bench.check_options` before any GPU is asked for (here
    there is none: checks passed would end at "needs CuPy")."""
    import chainexec.bench as bench

    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps([GOOD]))
    (tmp_path / "notes.json").write_text('{"my": "notes"}')
    argv = ["--cases", str(cases), "--out", str(tmp_path / "r.json")] + [o.format(tmp=tmp_path) for o in options]
    with pytest.raises(ChainexecError) as err:
        bench.main(argv)
    assert needle in str(err.value)
    assert (tmp_path / "notes.json").read_text() == '{"my": "notes"}'


@pytest.mark.parametrize("partial", ["notes", "cases"])
def test_an_out_partial_that_is_not_a_bench_run_s_rows_is_refused(tmp_path, partial):
    """``OUT.partial``, which the bench writes after each case and removes at its end, holding a
    user's notes or being the case file itself: refused before the GPU, the file left as it was
    (it was written over, then removed)."""
    import chainexec.bench as bench

    if partial == "notes":
        cases, out = tmp_path / "cases.json", tmp_path / "r.json"
        (tmp_path / "r.json.partial").write_text("notes\n")
    else:
        cases, out = tmp_path / "c.json.partial", tmp_path / "c.json"
    cases.write_text(json.dumps([GOOD]))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ChainexecError, match=r"\.partial: exists and is not a bench run's rows"):
        bench.main(["--cases", str(cases), "--out", str(out)])
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_case_whose_kernel_cannot_be_made_is_a_row_with_its_error(tmp_path, monkeypatch):
    """A case the kernel search or its compile fails on: its row records the error, the other
    cases run and the results are written (the error ended the bench with a traceback)."""
    import chainexec.bench as bench
    from chainexec.kernels import kernelconf

    ran = []
    _stand_in_gpu(monkeypatch, bench, ran)

    def choose_config(c, a, b, sizes, *rest):
        if sizes.get("d") == 3 * 10**28:
            raise OverflowError("Python int too large to convert to C long")

    monkeypatch.setattr(kernelconf, "choose_config", choose_config)
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps([GOOD, dict(GOOD, id=2, sizes={"a": 7, "b": 11, "c": 13, "d": 3 * 10**28})]))
    out = tmp_path / "r.json"
    assert bench.main(["--cases", str(cases), "--out", str(out), "--scales", "1", "--no-torch"]) == 1
    rows = json.loads(out.read_text())["rows"]
    assert ran == [1] and [r["id"] for r in rows] == [1, 2] and "OverflowError" in rows[1]["error"]


def test_an_earlier_result_may_be_written_over(tmp_path, monkeypatch):
    """The checks pass an ``--out`` that holds a result of the bench (the run that follows
    replaces it), and a new name."""
    import chainexec.bench as bench

    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps([GOOD]))
    earlier = tmp_path / "r.json"
    earlier.write_text(json.dumps(dict.fromkeys(bench.RESULT_KEYS, [])))
    for out in (earlier, tmp_path / "new.json"):
        bench.check_options(bench_args(cases, out), [GOOD])


def bench_args(cases, out):
    """The parsed options of ``bench tccg --cases CASES --out OUT``."""
    return SimpleNamespace(cases=str(cases), out=str(out), scales=[1, 2], budget=0.3, ids=None)


def _stand_in_gpu(monkeypatch, bench, ran: list, stop_at=None, device="H200"):
    """The bench's GPU parts replaced by stand-ins: each case's row is a skipped one (which the
    summary leaves out), its id appended to ``ran``; the first call of case ``stop_at`` is
    stopped by Ctrl-C."""
    import importlib.util

    from chainexec.kernels import kernelconf
    from chainexec.runtime import launch

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "cupy" else find_spec(name, *a))
    pool = SimpleNamespace(free_all_blocks=lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(get_default_memory_pool=lambda: pool))
    monkeypatch.setattr(launch, "device_model",
                        lambda: kernelconf.Device("H200", "90", 132, 48 * 1024, 228 * 1024, 255, 65536, 1024, 2048))
    monkeypatch.setattr(launch, "get_kernel", lambda *a, **k: None)
    monkeypatch.setattr(kernelconf, "choose_config", lambda *a, **k: None)
    monkeypatch.setattr(bench, "environment", lambda: {"device": device})
    rates = iter(range(100, 200))
    monkeypatch.setattr(bench, "dgemm_gflops", lambda: next(rates))
    monkeypatch.setattr(bench, "copy_gbs", lambda: 4000.0)

    stops = [stop_at]

    def run_case(case, scale, *rest):
        ran.append(case["id"])
        if case["id"] in stops:
            stops.remove(case["id"])
            raise KeyboardInterrupt
        return {"id": case["id"], "name": case["name"], "scale": scale, "skipped": "a stand-in"}

    monkeypatch.setattr(bench, "run_case", run_case)


@pytest.mark.parametrize("stop_at", [2, None])
def test_results_are_written_whole_once_every_case_has_run(tmp_path, monkeypatch, stop_at):
    """A run stopped part way (here by Ctrl-C during its second case) leaves the rows of the
    cases it finished in ``OUT.partial`` and no ``OUT``; a finished run writes ``OUT`` with its
    summary and removes ``OUT.partial``."""
    import chainexec.bench as bench

    ran = []
    _stand_in_gpu(monkeypatch, bench, ran, stop_at)
    out = tmp_path / "r.json"
    argv = ["--out", str(out), "--scales", "1", "--ids", "1", "2", "3", "--no-torch"]
    if stop_at:
        with pytest.raises(KeyboardInterrupt):
            bench.main(argv)
        assert not out.exists()
        rows = json.loads((tmp_path / "r.json.partial").read_text())["rows"]
        assert [r["id"] for r in rows] == [1]
    else:
        bench.main(argv)
        done = json.loads(out.read_text())
        assert [r["id"] for r in done["rows"]] == [1, 2, 3] and done["failures"] == [] and "summary" in done
        assert all(r["case_s"] >= 0 for r in done["rows"])  # each case's seconds, for planning device calls
        assert not (tmp_path / "r.json.partial").exists()


def test_a_stopped_run_resumes_where_it_stopped(tmp_path, monkeypatch):
    """``--resume`` keeps the finished rows of ``OUT.partial`` and the first call's DGEMM rate
    (every row's bound from one measurement), runs only the cases it lacks (a case that failed
    is run again, and cases beyond the first call's ``--ids`` are added) and writes one result of
    them all, in case order."""
    import chainexec.bench as bench

    ran = []
    _stand_in_gpu(monkeypatch, bench, ran, stop_at=3)
    out = tmp_path / "r.json"
    argv = ["--out", str(out), "--scales", "1", "--ids", "1", "2", "3", "4", "--no-torch"]
    with pytest.raises(KeyboardInterrupt):
        bench.main(argv)
    partial = tmp_path / "r.json.partial"
    first = json.loads(partial.read_text())
    assert [r["id"] for r in first["rows"]] == [1, 2] and first["dgemm_gflops"] == 100
    first["rows"][1] = {"id": 2, "name": "x", "scale": 1, "error": "RuntimeError('out of memory')"}
    first["rows"].append({"id": 6, "name": "y", "scale": 1, "error": "RuntimeError('launch failed')"})
    partial.write_text(json.dumps(first))
    ran.clear()
    bench.main(argv[:-1] + ["5", "--no-torch", "--resume"])
    assert ran == [2, 3, 4, 5]
    done = json.loads(out.read_text())
    assert [r["id"] for r in done["rows"]] == [1, 2, 3, 4, 5, 6] and "error" not in done["rows"][1]
    assert "error" in done["rows"][5] and done["failures"] == [[6, 1]]
    assert done["dgemm_gflops"] == 100 and done["earlier"] == [first["environment"]] and not partial.exists()


def test_resume_without_a_partial_run_runs_every_case(tmp_path, monkeypatch, capsys):
    import chainexec.bench as bench

    ran = []
    _stand_in_gpu(monkeypatch, bench, ran)
    bench.main(["--out", str(tmp_path / "r.json"), "--scales", "1", "--ids", "1", "2", "--no-torch", "--resume"])
    assert ran == [1, 2] and "no " + str(tmp_path / "r.json.partial") + " to resume" in capsys.readouterr().out


@pytest.mark.parametrize("change", ["source", "cases", "device", "dtype", "torn", "no environment"])
def test_a_partial_run_of_other_sources_device_or_dtype_is_not_resumed(tmp_path, monkeypatch, change):
    """Rows measured by other sources, of other contractions, on another device or in another
    dtype (or a file that is not a bench's rows) are refused with one line naming the file,
    before any case runs."""
    import chainexec.bench as bench

    ran = []
    _stand_in_gpu(monkeypatch, bench, ran, stop_at=2, device="H100" if change == "device" else "H200")
    out = tmp_path / "r.json"
    argv = ["--out", str(out), "--scales", "1", "--ids", "1", "2", "--no-torch"]
    with pytest.raises(KeyboardInterrupt):
        bench.main(argv + (["--dtype", "float32"] if change == "dtype" else []))
    partial = tmp_path / "r.json.partial"
    earlier = json.loads(partial.read_text())
    if change == "source":
        earlier["source"] = "0" * 64
    if change == "device":
        earlier["environment"]["device"] = "H200"
    if change == "cases":
        earlier["cases"] = "0" * 64
    if change == "no environment":
        earlier["environment"] = None
    partial.write_text(json.dumps(earlier)[:-20] if change == "torn" else json.dumps(earlier))
    ran.clear()
    with pytest.raises(ChainexecError) as err:
        bench.main(argv + ["--resume"])
    assert str(partial) in str(err.value) and "\n" not in str(err.value) and ran == [] and not out.exists()


def test_each_search_is_timed_on_its_own(tmp_path, monkeypatch):
    """The kernel searches run one after another in the calling thread (in threads each one's
    seconds would hold the others' turns of the interpreter), the compiles in threads; the
    recorded ``max_search_s`` is the longest search."""
    import threading

    import chainexec.bench as bench
    from chainexec.kernels import kernelconf
    from chainexec.runtime import launch

    _stand_in_gpu(monkeypatch, bench, [])
    searched, compiled = [], []

    def choose(*args, **kw):
        searched.append(threading.current_thread())
        time.sleep(0.02)

    monkeypatch.setattr(kernelconf, "choose_config", choose)
    monkeypatch.setattr(launch, "get_kernel", lambda *a, **k: compiled.append(threading.current_thread()))
    out = tmp_path / "r.json"
    bench.main(["--out", str(out), "--scales", "1", "2", "--ids", "1", "2", "3", "--no-torch"])
    assert len(searched) == 6 and set(searched) == {threading.main_thread()}
    assert len(compiled) == 6 and threading.main_thread() not in compiled
    assert 0.02 <= json.loads(out.read_text())["max_search_s"] < 0.1
