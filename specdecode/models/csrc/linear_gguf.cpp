// GGUF-quantized linear layers run as shipped: y[n, out] = x[n, in] . W[out, in]^T with W in its
// GGUF block format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), never dequantized.
//
// Why by hand: llama.cpp's vector dot products take one activation row per weight pass, and torch has no
// k-quant matmul at all. Speculative decoding verifies K+1 rows at once, so here each weight
// block is read and decoded once per call and applied to every row: the weights stream from
// memory once however many rows there are, and each row adds only its multiplies (for a k-quant
// super-block of 256 products: 8 VPDPBUSD and 1 or 2 VPMULLD on VNNI, 8 VPMADDUBSW and 1, 2 or 4
// VPMADDWD on AVX2; docs/GGUF_NATIVE.md measures them).
//
// Exactness: activations are quantized per row (int8, one float scale per block: 256 inputs for
// the k-quants like llama.cpp's Q8_K, 32 for the others like its Q8_0), so a row's integers never
// depend on other rows. Within a block every product is summed in int32, which is exact in any
// order. Floats enter once per block, in a fixed sequence per (row, output): an 8-lane FMA chain
// over the blocks, reduced by ``reduce8``'s fixed tree, whose lane k holds a fixed set of the
// block's integer products: for a 32-block its bytes 4k..4k+3; for a k-quant super-block two
// 16-value groups times their scales (see the portable build); plus one float FMA chain for the
// mins (Q4_1, Q5_1, Q4_K, Q5_K), added after the tree. So a row gets the same bits alone
// and among any rows at any position, and the three builds give the same bits as each other:
// portable (plain C++, for CPUs without AVX2), AVX2, and VNNI (VPDPBUSD where AVX2 takes
// VPMADDUBSW and VPMADDWD, from AVX-512 VNNI or AVX-VNNI).
//
// Weight planes (made losslessly from the GGUF blocks by ``gguf_planes.py``), row-major per output:
//   Q4_K: q [nb*128] nibbles as in GGUF, sc [nb*8], mn [nb*8] (one per 32 inputs), d, dm [nb] float
//   Q5_K: as Q4_K plus qh [nb*32];  Q6_K: q = ql [nb*128], qh [nb*64], sc [nb*16] int8, d [nb]
//   Q4_0/Q4_1: q [nb*16], d [nb] (dm [nb]: Q4_1's min);  Q5_0/Q5_1: as those plus qh [nb*4]
//   Q8_0: q [nb*32] int8, d [nb].  (nb: blocks per row of 256 or 32 inputs.)
#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <new>
#include <vector>

#include "attention.h"
#include "lanes.h"
#include "segments.h"

namespace {

constexpr int64_t COLS = 16;  // outputs per block (see rows_of)

enum Type : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

bool is_k(int t) { return t == Q4_K || t == Q5_K || t == Q6_K; }
int64_t block_of(int t) { return is_k(t) ? 256 : 32; }

struct Part {
    int type = 0;
    int64_t out = 0, in = 0, nb = 0;
    const uint8_t *q = nullptr, *qh = nullptr, *sc = nullptr, *mn = nullptr;
    const float *d = nullptr, *dm = nullptr;
};

// Value index (0..255) of byte p of the activations as the registers of a Q4_K / Q5_K super-block
// (``q4``) or a Q6_K one hold them: register p / 32, dword lane k = p % 32 / 4, byte t = p % 4.
//   Q4_K / Q5_K register 2j + h (j < 4, h < 2): 64 (k >> 1) + 32 (k & 1) + 8j + 4 ((k & 1) ^ h) + t,
//     lane k in sub-block k;
//   Q6_K register 4G + i (G < 2, i < 4): 128G + 32 (k & 3) + 16 (k >> 2) + 4i + t,
//     lane k in group 8G + 2 (k & 3) + (k >> 2).
inline int kperm(bool q4, int p) {
    const int reg = p / 32, k = p % 32 / 4, t = p % 4;
    if (q4) {
        const int j = reg / 2, h = reg % 2;
        return 64 * (k >> 1) + 32 * (k & 1) + 8 * j + 4 * ((k & 1) ^ h) + t;
    }
    const int G = reg / 4, i = reg % 4;
    return 128 * G + 32 * (k & 3) + 16 * (k >> 2) + 4 * i + t;
}

// Storage aligned to a cache line, for the activations: a tile's 32-byte loads of them then never
// straddle two lines, as half of them do when glibc's malloc (16-byte aligned) hands back a buffer
// 16 bytes off. Which a call got depended on the allocator's history, so a verify's cost varied
// with it (docs/GGUF_NATIVE.md, "Verify rows").
template <class T>
struct Aligned64 {
    using value_type = T;
    Aligned64() = default;
    template <class U>
    Aligned64(const Aligned64<U>&) {}
    T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
    void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
    template <class U>
    bool operator==(const Aligned64<U>&) const { return true; }
};

// Quantized activations of n rows in blocks of ``block`` inputs: int8 values in [-127, 127], one
// float scale per block, and integer sums per 16 inputs (k-quants) or per block (32-blocks). The
// SIMD builds also keep the 256-blocks block-major, so that one block of consecutive rows is
// contiguous and a tile reads row r at a fixed offset (made when a call has such a type and two
// rows or more, since one-row tiles read the natural order): ``kq[o]`` [nb][n][256] in ``kperm``
// order o (0: Q4_K / Q5_K, 1: Q6_K); ``kd`` [nb][n] (+ 8 zeros: a tile reads 8 rows at a time);
// for Q6_K ``kbs`` [nb][n][16], the sums per 16 as lane k of the lanes by group holds them, the
// pair (group g, group g + 8) with g = 2 (k & 3) + (k >> 2); for Q4_K / Q5_K ``kbt``
// [nb][4][ns][2], the sums per 32 (sub-block 2p and 2p + 1 at [b][p][row]), so that one load
// gives 8 rows' pairs (ns = n + 8).
struct Acts {
    int64_t n = 0, in = 0, block = 0, nb = 0, sums = 0, ns = 0;
    std::vector<int8_t, Aligned64<int8_t>> q, kq[2];
    std::vector<float> d, kd;
    std::vector<int16_t> bs, kbs, kbt;
    const int8_t* row(int64_t r) const { return q.data() + r * in; }
};

// One block of a row to int8: amax, the values times 127 / amax rounded to nearest even and
// clamped to [-127, 127]; returns amax. The AVX2 form gives the same bytes (max is exact in any
// order and skips NaN like std::max; the multiply, rounding and clamp are the same per value).
float quantize_block(const float* xb, int64_t block, int8_t* qb) {
#if defined(__AVX2__)
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mx = _mm256_setzero_ps();
    for (int64_t k = 0; k < block; k += 8) mx = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xb + k), abs_mask), mx);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
    const auto ints = [&](int64_t k) {
        const __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + k), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
    };
    for (int64_t k = 0; k < block; k += 32) {
        const __m256i a = _mm256_packs_epi32(ints(k), ints(k + 8)), b = _mm256_packs_epi32(ints(k + 16), ints(k + 24));
        const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + k), bytes);
    }
    return amax;
#else
    float amax = 0.f;
    for (int64_t k = 0; k < block; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int64_t k = 0; k < block; ++k)
        qb[k] = static_cast<int8_t>(std::clamp(std::nearbyint(xb[k] * inv), -127.f, 127.f));
    return amax;
#endif
}

// The integer sums of a quantized block: per 16 values (256-blocks) or of all 32 (32-blocks).
void block_sums(const int8_t* qb, int64_t block, int16_t* bs) {
#if defined(__AVX2__)
    for (int64_t k = 0; k < block; k += 32) {  // dword lanes: sums of 4 bytes; then of 16 per half
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + k));
        __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
        s = _mm256_hadd_epi32(s, s);
        s = _mm256_hadd_epi32(s, s);
        const int lo = _mm256_extract_epi32(s, 0), hi = _mm256_extract_epi32(s, 4);
        if (block == 256)
            bs[k / 16] = static_cast<int16_t>(lo), bs[k / 16 + 1] = static_cast<int16_t>(hi);
        else
            bs[0] = static_cast<int16_t>(lo + hi);
    }
#else
    const int64_t sums = block == 256 ? 16 : 1, per = block / sums;
    for (int64_t s = 0; s < sums; ++s) {
        int sum = 0;
        for (int64_t k = 0; k < per; ++k) sum += qb[s * per + k];
        bs[s] = static_cast<int16_t>(sum);
    }
#endif
}

// Sizes ``a`` for n rows of ``in`` inputs in blocks of ``block``, zeroed (a tile reads the padding
// rows of ``kd`` and ``kbt``); ``orders`` says which ``kperm`` orders the weights need.
void init_acts(Acts& a, int64_t n, int64_t in, int64_t block, const bool (&orders)[2]) {
    a = Acts{};
    a.n = n, a.in = in, a.block = block, a.nb = in / block, a.sums = block == 256 ? 16 : 1;
    a.q.resize(n * in), a.d.resize(n * a.nb), a.bs.resize(n * a.nb * a.sums);
    const bool major = n > 1 && (orders[0] || orders[1]);  // one-row tiles read the natural order
    for (int o = 0; o < 2; ++o)
        if (major && orders[o]) a.kq[o].resize(n * in);
    a.ns = n + 8;
    if (major) a.kd.resize(n * a.nb + 8);
    if (major && orders[0]) a.kbt.resize(a.nb * 4 * a.ns * 2);
    if (major && orders[1]) a.kbs.resize(n * a.nb * 16);
}

