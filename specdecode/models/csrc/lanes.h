// Eight float lanes with the same operations in the AVX2 build (one YMM register) and the
// portable build (plain C++ loops, std::fma): both round every lane alike, so kernels written on
// V8 give the same bits in either build. Included by the kernels that promise that.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace lanes {

// Whether this build is the AVX2 one (else the portable one); each extension exports it.
inline bool avx2() {
#if defined(__AVX2__)
    return true;
#else
    return false;
#endif
}

#if defined(__AVX2__)
struct V8 {
    __m256 v;
};
inline V8 load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void store(float* p, V8 a) { _mm256_storeu_ps(p, a.v); }
inline V8 splat(float x) { return {_mm256_set1_ps(x)}; }
inline V8 add(V8 a, V8 b) { return {_mm256_add_ps(a.v, b.v)}; }
inline V8 sub(V8 a, V8 b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline V8 mul(V8 a, V8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline V8 fma(V8 a, V8 b, V8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline V8 vmax(V8 a, V8 b) { return {_mm256_max_ps(a.v, b.v)}; }
inline V8 div(V8 a, V8 b) { return {_mm256_div_ps(a.v, b.v)}; }
inline V8 neg_abs(V8 a) { return {_mm256_or_ps(a.v, _mm256_set1_ps(-0.0f))}; }  // -|a|: the sign bit set
// Lanes of a where x >= 0 (NaN: b), else lanes of b.
inline V8 select_nonneg(V8 x, V8 a, V8 b) {
    return {_mm256_blendv_ps(b.v, a.v, _mm256_cmp_ps(x.v, _mm256_setzero_ps(), _CMP_GE_OQ))};
}
// 2^n for integer-valued n in [-126, 127], through the exponent bits.
inline V8 pow2(V8 n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23);
    return {_mm256_castsi256_ps(e)};
}
#else
struct V8 {
    float f[8];
};
inline V8 load(const float* p) { V8 r; std::memcpy(r.f, p, sizeof r.f); return r; }
inline void store(float* p, V8 a) { std::memcpy(p, a.f, sizeof a.f); }
inline V8 splat(float x) { V8 r; for (float& f : r.f) f = x; return r; }
#define LANES(expr) V8 r; for (int l = 0; l < 8; ++l) r.f[l] = (expr); return r
inline V8 add(V8 a, V8 b) { LANES(a.f[l] + b.f[l]); }
inline V8 sub(V8 a, V8 b) { LANES(a.f[l] - b.f[l]); }
inline V8 mul(V8 a, V8 b) { LANES(a.f[l] * b.f[l]); }
inline V8 fma(V8 a, V8 b, V8 c) { LANES(std::fma(a.f[l], b.f[l], c.f[l])); }
inline V8 vmax(V8 a, V8 b) { LANES(a.f[l] > b.f[l] ? a.f[l] : b.f[l]); }  // as MAXPS: b unless a > b
inline V8 div(V8 a, V8 b) { LANES(a.f[l] / b.f[l]); }
inline V8 neg_abs(V8 a) { LANES(-std::fabs(a.f[l])); }
inline V8 select_nonneg(V8 x, V8 a, V8 b) { LANES(x.f[l] >= 0.f ? a.f[l] : b.f[l]); }
inline V8 pow2(V8 n) {
    V8 r;
    for (int l = 0; l < 8; ++l) {
        const int32_t bits = (static_cast<int32_t>(std::nearbyint(n.f[l])) + 127) << 23;
        std::memcpy(&r.f[l], &bits, 4);
    }
    return r;
}
#undef LANES
#endif

// Lanes 0..7 summed in a fixed tree: ((f0 + f4) + (f2 + f6)) + ((f1 + f5) + (f3 + f7)). The AVX2
// version adds the halves, then the halves of that, then the last two: the same tree in registers.
inline float reduce8(V8 a) {
#if defined(__AVX2__)
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));  // f0+f4 .. f3+f7
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));  // (f0+f4)+(f2+f6), (f1+f5)+(f3+f7)
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
#else
    alignas(32) float f[8];
    store(f, a);
    return ((f[0] + f[4]) + (f[2] + f[6])) + ((f[1] + f[5]) + (f[3] + f[7]));
#endif
}

// exp(x) for x <= 0 (scores minus their max): x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-6
// polynomial (relative error below 2e-7), times 2^n. Arguments below -87 count as -87
// (exp(-87) = 1.6e-38, a weight no sum can notice).
inline V8 exp8(V8 x) {
    x = vmax(x, splat(-87.0f));
    // n = round(x / ln2): adding and subtracting 1.5 * 2^23 rounds to the nearest integer.
    const V8 magic = splat(12582912.0f);
    const V8 n = sub(add(mul(x, splat(1.44269504f)), magic), magic);
    V8 r = fma(n, splat(-0.693145752f), x);  // ln2 in two parts: r = x - n ln2 exactly enough
    r = fma(n, splat(-1.42860677e-06f), r);
    V8 p = splat(1.38888891e-3f);
    p = fma(p, r, splat(8.33333377e-3f));
    p = fma(p, r, splat(4.16666679e-2f));
    p = fma(p, r, splat(1.66666672e-1f));
    p = fma(p, r, splat(0.5f));
    p = fma(p, r, splat(1.0f));
    p = fma(p, r, splat(1.0f));
    return mul(p, pow2(n));
}

}  // namespace lanes
