"""The device timeline of one ``chainexec run``: how long the GPU computed, where it waited, and
which host calls it waited for.

``torch.profiler`` (CUPTI) records every kernel, copy and CUDA API call of the process, CuPy's,
cuBLAS's and the generated kernels alike; no ``nsys`` is needed (the GPU machine has none).
The run is ``chainexec.api.run`` in this process: the first one in a fresh process (a user's
run, first-use costs included), or with ``--warm`` a second one after a run that loaded every
kernel and grew the memory pools.

Usage (on a GPU machine with torch): ``python3 benchmarks/device_timeline.py CONFIG MACHINE
TRACE.json [--warm]``. It prints the executor's seconds, the device's span and busy seconds
(the union of its kernels, copies and memsets), its time per kernel name, the CUDA API calls
that took longest on the host, and the device's longest idle gaps with the host calls that
overlap them. ``TRACE.json`` is the Chrome trace (chrome://tracing, Perfetto).
"""

import argparse
import collections
import json

DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_API = ("cuda_runtime", "cuda_driver")


def gaps(spans: list[tuple[float, float, str]], least: float) -> list[tuple[float, float, str]]:
    """The device's idle intervals longer than ``least`` between ``(start, end, name)`` spans:
    ``(idle from, idle to, the name of the span that ends it)``."""
    found, last = [], None
    for s, e, name in sorted(spans):
        if last is not None and s - last > least:
            found.append((last, s, name))
        last = e if last is None else max(last, e)
    return found


def busy(spans: list[tuple[float, float, str]]) -> float:
    """Length of the union of ``(start, end, name)`` intervals: their span less the idle gaps."""
    return max(e for _, e, _ in spans) - min(s for s, _, _ in spans) - sum(b - a for a, b, _ in gaps(spans, 0.0))


def summarize(events: list[dict], top: int = 15) -> str:
    """A Chrome trace's events (microseconds) as text: the device's span and busy seconds, its
    seconds per kernel name, the longest host API calls by total, and its longest idle gaps with
    the host calls of more than 0.2 ms that overlap them."""
    device = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") in DEVICE]
    host = [e for e in events if e.get("cat") in HOST_API]
    if not device:
        return "no device events"
    first, end = min(s for s, _, _ in device), max(e for _, e, _ in device)
    lines = [f"device span {(end - first) / 1e6:.4f} s, busy {busy(device) / 1e6:.4f} s"]
    per = collections.defaultdict(lambda: [0, 0.0])
    for s, e, name in device:
        per[name[:60]][0] += 1
        per[name[:60]][1] += (e - s) / 1e6
    lines += [f"{t:9.4f} s {n:6d}  {name}" for name, (n, t) in sorted(per.items(), key=lambda x: -x[1][1])[:top]]
    calls = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for e in host:
        c = calls[e["name"]]
        c[0] += 1
        c[1] += e.get("dur", 0) / 1e3
        c[2] = max(c[2], e.get("dur", 0) / 1e3)
    lines.append("host API calls: total ms, calls, longest ms")
    lines += [f"{t:9.2f} ms {n:6d} {m:8.2f} ms  {name}" for name, (n, t, m) in sorted(calls.items(), key=lambda x: -x[1][1])[:top]]
    idle = gaps(device, 500.0)
    lines.append(f"idle gaps over 0.5 ms: {len(idle)}, {sum(b - a for a, b, _ in idle) / 1e3:.1f} ms in all")
    for a, b, name in sorted(idle, key=lambda g: g[0] - g[1])[:top]:
        during = [(e["name"], round(e["dur"] / 1e3, 2)) for e in host
                  if e["ts"] < b and e["ts"] + e.get("dur", 0) > a and e.get("dur", 0) > 200]
        lines.append(f"at {(a - first) / 1e3:8.2f} ms idle {(b - a) / 1e3:6.2f} ms before {name[:40]}; host: {during[:4]}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("machine")
    parser.add_argument("trace", help="Chrome trace file to write")
    parser.add_argument("--warm", action="store_true", help="profile a second run in this process")
    args = parser.parse_args(argv)

    from torch.profiler import ProfilerActivity, profile

    from chainexec import api

    if args.warm:
        api.run(args.config, backend="cupy", machine=args.machine)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        record = api.run(args.config, backend="cupy", machine=args.machine)
    prof.export_chrome_trace(args.trace)
    print(f"executor {record['measured']['total_seconds']:.4f} s; phases {record['run']['phases']}")
    with open(args.trace) as f:
        print(summarize(json.load(f)["traceEvents"]))


if __name__ == "__main__":
    main()