// Blocks i in [begin, end) of x [n, in] (row i / nb, block i % nb) into ``a``, sized by ``init_acts``.
// Each block is written alone, so any partition of 0 .. n * nb among threads gives the same ``a``.
void quantize_blocks(Acts& a, const float* x, int64_t begin, int64_t end) {
    static const auto tables = [] {  // kperm moves whole dwords: dword p / 4 takes dword kperm(p) / 4
        std::array<std::array<uint8_t, 64>, 2> t{};
        for (int p = 0; p < 64; ++p) t[0][p] = kperm(true, 4 * p) / 4, t[1][p] = kperm(false, 4 * p) / 4;
        return t;
    }();
    const int64_t n = a.n, block = a.block;
    const bool major = !a.kd.empty();
    for (int64_t i = begin; i < end; ++i) {
        const float* xb = x + i * block;
        int8_t* qb = a.q.data() + i * block;
        const float amax = quantize_block(xb, block, qb);
        a.d[i] = amax / 127.f;
        block_sums(qb, block, a.bs.data() + i * a.sums);
        if (!major) continue;
        const int64_t m = (i % a.nb) * n + i / a.nb;  // block-major index of (row, block)
        a.kd[m] = a.d[i];
        const int16_t* bs = a.bs.data() + i * 16;
        if (!a.kbs.empty())
            for (int k = 0; k < 8; ++k)
                a.kbs[m * 16 + 2 * k] = bs[2 * (k & 3) + (k >> 2)], a.kbs[m * 16 + 2 * k + 1] = bs[2 * (k & 3) + (k >> 2) + 8];
        if (!a.kbt.empty())
            for (int s = 0; s < 8; ++s)  // sub-block s = 2p + (s & 1)
                a.kbt[(((i % a.nb) * 4 + s / 2) * a.ns + i / a.nb) * 2 + (s & 1)] = static_cast<int16_t>(bs[2 * s] + bs[2 * s + 1]);
        for (int o = 0; o < 2; ++o)
            if (!a.kq[o].empty())
                for (int p = 0; p < 64; ++p) std::memcpy(a.kq[o].data() + m * 256 + 4 * p, qb + 4 * tables[o][p], 4);
    }
}

Acts quantize(const float* x, int64_t n, int64_t in, int64_t block, const bool (&orders)[2] = {false, false}) {
    Acts a;
    init_acts(a, n, in, block, orders);
    at::parallel_for(0, n * a.nb, 64, [&](int64_t begin, int64_t end) { quantize_blocks(a, x, begin, end); });
    return a;
}

inline float reduce8(const float* f) { return ((f[0] + f[4]) + (f[2] + f[6])) + ((f[1] + f[5]) + (f[3] + f[7])); }

// ---- Decoding, shared by the portable build and ``dequantize_rows``. -------------------------

// A k-quant super-block as 256 unsigned values with one scale and one min term per 16 values:
// value . x summed per 16 times sc16, minus mn16 times the activations' sum per 16 (Q6_K: value - 32
// is folded into mn16 = 32 * scale).
void decode_k(const Part& w, int64_t j, int64_t b, uint8_t* v, int16_t* sc16, int16_t* mn16) {
    const int64_t i = j * w.nb + b;
    if (w.type == Q6_K) {
        const uint8_t* ql = w.q + i * 128;
        const uint8_t* qh = w.qh + i * 64;
        for (int h = 0; h < 2; ++h)
            for (int l = 0; l < 32; ++l) {
                const uint8_t lo0 = ql[64 * h + l], lo1 = ql[64 * h + 32 + l], hb = qh[32 * h + l];
                v[128 * h + l] = (lo0 & 15) | ((hb & 3) << 4);
                v[128 * h + 32 + l] = (lo1 & 15) | (((hb >> 2) & 3) << 4);
                v[128 * h + 64 + l] = (lo0 >> 4) | (((hb >> 4) & 3) << 4);
                v[128 * h + 96 + l] = (lo1 >> 4) | (((hb >> 6) & 3) << 4);
            }
        for (int g = 0; g < 16; ++g) sc16[g] = static_cast<int8_t>(w.sc[i * 16 + g]), mn16[g] = 32 * sc16[g];
        return;
    }
    const uint8_t* qs = w.q + i * 128;
    for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
            uint8_t lo = qs[32 * c + l] & 15, hi = qs[32 * c + l] >> 4;
            if (w.type == Q5_K) {
                const uint8_t hb = w.qh[i * 32 + l];
                lo |= ((hb >> (2 * c)) & 1) << 4, hi |= ((hb >> (2 * c + 1)) & 1) << 4;
            }
            v[64 * c + l] = lo, v[64 * c + 32 + l] = hi;
        }
    for (int g = 0; g < 16; ++g) sc16[g] = w.sc[i * 8 + g / 2], mn16[g] = w.mn[i * 8 + g / 2];
}

// A 32-block as signed values (Q4_1 / Q5_1: unsigned values; their min is the dm plane).
void decode_32(const Part& w, int64_t j, int64_t b, int8_t* v) {
    const int64_t i = j * w.nb + b;
    if (w.type == Q8_0) {
        std::memcpy(v, w.q + i * 32, 32);
        return;
    }
    const uint8_t* qs = w.q + i * 16;
    uint32_t hbits = 0;
    if (w.type == Q5_0 || w.type == Q5_1) std::memcpy(&hbits, w.qh + i * 4, 4);
    const int off = w.type == Q4_0 ? 8 : w.type == Q5_0 ? 16 : 0;
    for (int l = 0; l < 16; ++l) {
        v[l] = static_cast<int8_t>((qs[l] & 15) + (((hbits >> l) & 1) << 4) - off);
        v[l + 16] = static_cast<int8_t>((qs[l] >> 4) + (((hbits >> (l + 16)) & 1) << 4) - off);
    }
}

// ---- Portable build: the SIMD builds' arithmetic, lane by lane. ------------------------------
// A k-quant super-block gives 8 int32 lanes, each the sum of two 16-value groups' products times
// their scales: Q4_K / Q5_K lane k holds groups 2k and 2k+1 (sub-block k, one scale), Q6_K lane k
// groups g and g + 8 with g = 2 (k & 3) + (k >> 2), less 32 times those groups' scales times their
// activation sums (Q6_K's values are unsigned minus 32). Every lane is converted to float once per
// super-block and accumulated by one FMA with dw * xd (the weight's and the row's scales); the
// mins of Q4_K / Q5_K are one integer per super-block (each sub-block's min times its activation
// sum) and one FMA with dm * xd into a float of their own, subtracted after the lanes' tree. A
// 32-block's lane k holds bytes 4k..4k+3. Every build has the same lanes and FMA sequences.

// The first of the two 16-value groups lane k of a k-quant super-block holds (the other: + 1 for
// Q4_K / Q5_K, + 8 for Q6_K).
inline int k_group(int type, int k) { return type == Q6_K ? 2 * (k & 3) + (k >> 2) : 2 * k; }
inline int k_group_step(int type) { return type == Q6_K ? 8 : 1; }

void rows_k_portable(const Part& w, const Acts& a, int64_t j, int64_t r0, int64_t rows, float* f, float* macc) {
    uint8_t v[256];
    int16_t sc16[16], mn16[16];
    for (int64_t b = 0; b < w.nb; ++b) {
        decode_k(w, j, b, v, sc16, mn16);
        const float dw = w.d[j * w.nb + b], dm = w.type == Q6_K ? dw : w.dm[j * w.nb + b];
        for (int64_t r = r0; r < r0 + rows; ++r) {
            const int8_t* x = a.row(r) + b * 256;
            const int16_t* bs = a.bs.data() + (r * a.nb + b) * 16;
            const float xd = a.d[r * a.nb + b];
            float* fr = f + (r - r0) * 8;
            int32_t s16[16];
            for (int g = 0; g < 16; ++g) {
                s16[g] = 0;
                for (int e = 16 * g; e < 16 * g + 16; ++e) s16[g] += int32_t(v[e]) * x[e];
            }
            const float dx = dw * xd;
            for (int k = 0; k < 8; ++k) {
                const int g = k_group(w.type, k), h = g + k_group_step(w.type);
                int32_t lane = sc16[g] * s16[g] + sc16[h] * s16[h];
                if (w.type == Q6_K) lane -= mn16[g] * bs[g] + mn16[h] * bs[h];  // the values' offset of 32
                fr[k] = std::fma(static_cast<float>(lane), dx, fr[k]);
            }
            if (w.type != Q6_K) {  // the mins: one integer per super-block, one float step per row
                int32_t mins = 0;
                for (int g = 0; g < 16; ++g) mins += mn16[g] * bs[g];
                macc[r - r0] = std::fma(-static_cast<float>(mins), dm * xd, macc[r - r0]);
            }
        }
    }
}

void rows_32_portable(const Part& w, const Acts& a, int64_t j, int64_t r0, int64_t rows, float* f, float* macc) {
    int8_t v[32];
    for (int64_t b = 0; b < w.nb; ++b) {
        decode_32(w, j, b, v);
        const float dw = w.d[j * w.nb + b];
        for (int64_t r = r0; r < r0 + rows; ++r) {
            const int8_t* x = a.row(r) + b * 32;
            const float xd = a.d[r * a.nb + b];
            float* fr = f + (r - r0) * 8;
            for (int k = 0; k < 8; ++k) {
                int32_t s = 0;
                for (int e = 4 * k; e < 4 * k + 4; ++e) s += int32_t(v[e]) * x[e];
                fr[k] = std::fma(static_cast<float>(s), dw * xd, fr[k]);
            }
            if (w.dm) macc[r - r0] = std::fma(w.dm[j * w.nb + b] * xd, static_cast<float>(a.bs[r * a.nb + b]), macc[r - r0]);
        }
    }
}

#if defined(__AVX2__)
// ---- AVX2 and VNNI builds: each block decoded into registers once, then applied to a tile of rows.

#ifndef GGUF_RT
#define GGUF_RT 8
#endif
constexpr int RT = GGUF_RT;  // rows per tile; build with -DGGUF_RT=N to compare (8 was fastest of 4-16)
// The last tile takes up to TMAX rows, so that a call of up to TMAX rows (a verify step) decodes
// each block once and no call ends in a small tile that decodes the weights again for a row or two.
constexpr int TMAX = 2 * RT - 1;
#ifndef GGUF_PF
#define GGUF_PF 4096
#endif
constexpr int64_t PF = GGUF_PF;  // bytes ahead in the values plane to prefetch

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Where the build has VNNI (AVX-512 VNNI with VL, or AVX-VNNI), a dword lane's four products and
// their sum are one VPDPBUSD; on AVX2 they are VPMADDUBSW and then VPMADDWD. Both give the same
// int32 lanes: VPMADDUBSW never saturates on our operands (unsigned values <= 128 times int8
// activations in [-127, 127] keep its pair sums within int16), and int32 sums wrap alike in any
// grouping.
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define GGUF_VNNI 1
#endif

