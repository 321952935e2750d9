"""Single-use point-wise producers inlined into their consumer (``planner/inline.py``): which
bodies qualify, what the fused statement computes, and what the (T) plan becomes."""

from __future__ import annotations

import pytest

from chainexec import spec
from chainexec.planner.build import make_plan
from chainexec.planner.inline import expression, fuse
from chainexec.planner.plan import Contraction, Loop, Op, Plan, TensorInfo, ops
from tests.conftest import triples_config

N = 5


def _c(k, out, oix, a, aix, b=None, bix=None, factor=1.0):
    return Contraction(k, out, list(oix), a, list(aix), b, list(bix) if b else None, factor, False, 0, k)


def _tensors(dtype="float64", computed=None):
    t = {name: TensorInfo(name, list(ix), [N] * len(ix), "float64", 8, role)
         for name, ix, role in [("A", "ij", "input"), ("B", "ij", "input"), ("W", "ij", "intermediate"),
                                ("X", "ij", "intermediate"), ("E", "", "output"), ("F", "ij", "output"),
                                ("y", "i", "output"), ("T", "ijk", "input")]}
    t["X"].dtype, t["X"].itemsize = dtype, 4 if dtype == "float32" else 8
    if computed:
        t["D"] = TensorInfo("D", ["i", "j"], [N, N], "float64", 8, "intermediate", source={"expr": computed})
    return t


def _ref(op, name, ix, level="device"):
    return Op(op, level, tensor=name, indices=list(ix))


def _get(name, ix="ij"):
    return [_ref("alloc", name, ix), _ref("get", name, ix)]


def _compute(k):
    return Op("compute", "device", contraction=k)


PRODUCER = _c(0, "X", "ij", "A", "ij", "B", "ij", 0.5)


def _body(reader: Contraction, between=(), around_producer=None):
    """X made point-wise from A and B, then ``reader`` (contraction 1) reads it."""
    out = reader.out
    producer = [_compute(0)] if around_producer is None else [around_producer]
    return ([_ref("alloc", "X", "ij")] + _get("A") + _get("B") + producer + list(between)
            + [_ref("free", "B", "ij"), _ref("alloc", out, reader.out_indices), _compute(1),
               _ref("free", "X", "ij"), _ref("free", "A", "ij"), _ref("accumulate", out, reader.out_indices),
               _ref("free", out, reader.out_indices)])


def _fused(body):
    return [node for node in body if isinstance(node, Op) and node.op == "fused"]


def test_a_single_use_producer_moves_into_a_scalar_reduction():
    cs = [PRODUCER, _c(1, "E", "", "X", "ij", "A", "ij", 2.0)]
    body = fuse(_body(cs[1]), cs, _tensors(), set())
    (op,) = _fused(body)
    assert (op.tensor, op.group, op.inlined) == ("E", [0, 1], ["X"])
    assert not any(node.tensor == "X" for node in body if node is not op)
    # B, freed after the producer before, now lives until the fused statement has run
    names = [(node.op, node.tensor) for node in body]
    assert names.index(("free", "B")) > names.index(("fused", "E"))
    f = expression(op, cs, _tensors())
    assert f.reduce and f.domain == ("i", "j") and f.out_indices == ()
    assert f.text == "2.0 * (0.5 * A[i,j] * B[i,j]) * A[i,j]"
    assert [(r.tensor, r.indices) for r in f.leaves] == [("A", ("i", "j")), ("B", ("i", "j"))]


def test_a_point_wise_consumer_is_fused_and_keeps_its_output():
    cs = [PRODUCER, _c(1, "F", "ij", "X", "ji", "B", "ij")]
    body = fuse(_body(cs[1]), cs, _tensors(), set())
    (op,) = _fused(body)
    f = expression(op, cs, _tensors())
    assert not f.reduce and f.domain == ("i", "j") and f.text == "1.0 * (0.5 * A[j,i] * B[j,i]) * B[i,j]"


def test_a_computed_tensor_is_evaluated_where_it_is_read():
    cs = [PRODUCER, _c(1, "E", "", "X", "ij", "D", "ji")]
    between = [_ref("alloc", "D", "ij"), _ref("eval", "D", "ij")]
    body = _body(cs[1], between)
    body.insert(-2, _ref("free", "D", "ij"))
    tensors = _tensors(computed="1 / (2 + A[i,j] * A[j,i])")
    (op,) = _fused(fuse(body, cs, tensors, set()))
    assert op.inlined == ["X", "D"]
    text = expression(op, cs, tensors).text.replace(" ", "")
    assert text == "1.0*(0.5*A[i,j]*B[i,j])*(1/(2+A[j,i]*A[i,j]))"


def _unchanged(cs, body, tensors=None, tiled=frozenset()):
    return fuse(body, cs, tensors or _tensors(), set(tiled)) is body


@pytest.mark.parametrize("case", ["read twice", "vector reduction", "summing producer", "renamed tiled index",
                                  "mixed dtypes", "leaf written in between", "producer in an inner loop",
                                  "scalar operand", "broadcast read"])
