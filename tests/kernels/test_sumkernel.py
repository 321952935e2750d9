"""The sum-of-contractions kernel: validation, the model's search, CPU emulation, nvcc compilation.

The emulation (shared with ``test_codegen``) compiles the generated kernel as host C++20, runs each
CUDA thread as a ``std::thread`` with ``std::barrier`` as ``__syncthreads``, on operands placed as
interior views of NaN-filled buffers (a read outside a view poisons the result), and compares with
``numpy.einsum`` term by term. Extents are chosen not to divide into the tiles.
"""

import math
import shutil
import subprocess

import numpy as np
import pytest

from chainexec.kernels import sumkernel as sk
from chainexec.kernels import summma
from chainexec.kernels.kernelconf import Device
from tests.conftest import nvcc_reports
from tests.kernels.emulation import compile_emulation
from tests.kernels.test_codegen import EMU_PRELUDE

SUM_PRELUDE = EMU_PRELUDE + r"""
#include <memory>
alignas(16) double cx_smem[1 << 16];  // dynamic shared memory of the tensor-core kernel
static std::barrier<>* g_warps[32];
static double g_xa[32][32][4], g_xb[32][32][2];
// One FP64 mma.sync of shape R x 8 x KS for the calling lane's warp, from the PTX ISA's fragment
// layouts (written here independently of the generator): lane l = 4g + t holds A[g + 8rh][t + 4kh]
// as a[rh + (R/8) kh], B[t + 4kh][g] as b[kh], and C[g + 8rh][2t + e] as d[2rh + e].
template <int R, int KS>
static void cx_emu_mma(double* d, const double* a, const double* b) {
  constexpr int NR = R / 8, NK = KS / 4;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  for (int q = 0; q < NR * NK; ++q) g_xa[w][lane][q] = a[q];
  for (int q = 0; q < NK; ++q) g_xb[w][lane][q] = b[q];
  g_warps[w]->arrive_and_wait();
  double out[2 * NR];
  for (int q = 0; q < 2 * NR; ++q) {
    const int row = (lane >> 2) + 8 * (q >> 1), col = 2 * (lane & 3) + (q & 1);
    double s = d[q];
    for (int k = 0; k < KS; ++k)
      s = std::fma(g_xa[w][(row % 8) * 4 + k % 4][row / 8 + NR * (k / 4)], g_xb[w][col * 4 + k % 4][k / 4], s);
    out[q] = s;
  }
  g_warps[w]->arrive_and_wait();
  for (int q = 0; q < 2 * NR; ++q) d[q] = out[q];
}
"""
"""The emulation prelude of both sum kernels: warp barriers and the MMA for the tensor-core one."""

H100 = Device.H100()
W_TERMS = ([(a, b, 1.0) for a, b in [("iafb", "kjcf"), ("iafc", "jkbf"), ("jbfa", "kicf"), ("jbfc", "ikaf"),
                                      ("kcfa", "jibf"), ("kcfb", "ijaf")]]
           + [(a, b, -1.0) for a, b in [("iajm", "mkbc"), ("iakm", "mjcb"), ("jbim", "mkac"), ("jbkm", "mica"),
                                        ("kcim", "mjab"), ("kcjm", "miba")]])
"""The (T) W tile: six sums over a virtual f and six over an occupied m (configs/ccsd_t.yaml)."""
CASES = [
    ("ijkabc", W_TERMS, dict(i=3, j=2, k=3, a=7, b=5, c=9, f=6, m=5)),
    ("abc", [("adec", "bed", 0.5), ("acde", "dbe", -1.0), ("dbc", "ad", 2.5)], dict(a=5, b=9, c=11, d=6, e=3)),
    ("abc", [("acd", "bdc", 1.0), ("dca", "dbc", -0.75)], dict(a=10, b=7, c=4, d=13)),  # c: a batch index
    ("ab", [("ka", "kb", 1.0)], dict(a=37, b=29, k=17)),
]
"""(output, [(A, B, factor)], extents): (T)'s W, two summed indices, a batch index, one GEMM."""


