"""`chainexec verify`: the full einsum and the sampled explicit-sum paths agree with a direct
computation, and both catch a corrupted output."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest

from chainexec import spec
from chainexec.generator import block
from chainexec.verify import expand, verify
from tests.conftest import assert_refused, fourindex_config, run_cli, write_config

CONFIG = {
    "indices": {"i": 4, "j": 5, "k": 3, "l": 6, "m": 2},
    "tensors": {
        "A": {"indices": ["i", "k"], "source": {"random": 1}},
        "B": {"indices": ["k", "j", "l"], "source": {"random": 2}},
        "D": {"indices": ["l", "m"], "source": {"random": 3}},
        "E": {"indices": ["i", "m", "j"], "source": {"random": 4}},
    },
    "statements": ["T[i,j,l] = A[i,k] * B[k,j,l]", "R[i,m,j] = 2 * T[i,j,l] * D[l,m]", "R[i,m,j] += E[i,m,j]",
                   "R[i,m,j] += -1 * A[i,k] * B[k,j,l] * D[l,m]"],
    "outputs": {"R": {"file": "out.h5", "dataset": "R"}},
    "machine": {"global_memory": "2KiB", "device_memory": "512B"},
}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    folder = tmp_path_factory.mktemp("verify")
    config = write_config(folder, CONFIG)
    assert run_cli("run", config).returncode == 0
    return config


def test_expansion_counts_terms(finished):
    s = spec.load(finished)
    terms = expand(s, "R")
    assert len(terms) == 3 and sorted(len(ops) for _, ops, _ in terms) == [1, 3, 3]


@pytest.mark.parametrize("limit", [2 << 30, 1024, 0])
def test_both_paths_pass_and_catch_corruption(finished, limit):
    """The full check, and the sampled one with some inputs held whole (1 KiB: A, B and D) or
    none, pass the run's output and fail it with every element off by 1e-9."""
    s = spec.load(finished)
    checks = verify(s, samples=500, limit=limit)
    assert [c.method for c in checks] == (["einsum"] if limit == 2 << 30 else ["sampled"])
    assert all(c.ok for c in checks)
    part = next((finished.parent / "out.h5.parts").rglob("rank0.h5"))
    with h5py.File(part, "a") as f:
        name = next(iter(f))
        original = f[name][...]
        f[name][...] = original * (1 + 1e-9)
    try:
        assert not any(c.ok for c in verify(s, samples=500, limit=limit))
    finally:
        with h5py.File(part, "a") as f:
            f[name][...] = original


def test_direct_value(finished):
    a, b, d, e = (block(k, shape, tuple((0, n) for n in shape), "float64")
                  for k, shape in [(1, (4, 3)), (2, (3, 5, 6)), (3, (6, 2)), (4, (4, 2, 5))])
    expected = np.einsum("ik,kjl,lm->imj", a, b, d) + e
    with h5py.File(finished.parent / "out.h5", "r") as f:
        assert np.allclose(f["R"][...], expected, rtol=1e-13, atol=1e-13)


def test_refuses_incomplete_output(finished, tmp_path):
    cfg = dict(CONFIG, outputs={"R": {"file": str(tmp_path / "never.h5"), "dataset": "R"}})
    proc = run_cli("verify", write_config(tmp_path, cfg))
    assert proc.returncode == 2 and "never.h5" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("limit", [2 << 30, 0])
@pytest.mark.parametrize("stored", ["broadcastable shape", "other shape", "group"])
def test_refuses_an_output_of_another_shape_or_no_dataset(finished, tmp_path, stored, limit):
    """An output marked complete whose dataset has another shape (one NumPy would broadcast
    against the reference, or not) or is a group: one line naming the file, on both paths."""
    from chainexec.errors import ChainexecError

    with h5py.File(finished.parent / "out.h5", "r") as f:
        r = f["R"][()]
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f.attrs["chainexec_complete"] = True
        if stored == "group":
            f.create_group("R")
        else:
            f["R"] = r[None] if stored == "broadcastable shape" else r[0]
    cfg = dict(CONFIG, outputs={"R": {"file": str(path), "dataset": "R"}})
    with pytest.raises(ChainexecError, match="other.h5: (no dataset 'R'|dataset 'R' holds float64 values of shape)"):
        verify(spec.load(write_config(tmp_path, cfg)), samples=50, limit=limit)


