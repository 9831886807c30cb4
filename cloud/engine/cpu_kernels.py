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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* y[b, :] = (bias or 0) + x[b, :] @ wt for b < rows; wt: [n_in, n_out] row-major (the engine's transposed weights).
   Four input rows per pass over y, added in input order (the same sums as one row at a time), for four (or two) rows
   of x at once where there are as many (each weight loaded once for all of them: a verify step's k + 1 rows cost
   little more memory traffic than one). Columns are split across threads in chunks of 256 when num_threads > 1; on
   one thread a pass covers whole rows, so the weights stream in memory order (the hardware prefetcher follows;
   a 256-column chunk read 1 KB of each row, a row's length apart): the demo cloud LM's step 1.64-1.74 -> 1.54-1.63 ms
   in fp32, 1.07-1.10 -> 0.88-0.90 ms in int8 (min of 5x50 calls, alternating). Each output's sum is the same. */
static void linear(const float *restrict x, int64_t rows, int64_t n_in, const float *restrict wt,
                   const float *restrict bias, int64_t n_out, float *restrict y, int num_threads) {
    const int64_t chunk = num_threads > 1 ? 256 : n_out, num_chunks = (n_out + chunk - 1) / chunk;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && num_chunks > 1) schedule(static)
    for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t j0 = c * chunk, j1 = j0 + chunk < n_out ? j0 + chunk : n_out;
        for (int64_t b = 0; b < rows; ++b) {
            float *restrict yb = y + b * n_out;
            for (int64_t j = j0; j < j1; ++j) yb[j] = bias ? bias[j] : 0.f;
        }
        int64_t i = 0;
        for (; i + 4 <= n_in; i += 4) {
            const float *restrict w0 = wt + i * n_out, *restrict w1 = w0 + n_out, *restrict w2 = w1 + n_out;
            const float *restrict w3 = w2 + n_out;
            int64_t b = 0;
            for (; b + 4 <= rows; b += 4) {
                const float *xa = x + b * n_in + i, *xb = xa + n_in, *xc = xb + n_in, *xd = xc + n_in;
                const float a0 = xa[0], a1 = xa[1], a2 = xa[2], a3 = xa[3];
                const float b0 = xb[0], b1 = xb[1], b2 = xb[2], b3 = xb[3];
                const float c0 = xc[0], c1 = xc[1], c2 = xc[2], c3 = xc[3];
                const float d0 = xd[0], d1 = xd[1], d2 = xd[2], d3 = xd[3];
                float *restrict ya = y + b * n_out, *restrict yb = ya + n_out, *restrict yc = yb + n_out;
                float *restrict yd = yc + n_out;
#pragma omp simd
                for (int64_t j = j0; j < j1; ++j) {
                    const float v0 = w0[j], v1 = w1[j], v2 = w2[j], v3 = w3[j];
                    ya[j] = (((ya[j] + a0 * v0) + a1 * v1) + a2 * v2) + a3 * v3;
                    yb[j] = (((yb[j] + b0 * v0) + b1 * v1) + b2 * v2) + b3 * v3;
                    yc[j] = (((yc[j] + c0 * v0) + c1 * v1) + c2 * v2) + c3 * v3;
                    yd[j] = (((yd[j] + d0 * v0) + d1 * v1) + d2 * v2) + d3 * v3;
                }
            }
            for (; b + 2 <= rows; b += 2) {
                const float *xa = x + b * n_in + i, *xb = xa + n_in;
                const float a0 = xa[0], a1 = xa[1], a2 = xa[2], a3 = xa[3];
                const float b0 = xb[0], b1 = xb[1], b2 = xb[2], b3 = xb[3];
                float *restrict ya = y + b * n_out, *restrict yb = ya + n_out;
#pragma omp simd
                for (int64_t j = j0; j < j1; ++j) {
                    const float v0 = w0[j], v1 = w1[j], v2 = w2[j], v3 = w3[j];
                    ya[j] = (((ya[j] + a0 * v0) + a1 * v1) + a2 * v2) + a3 * v3;
                    yb[j] = (((yb[j] + b0 * v0) + b1 * v1) + b2 * v2) + b3 * v3;
                }
            }
            for (; b < rows; ++b) {
                const float *xb = x + b * n_in + i;
                const float x0 = xb[0], x1 = xb[1], x2 = xb[2], x3 = xb[3];
                float *restrict yb = y + b * n_out;
#pragma omp simd
                for (int64_t j = j0; j < j1; ++j)
                    yb[j] = (((yb[j] + x0 * w0[j]) + x1 * w1[j]) + x2 * w2[j]) + x3 * w3[j];
            }
        }
        for (; i < n_in; ++i) {
            const float *w0 = wt + i * n_out;
            for (int64_t b = 0; b < rows; ++b) {
                const float x0 = x[b * n_in + i];
                float *restrict yb = y + b * n_out;
#pragma omp simd
                for (int64_t j = j0; j < j1; ++j) yb[j] += x0 * w0[j];
            }
        }
    }
}

