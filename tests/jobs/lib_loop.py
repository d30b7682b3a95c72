"""A process with NVIDIA's libcudart and libnccl mapped (from their wheels),
calling cudaMalloc in a loop (it fails at once without a GPU; the uprobes
fire all the same): a target to trace, stop, and kill.

    python lib_loop.py [--calls N] [--sleep S]

Prints ``ready`` once both libraries are mapped, ``done`` after N calls
(default: forever). Imports nothing from probing. ``installed_libraries`` is
the tests' and benchmarks' look-up of those libraries.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import sys
import time


def installed_libraries() -> list[str]:
    """The NVIDIA wheels' and torch's libraries on ``sys.path``, mapped or not
    (the tracer attaches to what is mapped; this finds what to map)."""
    found = []
    for entry in sys.path:
        for pattern in (
            "nvidia/nccl/lib/libnccl.so*",
            "nvidia/cuda_runtime/lib/libcudart.so*",  # CUDA 12 wheels
            "nvidia/cu[0-9]*/lib/libcudart.so*",  # CUDA 13 wheels: nvidia/cu13/lib
            "torch/lib/libtorch_cpu.so",
        ):
            found.extend(glob.glob(os.path.join(entry, pattern)))
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=-1)
    ap.add_argument("--sleep", type=float, default=0.001)
    args = ap.parse_args()
    libs = {os.path.basename(p).split(".so")[0]: p for p in installed_libraries()}
    cudart = ctypes.CDLL(libs["libcudart"])
    ctypes.CDLL(libs["libnccl"])
    print("ready", flush=True)
    p = ctypes.c_void_p()
    i = 0
    while args.calls < 0 or i < args.calls:
        cudart.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(1000 + i))
        i += 1
        time.sleep(args.sleep)
    print("done", flush=True)


if __name__ == "__main__":
    main()