@pytest.mark.parametrize("limit", [2 << 30, 0])
def test_an_output_that_cancels_is_judged_against_its_terms(tmp_path, limit):
    """X - X computed in two orders is rounding alone (about 1e-16 of its terms): relative to a
    zero reference every correct run would fail; relative to the terms' magnitude it passes, and
    an error of about 1e-9 of that magnitude is still caught."""
    cfg = dict(CONFIG, statements=["T[i,j,l] = A[i,k] * B[k,j,l]", "R[i,m,j] = 2 * T[i,j,l] * D[l,m]",
                                   "R[i,m,j] += -2 * A[i,k] * B[k,j,l] * D[l,m]"])
    config = write_config(tmp_path, cfg)
    assert run_cli("run", config).returncode == 0
    s = spec.load(config)
    (check,) = verify(s, samples=500, limit=limit)
    assert check.ok and "cancels" in check.method, check
    part = next((tmp_path / "out.h5.parts").rglob("rank0.h5"))
    with h5py.File(part, "a") as f:
        name = next(iter(f))
        f[name][...] += 1e-8  # the terms are of order 1 to 10
    (check,) = verify(s, samples=500, limit=limit)
    assert not check.ok, check


def test_scalar_outputs_are_the_complete_scalars(tmp_path):
    """``scalar_outputs``: the (T) job's energy as written (equal to the independent NumPy
    reference), nothing for a chain whose output is a tensor, and an output not marked complete
    is refused, as ``verify`` refuses it."""
    from chainexec.chem.triples import ccsd_t_energy
    from chainexec.errors import ChainexecError
    from chainexec.verify import scalar_outputs
    from tests.conftest import triples_config

    config = triples_config(tmp_path, "1GiB", 3, 7)
    assert run_cli("run", config).returncode == 0
    expected = ccsd_t_energy(tmp_path / "inputs.h5")
    (name, value), = scalar_outputs(spec.load(config)).items()
    assert name == "E" and abs(value - expected) <= 1e-12 * abs(expected)
    tensor = write_config(tmp_path, CONFIG, "tensor.yaml")
    assert run_cli("run", tensor).returncode == 0
    assert scalar_outputs(spec.load(tensor)) == {}
    with h5py.File(tmp_path / "energy.h5", "a") as f:
        f.attrs["chainexec_complete"] = False
    with pytest.raises(ChainexecError, match="not marked complete"):
        scalar_outputs(spec.load(config))


@pytest.mark.parametrize("samples, limit, needle", [
    (0, 0, "--samples must be at least 1"), (-3, 0, "--samples must be at least 1"),
    (0, 2 << 30, "--samples must be at least 1"), (300, -1, "--full-limit must be 0 bytes or more"),
    (1, 0, None), (1, 2 << 30, None)])
def test_a_check_of_nothing_is_refused(finished, samples, limit, needle):
    """`verify` that would check no element (no samples, or a negative byte limit) exits 2 with one
    line naming the option; one sample, or the full einsum, checks and passes."""
    proc = run_cli("verify", finished, "--samples", samples, "--full-limit", limit)
    if needle is None:
        assert proc.returncode == 0, proc.stderr
        expected = 1 if limit == 0 else 4 * 2 * 5
        assert f" over {expected} elements" in proc.stdout and proc.stdout.rstrip().endswith("ok"), proc.stdout
        return
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert needle in line and f"not {samples if samples < 1 else limit}" in line, line


