// Int4 weight, int8 activation linear layers for draft models on x86-64 CPUs (AVX2, or AVX-512
// VNNI where the CPU has it), and a draft's whole decoder forward for a few decode rows.
//
// Why by hand: no library here multiplies 4-bit weights by a few activation rows (torch's
// quantized engines stop at int8, whose weights are twice the bytes a one-row step streams), and
// a draft's one-row forward through torch spends more time dispatching its small ops than in
// its weights.
//
// A draft's numerics never affect exactness (the target verifies every token it proposes), so
// its few decode rows may take the cheapest arithmetic that keeps it agreeing with the target:
// weights as signed 4-bit values with one scale per group of 64 inputs, activations quantized to
// int8 per row per call, products summed in int32. A decode step reads 4.25-4.5 bits per weight.
//
// Two weight layouts:
// * Row-major, as ``draft_quant.Int4Groups`` holds it (``linear_int4``, one matrix per call):
//   packed[n, g*32 + j] holds weight (n, g*64 + j) in its low nibble and (n, g*64 + 32 + j) in its
//   high nibble, each stored as value + 8 (0..15); float scales [out, in/64]. Activations go
//   unsigned (xq + 128) and weights signed (nibble - 8); the 128 * sum(w) this adds is the
//   per-output ``offset[n]`` = 128 * sum_g s_g * sum(w_g), computed when quantizing. One group is
//   one VPDPBUSD (VNNI), or two VPMADDUBSW and a VPMADDWD (AVX2), reduced per output.
// * Tiles, which ``Int4Draft`` repacks every matrix into once (see "Tiles" below): each SIMD
//   lane is one output, so there is no reduction per output and one float FMA per 16 outputs and
//   group; a thread streams one contiguous run of bytes per matrix; scales are fp16.
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "attention.h"
#include "lanes.h"
#include "segments.h"

namespace {

constexpr int64_t G = 64;  // inputs per scale group
// Software prefetch, bytes ahead in the weight stream: a draft's matrices are small (a call
// streams 0.4-4 MB), too short for the hardware prefetcher to ramp up, so a one-row draft forward
// runs faster with it; 3 KB ahead was the fastest distance tried (0.5-4 KB).
constexpr int64_t PF = 3072;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
using Acc = __m512;  // float partial sums of one output and row
struct Group {       // one group's 64 bytes: activations (unsigned) or weights (signed)
    __m512i v;
};

inline Acc acc_zero() { return _mm512_setzero_ps(); }
inline Acc acc_load(const float* p) { return _mm512_loadu_ps(p); }
inline Acc acc_fma(Acc a, Acc b, Acc c) { return _mm512_fmadd_ps(a, b, c); }
inline float acc_sum(Acc a) { return _mm512_reduce_add_ps(a); }
inline Group load_x(const uint8_t* p) { return {_mm512_loadu_si512(reinterpret_cast<const void*>(p))}; }

inline Group load_w(const uint8_t* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i m = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(v, m);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
    const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return {_mm512_sub_epi8(u, _mm512_set1_epi8(8))};
}

// acc += scale * (the group's 64 products x * w, summed in int32).
inline Acc group_fma(const Group& x, const Group& w, float scale, Acc acc) {
    const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), x.v, w.v);
    return acc_fma(_mm512_cvtepi32_ps(d), _mm512_set1_ps(scale), acc);
}
#else
using Acc = __m256;
struct Group {  // a group's first and last 32 bytes
    __m256i lo, hi;
};

inline float hsum(__m256 a) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

inline Acc acc_zero() { return _mm256_setzero_ps(); }
inline Acc acc_load(const float* p) { return _mm256_loadu_ps(p); }
inline Acc acc_fma(Acc a, Acc b, Acc c) { return _mm256_fmadd_ps(a, b, c); }
inline float acc_sum(Acc a) { return hsum(a); }

inline Group load_x(const uint8_t* p) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}

inline Group load_w(const uint8_t* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i m = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
    return {_mm256_sub_epi8(_mm256_and_si256(v, m), eight),
            _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(v, 4), m), eight)};
}

inline Acc group_fma(const Group& x, const Group& w, float scale, Acc acc) {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(x.lo, w.lo), _mm256_maddubs_epi16(x.hi, w.hi));
    const __m256i d = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
    return acc_fma(_mm256_cvtepi32_ps(d), _mm256_set1_ps(scale), acc);
}
#endif

constexpr int64_t LANES = sizeof(Acc) / sizeof(float);