/* y = bias + (x @ wq) * scale, the weight-only int8 twin of linear: wq int8 [n_in, n_out] (the weights quantized
   per output column, symmetric), scale [n_out]. A quarter of the bytes to read, for a batch-1 step that reads every
   weight from the cache hierarchy once. Two rows (or one) per pass, each row's sums in input order. */
static void qlinear(const float *restrict x, int64_t rows, int64_t n_in, const int8_t *restrict wq,
                    const float *restrict scale, const float *restrict bias, int64_t n_out, float *restrict y,
                    int num_threads) {
    const int64_t chunk = num_threads > 1 ? 256 : n_out, num_chunks = (n_out + chunk - 1) / chunk;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && num_chunks > 1) schedule(static)
    for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t j0 = c * chunk, j1 = j0 + chunk < n_out ? j0 + chunk : n_out;
        for (int64_t b = 0; b < rows; ++b) {
            float *restrict yb = y + b * n_out;
            for (int64_t j = j0; j < j1; ++j) yb[j] = 0.f;
        }
        int64_t i = 0;
        for (; i + 4 <= n_in; i += 4) {
            const int8_t *restrict w0 = wq + i * n_out, *restrict w1 = w0 + n_out, *restrict w2 = w1 + n_out;
            const int8_t *restrict w3 = w2 + n_out;
            int64_t b = 0;
            for (; b + 2 <= rows; b += 2) {
                const float *xa = x + b * n_in + i, *xb = xa + n_in;
                const float a0 = xa[0], a1 = xa[1], a2 = xa[2], a3 = xa[3];
                const float b0 = xb[0], b1 = xb[1], b2 = xb[2], b3 = xb[3];
                float *restrict ya = y + b * n_out, *restrict yb = ya + n_out;
#pragma omp simd
                for (int64_t j = j0; j < j1; ++j) {
                    const float v0 = w0[j], v1 = w1[j], v2 = w2[j], v3 = w3[j];
                    ya[j] = (((ya[j] + a0 * v0) + a1 * v1) + a2 * v2) + a3 * v3;
                    yb[j] = (((yb[j] + b0 * v0) + b1 * v1) + b2 * v2) + b3 * v3;
                }
            }
            for (; b < rows; ++b) {
                const float *xb = x + b * n_in + i;
                const float x0 = xb[0], x1 = xb[1], x2 = xb[2], x3 = xb[3];
                float *restrict yb = y + b * n_out;
#pragma omp simd
                for (int64_t j = j0; j < j1; ++j)
                    yb[j] = (((yb[j] + x0 * (float)w0[j]) + x1 * (float)w1[j]) + x2 * (float)w2[j]) +
                            x3 * (float)w3[j];
            }
        }
        for (; i < n_in; ++i) {
            const int8_t *w0 = wq + i * n_out;
            for (int64_t b = 0; b < rows; ++b) {
                const float x0 = x[b * n_in + i];
                float *restrict yb = y + b * n_out;
#pragma omp simd
                for (int64_t j = j0; j < j1; ++j) yb[j] += x0 * (float)w0[j];
            }
        }
        for (int64_t b = 0; b < rows; ++b) {
            float *restrict yb = y + b * n_out;
#pragma omp simd
            for (int64_t j = j0; j < j1; ++j) yb[j] = yb[j] * scale[j] + (bias ? bias[j] : 0.f);
        }
    }
}