@pytest.mark.parametrize("limit", [None, 0], ids=["einsum", "sampled"])
def test_an_output_allowed_inf_is_checked_where_finite_and_not_finite_where_numpys_is_not(tmp_path, limit):
    """An output with ``allow_nonfinite`` whose input holds an inf: verify passes it without a
    warning (it printed NumPy's RuntimeWarning and failed it, relative error nan), and fails it
    where a value NumPy's reference has as inf or NaN is finite in the output."""
    cfg = fourindex_config()
    cfg["outputs"]["B"]["allow_nonfinite"] = True
    config = write_config(tmp_path, cfg)
    assert run_cli("generate", config).returncode == 0
    with h5py.File(tmp_path / "in.h5", "a") as f:
        f["C"][1, 1] = np.inf
    assert run_cli("run", config, "--quiet").returncode == 0
    options = [] if limit is None else ["--full-limit", limit, "--samples", 10**9]
    proc = run_cli("verify", config, *options)
    assert proc.returncode == 0 and proc.stderr == "" and " ok" in proc.stdout, proc.stdout + proc.stderr
    shard = next((tmp_path / "out" / "result.h5.parts").rglob("rank0.h5"))
    with h5py.File(shard, "a") as f:
        name = next(n for n in f)
        values = f[name][()]
        assert not np.isfinite(values).all()
        values[~np.isfinite(values)] = 1.0
        f[name][...] = values
    proc = run_cli("verify", config, *options)
    assert proc.returncode == 1 and "relative error inf" in proc.stdout and "FAILED" in proc.stdout, proc.stdout


def test_a_sampled_check_of_more_samples_than_elements_checks_each_element_once(finished):
    """``--samples`` above the output's elements (120 here) checks each of them, not a billion picks."""
    [check] = verify(spec.load(finished), samples=10**9, limit=0)
    assert check.ok and check.elements == 4 * 2 * 5 and check.method == "sampled"


@pytest.mark.parametrize("gone", ["an input's virtual source", "the output's parts folder"])
def test_values_that_lie_in_a_file_not_there_are_named(tmp_path, gone):
    """An input or output whose values lie in another file (a virtual dataset's source, the
    output's shards in its parts folder) that is not there: one line naming that file, exit 2
    (HDF5 read fill values: relative error inf or nan, blamed on the output)."""
    config = write_config(tmp_path, fourindex_config())
    assert run_cli("generate", config).returncode == 0
    if gone == "an input's virtual source":
        with h5py.File(tmp_path / "in.h5", "r") as f:
            values = f["A"][()]
        with h5py.File(tmp_path / "src.h5", "w") as f:
            f["A"] = values
        layout = h5py.VirtualLayout(shape=values.shape, dtype=values.dtype)
        layout[...] = h5py.VirtualSource(str(tmp_path / "src.h5"), "A", shape=values.shape)
        with h5py.File(tmp_path / "in.h5", "a") as f:
            del f["A"]
            f.create_virtual_dataset("A", layout, fillvalue=0.0)
    assert run_cli("run", config, "--quiet").returncode == 0
    missing = tmp_path / "src.h5"
    if gone == "an input's virtual source":
        missing.unlink()
    else:
        missing = next((tmp_path / "out" / "result.h5.parts").rglob("rank0.h5"))
        (tmp_path / "out" / "result.h5.parts").rename(tmp_path / "moved")
    assert_refused(run_cli("verify", config), str(missing), "which is not there")


@pytest.mark.parametrize("memory, method", [("3KiB", "sampled"), ("1GiB", "einsum")])
def test_the_default_full_limit_is_a_fifth_of_the_host_memory(finished, memory, method):
    """Without ``--full-limit`` the whole chain is einsum'd where its tensors take at most a fifth
    of the host memory available (here set through ``CHAINEXEC_HOST_MEMORY``), else sampled."""
    proc = run_cli("verify", finished, env={"CHAINEXEC_HOST_MEMORY": memory})
    assert proc.returncode == 0 and f": {method} over " in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("limit", [2 << 30, 0], ids=["einsum", "sampled"])
