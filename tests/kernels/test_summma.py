"""The sum kernel on FP64 tensor cores: the model's search, CPU emulation, nvcc compilation.

The emulation is the register kernel's (``test_sumkernel``: one ``std::thread`` per CUDA thread,
operands as views of NaN-filled buffers) with ``mma.sync`` emulated per warp from the PTX ISA's
fragment layouts, written in the test prelude independently of the generator; results are
compared with ``numpy.einsum`` term by term.
"""

import math
import shutil
import time

import numpy as np
import pytest

from chainexec.kernels import summma as mm
from chainexec.kernels.gett import MMA_SHAPES
from chainexec.kernels.kernelconf import Device
from tests.conftest import nvcc_reports
from tests.kernels.test_sumkernel import CASES, _emulate, _problem

H100 = Device.H100()
A100 = Device("A100", "80", 108, 48 * 1024, 164 * 1024, 255, 65536, 1024, 2048)
TILE = dict(i=3, j=3, k=3, a=180, b=180, c=180, f=180, m=24)
"""The (T) W tile of the o=24, v=180 run."""
MMA_CASES = [CASES[0], CASES[1], CASES[3]]
"""The register kernel's cases without a batch index: (T)'s W, two summed indices, one GEMM."""

gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")


def _err(got, ref):
    return np.linalg.norm(got - ref) / np.linalg.norm(ref)


@gxx
@pytest.mark.parametrize("out,terms,sizes", MMA_CASES, ids=["W", "two-summed", "gemm"])
def test_emulated_candidates_match_einsum(tmp_path, out, terms, sizes):
    """Each of the model's top candidates, chosen for large extents (W: the o=24, v=180 tile) and
    run at small odd ones (partial tiles, padded MMA rows and columns, a partial last step)."""
    big = TILE if out == "ijkabc" else {i: 6 * n for i, n in sizes.items()}
    cands = mm.candidates(_problem(out, terms, big), H100)
    assert cands
    for cfg in cands:
        got, ref, _ = _emulate(tmp_path, out, terms, sizes, "float64", cfg, seed=len(terms), gen=mm)
        assert _err(got, ref) <= 1e-12, cfg.name()


@gxx
@pytest.mark.parametrize("shape", sorted(MMA_SHAPES))
def test_emulated_every_mma_shape(tmp_path, shape):
    """Every FP64 MMA shape's fragment layout, on the W terms (whose splits put different output
    indices on the rows of every term), with a tile the extents do not divide."""
    out, terms, sizes = CASES[0]
    cfg = mm.MmaConfig((2, 2, 3, 4, 4, 4), 4, 8 if shape != "m16n8k8" else 16, shape)
    got, ref, _ = _emulate(tmp_path, out, terms, sizes, "float64", cfg, seed=7, gen=mm)
    assert _err(got, ref) <= 1e-12


@gxx
def test_emulated_no_store_leaves_output(tmp_path):
    out, terms, sizes = MMA_CASES[1]
    cfg = mm.candidates(_problem(out, terms, sizes), H100)[0]
    got, _, c0 = _emulate(tmp_path, out, terms, sizes, "float64", cfg, seed=5, store=False, gen=mm)
    assert np.array_equal(got, c0)


