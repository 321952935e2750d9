"""Human-readable views of plans and runs: the loop nest, and predicted-vs-measured tables."""

from __future__ import annotations

from chainexec import atomicfile
from chainexec.planner.plan import CATEGORIES, LEVEL_TIMES, Loop, Plan, to_dict
from chainexec.spec import format_size

_ARROW = {"load": "disk->global", "store": "global->disk", "get": "global->device", "accumulate": "device->global"}
# The movement categories timed at each level of the machine model (``Machine.seconds``); the
# third level, ``compute``, counts flops.
LEVEL_CATEGORIES = {"disk": ("disk->global", "global->disk"), "global<->device": ("global->device", "device->global")}


def contraction_line(plan: Plan, k: int) -> str:
    c = plan.contractions[k]
    rhs = f"{c.a}[{','.join(c.a_indices)}]"
    if c.b is not None:
        rhs += f" * {c.b}[{','.join(c.b_indices)}]"
    if c.factor != 1.0:
        rhs = f"{c.factor:g} * {rhs}"
    op = "+=" if c.accumulate else "="
    order = "" if c.order == "optimal" else f"  ({c.order} order)"
    return f"#{c.id}  {c.out}[{','.join(c.out_indices)}] {op} {rhs}    ({c.flops / 1e9:.3f} GFLOP){order}"


def _overlap(loop: Loop) -> str:
    """What a double-buffered loop's second buffers overlap with its work, in words."""
    if loop.level == "global":
        return "disk reads ahead, writes behind"
    parts = [f"{len(loop.ahead)} input tiles copied ahead"] if loop.ahead else []
    if loop.back:
        parts.append(f"{len(loop.back)} result{'s' * (len(loop.back) > 1)} copied back aside")
    return ", ".join(parts)


def loop_nest(plan: Plan) -> str:
    """The plan's loop nests as indented pseudo-code, each statement tagged with its level."""
    lines = []

    def walk(body, depth):
        pad = "  " * depth
        for node in body:
            if isinstance(node, Loop):
                tiles = ", ".join(f"{i}:{t}" for i, t in node.tiles.items()) or "one tile"
                kind = "parallel for" if node.parallel else "for"
                ahead = "" if node.depth == 1 else f"  ({node.depth} buffers: {_overlap(node)})"
                resumes = f"  (resumable, {node.resume}: run --checkpoint)" if node.resume else ""
                kept = ("  (kept while only " + node.symmetric[0] + " changes: "
                        + ", ".join(f"{t}[{','.join(ix)}]" for t, ix in node.kept) + ")") if node.kept else ""
                lines.append(f"{pad}{kind} tiles [{tiles}] @{node.level}{ahead}{kept}{resumes}")
                walk(node.body, depth + 1)
            elif node.op == "compute":
                marked = ("  (run symmetrized: one term per orbit where a permutation maps the tile onto itself"
                          + ("; written at the ordered elements" if node.ordered else "") + ")"
                          if node.symmetrized else "")
                lines.append(f"{pad}compute #{node.contraction} @device{marked}")
            elif node.op == "fused":
                inlined = ", ".join(node.inlined) + (f"; reused: {', '.join(node.lets)}" if node.lets else "")
                marked = "  (ordered elements only where tiles are equal)" if node.ordered else ""
                lines.append(f"{pad}fused      {node.tensor}[{','.join(node.indices)}] @device  "
                             f"{' '.join(f'#{k}' for k in node.group)}  (inlined: {inlined}){marked}")
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
    rows.append(f"{'time (model)':<18}" + (f"{plan.ranks} ranks: " if plan.ranks > 1 else "")
                + "  ".join(f"{k} {v:.3g} s" for k, v in p["seconds"].items())
                + f"  run {p['total_seconds']:.3g} s")
    if plan.pinned:
        rows.append(f"{'page-locked':<18}global arrays" + "".join(f", {t} (mapped)" for t in plan.locked))
    return "\n".join(rows)


def _setting(name: str, value) -> str:
    """A memory limit's or rate's value with its unit."""
    if value is None or isinstance(value, bool):
        return "-" if value is None else str(value).lower()
    if name.endswith("_memory") or name.endswith("_bytes"):
        return format_size(value)
    unit = "flop/s" if name == "flop_rate" else "s" if name.endswith("_seconds") else "B/s"
    return f"{value:.3g} {unit}"


