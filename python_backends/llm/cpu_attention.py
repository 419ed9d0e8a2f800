"""Decode attention on CPU straight from the paged KV cache: a small native kernel.

The engine's torch decode attention (`model.paged_attention`) gathers each group's cache
blocks into a padded copy and multiplies against it: every key and value is read from the
cache, written into the copy and read again, and every sequence is padded to its group's
longest context. Decode attention is memory-bound, so that is most of its time. This kernel
(`csrc/paged_decode.cpp`, AVX-512, bfloat16) reads each sequence's keys and values once,
where they are, with no padding: one call per layer for every decoding sequence of a step.

It is compiled on first use with the machine's C++ compiler (`-march=native`) into a cache
directory, keyed by the source, the flags, the compiler's version and the CPU, and loaded with
`ctypes`. It shares torch's OpenMP runtime (torch has loaded `libgomp.so.1` first), so its
parallel loop runs on the calling thread's pool with `torch.get_num_threads()` threads.
Where there is no compiler, no AVX-512 or no kernel for the model's head shape, `load()`
returns None and the engine keeps its torch attention (`load_error` says why).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
# -ffast-math compiles only: linked into a shared library it brings crtfastmath.o, which
# flushes subnormal floats to zero for the whole process when the library loads (numpy and
# the property tests then fail). So the object is compiled with it and linked without.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp")
# (query heads per key/value head, head dim) the kernel is compiled for (its CASE lines)
SHAPES = frozenset({(1, 64), (2, 64), (3, 64), (4, 64), (1, 128), (2, 128), (4, 128), (8, 128)})
CACHE_ENV = "KIT_KERNEL_CACHE"  # where compiled kernels go; default ~/.cache/serving-kit/kernels
DISABLE_ENV = "KIT_NO_KERNELS"  # set to 1: never build or load the kernel (the torch path only)

_P, _I = ctypes.c_void_p, ctypes.c_int64


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "serving-kit" / "kernels"


def cpu_flags() -> str:
    """This CPU's model and instruction-set flags, as Linux lists them ("" elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    found = {}
    for line in lines:
        key, _, value = line.partition(":")
        found.setdefault(key.strip(), value.strip())
    return f"{found.get('model name', '')}\n{found.get('flags', '')}"


def cpu_has_avx512() -> bool:
    flags = set(cpu_flags().split())
    return {"avx512f", "avx512bw", "avx512vl"} <= flags


class DecodeKernel:
    """The loaded kernel: `__call__` attends decoding sequences of one layer."""

    def __init__(self, path: Path):
        self.path = path
        self._fn = ctypes.CDLL(str(path)).decode_attention_bf16
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [_P, _P, _P, _I, _P, _I, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _I]

    @staticmethod
    def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        return num_heads % num_kv_heads == 0 and (num_heads // num_kv_heads, head_dim) in SHAPES

    def __call__(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                 lengths: torch.Tensor, block_size: int, scale: float, sliding_window: int | None) -> torch.Tensor:
        """query [sequences, heads, head_dim] bfloat16; keys, values: one layer's cache
        [kv_heads, slots, head_dim]; tables [sequences, blocks] int64 (a row's blocks past its
        length are not read); lengths [sequences] int64: each attends to positions
        0 .. length - 1 (the last `sliding_window` of them when set). Returns [sequences,
        heads, head_dim] bfloat16."""
        query = query.contiguous()
        num_seqs, num_heads, head_dim = query.shape
        for name, tensor in (("keys", keys), ("values", values), ("tables", tables), ("lengths", lengths)):
            if not tensor.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        if query.dtype != torch.bfloat16 or keys.dtype != torch.bfloat16 or values.dtype != torch.bfloat16:
            raise ValueError("the kernel attends in bfloat16")
        if tables.dtype != torch.int64 or lengths.dtype != torch.int64:
            raise ValueError("tables and lengths are int64")
        out = torch.empty_like(query)
        status = self._fn(query.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.stride(0), tables.data_ptr(),
                          tables.shape[1], lengths.data_ptr(), out.data_ptr(), num_seqs, num_heads, keys.shape[0],
                          head_dim, block_size, scale, sliding_window or 0)
        if status != 0:
            raise ValueError(f"no kernel for {num_heads} heads over {keys.shape[0]} of width {head_dim}")
        return out


def build(compiler: str | None = None) -> Path:
    """The compiled kernel's path, compiling it first when the cache has none for this source,
    these flags, this compiler and this CPU. Raises RuntimeError with the compiler's message."""
    compiler = compiler or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    # -march=native: a cache shared by machines of other CPUs must not hand them this one's build
    parts = [SOURCE.read_text(), *COMPILE_FLAGS, *LINK_FLAGS, version, cpu_flags()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    target = cache_dir() / f"paged_decode-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:  # then renamed: readers see whole files
        built, objects = Path(scratch) / target.name, Path(scratch) / "paged_decode.o"
        for command in ([compiler, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(objects)],
                        [compiler, *LINK_FLAGS, str(objects), "-o", str(built), "-lm"]):
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


load_error: str | None = None  # why the last `load()` returned None
_loaded: DecodeKernel | None = None


def load() -> DecodeKernel | None:
    """The kernel, built if needed; None (and `load_error`) where it cannot run here."""
    global _loaded, load_error
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        load_error = f"{DISABLE_ENV} is set"
        return None
    if _loaded is not None:
        return _loaded
    if not cpu_has_avx512():
        load_error = "this CPU has no AVX-512"
        return None
    try:
        _loaded = DecodeKernel(build())
    except (OSError, RuntimeError) as err:
        load_error = str(err)
        return None
    load_error = None
    return _loaded
