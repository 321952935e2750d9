"""Hostile configs: each is refused at once by `chainexec plan` with one line naming the file, the
line and the problem, exit status 2, no traceback.

Each case edits the four-index config's text; the line the error must name is found in the edited
text (the last line holding a marker), independently of the parser."""

from __future__ import annotations

import pytest

from tests.conftest import assert_refused, fourindex_config, run_cli, write_config


def _bomb(mappings: bool) -> str:
    """The "billion laughs" on one line: nine levels, each a list (or mapping) of nine aliases of
    the one before, 9⁹ scalars in all."""
    def collection(items):
        return "{" + ", ".join(f"k{k}: {x}" for k, x in enumerate(items)) + "}" if mappings else f"[{', '.join(items)}]"

    levels = [f"a0: &a0 {collection(['x'] * 9)}"]
    levels += [f"a{k}: &a{k} {collection([f'*a{k - 1}'] * 9)}" for k in range(1, 9)]
    return "bomb: {" + ", ".join(levels) + "}\n"


def _replace(old, new):
    def edit(text):
        assert old in text, old
        return text.replace(old, new, 1)
    return edit


def _prepend(new):
    return lambda text: new + text


def _extra_tensor(source: str):
    """A computed tensor with the given expression, declared before the statements."""
    return _replace("statements:", f"  E:\n    indices: [p]\n    source:\n      expr: '{source}'\nstatements:")


def _chain(*edits):
    def edit(text):
        for one in edits:
            text = one(text)
        return text
    return edit

