// Causal grouped-query attention of query rows over a KV cache, one row at a time: batch-invariant
// by construction.
//
// Why by hand: the torch version (``kernels.attention``) relies on BLAS giving a row the same bits
// in every call shape, which holds only because calls are padded and keys blocked, and it costs
// a dozen small ops per layer (with the other small steps of a layer, what
// ``scripts/native_steps.py`` times against the native path). Here a row's arithmetic depends only on its query, the keys it sees and
// their number, in a fixed order, so it gets the same bits alone, among any rows, in a prefill or
// token by token, and the AVX2 build and the portable build (plain C++ lane loops doing the same
// operations) agree bit for bit.
//
// Row i (its query at slot start + i) sees keys 0 .. start + i. Per query head: scores = q . k_j
// (an 8-lane FMA chain over the head dimension, then a fixed reduction tree) times ``scale``;
// m = their max; p_j = exp(s_j - m) by a polynomial (``exp8``: the same operations in both builds,
// unlike libm's exp); out = (sum_j p_j v_j) / (sum_j p_j), both sums running over j in order.
// A task is one row and one kv head: its query heads share each key and value load (the same
// chains as one head at a time, so the bits do not change with the grouping).
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "lanes.h"

namespace {

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

// One row's attention for H query heads of one kv head (their scores in s, H rows of stride ld).
// Keys per score block and value lanes per pass are as many as fit the 16 vector registers.
template <int H>
void head_block(const float* q, const float* k, const float* v, int64_t d, int64_t len, float scale, float* out,
                float* s, int64_t ld) {
    constexpr int J = H == 1 ? 4 : H <= 4 ? 3 : H <= 6 ? 2 : 1;
    constexpr int NV = H == 1 ? 8 : H <= 3 ? 4 : H <= 6 ? 2 : 1;
    int64_t j = 0;
    for (; j + J <= len; j += J) {
        prefetch_lanes(k + (j + KEYS_AHEAD) * d, J * d);
        scores<H, J>(q, k + j * d, d, scale, s + j, ld);
    }
    for (; j < len; ++j) scores<H, 1>(q, k + j * d, d, scale, s + j, ld);
    float inv[H];
    for (int h = 0; h < H; ++h) {
        float* sh = s + h * ld;
        float m = sh[0];
        for (j = 1; j < len; ++j) m = sh[j] > m ? sh[j] : m;
        for (j = len; j < ld; ++j) sh[j] = m;  // padding lanes: computed, never summed
        const V8 mv = splat(m);
        for (j = 0; j < ld; j += 8) store(sh + j, exp8(sub(load(sh + j), mv)));
        float total = 0.f;
        for (j = 0; j < len; ++j) total += sh[j];
        inv[h] = 1.f / total;
    }
    int64_t c = 0;
    for (; c + 8 * NV <= d; c += 8 * NV) weighted_sums<H, NV>(s, ld, v + c, d, len, inv, out + c);
    for (; c < d; c += 8) weighted_sums<H, 1>(s, ld, v + c, d, len, inv, out + c);
}

// One row's attention for the query heads of one kv head, in blocks of up to 8 heads.
void row_group(const float* q, const float* k, const float* v, int64_t group, int64_t d, int64_t len,
               float scale, float* out, std::vector<float>& buf) {
    const int64_t ld = (len + 7) / 8 * 8;
    buf.resize(8 * ld);
    float* s = buf.data();
    for (int64_t h = 0; h < group; h += 8) {
        const float* qh = q + h * d;
        float* oh = out + h * d;
        switch (group - h >= 8 ? 8 : group - h) {
            case 1: head_block<1>(qh, k, v, d, len, scale, oh, s, ld); break;
            case 2: head_block<2>(qh, k, v, d, len, scale, oh, s, ld); break;
            case 3: head_block<3>(qh, k, v, d, len, scale, oh, s, ld); break;
            case 4: head_block<4>(qh, k, v, d, len, scale, oh, s, ld); break;
            case 5: head_block<5>(qh, k, v, d, len, scale, oh, s, ld); break;
            case 6: head_block<6>(qh, k, v, d, len, scale, oh, s, ld); break;
            case 7: head_block<7>(qh, k, v, d, len, scale, oh, s, ld); break;
            default: head_block<8>(qh, k, v, d, len, scale, oh, s, ld); break;
        }
    }
}

}  // namespace