def test_what_stays_unfused(case):
    reader = _c(1, "E", "", "X", "ij", "A", "ij")
    cs = [PRODUCER, reader]
    tensors, tiled, between, producer = None, (), (), None
    if case == "read twice":
        cs.append(_c(2, "F", "ij", "X", "ij", "B", "ij"))
        between = [_ref("alloc", "F", "ij"), _compute(2)]
    elif case == "vector reduction":
        cs[1] = _c(1, "y", "i", "X", "ij", "A", "ij")
    elif case == "summing producer":
        cs[0] = _c(0, "X", "ij", "A", "ik", "B", "kj")
    elif case == "renamed tiled index":
        cs[1] = _c(1, "E", "", "X", "ji", "A", "ij")
        tiled = ("i",)
    elif case == "mixed dtypes":
        tensors = _tensors("float32")
    elif case == "leaf written in between":
        cs[1] = _c(1, "E", "", "X", "ij", "W", "ij")
        cs += [_c(2, "W", "ij", "A", "ik", "B", "kj")]
        cs[0] = _c(0, "X", "ij", "W", "ij", "B", "ij")
        between = [_compute(2)]
    elif case == "producer in an inner loop":
        producer = Loop("device", {"i": 2}, [_compute(0)])
    elif case == "scalar operand":  # found on the GPU machine: E[] has no reference in the expression language
        cs[0] = _c(0, "X", "ij", "E", "", "B", "ij")
    elif case == "broadcast read":  # X would be made again for every k
        cs[1] = _c(1, "E", "", "X", "ij", "T", "ijk")
    body = _body(cs[1], between, producer)
    if case == "leaf written in between":
        body = [_ref("alloc", "W", "ij"), _compute(2)] + body
    assert _unchanged(cs, body, tensors, tiled)


def test_renamed_reads_over_untiled_indices_are_inlined():
    cs = [PRODUCER, _c(1, "E", "", "X", "ji", "A", "ij")]
    assert _fused(fuse(_body(cs[1]), cs, _tensors(), {"k"}))


@pytest.fixture(scope="module")
def triples(tmp_path_factory):
    out = tmp_path_factory.mktemp("triples")
    return spec.load(triples_config(out, "256MiB", 4, 9, 5))


def test_triples_epilogue_keeps_one_six_index_buffer(triples):
    """V, Z, R, Dinv·R and Dinv all go into the energy's statement, Z (read at six permutations)
    as a reused value: computed once per element and read at its permutations. Of the six
    6-index device buffers W, V, Z, R, Dinv·R and Dinv only W remains; flops and statements are
    those of the unfused plan (same tiles here)."""
    fused, unfused = make_plan(triples), make_plan(triples, inline=False)
    found = {op.tensor: op for nest in fused.nests for op, _ in ops(nest.body) if op.op == "fused"}
    assert sorted(found) == ["E"]
    assert sorted(found["E"].inlined) == sorted(["V", "Z", "R", "Dinv", "_s26_0"]) and found["E"].lets == ["Z"]
    assert found["E"].group == list(range(12, 28))
    six = {op.tensor for nest in fused.nests for op, _ in ops(nest.body)
           if op.op == "alloc" and op.level == "device" and len(op.indices) == 6}
    assert six == {"W"}
    def tiles(plan):
        return [list({id(loop): loop.tiles for _, loops in ops(nest.body) for loop in loops}.values())
                for nest in plan.nests]

    assert tiles(fused) == tiles(unfused)
    for key in ("flops", "statements", "bytes"):
        assert fused.predicted[key] == unfused.predicted[key], key
    assert fused.predicted["streamed"] < 0.8 * unfused.predicted["streamed"]
    assert fused.predicted["memory_peak"]["device"] < 0.6 * unfused.predicted["memory_peak"]["device"]
    assert Plan.from_json(fused.to_json()) == fused


