"""Set a config's memory limits in place: python3 benchmarks/set_machine.py CONFIG GLOBAL DEVICE
(sizes as the config takes them, e.g. 16GiB 40GiB); used by the GPU benchmark scripts. The
config's leading comment and blank lines stay as they are: ``chainexec chem`` knows the configs it
wrote by their first line and replaces only those."""

import sys

import yaml

path, global_memory, device_memory = sys.argv[1:4]
with open(path, encoding="utf-8") as f:
    text = f.read()
lines = text.splitlines(keepends=True)
header = "".join(lines[:next((i for i, line in enumerate(lines) if line.strip() and not line.startswith("#")),
                             len(lines))])
cfg = yaml.safe_load(text)
cfg["machine"] = {"global_memory": global_memory, "device_memory": device_memory}
with open(path, "w", encoding="utf-8") as f:
    f.write(header + yaml.safe_dump(cfg, sort_keys=False))
