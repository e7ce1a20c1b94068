// Batch-invariant small-batch linear layer for x86-64 CPUs with AVX2 and FMA.
//
// y[n, out] = x[n, in] . w[out, in]^T, where every output element is computed the same way
// whatever n is: one 8-lane FMA accumulator walks k = 0, 8, 16, ... in order, then a fixed
// horizontal sum, then a scalar tail in order. Rows and outputs are only grouped in registers
// (to reuse each loaded weight vector for up to 3 rows), which never changes an element's
// arithmetic, and threads split the outputs, never a reduction. So a row gets the same bits
// alone (plain decoding) as inside a verify batch, and, unlike BLAS GEMM, one row needs no
// weight packing: the weights stream from memory once per call, which is what bounds decoding.
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>

namespace {

// Eight weights as floats: a plain load, or int8 widened (sign-extend, then convert exactly).
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const int8_t* w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 sh = _mm_movehdup_ps(s);
    s = _mm_add_ps(s, sh);
    sh = _mm_movehl_ps(sh, s);
    return _mm_cvtss_f32(_mm_add_ss(s, sh));
}

// Software prefetch, floats ahead in each weight row (512 bytes). It helps the multi-row tiles
// (4 weight streams per thread) but slows the one-row tile (8 streams), which the hardware
// prefetcher serves better alone: 254 against 266 ms for a step of the 1.5B target, 2026-11-22.
constexpr int64_t PREFETCH = 128;

// One register tile: JB outputs x RB rows over k in [k0, k1). The accumulators live in ``acc``
// between calls, so a reduction split into k-chunks performs exactly the FMAs of an unsplit one.
template <int JB, int RB, typename W>
inline void tile(const float* x, const W* w, __m256* acc, int64_t in, int64_t j0, int64_t r0,
                 int64_t k0, int64_t k1, bool prefetch) {
    __m256 a_[JB][RB];
    for (int a = 0; a < JB; ++a)
        for (int b = 0; b < RB; ++b) a_[a][b] = acc[a * RB + b];
    for (int64_t k = k0; k < k1; k += 8) {
        __m256 xv[RB];
        for (int b = 0; b < RB; ++b) xv[b] = _mm256_loadu_ps(x + (r0 + b) * in + k);
        for (int a = 0; a < JB; ++a) {
            const W* wk = w + (j0 + a) * in + k;
            if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(wk + PREFETCH), _MM_HINT_T0);
            const __m256 wv = load8(wk);
            for (int b = 0; b < RB; ++b) a_[a][b] = _mm256_fmadd_ps(wv, xv[b], a_[a][b]);
        }
    }
    for (int a = 0; a < JB; ++a)
        for (int b = 0; b < RB; ++b) acc[a * RB + b] = a_[a][b];
}

// The fixed epilogue of every output element: horizontal sum, then the scalar tail in order.
template <int JB, int RB, typename W>
inline void finish(const float* x, const W* w, const float* scale, float* y, const __m256* acc,
                   int64_t in, int64_t out, int64_t j0, int64_t r0) {
    const int64_t kv = in & ~int64_t(7);
    for (int a = 0; a < JB; ++a) {
        for (int b = 0; b < RB; ++b) {
            float s = hsum(acc[a * RB + b]);
            for (int64_t k = kv; k < in; ++k) s += float(w[(j0 + a) * in + k]) * x[(r0 + b) * in + k];
            y[(r0 + b) * out + j0 + a] = scale ? s * scale[j0 + a] : s;
        }
    }
}

template <int JB, int RB, typename W>
inline void whole(const float* x, const W* w, const float* scale, float* y, int64_t in, int64_t out,
                  int64_t j0, int64_t r0) {
    __m256 acc[JB * RB];
    for (auto& v : acc) v = _mm256_setzero_ps();
    tile<JB, RB>(x, w, acc, in, j0, r0, 0, in & ~int64_t(7), RB > 1);
    finish<JB, RB>(x, w, scale, y, acc, in, out, j0, r0);
}

template <int JB, int RB, typename W>
inline void row_groups(const float* x, const W* w, __m256* acc, int64_t n, int64_t in,
                       int64_t j0, int64_t k0, int64_t k1) {
    int64_t r = 0;
    for (; r + RB <= n; r += RB) tile<JB, RB>(x, w, acc + r * JB, in, j0, r, k0, k1, r == 0);
    if (n - r == 2) tile<JB, 2>(x, w, acc + r * JB, in, j0, r, k0, k1, r == 0);
    if (n - r == 1) tile<JB, 1>(x, w, acc + r * JB, in, j0, r, k0, k1, r == 0);
}

template <int JB, int RB, typename W>
inline void finish_groups(const float* x, const W* w, const float* scale, float* y,
                          const __m256* acc, int64_t n, int64_t in, int64_t out, int64_t j0) {
    int64_t r = 0;
    for (; r + RB <= n; r += RB) finish<JB, RB>(x, w, scale, y, acc + r * JB, in, out, j0, r);
    if (n - r == 2) finish<JB, 2>(x, w, scale, y, acc + r * JB, in, out, j0, r);
    if (n - r == 1) finish<JB, 1>(x, w, scale, y, acc + r * JB, in, out, j0, r);
}

constexpr int64_t MAX_ROWS = 63;  // rows per pass (a multiple of 3): the accumulators fit in 8 KB
constexpr int64_t K_CHUNK = 128;  // floats of k per pass over the row groups, measured best

// Tiles are chosen for speed only. One row: 8x1 keeps 8 weight streams in flight. Several rows:
// 4x3 (12 of 16 registers) reuses each weight load 3 times, and k is walked in chunks, each chunk
// visiting every row group while its 4 x 512 bytes of weights sit in L1. So the weights stream
// from memory once per call however many rows there are, and the accumulators carry over chunks.
template <int JB, typename W>
void all_rows(const float* x, const W* w, const float* scale, float* y, int64_t n, int64_t in,
              int64_t out, int64_t j0) {
    constexpr int JH = JB / 2;
    if (n <= 3) {  // a single row group: one pass over k, no accumulator round trips
        if (n == 1) whole<JB, 1>(x, w, scale, y, in, out, j0, 0);
        if (n == 2) for (int64_t jj = j0; jj < j0 + JB; jj += JH) whole<JH, 2>(x, w, scale, y, in, out, jj, 0);
        if (n == 3) for (int64_t jj = j0; jj < j0 + JB; jj += JH) whole<JH, 3>(x, w, scale, y, in, out, jj, 0);
        return;
    }
    const int64_t kv = in & ~int64_t(7);
    alignas(32) __m256 acc[MAX_ROWS * JH];
    for (int64_t jj = j0; jj < j0 + JB; jj += JH) {
        for (int64_t r0 = 0; r0 < n; r0 += MAX_ROWS) {  // rows are independent: slicing is exact
            const int64_t rows = std::min(MAX_ROWS, n - r0);
            const float* xr = x + r0 * in;
            float* yr = y + r0 * out;
            for (int64_t i = 0; i < rows * JH; ++i) acc[i] = _mm256_setzero_ps();
            for (int64_t k0 = 0; k0 < kv; k0 += K_CHUNK)
                row_groups<JH, 3>(xr, w, acc, rows, in, jj, k0, std::min(k0 + K_CHUNK, kv));
            finish_groups<JH, 3>(xr, w, scale, yr, acc, rows, in, out, jj);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("linear_rows", &linear_rows, "batch-invariant x @ w.T for small batches (AVX2/FMA)");
    m.def("linear_rows_int8", &linear_rows_int8, "batch-invariant (x @ w.T) * scale, int8 w");
}