// JB outputs x R rows; xq: unsigned activations [rows, in], row-major.
template <int JB, int R>
inline void tile(const uint8_t* xq, const float* xs, const uint8_t* w, const float* s, const float* off,
                 float* y, int64_t in, int64_t out, int64_t j0, int64_t r0) {
    const int64_t groups = in / G;
    Acc acc[JB][R];
    for (int a = 0; a < JB; ++a)
        for (int b = 0; b < R; ++b) acc[a][b] = acc_zero();
    for (int64_t g = 0; g < groups; ++g) {
        Group xv[R];
        for (int b = 0; b < R; ++b) xv[b] = load_x(xq + (r0 + b) * in + g * G);
        for (int a = 0; a < JB; ++a) {
            const uint8_t* wp = w + (j0 + a) * (in / 2) + g * (G / 2);
            _mm_prefetch(reinterpret_cast<const char*>(wp + PF), _MM_HINT_T0);
            const Group wv = load_w(wp);
            const float sg = s[(j0 + a) * groups + g];
            for (int b = 0; b < R; ++b) acc[a][b] = group_fma(xv[b], wv, sg, acc[a][b]);
        }
    }
    for (int a = 0; a < JB; ++a)
        for (int b = 0; b < R; ++b)
            y[(r0 + b) * out + j0 + a] = xs[r0 + b] * (acc_sum(acc[a][b]) - off[j0 + a]);
}

template <int JB>
void rows(const uint8_t* xq, const float* xs, const uint8_t* w, const float* s, const float* off, float* y,
          int64_t n, int64_t in, int64_t out, int64_t j0) {
    int64_t r = 0;
    for (; r + 2 <= n; r += 2) tile<JB, 2>(xq, xs, w, s, off, y, in, out, j0, r);
    if (r < n) tile<JB, 1>(xq, xs, w, s, off, y, in, out, j0, r);
}

// Activations -> unsigned int8 per row (symmetric, stored with +128) and their scales.
void quantize_rows(const float* x, int64_t n, int64_t in, uint8_t* q, float* scales) {
    for (int64_t r = 0; r < n; ++r) {
        const float* xr = x + r * in;
        float m = 0.f;
        for (int64_t k = 0; k < in; ++k) m = std::max(m, std::fabs(xr[k]));
        const float scale = m > 0.f ? m / 127.f : 1.f;
        const float inv = 1.f / scale;
        for (int64_t k = 0; k < in; ++k)
            q[r * in + k] = static_cast<uint8_t>(static_cast<int>(std::nearbyint(xr[k] * inv)) + 128);
        scales[r] = scale;
    }
}

// One int4 weight as raw pointers: packed [out, in/2], scales [out, in/64], offset [out].
struct Weight {
    const uint8_t* packed = nullptr;
    const float* scales = nullptr;
    const float* offset = nullptr;
    int64_t out = 0, in = 0;

    Weight() = default;
    Weight(const torch::Tensor& p, const torch::Tensor& s, const torch::Tensor& o)
        : packed(p.data_ptr<uint8_t>()), scales(s.data_ptr<float>()), offset(o.data_ptr<float>()),
          out(p.size(0)), in(p.size(1) * 2) {
        TORCH_CHECK(p.is_contiguous() && s.is_contiguous() && o.is_contiguous(), "int4 weight must be contiguous");
        TORCH_CHECK(in % G == 0 && s.size(0) == out && s.size(1) == in / G && o.numel() == out, "bad int4 weight");
    }

    // y [n, out] = x [n, in] @ w.T; xq/xs: scratch of n * in bytes and n floats.
    void apply(const float* x, int64_t n, float* y, uint8_t* xq, float* xs) const {
        quantize_rows(x, n, in, xq, xs);
        constexpr int64_t JB = 4;
        const int64_t blocks = out / JB;
        at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
            for (int64_t b = begin; b < end; ++b) rows<JB>(xq, xs, packed, scales, offset, y, n, in, out, b * JB);
        });
        for (int64_t j = blocks * JB; j < out; ++j) rows<1>(xq, xs, packed, scales, offset, y, n, in, out, j);
    }
};

// ---- Tiles: the layout of ``Int4Draft``'s matrices. ------------------------------------------
//
// A tile is 16 outputs (weight rows; the last tile of a matrix padded with zero scales) over all
// inputs, stored contiguously: first [groups][16] fp16 scales (padded to 64 bytes), then
// [groups][8 blocks][16 outputs][4 bytes], where byte t of output o in block b of group g holds
// input 64g + 8b + t in its low nibble and input 64g + 8b + 4 + t in its high nibble, each as
// value + 8 (0..15). A block's dword lane o is then four inputs of output o: one VPDPBUSD of the
// unsigned nibbles and a broadcast dword of four signed int8 activations adds their products to
// all 16 outputs at once (AVX2: VPMADDUBSW per 8 outputs, pairs added in int16 over four blocks,
// |sum| <= 4 * 2 * 2 * 15 * 127 = 30480, then VPMADDWD). The + 8 in every nibble adds
// 8 * (the group's activation sum), so each group's int32 accumulator starts at minus that.
// Integer sums are exact in any order, so both builds get the same int32 per (output, group);
// each output's floats are then one FMA chain over its groups in its own lane, times the row's
// activation scale: the same bits in the AVX2 and VNNI builds and for any split across threads.

