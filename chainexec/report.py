"""Human-readable views of plans and runs: the loop nest, and predicted-vs-measured tables."""

from __future__ import annotations

from chainexec.planner.cost import CATEGORY
from chainexec.planner.plan import CATEGORIES, Loop, Plan
from chainexec.spec import format_size

_ARROW = {"load": "disk->global", "store": "global->disk", "get": "global->device", "accumulate": "device->global"}


def contraction_line(plan: Plan, k: int) -> str:
    c = plan.contractions[k]
    rhs = f"{c.a}[{','.join(c.a_indices)}]"
    if c.b is not None:
        rhs += f" * {c.b}[{','.join(c.b_indices)}]"
    if c.factor != 1.0:
        rhs = f"{c.factor:g} * {rhs}"
    op = "+=" if c.accumulate else "="
    return f"#{c.id}  {c.out}[{','.join(c.out_indices)}] {op} {rhs}    ({c.flops / 1e9:.3f} GFLOP)"


def loop_nest(plan: Plan) -> str:
    """The plan's loop nests as indented pseudo-code, each statement tagged with its level."""
    lines = []

    def walk(body, depth):
        pad = "  " * depth
        for node in body:
            if isinstance(node, Loop):
                tiles = ", ".join(f"{i}:{t}" for i, t in node.tiles.items()) or "one tile"
                kind = "parallel for" if node.parallel else "for"
                lines.append(f"{pad}{kind} tiles [{tiles}] @{node.level}")
                walk(node.body, depth + 1)
            elif node.op == "compute":
                lines.append(f"{pad}compute #{node.contraction} @device")
            else:
                ref = f"{node.tensor}[{','.join(node.indices)}]"
                extra = f"  {_ARROW[node.op]}" if node.op in _ARROW else ""
                version = f"  v{node.version}" if node.version is not None else ""
                lines.append(f"{pad}{node.op:<10} {ref} @{node.level}{extra}{version}")

    for nest in plan.nests:
        lines += [contraction_line(plan, k) for k in nest.contractions]
        walk(nest.body, 1)
    return "\n".join(lines)


def summary(plan: Plan) -> str:
    """Predicted movement per level pair, memory per level, flops and time."""
    p = plan.predicted
    rows = [f"{'movement':<18}{'predicted':>16}"]
    rows += [f"{k:<18}{format_size(p['bytes'][k]):>16}" for k in CATEGORIES]
    rows.append(f"{'memory':<18}{'peak':>16}{'limit':>16}")
    rows += [f"{lvl:<18}{format_size(p['memory_peak'][lvl]):>16}{format_size(plan.memory_limit[lvl]):>16}"
             for lvl in ("global", "device")]
    rows.append(f"{'flops':<18}{p['flops'] / 1e9:>12.3f} GF")
    rows.append(f"{'time (model)':<18}" + "  ".join(f"{k} {v:.3g} s" for k, v in p["seconds"].items())
                + f"  bound {p['total_seconds']:.3g} s")
    return "\n".join(rows)


def comparison(predicted: dict, measured: dict) -> str:
    """Predicted and measured side by side; movement rows marked when they differ."""
    rows = [f"{'':<18}{'predicted':>16}{'measured':>16}"]
    for k in CATEGORIES:
        p, m = predicted["bytes"][k], measured["bytes"][k]
        rows.append(f"{k:<18}{p:>16,d}{m:>16,d}" + ("" if p == m else "   MISMATCH"))
    for lvl in ("global", "device"):
        p, m = predicted["memory_peak"][lvl], measured["memory_peak"][lvl]
        rows.append(f"{'peak ' + lvl:<18}{p:>16,d}{m:>16,d}" + ("" if p == m else "   MISMATCH"))
    rows.append(f"{'flops':<18}{predicted['flops']:>16,d}{measured['flops']:>16,d}")
    for k in predicted["seconds"]:
        rows.append(f"{k + ' s':<18}{predicted['seconds'][k]:>16.4f}{measured['seconds'][k]:>16.4f}")
    rows.append(f"{'total s':<18}{predicted['total_seconds']:>16.4f}{measured['total_seconds']:>16.4f}")
    return "\n".join(rows)


def ranks(per_rank: list[dict]) -> str:
    """Per-rank busy and idle seconds and parallel tiles done (load balance at a glance)."""
    rows = [f"{'rank':<6}{'busy s':>10}{'idle s':>10}{'tiles':>8}"]
    rows += [f"{r['rank']:<6}{r['busy_seconds']:>10.3f}{r['idle_seconds']:>10.3f}{r['tiles']:>8d}" for r in per_rank]
    return "\n".join(rows)


def matches(predicted: dict, measured: dict) -> bool:
    """Whether every movement category and memory peak was predicted exactly."""
    return all(predicted["bytes"][k] == measured["bytes"][k] for k in CATEGORY.values()) and all(
        predicted["memory_peak"][lvl] == measured["memory_peak"][lvl] for lvl in ("global", "device"))


def alternatives(plan: Plan) -> str:
    """The schedules the planner weighed: groups, predicted bytes per level, movement time."""
    rows = [f"{'alternative':<24}{'groups':<24}{'disk bytes':>14}{'global<->device':>17}{'move s':>10}  "]
    for a in plan.alternatives:
        disk = a["bytes"]["disk->global"] + a["bytes"]["global->disk"]
        dev = a["bytes"]["global->device"] + a["bytes"]["device->global"]
        marks = ["<- chosen"] if a["chosen"] else ([] if a["fits"] else ["does not fit"])
        marks += ["(paper's rule)"] if a.get("prescribed") else []
        mark = " ".join(marks)
        rows.append(f"{a['name']:<24}{a['groups']:<24}{format_size(disk):>14}{format_size(dev):>17}"
                    f"{a['movement_seconds']:>10.3g}  {mark}")
    for a in plan.alternatives:
        for r in (r for r in a.get("recurrence", []) if len(r["contractions"]) > 1):
            rows.append(f"memory recurrence f(1,n) (section 5) for contractions {r['contractions']}: device "
                        f"{format_size(r['device_bytes'])} (limit {format_size(r['limits']['device'])}), global "
                        f"{format_size(r['global_bytes'])} (limit {format_size(r['limits']['global'])})")
    rows.append("groups: [disk-level fused group], '|' separates device-level groups inside it; "
                "#k scheme: contraction k alone, global/device tiling scheme")
    return "\n".join(rows)


def plot_alternatives(plan: Plan, path: str) -> None:
    """Bar chart of predicted seconds per level for each alternative (matplotlib, optional extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from chainexec.errors import ChainexecError

        raise ChainexecError("--plot needs matplotlib: pip install 'chainexec[plot]'") from None
    shown = [a for a in plan.alternatives if a["kind"] == "schedule"]
    names = [f"{a['name']}{' *' if a['chosen'] else ''}" for a in shown]
    levels = list(shown[0]["seconds"]) if shown else []
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(names) + 1.5))
    left = [0.0] * len(names)
    for level in levels:
        widths = [a["seconds"][level] for a in shown]
        ax.barh(names, widths, left=left, label=level)
        left = [x + w for x, w in zip(left, widths)]
    ax.set_xlabel("predicted seconds (stacked per level; * = chosen)")
    ax.set_title(f"{plan.name}: alternatives weighed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