// acc + lane k: the sum of u[4k..4k+3] * s[4k..4k+3], u unsigned and s signed bytes.
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

inline __m256i dot4(__m256i u, __m256i s) {
#if defined(GGUF_VNNI)
    return dpbusd(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// The 8 lanes of a k-quant super-block (see the portable build) come from 8 registers of 32
// unsigned values whose dword lane k always lies in the 16-value groups lane k sums, so a row
// multiplies each register once and applies the scales once per super-block: on VNNI a chain of
// VPDPBUSD per group of registers, then VPMULLD by the scales; on AVX2 VPMADDUBSW per register,
// int16 sums of 8 (Q4_K), 4 (Q5_K) or 2 (Q6_K) registers (at most 30480, 31496 and 32004 in
// magnitude for values <= 15, 31, 63 against activations in [-127, 127], so never wrapped), then
// one VPMADDWD by the scales per sum. In tiles of two rows or more the registers are shuffled out
// of the GGUF layout once per super-block for all rows of the tile, and each row's activations are
// stored once per call in the matching order (``kperm``). What a row then adds per super-block is
// its multiplies, the scales' VPMULLD (VNNI), Q6_K's offset VPMADDWD and one FMA; with 9 rows or
// more that, not the decoding, is most of a tile's time, with the loads of its 8 activation
// registers per output and super-block (docs/GGUF_NATIVE.md, "Verify rows").

// A decoded super-block: its 8 value registers in ``kperm`` order and its scales per lane (VNNI:
// int32 lanes; AVX2: each int16 pair of a lane; Q6_K: one vector per group of 4 registers).
struct KBlock {
    __m256i v[8], sc[2];
};

inline __m256i scale_lanes(__m128i bytes8, bool is_signed) {  // 8 scale bytes -> lane k: scale k
#if defined(GGUF_VNNI)
    return is_signed ? _mm256_cvtepi8_epi32(bytes8) : _mm256_cvtepu8_epi32(bytes8);
#else
    const __m128i pairs = _mm_unpacklo_epi8(bytes8, bytes8);
    return is_signed ? _mm256_cvtepi8_epi16(pairs) : _mm256_cvtepu8_epi16(pairs);
#endif
}

template <int T>
inline KBlock decode_block(const Part& w, int64_t i) {
    KBlock k;
    const __m256i m4 = _mm256_set1_epi8(15);
    if constexpr (T == Q6_K) {
        const __m256i m3 = _mm256_set1_epi8(3);
        const __m256i hb[2] = {load32(w.qh + i * 64), load32(w.qh + i * 64 + 32)};
        for (int G = 0; G < 2; ++G) {
            __m256i V[4];  // values 128G + 32m .. + 31: group 8G + 2m in the low half, 8G + 2m + 1 in the high
            for (int o = 0; o < 2; ++o) {
                const __m256i l = load32(w.q + i * 128 + 64 * G + 32 * o);
                V[o] = _mm256_or_si256(_mm256_and_si256(l, m4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb[G], 2 * o), m3), 4));
                V[2 + o] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, 4), m4),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb[G], 4 + 2 * o), m3), 4));
            }
            // A 4x4 dword transpose within each 128-bit half: register i takes dword i of each V.
            const __m256i t0 = _mm256_unpacklo_epi32(V[0], V[1]), t1 = _mm256_unpackhi_epi32(V[0], V[1]);
            const __m256i t2 = _mm256_unpacklo_epi32(V[2], V[3]), t3 = _mm256_unpackhi_epi32(V[2], V[3]);
            k.v[4 * G] = _mm256_unpacklo_epi64(t0, t2), k.v[4 * G + 1] = _mm256_unpackhi_epi64(t0, t2);
            k.v[4 * G + 2] = _mm256_unpacklo_epi64(t1, t3), k.v[4 * G + 3] = _mm256_unpackhi_epi64(t1, t3);
        }
        const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + i * 16));
        k.sc[0] = scale_lanes(_mm_shuffle_epi8(sc, _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 0, 0, 0, 0, 0, 0, 0, 0)), true);
        k.sc[1] = scale_lanes(_mm_shuffle_epi8(sc, _mm_setr_epi8(8, 10, 12, 14, 9, 11, 13, 15, 0, 0, 0, 0, 0, 0, 0, 0)), true);
    } else {
        // P[j], qword c: bytes 8j..8j+7 of the super-block's 32-byte chunk c (whose low nibbles are
        // sub-block 2c, high nibbles sub-block 2c + 1). Shifting its odd dwords by 4 puts sub-block
        // 2c in lane 2c and 2c + 1 in lane 2c + 1; the same after swapping each qword's dwords
        // gives the other half of those bytes.
        const uint8_t* q = w.q + i * 128;
        const __m256i q0 = load32(q), q1 = load32(q + 32), q2 = load32(q + 64), q3 = load32(q + 96);
        const __m256i a = _mm256_unpacklo_epi64(q0, q1), b = _mm256_unpackhi_epi64(q0, q1);
        const __m256i c = _mm256_unpacklo_epi64(q2, q3), d = _mm256_unpackhi_epi64(q2, q3);
        const __m256i P[4] = {_mm256_permute2x128_si256(a, c, 0x20), _mm256_permute2x128_si256(b, d, 0x20),
                              _mm256_permute2x128_si256(a, c, 0x31), _mm256_permute2x128_si256(b, d, 0x31)};
        const __m256i nib = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
        for (int j = 0; j < 4; ++j) {
            k.v[2 * j] = _mm256_and_si256(_mm256_srlv_epi32(P[j], nib), m4);
            k.v[2 * j + 1] = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi32(P[j], 0xB1), nib), m4);
        }
        if constexpr (T == Q5_K) {
            // The fifth bits: byte 8j + t of qh holds chunk c's in bits 2c (low nibble) and 2c + 1.
            const __m256i one = _mm256_set1_epi8(1), bit = _mm256_setr_epi32(0, 1, 0, 1, 0, 1, 0, 1);
            const __m256i chunk = _mm256_setr_epi64x(0, 2, 4, 6);
            for (int j = 0; j < 4; ++j) {
                int64_t bits;
                std::memcpy(&bits, w.qh + i * 32 + 8 * j, 8);
                const __m256i h = _mm256_srlv_epi64(_mm256_set1_epi64x(bits), chunk);
                const __m256i h0 = _mm256_and_si256(_mm256_srlv_epi32(h, bit), one);
                const __m256i h1 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi32(h, 0xB1), bit), one);
                k.v[2 * j] = _mm256_or_si256(k.v[2 * j], _mm256_slli_epi16(h0, 4));
                k.v[2 * j + 1] = _mm256_or_si256(k.v[2 * j + 1], _mm256_slli_epi16(h1, 4));
            }
        }
        k.sc[0] = scale_lanes(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.sc + i * 8)), false);
    }
    return k;
}

// One row's 8 int32 lanes of a decoded super-block; x: its 256 activations in ``kperm`` order.
template <int T>
inline __m256i k_lanes(const KBlock& k, const int8_t* x) {
#if defined(GGUF_VNNI)
    const auto chain = [&](int r) {  // lane k: the products of registers r..r+3 in lane k
        __m256i s = dot4(k.v[r], load32(x + 32 * r));
        for (int e = r + 1; e < r + 4; ++e) s = dpbusd(s, k.v[e], load32(x + 32 * e));
        return s;
    };
    if constexpr (T == Q6_K)
        return _mm256_add_epi32(_mm256_mullo_epi32(chain(0), k.sc[0]), _mm256_mullo_epi32(chain(4), k.sc[1]));
    else
        return _mm256_mullo_epi32(_mm256_add_epi32(chain(0), chain(4)), k.sc[0]);
#else
    __m256i p[8];
    for (int e = 0; e < 8; ++e) p[e] = _mm256_maddubs_epi16(k.v[e], load32(x + 32 * e));
    if constexpr (T == Q4_K) {
        const __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])),
                                           _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7])));
        return _mm256_madd_epi16(s, k.sc[0]);
    } else if constexpr (T == Q5_K) {
        const __m256i s0 = _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3]));
        const __m256i s1 = _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7]));
        return _mm256_add_epi32(_mm256_madd_epi16(s0, k.sc[0]), _mm256_madd_epi16(s1, k.sc[0]));
    } else {
        const __m256i a = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[0], p[1]), k.sc[0]),
                                           _mm256_madd_epi16(_mm256_add_epi16(p[2], p[3]), k.sc[0]));
        const __m256i b = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[4], p[5]), k.sc[1]),
                                           _mm256_madd_epi16(_mm256_add_epi16(p[6], p[7]), k.sc[1]));
        return _mm256_add_epi32(a, b);
    }
#endif
}

