"""COGENT kernel configurations: enumeration, pruning and the DRAM-transaction cost model.

Implements the configuration space of Kim et al., "A Code Generator for High-Performance Tensor
Contractions on GPUs" (CGO 2019):

* Section III-B: the output tile of a thread block is a 2-D arrangement of threads
  (TBx x TBy) times a 2-D register tile (REGx x REGy); the external indices of the input that
  holds the output's fastest-varying index (FVI) map to TBx/REGx, the other input's external
  indices to TBy/REGy, the internal (contracted) indices to the serial step TBk.
* Section IV-A / Algorithm 2: enumeration of mappings and tile sizes (TB targets {4, 8, 16},
  REG targets {2, 4, 6, 8}), the Cartesian product of the partial configurations, and pruning
  by hardware constraints (shared memory, registers, threads) and performance constraints
  (coalescing, enough thread blocks).
* Section IV-B / Algorithm 3: the cost of a configuration is its predicted number of DRAM
  transactions (loads of both inputs plus the store of the output).

Layout: every tensor is stored **row-major** (C order), so the *last* index of an index string is
the stride-1 index (the FVI).  COGENT's paper uses column-major strings; all FVI rules here are
the paper's rules applied to the last letter instead of the first.

Deviations from the paper, each needed for correctness or to keep the space non-empty:

* An external index may be split between TB and REG (tile = tb_factor * reg_factor); the paper
  names this extension ("splitting each dimension", Section IV).  Without it a plain GEMM gets
  REGx = REGy = 1.
* When the available extents multiply to less than a TB/REG target, all of them are mapped
  fully (Algorithm 2 would drop the case).  A side without external indices gets an empty
  mapping (size 1).
* Besides the greedy TBk fills, TBk candidates that split a power-of-two target between the two
  inputs' internal FVIs are added, so that the coalescing rule can be met when both inputs have
  different internal FVIs (e.g. ``ab = acd * dbc``).
* The generated kernel loads each shared-memory tile cooperatively in the input's storage order,
  so coalescing depends on the tile, not on whether an index sits in TB or REG.  The coalescing
  constraint therefore asks that each input's FVI has a tile > 1 (TB, REG or TBk) and that the
  output's FVI leads TBx; the cost model ranks how well each tile coalesces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from itertools import product
from typing import Sequence

import numpy as np

from chainexec.speccheck import check_identifier

TB_TARGETS = (4, 8, 16)
"""Target thread-block dimension sizes for TBx, TBy and TBk (Section IV-A-3)."""
REG_TARGETS = (2, 4, 6, 8)
"""Target register-tile dimension sizes for REGx and REGy (Section IV-A-3)."""
BASE_REGISTERS = 32
"""32-bit registers a thread needs besides its tiles (addresses, loop counters, extents)."""
ELEM_BYTES = {"float64": 8, "float32": 4}
"""Bytes per element of the supported dtypes."""


@dataclass(frozen=True)
class Device:
    """The hardware limits the pruning rules and the cost model need (Section IV-A-1, IV-B).

    Units: bytes for memory sizes, 32-bit registers for register counts.  ``smem_per_block`` is
    the static shared-memory limit of one block (48 KiB without the dynamic opt-in), which is
    what the generated kernels use.  ``dram_transaction_bytes`` is the transaction size of the
    cost model (128 bytes in the paper, Section IV-B).
    """

    name: str
    compute_capability: str
    sm_count: int
    smem_per_block: int
    smem_per_sm: int
    regs_per_thread: int
    regs_per_sm: int
    max_threads_per_block: int
    max_threads_per_sm: int
    dram_transaction_bytes: int = 128
    smem_optin: int | None = None
    """Shared memory one block may opt into (bytes; CUDA's ``sharedMemPerBlockOptin``), where
    known: the kernels with dynamic shared memory use no more."""

    @classmethod
    def H100(cls) -> "Device":
        """NVIDIA H100 SXM (compute capability 9.0, 132 SMs): the default target."""
        return cls(name="NVIDIA H100 80GB HBM3", compute_capability="90", sm_count=132,
                   smem_per_block=48 * 1024, smem_per_sm=228 * 1024, regs_per_thread=255,
                   regs_per_sm=65536, max_threads_per_block=1024, max_threads_per_sm=2048)


@dataclass(frozen=True)
class Contraction:
    """A validated binary contraction ``C[c] = sum A[a] * B[b]`` split into COGENT's roles.

    ``x_operand`` is "A" or "B": the input that holds the output's FVI (last index of ``c``);
    ``xs``/``ys`` are the index tuples of that input and of the other one; ``x_ext``/``y_ext``
    their external indices and ``internal`` the contracted ones, each in FVI-to-SVI order
    (last letter first), the walking order of Algorithm 2.
    """

    c: tuple[str, ...]
    a: tuple[str, ...]
    b: tuple[str, ...]
    sizes: dict
    x_operand: str
    xs: tuple[str, ...]
    ys: tuple[str, ...]
    x_ext: tuple[str, ...]
    y_ext: tuple[str, ...]
    internal: tuple[str, ...]


def split_indices(spec: str | Sequence[str]) -> tuple[str, ...]:
    """Index names of a tensor: one per character of a string, or the items of a sequence.

    Every name must be one a config may hold (:func:`~chainexec.speccheck.check_identifier`): it
    becomes part of C identifiers."""
    names = tuple(spec)
    for name in names:
        check_identifier(name, "index name")
    if len(set(names)) != len(names):
        raise ValueError(f"repeated index in {''.join(names)!r}")
    return names


def parse_contraction(c, a, b, sizes: dict) -> Contraction:
    """Validate ``C[c] = sum A[a]*B[b]`` and classify its indices (Section II).

    Raises ValueError for an empty output, an operand with no index (a scalar factor), an index
    in all three tensors (batch/Hadamard), an index in only one tensor, or a missing /
    non-positive extent.
    """
    c, a, b = split_indices(c), split_indices(a), split_indices(b)
    if not c:
        raise ValueError("the output needs at least one index (full reductions are not supported)")
    if not a or not b:
        raise ValueError("both inputs need at least one index (a scalar factor is not a contraction "
                         "the generated kernels take)")
    sa, sb, sc = set(a), set(b), set(c)
    batch = sa & sb & sc
    if batch:
        raise ValueError(f"indices {sorted(batch)} appear in all three tensors "
                         "(batch/Hadamard contractions are not supported by generated kernels)")
    for idx in sa | sb | sc:
        if (idx in sa) + (idx in sb) + (idx in sc) != 2:
            raise ValueError(f"index {idx!r} must appear in exactly two of C, A, B")
        n = sizes.get(idx)
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise ValueError(f"extent of index {idx!r} must be a positive integer, got {n!r}")
    fvi = c[-1]
    x_operand = "A" if fvi in sa else "B"
    xs, ys = (a, b) if x_operand == "A" else (b, a)
    internal = tuple(i for i in reversed(xs) if i not in sc)
    return Contraction(c=c, a=a, b=b, sizes={i: int(sizes[i]) for i in sa | sb | sc},
                       x_operand=x_operand, xs=xs, ys=ys,
                       x_ext=tuple(i for i in reversed(xs) if i in sc),
                       y_ext=tuple(i for i in reversed(ys) if i in sc), internal=internal)


@dataclass(frozen=True)
class KernelConfig:
    """One COGENT kernel configuration (Table II), plain data.

    Mappings are tuples of ``(index, factor)``; the first entry of ``tbx``/``tby``/``tbk`` varies
    fastest with the thread (or step) coordinate.  An external index's tile is the product of its
    TB and REG factors (1 when it is mapped to neither: it then only indexes thread blocks, the
    paper's Blk_x).  ``tiles`` lists every index's tile (``l_Tiles``).  Sizes ``size_*`` are the
    products of the factors; ``threads = size_tbx * size_tby``.  ``smem_bytes`` and
    ``regs_per_thread`` (32-bit registers, an estimate) are the resources of Section IV-A-1.
    ``num_blocks`` and ``num_steps`` and the ``trans_*`` counts (DRAM transactions of
    ``transaction_bytes`` bytes, Algorithm 3) are evaluated at the representative ``sizes``.
    """

    c: tuple[str, ...]
    a: tuple[str, ...]
    b: tuple[str, ...]
    dtype: str
    x_operand: str
    tbx: tuple[tuple[str, int], ...]
    regx: tuple[tuple[str, int], ...]
    tby: tuple[tuple[str, int], ...]
    regy: tuple[tuple[str, int], ...]
    tbk: tuple[tuple[str, int], ...]
    tiles: tuple[tuple[str, int], ...]
    size_tbx: int
    size_regx: int
    size_tby: int
    size_regy: int
    size_tbk: int
    threads: int
    smem_bytes: int
    regs_per_thread: int
    sizes: tuple[tuple[str, int], ...]
    num_blocks: int
    num_steps: int
    transaction_bytes: int
    trans_x: int
    trans_y: int
    trans_c: int
    trans_total: int

    @classmethod
    def from_dict(cls, d: dict) -> "KernelConfig":
        """Rebuild a config from ``dataclasses.asdict`` output after a JSON round trip."""
        def conv(v):
            return tuple(conv(x) for x in v) if isinstance(v, list) else v
        return cls(**{f.name: conv(d[f.name]) for f in fields(cls)})

    def tile(self, index: str) -> int:
        """Tile size of ``index`` (1 for an index not tiled)."""
        return dict(self.tiles).get(index, 1)


def _fill(order: Sequence[tuple[str, int]], target: int) -> tuple[tuple[str, int], ...]:
    """Greedy fill of one dimension up to ``target`` (Algorithm 2, lines 10-46).

    Walks ``(index, available extent)`` pairs in order, mapping each fully until the product
    reaches the target; the index that overshoots gets the tile ``target // product_so_far``
    (line 14).  Indices with extent 1 are skipped.  If all extents multiply to less than the
    target, all are mapped fully.
    """
    out, prev = [], 1
    for name, n in order:
        if n <= 1:
            continue
        if prev * n >= target:
            f = target // prev if prev * n > target else n
            if f > 1:
                out.append((name, f))
            return tuple(out)
        out.append((name, n))
        prev *= n
    return tuple(out)


def _rotations(seq: Sequence) -> list[list]:
    """All cyclic rotations of ``seq`` (the ``s_idx`` loop of Algorithm 2, lines 3, 24, 44)."""
    return [list(seq[s:]) + list(seq[:s]) for s in range(len(seq))] or [[]]


def _enum_tb_reg(ext: tuple[str, ...], sizes: dict, lead: str | None) -> list[tuple]:
    """Partial configurations (TB mapping, REG mapping) for one side (Algorithm 2 + enum_REG).

    ``ext`` are the side's external indices in FVI-to-SVI order; ``lead`` (the output FVI on the
    x side) is always mapped first on TB.  REG then takes the remaining extents
    ``ceil(N / tb_factor)`` of every index, including one split by TB.
    """
    if not ext:
        return [((), ())]
    tbs = set()
    others = [i for i in ext if i != lead]
    for target, rot in product(TB_TARGETS, _rotations(others)):
        order = ([lead] if lead else []) + rot
        tbs.add(_fill([(i, sizes[i]) for i in order], target))
    parts = set()
    for tb in tbs:
        tbd = dict(tb)
        cand = [(i, -(-sizes[i] // tbd.get(i, 1))) for i in ext]
        cand = [(i, r) for i, r in cand if r > 1]
        if not cand:
            parts.add((tb, ()))
        for target, rot in product(REG_TARGETS, _rotations(cand)):
            parts.add((tb, _fill(rot, target)))
    return sorted(parts)


def _enum_tbk(con: Contraction) -> list[tuple]:
    """TBk candidates: greedy fills over the internal indices (Algorithm 2 applied to TBk) plus
    power-of-two splits of each target between the two inputs' internal FVIs."""
    internal, sizes = con.internal, con.sizes
    if not internal:
        return [()]
    out = set()
    for target, rot in product(TB_TARGETS, _rotations(internal)):
        out.add(_fill([(i, sizes[i]) for i in rot], target))
    fvis = [t[-1] for t in (con.xs, con.ys) if t[-1] in internal]
    if len(fvis) == 2 and fvis[0] != fvis[1]:
        k1, k2 = fvis
        for target in TB_TARGETS:
            t1 = 2
            while t1 < target:
                pair = ((k1, min(t1, sizes[k1])), (k2, min(target // t1, sizes[k2])))
                out.add(tuple(p for p in pair if p[1] > 1))
                t1 *= 2
    return sorted(out)


def smem_pitches(con: Contraction, x_tile, y_tile) -> tuple:
    """Row pitches (elements) of the shared-memory tiles ``sX[TBk][pitch_x]``, ``sY[TBk][pitch_y]``.

    One element of padding is added when the input's FVI is internal: its cooperative load then
    writes consecutive k rows from consecutive threads, which without padding would fall in one
    bank.  Used by the shared-memory constraint and by the code generator alike.
    """
    return x_tile + int(con.xs[-1] in con.internal), y_tile + int(con.ys[-1] in con.internal)


def _factor(mapping: tuple, index: str) -> int:
    return dict(mapping).get(index, 1)


def _tensor_transactions(order, tiles: dict, sizes: dict, elem_bytes: int, trans_bytes: int):
    """DRAM transactions to move one tile of a tensor stored row-major in ``order``.

    Generalises Algorithm 3, lines 2-10: ``cal_Cont`` is the number of contiguous elements of
    the tile in global memory (the FVI's tile, extended through slower indices while the tile
    covers the full extent); the tile is moved as ``elems / cont`` runs of ``cont`` elements,
    each costing ``ceil(cont * elem_bytes / trans_bytes)`` transactions (aligned, as the paper
    assumes).  Tiles are numpy arrays (or ints) broadcast over configurations; a tile larger than
    the extent counts only the extent.
    """
    elems, cont, alive = 1, 1, True
    for name in reversed(order):
        n = sizes[name]
        t = np.minimum(tiles.get(name, 1), n)
        elems = elems * t
        cont = np.where(alive, cont * t, cont)
        alive = np.logical_and(alive, t >= n)
    per_run = -(-(cont * elem_bytes) // trans_bytes)
    return (elems // cont) * per_run


def _store_run(con: Contraction, tb: tuple) -> int:
    """Contiguous output elements written by consecutive threads of one warp row.

    The thread x-coordinate walks the TBx mapping (first entry fastest); its run in C extends
    from the output FVI through following TBx entries while each is the next slower index of C
    and the previous one is fully covered by its TB factor alone.
    """
    run, pos = 1, len(con.c) - 1
    for name, f in tb:
        if pos < 0 or name != con.c[pos]:
            break
        n = con.sizes[name]
        run *= min(f, n)
        if f < n:
            break
        pos -= 1
    return run


def _evaluate(c, a, b, sizes: dict, dtype: str, device: Device) -> dict:
    """Evaluate the whole configuration space with numpy (see :func:`enumerate_configs`).

    Returns a dict with the partial configurations, per-configuration arrays of shape
    ``(n_x, n_y, n_k)``, the survivor mask ``alive`` and the pruning ``stats``.
    """
    if dtype not in ELEM_BYTES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(ELEM_BYTES)}")
    con = parse_contraction(c, a, b, sizes)
    ebytes, words = ELEM_BYTES[dtype], ELEM_BYTES[dtype] // 4
    sz = con.sizes
    xparts = _enum_tb_reg(con.x_ext, sz, con.c[-1])
    yparts = _enum_tb_reg(con.y_ext, sz, None)
    kparts = _enum_tbk(con)
    total = len(xparts) * len(yparts) * len(kparts)

    def tile_of(part, i):
        return _factor(part[0], i) * _factor(part[1], i)

    def fvi_ok(tensor, tile):
        return sz[tensor[-1]] == 1 or tile(tensor[-1]) > 1

    def x_ok(p):
        lead_ok = bool(p[0]) and p[0][0][0] == con.c[-1] or sz[con.c[-1]] == 1
        return lead_ok and (con.xs[-1] not in con.x_ext or fvi_ok(con.xs, lambda i: tile_of(p, i)))

    def y_ok(p):
        return con.ys[-1] not in con.y_ext or fvi_ok(con.ys, lambda i: tile_of(p, i))

    def k_ok(k):
        return all(t[-1] not in con.internal or fvi_ok(t, lambda i: _factor(k, i))
                   for t in (con.xs, con.ys))

    xparts = [p for p in xparts if x_ok(p)]
    yparts = [p for p in yparts if y_ok(p)]
    kparts = [k for k in kparts if k_ok(k)]
    removed = {"coalescing": total - len(xparts) * len(yparts) * len(kparts)}
    stats = {"total": total, "removed": removed,
             "partials": {"x": len(xparts), "y": len(yparts), "k": len(kparts)}}
    if not (xparts and yparts and kparts):
        removed.update(threads=0, shared_memory=0, registers=0, thread_blocks=0)
        stats.update(survivors=0, relaxed_thread_blocks=False)
        return {"stats": stats, "alive": np.zeros((0, 0, 0), dtype=bool)}

    def prod_attr(parts, fn, shape):
        return np.array([fn(p) for p in parts], dtype=np.int64).reshape(shape)

    shx, shy, shk = (-1, 1, 1), (1, -1, 1), (1, 1, -1)
    tx = prod_attr(xparts, lambda p: math.prod(f for _, f in p[0]), shx)
    rx = prod_attr(xparts, lambda p: math.prod(f for _, f in p[1]), shx)
    ty = prod_attr(yparts, lambda p: math.prod(f for _, f in p[0]), shy)
    ry = prod_attr(yparts, lambda p: math.prod(f for _, f in p[1]), shy)
    tk = prod_attr(kparts, lambda k: math.prod(f for _, f in k), shk)
    tiles = {i: prod_attr(xparts, lambda p, i=i: tile_of(p, i), shx) for i in con.x_ext}
    tiles.update({i: prod_attr(yparts, lambda p, i=i: tile_of(p, i), shy) for i in con.y_ext})
    tiles.update({i: prod_attr(kparts, lambda k, i=i: _factor(k, i), shk) for i in con.internal})
    shape = (len(xparts), len(yparts), len(kparts))

    threads = np.broadcast_to(tx * ty, shape)
    pitch_x, pitch_y = smem_pitches(con, tx * rx, ty * ry)
    smem = np.broadcast_to((pitch_x + pitch_y) * tk * ebytes, shape)
    regs = np.broadcast_to(words * (rx * ry + rx + ry) + BASE_REGISTERS, shape)
    blocks = np.ones(shape, dtype=np.int64)
    for i in con.c:
        blocks = blocks * (-(-sz[i] // tiles[i]))
    steps = np.ones(shape, dtype=np.int64)
    for i in con.internal:
        steps = steps * (-(-sz[i] // tiles[i]))
    blocks, steps = np.broadcast_to(blocks, shape), np.broadcast_to(steps, shape)

    alive = np.ones(shape, dtype=bool)
    checks = [("threads", threads <= device.max_threads_per_block),
              ("shared_memory", smem <= device.smem_per_block),
              ("registers", (regs <= device.regs_per_thread)
               & (regs * threads <= device.regs_per_sm)),
              ("thread_blocks", blocks >= device.sm_count)]
    relaxed = False
    for name, ok in checks:
        new = alive & ok
        if name == "thread_blocks" and not new.any() and alive.any():
            new = alive & (blocks == blocks[alive].max())
            relaxed = True
        removed[name] = int(alive.sum() - new.sum())
        alive = new

    tb = device.dram_transaction_bytes
    xs_tiles = {i: tiles[i] for i in con.xs}
    ys_tiles = {i: tiles[i] for i in con.ys}
    trans_x = blocks * steps * _tensor_transactions(con.xs, xs_tiles, sz, ebytes, tb)
    trans_y = blocks * steps * _tensor_transactions(con.ys, ys_tiles, sz, ebytes, tb)
    c_elems = np.ones((1, 1, 1), dtype=np.int64)
    for i in con.c:
        c_elems = c_elems * np.minimum(tiles[i], sz[i])
    run = prod_attr(xparts, lambda p: _store_run(con, p[0]), shx)
    trans_c = blocks * (-(-c_elems // run)) * (-(-(run * ebytes) // tb))
    trans_x, trans_y, trans_c = (np.broadcast_to(t, shape) for t in (trans_x, trans_y, trans_c))

    stats.update(survivors=int(alive.sum()), relaxed_thread_blocks=relaxed)
    arrays = dict(threads=threads, smem_bytes=smem, regs_per_thread=regs, num_blocks=blocks,
                  num_steps=steps, trans_x=trans_x, trans_y=trans_y, trans_c=trans_c,
                  size_tbx=tx, size_regx=rx, size_tby=ty, size_regy=ry, size_tbk=tk)
    return {"con": con, "dtype": dtype, "transaction_bytes": tb, "parts": (xparts, yparts, kparts),
            "arrays": arrays, "alive": alive, "stats": stats}


def _build(space: dict, where: tuple) -> list[KernelConfig]:
    """KernelConfig objects for the configurations at index arrays ``where = (ix, iy, ik)``."""
    con, (xparts, yparts, kparts) = space["con"], space["parts"]
    sizes_t = tuple(sorted(con.sizes.items()))
    tb_bytes = space["transaction_bytes"]
    cols = {k: np.broadcast_to(v, space["alive"].shape)[where].tolist()
            for k, v in space["arrays"].items()}
    out = []
    for n, (ix, iy, ik) in enumerate(zip(*(w.tolist() for w in where))):
        (tbx, regx), (tby, regy), tbk = xparts[ix], yparts[iy], kparts[ik]
        tl = {i: _factor(tbx, i) * _factor(regx, i) for i in con.x_ext}
        tl.update({i: _factor(tby, i) * _factor(regy, i) for i in con.y_ext})
        tl.update({i: _factor(tbk, i) for i in con.internal})
        val = {k: v[n] for k, v in cols.items()}
        out.append(KernelConfig(
            c=con.c, a=con.a, b=con.b, dtype=space["dtype"], x_operand=con.x_operand,
            tbx=tbx, regx=regx, tby=tby, regy=regy, tbk=tbk, tiles=tuple(sorted(tl.items())),
            sizes=sizes_t, transaction_bytes=tb_bytes,
            trans_total=val["trans_x"] + val["trans_y"] + val["trans_c"], **val))
    return out


def enumerate_configs(c, a, b, sizes: dict, dtype: str, device: Device
                      ) -> tuple[list[KernelConfig], dict]:
    """All configurations that survive COGENT's pruning, and how many each constraint removed.

    The space is the Cartesian product of the x-side partials (TBx, REGx), the y-side partials
    (TBy, REGy) and the TBk partials (Section IV-A-3).  Constraints, applied in this order, each
    counted on what the previous ones left (Section IV-A-1/2):

    * ``coalescing``: the output FVI leads TBx, each input's FVI has a tile > 1;
    * ``threads``: ``size_tbx * size_tby <= device.max_threads_per_block``;
    * ``shared_memory``: ``(TBx*REGx + TBy*REGy) * TBk * elem_bytes <= device.smem_per_block``
      (plus the padding of :func:`smem_pitches`);
    * ``registers``: estimated registers per thread within ``regs_per_thread`` and one block's
      registers within ``regs_per_sm``;
    * ``thread_blocks``: at least ``device.sm_count`` thread blocks at the representative sizes;
      if this removes every configuration it is relaxed to keep those with the most blocks
      (``stats['relaxed_thread_blocks']``).

    Returns ``(configs, stats)``; ``stats`` has ``total``, ``removed`` (dict by constraint),
    ``survivors``, ``partials`` (counts of x, y and k partial configurations) and
    ``relaxed_thread_blocks``.
    """
    space = _evaluate(c, a, b, sizes, dtype, device)
    if not space["alive"].any():
        return [], space["stats"]
    return _build(space, np.nonzero(space["alive"])), space["stats"]


def config_rank(cfg: KernelConfig) -> tuple:
    """Sort key of :func:`choose_config`: the Algorithm-3 DRAM transactions first; ties (the
    model does not see how a tile splits between threads and registers) go to the larger
    register tile (more FMAs per shared-memory load), then more threads, then larger TBk (fewer
    barriers), then the mappings themselves (a deterministic order)."""
    return (cfg.trans_total, -cfg.size_regx * cfg.size_regy, -cfg.threads, -cfg.size_tbk,
            (cfg.tbx, cfg.regx), (cfg.tby, cfg.regy), cfg.tbk)


def choose_config(c, a, b, sizes: dict, dtype: str, device: Device) -> KernelConfig:
    """The surviving configuration with the fewest predicted DRAM transactions (Section IV-B)."""
    space = _evaluate(c, a, b, sizes, dtype, device)
    alive = space["alive"]
    if not alive.any():
        raise ValueError(f"no kernel configuration survives pruning for "
                         f"{c}={a}*{b}: {space['stats']['removed']}")
    where = np.nonzero(alive)
    arr = {k: np.broadcast_to(v, alive.shape)[where] for k, v in space["arrays"].items()}
    total = arr["trans_x"] + arr["trans_y"] + arr["trans_c"]
    # np.lexsort sorts by its last key first; the partial lists are sorted, so their indices
    # order ties exactly as the mapping tuples of config_rank do.
    order = np.lexsort((where[2], where[1], where[0], -arr["size_tbk"], -arr["threads"],
                        -arr["size_regx"] * arr["size_regy"], total))
    best = order[0]
    return _build(space, tuple(w[best:best + 1] for w in where))[0]