/* The matrix weights[idx] applied to rows of x: int8 when scales[idx] is set (its per-column scales), else fp32. */
static void project(const float *const *weights, const float *const *scales, int64_t idx, const float *restrict x,
                    int64_t rows, int64_t n_in, const float *restrict bias, int64_t n_out, float *restrict y,
                    int num_threads) {
    if (scales != NULL && scales[idx] != NULL)
        qlinear(x, rows, n_in, (const int8_t *)weights[idx], scales[idx], bias, n_out, y, num_threads);
    else
        linear(x, rows, n_in, weights[idx], bias, n_out, y, num_threads);
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

enum { L_IN_NORM, L_QKV, L_QKV_BIAS, L_O, L_POST_NORM, L_GATE_UP, L_GATE_UP_BIAS, L_DOWN, L_DOWN_BIAS, L_FIELDS };
enum { W_EMBED, W_NORM, W_LM_HEAD, W_COS, W_SIN, W_LAYERS };
enum { D_LAYERS, D_HIDDEN, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_INTER, D_VOCAB, D_BLOCK, D_NUM_BLOCKS, D_MAX_BLOCKS,
       D_EMBED_ROW, D_EMBED_COL, D_FIELDS };

/* A small step of a Llama-family decoder: num_rows tokens (token_ids, positions), row r of sequence row_seqs[r]
   whose block table is row r_seq of block_tables [num_seqs, max_blocks] on the paged cache kv [layers, 2, num_blocks,
   block_size, kv_heads, head_dim]. A decode step is one row a sequence; a speculative verification is k + 1 rows of
   one sequence at consecutive positions; a draft catching up is a few. In each layer every row's K/V is written at
   its position first, then each row attends its sequence's positions 0 .. its own (causal: the step's later rows
   of the same sequence are not seen). Logits [num_logits, vocab] for rows logit_rows (the final norm and the LM head
   run for those only). dims and weights: the D_ and W_/L_ fields above (a NULL bias is none). The same operations
   as the torch model in one call; sums may be ordered differently. A matrix whose scales entry is set is int8
   (qlinear); scales may be NULL (every matrix fp32). Returns 0, or -1 when out of memory. */
int tl_decode_step(const int64_t *dims, const float *const *weights, const float *const *scales, float *kv,
                   const int64_t *token_ids,
                   const int64_t *positions, const int64_t *row_seqs, const int64_t *block_tables, int64_t num_rows,
                   const int64_t *logit_rows, int64_t num_logits, float *logits, float eps, float scale,
                   int num_threads) {
    const int64_t L = dims[D_LAYERS], H = dims[D_HIDDEN], nh = dims[D_HEADS], nkv = dims[D_KV_HEADS];
    const int64_t hd = dims[D_HEAD_DIM], I = dims[D_INTER], V = dims[D_VOCAB], bs = dims[D_BLOCK];
    const int64_t nb = dims[D_NUM_BLOCKS], max_blocks = dims[D_MAX_BLOCKS];
    const int64_t qs = nh * hd, kvs = nkv * hd, qkv_n = qs + 2 * kvs, group = nh / nkv, half = hd / 2;
    const int64_t B = num_rows, cache_half = nb * bs * kvs; /* floats in one layer's K (or V) cache */
    int64_t max_ctx = 0;
    for (int64_t b = 0; b < B; ++b) max_ctx = positions[b] + 1 > max_ctx ? positions[b] + 1 : max_ctx;
    const size_t need = (size_t)(B * (2 * H + qkv_n + qs + 2 * I + I) + group * max_ctx);
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
        project(weights, scales, lw + L_QKV, h, B, H, w[L_QKV_BIAS], qkv_n, qkv, num_threads);
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
        for (int64_t b = 0; b < B; ++b) {
            const int64_t ctx = positions[b] + 1;
            const int64_t *table = block_tables + row_seqs[b] * max_blocks;
            const float *row = qkv + b * qkv_n;
            for (int64_t kvh = 0; kvh < nkv; ++kvh) {
                for (int64_t t = 0; t < ctx; ++t) {
                    const float *k = k_cache + (table[t / bs] * bs + t % bs) * kvs + kvh * hd;
                    for (int64_t r = 0; r < group; ++r)
                        p[r * ctx + t] = dot(row + (kvh * group + r) * hd, k, hd) * scale;
                }
                for (int64_t r = 0; r < group; ++r) {
                    float *pr = p + r * ctx, m = -INFINITY, sum = 0.f;
                    for (int64_t t = 0; t < ctx; ++t) m = pr[t] > m ? pr[t] : m;
                    for (int64_t t = 0; t < ctx; ++t) {
                        pr[t] = expf(pr[t] - m);
                        sum += pr[t];
                    }
                    const float inv = 1.f / sum;
                    for (int64_t t = 0; t < ctx; ++t) pr[t] *= inv;
                    memset(att + b * qs + (kvh * group + r) * hd, 0, sizeof(float) * (size_t)hd);
                }
                for (int64_t t = 0; t < ctx; ++t) {
                    const float *v = v_cache + (table[t / bs] * bs + t % bs) * kvs + kvh * hd;
                    for (int64_t r = 0; r < group; ++r) {
                        const float wgt = p[r * ctx + t];
                        float *restrict o = att + b * qs + (kvh * group + r) * hd;
#pragma omp simd
                        for (int64_t d = 0; d < hd; ++d) o[d] += wgt * v[d];
                    }
                }
            }
        }
        project(weights, scales, lw + L_O, att, B, qs, NULL, H, h, num_threads);
        for (int64_t j = 0; j < B * H; ++j) x[j] += h[j];
        for (int64_t b = 0; b < B; ++b) rms_norm(x + b * H, w[L_POST_NORM], H, eps, h + b * H);
        project(weights, scales, lw + L_GATE_UP, h, B, H, w[L_GATE_UP_BIAS], 2 * I, gu, num_threads);
        for (int64_t b = 0; b < B; ++b)
            for (int64_t j = 0; j < I; ++j) {
                const float g = gu[b * 2 * I + j];
                act[b * I + j] = g / (1.f + expf(-g)) * gu[b * 2 * I + I + j];
            }
        project(weights, scales, lw + L_DOWN, act, B, I, w[L_DOWN_BIAS], H, h, num_threads);
        for (int64_t j = 0; j < B * H; ++j) x[j] += h[j];
    }
    for (int64_t i = 0; i < num_logits; ++i) rms_norm(x + logit_rows[i] * H, weights[W_NORM], H, eps, h + i * H);
    project(weights, scales, W_LM_HEAD, h, num_logits, H, NULL, V, logits, num_threads);
    free(buf);
    return 0;
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


def _build(compiler: str, name: str, source: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([source, compiler, version, " ".join(FLAGS), _cpu_flags()]).encode()).hexdigest()
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
            [compiler, *FLAGS, "-o", str(lib), str(src), "-lm"], capture_output=True, text=True, check=True, timeout=120
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
        if fn is not None:
            fn.restype = ctypes.c_int
            void, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
            fn.argtypes = [void, void, void, void, void, void, void, void, i64, void, i64, void, f32, f32, ctypes.c_int]
        _loaded_decode["decode_step"] = fn
        return fn


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
