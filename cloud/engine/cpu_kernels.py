"""Paged attention on CPU that reads the KV cache in place: a small C kernel, compiled for this host on first use.

The torch path (``attention._group_attention``) gathers every sequence's blocks into a padded copy and runs SDPA
over it: on CPU the copy and the padding were half of a batch-64 decode step's attention. This kernel walks each
sequence's block table itself, one task per (sequence, KV head) on torch's OpenMP pool, and attends the query rows
that share that KV head (GQA) over exactly the sequence's context: no copy, no padding, no mask.

It is plain C (no torch headers, so it builds in well under a second with the system's C compiler), loaded with
ctypes, and cached by a hash of its source, the compiler and the CPU's flags (``-march=native``). Without a C
compiler, or with ``TIERLINE_CPU_KERNELS=0``, the engine keeps the torch path; ``attention`` tests check the two
agree.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline int64_t token_at(const int64_t *table, int64_t t, int64_t block_size) {
    return table[t / block_size] * block_size + t % block_size;
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
    return s;
}

/* q, out: [num_seqs * q_len, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
   block_tables: [num_seqs, max_blocks]; context_lens: [num_seqs], each sequence's context with its q_len new
   tokens last. Query i of a sequence attends keys 0 .. context - q_len + i. Returns 0, or -1 when out of memory. */
int tl_paged_attention(const float *q, const float *k_cache, const float *v_cache, float *out,
                       const int64_t *block_tables, const int64_t *context_lens, int64_t num_seqs, int64_t q_len,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                       int64_t max_blocks, float scale, int num_threads) {
    const int64_t group = num_heads / num_kv_heads, rows = q_len * group;
    const int64_t token_stride = num_kv_heads * head_dim;
    int failed = 0;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t task = 0; task < num_seqs * num_kv_heads; ++task) {
        const int64_t b = task / num_kv_heads, kvh = task % num_kv_heads, ctx = context_lens[b];
        const int64_t *table = block_tables + b * max_blocks;
        float *p = malloc(sizeof(float) * (size_t)(rows * ctx));
        if (p == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        const float *qrow[rows];
        float *orow[rows];
        int64_t last[rows];
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = r / group, h = kvh * group + r % group, at = ((b * q_len + i) * num_heads + h) * head_dim;
            qrow[r] = q + at;
            orow[r] = out + at;
            last[r] = ctx - q_len + i;
        }
        for (int64_t t = 0; t < ctx; ++t) {
            const float *k = k_cache + token_at(table, t, block_size) * token_stride + kvh * head_dim;
            for (int64_t r = 0; r < rows; ++r) p[r * ctx + t] = t <= last[r] ? dot(qrow[r], k, head_dim) * scale : 0.f;
        }
        for (int64_t r = 0; r < rows; ++r) {
            float *pr = p + r * ctx, m = -INFINITY, sum = 0.f;
            const int64_t n = last[r] + 1;
            for (int64_t t = 0; t < n; ++t) m = pr[t] > m ? pr[t] : m;
            for (int64_t t = 0; t < n; ++t) {
                pr[t] = expf(pr[t] - m);
                sum += pr[t];
            }
            const float inv = 1.f / sum;
            for (int64_t t = 0; t < n; ++t) pr[t] *= inv;
            memset(orow[r], 0, sizeof(float) * (size_t)head_dim);
        }
        for (int64_t t = 0; t < ctx; ++t) {
            const float *v = v_cache + token_at(table, t, block_size) * token_stride + kvh * head_dim;
            for (int64_t r = 0; r < rows; ++r) {
                if (t > last[r]) continue;
                const float w = p[r * ctx + t];
                float *o = orow[r];
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) o[d] += w * v[d];
            }
        }
        free(p);
    }
    return failed ? -1 : 0;
}
"""

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")

# (q, k_cache, v_cache, block_tables, context_lens, q_len, scale) -> attention output
PagedAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor
]

_lock = threading.Lock()
_loaded: dict[str, PagedAttention | None] = {}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("TIERLINE_KERNEL_CACHE") or Path(base) / "tierline" / "kernels")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE, compiler, version, " ".join(FLAGS), _cpu_flags()]).encode()).hexdigest()
    target = cache_dir() / f"paged_attention-{key[:16]}.so"
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = target.parent.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        # Whoever can write there can put code into this process: load nothing from such a folder.
        raise OSError(f"{target.parent} is not private to this user (owner and mode): not loading code from it")
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, lib = Path(tmp) / "paged_attention.c", Path(tmp) / "paged_attention.so"
        src.write_text(SOURCE)
        subprocess.run(
            [compiler, *FLAGS, "-o", str(lib), str(src), "-lm"], capture_output=True, text=True, check=True, timeout=120
        )
        lib.replace(target)  # atomic: a concurrent build of the same key writes the same bytes
    return target


def paged_attention_kernel() -> PagedAttention | None:
    """The compiled kernel, or None (no C compiler, a failed build, or ``TIERLINE_CPU_KERNELS=0``); built once
    per process and cached on disk across processes."""
    if os.environ.get("TIERLINE_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    with _lock:
        if "paged_attention" in _loaded:
            return _loaded["paged_attention"]
        kernel: PagedAttention | None = None
        compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if compiler is None:
            logger.info("no C compiler found: CPU paged attention gathers blocks with torch")
        else:
            try:
                kernel = _wrap(ctypes.CDLL(str(_build(compiler))).tl_paged_attention)
            except (OSError, subprocess.SubprocessError) as exc:
                detail = getattr(exc, "stderr", "") or exc
                logger.warning("CPU paged-attention kernel unavailable (%s): gathering blocks with torch", detail)
        _loaded["paged_attention"] = kernel
        return kernel


def _wrap(fn: ctypes._NamedFuncPointer) -> PagedAttention:
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int]

    def paged_attention(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        q_len: int,
        scale: float,
    ) -> torch.Tensor:
        """q: [B * q_len, H, D] float32; caches [num_blocks, block_size, KVH, D]; block_tables [B, max_blocks] and
        context_lens [B] int64, every context at least ``q_len``. Returns [B * q_len, H, D]."""
        q = q.contiguous()  # (the model hands a slice of q and k rotated together)
        num_rows, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        num_seqs, max_blocks = block_tables.shape
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        assert block_tables.is_contiguous() and context_lens.is_contiguous() and num_rows == num_seqs * q_len
        out = torch.empty_like(q)
        rc = fn(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            out.data_ptr(),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            num_seqs,
            q_len,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            max_blocks,
            scale,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("paged attention: out of memory for the attention scores")
        return out

    return paged_attention