def _rowmajor(shape):
    return tuple(int(s) for s in np.cumprod((list(shape[1:]) + [1])[::-1])[::-1])


def _problem(out, terms, sizes, dtype="float64", pad=0):
    """The problem over views of buffers ``pad`` larger than the view along every index."""
    def view(idx):
        shape = tuple(sizes[i] for i in idx)
        return sk.View(tuple(idx), shape, _rowmajor([n + 2 * pad for n in shape]))

    return sk.problem(view(out), [sk.Term(view(a), view(b), f) for a, b, f in terms], dtype)


def _emu_main(name, ctype, nterms):
    ptrs = ", ".join(f"buf[{k}].data() + off[{k}]" for k in range(1 + 2 * nterms))
    return f"""
int main(int argc, char** argv) {{
  int grid = atoi(argv[1]), threads = atoi(argv[2]), store = atoi(argv[3]);
  const int nb = {1 + 2 * nterms};
  std::vector<std::vector<{ctype}>> buf(nb);
  long long off[nb];
  FILE* f = fopen(argv[4], "rb");
  for (int k = 0; k < nb; ++k) {{
    long long n = atoll(argv[6 + 2 * k]);
    off[k] = atoll(argv[7 + 2 * k]);
    buf[k].resize(n);
    if (fread(buf[k].data(), sizeof({ctype}), n, f) != (size_t)n) return 2;
  }}
  fclose(f);
  for (int b = 0; b < grid; ++b) {{
    std::barrier<> bar(threads);
    g_bar = &bar;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    for (int w = 0; w < threads / 32; ++w) {{
      warps.emplace_back(new std::barrier<>(32));
      g_warps[w] = warps.back().get();
    }}
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([&, t, b] {{ threadIdx.x = t; blockIdx.x = b; {name}({ptrs}, store); }});
    for (auto& th : ts) th.join();
  }}
  f = fopen(argv[5], "wb");
  fwrite(buf[0].data(), sizeof({ctype}), buf[0].size(), f);
  fclose(f);
  return 0;
}}
"""


def _emulate(tmp_path, out, terms, sizes, dtype, cfg, seed, pad=1, store=True, gen=sk):
    """(result, reference, initial output): the kernel emulated on views of padded buffers;
    ``gen`` the generator module (this one's or :mod:`chainexec.kernels.summma`)."""
    p = _problem(out, terms, sizes, dtype, pad)
    name, src = gen.generate(p, cfg)
    ctype = "double" if dtype == "float64" else "float"
    cpp, exe = tmp_path / f"{name}.cpp", tmp_path / name
    cpp.write_text(SUM_PRELUDE + src + _emu_main(name, ctype, len(terms)))
    compile_emulation(tmp_path, cpp, exe)
    rng = np.random.default_rng(seed)
    views, bufs = [], []
    for idx in [out] + [x for a, b, _ in terms for x in (a, b)]:
        shape = [sizes[i] for i in idx]
        big = np.full([n + 2 * pad for n in shape], np.nan, dtype=dtype)
        inner = tuple(slice(pad, pad + n) for n in shape)
        big[inner] = rng.standard_normal(shape).astype(dtype)
        bufs.append(big)
        views.append(big[inner])
    c0 = views[0].astype(np.float64)
    ref = c0.copy()
    for k, (a, b, f) in enumerate(terms):
        ref += f * np.einsum(f"{a},{b}->{out}", views[1 + 2 * k].astype(np.float64),
                             views[2 + 2 * k].astype(np.float64))
    inp, res = tmp_path / f"{name}.in", tmp_path / f"{name}.out"
    inp.write_bytes(b"".join(x.tobytes() for x in bufs))
    args = []
    for big in bufs:
        args += [str(big.size), str(pad * sum(_rowmajor(big.shape)))]
    subprocess.run([str(exe), str(gen.blocks(p, cfg)), str(cfg.threads), str(int(store)), str(inp), str(res)]
                   + args, check=True)
    got = np.fromfile(res, dtype=dtype).reshape(bufs[0].shape)
    inner = tuple(slice(pad, pad + sizes[i]) for i in out)
    outside = np.ones(got.shape, bool)
    outside[inner] = False
    assert np.isnan(got[outside]).all()  # nothing written outside the output's view
    return got[inner].astype(np.float64), ref, c0


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
@pytest.mark.parametrize("out,terms,sizes", CASES, ids=["W", "two-summed", "batch", "gemm"])
def test_emulated_candidates_match_einsum(tmp_path, out, terms, sizes):
    """Each of the model's top candidates (chosen for large extents, run at small odd ones)."""
    big = {i: 6 * n for i, n in sizes.items()}
    for cfg in sk.candidates(_problem(out, terms, big), H100):
        got, ref, _ = _emulate(tmp_path, out, terms, sizes, "float64", cfg, seed=len(terms))
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= 1e-12, cfg.name()


