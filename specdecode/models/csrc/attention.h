// One query row's causal grouped-query attention over a KV cache head: the query heads of one kv
// head share each key and value load. Shared by the target's batch-invariant attention
// (``attention_rows.cpp``) and the int4 draft's whole forward (``linear_int4.cpp``). Per query
// head: scores = q . k_j (an 8-lane FMA chain over the head dimension, then a fixed reduction
// tree) times ``scale``; m = their max; p_j = exp(s_j - m) by a polynomial (``exp8``: the same
// operations in the AVX2 and portable builds, unlike libm's exp); out = (sum_j p_j v_j) / (sum_j
// p_j), both sums running over j in order. So a row's arithmetic depends only on its query, the
// keys it sees and their number, in a fixed order.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "lanes.h"

namespace attention {

using namespace lanes;

// Software prefetch, ahead of where a row's loop reads: a deep context's keys and values stream
// from memory (at 3000 tokens, 86 MB of each a step), and the hardware prefetchers alone kept this
// loop at about 6 GB/s a core (`scripts/step_parts.py`: attention 13.8 of a 55.4 ms step at context
// 3000). A prefetch changes no bit, and one past the cache's end is a no-op (it never faults).
constexpr int64_t KEYS_AHEAD = 8, VALUES_AHEAD = 16;  // rows ahead: 4 and 8 KB at d = 128

inline void prefetch_lanes(const float* p, int64_t n) {  // the cache lines of p[0 .. n)
#if defined(__AVX2__)
    for (int64_t l = 0; l < n; l += 16) _mm_prefetch(reinterpret_cast<const char*>(p + l), _MM_HINT_T0);
#else
    (void)p, (void)n;
#endif
}

// Scores of H query heads (rows of q, stride d) against J consecutive keys: H * J FMA chains over
// the head dimension, each the one chain a lone (head, key) pair runs, so grouping changes no bit.
// Sharing each key load among the heads is what makes this fast: the keys of a deep context do not
// fit the L2 cache, and reading them once per kv head instead of once per query head cuts the
// traffic by the group size.
template <int H, int J>
inline void scores(const float* q, const float* k, int64_t d, float scale, float* s, int64_t ld) {
    V8 a[H][J];
    for (int h = 0; h < H; ++h)
        for (int j = 0; j < J; ++j) a[h][j] = splat(0.f);
    for (int64_t c = 0; c < d; c += 8) {
        V8 kc[J];
        for (int j = 0; j < J; ++j) kc[j] = load(k + j * d + c);
        for (int h = 0; h < H; ++h) {
            const V8 qc = load(q + h * d + c);
            for (int j = 0; j < J; ++j) a[h][j] = fma(qc, kc[j], a[h][j]);
        }
    }
    for (int h = 0; h < H; ++h)
        for (int j = 0; j < J; ++j) s[h * ld + j] = reduce8(a[h][j]) * scale;
}

// out_h[0 .. 8*NV) = inv_h * sum over j < len of p_h[j] * v[j][0 .. 8*NV), for H heads sharing each
// value load; every output lane is one chain over j in order.
template <int H, int NV>
inline void weighted_sums(const float* p, int64_t ld, const float* v, int64_t d, int64_t len, const float* inv,
                          float* out) {
    V8 acc[H][NV];
    for (int h = 0; h < H; ++h)
        for (int t = 0; t < NV; ++t) acc[h][t] = splat(0.f);
    for (int64_t j = 0; j < len; ++j) {
        const float* vj = v + j * d;
        prefetch_lanes(vj + VALUES_AHEAD * d, 8 * NV);
        V8 vt[NV];
        for (int t = 0; t < NV; ++t) vt[t] = load(vj + 8 * t);
        for (int h = 0; h < H; ++h) {
            const V8 pj = splat(p[h * ld + j]);
            for (int t = 0; t < NV; ++t) acc[h][t] = fma(pj, vt[t], acc[h][t]);
        }
    }
    for (int h = 0; h < H; ++h)
        for (int t = 0; t < NV; ++t) store(out + h * d + 8 * t, mul(acc[h][t], splat(inv[h])));
}

// Vector registers a build has: AVX2's 16, or AVX-512VL's 32 for the same 8-lane code.
#if defined(__AVX512VL__)
constexpr int REGISTERS = 32;
#else
constexpr int REGISTERS = 16;
#endif

// One row's attention for H query heads of one kv head (their scores in s, H rows of stride ld).
// Keys per score block (J) and value lanes per pass (NV) are as many as fit the build's vector
// registers: H * J score chains and H * NV value chains stay in registers. The bits are the
// same whatever the blocks, since grouping changes no chain. With the interleaved max and sum
// below and the blocks of ``row_group``, a row at 300 keys (`scripts/attention_time/attention_time.sh
// [attention.h] GROUP D 300`, one thread, AMD EPYC Zen 4, 2026-11-28, against the previous
// kernel): the int4 draft's 7 heads of 64 a kv head 7.8 against 20.4 us (AVX-512 build) and 9.2
// against 20.4 us (AVX2), the 1.5B target's 6 heads of 128 10.5 against 16.7 us (AVX-512) and
// 13.4 against 16.0 us (AVX2).
template <int H>
inline void head_block(const float* q, const float* k, const float* v, int64_t d, int64_t len, float scale, float* out,
                float* s, int64_t ld) {
    constexpr int J = REGISTERS == 32 ? (H == 1 ? 4 : H == 2 ? 8 : H == 3 ? 6 : H <= 5 ? 4 : 3)
                                      : (H == 1 ? 4 : H <= 4 ? 3 : H <= 6 ? 2 : 1);
    constexpr int NV = REGISTERS == 32 ? (H <= 3 ? 8 : 4) : (H == 1 ? 8 : H <= 3 ? 4 : H <= 6 ? 2 : 1);
    int64_t j = 0;
    for (; j + J <= len; j += J) {
        prefetch_lanes(k + (j + KEYS_AHEAD) * d, J * d);
        scores<H, J>(q, k + j * d, d, scale, s + j, ld);
    }
    for (; j < len; ++j) scores<H, 1>(q, k + j * d, d, scale, s + j, ld);
    // Each head's max and sum run over j in order; the heads' chains interleave, so that their
    // latencies overlap rather than add up.
    float m[H], total[H], inv[H];
    for (int h = 0; h < H; ++h) m[h] = s[h * ld];
    for (j = 1; j < len; ++j)
        for (int h = 0; h < H; ++h) m[h] = s[h * ld + j] > m[h] ? s[h * ld + j] : m[h];
    for (int h = 0; h < H; ++h) {
        float* sh = s + h * ld;
        for (j = len; j < ld; ++j) sh[j] = m[h];  // padding lanes: computed, never summed
        const V8 mv = splat(m[h]);
        for (j = 0; j < ld; j += 8) store(sh + j, exp8(sub(load(sh + j), mv)));
        total[h] = 0.f;
    }
    for (j = 0; j < len; ++j)
        for (int h = 0; h < H; ++h) total[h] += s[h * ld + j];
    for (int h = 0; h < H; ++h) inv[h] = 1.f / total[h];
    int64_t c = 0;
    for (; c + 8 * NV <= d; c += 8 * NV) weighted_sums<H, NV>(s, ld, v + c, d, len, inv, out + c);
    for (; c < d; c += 8) weighted_sums<H, 1>(s, ld, v + c, d, len, inv, out + c);
}

// Rotate-half RoPE of one head in place with a position's cos, sin [d]: x1 cos - x2 sin and
// x2 cos + x1 sin, the operations and order of ``kernels.apply_rope``, so its bits where floats are
// not contracted (the target's builds: ``kernel_build.gguf_flags``).
inline void rope_half(float* t, const float* c, const float* s, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t l = 0; l < half; ++l) {
        const float x1 = t[l], x2 = t[l + half];
        t[l] = x1 * c[l] - x2 * s[l];
        t[l + half] = x2 * c[l + half] + x1 * s[l + half];
    }
}