// A one-row tile computes the same lanes without the weight shuffles, which it could not amortize:
// it multiplies the super-block's registers in their GGUF order (with its activations in natural
// order) and moves the sums into their lanes with horizontal adds. Register g (natural order) of a
// Q4_K / Q5_K super-block is sub-block g; of a Q6_K one, groups 2g and 2g + 1 in its two halves.
template <int T>
inline void natural_block(const Part& w, int64_t i, __m256i* v) {
    const __m256i m4 = _mm256_set1_epi8(15);
    if constexpr (T == Q6_K) {
        const __m256i m3 = _mm256_set1_epi8(3);
        for (int G = 0; G < 2; ++G) {
            const __m256i hb = load32(w.qh + i * 64 + 32 * G);
            for (int o = 0; o < 2; ++o) {
                const __m256i l = load32(w.q + i * 128 + 64 * G + 32 * o);
                v[4 * G + o] = _mm256_or_si256(_mm256_and_si256(l, m4),
                                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * o), m3), 4));
                v[4 * G + 2 + o] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, 4), m4),
                                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4 + 2 * o), m3), 4));
            }
        }
    } else {
        const __m256i hb = T == Q5_K ? load32(w.qh + i * 32) : _mm256_setzero_si256(), one = _mm256_set1_epi8(1);
        for (int c = 0; c < 4; ++c) {
            const __m256i q = load32(w.q + i * 128 + 32 * c);
            v[2 * c] = _mm256_and_si256(q, m4);
            v[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            if constexpr (T == Q5_K) {
                v[2 * c] = _mm256_or_si256(v[2 * c], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c), one), 4));
                v[2 * c + 1] = _mm256_or_si256(v[2 * c + 1], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c + 1), one), 4));
            }
        }
    }
}

// Per 128-bit half: dword j the sum of that half of d_j (j < 4). Integer sums, so any grouping
// gives the same bits; unpacks and adds rather than VPHADDD, which issues once every two cycles
// on Zen 4 against two or more unpacks or adds a cycle. A one-row call on weights in cache runs
// a few percent faster; from memory, as in a decode step, the row is bandwidth-bound either way.
inline __m256i sums4(__m256i d0, __m256i d1, __m256i d2, __m256i d3) {
    const __m256i s01 = _mm256_add_epi32(_mm256_unpacklo_epi32(d0, d1), _mm256_unpackhi_epi32(d0, d1));
    const __m256i s23 = _mm256_add_epi32(_mm256_unpacklo_epi32(d2, d3), _mm256_unpackhi_epi32(d2, d3));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(s01, s23), _mm256_unpackhi_epi64(s01, s23));
}

// One row's lanes of super-block i from its natural registers; x: its 256 activations in order.
template <int T>
inline __m256i k_lanes_natural(const Part& w, int64_t i, const int8_t* x) {
    __m256i v[8], d[8];
    natural_block<T>(w, i, v);
    for (int g = 0; g < 8; ++g) d[g] = dot4(v[g], load32(x + 32 * g));
    // Per 128-bit half: [sum of half of d0, of d1, of d2, of d3] (and likewise d4..d7).
    const __m256i a = sums4(d[0], d[1], d[2], d[3]), b = sums4(d[4], d[5], d[6], d[7]);
    if constexpr (T == Q6_K) {  // lane L of a (b): group 2 (L & 3) + (L >> 2) (+ 8), as the shuffled layout
        const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + i * 16));
        const __m256i s0 = _mm256_cvtepi8_epi32(_mm_shuffle_epi8(sc, _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 0, 0, 0, 0, 0, 0, 0, 0)));
        const __m256i s1 = _mm256_cvtepi8_epi32(_mm_shuffle_epi8(sc, _mm_setr_epi8(8, 10, 12, 14, 9, 11, 13, 15, 0, 0, 0, 0, 0, 0, 0, 0)));
        return _mm256_add_epi32(_mm256_mullo_epi32(a, s0), _mm256_mullo_epi32(b, s1));
    } else {  // sub-block k: both halves of register k
        const __m256i s = _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
        return _mm256_mullo_epi32(s, _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.sc + i * 8))));
    }
}

// Q6_K: the scales of lane k's groups g and g + 8 (g = 2 (k & 3) + (k >> 2)) times 32, as int16
// pairs: VPMADDWD with a row's sums in that order (``Acts::kbs``) gives the lanes' offset terms.
inline __m256i q6_offsets(const Part& w, int64_t i) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + i * 16));
    const __m128i pairs = _mm_shuffle_epi8(sc, _mm_setr_epi8(0, 8, 2, 10, 4, 12, 6, 14, 1, 9, 3, 11, 5, 13, 7, 15));
    return _mm256_slli_epi16(_mm256_cvtepi8_epi16(pairs), 5);
}

// Q4_K / Q5_K: super-block i's mins as int16 pairs, (min of sub-block 2p, of 2p + 1) in every
// dword of mnp[p].
inline void min_pairs(const Part& w, int64_t i, __m256i* mnp) {
    const __m128i mn = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.mn + i * 8)));
    mnp[0] = _mm256_broadcastd_epi32(mn), mnp[1] = _mm256_broadcastd_epi32(_mm_shuffle_epi32(mn, 0x55));
    mnp[2] = _mm256_broadcastd_epi32(_mm_shuffle_epi32(mn, 0xAA)), mnp[3] = _mm256_broadcastd_epi32(_mm_shuffle_epi32(mn, 0xFF));
}

// The integer mins term of 8 consecutive rows of a super-block: per row, the sum over sub-blocks
// of min times the activations' sum; bt: the rows' pair sums in ``Acts::kbt`` (pair p at p * ns * 2).
inline __m256i mins8(const __m256i* mnp, const int16_t* bt, int64_t ns) {
    __m256i mins = _mm256_madd_epi16(mnp[0], load32(reinterpret_cast<const int8_t*>(bt)));
    for (int p = 1; p < 4; ++p)
        mins = _mm256_add_epi32(mins, _mm256_madd_epi16(mnp[p], load32(reinterpret_cast<const int8_t*>(bt + p * ns * 2))));
    return mins;
}

// A row's float steps per super-block: f += lanes * (dw * xd) on 8 lanes, and for Q4_K / Q5_K
// macc += -mins * (dm * xd) on one float, mins = sum over the sub-blocks of min times the
// activations' sum. The mins of a tile's rows take one vector step per 8 rows (``Acts::kbt``);
// Q6_K folds its values' offset of 32 into the integer lanes (dm = dw).
template <int T, int R>
inline void tile_k(const Part& w, const Acts& a, int64_t j, int64_t r0, __m256* f, float* macc) {
    constexpr bool has_min = T != Q6_K;
    constexpr int C = (R + 7) / 8;  // vectors of 8 rows
    __m256 mv[C];
    for (int c = 0; c < C; ++c) mv[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < w.nb; ++b) {
        const int64_t i = j * w.nb + b, m = b * a.n + r0;  // m: the tile's first row of block b
        if constexpr (PF > 0) {
            _mm_prefetch(reinterpret_cast<const char*>(w.q + i * 128 + PF), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(w.q + i * 128 + 64 + PF), _MM_HINT_T0);
            if constexpr (T != Q4_K) _mm_prefetch(reinterpret_cast<const char*>(w.qh + i * (T == Q6_K ? 64 : 32) + PF / 2), _MM_HINT_T0);
        }
        const float dw = w.d[i], dm = has_min ? w.dm[i] : 0.f;
        if constexpr (R == 1) {
            const int64_t ab = r0 * a.nb + b;
            const float xd = a.d[ab];
            __m256i lanes = k_lanes_natural<T>(w, i, a.row(r0) + b * 256);
            const __m256i bs = load32(reinterpret_cast<const int8_t*>(a.bs.data() + ab * 16));
            if constexpr (has_min) {
                const __m128i mn8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.mn + i * 8));
                const __m256i mins = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8)), bs);  // per 16
                const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(mins), _mm256_extracti128_si256(mins, 1));
                const __m128i q = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
                const int32_t total = _mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, 0xB1)));
                macc[0] = std::fma(-static_cast<float>(total), dm * xd, macc[0]);
            } else {  // pair (sum of group j, of group j + 8) in dword j, then dword g(k) into lane k
                const __m128i lo = _mm256_castsi256_si128(bs), hi = _mm256_extracti128_si256(bs, 1);
                const __m256i pairs = _mm256_permutevar8x32_epi32(_mm256_set_m128i(_mm_unpackhi_epi16(lo, hi), _mm_unpacklo_epi16(lo, hi)),
                                                                  _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
                lanes = _mm256_sub_epi32(lanes, _mm256_madd_epi16(q6_offsets(w, i), pairs));
            }
            f[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(dw * xd), f[0]);
            continue;
        }
        alignas(32) float dx[8 * C];
        const __m256 dw8 = _mm256_set1_ps(dw), dm8 = _mm256_set1_ps(dm);
        __m256i mnp[4];
        if constexpr (has_min) min_pairs(w, i, mnp);
        for (int c = 0; c < C; ++c) {
            const __m256 xd = _mm256_loadu_ps(a.kd.data() + m + 8 * c);
            _mm256_store_ps(dx + 8 * c, _mm256_mul_ps(dw8, xd));
            if constexpr (has_min) {
                const __m256i mins = mins8(mnp, a.kbt.data() + ((b * 4) * a.ns + r0 + 8 * c) * 2, a.ns);
                mv[c] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dm8, xd), mv[c]);
            }
        }
        const KBlock k = decode_block<T>(w, i);
        const int8_t* x = a.kq[T == Q6_K ? 1 : 0].data() + m * 256;
        __m256i offsets;
        if constexpr (!has_min) offsets = q6_offsets(w, i);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            __m256i lanes = k_lanes<T>(k, x + 256 * r);
            if constexpr (!has_min)
                lanes = _mm256_sub_epi32(lanes, _mm256_madd_epi16(offsets, load32(reinterpret_cast<const int8_t*>(a.kbs.data() + (m + r) * 16))));
            f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_broadcast_ss(dx + r), f[r]);
        }
    }
    if constexpr (has_min && R > 1) {
        alignas(32) float mins[8 * C];
        for (int c = 0; c < C; ++c) _mm256_store_ps(mins + 8 * c, mv[c]);
        for (int r = 0; r < R; ++r) macc[r] = mins[r];
    }
}

// 32 bits -> 32 bytes, 0xFF where the bit is set.
inline __m256i bits_to_bytes(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                               _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i mask = _mm256_set1_epi64x(0x8040201008040201);
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask);
}