# case: (edit of the config text, marker of the line named (None: no line), problem)
CASES = {
    # 1. Aliases that stand for more nodes than a config may hold, or for an infinite structure.
    "alias_bomb": (_prepend(_bomb(mappings=False)), "bomb:", "more than 10000 YAML nodes"),
    "alias_bomb_of_mappings": (_prepend(_bomb(mappings=True)), "bomb:", "more than 10000 YAML nodes"),
    "recursive_alias": (_prepend("loop: &loop [x, *loop]\n"), "loop:", "alias *loop lies inside what it refers to"),
    "deep_nesting": (_prepend("deep: " + "[" * 5000 + "]" * 5000 + "\n"), "deep:", "nested deeper than 32 levels"),
    # 2. A key given twice, in any mapping: the line of the second.
    "duplicate_section": (lambda text: text + "machine: {global_memory: 1GiB, device_memory: 1GiB}\n",
                          "machine:", "key 'machine' repeats (first on line"),
    "duplicate_tensor": (_replace("statements:", "  C:\n    indices: [p, a]\nstatements:"), "  C:",
                         "key 'C' repeats (first on line"),
    "duplicate_source_key": (_replace("      seed: 11\n", "      seed: 11\n      seed: 99\n"), "seed: 99",
                             "key 'seed' repeats"),
    "duplicate_index": (_replace("  p: 10\n", "  p: 10\n  p: 12\n"), "p: 12", "key 'p' repeats"),
    # a seeded input whose layout stores values its symmetry equates: generate made them differ
    "seeded_layout_narrower_than_symmetry": (
        _replace("  A:\n", "  A:\n    symmetry: {pairs: [[p, q], [r, s]], exchange: true}\n    layout: s4\n"),
        "layout: s4", "tensor 'A': seeded values stored as s4 would lack the symmetry it declares beyond s4"),
    # a seed the generator does not tell apart from a smaller one (it made seed 11's values)
    "seed_beyond_the_generator": (_replace("      seed: 11\n", f"      seed: {11 + (1 << 24)}\n"), "seed: 16777227",
                                  "must be below 16777216 (2**24): the generator makes seed 11's values"),
    "duplicate_output_key": (_replace("    dataset: B\n", "    dataset: B\n    file: other.h5\n"), "other.h5",
                             "key 'file' repeats"),
    # 3. Not UTF-8.
    "latin1_comment": (lambda text: _replace("statements:", "# café\nstatements:")(text).encode("latin-1"),
                       b"# caf", "not UTF-8 text (byte 0xe9"),
    "utf16": (lambda text: text.encode("utf-16"), b"\xff\xfe", "not UTF-8 text (byte 0xff at offset 0)"),
    "escape_beyond_unicode": (_prepend('x: "\\U10010000"\n'), "x:", "malformed YAML: a scalar's escape names no character"),
    # 4. A dtype that is no name.
    **{f"dtype_{kind}_{place}": (edit(value), "dtype:", f"{prefix}dtype {shown} is not supported")
       for kind, value, shown in [("list", "[float64]", "['float64']"), ("mapping", "{float64: 1}", "{'float64': 1}")]
       for place, edit, prefix in [
           ("top", lambda v: _prepend(f"dtype: {v}\n"), ""),
           ("tensor", lambda v: _replace("  C:\n", f"  C:\n    dtype: {v}\n"), "tensor 'C': "),
       ]},
    # 5. Sizes that are not a finite whole number of bytes an int64 holds.
    **{f"size_{name}": (_replace("device_memory: 3KiB", f"device_memory: {value}"), "device_memory:", problem)
       for name, value, problem in [
           ("inf", ".inf", "size must be a finite number of bytes"),
           ("minus_inf", "-.inf", "size must be a finite number of bytes"),
           ("nan", ".nan", "size must be a finite number of bytes"),
           ("1e400", "1e400", "size must be a finite number of bytes"),
           ("float_1e400", "1.0e+400", "size must be a finite number of bytes"),
           ("2_63", str(2**63), "size must be a finite number of bytes"),
           ("1e30_TiB", "1e30 TiB", "size must be a finite number of bytes"),
           ("inf_GiB", "inf GiB", "expected a size such as 8GiB"),
           ("list", "[1, 2]", "expected a size such as 8GiB"),
       ]},
    # 6. Expressions nested deeper than the parser goes.
    **{f"expr_{name}": (_extra_tensor(source), "expr:", problem) for name, source, problem in [
        ("parentheses", "(" * 5000 + "C[p,p]" + ")" * 5000, "at most 256"),
        ("minus_signs", "-" * 5000 + "C[p,p]", "at most 256"),
        ("long_sum", " + ".join(["C[p,p]"] * 5000), "at most 256"),
        ("attributes", "C" + ".x" * 5000, "at most 256"),
        ("not_chain", "not " * 5000 + "C[p,p]", "not 'not'"),
        ("if_chain", "C[p,p] if C[p,p] else " * 3000 + "C[p,p]", "not 'if'"),
        ("huge_integer", "1" + "0" * 400 + " * C[p,p]", "is not a finite float64"),
    ]},
    # 7. Factors that are not finite in the statement's dtype.
    **{f"factor_{name}": (edit, "- B[a,b,c,d] =", problem) for name, edit, problem in [
        ("literal", _replace(" = C[p,a]", " = 1e999 * C[p,a]"), "its factor inf is not a finite float64"),
        ("product", _replace(" = C[p,a]", " = 1e200 * C[p,a] * 1e200"), "its factor inf is not a finite float64"),
        ("negative_product", _replace(" = C[p,a]", " = -1e300 * C[p,a] * 1e300"),
         "its factor -inf is not a finite float64"),
        ("float32", lambda text: "dtype: float32\n" + text.replace(" = C[p,a]", " = 1e39 * C[p,a]"),
         "its factor 1e+39 is not a finite float32"),
        ("float32_underflow", lambda text: "dtype: float32\n" + text.replace(" = C[p,a]", " = 1e-50 * C[p,a]"),
         "its factor 1e-50 is below the smallest float32"),
        ("nan", _replace(" = C[p,a]", " = nan * C[p,a]"), "cannot read the factor 'nan'"),
        ("inf", _replace(" = C[p,a]", " = inf * C[p,a]"), "cannot read the factor 'inf'"),
    ]},
    # 8. Outputs that overwrite each other; dataset names that are empty or mean something else to HDF5.
    "two_outputs_one_dataset": (
        _chain(_replace("outputs:", "- E[a,b,c,d] = B[a,b,c,d]\noutputs:"),
               _replace("machine:", "  E:\n    file: ./out/../out/result.h5\n    dataset: B\nmachine:")),
        "  E:", "output 'E' goes to the dataset ./out/../out/result.h5:B, as output 'B' does"),
    **{f"output_dataset_{name}": (_replace("    dataset: B", f"    dataset: {value}"), "    dataset:",
                                  f"output 'B': dataset {shown} is not a plain HDF5 dataset name")
       for name, value, shown in [("empty", "''", "''"), ("leading_slash", "/B", "'/B'"),
                                  ("trailing_slash", "B/", "'B/'"), ("group", "g/B", "'g/B'"), ("dot", ".", "'.'"),
                                  ("dotdot", "..", "'..'"), ("tab", '"B\\t"', "'B\\t'")]},
    **{f"source_dataset_{name}": (_replace("      dataset: A", f"      dataset: {value}"), f"dataset: {value}",
                                  f"source of 'A': dataset {shown} is not a plain HDF5 dataset name")
       for name, value, shown in [("empty", "''", "''"), ("leading_slash", "/A", "'/A'"),
                                  ("trailing_slash", "g/A/", "'g/A/'"), ("empty_group", "g//A", "'g//A'"),
                                  ("dot_group", "g/./A", "'g/./A'"), ("dot", ".", "'.'")]},
    "output_file_empty": (_replace("    file: out/result.h5", "    file: ''"), "  B:", "needs 'file' and 'dataset'"),
    **{f"output_file_folder_{name}": (_replace("    file: out/result.h5", f"    file: {value}"), f"file: {value}",
                                      f"output 'B': file '{value}' names a folder")
       for name, value in [("slash", "out/"), ("dot", "."), ("dotdot", "out/..")]},
    # Extents and tensors beyond a signed 64-bit count (NumPy's and HDF5's; the planner's floats overflowed).
    "extent_2_63": (_replace("  p: 10\n", f"  p: {2**63}\n"), "  p:", "index 'p' must have a positive integer extent"),
    "extent_1e400": (_replace("  p: 10\n", f"  p: {10**400}\n"), "  p:", "(at most 2^63 - 1)"),
    "range_2_63": (_prepend(f"ranges: {{big: {2**63}}}\n"), "ranges:",
                   "range 'big' must have a positive integer extent"),
    # 2^16 along each of four indices: 2^64 elements.
    "tensor_elements": (_replace("  p: 10\n  q: 10\n  r: 10\n  s: 10\n", "".join(f"  {i}: 65536\n" for i in "pqrs")),
                        "indices:\n    - p\n    - q", "tensor 'A' would hold more than 2^63 - 1 elements"),
    "inferred_tensor_elements": (_replace("  a: 8\n  b: 8\n  c: 8\n  d: 8\n", "".join(f"  {i}: 65536\n" for i in "abcd")),
                                 "- B[a,b,c,d] =", "tensor 'B' would hold more than 2^63 - 1 elements"),
    # 9. Names longer than 64 characters (they reach file names and CUDA source), or ending in a newline.
    "long_tensor_name": (_chain(_replace("B[a,b,c,d] =", "B" * 65 + "[a,b,c,d] ="), _replace("  B:", "  " + "B" * 65 + ":")),
                         "- BBB", "tensor name 'BBBB"),
    "long_index_name": (_replace("  p: 10\n", "  p: 10\n  " + "i" * 65 + ": 3\n"), "iii", "has 65 characters"),
    "long_config_name": (_replace("name: fourindex", "name: " + "n" * 65), "name:",
                         "has 65 characters; names have at most 64"),
    "name_with_newline": (_replace("name: fourindex", 'name: "fourindex\\n"'), "name:",
                          "'fourindex\\n' is not a plain identifier"),
}


def _line_of(text: str | bytes, marker: str | bytes) -> int:
    """The 1-based line of the last occurrence of ``marker`` (bytes in bytes)."""
    return text[:text.rindex(marker)].count(b"\n" if isinstance(text, bytes) else "\n") + 1


LAUNCHED = ["alias_bomb", "duplicate_section", "utf16", "dtype_list_top", "size_inf", "expr_parentheses",
            "two_outputs_one_dataset", "factor_literal", "long_tensor_name"]
"""Cases also run on two ranks: the launcher's status is 2 (never the resume status 3)."""


@pytest.mark.parametrize("case, command, ranks", [(c, "plan", None) for c in sorted(CASES)]
                         + [(c, "run", 2) for c in LAUNCHED])
def test_hostile_config_is_refused_in_one_line(case, command, ranks, tmp_path):
    edit, marker, problem = CASES[case]
    config = write_config(tmp_path, fourindex_config())
    edited = edit(config.read_text())
    if isinstance(edited, bytes):
        config.write_bytes(edited)
    else:
        config.write_text(edited)
    line = _line_of(edited, marker)
    proc = run_cli(command, config, timeout=60, ranks=ranks)
    assert_refused(proc, f"{config}:{line}: ", problem)
