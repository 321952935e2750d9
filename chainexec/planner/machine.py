"""Machine model: the bandwidths and flop rate that turn predicted bytes and flops into seconds.

The plan's predicted time per level is bytes / bandwidth (for compute, the sum over statements of
the larger of flops / rate and streamed bytes / device bandwidth); movement at each level is
costed separately (multi-level paper, section 4). How the levels of a nest overlap, and so the
predicted wall time, is :func:`chainexec.planner.cost.predict`'s. The defaults are conservative figures
for one node; a machine file (JSON, same field names, :meth:`Machine.parse`) replaces them.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from chainexec import userfiles
from chainexec.errors import ChainexecError



@dataclass(frozen=True)
class Machine:
    """Rates in bytes per second (bandwidths) and flops per second, per rank."""

    disk_read: float = 1.0e9
    disk_write: float = 0.5e9
    global_to_device: float = 10.0e9
    device_to_global: float = 10.0e9
    flop_rate: float = 20.0e9
    # Seconds the runtime spends per compute statement it runs, beside the flops (bookkeeping, tile
    # copies, kernel launch): what makes many small tiles slower than few large ones. `chainexec
    # calibrate` measures it.
    statement_seconds: float = 2.0e-4
    # Seconds the runtime spends per transfer statement it runs beside the bytes' time: per get or
    # accumulate (the global<->device level) and per load or store (the disk level), the tile's
    # slicing, the bookkeeping and the call into the global array or the file. What makes many
    # small tiles slow to move though their bytes are few. `chainexec calibrate` measures both on
    # the run it measures statement_seconds on; 0, the default, leaves them unpriced.
    transfer_call_seconds: float = 0.0
    disk_call_seconds: float = 0.0
    # Bytes per second a compute statement reads and writes in device memory (its operands' and
    # output's tiles): a statement costs the larger of flops / flop_rate and streamed bytes /
    # device_bandwidth (:meth:`compute_seconds`), which is what makes point-wise statements over
    # 6-D tiles and output-heavy contractions slow though their flops are few. `chainexec
    # calibrate` measures it (a tile copied into each order of its last three indices, since
    # statements read their operands permuted); None, the default, leaves compute as flops alone
    # (the papers' model).
    device_bandwidth: float | None = None
    # Bytes per second an orbit kernel (a fused full reduction with reused values,
    # :mod:`chainexec.kernels.orbits`) loads and stores through the SMs' L1 and shared memory, as
    # :func:`chainexec.kernels.orbits.point_bytes` counts them: such a statement costs at least
    # its points times those bytes over this rate (the hierarchical roofline's L1 ceiling), since
    # it reads each value at several permuted points there while its device-memory traffic is
    # each input's tile once. `chainexec calibrate` measures it on a GPU; None leaves those
    # statements at :meth:`compute_seconds`.
    orbit_bandwidth: float | None = None
    # Whether compute statements are queued on a device stream (CuPy): the
    # host's per-statement seconds then overlap the device's compute of the statements before
    # them instead of adding to it (the executor waits for the device only before transfers, so
    # within a tile; the (T) tiles are alike, so per tile and summed come to the same). False for
    # NumPy, which runs the statements one after the other on the host.
    async_statements: bool = False
    # Bytes of the smallest result tile a device loop copies back to the host on a stream of its
    # own (``Loop.back``, :func:`chainexec.planner.pipeline.deepen`); smaller ones are copied on
    # the compute stream, where a copy costs less host time than handing it to another stream
    # (an event, a stream switch and a later wait per copy, several times the copy's own host time
    # for the (T) energy's 8-byte copy per tile).
    aside_copy_bytes: int = 1 << 20
    # Bytes per second of a run's writes that the page cache takes (each rank's blocks written
    # over threads into files of their own, :mod:`chainexec.runtime.store`, nothing synced), and
    # the bytes per rank it takes at that rate (the host's dirty-page limit shared by its ranks)
    # before the kernel makes writers wait for the disk: beyond them writes go at disk_write.
    # `chainexec calibrate` measures both; None leaves every write at disk_write, the rate of
    # writes made durable.
    disk_write_cached: float | None = None
    write_cache_bytes: int = 0
    # Bytes per second a run prepares global memory at: a global buffer's MPI window made and its
    # pages touched once, by a zero fill over threads or by its first write (every global buffer
    # but an input's tile read from its file, :func:`chainexec.planner.cost.predict_nests`).
    # `chainexec calibrate` measures it; None leaves the preparation unpriced.
    global_fill: float | None = None
    # Host<->device bytes per rank from which a run uses page-locked host buffers (:attr:`Plan.pinned`):
    # its global arrays are then locked where they lie and their tiles move by DMA, without the
    # staging copy on the host. The first page-locked allocation of a process waits for the
    # device; DMA from page-locked memory runs faster than the staged copies, which repays that
    # wait from about a GB on: a four-index run moving a few GB per rank is faster pinned, one
    # moving a few hundred MB is not (the measurements: benchmarks/results/INDEX.md).
    pinned_from_bytes: int = 1 << 30
    # Bytes per second of those DMA copies between page-locked host memory and the device, each
    # way: the rate of a pinned run's transfers of global arrays. `chainexec calibrate` measures
    # them on a GPU; None prices every transfer at global_to_device / device_to_global.
    host_to_device: float | None = None
    device_to_host: float | None = None
    # Bytes per second a pinned run page-locks its global arrays at (each registered with the
    # device before its first transfer and unregistered before it is freed), and the rate at
    # which an input's rows mapped from its file, in the page cache, reach the device in such a
    # run (not locked: copied through the staging buffers). `chainexec calibrate` measures both
    # on a GPU; None leaves the locking unpriced and prices those rows at global_to_device.
    host_lock: float | None = None
    mapped_to_device: float | None = None
    # Bytes per second at which those rows reach the device by DMA where a pinned run locks the
    # mapping itself (:attr:`Plan.locked`): one copy from the page cache's own pages, not from a
    # buffer of the run's. `chainexec calibrate` measures it on a GPU; None prices them at
    # host_to_device.
    mapped_locked_to_device: float | None = None
    source: str = "defaults"

    def compute_seconds(self, flops: int, streamed: int) -> float:
        """Seconds of one compute statement (over all its iterations) that does ``flops`` and
        streams ``streamed`` bytes through device memory: the larger of the two times, the
        roofline model (Williams, Waterman and Patterson, CACM 52(4), 2009), since a kernel reads
        its operands while it multiplies them. Not their sum: that prices W's operand reads in
        (T) on top of its GEMMs' flops, and so favours larger occupied tiles that run slower."""
        if not self.device_bandwidth:
            return flops / self.flop_rate
        return max(flops / self.flop_rate, streamed / self.device_bandwidth)

    def write_seconds(self, nbytes: int, ranks: int = 1) -> float:
        """Seconds of ``nbytes`` written to disk by ``ranks`` ranks, summed over the ranks as
        :meth:`seconds` counts them: each rank's first :attr:`write_cache_bytes` bytes at
        :attr:`disk_write_cached`, the rest at :attr:`disk_write`."""
        if not self.disk_write_cached:
            return nbytes / self.disk_write
        cached = min(nbytes, self.write_cache_bytes * ranks)
        return cached / self.disk_write_cached + (nbytes - cached) / self.disk_write

    def seconds(self, moved: dict[str, int], compute: float, transfers: float, ranks: int = 1,
                priced: tuple[int, float] = (0, 0.0)) -> dict[str, float]:
        """Seconds per level for the given bytes per category (all ``ranks`` ranks' together),
        compute seconds (the sum of :meth:`compute_seconds` over the statements) and transfer
        seconds (the sum of :meth:`transfer_seconds` over the gets and accumulates, each at the
        rate of its kind of host memory), summed over the ranks. ``priced``: bytes of loads that
        are not disk reads and their seconds (a computed source's at its rate; a mapped input's
        pages the page cache holds move in none). The calls' own seconds are
        :meth:`call_seconds`'."""
        loads, seconds = priced
        return {
            "disk": (moved["disk->global"] - loads) / self.disk_read + seconds
            + self.write_seconds(moved["global->disk"], ranks),
            "global<->device": transfers,
            "compute": compute,
        }

    def call_seconds(self, calls: dict[str, int]) -> dict[str, float]:
        """Seconds per transfer level of ``calls`` (per level given: the disk's loads and
        stores, the global<->device level's gets and accumulates), at :attr:`disk_call_seconds`
        and :attr:`transfer_call_seconds` each."""
        each = {"disk": self.disk_call_seconds, "global<->device": self.transfer_call_seconds}
        return {level: n * each[level] for level, n in calls.items()}

    def busy_seconds(self, compute: float, statements: float, calls: float = 0.0) -> float:
        """Seconds the compute level keeps a run busy: the statements' ``compute`` seconds
        (:meth:`compute_seconds` summed) with the host's :attr:`statement_seconds` for each of
        ``statements`` and the ``calls`` seconds of its transfers' per-call time (the same
        thread's work), added, or overlapped where the statements are queued on a device stream
        (:attr:`async_statements`): many small tiles cost their bookkeeping even where their
        flops are few.

        Overlapped, the two are priced as the Euclidean norm ``√(compute² + host²)``, not their
        maximum: the queue between host and device drains at every wait for the device (pending
        stamps read, room made in the memory pool, a result landed), and the calibrated
        :attr:`statement_seconds` is a tiny matrix product's, below what a statement with
        several launches costs, so where the two times are alike neither hides the other. The
        norm is their maximum where one dominates and √2 times it where they are equal. Priced
        as their maximum, (T)'s small occupied tiles, whose host time nearly equals their
        compute, looked as cheap as larger ones and ran slower (measured in
        ``benchmarks/results/INDEX.md``)."""
        host = statements * self.statement_seconds + calls
        return math.hypot(compute, host) if self.async_statements else compute + host

    def transfer_seconds(self, op: str, nbytes: int, locked: bool = False, mapped: bool = False) -> float:
        """Seconds of ``nbytes`` moved to the device (``get``) or back (``accumulate``): by DMA
        from page-locked host memory where ``locked`` (at :attr:`host_to_device` /
        :attr:`device_to_host` where measured; rows of a mapped input, ``mapped`` too, at
        :attr:`mapped_locked_to_device` where measured); rows of a pinned run's input mapped from
        its file where ``mapped`` alone (at :attr:`mapped_to_device` where measured); else
        through a staging copy on the host (at :attr:`global_to_device` / :attr:`device_to_global`)."""
        if op == "get":
            dma = (self.mapped_locked_to_device if mapped else None) or self.host_to_device
            rate = (dma if locked else self.mapped_to_device if mapped else None) or self.global_to_device
            return nbytes / rate
        return nbytes / (self.device_to_host if locked and self.device_to_host else self.device_to_global)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def parse(cls, text: str, path: str) -> tuple["Machine", frozenset[str]]:
        """The machine of a machine file's ``text`` (read from ``path`` by
        :func:`chainexec.machinecache.read`) and the fields it gives (the others are defaults):
        a JSON object whose keys are this class's fields. The rates of :data:`RATES` are required; the other fields keep their
        defaults where absent, and ``details`` (what ``chainexec calibrate`` measured) is
        ignored. Any other key, and any value :data:`FIELDS` refuses, is a
        :class:`ChainexecError` naming the file and the field, as is text that is not JSON."""
        data = userfiles.loads(text, "machine file", path)
        if not isinstance(data, dict):
            raise ChainexecError(f"a machine file holds a JSON object of fields, not {_json_type(data)}", str(path))
        for key, value in data.items():
            if key == "details":
                continue
            if key not in FIELDS:
                raise ChainexecError(f"unknown field {key!r} (known: {', '.join(FIELDS)}, details)", str(path))
            valid, what = FIELDS[key]
            if not valid(value):
                raise ChainexecError(f"field {key!r} must be {what}, not {json.dumps(value)}", str(path))
        missing = [name for name in RATES if name not in data]
        if missing:
            raise ChainexecError(f"missing field{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))}", str(path))
        data.pop("details", None)
        data.update({key: int(value) for key, value in data.items() if FIELDS[key][0] is _bytes})
        return cls(**{"source": str(path), **data}), frozenset(data)


