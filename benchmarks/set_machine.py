"""Set a config's memory limits in place: python3 benchmarks/set_machine.py CONFIG GLOBAL DEVICE
(sizes as the config takes them, e.g. 16GiB 40GiB); used by the GPU benchmark scripts."""

import sys

import yaml

path, global_memory, device_memory = sys.argv[1:4]
with open(path) as f:
    cfg = yaml.safe_load(f)
cfg["machine"] = {"global_memory": global_memory, "device_memory": device_memory}
with open(path, "w") as f:
    yaml.safe_dump(cfg, f, sort_keys=False)