constexpr int64_t TILE = 16;  // outputs per tile: one AVX-512 register of int32 lanes, two AVX2 ones
constexpr int64_t MAX_ROWS = 32;  // rows per call: draft_quant.FUSED_MAX_ROWS (tiles take MAXR at a time)
// Software prefetch into L2, bytes ahead in a thread's stream of tiles: one prefetch per 64-byte
// block read. Into L2 rather than L1 and 6 KB ahead was the fastest tried (T0 at 1-3 KB, T1 at
// 3-24 KB): ``scripts/draft_step.py`` one-row steps.
constexpr int64_t TILE_PF = 6144;

struct Tiled {
    torch::Tensor buf;  // uint8 [tiles * tile_bytes]
    const uint8_t* data = nullptr;
    int64_t out = 0, in = 0, groups = 0, tiles = 0, scale_bytes = 0, tile_bytes = 0;
};

// ``w`` repacked into tiles; slot j of the tiles holds w's row rows[j] (-1 or past the end: zeros).
// Scales are rounded to fp16 (``pack_int4`` makes them fp16 values, so this loses nothing).
Tiled tile_weight(const Weight& w, const std::vector<int64_t>& rows) {
    Tiled t;
    t.out = static_cast<int64_t>(rows.size()), t.in = w.in, t.groups = w.in / G;
    t.tiles = (t.out + TILE - 1) / TILE;
    t.scale_bytes = (t.groups * TILE * 2 + 63) / 64 * 64;
    t.tile_bytes = t.scale_bytes + t.groups * TILE * G / 2;
    t.buf = torch::zeros({t.tiles * t.tile_bytes}, torch::kUInt8);
    uint8_t* base = t.buf.data_ptr<uint8_t>();
    t.data = base;
    at::parallel_for(0, t.tiles, 16, [&](int64_t begin, int64_t end) {
        uint8_t nib[G];
        for (int64_t i = begin; i < end; ++i) {
            uint16_t* sc = reinterpret_cast<uint16_t*>(base + i * t.tile_bytes);
            uint8_t* q = base + i * t.tile_bytes + t.scale_bytes;
            for (int64_t o = 0; o < TILE; ++o) {
                const int64_t j = i * TILE + o, src = j < t.out ? rows[j] : -1;
                if (src < 0) continue;
                for (int64_t g = 0; g < t.groups; ++g) {
                    sc[g * TILE + o] = c10::Half(w.scales[src * t.groups + g]).x;
                    const uint8_t* p = w.packed + src * (w.in / 2) + g * (G / 2);
                    for (int64_t k = 0; k < G / 2; ++k) nib[k] = p[k] & 15, nib[k + G / 2] = p[k] >> 4;
                    for (int64_t b = 0; b < 8; ++b)
                        for (int64_t u = 0; u < 4; ++u)
                            q[(g * 8 + b) * 64 + o * 4 + u] = nib[8 * b + u] | (nib[8 * b + 4 + u] << 4);
                }
            }
        }
    });
    return t;
}

std::vector<int64_t> identity(int64_t n) {
    std::vector<int64_t> r(n);
    for (int64_t j = 0; j < n; ++j) r[j] = j;
    return r;
}

// gate|up [2 inter, in] in tiles of 8 gate rows then the same 8 up rows, so one tile gives 8
// outputs of the gated product silu(gate) * up.
std::vector<int64_t> gate_up_pairs(int64_t inter) {
    std::vector<int64_t> r(2 * inter);
    for (int64_t j = 0; j < 2 * inter; ++j) r[j] = j / 16 * 8 + j % 8 + (j % 16 >= 8 ? inter : 0);
    return r;
}

// One thread's int8 activations of n rows for a tiled matrix: values in [-127, 127] (row-major),
// one float scale per row (as ``quantize_rows``), and per group -8 times the values' sum.
struct Acts {
    std::vector<int8_t> q;
    std::vector<int32_t> base;
    std::vector<float> scale;
    int64_t n = 0, in = 0, groups = 0;

    // Vectorized: the largest |x| is exact in any order, and each value is x * inv rounded half
    // to even (VROUNDPS, as std::nearbyint) and summed in int32, so these are the bits a scalar
    // loop gives. Every thread sets its own copy of a matrix's input rows, so this runs once per
    // thread and matrix; a scalar loop took a tenth of an 8-row forward (perf, cpu-clock samples).
    void set(const float* x, int64_t rows, int64_t width) {
        n = rows, in = width, groups = width / G;
        q.resize(n * in), base.resize(n * groups), scale.resize(n);
        const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (int64_t r = 0; r < n; ++r) {
            const float* xr = x + r * in;
            __m256 m8 = _mm256_setzero_ps();
            for (int64_t k = 0; k < in; k += 8) m8 = _mm256_max_ps(m8, _mm256_and_ps(_mm256_loadu_ps(xr + k), magnitude));
            alignas(32) float lanes[8];
            _mm256_store_ps(lanes, m8);
            const float m = *std::max_element(lanes, lanes + 8);
            scale[r] = m > 0.f ? m / 127.f : 1.f;
            const __m256 inv = _mm256_set1_ps(1.f / scale[r]);
            for (int64_t g = 0; g < groups; ++g) {
                __m256i sum = _mm256_setzero_si256();
                for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
                    __m256i v[4];
                    for (int u = 0; u < 4; ++u) {
                        const __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xr + k + 8 * u), inv);
                        v[u] = _mm256_cvtps_epi32(_mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                        sum = _mm256_add_epi32(sum, v[u]);
                    }
                    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + r * in + k), _mm256_permutevar8x32_epi32(bytes, order));
                }
                alignas(32) int32_t s8[8];
                _mm256_store_si256(reinterpret_cast<__m256i*>(s8), sum);
                base[r * groups + g] = -8 * (((s8[0] + s8[1]) + (s8[2] + s8[3])) + ((s8[4] + s8[5]) + (s8[6] + s8[7])));
            }
        }
    }
    int32_t dword(int64_t r, int64_t k) const {  // activations k..k+3 of row r
        int32_t v;
        std::memcpy(&v, q.data() + r * in + k, 4);
        return v;
    }
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int MAXR = 8;  // rows per pass over a tile