#: The fields a machine file must give: the rates the model divides bytes and flops by.
RATES = ("disk_read", "disk_write", "global_to_device", "device_to_global", "flop_rate")


def _number(value) -> bool:
    """A JSON number other than NaN and the infinities (which Python's JSON reads as floats)."""
    return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and math.isfinite(value)


RATE_RANGE = (1.0, 1e18)
"""Rates a machine file may give (bytes or flops per second): one a second to an exa- a second,
past any machine's, so that no predicted time over- or underflows to infinity or NaN."""

SECONDS_MAX = 1e4
"""Seconds a machine file may give per statement or call."""

BYTES_MAX = 2**63 - 1
"""Bytes a machine file may give (as every byte count of a config)."""


def _rate(value) -> bool:
    return _number(value) and RATE_RANGE[0] <= value <= RATE_RANGE[1]


def _bytes(value) -> bool:
    """A whole number of bytes in range, written as an integer or as a float with no fraction
    (``1e9``, which JSON writers and hand-edited files give for a round size)."""
    return _number(value) and 0 <= value <= BYTES_MAX and float(value).is_integer()


_PER_SECOND = f"a number of bytes per second from {RATE_RANGE[0]:g} to {RATE_RANGE[1]:g}"
_WHOLE = "a whole number of bytes, 0 or more and at most 2^63 - 1"
_OR_NULL = (lambda v: v is None or _rate(v), f"{_PER_SECOND}, or null")

