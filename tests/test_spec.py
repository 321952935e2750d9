"""Spec parsing: statements, sizes, index classes, inferred intermediates, errors with lines."""

from __future__ import annotations

import pytest

from chainexec import spec
from chainexec.errors import ChainexecError

BASE = """\
name: t
ranges: {occ: 3, vir: 5}
indices: {i: occ, j: occ, a: vir, b: vir, k: 4}
tensors:
  X: {indices: [i, a], source: {random: 1}}
  Y: {indices: [a, j], source: {file: y.h5, dataset: Y, seed: 2}}
statements:
  - T[i,j] = 0.5 * X[i,a] * Y[a,j]
  - T[i,j] -= X[i,b] * Y[b,j]
outputs:
  T: {file: out.h5, dataset: T}
machine: {global_memory: 1MiB, device_memory: 64 KiB}
"""


def test_parses_a_complete_config():
    s = spec.loads(BASE, "t.yaml")
    assert s.extents == {"i": 3, "j": 3, "a": 5, "b": 5, "k": 4}
    assert s.tensors["T"].indices == ("i", "j") and s.tensors["T"].source is None
    assert s.statements[0].factor == 0.5 and not s.statements[0].accumulate
    assert s.statements[1].factor == -1.0 and s.statements[1].accumulate
    assert s.machine.global_memory == 2**20 and s.machine.device_memory == 64 * 2**10
    assert s.tensors["Y"].source.seed == 2
    assert s.statements[0].line == 8


@pytest.mark.parametrize("text, factor, operands", [
    ("C[i,j] = A[i,k] * B[k,j]", 1.0, 2),
    ("C[i,j] += -2 * A[i,k] * 0.25 * B[k,j]", -0.5, 2),
    ("C[] = A[i,k] * B[i,k]", 1.0, 2),
    ("C[j,i] = A[i,j]", 1.0, 1),
    ("C[i,j] = A[i,k] * B[k,j] * - 2", -2.0, 2),
])
def test_statement_forms(text, factor, operands):
    st = spec.parse_statement(text)
    assert st.factor == factor and len(st.operands) == operands


@pytest.mark.parametrize("factors, needle", [
    ("1e-400", "below the smallest float64"), ("1e-200 * 1e-200", "below the smallest float64"),
    ("\u0663", "cannot read the factor '\u0663'"),  # an Arabic-Indic 3 was read as 3
])
def test_a_factor_that_would_be_zero_or_is_no_ascii_number_is_refused(factors, needle):
    """Factors whose product underflows to 0 (the result was all zeros, exit 0) and digits of
    other scripts are refused; a factor written as zero stays allowed."""
    with pytest.raises(ValueError, match=needle):
        spec.parse_statement(f"X[i] = A[i,j] * B[j] * {factors}")
    assert spec.parse_statement("X[i] = 0.0 * A[i,j] * B[j] * 1e-300").factor == 0


@pytest.mark.parametrize("factor", ["1/3", "1_000", "0x10", "two"])
def test_a_factor_that_is_no_decimal_number_is_named(factor):
    """A fraction or another spelling of a number is named as a factor that is no decimal
    number (it was "cannot read ... as a tensor reference", which sent users looking for a
    tensor), with how to write it."""
    with pytest.raises(ValueError, match=f"cannot read the factor '{factor}'.*decimal numbers such as 0.5"):
        spec.parse_statement(f"X[i] = A[i,j] * B[j] * {factor}")


