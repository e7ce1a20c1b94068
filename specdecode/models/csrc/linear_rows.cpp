// Batch-invariant small-batch linear layer for x86-64 CPUs with AVX2 and FMA (AVX-512 when built for it).
//
// y[n, out] = x[n, in] . w[out, in]^T, where every output element is computed the same way
// whatever n is: one L-lane FMA accumulator walks k = 0, L, 2L, ... in order, then a fixed
// horizontal sum, then a scalar tail in order. Rows and outputs are only grouped in registers
// (to reuse each loaded weight vector for several rows), which never changes an element's
// arithmetic, and threads split the outputs, never a reduction. So a row gets the same bits
// alone (plain decoding) as inside a verify batch, and, unlike BLAS GEMM, one row needs no
// weight packing: the weights stream from memory once per call, which is what bounds decoding.
//
// The lane count L is fixed per build (16 with AVX-512, else 8), so it changes bits between
// builds but never between calls of one build, which is all exactness needs.
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>

namespace {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t L = 16;
constexpr int RB = 6;  // rows per register tile: 4 x 6 accumulators of 32 registers
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
// L weights as floats: a plain load, or int8 widened (sign-extend, then convert exactly).
inline Vec load_w(const float* w) { return _mm512_loadu_ps(w); }
inline Vec load_w(const int8_t* w) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}
inline __m256 fold(Vec v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }
#else
using Vec = __m256;
constexpr int64_t L = 8;
constexpr int RB = 3;  // 4 x 3 accumulators of 16 registers
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec load_w(const float* w) { return _mm256_loadu_ps(w); }
inline Vec load_w(const int8_t* w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}
inline __m256 fold(Vec v) { return v; }
#endif

inline float hsum(Vec v) {
    const __m256 h = fold(v);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    __m128 sh = _mm_movehdup_ps(s);
    s = _mm_add_ps(s, sh);
    sh = _mm_movehl_ps(sh, s);
    return _mm_cvtss_f32(_mm_add_ss(s, sh));
}

// Software prefetch, floats ahead in each weight row (512 bytes). It helps the multi-row tiles
// (4 weight streams per thread) but slows the one-row tile (8 streams), which the hardware
// prefetcher serves better alone (docs/PERFORMANCE.md, "Design choices and their measurements").
constexpr int64_t PREFETCH = 128;

// One register tile: JB outputs x R rows over k in [k0, k1). The accumulators live in ``acc``
// between calls, so a reduction split into k-chunks performs exactly the FMAs of an unsplit one.
template <int JB, int R, typename W>
inline void tile(const float* x, const W* w, Vec* acc, int64_t in, int64_t j0, int64_t r0,
                 int64_t k0, int64_t k1, bool prefetch) {
    Vec a_[JB][R];
    for (int a = 0; a < JB; ++a)
        for (int b = 0; b < R; ++b) a_[a][b] = acc[a * R + b];
    for (int64_t k = k0; k < k1; k += L) {
        Vec xv[R];
        for (int b = 0; b < R; ++b) xv[b] = vload(x + (r0 + b) * in + k);
        for (int a = 0; a < JB; ++a) {
            const W* wk = w + (j0 + a) * in + k;
            if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(wk + PREFETCH), _MM_HINT_T0);
            const Vec wv = load_w(wk);
            for (int b = 0; b < R; ++b) a_[a][b] = vfma(wv, xv[b], a_[a][b]);
        }
    }
    for (int a = 0; a < JB; ++a)
        for (int b = 0; b < R; ++b) acc[a * R + b] = a_[a][b];
}

// The fixed epilogue of every output element: horizontal sum, then the scalar tail in order.
template <int JB, int R, typename W>
inline void finish(const float* x, const W* w, const float* scale, float* y, const Vec* acc,
                   int64_t in, int64_t out, int64_t j0, int64_t r0) {
    const int64_t kv = in & ~(L - 1);
    for (int a = 0; a < JB; ++a) {
        for (int b = 0; b < R; ++b) {
            float s = hsum(acc[a * R + b]);
            for (int64_t k = kv; k < in; ++k) s += float(w[(j0 + a) * in + k]) * x[(r0 + b) * in + k];
            y[(r0 + b) * out + j0 + a] = scale ? s * scale[j0 + a] : s;
        }
    }
}

template <int JB, int R, typename W>
inline void whole(const float* x, const W* w, const float* scale, float* y, int64_t in, int64_t out,
                  int64_t j0, int64_t r0) {
    Vec acc[JB * R];
    for (auto& v : acc) v = vzero();
    tile<JB, R>(x, w, acc, in, j0, r0, 0, in & ~(L - 1), R > 1);
    finish<JB, R>(x, w, scale, y, acc, in, out, j0, r0);
}

// ``whole`` for a group of ``rows`` (1..R) rows, choosing the tile height at compile time.
template <int JB, int R, typename W>
inline void whole_rows(int64_t rows, const float* x, const W* w, const float* scale, float* y, int64_t in,
                       int64_t out, int64_t j0) {
    if constexpr (R > 0) {
        if (rows == R) return whole<JB, R>(x, w, scale, y, in, out, j0, 0);
        whole_rows<JB, R - 1>(rows, x, w, scale, y, in, out, j0);
    }
}

// The last ``rows`` (< RB) rows of a pass: one shorter tile, on their own accumulators.
template <int JB, int R, typename W>
inline void tile_rest(int64_t rows, const float* x, const W* w, Vec* acc, int64_t in, int64_t j0,
                      int64_t r0, int64_t k0, int64_t k1) {
    if constexpr (R > 0) {
        if (rows == R) return tile<JB, R>(x, w, acc, in, j0, r0, k0, k1, r0 == 0);
        tile_rest<JB, R - 1>(rows, x, w, acc, in, j0, r0, k0, k1);
    }
}

