"""Time one (T) W tile on the GPU: the twelve terms one by one (each by the autotuner's method)
against the sum kernels (every term accumulated in registers, the autotuner's pick of the model's
candidates; and, forced, the tensor-core kernel's first candidate), results compared with each
other and with ``numpy.einsum`` on a sample.

Usage (on a GPU machine): ``python3 benchmarks/sum_tile.py OUT.json [o v tile sweep]``; defaults
o=24, v=180, occupied tile 3 (the o=24 v=180 synthetic run's device tile: 3x3x3x180x180x180, 1.26 GB).
Operands are views of whole device arrays, as the executor passes them. A sweep also times the
model's best configuration of each of its eight best register tiles at every step depth that
fits, and the tensor-core kernel's eight best tiles (``sweep`` in the JSON: model and measured
seconds), to check the models' rankings; ``sweep`` 0 leaves it out. ``split`` forces the six sums
over m into the register kernel and the six over f one by one, each by its tuned method (what
the autotuner may pick).
"""

import json
import sys
import time

import cupy
import numpy as np

from chainexec.kernels import sumkernel, summma
from chainexec.planner.plan import Contraction
from chainexec.runtime import launch
from chainexec.runtime.backends.cupy import CupyBackend
from tests.kernels.test_sumkernel import W_TERMS


def main(path, o=24, v=180, tile=3, with_sweep=1):
    rng = np.random.default_rng(5)
    full = {"ovvv": cupy.asarray(rng.standard_normal((o, v, v, v))),
            "t2": cupy.asarray(rng.standard_normal((o, o, v, v))),
            "ovoo": cupy.asarray(rng.standard_normal((o, v, o, o)))}
    occ = {"i": slice(0, tile), "j": slice(tile, 2 * tile), "k": slice(2 * tile, 3 * tile), "m": slice(None)}

    def view(name, idx):
        return full[name][tuple(occ.get(i, slice(None)) for i in idx)]

    ops, cs = [], []
    for k, (a, b, f) in enumerate(W_TERMS):
        ops.append((view("ovvv" if "f" in a else "ovoo", a), view("t2", b)))
        cs.append(Contraction(k, "W", list("ijkabc"), f"A{k}", list(a), f"B{k}", list(b), f, True, 0, k))
    shape = (tile,) * 3 + (v,) * 3
    flops = sum(2 * np.prod(shape) * (v if "f" in a else o) for a, _, _ in W_TERMS)
    res = {"o": o, "v": v, "tile": tile, "flops": float(flops), "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()}
    outs = {}

    def per_term(be, W):
        for c, (a, b) in zip(cs, ops):
            be.contract(c, W, a, b)

    def summed(be, W):
        be.contract_sum(cs, W, ops)

    labels = ("sum", "summma", "split")
    for label, method, run in (("per-term", "auto", per_term), ("sum", "auto", summed), ("summma", "summma", summed),
                               ("split", "split", summed)):
        be = CupyBackend(cupy, method)
        W = cupy.zeros(shape)
        times = []
        for _ in range(4):  # the first call decides the methods (tuning), the others are timed
            W[...] = 0
            cupy.cuda.get_current_stream().synchronize()
            t0 = time.perf_counter()
            run(be, W)
            be.wait()  # the backend returns once the kernels are queued
            times.append(time.perf_counter() - t0)
        first, times = times[0], times[1:]
        outs[label] = W
        res[label] = {"first_call_seconds": first, "seconds": min(times), "tflops": flops / min(times) / 1e12,
                      "choices": [{"method": ch.method, "config": ch.config,
                                   "seconds": {m: round(s, 6) for m, s in ch.seconds.items()}}
                                  for ch in be.choices.values()]}
        print(label, res[label]["seconds"], res[label]["tflops"], flush=True)
    for label in labels:
        d = outs[label] - outs["per-term"]
        res[f"relative_difference_{label}"] = float(cupy.linalg.norm(d) / cupy.linalg.norm(outs["per-term"]))
    # an independent check on a sample: numpy.einsum on the host for one (a) slice
    sample = np.zeros(shape[:3] + (1, v, v))
    for (a, b, f), (x, y) in zip(W_TERMS, ops):
        xa, ya = cupy.asnumpy(x), cupy.asnumpy(y)
        cut = [slice(0, 1) if i == "a" else slice(None) for i in a]
        cutb = [slice(0, 1) if i == "a" else slice(None) for i in b]
        sample += f * np.einsum(f"{a},{b}->ijkabc", xa[tuple(cut)], ya[tuple(cutb)])
    for label in labels:
        got = cupy.asnumpy(outs[label][:, :, :, 0:1])
        res[f"einsum_sample_relative_error_{label}"] = float(np.linalg.norm(got - sample) / np.linalg.norm(sample))
    be = CupyBackend(cupy, "sum")
    W = outs["sum"]

    def view(arr, idx):
        return sumkernel.View(tuple(idx), arr.shape, tuple(x // arr.itemsize for x in arr.strides))

    prob = sumkernel.problem(view(W, "ijkabc"), [sumkernel.Term(view(a, x), view(b, y), f)
                                                 for (x, y, f), (a, b) in zip(W_TERMS, ops)], "float64")
    dev = launch.device_model()
    res["sweep"] = []
    sweep = [] if not with_sweep else [("sum", sumkernel.SumConfig(c.tb, c.reg, kc)) for c in sumkernel.candidates(prob, dev, top=8)
             for kc in sumkernel.KC] + [("summma", c) for c in summma.candidates(prob, dev, top=8)]
    for kind, cfg in sweep:
        model = launch.SUM_KINDS[kind][0].predict(prob, cfg, dev)
        if model == float("inf"):
            continue
        t = be._timed(lambda: launch.launch_sum(kind, prob, cfg, W, ops, False))
        res["sweep"].append({"kind": kind, "config": cfg.name(), "model": model, "seconds": t, "tflops": flops / t / 1e12})
        print(kind, cfg.name(), round(model * 1e3, 2), round(t * 1e3, 2), round(flops / t / 1e12, 2), flush=True)
    print(json.dumps({k: v for k, v in res.items() if k != "sweep"}, indent=1))
    json.dump(res, open(path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