template <int T>
inline __m256i block_32(const Part& w, int64_t i) {
    if constexpr (T == Q8_0) {
        return load32(w.q + i * 32);
    } else {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.q + i * 16));
        const __m128i m4 = _mm_set1_epi8(15);
        __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
        if constexpr (T == Q5_0 || T == Q5_1) {
            uint32_t hbits;
            std::memcpy(&hbits, w.qh + i * 4, 4);
            v = _mm256_or_si256(v, _mm256_and_si256(bits_to_bytes(hbits), _mm256_set1_epi8(16)));
        }
        if constexpr (T == Q4_0) v = _mm256_sub_epi8(v, _mm256_set1_epi8(8));
        if constexpr (T == Q5_0) v = _mm256_sub_epi8(v, _mm256_set1_epi8(16));
        return v;
    }
}

template <int T, int R>
inline void tile_32(const Part& w, const Acts& a, int64_t j, int64_t r0, __m256* f, float* macc) {
    constexpr bool has_min = T == Q4_1 || T == Q5_1;
    constexpr bool is_signed = !has_min;
    const int8_t* x[R];
    for (int r = 0; r < R; ++r) x[r] = a.row(r0 + r);
    for (int64_t b = 0; b < w.nb; ++b) {
        const int64_t i = j * w.nb + b;
        if constexpr (PF > 0)
            if ((i & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(w.q + i * (T == Q8_0 ? 32 : 16) + PF), _MM_HINT_T0);
        const __m256i v = block_32<T>(w, i);
        const __m256i u = is_signed ? _mm256_sign_epi8(v, v) : v;  // |v| against x * sign(v)
        const float dw = w.d[i];
        for (int r = 0; r < R; ++r) {
            const int64_t ab = (r0 + r) * a.nb + b;
            const __m256i xr = load32(x[r] + b * 32);
            const __m256i p = dot4(u, is_signed ? _mm256_sign_epi8(xr, v) : xr);
            const float xd = a.d[ab];
            f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * xd), f[r]);
            if constexpr (has_min) macc[r] = std::fma(w.dm[i] * xd, static_cast<float>(a.bs[ab]), macc[r]);
        }
    }
}

// A function of its own for each (type, rows), registers allocated for it alone: left to the
// inliner, the tiles of 10 to 15 rows were inlined into their caller in one build and not in
// another, and took 1.3-1.7x as long where they were (docs/GGUF_NATIVE.md, "Verify rows").
template <int T, int R>
[[gnu::noinline]] void tile(const Part& w, const Acts& a, int64_t j, int64_t r0, float* y, int64_t ystride, int64_t col) {
    __m256 f[R];
    float macc[R] = {};
    for (int r = 0; r < R; ++r) f[r] = _mm256_setzero_ps();
    if constexpr (T == Q4_K || T == Q5_K || T == Q6_K)
        tile_k<T, R>(w, a, j, r0, f, macc);
    else
        tile_32<T, R>(w, a, j, r0, f, macc);
    for (int r = 0; r < R; ++r) {
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, f[r]);
        y[(r0 + r) * ystride + col] = reduce8(lanes) + macc[r];
    }
}

template <int T, int R>
void tile_rest(int64_t rows, const Part& w, const Acts& a, int64_t j, int64_t r0, float* y, int64_t ys, int64_t col) {
    if constexpr (R > 0) {
        if (rows == R) return tile<T, R>(w, a, j, r0, y, ys, col);
        tile_rest<T, R - 1>(rows, w, a, j, r0, y, ys, col);
    }
}

// ---- Wide tiles: many rows against several outputs at once.
// A row tile above decodes each super-block for its 8 rows and applies each decoded register to
// them one by one, each multiply loading its own 32 bytes of activations. A call of 16 rows or
// more instead decodes the super-blocks of WN outputs once for all its rows (into a per-thread
// buffer: a row of 8960 inputs takes 70 KB for 4 outputs) and multiplies blocks of WM rows by WN
// outputs from registers: each activation register serves WN outputs and each weight register
// WM rows. Every (row, output) gets the integer lanes ``tile_k`` computes (int32 sums, exact in
// any order) and the same float steps in the same order, so the same bits.
// Where they pay (``python scripts/gguf_rows.py --rows 16,64,146 --by-type --against`` the row
// tiles' source, Zen 4, 2026-11-26): VNNI Q4_K 1.06x / 1.12x / 1.34x as fast, Q6_K 1.02x / 1.12x /
// 1.20x; AVX2 Q6_K 0.82x / 1.17x / 1.16x, AVX2 Q4_K 0.79x / 0.89x / 0.98x (its int16 sums in 16
// registers), so AVX2 keeps row tiles for Q4_K.
#if defined(GGUF_VNNI)
constexpr int WM = 4, WN = 4;  // 16 accumulators of AVX-512VL's 32 registers
template <int T>
constexpr bool wide_pays() { return T == Q4_K || T == Q6_K; }
#else
constexpr int WM = 2, WN = 4;  // 8 of AVX2's 16
template <int T>
constexpr bool wide_pays() { return T == Q6_K; }
#endif
constexpr int WR = 8;  // rows per pass over the buffer: one vector of the mins' chains

// The registers of one scale group: one VPDPBUSD chain before VPMULLD (VNNI), one int16 sum
// before VPMADDWD (AVX2), as ``k_lanes`` groups them.
template <int T>
constexpr int group_regs() {
#if defined(GGUF_VNNI)
    return T == Q6_K ? 4 : 8;
#else
    return T == Q6_K ? 2 : 8;
#endif
}

inline __m256i acc_dot(__m256i acc, __m256i u, __m256i s) {
#if defined(GGUF_VNNI)
    return dpbusd(acc, u, s);
#else
    return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s));
#endif
}

inline __m256i apply_scale(__m256i acc, __m256i sc) {
#if defined(GGUF_VNNI)
    return _mm256_mullo_epi32(acc, sc);
#else
    return _mm256_madd_epi16(acc, sc);
#endif
}

// One super-block of WN outputs, decoded: values in ``kperm`` order, scales as ``KBlock`` holds
// them, and per output what ``tile_k`` derives per block (Q4_K: the mins as int16 pairs by
// sub-block pair; Q6_K: its offsets' scales).
struct WideBlock {
    __m256i v[WN][8], sc[WN][2], extra[WN][4];
    float dw[WN], dm[WN];
};

template <int T>
void decode_wide(const Part& w, int64_t j, WideBlock* blocks) {
    for (int64_t b = 0; b < w.nb; ++b) {
        WideBlock& B = blocks[b];
        for (int c = 0; c < WN; ++c) {
            const int64_t i = (j + c) * w.nb + b;
            if constexpr (PF > 0) {
                _mm_prefetch(reinterpret_cast<const char*>(w.q + i * 128 + PF), _MM_HINT_T0);
                _mm_prefetch(reinterpret_cast<const char*>(w.q + i * 128 + 64 + PF), _MM_HINT_T0);
                if constexpr (T == Q6_K) _mm_prefetch(reinterpret_cast<const char*>(w.qh + i * 64 + PF / 2), _MM_HINT_T0);
            }
            const KBlock k = decode_block<T>(w, i);
            for (int e = 0; e < 8; ++e) B.v[c][e] = k.v[e];
            B.sc[c][0] = k.sc[0], B.sc[c][1] = T == Q6_K ? k.sc[1] : k.sc[0];
            B.dw[c] = w.d[i];
            if constexpr (T == Q6_K) {
                B.extra[c][0] = q6_offsets(w, i), B.dm[c] = 0.f;
            } else {
                min_pairs(w, i, B.extra[c]);
                B.dm[c] = w.dm[i];
            }
        }
    }
}

// Rows r0 .. r0 + WR - 1 against the decoded outputs.
template <int T>
void wide_rows(const WideBlock* blocks, int64_t nb, const Acts& a, int64_t r0, float* y, int64_t ystride, int64_t col) {
    constexpr bool has_min = T != Q6_K;
    constexpr int H = group_regs<T>();
    alignas(32) float F[WR][WN][8] = {};
    alignas(32) int32_t L[WR][WN][8];  // a row's lanes while several scale groups add up
    __m256 mv[WN];
    for (int c = 0; c < WN; ++c) mv[c] = _mm256_setzero_ps();
    const int8_t* xq = a.kq[T == Q6_K ? 1 : 0].data();
    for (int64_t b = 0; b < nb; ++b) {
        const WideBlock& B = blocks[b];
        const int64_t m = b * a.n + r0;
        const __m256 xd = _mm256_loadu_ps(a.kd.data() + m);
        const int16_t* bt = has_min ? a.kbt.data() + ((b * 4) * a.ns + r0) * 2 : nullptr;
        alignas(32) float dx[WN][8];
        for (int c = 0; c < WN; ++c) {
            _mm256_store_ps(dx[c], _mm256_mul_ps(_mm256_set1_ps(B.dw[c]), xd));
            if constexpr (has_min) {  // as tile_k
                const __m256i mins = mins8(B.extra[c], bt, a.ns);
                mv[c] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(_mm256_set1_ps(B.dm[c]), xd), mv[c]);
            }
        }
        const int8_t* x = xq + m * 256;
        for (int g = 0; g < WR; g += WM) {
            // The decoded weights are loaded anew for each block of rows: held in registers
            // across them, they would push the accumulators out to the stack.
            asm volatile("" ::: "memory");
#pragma GCC unroll 8
            for (int h = 0; h < 8; h += H) {
                __m256i acc[WM][WN];
                for (int r = 0; r < WM; ++r)
                    for (int c = 0; c < WN; ++c) acc[r][c] = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int e = h; e < h + H; ++e) {
                    __m256i xr[WM];
                    for (int r = 0; r < WM; ++r) xr[r] = load32(x + 256 * (g + r) + 32 * e);
                    for (int c = 0; c < WN; ++c) {
                        const __m256i wv = _mm256_load_si256(&B.v[c][e]);
                        for (int r = 0; r < WM; ++r) acc[r][c] = acc_dot(acc[r][c], wv, xr[r]);
                    }
                }
                for (int r = 0; r < WM; ++r)
                    for (int c = 0; c < WN; ++c) {
                        __m256i part = apply_scale(acc[r][c], B.sc[c][h / 4]);
                        __m256i* lp = reinterpret_cast<__m256i*>(L[g + r][c]);
                        if (h > 0) part = _mm256_add_epi32(_mm256_load_si256(lp), part);
                        if (h + H < 8) {
                            _mm256_store_si256(lp, part);
                            continue;
                        }
                        if constexpr (!has_min)
                            part = _mm256_sub_epi32(part, _mm256_madd_epi16(B.extra[c][0], load32(reinterpret_cast<const int8_t*>(a.kbs.data() + (m + g + r) * 16))));
                        float* fp = F[g + r][c];
                        _mm256_store_ps(fp, _mm256_fmadd_ps(_mm256_cvtepi32_ps(part), _mm256_broadcast_ss(dx[c] + g + r), _mm256_load_ps(fp)));
                    }
            }
        }
    }
    for (int c = 0; c < WN; ++c) {
        alignas(32) float mins[8];
        _mm256_store_ps(mins, mv[c]);
        for (int r = 0; r < WR; ++r) y[(r0 + r) * ystride + col + c] = reduce8(F[r][c]) + (has_min ? mins[r] : 0.f);
    }
}