// Outputs of one tile for rows r0 .. r0+R-1: y[r][o] (o < 16).
template <int R>
inline void tile_rows(const Tiled& w, const uint8_t* tile, const Acts& a, int64_t r0, float (*y)[TILE]) {
    constexpr int C = R <= 4 ? 2 : 1;  // int32 chains per row (a one-row tile needs two to hide latency)
    const uint16_t* sc = reinterpret_cast<const uint16_t*>(tile);
    const uint8_t* q = tile + w.scale_bytes;
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512 f[R];
    for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < w.groups; ++g) {
        __m512i acc[R][C];
        for (int r = 0; r < R; ++r) {
            acc[r][0] = _mm512_set1_epi32(a.base[(r0 + r) * a.groups + g]);
            if constexpr (C == 2) acc[r][1] = _mm512_setzero_si512();
        }
        const uint8_t* qg = q + g * 512;
        for (int b = 0; b < 8; ++b) {
            _mm_prefetch(reinterpret_cast<const char*>(qg + 64 * b + TILE_PF), _MM_HINT_T1);
            const __m512i v = _mm512_load_si512(qg + 64 * b);
            const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            for (int r = 0; r < R; ++r) {
                const int64_t k = g * G + 8 * b;
                acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], lo, _mm512_set1_epi32(a.dword(r0 + r, k)));
                acc[r][C - 1] = _mm512_dpbusd_epi32(acc[r][C - 1], hi, _mm512_set1_epi32(a.dword(r0 + r, k + 4)));
            }
        }
        const __m512 s = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(sc + g * TILE)));
        for (int r = 0; r < R; ++r) {
            const __m512i sum = C == 2 ? _mm512_add_epi32(acc[r][0], acc[r][C - 1]) : acc[r][0];
            f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), s, f[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y[r], _mm512_mul_ps(f[r], _mm512_set1_ps(a.scale[r0 + r])));
}
#else
// Every pass takes both halves of a tile's blocks (16 outputs, two registers) for up to 4 rows:
// each row's broadcast activations serve both halves, and a decode step's one or two rows stream
// each tile once, its loads going on while it computes. Against a pass per half, a draft forward
// of 3 / 8 / 32 rows took 0.73-0.76x / 0.82-0.83x / 0.86-0.92x the time, and one row 15-16 ms
// against 18-20 ms (docs/PERFORMANCE.md, "The draft"). In the inner loop 8 int16 sums, 4 decoded
// weight registers and a row's two broadcasts fill AVX2's 16 registers.
constexpr int MAXR = 4;

// Outputs of one tile for rows r0 .. r0+R-1: y[r][o] (o < 16), outputs 8c .. 8c + 7 in half c.
template <int R>
inline void tile_rows(const Tiled& w, const uint8_t* tile, const Acts& a, int64_t r0, float (*y)[TILE]) {
    constexpr int P = 2;  // halves
    const uint16_t* sc = reinterpret_cast<const uint16_t*>(tile);
    const uint8_t* q = tile + w.scale_bytes;
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 f[P][R];
    for (int c = 0; c < P; ++c)
        for (int r = 0; r < R; ++r) f[c][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < w.groups; ++g) {
        __m256i acc[P][R];
        for (int c = 0; c < P; ++c)
            for (int r = 0; r < R; ++r) acc[c][r] = _mm256_set1_epi32(a.base[(r0 + r) * a.groups + g]);
        for (int h = 0; h < 2; ++h) {  // four blocks at a time keep the int16 sums within +-30480
            __m256i s16[P][R];
            for (int c = 0; c < P; ++c)
                for (int r = 0; r < R; ++r) s16[c][r] = _mm256_setzero_si256();
            for (int b = 4 * h; b < 4 * h + 4; ++b) {
                const uint8_t* p = q + g * 512 + 64 * b;
                _mm_prefetch(reinterpret_cast<const char*>(p + TILE_PF), _MM_HINT_T1);
                __m256i lo[P], hi[P];
                for (int c = 0; c < P; ++c) {
                    const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 32 * c));
                    lo[c] = _mm256_and_si256(v, m4), hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                }
                const int64_t k = g * G + 8 * b;
                for (int r = 0; r < R; ++r) {
                    const __m256i xl = _mm256_set1_epi32(a.dword(r0 + r, k));
                    const __m256i xh = _mm256_set1_epi32(a.dword(r0 + r, k + 4));
                    for (int c = 0; c < P; ++c)
                        s16[c][r] = _mm256_add_epi16(s16[c][r], _mm256_add_epi16(_mm256_maddubs_epi16(lo[c], xl),
                                                                                  _mm256_maddubs_epi16(hi[c], xh)));
                }
            }
            for (int c = 0; c < P; ++c)
                for (int r = 0; r < R; ++r) acc[c][r] = _mm256_add_epi32(acc[c][r], _mm256_madd_epi16(s16[c][r], ones));
        }
        for (int c = 0; c < P; ++c) {
            const __m256 s = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(sc + g * TILE + 8 * c)));
            for (int r = 0; r < R; ++r) f[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[c][r]), s, f[c][r]);
        }
    }
    for (int c = 0; c < P; ++c)
        for (int r = 0; r < R; ++r)
            _mm256_storeu_ps(y[r] + 8 * c, _mm256_mul_ps(f[c][r], _mm256_set1_ps(a.scale[r0 + r])));
}
#endif

