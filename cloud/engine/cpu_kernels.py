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
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Protocol

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
   tokens last. Query i of a sequence attends keys 0 .. context - q_len + i, only its last `window` of them when
   window > 0; scores are soft-capped to softcap * tanh(s / softcap) when softcap > 0. Returns 0, or -1 when out of
   memory. */
int tl_paged_attention(const float *q, const float *k_cache, const float *v_cache, float *out,
                       const int64_t *block_tables, const int64_t *context_lens, int64_t num_seqs, int64_t q_len,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                       int64_t max_blocks, float scale, int num_threads, int64_t window, float softcap) {
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
        int64_t first[rows], last[rows], start = ctx;
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = r / group, h = kvh * group + r % group, at = ((b * q_len + i) * num_heads + h) * head_dim;
            qrow[r] = q + at;
            orow[r] = out + at;
            last[r] = ctx - q_len + i;
            first[r] = window > 0 && last[r] - window + 1 > 0 ? last[r] - window + 1 : 0;
            start = first[r] < start ? first[r] : start;
        }
        for (int64_t t = start; t < ctx; ++t) {
            const float *k = k_cache + token_at(table, t, block_size) * token_stride + kvh * head_dim;
            for (int64_t r = 0; r < rows; ++r) {
                float s = t <= last[r] && t >= first[r] ? dot(qrow[r], k, head_dim) * scale : 0.f;
                if (softcap > 0.f) s = softcap * tanhf(s / softcap);
                p[r * ctx + t] = s;
            }
        }
        for (int64_t r = 0; r < rows; ++r) {
            float *pr = p + r * ctx, m = -INFINITY, sum = 0.f;
            const int64_t n = last[r] + 1;
            for (int64_t t = first[r]; t < n; ++t) m = pr[t] > m ? pr[t] : m;
            for (int64_t t = first[r]; t < n; ++t) {
                pr[t] = expf(pr[t] - m);
                sum += pr[t];
            }
            const float inv = 1.f / sum;
            for (int64_t t = first[r]; t < n; ++t) pr[t] *= inv;
            memset(orow[r], 0, sizeof(float) * (size_t)head_dim);
        }
        for (int64_t t = start; t < ctx; ++t) {
            const float *v = v_cache + token_at(table, t, block_size) * token_stride + kvh * head_dim;
            for (int64_t r = 0; r < rows; ++r) {
                if (t > last[r] || t < first[r]) continue;
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

DECODE_SOURCE = r"""
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#ifndef TILE_PREFETCH
#define TILE_PREFETCH 16
#endif
/* How the tiles prefetch the weights (``__builtin_prefetch``'s locality): 0, non-temporal, was best on AMD EPYCs;
   on Intel Xeons (the build passes 3 there: ``_host_defines``) it made tiles of three rows or more 3-4x slower
   (2-core Xeon with AVX-512 and AMX, demo LM, 5 rows: 3.65 ms against 1.11 into every cache level). */
#ifndef TILE_PREFETCH_LOCALITY
#define TILE_PREFETCH_LOCALITY 0
#endif

/* VL floats (int8 weights widened to floats): GCC's vector extension at the host's register width, and the column
   vectors of a tile for R rows, COLS_R (R x COLS_R sums and COLS_R weights in registers: 32 registers with AVX-512
   or NEON, 16 with AVX2). */
#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__)
#define VL 8
#else
#define VL 4
#endif
#if defined(__AVX__) && !defined(__AVX512F__)
#define COLS_1 4
#define COLS_2 4
#define COLS_3 3
#define COLS_4 2
#define COLS_5 2
#define COLS_6 2
#define COLS_7 1
#define COLS_8 1
#else
#define COLS_1 8
#define COLS_2 8
#define COLS_3 6
#define COLS_4 4
#define COLS_5 4
#define COLS_6 4
#define COLS_7 3
#define COLS_8 3
#endif
typedef float vf __attribute__((vector_size(4 * VL)));
static inline vf load_f32(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline vf load_i8(const int8_t *p) {
    vf v;
#if VL == 16 && defined(__AVX512F__)
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    memcpy(&v, &f, sizeof v);
#elif VL == 8 && defined(__AVX2__)
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    memcpy(&v, &f, sizeof v);
#else /* (GCC widens a vector of int8 one value at a time: a loop it vectorizes instead) */
    float f[VL];
    for (int t = 0; t < VL; ++t) f[t] = (float)p[t];
    memcpy(&v, f, sizeof v);
#endif
    return v;
}
static inline void store_f32(float *p, vf v) { memcpy(p, &v, sizeof v); }
/* a + b c in every lane with one rounding (FMA) where the host has it, in every tile alike: contraction left to the
   compiler (-ffp-contract=fast) was not applied alike to every tile's specialization (GCC left the one-row,
   one-vector tile of AVX2 builds unfused, and a row's logits then depended on the rows verified with it). */
static inline vf fma_vf(vf a, float b, vf c) {
#if VL == 16 && defined(__AVX512F__)
    __m512 r, x;
    memcpy(&r, &a, sizeof r);
    memcpy(&x, &c, sizeof x);
    r = _mm512_fmadd_ps(_mm512_set1_ps(b), x, r);
    memcpy(&a, &r, sizeof a);
    return a;
#elif VL == 8 && defined(__FMA__)
    __m256 r, x;
    memcpy(&r, &a, sizeof r);
    memcpy(&x, &c, sizeof x);
    r = _mm256_fmadd_ps(_mm256_set1_ps(b), x, r);
    memcpy(&a, &r, sizeof a);
    return a;
#elif defined(__FP_FAST_FMAF)
    float r[VL], x[VL];
    memcpy(r, &a, sizeof r);
    memcpy(x, &c, sizeof x);
    for (int t = 0; t < VL; ++t) r[t] = __builtin_fmaf(b, x[t], r[t]);
    memcpy(&a, r, sizeof a);
    return a;
#else
    return a + b * c;
#endif
}
/* the scalar columns' a + b c: an FMA where the vector tiles use one */
static inline float fma_f(float a, float b, float c) {
#if defined(__FP_FAST_FMAF)
    return __builtin_fmaf(b, c, a);
#else
    return a + b * c;
#endif
}

/* y[r, j .. j + VL C) += x[r, :] @ w[:, j .. j + VL C) for r < R (R and C constants where inlined): the R x C vector
   sums stay in registers over every input i, added in input order (y[r, j] + x[r, 0] w[0, j] + x[r, 1] w[1, j] + ...,
   the same sum for any R), and each weight vector is loaded once for all R rows. The tile's vector c is vector
   v0 + c of its weights w: in sub-panel (v0 + c) / sv, sub_stride values apart, at (v0 + c) % sv vectors in; its
   rows are w_stride values apart (n_out, a panel's width, or a sub-panel's: see ``matmul``). The weights are
   prefetched TILE_PREFETCH rows ahead for three rows or more. */
#define TILE(NAME, W, LOAD, VALUES_PER_LINE)                                                                       \
    static inline __attribute__((always_inline)) void NAME(const int R, const int C, const float *restrict x,     \
                                                           int64_t n_in, const W *restrict w, int64_t v0,          \
                                                           int64_t sv, int64_t sub_stride, int64_t w_stride,       \
                                                           int64_t n_out, float *restrict y) {                     \
        vf acc[8][8];                                                                                               \
        const W *restrict wc[8];                                                                                    \
        for (int c = 0; c < C; ++c) wc[c] = w + ((v0 + c) / sv) * sub_stride + ((v0 + c) % sv) * VL;              \
        /* a prefetch a cache line of a row, and one a sub-panel */                                                 \
        const int pf_step = VALUES_PER_LINE / VL < sv ? VALUES_PER_LINE / VL : (int)sv;                             \
        for (int r = 0; r < R; ++r)                                                                                 \
            for (int c = 0; c < C; ++c) acc[r][c] = load_f32(y + r * n_out + VL * c);                               \
        for (int64_t i = 0; i < n_in; ++i) {                                                                        \
            const int64_t o = i * w_stride;                                                                         \
            if (R >= 3 && i + TILE_PREFETCH < n_in) /* (one or two rows: faster without) */                      \
                for (int c = 0; c < C; c += pf_step)                                                                \
                    __builtin_prefetch(wc[c] + o + TILE_PREFETCH * w_stride, 0, TILE_PREFETCH_LOCALITY);            \
            vf v[8];                                                                                                \
            for (int c = 0; c < C; ++c) v[c] = LOAD(wc[c] + o);                                                     \
            for (int r = 0; r < R; ++r) {                                                                           \
                const float xr = x[r * n_in + i];                                                                   \
                for (int c = 0; c < C; ++c) acc[r][c] = fma_vf(acc[r][c], xr, v[c]);                                \
            }                                                                                                       \
        }                                                                                                           \
        for (int r = 0; r < R; ++r)                                                                                 \
            for (int c = 0; c < C; ++c) store_f32(y + r * n_out + VL * c, acc[r][c]);                               \
    }
TILE(tile_f32, float, load_f32, 16)
TILE(tile_i8, int8_t, load_i8, 64)

/* Rows b .. b + R of x and y (R = min(8, rows - b)) over columns [j0, j1): tiles of COLS_R vectors, then a vector at a
   time, then single columns (in the same order of sums). */
#define TILES_OF(TILE_FN, R, WIDTH)                                                                                 \
    case R:                                                                                                         \
        for (; j + WIDTH * VL <= j1; j += WIDTH * VL)                                                               \
            TILE_FN(R, WIDTH, xb, n_in, split ? w : w + (j - jw), split ? (j - j0) / VL : 0, sv, sub_stride,         \
                    w_stride, n_out, yb + j);                                                                       \
        break;
#define TILES(TILE_FN, W, WEIGHTS)                                                                                  \
    for (int64_t b = 0; b < rows; b += 8) {                                                                         \
        const W *restrict w = WEIGHTS;                                                                              \
        const int R = rows - b < 8 ? (int)(rows - b) : 8;                                                           \
        const float *xb = x + b * n_in;                                                                             \
        float *yb = y + b * n_out;                                                                                  \
        int64_t j = j0;                                                                                             \
        switch (R) {                                                                                                \
            TILES_OF(TILE_FN, 1, COLS_1)                                                                            \
            TILES_OF(TILE_FN, 2, COLS_2)                                                                            \
            TILES_OF(TILE_FN, 3, COLS_3)                                                                            \
            TILES_OF(TILE_FN, 4, COLS_4)                                                                            \
            TILES_OF(TILE_FN, 5, COLS_5)                                                                            \
            TILES_OF(TILE_FN, 6, COLS_6)                                                                            \
            TILES_OF(TILE_FN, 7, COLS_7)                                                                            \
            TILES_OF(TILE_FN, 8, COLS_8)                                                                            \
        }                                                                                                           \
        switch (R) {                                                                                                \
            TILES_OF(TILE_FN, 1, 1)                                                                                 \
            TILES_OF(TILE_FN, 2, 1)                                                                                 \
            TILES_OF(TILE_FN, 3, 1)                                                                                 \
            TILES_OF(TILE_FN, 4, 1)                                                                                 \
            TILES_OF(TILE_FN, 5, 1)                                                                                 \
            TILES_OF(TILE_FN, 6, 1)                                                                                 \
            TILES_OF(TILE_FN, 7, 1)                                                                                 \
            TILES_OF(TILE_FN, 8, 1)                                                                                 \
        }                                                                                                           \
        for (; j < j1; ++j)                                                                                         \
            for (int r = 0; r < R; ++r) {                                                                           \
                float acc = yb[r * n_out + j];                                                                      \
                for (int64_t i = 0; i < n_in; ++i)                                                                  \
                    acc = fma_f(acc, xb[r * n_in + i], (float)w[i * w_stride + j - jw]);                            \
                yb[r * n_out + j] = acc;                                                                            \
            }                                                                                                       \
    }

/* One widest tile's columns: a chunk of the columns a thread takes, and the width of a packed matrix's panels. */
#define PANEL (VL * COLS_1)
int tl_panel_width(void) { return PANEL; }
/* The columns of a packed panel's sub-panels (see ``matmul``): where a panel's rows are wider than a cache line, a full
   panel is in sub-panels of one line a row (16 fp32 columns, 64 int8 ones), which every tile reads start to end, where
   a tile narrower than the panel read some of each row's lines (AVX2 fp32 panels: 4 lines a row, 2-vector tiles for 4
   to 6 rows; AVX-512: 8 lines fp32, 2 int8). The demo cloud LM's matrices, 2 threads, alternating runs: 2-core EPYC
   with AVX2 (fp32; p10 of 300 calls) one row 0.617 -> 0.544 ms, 5 rows 1.196 -> 1.034, 9 rows 2.214 -> 1.877; 2-core
   Xeon with AVX-512 (a forward in the engine, p10 of 3x200 calls) fp32 one row 0.85 -> 0.82, 5 rows 1.19 -> 1.12, 7
   rows 1.42 -> 1.29, 9 rows 1.70 -> 1.56; int8 one row 0.485 -> 0.450, 5 rows 0.94 -> 0.86. 128-bit builds
   (SSE, NEON) are unmeasured and keep whole panels. */
#define LINE_BYTES 64
#if VL >= 8
#define SUBW_F32 (LINE_BYTES / 4)
#define SUBW_I8 (PANEL > LINE_BYTES ? LINE_BYTES : PANEL)
#else
#define SUBW_F32 PANEL
#define SUBW_I8 PANEL
#endif
int tl_sub_panel_width(int int8) { return int8 ? SUBW_I8 : SUBW_F32; }

/* y[b, :] = (bias or 0) + x[b, :] @ wt for b < rows; wt: [n_in, n_out] row-major (the engine's transposed weights),
   fp32, or int8 with per-column scales (``scale``: y = bias + (x @ wq) * scale, the weight-only int8 layout). Up to
   eight rows of x share each weight read (a verification's k + 1 rows cost little more memory traffic than one
   row), and each output's sum is in input order whatever the rows: a token's logits are the same decoded alone or
   verified among others. With num_threads > 1 the columns go to the threads in chunks of one widest tile (PANEL
   columns: 128 with AVX-512), taken in turn: a 256-column projection (o and down of a model 256 wide) is two chunks,
   not one thread's work. A ``packed`` matrix (every int8 one, and fp32 ones where ``FusedDecoder`` keeps a packed
   copy) is laid out in panels of PANEL columns, one after another, each [n_in, its width] row-major: a chunk's
   weights are one run of memory, read start to end, where the rows of the [n_in, n_out] layout are n_out apart (a
   stride the hardware prefetchers follow poorly across pages). A full panel may be in sub-panels instead
   (``tl_sub_panel_width``): [n_in, subw] each, one after another; the last, narrower panel of a matrix stays whole.
   The demo cloud LM's decode step (2-core EPYC with AVX-512, 150 tokens of context, 3 alternating processes of 400
   calls): int8 p10 0.309-0.317 ms -> 0.283-0.290 packed, fp32 median 0.98-1.26 -> 0.67-0.76. */
static void matmul(const float *restrict x, int64_t rows, int64_t n_in, const void *restrict weight,
                   const float *restrict scale, const float *restrict bias, int64_t n_out, float *restrict y,
                   int packed, int num_threads) {
    const float *restrict wf = scale == NULL ? (const float *)weight : NULL;
    const int8_t *restrict wq = scale != NULL ? (const int8_t *)weight : NULL;
    const int64_t chunk = num_threads > 1 || packed ? PANEL : n_out, num_chunks = (n_out + chunk - 1) / chunk;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && num_chunks > 1) schedule(dynamic, 1)
    for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t j0 = c * chunk, j1 = j0 + chunk < n_out ? j0 + chunk : n_out;
        /* where the weights of columns j0 .. j1 start, the column they start with and their row stride */
        const int64_t jw = packed ? j0 : 0, subw = wq ? SUBW_I8 : SUBW_F32;
        /* a packed panel of PANEL columns is in sub-panels of subw columns, [n_in, subw] each, one after another */
        const int split = packed && j1 - j0 == PANEL && subw < PANEL;
        const int64_t w_stride = split ? subw : packed ? j1 - j0 : n_out;
        const int64_t sv = split ? subw / VL : (int64_t)1 << 40, sub_stride = split ? n_in * subw : 0;
        for (int64_t b = 0; b < rows; ++b) {
            float *restrict yb = y + b * n_out;
            for (int64_t j = j0; j < j1; ++j) yb[j] = bias && !wq ? bias[j] : 0.f;
        }
        if (wq) {
            TILES(tile_i8, int8_t, wq + c * n_in * PANEL)
            for (int64_t b = 0; b < rows; ++b) {
                float *restrict yb = y + b * n_out;
#pragma omp simd
                for (int64_t j = j0; j < j1; ++j) yb[j] = yb[j] * scale[j] + (bias ? bias[j] : 0.f);
            }
        } else {
            TILES(tile_f32, float, packed ? wf + c * n_in * PANEL : wf)
        }
    }
}

/* The matrix weights[idx] applied to rows of x: int8 when scales[idx] is set (its per-column scales; packed), else
   fp32 (packed where ``packed``). */
static void project(const float *const *weights, const float *const *scales, int64_t idx, const float *restrict x,
                    int64_t rows, int64_t n_in, const float *restrict bias, int64_t n_out, float *restrict y,
                    int packed, int num_threads) {
    const float *scale = scales != NULL ? scales[idx] : NULL;
    matmul(x, rows, n_in, weights[idx], scale, bias, n_out, y, packed || scale != NULL, num_threads);
}

/* out = weight * (x * rsqrt(mean(x^2) + eps)), one row of n. */
static void rms_norm(const float *restrict x, const float *restrict weight, int64_t n, float eps, float *restrict out) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < n; ++j) ss += x[j] * x[j];
    const float r = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t j = 0; j < n; ++j) out[j] = weight[j] * (x[j] * r);
}

/* Rotate-half RoPE of one head in place: (x1 c - x2 s, x2 c + x1 s). */
static void rope(float *restrict x, const float *restrict c, const float *restrict s, int64_t half) {
    for (int64_t d = 0; d < half; ++d) {
        const float x1 = x[d], x2 = x[d + half];
        x[d] = x1 * c[d] + x2 * -s[d];
        x[d + half] = x2 * c[d] + x1 * s[d];
    }
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
    return s;
}

/* The sum of a vector's lanes, as a tree (a lane at a time is a chain of VL dependent adds). */
static inline float hsum(vf v) {
#if VL == 16 && defined(__AVX512F__)
    __m512 m;
    memcpy(&m, &v, sizeof m);
    return _mm512_reduce_add_ps(m);
#elif VL == 8 && defined(__AVX__)
    __m256 m;
    memcpy(&m, &v, sizeof m);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
    float f[VL], s = 0.f;
    memcpy(f, &v, sizeof f);
    for (int t = 0; t < VL; ++t) s += f[t];
    return s;
#endif
}

/* Softmax in place over each of the group's rows of scores p [group, ctx]. */
static void softmax_rows(float *p, int64_t group, int64_t ctx) {
    for (int64_t r = 0; r < group; ++r) {
        float *pr = p + r * ctx, m = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < ctx; ++t) m = pr[t] > m ? pr[t] : m;
        for (int64_t t = 0; t < ctx; ++t) {
            pr[t] = expf(pr[t] - m);
            sum += pr[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < ctx; ++t) pr[t] *= inv;
    }
}

/* Attention of the `group` query heads q [group, hd] that share one KV head (kvh's slice of each cached token, kvs
   floats a token) over the positions 0 .. ctx - 1 of a sequence's block table, into out [group, hd]; p: scratch for
   [group, ctx] scores. With hd = C vectors (C a constant where inlined): a score is C multiply-adds and one tree sum,
   and each output head's C vector sums stay in registers over the positions. */
static inline __attribute__((always_inline)) void attend_vectors(const int C, const float *restrict q,
                                                                 float *restrict out, const float *k_cache,
                                                                 const float *v_cache, const int64_t *table,
                                                                 int64_t ctx, int64_t bs, int64_t kvs, int64_t group,
                                                                 float scale, float *restrict p) {
    const int64_t hd = (int64_t)C * VL;
    for (int64_t t = 0; t < ctx; ++t) {
        const float *k = k_cache + (table[t / bs] * bs + t % bs) * kvs;
        vf kv[8];
        for (int c = 0; c < C; ++c) kv[c] = load_f32(k + c * VL);
        for (int64_t r = 0; r < group; ++r) {
            const float *qr = q + r * hd;
            vf s = load_f32(qr) * kv[0];
            for (int c = 1; c < C; ++c) s = s + load_f32(qr + c * VL) * kv[c];
            p[r * ctx + t] = hsum(s) * scale;
        }
    }
    softmax_rows(p, group, ctx);
    for (int64_t r = 0; r < group; ++r) {
        vf acc[8];
        for (int c = 0; c < C; ++c) acc[c] = (vf){0};
        const float *pr = p + r * ctx;
        for (int64_t t = 0; t < ctx; ++t) {
            const float *v = v_cache + (table[t / bs] * bs + t % bs) * kvs;
            const float wgt = pr[t];
            for (int c = 0; c < C; ++c) acc[c] = acc[c] + wgt * load_f32(v + c * VL);
        }
        for (int c = 0; c < C; ++c) store_f32(out + r * hd + c * VL, acc[c]);
    }
}

static void attend(const float *restrict q, float *restrict out, const float *k_cache, const float *v_cache,
                   const int64_t *table, int64_t ctx, int64_t bs, int64_t kvs, int64_t hd, int64_t group, float scale,
                   float *restrict p) {
    switch (hd % VL == 0 ? hd / VL : 0) {
#define ATTEND_CASE(C)                                                                                         \
    case C:                                                                                                    \
        attend_vectors(C, q, out, k_cache, v_cache, table, ctx, bs, kvs, group, scale, p);                    \
        return;
        ATTEND_CASE(1) ATTEND_CASE(2) ATTEND_CASE(3) ATTEND_CASE(4) ATTEND_CASE(5) ATTEND_CASE(6) ATTEND_CASE(7)
        ATTEND_CASE(8)
        default: break;
    }
    for (int64_t t = 0; t < ctx; ++t) { /* a head of any other width */
        const float *k = k_cache + (table[t / bs] * bs + t % bs) * kvs;
        for (int64_t r = 0; r < group; ++r) p[r * ctx + t] = dot(q + r * hd, k, hd) * scale;
    }
    softmax_rows(p, group, ctx);
    memset(out, 0, sizeof(float) * (size_t)(group * hd));
    for (int64_t t = 0; t < ctx; ++t) {
        const float *v = v_cache + (table[t / bs] * bs + t % bs) * kvs;
        for (int64_t r = 0; r < group; ++r) {
            const float wgt = p[r * ctx + t];
            float *restrict o = out + r * hd;
#pragma omp simd
            for (int64_t d = 0; d < hd; ++d) o[d] += wgt * v[d];
        }
    }
}

enum { L_IN_NORM, L_QKV, L_QKV_BIAS, L_O, L_POST_NORM, L_GATE_UP, L_GATE_UP_BIAS, L_DOWN, L_DOWN_BIAS, L_FIELDS };
enum { W_EMBED, W_NORM, W_LM_HEAD, W_COS, W_SIN, W_LAYERS };
enum { D_LAYERS, D_HIDDEN, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_INTER, D_VOCAB, D_BLOCK, D_NUM_BLOCKS, D_MAX_BLOCKS,
       D_EMBED_ROW, D_EMBED_COL, D_PACKED, D_FIELDS };

/* A small step of a Llama-family decoder: num_rows tokens (token_ids, positions), row r of sequence row_seqs[r]
   whose block table is row r_seq of block_tables [num_seqs, max_blocks] on the paged cache kv [layers, 2, num_blocks,
   block_size, kv_heads, head_dim]. A decode step is one row a sequence; a speculative verification is k + 1 rows of
   one sequence at consecutive positions; a draft catching up is a few. In each layer every row's K/V is written at
   its position first, then each row attends its sequence's positions 0 .. its own (causal: the step's later rows
   of the same sequence are not seen). Logits [num_logits, vocab] for rows logit_rows (the final norm and the LM head
   run for those only). dims and weights: the D_ and W_/L_ fields above (a NULL bias is none). The same operations
   as the torch model in one call; sums may be ordered differently. A matrix whose scales entry is set is int8
   (matmul); scales may be NULL (every matrix fp32). Returns 0, or -1 when out of memory. */
int tl_decode_step(const int64_t *dims, const float *const *weights, const float *const *scales, float *kv,
                   const int64_t *token_ids,
                   const int64_t *positions, const int64_t *row_seqs, const int64_t *block_tables, int64_t num_rows,
                   const int64_t *logit_rows, int64_t num_logits, float *logits, float eps, float scale,
                   int num_threads) {
    const int64_t L = dims[D_LAYERS], H = dims[D_HIDDEN], nh = dims[D_HEADS], nkv = dims[D_KV_HEADS];
    const int64_t hd = dims[D_HEAD_DIM], I = dims[D_INTER], V = dims[D_VOCAB], bs = dims[D_BLOCK];
    const int64_t nb = dims[D_NUM_BLOCKS], max_blocks = dims[D_MAX_BLOCKS];
    const int packed = dims[D_PACKED] != 0; /* the fp32 matrices in panels (``matmul``) */
    const int64_t qs = nh * hd, kvs = nkv * hd, qkv_n = qs + 2 * kvs, group = nh / nkv, half = hd / 2;
    const int64_t B = num_rows, cache_half = nb * bs * kvs; /* floats in one layer's K (or V) cache */
    int64_t max_ctx = 0;
    for (int64_t b = 0; b < B; ++b) max_ctx = positions[b] + 1 > max_ctx ? positions[b] + 1 : max_ctx;
    const int nt = num_threads > 1 ? num_threads : 1; /* each thread's scratch for scores */
    const size_t need = (size_t)(B * (2 * H + qkv_n + qs + 2 * I + I) + nt * group * max_ctx);
    float *buf = malloc(sizeof(float) * need);
    if (buf == NULL) return -1;
    float *x = buf, *h = x + B * H, *qkv = h + B * H, *att = qkv + B * qkv_n, *gu = att + B * qs, *act = gu + B * 2 * I;
    float *p = act + B * I;
    const float *embed = weights[W_EMBED];
    for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < H; ++j) x[b * H + j] = embed[token_ids[b] * dims[D_EMBED_ROW] + j * dims[D_EMBED_COL]];
    for (int64_t l = 0; l < L; ++l) {
        const int64_t lw = W_LAYERS + l * L_FIELDS;
        const float *const *w = weights + lw;
        float *k_cache = kv + (2 * l) * cache_half, *v_cache = k_cache + cache_half;
        for (int64_t b = 0; b < B; ++b) rms_norm(x + b * H, w[L_IN_NORM], H, eps, h + b * H);
        project(weights, scales, lw + L_QKV, h, B, H, w[L_QKV_BIAS], qkv_n, qkv, packed, num_threads);
        for (int64_t b = 0; b < B; ++b) { /* every row's K/V into the cache before any row attends */
            const int64_t pos = positions[b];
            const int64_t *table = block_tables + row_seqs[b] * max_blocks;
            const float *c = weights[W_COS] + pos * half, *s = weights[W_SIN] + pos * half;
            float *row = qkv + b * qkv_n;
            for (int64_t head = 0; head < nh + nkv; ++head) rope(row + head * hd, c, s, half);
            const int64_t slot = table[pos / bs] * bs + pos % bs;
            memcpy(k_cache + slot * kvs, row + qs, sizeof(float) * (size_t)kvs);
            memcpy(v_cache + slot * kvs, row + qs + kvs, sizeof(float) * (size_t)kvs);
        }
        /* One task per (row, KV head), over the threads when there are several. */
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && B * nkv > 1) schedule(dynamic, 1)
        for (int64_t task = 0; task < B * nkv; ++task) {
            const int64_t b = task / nkv, kvh = task % nkv;
            const int64_t *table = block_tables + row_seqs[b] * max_blocks;
            attend(qkv + b * qkv_n + kvh * group * hd, att + b * qs + kvh * group * hd, k_cache + kvh * hd,
                   v_cache + kvh * hd, table, positions[b] + 1, bs, kvs, hd, group, scale,
                   p + (int64_t)omp_get_thread_num() * group * max_ctx);
        }
        project(weights, scales, lw + L_O, att, B, qs, NULL, H, h, packed, num_threads);
        for (int64_t j = 0; j < B * H; ++j) x[j] += h[j];
        for (int64_t b = 0; b < B; ++b) rms_norm(x + b * H, w[L_POST_NORM], H, eps, h + b * H);
        project(weights, scales, lw + L_GATE_UP, h, B, H, w[L_GATE_UP_BIAS], 2 * I, gu, packed, num_threads);
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && B > 1) schedule(static)
        for (int64_t b = 0; b < B; ++b)
            for (int64_t j = 0; j < I; ++j) {
                const float g = gu[b * 2 * I + j];
                act[b * I + j] = g / (1.f + expf(-g)) * gu[b * 2 * I + I + j];
            }
        project(weights, scales, lw + L_DOWN, act, B, I, w[L_DOWN_BIAS], H, h, packed, num_threads);
        for (int64_t j = 0; j < B * H; ++j) x[j] += h[j];
    }
    for (int64_t i = 0; i < num_logits; ++i) rms_norm(x + logit_rows[i] * H, weights[W_NORM], H, eps, h + i * H);
    project(weights, scales, W_LM_HEAD, h, num_logits, H, NULL, V, logits, packed, num_threads);
    free(buf);
    return 0;
}

/* A draft model's greedy proposals for num_seqs sequences in one call: the step tl_decode_step runs on the given rows
   (each sequence's unseen tokens, row_seqs and block_tables as there; last_rows[s]: sequence s's last row) gives each
   sequence its first proposal, the argmax of its last row's logits (the lowest id among equal maxima, as
   torch.argmax); then sequence s feeds its proposal i - 1 at the next position to get proposal i, for i < ks[s]
   (every sequence still proposing, one row each, in one step). proposals: [num_seqs, max_k], row s filled up to
   ks[s] (1 <= ks[s] <= max_k). Returns 0, or -1 when out of memory. */
int tl_draft_greedy(const int64_t *dims, const float *const *weights, const float *const *scales, float *kv,
                    const int64_t *token_ids, const int64_t *positions, const int64_t *row_seqs,
                    const int64_t *block_tables, int64_t num_rows, const int64_t *last_rows, int64_t num_seqs,
                    const int64_t *ks, int64_t max_k, int64_t *proposals, float eps, float scale, int num_threads) {
    const int64_t V = dims[D_VOCAB];
    float *logits = malloc(sizeof(float) * (size_t)(num_seqs * V));
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(5 * num_seqs));
    if (logits == NULL || ids == NULL) {
        free(logits);
        free(ids);
        return -1;
    }
    int64_t *tok = ids, *pos = tok + num_seqs, *seq = pos + num_seqs, *rows = seq + num_seqs, *next = rows + num_seqs;
    int rc = 0;
    int64_t n = num_seqs;
    for (int64_t s = 0; s < num_seqs; ++s) {
        seq[s] = s;
        next[s] = positions[last_rows[s]] + 1;
    }
    for (int64_t i = 0; i < max_k && n > 0 && rc == 0; ++i) {
        if (i == 0)
            rc = tl_decode_step(dims, weights, scales, kv, token_ids, positions, row_seqs, block_tables, num_rows,
                                last_rows, num_seqs, logits, eps, scale, num_threads);
        else
            rc = tl_decode_step(dims, weights, scales, kv, tok, pos, seq, block_tables, n, rows, n, logits, eps, scale,
                                num_threads);
        int64_t m = 0;
        for (int64_t r = 0; r < n; ++r) {
            const int64_t s = seq[r];
            const float *l = logits + r * V;
            int64_t best = 0;
            for (int64_t v = 1; v < V; ++v) best = l[v] > l[best] ? v : best;
            proposals[s * max_k + i] = best;
            if (i + 1 < ks[s]) { /* it proposes on: its proposal at the next position */
                tok[m] = best;
                pos[m] = next[s] + i;
                seq[m] = s;
                rows[m] = m;
                ++m;
            }
        }
        n = m;
    }
    free(logits);
    free(ids);
    return rc;
}
"""

# -ffp-contract=fast: a multiply-add is one rounding (FMA), as in BLAS and llama.cpp (ISO C mode would keep them
# apart). On x86, vectors as wide as the host's registers (GCC keeps to 256 bits on AVX-512 hosts by default).
# Measured on the demo cloud LM (2-core Xeon with AVX-512, one thread, min of 5x50 calls, 3 alternating rounds):
# a decode step 1.70-1.75 -> 1.63-1.69 ms, a verification of 5 tokens 3.40-3.51 -> 2.70-2.76 ms.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-ffp-contract=fast") + (
    ("-mprefer-vector-width=512",) if platform.machine().lower() in ("x86_64", "amd64") else ()
)


class PagedAttention(Protocol):
    """The compiled kernel bound by ``_wrap``: see its ``paged_attention``."""

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        q_len: int,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor: ...


_lock = threading.Lock()
_loaded: dict[str, PagedAttention | None] = {}
_loaded_decode: dict[str, ctypes._NamedFuncPointer | None] = {}
_panel_width = [0, 0, 0]  # ``panel_width``: the panels', fp32 sub-panels', int8 sub-panels' columns


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("TIERLINE_KERNEL_CACHE") or Path(base) / "tierline" / "kernels")


