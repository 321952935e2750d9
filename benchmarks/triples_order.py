"""Write a copy of a (T) config with its six-index tensors (W, V, Z, R, Dinv) in another index
order, to time orders against each other on one machine:

    python3 benchmarks/triples_order.py CONFIG OUT ORDER      (ORDER: a permutation of ijkabc)

Every reference to those tensors in the statements is permuted alike, so the copy computes the
same energy; only the order of a tile's buffers (and so the GEMM shapes of W's terms) changes.
The order CONFIG has is read from Dinv's declared indices."""

import re
import sys

import yaml

SIX = ("W", "V", "Z", "R", "Dinv")


def refuse(problem: str) -> None:
    print(f"triples_order: {problem}", file=sys.stderr)
    sys.exit(2)


source_path, out_path, order = sys.argv[1:4]
if sorted(order) != sorted("ijkabc"):
    refuse(f"{order!r} is not a permutation of ijkabc")
with open(source_path) as f:
    cfg = yaml.safe_load(f)
source = "".join(cfg["tensors"]["Dinv"]["indices"])
if sorted(source) != sorted("ijkabc"):
    refuse(f"{source_path}: Dinv's indices {source!r} are not a permutation of ijkabc")
positions = [source.index(i) for i in order]
reference = re.compile(r"\b(" + "|".join(SIX) + r")\[([a-z](?:,[a-z]){5})\]")
named = re.compile(r"\b(" + "|".join(SIX) + r")\s*\[")
if any(len(named.findall(s)) != len(reference.findall(s)) for s in cfg["statements"]):
    refuse(f"{source_path}: a reference to {', '.join(SIX)} is not of the form X[i,a,j,b,k,c] "
           "(six one-letter indices, no spaces)")


def permuted(match: re.Match) -> str:
    names = match.group(2).split(",")
    return f"{match.group(1)}[{','.join(names[p] for p in positions)}]"


cfg["tensors"]["Dinv"]["indices"] = list(order)
cfg["statements"] = [reference.sub(permuted, statement) for statement in cfg["statements"]]
with open(out_path, "w") as f:
    yaml.safe_dump(cfg, f, sort_keys=False)
