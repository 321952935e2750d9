#!/usr/bin/env bash
# Session 7, call 1: GPU tests not re-run since the sixth session's last changes.
export PYTHONPATH=$PWD OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
echo commit $(cat .gpurun/commit.txt)
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
timeout 540 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_checkpoint.py tests/runtime/test_device_gpu.py tests/runtime/test_pointwise_gpu.py tests/runtime/test_inline.py 2>&1 | tail -25 | tee $OUT/tests.txt
