// Int4 weight, int8 activation linear layer for draft models on x86-64 CPUs: AVX2, or AVX-512
// VNNI where the CPU has it.
//
// A draft's numerics never affect exactness (the target verifies every token it proposes), so
// its few decode rows may take the cheapest arithmetic that keeps it agreeing with the target:
// weights as signed 4-bit values with one float scale per group of 64 inputs, activations
// quantized to int8 per row per call, products summed in int32. A decode step then reads 4.5
// bits per weight instead of fbgemm's 8.
//
// Layout: packed[n, g*32 + j] holds weight (n, g*64 + j) in its low nibble and (n, g*64 + 32 + j)
// in its high nibble, each stored as value + 8 (0..15). Both instruction sets multiply unsigned
// by signed bytes, so the activations go unsigned (xq + 128) and the weights signed (nibble - 8);
// the 128 * sum(w) the offset adds is a per-output constant, ``offset[n]`` =
// 128 * sum_g s_g * sum(w_g), computed when quantizing.
//
// One group (64 products) is one VPDPBUSD with AVX-512 VNNI. With AVX2 it is two VPMADDUBSW
// (pairs of u8 * s8 into int16: at most 2 * 255 * 8 = 4080, so neither they nor the sum of the
// two halves can saturate) and one VPMADDWD against ones (into int32). The compiler flags choose
// the build (``native.int4_flags()``); both give the same integers per group, so the two builds
// differ only in the float accumulation order.
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

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

inline float dot(const float* a, const float* b, int64_t d) {
    Acc acc = acc_zero();
    int64_t k = 0;
    for (; k + LANES <= d; k += LANES) acc = acc_fma(acc_load(a + k), acc_load(b + k), acc);
    float s = acc_sum(acc);
    for (; k < d; ++k) s += a[k] * b[k];
    return s;
}

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

void rms_norm(const float* x, const float* w, int64_t n, int64_t d, float eps, float* y) {
    for (int64_t r = 0; r < n; ++r) {
        float ss = 0.f;
        for (int64_t k = 0; k < d; ++k) ss += x[r * d + k] * x[r * d + k];
        const float inv = 1.f / std::sqrt(ss / d + eps);
        for (int64_t k = 0; k < d; ++k) y[r * d + k] = w[k] * (x[r * d + k] * inv);
    }
}

// Rotate-half RoPE of one head vector in place (HF layout).
void rope(float* v, const float* cos, const float* sin, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t k = 0; k < half; ++k) {
        const float a = v[k], b = v[k + half];
        v[k] = a * cos[k] - b * sin[k];
        v[k + half] = b * cos[k + half] + a * sin[k + half];
    }
}

struct Layer {
    const float* in_norm;
    const float* post_norm;
    const float* qkv_bias;  // or nullptr
    Weight qkv, o, gate_up, down;
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

// A whole int4 draft decoder forward for a few decode rows in one call.
//
// Why: through torch, a one-row draft forward spends most of its time outside the int4 linear
// layers, in the dispatch of some 40 small ops per layer, each a few microseconds for a single
// row. Here a layer is plain loops over the same weights and cache. ``python
// scripts/draft_step.py --quantize int4`` times this forward against the torch layers
// (docs/PERFORMANCE.md, "The draft").
// Numerics follow ``Decoder`` in float32 (rms_norm, rotate-half RoPE, causal softmax attention
// with grouped kv heads, SiLU-gated MLP); only the draft uses this, so its rounding is free.
class Int4Draft {
  public:
    // layers[i]: in_norm, post_norm, qkv_bias (empty if none), then packed, scales, offset of
    // qkv, o, gate_up and down. cos/sin: [positions, head_dim]. The tensors are kept alive here.
    Int4Draft(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, torch::Tensor embed,
              torch::Tensor cos, torch::Tensor sin, torch::Tensor norm, std::vector<torch::Tensor> lm_head,
              std::vector<std::vector<torch::Tensor>> layers)
        : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(static_cast<float>(eps)),
          embed_(embed.contiguous()), cos_(cos.contiguous()), sin_(sin.contiguous()), norm_(norm.contiguous()) {
        TORCH_CHECK(lm_head.size() == 3, "lm_head: packed, scales, offset");
        hidden_ = norm_.size(0);
        TORCH_CHECK(!embed_.numel() || embed_.size(1) == hidden_, "embed must be [V, hidden] or empty");
        lm_head_ = Weight(lm_head[0], lm_head[1], lm_head[2]);
        for (auto& t : lm_head) keep_.push_back(t);
        for (auto& l : layers) {
            TORCH_CHECK(l.size() == 15, "each layer needs 15 tensors");
            for (auto& t : l) keep_.push_back(t);
            Layer layer;
            layer.in_norm = l[0].data_ptr<float>();
            layer.post_norm = l[1].data_ptr<float>();
            layer.qkv_bias = l[2].numel() ? l[2].data_ptr<float>() : nullptr;
            layer.qkv = Weight(l[3], l[4], l[5]);
            layer.o = Weight(l[6], l[7], l[8]);
            layer.gate_up = Weight(l[9], l[10], l[11]);
            layer.down = Weight(l[12], l[13], l[14]);
            TORCH_CHECK(layer.qkv.in == hidden_ && layer.qkv.out == (heads + 2 * kv_heads) * head_dim, "bad qkv");
            TORCH_CHECK(layer.o.in == heads * head_dim && layer.o.out == hidden_, "bad o");
            TORCH_CHECK(layer.down.in * 2 == layer.gate_up.out && layer.down.out == hidden_, "bad mlp");
            layers_.push_back(layer);
        }
    }

