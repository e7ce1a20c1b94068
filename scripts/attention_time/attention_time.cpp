// One row's attention over a cache (attention.h's ``row_group``) timed alone: one thread, no torch.
// Built by attention_time.sh from a copy of attention.h, so a change to the kernel can be timed in
// seconds, in each build, against the one before it; the checksum's bits show whether the output
// changed.
//
//   attention_time GROUP D LEN: GROUP query heads of one kv head, head size D, LEN keys.
#include ATTENTION

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

int main(int argc, char** argv) {
    if (argc != 4) {
        std::fprintf(stderr, "usage: %s GROUP D LEN\n", argv[0]);
        return 2;
    }
    const int64_t group = std::atoll(argv[1]), d = std::atoll(argv[2]), len = std::atoll(argv[3]);
    if (group <= 0 || d <= 0 || d % 8 || len <= 0) {
        std::fprintf(stderr, "GROUP and LEN must be positive, D a positive multiple of 8\n");
        return 2;
    }
    std::mt19937 g(1);
    std::uniform_real_distribution<float> u(-1, 1);
    std::vector<float> q(group * d), k(len * d), v(len * d), out(group * d), scores;
    for (auto* t : {&q, &k, &v})
        for (auto& x : *t) x = u(g);
    double best = 1e30;
    for (int round = 0; round < 15; ++round) {  // best of 15 rounds of 200 rows
        const auto start = std::chrono::steady_clock::now();
        for (int it = 0; it < 200; ++it)
            attention::row_group(q.data(), k.data(), v.data(), group, d, len, 0.125f, out.data(), scores);
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / 200);
    }
    float sum = 0.f;
    for (float x : out) sum += x;
    uint32_t bits;
    std::memcpy(&bits, &sum, 4);
    std::printf("group %ld d %ld len %ld: %.2f us a row (checksum bits %08x)\n", static_cast<long>(group),
                static_cast<long>(d), static_cast<long>(len), best * 1e6, bits);
    return 0;
}
