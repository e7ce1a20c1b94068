// The GGUF kernel's row tiles alone: ns per super-block for 1..16 rows on random k-quant weights,
// one thread, no torch. Built by tile_time.sh from the kernel's source (its code above the SIMD
// build's ``output_rows``), so a change to the tiles can be timed in seconds and without the
// spread a whole model's run picks up from a shared host.
//
//   tile_time TYPE IN OUT COPIES SECONDS
//
// TYPE: 12 (Q4_K) or 14 (Q6_K); IN inputs; OUT outputs per call; COPIES weight copies taken in
// turn (1 keeps a small matrix in L2; enough copies to outgrow L3 stream it from memory). Each row
// count keeps its best of 15 rounds, taken in turn; after each figure, in brackets, the activation
// buffer's offset from a 64-byte boundary.
#include KERNEL

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>

namespace {

struct Planes {
    std::vector<uint8_t> q, qh, sc, mn;
    std::vector<float> d, dm;
};

Part random_part(int type, int64_t in, int64_t out, std::mt19937& g, Planes& p) {
    const int64_t nb = in / 256;
    p.q.resize(out * nb * 128), p.qh.resize(out * nb * 64), p.sc.resize(out * nb * 16), p.mn.resize(out * nb * 8);
    p.d.resize(out * nb), p.dm.resize(out * nb);
    for (auto& v : p.q) v = g();
    for (auto& v : p.qh) v = g();
    for (auto& v : p.sc) v = type == Q6_K ? static_cast<uint8_t>(static_cast<int>(g() % 64) - 32) : g() % 64;
    for (auto& v : p.mn) v = g() % 64;
    for (auto& v : p.d) v = 1e-3f * (g() % 100 + 1);
    for (auto& v : p.dm) v = 1e-3f * (g() % 100);
    Part w;
    w.type = type, w.out = out, w.in = in, w.nb = nb;
    w.q = p.q.data(), w.qh = type == Q4_K ? nullptr : p.qh.data(), w.sc = p.sc.data(), w.mn = p.mn.data();
    w.d = p.d.data(), w.dm = p.dm.data();
    return w;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 6) {
        std::fprintf(stderr, "usage: %s TYPE(12|14) IN OUT COPIES SECONDS\n", argv[0]);
        return 2;
    }
    const int type = std::atoi(argv[1]);
    const int64_t in = std::atoll(argv[2]), out = std::atoll(argv[3]), copies = std::atoll(argv[4]);
    const double seconds = std::atof(argv[5]);
    if ((type != Q4_K && type != Q6_K) || in <= 0 || in % 256 || out <= 0 || copies <= 0 || seconds <= 0) {
        std::fprintf(stderr, "TYPE must be 12 (Q4_K) or 14 (Q6_K), IN a positive multiple of 256, the rest positive\n");
        return 2;
    }
    std::mt19937 g(1);
    std::vector<Planes> planes(copies);
    std::vector<Part> parts;
    for (auto& p : planes) parts.push_back(random_part(type, in, out, g, p));
    constexpr int max_rows = 16, rounds = 15;
    std::vector<Acts> acts(max_rows + 1);
    std::vector<std::vector<float>> ys(max_rows + 1);
    for (int rows = 1; rows <= max_rows; ++rows) {
        std::vector<float> x(rows * in);
        for (auto& v : x) v = std::uniform_real_distribution<float>(-1, 1)(g);
        const bool orders[2] = {type == Q4_K, type == Q6_K};
        acts[rows] = quantize(x.data(), rows, in, 256, orders);
        ys[rows].resize(rows * out);
    }
    const auto run = [&](const Part& w, const Acts& a, float* y) {
        if (type == Q4_K)
            rows_of<Q4_K>(w, a, 0, out, y, out, 0);
        else
            rows_of<Q6_K>(w, a, 0, out, y, out, 0);
    };
    std::vector<double> best(max_rows + 1, 1e30);
    for (int round = 0; round < rounds; ++round)
        for (int rows = 1; rows <= max_rows; ++rows) {
            int64_t calls = 0;
            double elapsed = 0;
            const auto start = std::chrono::steady_clock::now();
            while (elapsed < seconds / rounds / max_rows) {
                for (int k = 0; k < 4; ++k, ++calls) run(parts[calls % copies], acts[rows], ys[rows].data());
                elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            }
            best[rows] = std::min(best[rows], elapsed / calls);
        }
    std::printf("%s in %ld out %ld, %ld cop%s of %.0f KB; ns per super-block:\n", type == Q4_K ? "Q4_K" : "Q6_K",
                static_cast<long>(in), static_cast<long>(out), static_cast<long>(copies), copies == 1 ? "y" : "ies",
                out * (in / 256) * (type == Q6_K ? 210 : 144) / 1024.0);
    for (int rows = 1; rows <= max_rows; ++rows)
        std::printf(" %dr %.1f (%ld)", rows, best[rows] / (out * (in / 256)) * 1e9,
                    static_cast<long>(reinterpret_cast<uintptr_t>(acts[rows].kq[type == Q6_K].data()) % 64));
    std::printf("\n");
    return 0;
}