// Outputs j .. j + WN - 1 for rows 0 .. rows - 1 (a multiple of WR).
template <int T>
void wide_columns(const Part& w, const Acts& a, int64_t j, int64_t rows, float* y, int64_t ystride, int64_t col) {
    thread_local std::vector<WideBlock> blocks;
    if (static_cast<int64_t>(blocks.size()) < w.nb) blocks.resize(w.nb);
    decode_wide<T>(w, j, blocks.data());
    for (int64_t r0 = 0; r0 < rows; r0 += WR) wide_rows<T>(blocks.data(), w.nb, a, r0, y, ystride, col);
}

// Outputs j0 .. j1-1 of one part for every row: row tile by row tile, each tile across the
// outputs, so the tile's activations stay in L1 while the outputs' weights (a few KB each) come
// from L2. Output by output instead, a prefill of 64 rows would re-read its 100 KB of activations
// from L2 for every output. Each (row, output) is computed exactly as alone.
template <int T>
void rows_of(const Part& w, const Acts& a, int64_t j0, int64_t j1, float* y, int64_t ystride, int64_t col0) {
    if constexpr (wide_pays<T>() && RT == WR) {
        if (a.n > TMAX) {  // wide tiles for every whole 8 rows; row tiles for the other outputs and rows
            const int64_t whole = a.n / WR * WR;
            int64_t j = j0;
            for (; j + WN <= j1; j += WN) wide_columns<T>(w, a, j, whole, y, ystride, col0 + j - j0);
            for (; j < j1; ++j)
                for (int64_t r = 0; r < whole; r += RT) tile<T, RT>(w, a, j, r, y, ystride, col0 + j - j0);
            if (whole < a.n)
                for (j = j0; j < j1; ++j) tile_rest<T, TMAX>(a.n - whole, w, a, j, whole, y, ystride, col0 + j - j0);
            return;
        }
    }
    int64_t r = 0;
    for (; a.n - r > TMAX; r += RT)
        for (int64_t j = j0; j < j1; ++j) tile<T, RT>(w, a, j, r, y, ystride, col0 + j - j0);
    for (int64_t j = j0; j < j1; ++j) tile_rest<T, TMAX>(a.n - r, w, a, j, r, y, ystride, col0 + j - j0);
}

void output_rows(const Part& w, const Acts& a, int64_t j0, int64_t j1, float* y, int64_t ystride, int64_t col0) {
    switch (w.type) {
        case Q4_0: return rows_of<Q4_0>(w, a, j0, j1, y, ystride, col0);
        case Q4_1: return rows_of<Q4_1>(w, a, j0, j1, y, ystride, col0);
        case Q5_0: return rows_of<Q5_0>(w, a, j0, j1, y, ystride, col0);
        case Q5_1: return rows_of<Q5_1>(w, a, j0, j1, y, ystride, col0);
        case Q8_0: return rows_of<Q8_0>(w, a, j0, j1, y, ystride, col0);
        case Q4_K: return rows_of<Q4_K>(w, a, j0, j1, y, ystride, col0);
        case Q5_K: return rows_of<Q5_K>(w, a, j0, j1, y, ystride, col0);
        default: return rows_of<Q6_K>(w, a, j0, j1, y, ystride, col0);
    }
}
#else
constexpr int RT = 8;

void output_rows(const Part& w, const Acts& a, int64_t j0, int64_t j1, float* y, int64_t ystride, int64_t col0) {
    for (int64_t j = j0; j < j1; ++j) {
        const int64_t col = col0 + j - j0;
        for (int64_t r0 = 0; r0 < a.n; r0 += RT) {
            const int64_t rows = std::min<int64_t>(RT, a.n - r0);
            float lanes[RT * 8] = {}, macc[RT] = {};
            if (is_k(w.type))
                rows_k_portable(w, a, j, r0, rows, lanes, macc);
            else
                rows_32_portable(w, a, j, r0, rows, lanes, macc);
            for (int64_t r = 0; r < rows; ++r) y[(r0 + r) * ystride + col] = reduce8(lanes + 8 * r) + macc[r];
        }
    }
}
#endif

// ---- Input transforms, fused so a layer's norms and gated activation cost no torch calls. ------
// Each works on one row in a fixed order with ``lanes::V8`` (the same bits in every build).

// RMS norm: x * (1 / sqrt(mean(x^2) + eps)) * weight; the sum of squares as an 8-lane FMA chain.
void rms_row(const float* x, const float* weight, int64_t in, float eps, float* y) {
    using namespace lanes;
    V8 ss = splat(0.f);
    for (int64_t k = 0; k < in; k += 8) {
        const V8 v = load(x + k);
        ss = fma(v, v, ss);
    }
    const float inv = 1.f / std::sqrt(reduce8(ss) / static_cast<float>(in) + eps);
    for (int64_t k = 0; k < in; k += 8) store(y + k, mul(load(weight + k), mul(load(x + k), splat(inv))));
}

// SiLU-gated product of a gate|up row: silu(g) * u, silu(g) = g * sigmoid(g) with
// sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, e = exp(-|g|) (never overflows).
void glu_span(const float* gate, const float* up, int64_t len, float* y) {
    using namespace lanes;
    for (int64_t k = 0; k < len; k += 8) {
        const V8 g = load(gate + k), u = load(up + k);
        const V8 e = exp8(neg_abs(g));
        const V8 one = splat(1.f);
        const V8 sig = select_nonneg(g, div(one, add(one, e)), div(e, add(one, e)));
        store(y + k, mul(mul(g, sig), u));
    }
}

void glu_row(const float* gate_up, int64_t in, float* y) { glu_span(gate_up, gate_up + in, in, y); }

enum Pre : int64_t { PRE_NONE = 0, PRE_RMS = 1, PRE_GLU = 2 };

// The rows the kernel multiplies: x itself, or x transformed row by row into ``buf``.
const float* prepare(const torch::Tensor& x, int64_t pre, const torch::Tensor& norm, double eps, int64_t in,
                     std::vector<float>& buf) {
    if (pre == PRE_NONE) return x.data_ptr<float>();
    const int64_t n = x.size(0), width = x.size(1);
    TORCH_CHECK(in % 8 == 0, "fused input transforms need a multiple of 8 inputs, got ", in);
    buf.resize(n * in);
    const float* xp = x.data_ptr<float>();
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            if (pre == PRE_RMS)
                rms_row(xp + r * width, norm.data_ptr<float>(), in, static_cast<float>(eps), buf.data() + r * in);
            else
                glu_row(xp + r * width, in, buf.data() + r * in);
        }
    });
    return buf.data();
}

const uint8_t* bytes(const torch::Tensor& t) { return t.numel() ? static_cast<const uint8_t*>(t.data_ptr()) : nullptr; }
const float* floats(const torch::Tensor& t) { return t.numel() ? t.data_ptr<float>() : nullptr; }

Part make_part(int type, int64_t out, int64_t in, const std::vector<torch::Tensor>& p) {
    TORCH_CHECK(p.size() == 6, "a part has six planes: q, qh, sc, mn, d, dm");
    for (const auto& t : p) TORCH_CHECK(!t.numel() || t.is_contiguous(), "weight planes must be contiguous");
    TORCH_CHECK(in % block_of(type) == 0, "input size ", in, " is not a whole number of blocks of type ", type);
    Part w;
    w.type = type, w.out = out, w.in = in, w.nb = in / block_of(type);
    w.q = bytes(p[0]), w.qh = bytes(p[1]), w.sc = bytes(p[2]), w.mn = bytes(p[3]), w.d = floats(p[4]), w.dm = floats(p[5]);
    TORCH_CHECK(p[4].numel() == out * w.nb, "need one scale per block");
    TORCH_CHECK(!(type == Q4_K || type == Q5_K) || p[3].numel() == out * w.nb * 8,
                "need one min per 32 inputs (planes repacked by an older version?)");
    return w;
}

using Parts = std::vector<std::tuple<int64_t, int64_t, std::vector<torch::Tensor>>>;

// Matrices applied to the same input, outputs concatenated (q|k|v, gate|up), and what their
// activations need: 256-blocks for the k-quants (in the ``kperm`` orders their multi-row tiles
// read), 32-blocks for the others.
struct Matrix {
    std::vector<Part> ws;
    std::vector<int64_t> starts{0};  // each part's first output
    int64_t in = 0, total = 0;
    bool need_k = false, need_32 = false, orders[2] = {false, false};
};

Matrix make_matrix(const Parts& parts, int64_t in) {
    Matrix m;
    m.in = in;
    for (const auto& [type, out, planes] : parts) {
        m.ws.push_back(make_part(static_cast<int>(type), out, in, planes));
        m.total += out;
        m.starts.push_back(m.total);
        (is_k(static_cast<int>(type)) ? m.need_k : m.need_32) = true;
        if (lanes::avx2() && is_k(static_cast<int>(type))) m.orders[type == Q6_K ? 1 : 0] = true;
    }
    return m;
}