// rows (1..R) rows from r0 through the tile_rows instance of that many rows.
template <int R>
inline void rows_upto(int64_t rows, const Tiled& w, const uint8_t* tile, const Acts& a, int64_t r0, float (*y)[TILE]) {
    if constexpr (R > 1)
        if (rows < R) return rows_upto<R - 1>(rows, w, tile, a, r0, y);
    tile_rows<R>(w, tile, a, r0, y);
}

// Tile i of w for every row of a: y[r][o].
void tile_all_rows(const Tiled& w, int64_t i, const Acts& a, float (*y)[TILE]) {
    const uint8_t* tile = w.data + i * w.tile_bytes;
    for (int64_t r0 = 0; r0 < a.n; r0 += MAXR) rows_upto<MAXR>(std::min<int64_t>(MAXR, a.n - r0), w, tile, a, r0, y + r0);
}

// Tiles of w this thread owns (an even share), each handed to sink(i, y) with y[r][o] its outputs.
template <typename Sink>
void run_share(const Tiled& w, const Acts& a, int thread, int threads, Sink&& sink) {
    alignas(64) float y[MAX_ROWS][TILE];
    const int64_t begin = w.tiles * thread / threads, end = w.tiles * (thread + 1) / threads;
    for (int64_t i = begin; i < end; ++i) {
        tile_all_rows(w, i, a, y);
        sink(i, y);
    }
}

// ---- The float steps of a layer, row by row on lanes::V8: the same bits in both builds. -------

// y = w * (x * (1 / sqrt(mean(x^2) + eps))) for n rows of d (a multiple of 8) values.
void rms_rows(const float* x, const float* w, int64_t n, int64_t d, float eps, float* y) {
    using namespace lanes;
    for (int64_t r = 0; r < n; ++r) {
        const float* xr = x + r * d;
        V8 ss = splat(0.f);
        for (int64_t k = 0; k < d; k += 8) {
            const V8 v = load(xr + k);
            ss = fma(v, v, ss);
        }
        const V8 inv = splat(1.f / std::sqrt(reduce8(ss) / static_cast<float>(d) + eps));
        for (int64_t k = 0; k < d; k += 8) store(y + r * d + k, mul(load(w + k), mul(load(xr + k), inv)));
    }
}

// silu(g) * u, with sigmoid(g) from e = exp(-|g|), which never overflows.
inline lanes::V8 glu8(lanes::V8 g, lanes::V8 u) {
    using namespace lanes;
    const V8 e = exp8(neg_abs(g)), one = splat(1.f);
    return mul(mul(g, select_nonneg(g, div(one, add(one, e)), div(e, add(one, e)))), u);
}

struct Layer {
    const float* in_norm;
    const float* post_norm;
    const float* qkv_bias;  // or nullptr
    Tiled qkv, o, gate_up, down;
};

}  // namespace

// x [n, in] float32 -> y [n, out]; packed [out, in/2] uint8, scales [out, in/64], offset [out].
torch::Tensor linear_int4(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          const torch::Tensor& offset) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be [n, in] float32");
    TORCH_CHECK(packed.scalar_type() == torch::kUInt8, "bad packed weight");
    const Weight w(packed, scales, offset);
    TORCH_CHECK(x.size(1) == w.in, "x has ", x.size(1), " inputs, the weight ", w.in);
    const int64_t n = x.size(0);
    auto xq = torch::empty({n, w.in}, x.options().dtype(torch::kUInt8));
    auto xs = torch::empty({n}, x.options());
    auto y = torch::empty({n, w.out}, x.options());
    w.apply(x.data_ptr<float>(), n, y.data_ptr<float>(), xq.data_ptr<uint8_t>(), xs.data_ptr<float>());
    return y;
}

