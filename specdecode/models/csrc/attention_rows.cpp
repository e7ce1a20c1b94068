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
// Row i (its query at slot start + i) sees keys 0 .. start + i. A task is one row and one kv head
// (``attention::row_group``, ``attention.h``): its query heads share each key and value load, the
// same chains as one head at a time, so the bits do not change with the grouping.
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention.h"
#include "lanes.h"

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
            attention::row_group(qp + (i * hq + g * group) * d, kp + g * cap * d, vp + g * cap * d, group, d, start + i + 1, sc,
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
    const int64_t n = qkv.size(0), width = qkv.size(1), d = width / (hq + 2 * hkv);
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
        for (int64_t h = 0; h < hq + hkv; ++h) attention::rope_half(orow + h * d, c, s, d);
    }
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("attention_rows", &attention_rows, "batch-invariant causal GQA of query rows over a KV cache layer");
    m.def("rope_qkv", &rope_qkv, "bias and rotate-half RoPE on the q and k heads of a fused q|k|v", py::arg("qkv"),
          py::arg("bias"), py::arg("cos"), py::arg("sin"), py::arg("hq"), py::arg("hkv"));
    m.def("avx2", &lanes::avx2, "whether this build uses AVX2 (else the portable C++ build)");
}
