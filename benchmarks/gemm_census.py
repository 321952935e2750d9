"""The cuBLAS GEMMs of one ``chainexec run``, by shape, and what cuBLASLt offers for them.

A config is run twice in this process with CuPy (the first compiles and tunes); during the second,
every call the backend makes to cuBLAS's batched FP64 GEMMs (``dgemmStridedBatched``,
``dgemmBatched``, :meth:`chainexec.runtime.backends.methods.Methods.batched_gemm`) is timed
between two CUDA events and counted by its shape (operations, m, n, k, leading dimensions,
batch strides, batch count). With ``--lt N`` the N shapes that took longest are then timed alone
on random operands: cuBLAS as the run calls it, and each algorithm cuBLASLt's heuristic offers
for the same problem (through ``ctypes``: CuPy has no cuBLASLt binding), each adding its product
to the output as the run's stacked terms do (beta 1), all timed in turns, each algorithm's sum
compared with cuBLAS's (``rel_err``).

Usage (on a GPU machine): ``python3 benchmarks/gemm_census.py CONFIG OUT.json [--lt N]``. It
prints the census (calls, device milliseconds and TFLOP/s per shape, longest first), the DGEMM
rate of an 8192³ product, and per timed shape the rate of cuBLAS and of cuBLASLt's fastest
algorithm (its configuration: algorithm id, tile id, split-K, stages); ``OUT.json`` holds all of it.
"""

import argparse
import ctypes
import json

FIELDS = ("kind", "ta", "tb", "m", "n", "k", "lda", "sa", "ldb", "sb", "ldc", "sc", "count")
"""A shape: ``kind`` ``strided`` or ``pointers``, the operations (0 none, 1 transposed), the
sizes, leading dimensions and batch strides in elements (0 for a pointer-array call), GEMMs."""


def summarize(calls: list[tuple[tuple, float]]) -> list[dict]:
    """Per shape (a tuple in :data:`FIELDS` order), from ``(shape, milliseconds)`` per call: its
    calls, their milliseconds and their TFLOP/s (2·m·n·k·count flops a call), longest first."""
    rows: dict[tuple, dict] = {}
    for shape, ms in calls:
        row = rows.setdefault(shape, dict(zip(FIELDS, shape)) | {"calls": 0, "ms": 0.0})
        row["calls"] += 1
        row["ms"] += ms
    for row in rows.values():
        flops = 2.0 * row["m"] * row["n"] * row["k"] * row["count"] * row["calls"]
        row["tflops"] = round(flops / row["ms"] / 1e9, 2) if row["ms"] else None
        row["ms"] = round(row["ms"], 3)
    return sorted(rows.values(), key=lambda r: -r["ms"])


def spans(row: dict) -> tuple[int, int, int, int, int, int]:
    """Batch strides of A, B and C (a pointer-array call's matrices laid end to end) and the
    elements each operand's batch spans from its first element to its last (its matrices may
    interleave, a batch index inside another's columns): ``(sa, sb, sc, span_a, span_b, span_c)``."""
    (ar, ac), (br, bc) = _rows_cols(row)
    sa, sb, sc = row["sa"] or row["lda"] * ac, row["sb"] or row["ldb"] * bc, row["sc"] or row["ldc"] * row["n"]
    last = row["count"] - 1
    return (sa, sb, sc, last * sa + row["lda"] * (ac - 1) + ar, last * sb + row["ldb"] * (bc - 1) + br,
            last * sc + row["ldc"] * (row["n"] - 1) + row["m"])


def _rows_cols(row: dict) -> tuple[tuple[int, int], tuple[int, int]]:
    """The stored (column-major) rows and columns of A and B: op(A) is m×k, op(B) k×n."""
    a = (row["m"], row["k"]) if row["ta"] == 0 else (row["k"], row["m"])
    b = (row["k"], row["n"]) if row["tb"] == 0 else (row["n"], row["k"])
    return a, b


def _census(config: str) -> list[dict]:
    """Run ``config`` twice; :func:`summarize` of the second run's batched GEMM calls."""
    import cupy
    from cupy_backends.cuda.libs import cublas

    from chainexec import api

    events = []
    strided, pointers = cublas.dgemmStridedBatched, cublas.dgemmBatched

    def timed(call, shape):
        def run(*args):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            call(*args)
            end.record()
            events.append((shape(args), start, end))
        return run

    cublas.dgemmStridedBatched = timed(strided, lambda a: ("strided", *a[1:6], a[8], a[9], a[11], a[12], a[15], a[16], a[17]))
    cublas.dgemmBatched = timed(pointers, lambda a: ("pointers", *a[1:6], a[8], 0, a[10], 0, a[13], 0, a[14]))
    try:
        for _ in range(2):
            events.clear()
            api.run(config, backend="cupy", plan_cache=False)
        cupy.cuda.Device().synchronize()
    finally:
        cublas.dgemmStridedBatched, cublas.dgemmBatched = strided, pointers
    calls = [(shape, cupy.cuda.get_elapsed_time(start, end)) for shape, start, end in events]
    return summarize(calls)