@pytest.mark.parametrize("value, expected", [("8GiB", 8 * 2**30), ("1.5 MiB", 3 * 2**19), ("1e6", 10**6),
                                             (4096, 4096), ("2GB", 2 * 10**9), (2**63 - 1, 2**63 - 1),
                                             ("8388607 TiB", (2**23 - 1) * 2**40), (1.9, 1),
                                             (str(2**63 - 1), 2**63 - 1), (str(2**53 + 1), 2**53 + 1),
                                             ("1e-3GiB", 2**30 // 1000), ("1e+3", 1000)])
def test_sizes(value, expected):
    """Sizes as written, exact to the byte where given as text (2^63 - 1 was refused as
    9.223372036854776e+18 and 2^53 + 1 read as 2^53), signed exponents included."""
    assert spec.parse_size(value, "x") == expected


@pytest.mark.parametrize("value", ["-1", "eight", 0, True, "3 parsecs", 0.5, float("inf"), float("-inf"), float("nan"),
                                   "1e400", "inf GiB", "nan", 2**63, 10**400, "8 EiB", "8388608 TiB", [1], None,
                                   str(2**63), "0.9999999999999999999", "1e999999999", "1e-999999999"])
def test_bad_sizes(value):
    with pytest.raises(ValueError):
        spec.parse_size(value, "x")


def test_aliases_within_the_bound_and_merge_keys_load():
    """A merged mapping's keys may be overridden (YAML's merge, not a repeat); aliases that stand
    for few nodes are plain YAML."""
    text = BASE.replace("Y: {indices: [a, j], source: {file: y.h5, dataset: Y, seed: 2}}",
                        "Y: {indices: &aj [a, j], source: &y {file: y.h5, dataset: Y, seed: 2}}\n"
                        "  Z: {indices: *aj, source: {<<: *y, dataset: grp/Z}}")
    s = spec.loads(text, "t.yaml")
    assert s.tensors["Z"].indices == ("a", "j")
    assert s.tensors["Z"].source == spec.Source(file="y.h5", dataset="grp/Z", seed=2)


@pytest.mark.parametrize("keys, repeated", [("{i: 3, j: 3, i: 4}", "i"), ("{1: 3, 0x1: 4}", "0x1"),
                                           ("{a: 1, 'a': 2}", "a")])
def test_keys_repeat_as_the_values_they_stand_for(keys, repeated):
    with pytest.raises(ChainexecError) as err:
        spec.loads(BASE.replace("indices: {i: occ, j: occ, a: vir, b: vir, k: 4}", f"indices: {keys}"), "t.yaml")
    assert str(err.value).startswith("t.yaml:3: ") and f"key {repeated!r} repeats (first on line 3)" in str(err.value)


def test_names_of_the_longest_length_load():
    """Names of 64 characters (the documented limit) are accepted; 65 are refused (test_spec_hostile)."""
    t, x, i = "T" * 64, "X" * 64, "i" * 64
    text = f"""\
name: {"c" * 64}
indices: {{{i}: 3}}
tensors:
  {x}: {{indices: [{i}], source: {{random: 1}}}}
statements:
  - {t}[{i}] = {x}[{i}]
outputs:
  {t}: {{file: out.h5, dataset: {t}}}
machine: {{global_memory: 1MiB, device_memory: 64KiB}}
"""
    s = spec.loads(text, "t.yaml")
    assert s.name == "c" * 64 and set(s.tensors) == {t, x} and set(s.extents) == {i}


@pytest.mark.parametrize("edit, message, line", [
    (("T[i,j] -= X[i,b]", "T[i,j] -= X[i,c]"), "unknown index 'c'", 9),
    (("  - T[i,j] = 0.5", "  - T[i,j] += 0.5"), "before any '=' assigns it", 8),
    (("X: {indices: [i, a]", "X: {indices: [i, k]"), "index 'a' has extent 5 but X's dimension 'k' has 4", 8),
    (("outputs:\n  T:", "outputs:\n  Q:"), "output 'Q' is not assigned", 11),
    (("device_memory: 64 KiB", "device_memory: lots"), "expected a size", 12),
    (("name: t", "name: 1t"), "not a plain identifier", 1),
    (("  - T[i,j] -= X[i,b] * Y[b,j]\n", "  - T[i,j] -= X[i,b] * Z[b,j]\n"), "unknown tensor 'Z'", 9),
    # A second '=' or a term reading its own target: refused (each used to give wrong numbers or crash).
    (("T[i,j] -= X[i,b]", "T[i,j] = X[i,b]"), "assigns 'T' a second time", 9),
    (("T[i,j] -= X[i,b] * Y[b,j]", "T[i,j] += T[j,i]"), "reads 'T', the tensor it assigns", 9),
    # A result nothing reads (computed, then thrown away): an intermediate, a term added after the
    # last read of its tensor, an output's name misspelt where a statement reads it.
    (("  - T[i,j] -= X[i,b] * Y[b,j]\n", "  - T[i,j] -= X[i,b] * Y[b,j]\n  - U[i,j] = X[i,a] * X[j,a]\n"),
     "'U[i,j] = X[i,a] * X[j,a]' computes 'U', which no output names and no later statement reads", 10),
    (("  - T[i,j] -= X[i,b] * Y[b,j]\n", "  - S[i,j] = X[i,b] * Y[b,j]\n  - T[i,j] -= S[j,i]\n"
      "  - S[i,j] += X[i,a] * Y[a,j]\n"), "'S[i,j] += X[i,a] * Y[a,j]' computes 'S', which no output names", 11),
    (("  - T[i,j] -= X[i,b] * Y[b,j]\n", "  - S[i,j] = X[i,b] * Y[b,j]\n  - T[i,j] += S[i,j]\n"
      "  - T2[i,j] = S[j,i]\n"), "'T2[i,j] = S[j,i]' computes 'T2'", 11),
])
def test_errors_name_file_and_line(edit, message, line):
    with pytest.raises(ChainexecError) as err:
        spec.loads(BASE.replace(*edit), "t.yaml")
    assert message in str(err.value)
    assert str(err.value).startswith(f"t.yaml:{line}:")


@pytest.mark.parametrize("file, accepted", [("my-config.yaml", False), ("1.yaml", False), ("for.yaml", False),
                                            ("my_config.yaml", True)])
def test_a_config_without_a_name_takes_its_file_names_where_that_is_an_identifier(file, accepted):
    """No ``name:``: the file's name stands for it; one that is no identifier is refused naming
    the file alone (no line of the config gave it) and asking for a ``name:``."""
    text = BASE.replace("name: t\n", "")
    assert "name:" not in text
    if accepted:
        assert spec.loads(text, file).name == "my_config"
        return
    with pytest.raises(ChainexecError) as err:
        spec.loads(text, file)
    assert str(err.value).startswith(f"{file}: the config has no `name:`, and its file name")
    assert str(err.value).endswith("add one")


@pytest.mark.parametrize("value, message", [
    ("[i, j]", "symmetric index 'i' is one of its own indices"),
    ("[a]", "symmetric must list two or more index names"),
    ("a", "symmetric must list two or more index names"),
    ("[a, a]", "symmetric lists an index twice"),
    ("[a, z]", "symmetric index 'z' is not declared"),
    ("[a, k]", "symmetric index 'k' does not occur in the statements"),
])
def test_symmetric_output_errors(value, message):
    text = BASE.replace("T: {file: out.h5, dataset: T}", f"T: {{file: out.h5, dataset: T, symmetric: {value}}}")
    with pytest.raises(ChainexecError) as err:
        spec.loads(text, "t.yaml")
    assert message in str(err.value)
    assert str(err.value).startswith("t.yaml:11:")


def test_symmetric_output_accepted():
    text = BASE.replace("T: {file: out.h5, dataset: T}", "T: {file: out.h5, dataset: T, symmetric: [b, a]}")
    (out,) = spec.loads(text, "t.yaml").outputs
    assert out.symmetric == ("b", "a")


AO2MO = """\
name: ao2mo
ranges: {ao: 7, mo: 5}
indices: {p: ao, q: ao, r: ao, s: ao, a: mo, b: mo, c: mo, d: mo}
tensors:
  A: {indices: [p, q, r, s], symmetry: {pairs: [[p, q], [r, s]], exchange: true}, layout: packed,
      source: {file: in.h5, dataset: eri}}
  C: {indices: [p, a], source: {file: in.h5, dataset: C}}
  D: {indices: [p, a], source: {file: in.h5, dataset: D}}
  B: {indices: [a, b, c, d], symmetry: {pairs: [[a, b], [c, d]], exchange: true}, layout: packed}
statements:
  - B[a,b,c,d] = C[p,a] * C[q,b] * C[r,c] * C[s,d] * A[p,q,r,s]
outputs:
  B: {file: out.h5, dataset: B}
"""


def test_symmetry_declarations_load():
    s = spec.loads(AO2MO, "ao2mo.yaml")
    assert s.tensors["A"].symmetry.kind(4) == "s8" and s.tensors["A"].layout == "s8"
    assert s.tensors["C"].symmetry is None and s.tensors["C"].layout == "dense"


@pytest.mark.parametrize("edits, message, line", [
    ([("C[q,b] * C[r,c]", "C[q,c] * C[r,b]")], "exchanging a<->b in the result does not give the same sum", 11),
    ([("C[s,d] * A", "D[s,d] * A")], "exchanging c<->d in the result does not give the same sum", 11),
    ([("exchange: true}, layout: packed,", "exchange: true}, layout: zip,")], "layout is dense, packed or one of", 5),
    ([("exchange: true}, layout: packed", "exchange: false}, layout: s8")], "layout s8 packs what its symmetry", 5),
    ([("  C: {indices: [p, a], source", "  C: {indices: [p, a], layout: packed, source")],
     "needs a symmetry to pack", 7),
    ([("mo: 5}", "mo: 5, mo2: 6}"), ("d: mo}", "d: mo2}")], "pair [c, d] has extents 5 and 6", 9),
    ([("pairs: [[p, q], [r, s]], exchange: true}, layout: packed", "pairs: [[p, r]]}, layout: packed")],
     "not two adjacent indices", 5),
])
def test_symmetry_errors(edits, message, line):
    text = AO2MO
    for old, new in edits:
        text = text.replace(old, new)
    with pytest.raises(ChainexecError) as err:
        spec.loads(text, "ao2mo.yaml")
    assert str(err.value).startswith(f"ao2mo.yaml:{line}: ") and message in str(err.value), str(err.value)


@pytest.mark.parametrize("tensor, message", [
    ("G: {indices: [p], source: {expr: 'C[p,p]'}}", "G': C[p,p] in its expression repeats an index"),
    ("G: {indices: [p, q, r, s], source: {expr: '2 * A[p,q,r,s]'}}",
     "G': A in its expression is stored packed (layout s8); an expression reads dense inputs"),
])
def test_an_expression_reads_each_index_once_from_dense_inputs(tensor, message):
    """An expression that takes a diagonal or reads a packed input: refused at its line (``plan``
    passed both, and the run crashed reading them: an axes mismatch, a 4-D box of a packed
    dataset)."""
    text = AO2MO.replace("  B: {indices", f"  {tensor}\n  B: {{indices").replace("{ao: 7, mo: 5}", "{ao: 5, mo: 5}")
    with pytest.raises(ChainexecError) as err:
        spec.loads(text, "ao2mo.yaml")
    assert str(err.value).startswith("ao2mo.yaml:9: ") and message in str(err.value), str(err.value)


@pytest.mark.parametrize("value", ["0", "-1.0e+9", "fast", "true", ".nan"])
def test_computed_source_rate_is_a_positive_number(value):
    """``bytes_per_second`` of a computed source: one line naming the tensor and the key."""
    from tests.planner.test_cost import COMPUTED

    with pytest.raises(ChainexecError) as err:
        spec.loads(COMPUTED % f", bytes_per_second: {value}", "/tmp/computed.yaml")
    assert "\n" not in str(err.value) and "bytes_per_second must be a positive number" in str(err.value)
    assert "'A'" in str(err.value)


def test_computed_source_rate_is_kept_apart_from_its_parameters():
    from tests.planner.test_cost import COMPUTED

    s = spec.loads(COMPUTED % ", bytes_per_second: 3200000000.0", "/tmp/computed.yaml")
    source = s.tensors["A"].source
    assert source.bytes_per_second == 3.2e9 and "bytes_per_second" not in dict(source.parameters)


@pytest.mark.parametrize("word", ["no", "on", "off", "yes", "NO", "On"])
def test_yaml_1_1_booleans_are_names(word):
    """YAML 1.1 reads ``no``, ``on``, ``off`` and ``yes`` as booleans, so a range named ``no``
    (occupied orbitals) was refused as "range name False"; the config is read with YAML 1.2's
    booleans, and they are names."""
    s = spec.loads(BASE.replace("ranges: {occ: 3", f"ranges: {{{word}: 3").replace("i: occ, j: occ",
                                                                                 f"i: {word}, j: {word}"), "c.yaml")
    assert s.extents == {"i": 3, "j": 3, "a": 5, "b": 5, "k": 4}


def test_a_flag_written_yes_is_refused_as_not_true_or_false():
    text = BASE.replace("T: {file: out.h5, dataset: T}", "T: {file: out.h5, dataset: T, allow_nonfinite: yes}")
    with pytest.raises(ChainexecError, match="allow_nonfinite is true or false, not 'yes'"):
        spec.loads(text, "c.yaml")
    assert spec.loads(text.replace(": yes}", ": True}"), "c.yaml").outputs[0].allow_nonfinite