// The tiled kernel on one matrix: x [n <= 8, in] @ w.T through ``Int4Draft``'s layout (for tests).
torch::Tensor linear_int4_tiled(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                                const torch::Tensor& offset) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be [n, in] float32");
    TORCH_CHECK(packed.scalar_type() == torch::kUInt8, "bad packed weight");
    const Weight w(packed, scales, offset);
    TORCH_CHECK(x.size(1) == w.in && x.size(0) >= 1 && x.size(0) <= MAX_ROWS, "x must be [1..", MAX_ROWS, ", in]");
    const Tiled t = tile_weight(w, identity(w.out));
    Acts a;
    a.set(x.data_ptr<float>(), x.size(0), w.in);
    auto y = torch::empty({x.size(0), w.out}, x.options());
    float* yp = y.data_ptr<float>();
    run_share(t, a, 0, 1, [&](int64_t i, float (*v)[TILE]) {
        for (int64_t r = 0; r < a.n; ++r)
            for (int64_t o = 0; o < TILE && i * TILE + o < w.out; ++o) yp[r * w.out + i * TILE + o] = v[r][o];
    });
    return y;
}

// A whole int4 draft decoder forward for a few decode rows in one call.
//
// Why: through torch, a one-row draft forward spends most of its time outside the int4 linear
// layers, in the dispatch of some 40 small ops per layer, each a few microseconds for a single
// row. Here a layer is plain loops over the same weights (repacked into tiles when built: a copy
// of the int4 bytes) and cache, in one OpenMP team for the whole forward: each thread computes an
// even share of every matrix's tiles, and the threads meet at one barrier per step that needs
// another thread's outputs (five per layer). Each thread quantizes a matrix's input rows itself,
// so no barrier waits for that. ``python scripts/draft_step.py --quantize int4`` times this
// forward against the torch layers and a target step (docs/PERFORMANCE.md, "The draft").
// Numerics follow ``Decoder`` in float32 (rms_norm, rotate-half RoPE, causal softmax attention
// with grouped kv heads, SiLU-gated MLP); only the draft uses this, so its rounding is free; a
// row's bits depend neither on the build (AVX2 or VNNI) nor on the number of threads.
class Int4Draft {
  public:
    // layers[i]: in_norm, post_norm, qkv_bias (empty if none), then packed, scales, offset of
    // qkv, o, gate_up and down (row-major, as ``Int4Groups``); lm_head likewise, with any number of
    // rows (a vocabulary subset gives logits of its rows). cos/sin: [positions, head_dim].
    Int4Draft(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, torch::Tensor embed,
              torch::Tensor cos, torch::Tensor sin, torch::Tensor norm, std::vector<torch::Tensor> lm_head,
              std::vector<std::vector<torch::Tensor>> layers)
        : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(static_cast<float>(eps)),
          embed_(embed.contiguous()), cos_(cos.contiguous()), sin_(sin.contiguous()), norm_(norm.contiguous()) {
        TORCH_CHECK(lm_head.size() == 3, "lm_head: packed, scales, offset");
        hidden_ = norm_.size(0);
        TORCH_CHECK(!embed_.numel() || embed_.size(1) == hidden_, "embed must be [V, hidden] or empty");
        TORCH_CHECK(head_dim % 8 == 0 && heads % kv_heads == 0, "head_dim must be a multiple of 8");
        const Weight lm(lm_head[0], lm_head[1], lm_head[2]);
        TORCH_CHECK(lm.in == hidden_, "bad lm_head");
        lm_head_ = tile_weight(lm, identity(lm.out));
        for (auto& l : layers) {
            TORCH_CHECK(l.size() == 15, "each layer needs 15 tensors");
            for (int i = 0; i < 3; ++i) keep_.push_back(l[i].contiguous());
            Layer layer;
            layer.in_norm = keep_[keep_.size() - 3].data_ptr<float>();
            layer.post_norm = keep_[keep_.size() - 2].data_ptr<float>();
            layer.qkv_bias = l[2].numel() ? keep_.back().data_ptr<float>() : nullptr;
            const Weight qkv(l[3], l[4], l[5]), o(l[6], l[7], l[8]), gate_up(l[9], l[10], l[11]), down(l[12], l[13], l[14]);
            TORCH_CHECK(qkv.in == hidden_ && qkv.out == (heads + 2 * kv_heads) * head_dim, "bad qkv");
            TORCH_CHECK(o.in == heads * head_dim && o.out == hidden_, "bad o");
            TORCH_CHECK(down.in * 2 == gate_up.out && gate_up.in == hidden_ && down.out == hidden_, "bad mlp");
            layer.qkv = tile_weight(qkv, identity(qkv.out));
            layer.o = tile_weight(o, identity(o.out));
            layer.gate_up = tile_weight(gate_up, gate_up_pairs(down.in));
            layer.down = tile_weight(down, identity(down.out));
            layers_.push_back(std::move(layer));
        }
    }