def _errors(runs: list, out) -> list[float]:
    """The largest difference between what each of ``runs[1:]`` adds to ``out`` in one call and
    what ``runs[0]`` adds, relative to the largest element of the latter; ``out`` as before."""
    before = out.copy()
    runs[0]()
    reference = out - before
    scale = float(abs(reference).max())
    errors = []
    for run in runs[1:]:
        out[...] = before
        run()
        errors.append(float(abs(out - before - reference).max()) / scale)
    out[...] = before
    return errors


def _interleaved(runs: list, rounds: int = 7, reps: int = 10) -> list[float]:
    """Median milliseconds a call of each of ``runs``, timed in turn ``rounds`` times (``reps``
    calls between two CUDA events each) after one warm-up call each: under the board's power cap
    the clock drifts over seconds, and candidates timed one after the other would see different
    clocks."""
    import cupy

    for run in runs:
        run()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = [[] for _ in runs]
    for _ in range(rounds):
        for run, seen in zip(runs, times):
            start.record()
            for _ in range(reps):
                run()
            end.record()
            end.synchronize()
            seen.append(cupy.cuda.get_elapsed_time(start, end) / reps)
    return [sorted(seen)[len(seen) // 2] for seen in times]


class _Lt:
    """The few cuBLASLt calls :func:`_algorithms` needs, on the library CuPy's cuBLAS loaded."""

    R_64F, COMPUTE_64F = 1, 70  # cudaDataType CUDA_R_64F, cublasComputeType_t CUBLAS_COMPUTE_64F
    TRANSA, TRANSB = 3, 4  # cublasLtMatmulDescAttributes_t
    BATCH_COUNT, BATCH_STRIDE = 5, 6  # cublasLtMatrixLayoutAttribute_t
    MAX_WORKSPACE = 1  # cublasLtMatmulPreferenceAttributes_t
    CONFIG = {"id": 0, "tile": 1, "split_k": 2, "stages": 6}  # cublasLtMatmulAlgoConfigAttributes_t

    class Algo(ctypes.Structure):
        _fields_ = [("data", ctypes.c_uint64 * 8)]

    class Heuristic(ctypes.Structure):
        pass

    Heuristic._fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                          ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]

    def __init__(self):
        import cupy

        cupy.cuda.device.get_cublas_handle()
        path = next(line.split()[-1] for line in open("/proc/self/maps") if "libcublasLt" in line)
        self.lib = ctypes.CDLL(path)
        self.version = self.lib.cublasLtGetVersion()
        self.handle = ctypes.c_void_p()
        self.check(self.lib.cublasLtCreate(ctypes.byref(self.handle)))

    @staticmethod
    def check(status: int) -> None:
        if status != 0:
            raise RuntimeError(f"cuBLASLt status {status}")

    def set(self, setter, obj, attribute: int, value, ctype) -> None:
        v = ctype(value)
        self.check(setter(obj, attribute, ctypes.byref(v), ctypes.sizeof(v)))

    def layout(self, rows: int, cols: int, ld: int, count: int, stride: int):
        out = ctypes.c_void_p()
        self.check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(out), self.R_64F, ctypes.c_uint64(rows),
                                                       ctypes.c_uint64(cols), ctypes.c_int64(ld)))
        self.set(self.lib.cublasLtMatrixLayoutSetAttribute, out, self.BATCH_COUNT, count, ctypes.c_int32)
        self.set(self.lib.cublasLtMatrixLayoutSetAttribute, out, self.BATCH_STRIDE, stride, ctypes.c_int64)
        return out

    def config(self, algo) -> dict:
        found = {}
        for name, attribute in self.CONFIG.items():
            v, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
            self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attribute, ctypes.byref(v),
                                                          ctypes.sizeof(v), ctypes.byref(written))
            found[name] = v.value
        return found