def machine(record: dict) -> str:
    """Where each memory limit and rate of a plan came from (``Plan.machine``), a line each: config,
    detected, machine file, calibration cache or the built-in defaults, and the detail."""
    rows = [f"{'limit or rate':<20}{'value':>16}  from"]
    rows += [f"{name:<20}{_setting(name, r['value']):>16}  {r['from']}: {r['detail']}" for name, r in record.items()]
    return "\n".join(rows)


def comparison(predicted: dict, measured: dict) -> str:
    """Predicted and measured side by side; rows that must agree exactly are marked when they
    differ. Columns are as wide as the largest number (a (T) run streams petabytes)."""
    counted = _exact(predicted, measured)
    w = max(16, 2 + max(len(f"{n:,d}") for _, p, m in counted for n in (p, m)))
    rows = [f"{'':<18}{'predicted':>{w}}{'measured':>{w}}"]
    rows += [f"{name:<18}{p:>{w},d}{m:>{w},d}" + ("" if p == m else "   MISMATCH") for name, p, m in counted]
    for k in predicted["seconds"]:
        rows.append(f"{k + ' s':<18}{predicted['seconds'][k]:>{w}.4f}{measured['seconds'][k]:>{w}.4f}")
    rows.append(f"{'total s':<18}{predicted['total_seconds']:>{w}.4f}{measured['total_seconds']:>{w}.4f}")
    return "\n".join(rows)


def ranks(per_rank: list[dict]) -> str:
    """Per rank: seconds from the process's start to the executor's (start s), busy and idle
    seconds, seconds in the global<->device statements (transfers both ways) and parallel
    tiles done: load balance and start-up at a glance."""
    rows = [f"{'rank':<6}{'start s':>10}{'busy s':>10}{'idle s':>10}{'g<->d s':>10}{'tiles':>8}"]
    for r in per_rank:
        start = "-" if r["start_seconds"] is None else f"{r['start_seconds']:.3f}"
        rows.append(f"{r['rank']:<6}{start:>10}{r['busy_seconds']:>10.3f}{r['idle_seconds']:>10.3f}"
                    f"{r['level_seconds']['global<->device']:>10.3f}{r['tiles']:>8d}")
    return "\n".join(rows)


def statements(seconds: dict[str, float], predicted: dict[str, float], top: int = 10) -> str:
    """Where the executor's time went: the ``top`` statements by seconds (summed over ranks;
    compute, evaluations, global<->device transfers and the disk worker's loads and stores),
    their share of all those seconds, and the seconds the plan predicts for each
    (:func:`chainexec.planner.cost.predict`'s ``by_statement``, all ranks together)."""
    total = sum(seconds.values()) or 1.0
    rows = [f"{'statement':<22}{'seconds':>12}{'share':>9}{'predicted':>12}"]
    rows += [f"{name:<22}{s:>12.4f}{_percent(s / total):>9}{predicted.get(name, 0.0):>12.4f}"
             for name, s in list(seconds.items())[:top]]
    if len(seconds) > top:
        rest = sum(list(seconds.values())[top:])
        guess = sum(predicted.get(name, 0.0) for name in list(seconds)[top:])
        rows.append(f"{f'({len(seconds) - top} more)':<22}{rest:>12.4f}{_percent(rest / total):>9}{guess:>12.4f}")
    return "\n".join(rows)


def _exact(predicted: dict, measured: dict) -> list[tuple[str, int, int]]:
    """(row name, predicted, measured) of every count the runtime must reproduce exactly: bytes
    per movement category, memory peaks, flops and bytes streamed through device memory."""
    rows = [(k, predicted["bytes"][k], measured["bytes"][k]) for k in CATEGORIES]
    rows += [("peak " + lvl, predicted["memory_peak"][lvl], measured["memory_peak"][lvl]) for lvl in ("global", "device")]
    return rows + [("flops", predicted["flops"], measured["flops"]),
                   ("streamed (device)", predicted["streamed"], measured["streamed"])]


def matches(predicted: dict, measured: dict) -> bool:
    """Whether every count of :func:`_exact` was predicted exactly."""
    return all(p == m for _, p, m in _exact(predicted, measured))


def plan_json(plan: Plan) -> dict:
    """What ``chainexec plan --json`` prints: the prediction, each binary contraction (its output,
    inputs and flops), the alternatives priced, where each limit and rate came from, and the plan
    itself (:func:`~chainexec.planner.plan.to_dict`)."""

    def ref(name, idx):
        return f"{name}[{','.join(idx)}]"

    contractions = [{"id": c.id, "output": ref(c.out, c.out_indices),
                     "inputs": [ref(n, ix) for n, ix in c.operands()],
                     "flops": c.flops} for c in plan.contractions]
    return {"predicted": plan.predicted, "contractions": contractions, "alternatives": plan.alternatives,
            "machine": plan.machine, "plan": to_dict(plan)}


