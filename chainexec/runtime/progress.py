"""Progress of a run, shown by rank 0 after every nest: parallel tiles done of the plan's total,
bytes per second per level so far, elapsed time and an ETA from the tile rate. A tqdm bar on a
terminal; one plain log line per nest otherwise (batch jobs, CI logs). tqdm is imported only for
a bar: its import (with the package metadata it reads) is a share of a short run's process that a
batch job need not pay."""

from __future__ import annotations

import sys
import time

from chainexec.spec import format_size


class Progress:
    def __init__(self, total_tiles: int, nests: int, stream=None):
        self.total = total_tiles
        self.nests = nests
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()
        self.bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_tiles, unit="tile", file=self.stream)

    def update(self, nest: int, tiles: int, moved: dict[str, int]) -> None:
        """After nest ``nest`` (1-based): ``tiles`` done and bytes ``moved`` per category, all ranks."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        disk = (moved["disk->global"] + moved["global->disk"]) / elapsed
        device = (moved["global->device"] + moved["device->global"]) / elapsed
        rates = f"disk {format_size(disk)}/s, global<->device {format_size(device)}/s"
        if self.bar is not None:
            self.bar.n = tiles
            self.bar.set_postfix_str(f"nest {nest}/{self.nests}, {rates}")
            self.bar.refresh()
            return
        eta = f"{elapsed * (self.total - tiles) / tiles:.1f} s" if tiles else "?"
        print(f"chainexec: nest {nest}/{self.nests}, tiles {tiles}/{self.total}, {rates}, "
              f"elapsed {elapsed:.1f} s, ETA {eta}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