// q [n, hq, d] at cache slots start .. start+n-1; k, v [hkv, capacity, d] (one layer of the cache,
// already holding these rows' keys and values). Row i sees keys 0 .. start+i. -> [n, hq * d].
torch::Tensor attention_rows(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t start,
                             double scale) {
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q [n, hq, d], k and v [hkv, capacity, d]");
    TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
                v.scalar_type() == torch::kFloat32, "float32 only");
    TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "contiguous tensors only");
    const int64_t n = q.size(0), hq = q.size(1), d = q.size(2), hkv = k.size(0), cap = k.size(1);
    TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == d && hkv > 0 && hq % hkv == 0, "mismatched shapes");
    TORCH_CHECK(d % 8 == 0, "head dimension must be a multiple of 8, got ", d);
    TORCH_CHECK(start >= 0 && start + n <= cap, "rows ", start, "..", start + n, " outside the cache");
    auto out = torch::empty({n, hq * d}, q.options());
    const int64_t group = hq / hkv;
    const float* qp = q.data_ptr<float>();
    const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const float sc = static_cast<float>(scale);
    at::parallel_for(0, n * hkv, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> buf;
        for (int64_t t = begin; t < end; ++t) {
            const int64_t i = t / hkv, g = t % hkv;
            row_group(qp + (i * hq + g * group) * d, kp + g * cap * d, vp + g * cap * d, group, d, start + i + 1, sc,
                      op + (i * hq + g * group) * d, buf);
        }
    });
    return out;
}

// qkv [n, (hq + 2 hkv) d] -> the same with ``bias`` added (when given) and rotate-half RoPE applied
// to the q and k heads with cos, sin [n, d]. The operations and their order are those of
// ``kernels.apply_rope`` on ``qkv + bias`` (x1 cos - x2 sin, x2 cos + x1 sin), so the bits match it.
torch::Tensor rope_qkv(const torch::Tensor& qkv, const c10::optional<torch::Tensor>& bias, const torch::Tensor& cos,
                       const torch::Tensor& sin, int64_t hq, int64_t hkv) {
    TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == torch::kFloat32, "qkv [n, width] float32");
    const int64_t n = qkv.size(0), width = qkv.size(1), d = width / (hq + 2 * hkv), half = d / 2;
    TORCH_CHECK(d * (hq + 2 * hkv) == width && d % 2 == 0, "qkv width does not split into heads");
    TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == n && cos.size(1) == d && cos.is_contiguous() &&
                sin.is_contiguous(), "cos and sin must be [n, head_dim]");
    const bool has_bias = bias.has_value() && bias->defined();
    TORCH_CHECK(!has_bias || (bias->numel() == width && bias->is_contiguous()), "bias must be [width]");
    auto out = torch::empty_like(qkv);
    const float *x = qkv.data_ptr<float>(), *b = has_bias ? bias->data_ptr<float>() : nullptr;
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    float* o = out.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) {
        const float* xr = x + r * width;
        float* orow = o + r * width;
        const float *c = cp + r * d, *s = sp + r * d;
        for (int64_t e = 0; e < width; ++e) orow[e] = has_bias ? xr[e] + b[e] : xr[e];
        for (int64_t h = 0; h < hq + hkv; ++h) {
            float* t = orow + h * d;
            for (int64_t l = 0; l < half; ++l) {
                const float x1 = t[l], x2 = t[l + half];
                t[l] = x1 * c[l] - x2 * s[l];
                t[l + half] = x2 * c[l + half] + x1 * s[l + half];
            }
        }
    }
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("attention_rows", &attention_rows, "batch-invariant causal GQA of query rows over a KV cache layer");
    m.def("rope_qkv", &rope_qkv, "bias and rotate-half RoPE on the q and k heads of a fused q|k|v", py::arg("qkv"),
          py::arg("bias"), py::arg("cos"), py::arg("sin"), py::arg("hq"), py::arg("hkv"));
    m.def("avx2", &lanes::avx2, "whether this build uses AVX2 (else the portable C++ build)");
}