// Most query heads per block: a group splits into blocks of ceil(group / blocks) heads, at most 7 (32 registers) or
// 6 (16 registers). With 16, a block of 7 or 8 leaves room for one key and one value vector a pass
// (J = NV = 1) and took twice a block of 6's time per head (the AVX2 figures above); with 32, 8
// heads of 128 as 4 and 4 took 15.7 against 19.9 us as one block (the same script, GROUP 8).
constexpr int64_t MAX_BLOCK = REGISTERS == 32 ? 7 : 6;

// One row's attention for the query heads of one kv head, in blocks of up to MAX_BLOCK heads.
inline void row_group(const float* q, const float* k, const float* v, int64_t group, int64_t d, int64_t len,
               float scale, float* out, std::vector<float>& buf) {
    if (group <= 0) return;
    const int64_t ld = (len + 7) / 8 * 8;
    const int64_t blocks = (group + MAX_BLOCK - 1) / MAX_BLOCK, block = (group + blocks - 1) / blocks;
    buf.resize(block * ld);
    float* s = buf.data();
    for (int64_t h = 0; h < group; h += block) {
        const float* qh = q + h * d;
        float* oh = out + h * d;
        switch (std::min(block, group - h)) {
            case 1: head_block<1>(qh, k, v, d, len, scale, oh, s, ld); break;
            case 2: head_block<2>(qh, k, v, d, len, scale, oh, s, ld); break;
            case 3: head_block<3>(qh, k, v, d, len, scale, oh, s, ld); break;
            case 4: head_block<4>(qh, k, v, d, len, scale, oh, s, ld); break;
            case 5: head_block<5>(qh, k, v, d, len, scale, oh, s, ld); break;
            case 6: head_block<6>(qh, k, v, d, len, scale, oh, s, ld); break;
            default: head_block<7>(qh, k, v, d, len, scale, oh, s, ld); break;
        }
    }
}