def alternatives(plan: Plan) -> str:
    """The schedules the planner weighed: groups, predicted bytes per level, movement time; then
    the finished plan's (the prediction the run is measured against), which the passes after
    the choice and the page cache's share of the inputs make differ from the chosen one's."""
    rows = [f"{'alternative':<24}{'groups':<24}{'disk bytes':>14}{'global<->device':>17}{'move s':>10}  "]
    for a in plan.alternatives:
        disk, dev = level_amount(a, "disk"), level_amount(a, "global<->device")
        marks = ["<- chosen"] if a["chosen"] else ([] if a["fits"] else ["does not fit"])
        marks += ["(paper's rule)"] if a.get("prescribed") else []
        mark = " ".join(marks)
        rows.append(f"{a['name']:<24}{a['groups']:<24}{format_size(disk):>14}{format_size(dev):>17}"
                    f"{a['movement_seconds']:>10.3g}  {mark}")
    if plan.predicted:
        p = plan.predicted
        moving = p["seconds"]["disk"] + p["seconds"]["global<->device"]
        rows.append(f"{'finished plan':<24}{'':<24}{format_size(level_amount(p, 'disk')):>14}"
                    f"{format_size(level_amount(p, 'global<->device')):>17}{moving:>10.3g}  the prediction")
    for a in plan.alternatives:
        for r in (r for r in a.get("recurrence", []) if len(r["contractions"]) > 1):
            rows.append(f"memory recurrence f(1,n) (section 5) for contractions {r['contractions']}: device "
                        f"{format_size(r['device_bytes'])} (limit {format_size(r['limits']['device'])}), global "
                        f"{format_size(r['global_bytes'])} (limit {format_size(r['limits']['global'])})")
    rows.append("groups: [disk-level fused group], '|' separates device-level groups inside it; "
                "#k scheme: contraction k alone, global/device tiling scheme; the alternatives as the search "
                "weighed them, the finished plan after the chosen one's tiles are kept, fetched ahead and "
                "evaluated per orbit and its inputs' share in the page cache priced")
    return "\n".join(rows)


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend; a one-line error without the optional
    extra (asked before a command computes anything where it draws, so a missing extra costs no
    run)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from chainexec.errors import ChainexecError

        raise ChainexecError("--plot needs matplotlib: pip install 'chainexec[plot]'") from None
    return plt


def _save(fig, path: str) -> None:
    """Write ``fig`` as PNG to ``path`` through a temporary file beside it
    (:func:`~chainexec.atomicfile.replacing`): no partial file is left."""
    try:
        with atomicfile.replacing(path) as tmp:
            fig.savefig(tmp, format="png")
    except OSError as err:
        from chainexec.errors import ChainexecError

        raise ChainexecError(f"cannot write the plot ({err.strerror or err})", path) from None


def plot_alternatives(plan: Plan, path: str) -> None:
    """Bar chart of predicted seconds per level for each alternative (matplotlib, optional extra)."""
    plt = pyplot()
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
    _save(fig, path)
    plt.close(fig)


def level_amount(record: dict, level: str) -> int:
    """What a predicted or measured record does at one machine level: bytes moved, flops for ``compute``."""
    if level == "compute":
        return record["flops"]
    return sum(record["bytes"][k] for k in LEVEL_CATEGORIES[level])