    // tokens [n] int64 (or their embeddings [n, hidden] float32, for a model built with an empty
    // embed) at cache slots start..start+n-1 of k/v [layers, kv_heads, capacity, head_dim];
    // returns logits [n, V], or [1, V] for the last row with last_only.
    torch::Tensor forward(const torch::Tensor& tokens, torch::Tensor k_cache, torch::Tensor v_cache, int64_t start,
                          bool last_only) {
        const bool embedded = tokens.scalar_type() == torch::kFloat32;
        const int64_t n = tokens.size(0), D = hidden_, d = head_dim_, hq = heads_, hkv = kv_heads_;
        const int64_t capacity = k_cache.size(2), end = start + n;
        TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(0) == (int64_t)layers_.size()
                        && k_cache.size(1) == hkv && k_cache.size(3) == d, "bad kv cache");
        TORCH_CHECK(start >= 0 && end <= capacity && end <= cos_.size(0), "slots past the cache");
        TORCH_CHECK(embedded ? tokens.dim() == 2 && tokens.size(1) == D && n > 0
                             : tokens.scalar_type() == torch::kInt64 && tokens.dim() == 1 && n > 0 && embed_.numel(),
                    "tokens must be [n > 0] int64, or [n > 0, hidden] float32 embeddings");
        const torch::Tensor ids = tokens.contiguous();
        const int64_t inter = layers_.empty() ? 0 : layers_[0].down.in;
        const int64_t widest = std::max({D, hq * d, inter});
        std::vector<float> x(n * D), h(n * D), qkv(n * (hq + 2 * hkv) * d), attn(n * hq * d),
            gu(n * 2 * inter), act(n * inter), tmp(n * D), scores(hq * n * end);
        std::vector<uint8_t> xq(n * widest);
        std::vector<float> xs(n);
        if (embedded) {
            std::copy_n(ids.data_ptr<float>(), n * D, x.data());
        } else {
            const int64_t* tok = ids.data_ptr<int64_t>();
            for (int64_t r = 0; r < n; ++r) {
                TORCH_CHECK(tok[r] >= 0 && tok[r] < embed_.size(0), "token id out of range");
                std::copy_n(embed_.data_ptr<float>() + tok[r] * D, D, x.data() + r * D);
            }
        }
        const float scale = 1.f / std::sqrt(static_cast<float>(d));
        const int64_t width = (hq + 2 * hkv) * d, group = hq / hkv;
        for (size_t li = 0; li < layers_.size(); ++li) {
            const Layer& L = layers_[li];
            float* kc = k_cache.data_ptr<float>() + li * hkv * capacity * d;
            float* vc = v_cache.data_ptr<float>() + li * hkv * capacity * d;
            rms_norm(x.data(), L.in_norm, n, D, eps_, h.data());
            L.qkv.apply(h.data(), n, qkv.data(), xq.data(), xs.data());
            for (int64_t r = 0; r < n; ++r) {
                float* row = qkv.data() + r * width;
                if (L.qkv_bias)
                    for (int64_t j = 0; j < width; ++j) row[j] += L.qkv_bias[j];
                const float* c = cos_.data_ptr<float>() + (start + r) * d;
                const float* s = sin_.data_ptr<float>() + (start + r) * d;
                for (int64_t hd = 0; hd < hq + hkv; ++hd) rope(row + hd * d, c, s, d);
                for (int64_t g = 0; g < hkv; ++g) {
                    std::copy_n(row + (hq + g) * d, d, kc + (g * capacity + start + r) * d);
                    std::copy_n(row + (hq + hkv + g) * d, d, vc + (g * capacity + start + r) * d);
                }
            }
            at::parallel_for(0, hkv, 1, [&](int64_t g0, int64_t g1) {
                for (int64_t g = g0; g < g1; ++g)
                    attend(qkv.data(), width, kc + g * capacity * d, vc + g * capacity * d, g, group, n, start,
                           scale, scores.data(), attn.data());
            });
            L.o.apply(attn.data(), n, tmp.data(), xq.data(), xs.data());
            for (int64_t k = 0; k < n * D; ++k) x[k] += tmp[k];
            rms_norm(x.data(), L.post_norm, n, D, eps_, h.data());
            L.gate_up.apply(h.data(), n, gu.data(), xq.data(), xs.data());
            for (int64_t r = 0; r < n; ++r)
                for (int64_t j = 0; j < inter; ++j) {
                    const float g = gu[r * 2 * inter + j];
                    act[r * inter + j] = g / (1.f + std::exp(-g)) * gu[r * 2 * inter + inter + j];
                }
            L.down.apply(act.data(), n, tmp.data(), xq.data(), xs.data());
            for (int64_t k = 0; k < n * D; ++k) x[k] += tmp[k];
        }
        const int64_t first = last_only ? n - 1 : 0, m = n - first;
        rms_norm(x.data() + first * D, norm_.data_ptr<float>(), m, D, eps_, h.data());
        auto logits = torch::empty({m, lm_head_.out}, norm_.options());
        lm_head_.apply(h.data(), m, logits.data_ptr<float>(), xq.data(), xs.data());
        return logits;
    }