@pytest.mark.parametrize("out,terms,sizes,parts", [
    (*CASES[0], [tuple(range(6, 12))]),  # the six sums over m (5) before the six over f (6)
    (*CASES[1], []),  # one term sums over less than the others: nothing to gather
    (*CASES[2], []),  # equal ranges
    (*CASES[3], []),
    ("ab", [("ka", "kb", 1.0), ("ak", "bk", -2.0), ("kla", "klb", 0.5), ("klma", "lbmk", 1.5)],
     dict(a=4, b=5, k=2, l=3, m=7), [(0, 1), (0, 1, 2)]),
], ids=["W", "two-summed", "batch", "gemm", "three-depths"])
def test_splits_gather_the_short_terms(out, terms, sizes, parts):
    """The terms a split runs in one kernel: those up to each summed length below the longest."""
    p = _problem(out, terms, sizes)
    assert sk.splits(p) == parts
    for part in parts:
        sub = p.part(part)
        assert sub.out == p.out and sub.terms == tuple(p.terms[k] for k in part)
        assert max(sub.depth(t) for t in sub.terms) < max(p.depth(t) for t in p.terms)


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_emulated_float32_and_no_store(tmp_path):
    out, terms, sizes = CASES[1]
    cfg = sk.candidates(_problem(out, terms, sizes, "float32"), H100)[0]
    got, ref, _ = _emulate(tmp_path, out, terms, sizes, "float32", cfg, seed=3)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= 1e-5
    got, _, c0 = _emulate(tmp_path, out, terms, sizes, "float32", cfg, seed=3, store=False)
    assert np.array_equal(got, c0)


def test_search_respects_the_device():
    """Every candidate fits: registers, static shared memory, threads; extents that tiles
    overhang are allowed; the (T) tile's terms read at most half as many values as they
    multiply-add (the register tile's point)."""
    out, terms, _ = CASES[0]
    p = _problem(out, terms, dict(i=3, j=3, k=3, a=180, b=180, c=180, f=180, m=24))
    cands = sk.candidates(p, H100)
    assert len(cands) == sk.TOP and len({c.reg for c in cands}) == sk.TOP
    for cfg in cands:
        assert sk.registers(p, cfg) <= H100.regs_per_thread and sk.smem_bytes(p, cfg) <= H100.smem_per_block
        assert cfg.threads in sk.THREADS and sk.predict(p, cfg, H100) < math.inf
        acc = math.prod(cfg.reg)
        for t in p.terms:
            a, b = sk._sides(p, t)
            reads = math.prod(cfg.reg[d] for d in a) + math.prod(cfg.reg[d] for d in b)
            assert 2 * reads <= acc
    assert sk.SumConfig.from_json(cands[0].to_json()) == cands[0]