def _cpuinfo_line(*prefixes: str) -> str:
    """The first line of /proc/cpuinfo that starts with one of ``prefixes`` ("" where none, or unreadable)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(prefixes):
                return line
    except OSError:
        pass
    return ""


def _cpu_flags() -> str:
    return _cpuinfo_line("flags", "Features")


def _cpu_vendor() -> str:
    return _cpuinfo_line("vendor_id").partition(":")[2].strip()


def _host_defines() -> tuple[str, ...]:
    """Choices of the kernels' source that -march=native does not make: on Intel x86, tiles prefetch their weights
    into every cache level (``TILE_PREFETCH_LOCALITY``), not non-temporally as elsewhere."""
    return ("-DTILE_PREFETCH_LOCALITY=3",) if _cpu_vendor() == "GenuineIntel" else ()


def _build(compiler: str, name: str, source: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    flags = (*FLAGS, *_host_defines())
    key = hashlib.sha256("\0".join([source, compiler, version, " ".join(flags), _cpu_flags()]).encode()).hexdigest()
    target = cache_dir() / f"{name}-{key[:16]}.so"
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = target.parent.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        # Whoever can write there can put code into this process: load nothing from such a folder.
        raise OSError(f"{target.parent} is not private to this user (owner and mode): not loading code from it")
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, lib = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
        src.write_text(source)
        subprocess.run(
            [compiler, *flags, "-o", str(lib), str(src), "-lm"], capture_output=True, text=True, check=True, timeout=120
        )
        lib.replace(target)  # atomic: a concurrent build of the same key writes the same bytes
    return target


def _switched_off() -> bool:
    return os.environ.get("TIERLINE_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off")


def _library(name: str, source: str, fallback: str) -> ctypes.CDLL | None:
    """``source`` compiled (or its cached build) and loaded, or None with ``fallback`` (what the engine does
    instead) logged. Call with ``_lock`` held."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler found: %s", fallback)
        return None
    try:
        return ctypes.CDLL(str(_build(compiler, name, source)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("CPU kernel %s unavailable (%s): %s", name, detail, fallback)
        return None


def paged_attention_kernel() -> PagedAttention | None:
    """The compiled kernel, or None (no C compiler, a failed build, or ``TIERLINE_CPU_KERNELS=0``); built once
    per process and cached on disk across processes."""
    if _switched_off():
        return None
    with _lock:
        if "paged_attention" in _loaded:
            return _loaded["paged_attention"]
        lib = _library("paged_attention", SOURCE, "CPU paged attention gathering blocks with torch")
        kernel = _wrap(lib.tl_paged_attention) if lib is not None else None
        _loaded["paged_attention"] = kernel
        return kernel


def decode_step_function() -> ctypes._NamedFuncPointer | None:
    """``tl_decode_step`` of ``DECODE_SOURCE`` with its signature declared, or None (as ``paged_attention_kernel``);
    ``FusedDecoder`` binds it to a model."""
    if _switched_off():
        return None
    with _lock:
        if "decode_step" in _loaded_decode:
            return _loaded_decode["decode_step"]
        lib = _library("decode_step", DECODE_SOURCE, "small decode steps run the torch model")
        fn = lib.tl_decode_step if lib is not None else None
        greedy = lib.tl_draft_greedy if lib is not None else None
        if fn is not None and greedy is not None:
            void, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
            fn.restype = greedy.restype = ctypes.c_int
            fn.argtypes = [void, void, void, void, void, void, void, void, i64, void, i64, void, f32, f32, ctypes.c_int]
            greedy.argtypes = [void] * 8 + [i64, void, i64, void, i64, void, f32, f32, ctypes.c_int]
        _loaded_decode["decode_step"] = fn
        _loaded_decode["draft_greedy"] = greedy
        if lib is not None:
            width, sub = lib.tl_panel_width, lib.tl_sub_panel_width
            width.restype, width.argtypes = ctypes.c_int, []
            sub.restype, sub.argtypes = ctypes.c_int, [ctypes.c_int]
            _panel_width[:] = [int(width()), int(sub(0)), int(sub(1))]
        return fn


def panel_width() -> int:
    """The width of the panels ``tl_decode_step`` reads a packed matrix in (``FusedDecoder`` packs them so): the
    widest tile's columns of this build (128 with AVX-512); 0 where the kernel is not built."""
    decode_step_function()
    return _panel_width[0]


def sub_panel_width(int8: bool) -> int:
    """The width of the sub-panels a full panel of a packed fp32 (or ``int8``) matrix is in: a cache line a row
    (16 fp32 columns, 64 int8 ones) on AVX2 and AVX-512 builds, the panel's width where it is whole (128-bit
    builds, AVX2's int8 panels of 32 bytes a row); 0 where the kernel is not built."""
    decode_step_function()
    return _panel_width[2 if int8 else 1]


def draft_greedy_function() -> ctypes._NamedFuncPointer | None:
    """``tl_draft_greedy`` of ``DECODE_SOURCE`` (built with ``decode_step_function``), or None."""
    if decode_step_function() is None:
        return None
    return _loaded_decode.get("draft_greedy")


def _wrap(fn: ctypes._NamedFuncPointer) -> PagedAttention:
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int]
    fn.argtypes += [ctypes.c_int64, ctypes.c_float]

    def paged_attention(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        q_len: int,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """q: [B * q_len, H, D] float32; caches [num_blocks, block_size, KVH, D]; block_tables [B, max_blocks] and
        context_lens [B] int64, every context at least ``q_len``; ``window`` (0: none): each query attends its last
        ``window`` positions; ``softcap`` (0: none) caps the scores. Returns [B * q_len, H, D]."""
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
            window,
            softcap,
        )
        if rc != 0:
            raise MemoryError("paged attention: out of memory for the attention scores")
        return out

    return paged_attention
