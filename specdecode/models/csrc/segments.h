// Several sequences' rows in one forward (a batch of requests): each segment is one sequence's
// consecutive rows against its own KV cache [layers, kv_heads, capacity, head_dim]. Shared by the
// target's native forward (``linear_gguf.cpp``) and the int4 draft's (``linear_int4.cpp``), whose
// ``forward`` is a batch of one segment and ``forward_batch`` a server's batch.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace segments {

struct Segment {  // one sequence's rows row0 .. row0 + n - 1, at its cache's slots start ..
    float *k = nullptr, *v = nullptr;
    int64_t capacity = 0, start = 0, row0 = 0, n = 0;
};

// The rows whose logits are asked for: every row, or with ``last_only`` each segment's last.
inline std::vector<int64_t> head_rows(const std::vector<int64_t>& counts, bool last_only) {
    std::vector<int64_t> heads;
    int64_t row = 0;
    for (int64_t c : counts) {
        TORCH_CHECK(c > 0, "every segment needs rows");
        for (int64_t r = last_only ? row + c - 1 : row; r < row + c; ++r) heads.push_back(r);
        row += c;
    }
    return heads;
}

// The segments of ``rows`` rows in all, checked against a model of ``layers`` layers, ``kv_heads``
// heads of ``head_dim`` and ``positions`` RoPE positions.
inline std::vector<Segment> make(const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                                 const std::vector<int64_t>& starts, const std::vector<int64_t>& counts, int64_t rows,
                                 int64_t layers, int64_t kv_heads, int64_t head_dim, int64_t positions) {
    TORCH_CHECK(k_caches.size() == counts.size() && v_caches.size() == counts.size() && starts.size() == counts.size(),
                "one cache, start and count per segment");
    std::vector<Segment> out;
    int64_t row = 0;
    for (size_t i = 0; i < counts.size(); ++i) {
        const torch::Tensor &k = k_caches[i], &v = v_caches[i];
        TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.dim() == 4 && k.size(0) == layers && k.size(1) == kv_heads
                        && k.size(3) == head_dim && v.sizes() == k.sizes() && k.scalar_type() == torch::kFloat32
                        && v.scalar_type() == torch::kFloat32,
                    "bad kv cache");
        const Segment seg{k.data_ptr<float>(), v.data_ptr<float>(), k.size(2), starts[i], row, counts[i]};
        TORCH_CHECK(seg.n > 0 && seg.start >= 0 && seg.start + seg.n <= seg.capacity && seg.start + seg.n <= positions,
                    "slots past the cache");
        out.push_back(seg);
        row += seg.n;
    }
    TORCH_CHECK(row == rows, "the segments' rows must add up to the input's");
    return out;
}

}  // namespace segments