  private:
    // Query heads g*group .. of every row against kv head g; row r sees slots 0..start+r.
    void attend(const float* qkv, int64_t width, const float* k, const float* v, int64_t g, int64_t group,
                int64_t n, int64_t start, float scale, float* scores, float* out) const {
        const int64_t d = head_dim_, hq = heads_;
        for (int64_t r = 0; r < n; ++r) {
            const int64_t len = start + r + 1;
            for (int64_t j = 0; j < group; ++j) {
                const int64_t head = g * group + j;
                const float* q = qkv + r * width + head * d;
                float* p = scores + (head * n + r) * (start + n);
                float top = -INFINITY;
                for (int64_t t = 0; t < len; ++t) {
                    p[t] = dot(q, k + t * d, d) * scale;
                    top = std::max(top, p[t]);
                }
                float sum = 0.f;
                for (int64_t t = 0; t < len; ++t) sum += (p[t] = std::exp(p[t] - top));
                float* o = out + r * hq * d + head * d;
                std::fill_n(o, d, 0.f);
                for (int64_t t = 0; t < len; ++t) {
                    const float w = p[t] / sum;
                    const float* vt = v + t * d;
                    for (int64_t c = 0; c < d; ++c) o[c] += w * vt[c];
                }
            }
        }
    }

    int64_t heads_, kv_heads_, head_dim_, hidden_;
    float eps_;
    torch::Tensor embed_, cos_, sin_, norm_;
    Weight lm_head_;
    std::vector<Layer> layers_;
    std::vector<torch::Tensor> keep_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("lanes", [] { return LANES; },
          "float lanes per accumulator: 16 in the AVX-512 VNNI build, 8 in the AVX2 build");
    m.def("linear_int4", &linear_int4, "int4-weight, int8-activation x @ w.T for draft decode rows (AVX2 or AVX-512 VNNI)");
    pybind11::class_<Int4Draft>(m, "Int4Draft")
        .def(pybind11::init<int64_t, int64_t, int64_t, double, torch::Tensor, torch::Tensor, torch::Tensor,
                            torch::Tensor, std::vector<torch::Tensor>, std::vector<std::vector<torch::Tensor>>>())
        .def("forward", &Int4Draft::forward, "logits of a few decode rows, writing their keys and values");
}