def test_one_element_whose_terms_cancel_allows_no_other_element_more(tmp_path, limit):
    """``y = A·x`` with one row of terms ±1e14 that cancel: its element may be off by the rounding
    of 1e14, but the other elements (terms of order 1) are held to theirs. Two of them changed by
    1.5 and 2 fail (they passed as cancellation, relative error 8.8e-13), the correct output
    passes."""
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["A"] = np.array([[1e14, -1e14], [1.0, 0.5], [0.25, 2.0], [3.0, 1.0]])
        f["x"] = np.ones(2)
    cfg = {"indices": {"i": 4, "k": 2},
           "tensors": {"A": {"indices": ["i", "k"], "source": {"file": "in.h5", "dataset": "A"}},
                       "x": {"indices": ["k"], "source": {"file": "in.h5", "dataset": "x"}}},
           "statements": ["y[i] = A[i,k] * x[k]"], "outputs": {"y": {"file": "out.h5", "dataset": "y"}}}
    config = write_config(tmp_path, cfg)
    assert run_cli("run", config, "--quiet").returncode == 0
    s = spec.load(config)
    (check,) = verify(s, samples=10, limit=limit)
    assert check.ok, check
    part = next((tmp_path / "out.h5.parts").rglob("rank0.h5"))
    with h5py.File(part, "a") as f:
        name = next(iter(f))
        f[name][1] = -1.0
        f[name][3] = 6.0
    (check,) = verify(s, samples=10, limit=limit)
    assert not check.ok and check.relative_error > 1e-13, check


def _packed_output(folder, extent: int):
    """A run of ``C = A·Aᵀ`` written packed (s2) in ``folder``: its config."""
    cfg = {"indices": {"i": extent, "j": extent, "k": 3},
           "tensors": {"A": {"indices": ["i", "k"], "source": {"random": 1}},
                       "C": {"indices": ["i", "j"], "symmetry": {"pairs": [["i", "j"]]}, "layout": "s2"}},
           "statements": ["C[i,j] = A[i,k] * A[j,k]"], "outputs": {"C": {"file": "out.h5", "dataset": "C"}}}
    folder.mkdir()
    config = write_config(folder, cfg)
    assert run_cli("run", config, "--quiet").returncode == 0
    return config


@pytest.mark.parametrize("limit", [2 << 30, 0], ids=["einsum", "sampled"])
def test_a_packed_output_is_checked_at_its_stored_elements(tmp_path, limit):
    """A packed (s2) output: both paths read its stored elements (the sampled one failed on any
    packed output, PySCF's AO→MO s4 included: 2 indexing arguments for 1 dimension), pass it, and
    fail it with one stored element changed."""
    config = _packed_output(tmp_path / "five", 5)
    s = spec.load(config)
    (check,) = verify(s, samples=10**9, limit=limit)
    assert check.ok and check.elements == 25, check
    part = next((tmp_path / "five" / "out.h5.parts").rglob("rank0.h5"))
    with h5py.File(part, "a") as f:
        name = next(iter(f))
        f[name][7] += 1e-6
    (check,) = verify(s, samples=10**9, limit=limit)
    assert not check.ok, check


@pytest.mark.parametrize("limit", [2 << 30, 0], ids=["einsum", "sampled"])
@pytest.mark.parametrize("other", [4, 6])
def test_a_packed_output_of_other_extents_is_refused(tmp_path, other, limit):
    """The s2 output of a run at extent 4 or 6 read under the extent-5 config: one line naming
    the file (extent 6 passed: its first 15 stored values read as the 5×5 triangle; extent 4
    crashed with an IndexError)."""
    from chainexec.errors import ChainexecError

    config = _packed_output(tmp_path / "five", 5)
    _packed_output(tmp_path / "other", other)
    (tmp_path / "five" / "out.h5").unlink()
    shutil.rmtree(tmp_path / "five" / "out.h5.parts")
    shutil.copy(tmp_path / "other" / "out.h5", tmp_path / "five" / "out.h5")
    shutil.copytree(tmp_path / "other" / "out.h5.parts", tmp_path / "five" / "out.h5.parts")
    with pytest.raises(ChainexecError, match="five/out.h5: dataset 'C' holds float64 values of shape "
                                             rf"\({other * (other + 1) // 2},\).*not this config's output"):
        verify(spec.load(config), samples=50, limit=limit)