template <int JB, int R, typename W>
inline void finish_rest(int64_t rows, const float* x, const W* w, const float* scale, float* y,
                        const Vec* acc, int64_t in, int64_t out, int64_t j0, int64_t r0) {
    if constexpr (R > 0) {
        if (rows == R) return finish<JB, R>(x, w, scale, y, acc, in, out, j0, r0);
        finish_rest<JB, R - 1>(rows, x, w, scale, y, acc, in, out, j0, r0);
    }
}

template <int JB, typename W>
inline void row_groups(const float* x, const W* w, Vec* acc, int64_t n, int64_t in,
                       int64_t j0, int64_t k0, int64_t k1) {
    int64_t r = 0;
    for (; r + RB <= n; r += RB) tile<JB, RB>(x, w, acc + r * JB, in, j0, r, k0, k1, r == 0);
    tile_rest<JB, RB - 1>(n - r, x, w, acc + r * JB, in, j0, r, k0, k1);
}

template <int JB, typename W>
inline void finish_groups(const float* x, const W* w, const float* scale, float* y,
                          const Vec* acc, int64_t n, int64_t in, int64_t out, int64_t j0) {
    int64_t r = 0;
    for (; r + RB <= n; r += RB) finish<JB, RB>(x, w, scale, y, acc + r * JB, in, out, j0, r);
    finish_rest<JB, RB - 1>(n - r, x, w, scale, y, acc + r * JB, in, out, j0, r);
}

constexpr int64_t MAX_ROWS = RB * (64 / RB);  // rows per pass: the accumulators fit in L1
constexpr int64_t K_CHUNK = 128;  // floats of k per pass over the row groups, measured best

// Tiles are chosen for speed only. One row: 8x1 keeps 8 weight streams in flight. Several rows:
// 4 x RB reuses each weight load RB times, and k is walked in chunks, each chunk visiting every
// row group while its 4 x 512 bytes of weights sit in L1. So the weights stream from memory once
// per call however many rows there are, and the accumulators carry over chunks.
template <int JB, typename W>
void all_rows(const float* x, const W* w, const float* scale, float* y, int64_t n, int64_t in,
              int64_t out, int64_t j0) {
    constexpr int JH = JB / 2;
    if (n == 1) return whole<JB, 1>(x, w, scale, y, in, out, j0, 0);
    if (n <= RB) {  // a single row group: one pass over k, no accumulator round trips
        for (int64_t jj = j0; jj < j0 + JB; jj += JH) whole_rows<JH, RB>(n, x, w, scale, y, in, out, jj);
        return;
    }
    const int64_t kv = in & ~(L - 1);
    alignas(64) Vec acc[MAX_ROWS * JH];
    for (int64_t jj = j0; jj < j0 + JB; jj += JH) {
        for (int64_t r0 = 0; r0 < n; r0 += MAX_ROWS) {  // rows are independent: slicing is exact
            const int64_t rows = std::min(MAX_ROWS, n - r0);
            const float* xr = x + r0 * in;
            float* yr = y + r0 * out;
            for (int64_t i = 0; i < rows * JH; ++i) acc[i] = vzero();
            for (int64_t k0 = 0; k0 < kv; k0 += K_CHUNK)
                row_groups<JH>(xr, w, acc, rows, in, jj, k0, std::min(k0 + K_CHUNK, kv));
            finish_groups<JH>(xr, w, scale, yr, acc, rows, in, out, jj);
        }
    }
}


template <typename W>
torch::Tensor run(const torch::Tensor& x, const W* wp, const float* scale, int64_t out) {
    const int64_t n = x.size(0), in = x.size(1);
    auto y = torch::empty({n, out}, x.options());
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    constexpr int64_t JB = 8;
    const int64_t blocks = out / JB;
    at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) all_rows<JB>(xp, wp, scale, yp, n, in, out, b * JB);
    });
    for (int64_t j = blocks * JB; j < out; ++j)  // the last out % 8 outputs, one at a time
        for (int64_t r = 0; r < n; ++r) whole<1, 1>(xp, wp, scale, yp, in, out, j, r);
    return y;
}

void check_x(const torch::Tensor& x, const torch::Tensor& w) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "need x [n, in], w [out, in]");
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "x must be float32");
    TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "contiguous inputs only");
}

}  // namespace

torch::Tensor linear_rows(const torch::Tensor& x, const torch::Tensor& w) {
    check_x(x, w);
    TORCH_CHECK(w.scalar_type() == torch::kFloat32, "float32 weights only");
    return run(x, w.data_ptr<float>(), nullptr, w.size(0));
}

torch::Tensor linear_rows_int8(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale) {
    check_x(x, w);
    TORCH_CHECK(w.scalar_type() == torch::kInt8, "int8 weights only");
    TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.numel() == w.size(0),
                "need one float32 scale per output");
    return run(x, w.data_ptr<int8_t>(), scale.data_ptr<float>(), w.size(0));
}

int64_t lanes() { return L; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("linear_rows", &linear_rows, "batch-invariant x @ w.T for small batches (AVX2/FMA or AVX-512)");
    m.def("linear_rows_int8", &linear_rows_int8, "batch-invariant (x @ w.T) * scale, int8 w");
    m.def("lanes", &lanes, "floats per accumulator of this build (8: AVX2, 16: AVX-512)");
}