def test_search_respects_the_device():
    """Every candidate of the (T) tile fits the H100 (dynamic shared memory, registers,
    accumulators), the tiles differ, and the model's times are finite and ranked."""
    out, terms, _ = CASES[0]
    p = _problem(out, terms, TILE)
    cands = mm.candidates(p, H100)
    assert len(cands) == mm.TOP and len({c.tile for c in cands}) == mm.TOP
    times = [mm.predict(p, c, H100) for c in cands]
    assert times == sorted(times) and times[-1] < math.inf
    for cfg in cands:
        assert mm.smem_bytes(p, cfg) <= 227 * 1024 and mm.registers(p, cfg) <= 255
        assert mm.TILE_PRODUCT[0] <= math.prod(cfg.tile) <= mm.TILE_PRODUCT[1]
        assert cfg.threads in [32 * w for w in mm.WARPS]
        r = MMA_SHAPES[cfg.mma][0]
        assert all(x.mt * x.nt * 2 * r // 8 <= mm.MAX_ACC and x.wm * x.wn == cfg.warps for x in mm.layouts(p, cfg))
    assert mm.MmaConfig.from_json(cands[0].to_json()) == cands[0]


def test_search_time():
    """The search takes well under a second or two for the (T) tile (once per tile shape)."""
    out, terms, _ = CASES[0]
    p = _problem(out, terms, dict(TILE, i=4, j=4, k=4))
    t0 = time.perf_counter()
    mm.candidates(p, H100)
    assert time.perf_counter() - t0 < 5


def test_what_the_kernel_does_not_handle():
    """A batch index, float32 or a device without FP64 MMA: no candidates, and generate refuses;
    sm_80 gets only the m8n8k4 shape."""
    out, terms, sizes = CASES[2]  # c is in both operands
    batch = _problem(out, terms, sizes)
    assert not mm.applies(batch, 90) and mm.candidates(batch, H100) == []
    with pytest.raises(ValueError, match="batch"):
        mm.generate(batch, mm.MmaConfig((4, 4, 4), 4, 8, "m8n8k4"))
    out, terms, sizes = CASES[3]
    assert mm.candidates(_problem(out, terms, sizes, "float32"), H100) == []
    old = Device("V100", "70", 80, 48 * 1024, 96 * 1024, 255, 65536, 1024, 2048)
    assert mm.candidates(_problem(out, terms, sizes), old) == []
    on80 = mm.candidates(_problem(*CASES[0][:2], TILE), A100)
    assert on80 and {c.mma for c in on80} == {"m8n8k4"}
    with pytest.raises(ValueError, match="rank"):
        mm.generate(_problem(out, terms, sizes), mm.MmaConfig((8, 8, 8), 4, 8, "m8n8k4"))


@pytest.mark.parametrize("shape", sorted(MMA_SHAPES))
def test_fragment_reads_take_two_wavefronts(shape):
    """Every fragment read of a warp (8 rows × 4 summed elements at the chosen pitch) touches
    each 8-byte slot of a 128-byte shared-memory row exactly twice: two wavefronts, the minimum
    for 32 doubles."""
    out, terms, _ = CASES[0]
    p = _problem(out, terms, TILE)
    for tile in [(1, 3, 3, 8, 8, 8), (3, 3, 3, 4, 4, 8), (1, 1, 7, 16, 16, 4)]:
        for x in mm.layouts(p, mm.MmaConfig(tile, 4, 16, shape)):
            for pitch in (x.pa, x.pb):
                slots = np.bincount([((lane & 3) * pitch + (lane >> 2)) % 16 for lane in range(32)], minlength=16)
                assert (slots == 2).all(), (tile, pitch)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_tile_kernels_compile_without_spills(tmp_path):
    """The (T) tile's top candidates, and one configuration of each MMA shape, compile for sm_90
    with no register spills and no stack frame (accumulators and fragments stay in registers)."""
    out, terms, _ = CASES[0]
    p = _problem(out, terms, TILE)
    cfgs = mm.candidates(p, H100) + [mm.MmaConfig((1, 3, 3, 8, 8, 8), 4, 16, s) for s in sorted(MMA_SHAPES)]
    for cfg, report in zip(cfgs, nvcc_reports(tmp_path, [mm.generate(p, cfg)[1] for cfg in cfgs])):
        assert "0 bytes stack frame, 0 bytes spill stores" in report, (cfg.name(), report)


def test_search_keeps_to_the_opt_in_limit():
    """A device that lets a block opt into less shared memory (consumer parts: about 99 KiB)
    gets only candidates within it."""
    import dataclasses

    out, terms, _ = CASES[0]
    p = _problem(out, terms, TILE)
    small = dataclasses.replace(H100, smem_optin=99 * 1024)
    cands = mm.candidates(p, small)
    assert cands and all(mm.smem_bytes(p, c) <= 99 * 1024 for c in cands)
    assert any(mm.smem_bytes(p, c) > 99 * 1024 for c in mm.candidates(p, H100))