@pytest.mark.parametrize("limit", [2 << 30, 0], ids=["einsum", "sampled"])
def test_an_output_of_another_dtype_is_refused(finished, tmp_path, limit):
    """The float64 run's output read under the same chain in float32: not its output (it passed)."""
    from chainexec.errors import ChainexecError

    cfg = dict(CONFIG, dtype="float32", outputs={"R": {"file": str(finished.parent / "out.h5"), "dataset": "R"}})
    with pytest.raises(ChainexecError, match="out.h5: dataset 'R' holds float64 values .* is float32"):
        verify(spec.load(write_config(tmp_path, cfg)), samples=50, limit=limit)


def test_a_missing_output_is_named_by_the_sampled_check(tmp_path):
    """The sampled check of an output never written: one line naming it, exit 2, as the full
    check's (a FileNotFoundError traceback)."""
    cfg = dict(CONFIG, outputs={"R": {"file": "never.h5", "dataset": "R"}})
    assert_refused(run_cli("verify", write_config(tmp_path, cfg), "--full-limit", 0), "never.h5")


def test_the_sampled_check_reads_inputs_where_its_samples_need_them(tmp_path):
    """A seeded input of 10^11 elements (800 GB) checked by samples: each sample makes the one row
    it needs (the check made every input whole first: out of memory). The output, zeros written
    by hand, fails."""
    cfg = {"indices": {"i": 10**6, "k": 10**5},
           "tensors": {"A": {"indices": ["i", "k"], "source": {"random": 1}},
                       "x": {"indices": ["k"], "source": {"random": 2}}},
           "statements": ["y[i] = A[i,k] * x[k]"], "outputs": {"y": {"file": "out.h5", "dataset": "y"}}}
    config = write_config(tmp_path, cfg)
    with h5py.File(tmp_path / "out.h5", "w") as f:
        f.attrs["chainexec_complete"] = True
        f.create_dataset("y", data=np.zeros(10**6))
    (check,) = verify(spec.load(config), samples=20, limit=0)
    assert check.method == "sampled" and check.elements == 20 and not check.ok, check


def test_a_copy_of_an_earlier_output_is_not_checked_against_a_later_run_s_values(tmp_path):
    """``out.h5`` copied to ``backup.h5`` (the file alone), then the chain run again with another
    seed: the copy's datasets read the parts folder the new run filled, so it held the new values
    and verified against the new config. Verified under the old config now, it is one line naming
    the parts folder, exit 2; the new output verifies."""
    config = write_config(tmp_path, dict(CONFIG, outputs={"R": {"file": "out.h5", "dataset": "R"}}))
    assert run_cli("run", config, "--quiet").returncode == 0
    shutil.copy(tmp_path / "out.h5", tmp_path / "backup.h5")
    old = write_config(tmp_path, dict(CONFIG, outputs={"R": {"file": "backup.h5", "dataset": "R"}}), "old.yaml")
    assert run_cli("verify", old).returncode == 0
    tensors = dict(CONFIG["tensors"], A={"indices": ["i", "k"], "source": {"random": 9}})
    assert run_cli("run", write_config(tmp_path, dict(CONFIG, tensors=tensors)), "--quiet").returncode == 0
    assert_refused(run_cli("verify", old), "backup.h5", "out.h5.parts", "a later run filled with its own")
    assert run_cli("verify", config).returncode == 0