    // tokens [n] int64 (or their embeddings [n, hidden] float32, for a model built with an empty
    // embed) at cache slots start..start+n-1 of k/v [layers, kv_heads, capacity, head_dim];
    // returns logits [n, V], or [1, V] for the last row with last_only.
    // ``head`` false: no logits (an empty [0, V]), for the chunks of a long input before its last.
    torch::Tensor forward(const torch::Tensor& tokens, torch::Tensor k_cache, torch::Tensor v_cache, int64_t start,
                          bool last_only, bool head) {
        const int64_t n = tokens.dim() >= 1 ? tokens.size(0) : 0;
        std::vector<int64_t> heads;
        if (head) heads = segments::head_rows({n}, last_only);
        return run_segments(tokens, {k_cache}, {v_cache}, {start}, {n}, heads);
    }

    // Several sequences' rows in one forward (the draft steps of a batch of requests): tokens as in
    // ``forward``, segment i's counts[i] rows at slots starts[i].. of its own cache k_caches[i] /
    // v_caches[i]; at most MAX_ROWS rows in all. Logits of every row, or with ``last_only`` of each
    // segment's last, in order. The weights stream once for all the rows, which is what a draft
    // step costs: two requests' steps in one call cost about one.
    torch::Tensor forward_batch(const torch::Tensor& tokens, const std::vector<torch::Tensor>& k_caches,
                                const std::vector<torch::Tensor>& v_caches, const std::vector<int64_t>& starts,
                                const std::vector<int64_t>& counts, bool last_only) {
        return run_segments(tokens, k_caches, v_caches, starts, counts, segments::head_rows(counts, last_only));
    }

  private:
    struct State {  // one forward's buffers, shared by its threads
        int64_t n = 0;
        std::vector<segments::Segment> segments;
        std::vector<int64_t> heads;  // the rows whose logits are asked for
        std::vector<float> x, qkv, attn, act;
    };

    torch::Tensor run_segments(const torch::Tensor& tokens, const std::vector<torch::Tensor>& k_caches,
                               const std::vector<torch::Tensor>& v_caches, const std::vector<int64_t>& starts,
                               const std::vector<int64_t>& counts, const std::vector<int64_t>& heads) {
        const bool embedded = tokens.scalar_type() == torch::kFloat32;
        const int64_t n = tokens.dim() >= 1 ? tokens.size(0) : 0, D = hidden_;
        TORCH_CHECK(embedded ? tokens.dim() == 2 && tokens.size(1) == D && n > 0
                             : tokens.scalar_type() == torch::kInt64 && tokens.dim() == 1 && n > 0 && embed_.numel(),
                    "tokens must be [n > 0] int64, or [n > 0, hidden] float32 embeddings");
        TORCH_CHECK(n <= MAX_ROWS, "at most ", MAX_ROWS, " rows");
        State s;
        s.n = n, s.heads = heads;
        s.segments = segments::make(k_caches, v_caches, starts, counts, n, static_cast<int64_t>(layers_.size()), kv_heads_,
                                    head_dim_, cos_.size(0));
        const torch::Tensor ids = tokens.contiguous();
        s.x.resize(n * D);
        if (embedded) {
            std::copy_n(ids.data_ptr<float>(), n * D, s.x.data());
        } else {
            const int64_t* tok = ids.data_ptr<int64_t>();
            for (int64_t r = 0; r < n; ++r) {
                TORCH_CHECK(tok[r] >= 0 && tok[r] < embed_.size(0), "token id out of range");
                std::copy_n(embed_.data_ptr<float>() + tok[r] * D, D, s.x.data() + r * D);
            }
        }
        auto logits = torch::empty({static_cast<int64_t>(heads.size()), lm_head_.out}, norm_.options());
        const int64_t inter = layers_.empty() ? 0 : layers_[0].down.in;
        s.qkv.resize(n * (heads_ + 2 * kv_heads_) * head_dim_), s.attn.resize(n * heads_ * head_dim_), s.act.resize(n * inter);
        const int threads = at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(threads)
        run(s, omp_get_thread_num(), omp_get_num_threads(), logits.data_ptr<float>());
        return logits;
    }