// What activations a matrix needs; ``merge`` makes one set serve several matrices (the same step
// of every layer: the layers of a Q4_K_M file mix Q4_K and Q6_K).
struct Needs {
    int64_t in = 0;
    bool k = false, b32 = false, orders[2] = {false, false};
    explicit Needs(const Matrix& m) : in(m.in), k(m.need_k), b32(m.need_32), orders{m.orders[0], m.orders[1]} {}
    void merge(const Matrix& m) {
        k |= m.need_k, b32 |= m.need_32, orders[0] |= m.orders[0], orders[1] |= m.orders[1];
    }
};

// A matrix's activations for n rows (``Acts`` per block size it needs).
struct MatrixActs {
    Acts k, b32;
    void init(const Needs& m, int64_t n) {
        const bool none[2] = {false, false};
        if (m.k) init_acts(k, n, m.in, 256, m.orders);
        if (m.b32) init_acts(b32, n, m.in, 32, none);
    }
    // Share t of T of the rows' blocks (x [n, in]); the shares of 0 .. T - 1 quantize them all.
    void quantize(const float* x, int64_t t, int64_t T) {
        for (Acts* a : {&k, &b32})
            if (a->n) quantize_blocks(*a, x, a->n * a->nb * t / T, a->n * a->nb * (t + 1) / T);
    }
    // Rows r0 .. r1 - 1 (x: row r0).
    void quantize_rows(const float* x, int64_t r0, int64_t r1) {
        for (Acts* a : {&k, &b32})
            if (a->n) quantize_blocks(*a, x - r0 * a->in, r0 * a->nb, r1 * a->nb);
    }
};

// Outputs [begin, end) of ``m`` for every row into y [n, m.total], in blocks of COLS outputs that
// never cross a part. Each output is computed alone, so any split among threads gives the same bits.
void outputs(const Matrix& m, const MatrixActs& a, int64_t begin, int64_t end, float* y) {
    size_t p = std::upper_bound(m.starts.begin(), m.starts.end(), begin) - m.starts.begin() - 1;
    for (int64_t col = begin; col < end;) {
        while (col >= m.starts[p + 1]) ++p;
        const int64_t stop = std::min({col + COLS, end, m.starts[p + 1]});
        const Part& w = m.ws[p];
        output_rows(w, is_k(w.type) ? a.k : a.b32, col - m.starts[p], stop - m.starts[p], y, m.total, col);
        col = stop;
    }
}

// ---- A target's whole forward for its decode and verify rows, in one call. -------------------
// Why: through the Python layers a decode step of the 1.5B target makes some 200 calls, seven a
// layer, and the second thread waits while Python runs between them. Here one OpenMP team runs
// every layer and meets at a barrier wherever a step needs another thread's results. Every step
// is the function the layered path calls (``rms_row``, ``glu_span``, ``quantize_blocks``,
// ``outputs``, ``attention::rope_half`` and ``row_group``) on the same values in the same order, and
// each thread's share of a step is a set of whole rows, blocks, outputs or kv heads, each computed
// alone: so a row gets the bits of ``linear_gguf`` and ``attention_rows`` (tests/test_gguf_forward.py).
class GGUFForward {
  public:
    using LayerArgs = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, Parts, Parts, Parts, Parts>;

    // layers[i]: in_norm, post_norm, qkv_bias (empty if none), and the parts of qkv, o, gate_up
    // and down (``GGUFLinear.args``); lm_head's parts likewise. cos/sin: [positions, head_dim].
    GGUFForward(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, torch::Tensor cos, torch::Tensor sin,
                torch::Tensor norm, const Parts& lm_head, const std::vector<LayerArgs>& layers)
        : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), cos_(cos.contiguous()), sin_(sin.contiguous()),
          norm_(norm.contiguous()) {
        hidden_ = norm_.numel();
        const int64_t width = (heads + 2 * kv_heads) * head_dim;
        TORCH_CHECK(head_dim % 8 == 0 && heads % kv_heads == 0, "head_dim must be a multiple of 8, heads of kv_heads");
        TORCH_CHECK(cos_.scalar_type() == torch::kFloat32 && sin_.sizes() == cos_.sizes() && cos_.size(1) == head_dim,
                    "cos and sin must be [positions, head_dim] float32");
        keep(lm_head);
        lm_head_ = make_matrix(lm_head, hidden_);
        for (const auto& [in_norm, post_norm, bias, qkv, o, gate_up, down] : layers) {
            keep(qkv), keep(o), keep(gate_up), keep(down);
            Layer L{in_norm.contiguous(), post_norm.contiguous(), bias.contiguous(), make_matrix(qkv, hidden_),
                    make_matrix(o, heads * head_dim), make_matrix(gate_up, hidden_), Matrix{}};
            TORCH_CHECK(L.in_norm.numel() == hidden_ && L.post_norm.numel() == hidden_, "norms must be [hidden]");
            TORCH_CHECK(!L.bias.numel() || L.bias.numel() == width, "qkv_bias must be [(heads + 2 kv_heads) head_dim]");
            TORCH_CHECK(L.qkv.total == width && L.o.total == hidden_ && L.gate_up.total % 2 == 0, "bad layer shapes");
            L.down = make_matrix(down, L.gate_up.total / 2);
            TORCH_CHECK(L.down.total == hidden_ && L.down.in % 8 == 0, "bad down shape");
            TORCH_CHECK(layers_.empty() || (L.qkv.total == layers_[0].qkv.total && L.down.in == layers_[0].down.in),
                        "every layer must have the same shapes");
            const Matrix* ms[4] = {&L.qkv, &L.o, &L.gate_up, &L.down};
            for (int i = 0; i < 4; ++i)
                if (layers_.empty()) needs_.emplace_back(*ms[i]); else needs_[i].merge(*ms[i]);
            layers_.push_back(std::move(L));
        }
    }

    // x [n, hidden] float32 (embedded rows) at cache slots start .. start + n - 1 of k/v [layers,
    // kv_heads, capacity, head_dim], which it fills; logits [n, V], or [1, V] of the last row with
    // ``last_only``; ``head`` false: none (an empty [0, V]).
    torch::Tensor forward(const torch::Tensor& x, torch::Tensor k_cache, torch::Tensor v_cache, int64_t start, bool last_only,
                          bool head) {
        const int64_t n = x.dim() == 2 ? x.size(0) : 0;
        std::vector<int64_t> heads;
        if (head) heads = segments::head_rows({n}, last_only);
        return run_segments(x, {k_cache}, {v_cache}, {start}, {n}, heads);
    }

    // Several sequences' rows in one forward (a server's batch): x [sum of counts, hidden], segment
    // i's ``counts[i]`` rows at slots starts[i].. of its own cache k_caches[i] / v_caches[i]. Logits
    // of every row, or with ``last_only`` of each segment's last, in order.
    torch::Tensor forward_batch(const torch::Tensor& x, const std::vector<torch::Tensor>& k_caches,
                                const std::vector<torch::Tensor>& v_caches, const std::vector<int64_t>& starts,
                                const std::vector<int64_t>& counts, bool last_only) {
        return run_segments(x, k_caches, v_caches, starts, counts, segments::head_rows(counts, last_only));
    }

  private:
    struct Layer {
        torch::Tensor in_norm, post_norm, bias;
        Matrix qkv, o, gate_up, down;
    };

    struct State {  // one forward's buffers, shared by its threads
        int64_t n = 0;
        std::vector<segments::Segment> segments;
        std::vector<int64_t> heads;  // the rows whose logits are asked for
        float* logits = nullptr;
        std::vector<float> x, h, y, qkv, attn, gate_up, act;
        MatrixActs acts[4], a_head;  // acts: of qkv, o, gate_up and down (``needs_``)
    };

    torch::Tensor run_segments(const torch::Tensor& x, const std::vector<torch::Tensor>& k_caches,
                               const std::vector<torch::Tensor>& v_caches, const std::vector<int64_t>& starts,
                               const std::vector<int64_t>& counts, const std::vector<int64_t>& heads) {
        const int64_t D = hidden_;
        TORCH_CHECK(x.dim() == 2 && x.size(1) == D && x.scalar_type() == torch::kFloat32 && x.size(0) > 0,
                    "x must be [n > 0, hidden] float32");
        State s;
        s.n = x.size(0), s.heads = heads;
        s.segments = segments::make(k_caches, v_caches, starts, counts, s.n, static_cast<int64_t>(layers_.size()), kv_heads_,
                                    head_dim_, cos_.size(0));
        const int64_t n = s.n;
        auto logits = torch::empty({static_cast<int64_t>(heads.size()), lm_head_.total}, x.options());
        s.logits = logits.data_ptr<float>();
        const torch::Tensor xc = x.contiguous();
        s.x.assign(xc.data_ptr<float>(), xc.data_ptr<float>() + n * D);
        const int64_t inter = layers_.empty() ? 0 : layers_[0].down.in;
        s.h.resize(n * D), s.y.resize(n * D), s.qkv.resize(n * (heads_ + 2 * kv_heads_) * head_dim_);
        s.attn.resize(n * heads_ * head_dim_), s.gate_up.resize(n * 2 * inter), s.act.resize(n * inter);
        if (!layers_.empty())
            for (int i = 0; i < 4; ++i) s.acts[i].init(needs_[i], n);
        s.a_head.init(Needs(lm_head_), static_cast<int64_t>(heads.size()));
        const int threads = at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(threads)
        run(s, omp_get_thread_num(), omp_get_num_threads());
        return logits;
    }

    static int64_t share(int64_t total, int t, int T) { return total * t / T; }

    // RMS norm of m rows of s.x (rows[r], or r without ``rows``) into s.h rows 0 .. m - 1, quantized
    // into a: this thread's rows.
    void norm_rows(State& s, const float* weight, const int64_t* rows, int64_t m, MatrixActs& a, int t, int T) const {
        const int64_t D = hidden_;
        const int64_t lo = share(m, t, T), hi = share(m, t + 1, T);
        for (int64_t r = lo; r < hi; ++r)
            rms_row(s.x.data() + (rows ? rows[r] : r) * D, weight, D, static_cast<float>(eps_), s.h.data() + r * D);
        if (hi > lo) a.quantize_rows(s.h.data() + lo * D, lo, hi);
    }

    // y = m(activations) for this thread's outputs, then x += y on them (the residual).
    void add_outputs(State& s, const Matrix& m, const MatrixActs& a, int t, int T) const {
        const int64_t D = hidden_, lo = share(D, t, T), hi = share(D, t + 1, T);
        outputs(m, a, lo, hi, s.y.data());
        for (int64_t r = 0; r < s.n; ++r)
            for (int64_t j = lo; j < hi; ++j) s.x[r * D + j] = s.x[r * D + j] + s.y[r * D + j];
    }

    void run(State& s, int t, int T) const {
        const int64_t n = s.n, d = head_dim_, hq = heads_, hkv = kv_heads_;
        const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
        std::vector<float> scores;  // attention's scratch
        for (size_t li = 0; li < layers_.size(); ++li) {
            const Layer& L = layers_[li];
            const int64_t width = L.qkv.total, inter = L.down.in;
            norm_rows(s, L.in_norm.data_ptr<float>(), nullptr, n, s.acts[0], t, T);
#pragma omp barrier
            outputs(L.qkv, s.acts[0], share(width, t, T), share(width, t + 1, T), s.qkv.data());
#pragma omp barrier
            const int64_t tasks = static_cast<int64_t>(s.segments.size()) * hkv;  // (segment, kv head)
            for (int64_t task = share(tasks, t, T); task < share(tasks, t + 1, T); ++task) {
                const segments::Segment& seg = s.segments[task / hkv];
                const int64_t g = task % hkv, slot0 = (li * hkv + g) * seg.capacity;
                attention::rope_write_attend(s.qkv.data() + seg.row0 * width, width, seg.n, seg.start, g, hq, hkv, d,
                                             L.bias.numel() ? L.bias.data_ptr<float>() : nullptr, cos_.data_ptr<float>(),
                                             sin_.data_ptr<float>(), seg.k + slot0 * d, seg.v + slot0 * d, scale,
                                             s.attn.data() + seg.row0 * hq * d, scores);
            }
#pragma omp barrier
            s.acts[1].quantize(s.attn.data(), t, T);
#pragma omp barrier
            add_outputs(s, L.o, s.acts[1], t, T);
#pragma omp barrier
            norm_rows(s, L.post_norm.data_ptr<float>(), nullptr, n, s.acts[2], t, T);
#pragma omp barrier
            outputs(L.gate_up, s.acts[2], share(2 * inter, t, T), share(2 * inter, t + 1, T), s.gate_up.data());
#pragma omp barrier
            const int64_t k0 = share(inter / 8, t, T) * 8, k1 = share(inter / 8, t + 1, T) * 8;
            for (int64_t r = 0; r < n; ++r) {
                const float* gu = s.gate_up.data() + r * 2 * inter;
                glu_span(gu + k0, gu + inter + k0, k1 - k0, s.act.data() + r * inter + k0);
            }
#pragma omp barrier
            s.acts[3].quantize(s.act.data(), t, T);
#pragma omp barrier
            add_outputs(s, L.down, s.acts[3], t, T);
#pragma omp barrier
        }
        const int64_t m = static_cast<int64_t>(s.heads.size()), V = lm_head_.total;
        if (m == 0) return;
        norm_rows(s, norm_.data_ptr<float>(), s.heads.data(), m, s.a_head, t, T);
#pragma omp barrier
        outputs(lm_head_, s.a_head, share(V, t, T), share(V, t + 1, T), s.logits);
    }

    void keep(const Parts& parts) {  // the planes the parts point into
        for (const auto& part : parts)
            for (const auto& plane : std::get<2>(part)) keep_.push_back(plane);
    }

    int64_t heads_, kv_heads_, head_dim_, hidden_ = 0;
    double eps_;
    torch::Tensor cos_, sin_, norm_;
    Matrix lm_head_;
    std::vector<Layer> layers_;
    std::vector<Needs> needs_;  // the activations of every layer's qkv, o, gate_up and down
    std::vector<torch::Tensor> keep_;
};

}  // namespace