#: Each field of :class:`Machine`: whether a machine file's value is valid, and what a valid one is.
FIELDS = {
    **{name: (_rate, _PER_SECOND) for name in RATES if name != "flop_rate"},
    "flop_rate": (_rate, f"a number of flops per second from {RATE_RANGE[0]:g} to {RATE_RANGE[1]:g}"),
    **{name: (lambda v: _number(v) and 0 <= v <= SECONDS_MAX,
              f"a number of seconds, 0 or more and at most {SECONDS_MAX:g}")
       for name in ("statement_seconds", "transfer_call_seconds", "disk_call_seconds")},
    "device_bandwidth": _OR_NULL,
    "orbit_bandwidth": _OR_NULL,
    "async_statements": (lambda v: isinstance(v, bool), "true or false"),
    "aside_copy_bytes": (_bytes, _WHOLE),
    "disk_write_cached": _OR_NULL,
    "write_cache_bytes": (_bytes, _WHOLE),
    "global_fill": _OR_NULL,
    "pinned_from_bytes": (_bytes, _WHOLE),
    "host_to_device": _OR_NULL,
    "device_to_host": _OR_NULL,
    "host_lock": _OR_NULL,
    "mapped_to_device": _OR_NULL,
    "mapped_locked_to_device": _OR_NULL,
    "source": (lambda v: isinstance(v, str), "a string"),
}


def _json_type(value) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")