def _ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is zero or missing (nothing done or no time: no meaningful rate)."""
    return a / b if a and b else None


def level_rates(predicted: dict, measured: dict) -> list[dict]:
    """Per machine level: ``predicted`` and ``measured`` amount (bytes; flops for compute), predicted
    and measured busy ``seconds``, ``achieved`` rate (measured amount / measured seconds, per second),
    ``bound`` rate (what the prediction used: predicted amount / predicted seconds) and
    ``fraction`` = achieved / bound. Rates and fraction are None where undefined."""
    rows = []
    for level in LEVEL_TIMES:
        p, m = level_amount(predicted, level), level_amount(measured, level)
        achieved = _ratio(m, measured["seconds"][level])
        bound = _ratio(p, predicted["seconds"][level])
        rows.append({"level": level, "predicted": p, "measured": m,
                     "predicted_seconds": predicted["seconds"][level], "seconds": measured["seconds"][level],
                     "achieved": achieved, "bound": bound, "fraction": _ratio(achieved, bound)})
    return rows


def _amount(level: str, n: int) -> str:
    """Bytes with binary units; flops (compute) as an exact integer."""
    return f"{n:,d}" if level == "compute" else format_size(n)


def _rate(level: str, per_second: float | None) -> str:
    """GB/s (1e9 bytes), GFLOP/s for compute; "-" where undefined."""
    if per_second is None:
        return "-"
    return f"{per_second / 1e9:.3f} {'GFLOP/s' if level == 'compute' else 'GB/s'}"


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def _memory_rows(measured: dict, memory_limit: dict[str, int]) -> list[str]:
    """Per level with a limit: the measured peak (plan buffers) and, when the backend reports it, the
    allocator high-water (scratch included) against the configured limit; rows above it are marked."""
    rows = [f"{'memory':<20}{'measured':>14}{'limit':>14}{'of limit':>10}"]
    for kind, per_level in (("peak", measured["memory_peak"]), ("high-water", measured.get("memory_high_water", {}))):
        for level, limit in memory_limit.items():
            if level in per_level:
                n = per_level[level]
                over = "   ABOVE LIMIT" if n > limit else ""
                rows.append(f"{kind + ' ' + level:<20}{format_size(n):>14}{format_size(limit):>14}"
                            f"{_percent(_ratio(n, limit)):>10}{over}")
    return rows


def run_report(predicted: dict, measured: dict, memory_limit: dict[str, int], phases: dict | None = None) -> str:
    """Achieved against the machine model, per level (disk, global<->device, compute); the wall time
    against the predicted one; memory peaks against the limits (bytes per level); where the
    seconds of the run went (``phases`` of :func:`chainexec.api.run`)."""
    # One space at least between cells: a (T) run at o=40 v=400 counts 3.9e15 flops (21 characters).
    rows = [f"{'level':<15} {'predicted':>25} {'measured':>25} {'busy s':>9} {'achieved':>20} {'bound':>20} "
            f"{'achieved/bound':>15}"]
    for r in level_rates(predicted, measured):
        lvl = r["level"]
        rows.append(f"{lvl:<15} {_amount(lvl, r['predicted']):>25} {_amount(lvl, r['measured']):>25} "
                    f"{r['seconds']:>9.3f} {_rate(lvl, r['achieved']):>20} {_rate(lvl, r['bound']):>20} "
                    f"{_percent(r['fraction']):>15}")
    rows.append("(amounts: bytes; compute: flops. achieved = all ranks' amount / busiest rank's seconds;"
                " bound = the prediction's rate)")
    wall = _ratio(measured["total_seconds"], predicted["total_seconds"])
    rows.append(f"wall s: measured {measured['total_seconds']:.3f}, predicted {predicted['total_seconds']:.3f}, "
                f"measured/predicted {'-' if wall is None else f'{wall:.2f}x'}")
    if phases:
        rows.append("run s: " + ", ".join(f"{name} {seconds:.3f}" for name, seconds in phases.items()))
    return "\n".join(rows + _memory_rows(measured, memory_limit))


def _grouped_bars(ax, levels: list[str], series: list[tuple[str, list[float]]], ylabel: str) -> None:
    """Side-by-side bars per level, one colour per (label, values) series."""
    width = 0.8 / len(series)
    for k, (label, values) in enumerate(series):
        ax.bar([i + (k - (len(series) - 1) / 2) * width for i in range(len(levels))], values, width=width, label=label)
    ax.set_xticks(range(len(levels)), levels)
    ax.set_ylabel(ylabel)
    ax.legend()


def plot_run(predicted: dict, measured: dict, path: str) -> None:
    """PNG of :func:`run_report`'s comparison: achieved vs bound rate per level (GB/s; GFLOP/s for
    compute; undefined rates drawn as 0), and predicted vs measured busy seconds per level
    (matplotlib, optional extra)."""
    plt = pyplot()
    rows = level_rates(predicted, measured)
    levels = [r["level"] for r in rows]

    def giga(key):
        return [(r[key] or 0.0) / 1e9 for r in rows]

    fig, (rates, seconds) = plt.subplots(1, 2, figsize=(11, 4))
    _grouped_bars(rates, levels, [("achieved", giga("achieved")), ("bound (machine model)", giga("bound"))],
                  "GB/s (compute: GFLOP/s)")
    _grouped_bars(seconds, levels, [("measured", [r["seconds"] for r in rows]),
                                    ("predicted", [r["predicted_seconds"] for r in rows])], "busy seconds")
    rates.set_title("rate per level")
    seconds.set_title(f"seconds per level (wall {measured['total_seconds']:.3g} s, "
                      f"predicted {predicted['total_seconds']:.3g} s)")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