    // One thread's part of the forward; every thread of the team runs it.
    void run(State& s, int t, int T, float* logits) const {
        const int64_t n = s.n, D = hidden_, d = head_dim_, hq = heads_, hkv = kv_heads_;
        const int64_t width = (hq + 2 * hkv) * d, inter = layers_.empty() ? 0 : layers_[0].down.in;
        const float scale = 1.f / std::sqrt(static_cast<float>(d));
        const int64_t m = static_cast<int64_t>(s.heads.size()), V = lm_head_.out;
        Acts a;
        std::vector<float> h(n * D), scores;  // attention's scratch, sized by row_group
        // Rows the layer's o projection and MLP run for: all of them, except in the last layer,
        // where only the rows whose logits are asked for (``s.heads``, moved to rows 0 .. m - 1)
        // go on; the others' keys and values, written by its attention, are all later calls read.
        // A prefill chunk without logits skips most of that layer's weights (a 24-layer draft's
        // catch-up: 1/24 of its work), and rows are independent, so no kept row's bits change.
        int64_t live = n;
        auto add_to_x = [&](int64_t i, float (*y)[TILE]) {
            for (int64_t r = 0; r < live; ++r)
                for (int64_t o = 0; o < TILE; ++o) s.x[r * D + i * TILE + o] += y[r][o];
        };
        const int64_t tasks = static_cast<int64_t>(s.segments.size()) * hkv;  // (segment, kv head)
        for (size_t li = 0; li < layers_.size(); ++li) {
            const Layer& L = layers_[li];
            const bool last = li + 1 == layers_.size();
            rms_rows(s.x.data(), L.in_norm, n, D, eps_, h.data());
            a.set(h.data(), n, D);
            run_share(L.qkv, a, t, T, [&](int64_t i, float (*y)[TILE]) {
                const int64_t cols = std::min(TILE, width - i * TILE);
                for (int64_t r = 0; r < n; ++r) std::copy_n(y[r], cols, s.qkv.data() + r * width + i * TILE);
            });
#pragma omp barrier
            for (int64_t task = tasks * t / T; task < tasks * (t + 1) / T; ++task) {  // this thread's
                const segments::Segment& seg = s.segments[task / hkv];
                const int64_t g = task % hkv, slot0 = (li * hkv + g) * seg.capacity;
                attention::rope_write_attend(s.qkv.data() + seg.row0 * width, width, seg.n, seg.start, g, hq, hkv, d,
                                             L.qkv_bias, cos_.data_ptr<float>(), sin_.data_ptr<float>(), seg.k + slot0 * d,
                                             seg.v + slot0 * d, scale, s.attn.data() + seg.row0 * hq * d, scores);
            }
#pragma omp barrier
            if (last && m < n) {
                live = m;
                if (m == 0) return;
                if (t == 0)  // heads ascend, so row heads[i] >= i moves down without overwriting a later one
                    for (int64_t i = 0; i < m; ++i) {
                        if (s.heads[i] == i) continue;
                        std::copy_n(s.attn.data() + s.heads[i] * hq * d, hq * d, s.attn.data() + i * hq * d);
                        std::copy_n(s.x.data() + s.heads[i] * D, D, s.x.data() + i * D);
                    }
#pragma omp barrier
            }
            a.set(s.attn.data(), live, hq * d);
            run_share(L.o, a, t, T, add_to_x);
#pragma omp barrier
            rms_rows(s.x.data(), L.post_norm, live, D, eps_, h.data());
            a.set(h.data(), live, D);
            run_share(L.gate_up, a, t, T, [&](int64_t i, float (*y)[TILE]) {
                for (int64_t r = 0; r < live; ++r)
                    lanes::store(s.act.data() + r * inter + i * 8, glu8(lanes::load(y[r]), lanes::load(y[r] + 8)));
            });
#pragma omp barrier
            a.set(s.act.data(), live, inter);
            run_share(L.down, a, t, T, add_to_x);
#pragma omp barrier
        }
        if (m == 0) return;
        const bool moved = live < n;  // the heads are rows 0 .. m - 1 now
        for (int64_t i = 0; i < m; ++i)
            rms_rows(s.x.data() + (moved ? i : s.heads[i]) * D, norm_.data_ptr<float>(), 1, D, eps_, h.data() + i * D);
        a.set(h.data(), m, D);
        run_share(lm_head_, a, t, T, [&](int64_t i, float (*y)[TILE]) {
            for (int64_t r = 0; r < m; ++r)
                for (int64_t o = 0; o < TILE && i * TILE + o < V; ++o) logits[r * V + i * TILE + o] = y[r][o];
        });
    }

    int64_t heads_, kv_heads_, head_dim_, hidden_;
    float eps_;
    torch::Tensor embed_, cos_, sin_, norm_;
    Tiled lm_head_;
    std::vector<Layer> layers_;
    std::vector<torch::Tensor> keep_;  // norms and biases the layers point into
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("lanes", [] { return LANES; },
          "float lanes per accumulator of linear_int4: 16 in the AVX-512 VNNI build, 8 in the AVX2 build");
    m.def("linear_int4", &linear_int4, "int4-weight, int8-activation x @ w.T for draft decode rows (AVX2 or AVX-512 VNNI)");
    m.def("linear_int4_tiled", &linear_int4_tiled, "linear_int4 through Int4Draft's tiled layout (1..8 rows)");
    pybind11::class_<Int4Draft>(m, "Int4Draft")
        .def(pybind11::init<int64_t, int64_t, int64_t, double, torch::Tensor, torch::Tensor, torch::Tensor,
                            torch::Tensor, std::vector<torch::Tensor>, std::vector<std::vector<torch::Tensor>>>())
        .def("forward", &Int4Draft::forward, "logits of a few decode rows, writing their keys and values",
             pybind11::arg("tokens"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("start"),
             pybind11::arg("last_only"), pybind11::arg("head") = true)
        .def("forward_batch", &Int4Draft::forward_batch, "logits of several sequences' rows in one forward",
             pybind11::arg("tokens"), pybind11::arg("k_caches"), pybind11::arg("v_caches"), pybind11::arg("starts"),
             pybind11::arg("counts"), pybind11::arg("last_only"));
}