def test_search_time():
    """The model's search takes well under a second for the (T) tile (done once per tile shape)."""
    import time

    out, terms, _ = CASES[0]
    p = _problem(out, terms, dict(i=4, j=4, k=4, a=180, b=180, c=180, f=180, m=24))
    t0 = time.perf_counter()
    sk.candidates(p, H100)
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize("out,terms,match", [
    ("ab", [("ak", "bj", 1.0)], "both operands"),
    ("ab", [("ak", "kc", 1.0)], "one operand"),
    ("ab", [("aa", "ab", 1.0)], "malformed"),
])
def test_invalid_problems_raise(out, terms, match):
    sizes = dict(a=3, b=4, c=5, j=6, k=7)
    with pytest.raises(ValueError, match=match):
        _problem(out, terms, sizes)


def test_other_invalid_inputs_raise():
    out, terms, sizes = CASES[3]
    p = _problem(out, terms, sizes)
    with pytest.raises(ValueError, match="dtype"):
        sk.problem(p.out, list(p.terms), "float16")
    with pytest.raises(ValueError, match="extents"):
        sk.problem(sk.View(("a", "b"), (3, 4), (4, 1)), [sk.Term(sk.View(("k", "a"), (2, 5), (5, 1)),
                                                                 sk.View(("k", "b"), (2, 4), (4, 1)), 1.0)], "float64")
    with pytest.raises(ValueError, match="zero stride"):
        sk.problem(sk.View(("a", "b"), (37, 29), (0, 1)), list(p.terms), "float64")
    with pytest.raises(ValueError, match="rank"):
        sk.generate(p, sk.SumConfig((8, 8, 1), (1, 1, 1), 4))


@pytest.mark.parametrize("gen", [sk, summma], ids=["registers", "tensor-cores"])
def test_source_has_no_index_names(gen):
    """Index names never reach either kernel's source: dimensions are numbered."""
    p = sk.problem(sk.View(("Qz", "Yw"), (9, 10), (10, 1)),
                   [sk.Term(sk.View(("Kv", "Qz"), (4, 9), (9, 1)), sk.View(("Kv", "Yw"), (4, 10), (10, 1)), 1.0)],
                   "float64")
    name, src = gen.generate(p, gen.candidates(p, H100)[0])
    assert name in src and not any(i in src for i in ("Qz", "Yw", "Kv"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_tile_kernel_compiles_without_spills(tmp_path):
    """The (T) tile's top candidates compile for sm_90 with no register spills."""
    out, terms, _ = CASES[0]
    p = _problem(out, terms, dict(i=3, j=3, k=3, a=180, b=180, c=180, f=180, m=24))
    cfgs = sk.candidates(p, H100)
    for cfg, report in zip(cfgs, nvcc_reports(tmp_path, [sk.generate(p, cfg)[1] for cfg in cfgs])):
        assert "0 bytes spill stores" in report, (cfg.name(), report)


def test_offsets_are_64_bit_only_for_large_views():
    """32-bit offset arithmetic (fewer instructions per copy) unless a view spans 2^31 elements."""
    out, terms, sizes = CASES[3]
    small = _problem(out, terms, sizes)
    big = sk.problem(small.out, [sk.Term(sk.View(("k", "a"), (17, 37), (2**27, 1)), small.terms[0].b, 1.0)],
                     "float64")
    cfg = sk.candidates(small, H100)[0]
    assert "(long long)" not in sk.generate(small, cfg)[1]
    assert "(long long)" in sk.generate(big, cfg)[1]


def test_past_the_end_guard_is_64_bit_where_needed():
    """The guard on a partial last step multiplies the summed length left by the slice's pitch:
    in 32 bits only while that product stays below 2^31."""
    def view(idx, shape):
        return sk.View(tuple(idx), shape, _rowmajor(shape))

    def source(n):
        p = sk.problem(view("ab", (8, 8)), [sk.Term(view("akl", (8, n, n)), view("klb", (n, n, 8)), 1.0)], "float64")
        return sk.generate(p, sk.SumConfig((8, 8), (1, 1), 4))[1]

    assert "(long long)q <" not in source(101) and "(long long)q <" in source(50001)
