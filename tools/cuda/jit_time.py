#!/usr/bin/env python3
"""Times loading candle's kernel modules on the GPU: each PTX module as candle loads it (the
driver compiles it at run time; run with CUDA_CACHE_DISABLE=1 for the cold cost), and the same
module assembled ahead of time for sm_90a by ptxas (a cubin: the driver only loads it).
Usage: jit_time.py DIR  (DIR holds NAME.ptx and NAME.cubin pairs). Needs only libcuda."""
import ctypes, glob, os, sys, time

cuda = ctypes.CDLL("libcuda.so.1")


def check(rc, what):
    if rc != 0:
        sys.exit(f"{what} failed: CUresult {rc}")


check(cuda.cuInit(0), "cuInit")
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
rows, tot = [], [0.0, 0.0]
for ptx in sorted(glob.glob(os.path.join(sys.argv[1], "*.ptx"))):
    name = os.path.basename(ptx)[:-4]
    times = []
    for path in (ptx, ptx[:-4] + ".cubin"):
        data = open(path, "rb").read() + (b"\0" if path.endswith(".ptx") else b"")
        mod = ctypes.c_void_p()
        t0 = time.perf_counter()
        check(cuda.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(data)), f"cuModuleLoadData({path})")
        times.append((time.perf_counter() - t0) * 1e3)
        cuda.cuModuleUnload(mod)
    tot[0] += times[0]
    tot[1] += times[1]
    print(f"{name:<10} ptx {os.path.getsize(ptx) / 1e6:6.2f} MB: load {times[0]:8.1f} ms; cubin: load {times[1]:6.1f} ms", flush=True)
print(f"total: ptx {tot[0]:.0f} ms, cubin {tot[1]:.0f} ms (CUDA_CACHE_DISABLE={os.environ.get('CUDA_CACHE_DISABLE', '')})")