// y [n, sum of parts' out] = residual + T(x) @ concat(parts).T; each part: (type, out, planes).
// T (``pre``): none; RMS norm with ``norm`` weights and ``eps``; or the SiLU-gated product of
// x = [gate | up] (x has twice the parts' inputs). ``residual`` [n, out], when given, is added to
// each output after its dot product.
torch::Tensor linear_gguf(const torch::Tensor& x, const Parts& parts, int64_t pre, const c10::optional<torch::Tensor>& norm_opt,
                          double eps, const c10::optional<torch::Tensor>& residual_opt) {
    const torch::Tensor norm = norm_opt.value_or(torch::Tensor()), residual = residual_opt.value_or(torch::Tensor());
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be [n, in] float32");
    TORCH_CHECK(pre == PRE_NONE || pre == PRE_RMS || pre == PRE_GLU, "pre must be 0 (none), 1 (rms) or 2 (glu)");
    const int64_t n = x.size(0), in = pre == PRE_GLU ? x.size(1) / 2 : x.size(1);
    TORCH_CHECK(pre != PRE_GLU || x.size(1) == 2 * in, "a gated input has an even width");
    TORCH_CHECK(pre != PRE_RMS || (norm.defined() && norm.numel() == in && norm.is_contiguous() && norm.scalar_type() == torch::kFloat32),
                "the norm weight must be [in] float32");
    const Matrix m = make_matrix(parts, in);
    const bool add = residual.defined();
    TORCH_CHECK(!add || (residual.dim() == 2 && residual.size(0) == n && residual.size(1) == m.total &&
                         residual.is_contiguous() && residual.scalar_type() == torch::kFloat32),
                "the residual must be [n, out] float32");
    auto y = torch::empty({n, m.total}, x.options());
    if (n == 0) return y;
    std::vector<float> buf;
    const float* xs = prepare(x, pre, norm, eps, in, buf);
    MatrixActs a;
    if (m.need_k) a.k = quantize(xs, n, in, 256, m.orders);
    if (m.need_32) a.b32 = quantize(xs, n, in, 32);
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, m.total, 8, [&](int64_t begin, int64_t end) { outputs(m, a, begin, end, yp); });
    if (add) {  // one float add per output, after its dot product: rows stay independent
        const float* rp = residual.data_ptr<float>();
        for (int64_t i = 0; i < n * m.total; ++i) yp[i] = rp[i] + yp[i];
    }
    return y;
}

// Rows ``ids`` of one part as float32 [len(ids), in]: embedding lookups of a quantized table.
torch::Tensor dequantize_rows(int64_t type, int64_t out, int64_t in, const std::vector<torch::Tensor>& planes,
                              const torch::Tensor& ids) {
    const Part w = make_part(static_cast<int>(type), out, in, planes);
    TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.dim() == 1, "ids must be a 1-D int64 tensor");
    auto y = torch::empty({ids.size(0), in}, torch::kFloat32);
    const int64_t* id = ids.contiguous().data_ptr<int64_t>();
    for (int64_t r = 0; r < ids.size(0); ++r) {
        const int64_t j = id[r];
        TORCH_CHECK(0 <= j && j < out, "row ", j, " out of range");
        float* yr = y.data_ptr<float>() + r * in;
        for (int64_t b = 0; b < w.nb; ++b) {
            const int64_t i = j * w.nb + b;
            if (is_k(w.type)) {
                uint8_t v[256];
                int16_t sc16[16], mn16[16];
                decode_k(w, j, b, v, sc16, mn16);
                for (int k = 0; k < 256; ++k) {
                    const int g = k / 16;
                    yr[b * 256 + k] = w.type == Q6_K ? w.d[i] * float(sc16[g]) * float(int(v[k]) - 32)
                                                     : w.d[i] * float(sc16[g]) * float(v[k]) - w.dm[i] * float(mn16[g]);
                }
            } else {
                int8_t v[32];
                decode_32(w, j, b, v);
                for (int k = 0; k < 32; ++k) yr[b * 32 + k] = w.d[i] * float(v[k]) + (w.dm ? w.dm[i] : 0.f);
            }
        }
    }
    return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("linear_gguf", &linear_gguf, "batch-invariant residual + T(x) @ W.T with W in GGUF block formats, as (type, "
          "out, planes) parts; T: 0 none, 1 RMS norm, 2 SiLU-gated",
          py::arg("x"), py::arg("parts"), py::arg("pre") = 0, py::arg("norm") = py::none(), py::arg("eps") = 0.0,
          py::arg("residual") = py::none());
    m.def("dequantize_rows", &dequantize_rows, "float rows of a GGUF-quantized weight");
    py::class_<GGUFForward>(m, "GGUFForward")
        .def(py::init<int64_t, int64_t, int64_t, double, torch::Tensor, torch::Tensor, torch::Tensor, const Parts&,
                      const std::vector<GGUFForward::LayerArgs>&>())
        .def("forward", &GGUFForward::forward, "logits of rows through every layer, writing their keys and values",
             py::arg("x"), py::arg("k_cache"), py::arg("v_cache"), py::arg("start"), py::arg("last_only"),
             py::arg("head") = true)
        .def("forward_batch", &GGUFForward::forward_batch, "logits of several sequences' rows in one forward",
             py::arg("x"), py::arg("k_caches"), py::arg("v_caches"), py::arg("starts"), py::arg("counts"),
             py::arg("last_only"));
    m.def("avx2", &lanes::avx2, "whether this build uses AVX2 (else the portable C++ build)");
    m.def("isa", [] {
#if defined(GGUF_VNNI)
        return "vnni";
#else
        return lanes::avx2() ? "avx2" : "portable";
#endif
    }, "this build's name: portable, avx2 or vnni (native.GGUF_ISAS)");
}