def _plan(tmp_path, statements, outputs):
    import yaml

    cfg = {"name": "chain", "indices": {"i": 6, "j": 6},
           "tensors": {n: {"indices": ["i", "j"], "source": {"random": k}} for k, n in enumerate("ABC", 1)},
           "statements": statements, "outputs": {n: {"file": "o.h5", "dataset": n} for n in outputs},
           "machine": {"global_memory": "1GiB", "device_memory": "1GiB"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return make_plan(spec.load(tmp_path / "c.yaml"))


def test_a_statement_that_would_read_its_own_output_stays_unfused(tmp_path):
    """Inlining P into ``Z += P`` would make one kernel read Z[j,i] while it writes Z[i,j]
    (found in review: a race on the GPU, right on NumPy)."""
    plan = _plan(tmp_path, ["Z[i,j] = A[i,j]", "P[i,j] = Z[j,i] * B[i,j]", "Z[i,j] += P[i,j]",
                            "O[i,j] = Z[i,j] * B[i,j]"], ["O"])
    assert not any(op.op == "fused" and op.tensor == "Z" for nest in plan.nests for op, _ in ops(nest.body))


def test_two_fused_statements_reading_one_buffer_free_it_once_after_both(tmp_path):
    """A is read by both producers; its free moves after the later fused statement, once (found
    in review: each fusion moved it, and planning failed on the double free)."""
    plan = _plan(tmp_path, ["Y[i,j] = A[i,j] * B[i,j]", "X[i,j] = A[i,j] * C[i,j]", "F[i,j] = X[i,j] * B[i,j]",
                            "G[i,j] = Y[i,j] * C[i,j]"], ["F", "G"])
    body = [(op.op, op.tensor) for nest in plan.nests for op, _ in ops(nest.body) if op.level == "device"]
    assert {t for o, t in body if o == "fused"} == {"F", "G"}
    assert body.count(("free", "A")) == 1 and body.index(("free", "A")) > body.index(("fused", "G"))


@pytest.mark.parametrize("indices, statements", [
    # read twice but never permuted: nothing for an orbit kernel to reuse
    ({"i": 4, "j": 4}, ["Z[i,j] = A[i,j] * B[i,j]", "R[i,j] = Z[i,j] * Z[i,j]", "E[] = A[i,j] * R[i,j]"]),
    # permuted across indices of two extents (4 and 6)
    ({"i": 4, "j": 4, "a": 6, "b": 6}, ["Z[i,j,a,b] = T[i,j,a,b] * T[j,i,b,a]", "R[i,j,a,b] = Z[j,i,a,b]",
                                        "R[i,j,a,b] += Z[i,j,b,a]", "E[] = T[i,j,a,b] * R[i,j,a,b]"]),
    # the reduction renames R's indices: Z's value would be made over names the reduction lacks
    ({"i": 4, "j": 4, "a": 4, "b": 4}, ["Z[i,j] = A[i,j] * B[i,j]", "R[i,j] = 2 * Z[i,j]", "R[i,j] -= Z[j,i]",
                                        "E[] = S[a,b] * R[a,b]"]),
    # two values within the kernel's bounds each, together permuting four indices (i, j and a, b)
    ({"i": 4, "j": 4, "a": 4, "b": 4}, ["Z[i,j,a,b] = T[i,j,a,b] * T[i,j,a,b]", "Y[i,j,a,b] = 3 * T[i,j,a,b]",
                                        "R[i,j,a,b] = Z[j,i,a,b]", "R[i,j,a,b] += Z[i,j,a,b]",
                                        "R[i,j,a,b] += Y[i,j,b,a]", "R[i,j,a,b] += Y[i,j,a,b]",
                                        "E[] = T[i,j,a,b] * R[i,j,a,b]"]),
], ids=["never permuted", "unequal extents", "renamed reduction", "four together"])
def test_values_the_orbit_kernel_cannot_reuse_stay_buffers(tmp_path, indices, statements):
    """Found in review (each planned as a reused value, then failed on the GPU or on both
    backends; the last also in the cost model's price of the orbit kernel): such a producer stays
    a buffer, and the run equals einsum."""
    import numpy as np
    import yaml

    from chainexec import api
    from chainexec.generator import block

    shapes = {"A": "ij", "B": "ij", "S": "ab", "T": "ijab"}
    used = {n: ix for n, ix in shapes.items() if any(f"{n}[" in s for s in statements)}
    cfg = {"name": "reuse", "indices": indices,
           "tensors": {n: {"indices": list(ix), "source": {"random": k}} for k, (n, ix) in enumerate(used.items(), 1)},
           "statements": statements, "outputs": {"E": {"file": "o.h5", "dataset": "E"}},
           "machine": {"global_memory": "1GiB", "device_memory": "1GiB"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    plan = make_plan(spec.load(tmp_path / "c.yaml"))
    assert not any(op.lets for nest in plan.nests for op, _ in ops(nest.body))
    api.run(tmp_path / "c.yaml", backend="numpy")
    x = {n: block(k, tuple(indices[i] for i in ix), tuple((0, indices[i]) for i in ix), "float64")
         for k, (n, ix) in enumerate(used.items(), 1)}
    if "Y[i,j,a,b] = 3 * T[i,j,a,b]" in statements:
        t = x["T"]
        z, y = t * t, 3 * t
        ref = np.sum(t * (z.transpose(1, 0, 2, 3) + z + y.transpose(0, 1, 3, 2) + y))
    elif "T" in x:
        t = x["T"]
        z = t * t.transpose(1, 0, 3, 2)
        ref = np.sum(t * (z.transpose(1, 0, 2, 3) + z.transpose(0, 1, 3, 2)))
    elif "S" in x:
        z = x["A"] * x["B"]
        ref = np.sum(x["S"] * (2 * z - z.T))
    else:
        z = x["A"] * x["B"]
        ref = np.sum(x["A"] * z * z)
    import h5py

    with h5py.File(tmp_path / "o.h5") as f:
        assert abs(float(f["E"][()]) - ref) <= 1e-12 * abs(ref)
