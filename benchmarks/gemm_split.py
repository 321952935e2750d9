"""cuBLAS on the AO→MO TCCG cases 9–11 with the short GEMM side split into several calls.

The three cases are one GEMM shape: ``C[z][m, n] = Σ_e A[e, m] B[z][e, n]`` with m = e = 144 at
scale 2, the operand A shared by every batch z, as cuBLAS runs it column-major
``gemm(N, T, M, 144, 144)`` (M = 144³ for case 9, 144² with 144 batches for case 10, 144 with
144² batches for case 11). A tile of 128 or 64 columns covers 144 columns in two or three tiles,
the last mostly empty: splitting the 144 columns into calls whose widths the tiles fit (128 + 16,
96 + 48, …) may pay the extra pass over B that each call makes. This times, on random operands,
the whole call and each split (CUDA events, ``--reps`` calls each), checks each split's output
against the whole call's (largest difference over the largest element), and the whole call's at
``--samples`` random elements against NumPy's sum over the same operands, copied to the host.

Usage (on a GPU machine): ``python3 benchmarks/gemm_split.py OUT.json [--scale 2] [--reps 10]``.
It prints a line per case (milliseconds and TFLOP/s per split) and writes them to ``OUT.json``
with the DGEMM rate of a 4096³ product.
"""

import argparse
import json

import numpy as np

SPLITS = ((144,), (128, 16), (112, 32), (96, 48), (80, 64), (72, 72), (64, 80), (48, 96), (48, 48, 48),
          (64, 64, 16), (32, 112), (16, 128))
"""Widths (columns of the short side, in order) of the calls of each split of 144 columns."""


def timed(cp, call, reps: int) -> float:
    """Milliseconds per call of ``call`` over ``reps`` calls, after one untimed call."""
    call()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        call()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / reps


def gemms(cp, cublas, e: int, m: int, count: int, widths, a, b, c):
    """A function making ``c`` by one cuBLAS call per width of ``widths`` (summing to ``e``):
    columns ``[n0, n0 + w)`` of each batch's column-major ``m × e`` output from the same rows of
    ``a`` (``e × e``, row-major ``A[e, m]``) and all of ``b``."""
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    scalars = np.array([1.0, 0.0])
    one, zero = scalars.ctypes.data, scalars.ctypes.data + 8
    n, t = cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_T

    def call(keep=scalars):  # the scalars' array stays alive while cuBLAS reads it
        n0 = 0
        for w in widths:
            at, ct = a.data.ptr + 8 * n0, c.data.ptr + 8 * n0 * m
            if count == 1:
                cublas.dgemm(handle, n, t, m, w, e, one, b.data.ptr, m, at, e, zero, ct, m)
            else:
                cublas.dgemmStridedBatched(handle, n, t, m, w, e, one, b.data.ptr, m, e * m, at, e, 0, zero, ct, m,
                                           e * m, count)
            n0 += w

    return call


def dgemm_tflops(cp, n: int = 4096) -> float:
    """TFLOP/s of an ``n``-cubed FP64 product on random operands."""
    x, y = cp.random.rand(n, n), cp.random.rand(n, n)
    return 2 * n ** 3 / timed(cp, lambda: x @ y, 5) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--scale", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args()

    import cupy as cp
    from cupy_backends.cuda.libs import cublas

    rng = np.random.default_rng(7)
    found = {"dgemm_tflops": dgemm_tflops(cp), "scale": args.scale, "cases": {}}
    e = 72 * args.scale
    for name, m, count in (("9", e ** 3, 1), ("10", e ** 2, e), ("11", e, e ** 2)):
        a = cp.asarray(rng.random((e, e)) - 0.5)
        b = cp.random.rand(count * e * m) - 0.5
        whole = cp.empty(count * e * m)
        gemms(cp, cublas, e, m, count, (e,), a, b, whole)()
        # C[z][col, row] column-major: element (z, row m_, column j) at z·e·m + j·m + m_
        z, j, row = (rng.integers(0, k, args.samples) for k in (count, e, m))
        host_a, picked = cp.asnumpy(a), cp.asnumpy(whole[z * e * m + j * m + row])
        host_b = cp.asnumpy(b.reshape(count, e, m))
        reference = np.einsum("se,se->s", host_a[:, j].T, host_b[z, :, row])
        rows = {"sampled_rel_err": float(np.max(np.abs(picked - reference)) / np.max(np.abs(reference)))}
        for widths in SPLITS if e == 144 else ((e,),):
            out = cp.empty_like(whole)
            call = gemms(cp, cublas, e, m, count, widths, a, b, out)
            ms = timed(cp, call, args.reps)
            err = float(cp.abs(out - whole).max() / cp.abs(whole).max())
            rows["+".join(map(str, widths))] = {"ms": ms, "tflops": 2.0 * e ** 5 / ms / 1e9, "rel_err": err}
            del out
        found["cases"][name] = rows
        print(name, json.dumps(rows), flush=True)
        del a, b, whole
        cp.get_default_memory_pool().free_all_blocks()
    with open(args.out, "w") as f:
        json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