def _algorithms(lt: _Lt, row: dict, offered: int = 32, workspace_bytes: int = 64 << 20) -> dict:
    """``row``'s shape timed alone on random operands (beta 1), in turns (:func:`_interleaved`):
    cuBLAS as the run calls it (a pointer-array call as the strided one over :func:`spans`'
    strides), and every algorithm cuBLASLt's heuristic offers, with its configuration."""
    import cupy
    import numpy as np
    from cupy_backends.cuda.libs import cublas

    sa, sb, sc, span_a, span_b, span_c = spans(row)
    (ar, ac), (br, bc) = _rows_cols(row)
    rng = cupy.random.default_rng(0)
    a, b, c = (rng.standard_normal(n) for n in (span_a, span_b, span_c))
    one = np.array(1.0)
    flops = 2.0 * row["m"] * row["n"] * row["k"] * row["count"]
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    runs = [lambda: cublas.dgemmStridedBatched(
        handle, row["ta"], row["tb"], row["m"], row["n"], row["k"], one.ctypes.data, a.data.ptr, row["lda"], sa,
        b.data.ptr, row["ldb"], sb, one.ctypes.data, c.data.ptr, row["ldc"], sc, row["count"])]
    desc, pref = ctypes.c_void_p(), ctypes.c_void_p()
    lt.check(lt.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), lt.COMPUTE_64F, lt.R_64F))
    lt.set(lt.lib.cublasLtMatmulDescSetAttribute, desc, lt.TRANSA, row["ta"], ctypes.c_int32)
    lt.set(lt.lib.cublasLtMatmulDescSetAttribute, desc, lt.TRANSB, row["tb"], ctypes.c_int32)
    layouts = [lt.layout(ar, ac, row["lda"], row["count"], sa), lt.layout(br, bc, row["ldb"], row["count"], sb),
               lt.layout(row["m"], row["n"], row["ldc"], row["count"], sc)]
    lt.check(lt.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)))
    lt.set(lt.lib.cublasLtMatmulPreferenceSetAttribute, pref, lt.MAX_WORKSPACE, workspace_bytes, ctypes.c_uint64)
    found, count = (lt.Heuristic * offered)(), ctypes.c_int(0)
    lt.check(lt.lib.cublasLtMatmulAlgoGetHeuristic(lt.handle, desc, *layouts, layouts[2], pref, offered, found,
                                                   ctypes.byref(count)))
    workspace = cupy.empty(workspace_bytes, cupy.uint8)
    stream = ctypes.c_void_p(cupy.cuda.get_current_stream().ptr)
    pointer = one.ctypes.data_as(ctypes.c_void_p)
    usable = [h for h in found[:count.value] if h.state == 0]
    runs += [lambda h=h: lt.check(lt.lib.cublasLtMatmul(
        lt.handle, desc, pointer, ctypes.c_void_p(a.data.ptr), layouts[0], ctypes.c_void_p(b.data.ptr), layouts[1],
        pointer, ctypes.c_void_p(c.data.ptr), layouts[2], ctypes.c_void_p(c.data.ptr), layouts[2],
        ctypes.byref(h.algo), ctypes.c_void_p(workspace.data.ptr), ctypes.c_size_t(workspace_bytes), stream))
        for h in usable]
    errors = _errors(runs, c)
    ms, *lt_ms = _interleaved(runs)
    result = {"cublas_ms": round(ms, 4), "cublas_tflops": round(flops / ms / 1e9, 2),
              "cublaslt": [lt.config(h.algo) | {"ms": round(t, 4), "tflops": round(flops / t / 1e9, 2),
                                                "rel_err": float(e)} for h, t, e in zip(usable, lt_ms, errors)]}
    for layout in layouts:
        lt.lib.cublasLtMatrixLayoutDestroy(layout)
    lt.lib.cublasLtMatmulDescDestroy(desc)
    lt.lib.cublasLtMatmulPreferenceDestroy(pref)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("out")
    parser.add_argument("--lt", type=int, default=0, metavar="N", help="time the N longest shapes with cuBLASLt too")
    args = parser.parse_args()
    import cupy

    from chainexec.bench import dgemm_gflops

    rows = _census(args.config)
    total = sum(r["ms"] for r in rows)
    print(f"GEMMs: {sum(r['calls'] for r in rows)} calls, {len(rows)} shapes, {total / 1e3:.3f} device s")
    for row in rows:
        print(json.dumps(row))
    report = {"config": args.config, "census": rows, "dgemm_tflops": round(dgemm_gflops() / 1e3, 2)}
    print(f"DGEMM 8192^3: {report['dgemm_tflops']} TFLOP/s")
    if args.lt:
        lt = _Lt()
        report["cublaslt_version"] = lt.version
        for row in rows[:args.lt]:
            row |= _algorithms(lt, row)
            best = max((x for x in row["cublaslt"] if x["rel_err"] <= 1e-12), key=lambda x: x["tflops"], default=None)
            print(f"m={row['m']} n={row['n']} k={row['k']} count={row['count']}: cuBLAS {row['cublas_tflops']} "
                  f"TFLOP/s, cuBLASLt best of {len(row['cublaslt'])} {best}")
            cupy.get_default_memory_pool().free_all_blocks()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