// Kv head g of n consecutive rows of a fused q|k|v (qkv, row stride ``width``: the hq query heads,
// then the hkv keys, then the hkv values) at cache slots start .. start + n - 1: bias (when given)
// and RoPE on the group's query heads and the key, the key and value into the cache (kc, vc: head
// g's slots), then each row's attention over slots 0 .. start + i into attn (row stride hq * d).
// The int4 draft's forward and the GGUF target's share it.
inline void rope_write_attend(float* qkv, int64_t width, int64_t n, int64_t start, int64_t g, int64_t hq, int64_t hkv,
                              int64_t d, const float* bias, const float* cos, const float* sin, float* kc, float* vc,
                              float scale, float* attn, std::vector<float>& scores) {
    const int64_t group = hq / hkv;
    for (int64_t i = 0; i < n; ++i) {
        float* row = qkv + i * width;
        const float *c = cos + (start + i) * d, *sn = sin + (start + i) * d;
        for (int64_t j = 0; j < group + 2; ++j) {
            const int64_t head = j < group ? g * group + j : j == group ? hq + g : hq + hkv + g;
            float* v = row + head * d;
            if (bias)
                for (int64_t e = 0; e < d; ++e) v[e] = v[e] + bias[head * d + e];
            if (head < hq + hkv) rope_half(v, c, sn, d);
        }
        std::copy_n(row + (hq + g) * d, d, kc + (start + i) * d);
        std::copy_n(row + (hq + hkv + g) * d, d, vc + (start + i) * d);
    }
    for (int64_t i = 0; i < n; ++i)  // the group's query heads share each key and value load
        row_group(qkv + i * width + g * group * d, kc, vc, group, d, start + i + 1, scale, attn + i * hq * d + g * group * d,
                  scores);
}

}  // namespace attention
