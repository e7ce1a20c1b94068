// What a verify row's arithmetic costs on this CPU with nothing in its way: the AVX2 tile's
// instructions for one row and Q4_K super-block (8 VPMADDUBSW on activations read from L1, 7
// VPADDW, VPMADDWD by the scales, VCVTDQ2PS, a broadcast and an FMA) for 4 rows whose weights and
// accumulators stay in registers; and the rates at which the CPU issues independent VPADDW and
// VPMADDUBSW, against a chain of dependent scalar adds (one a cycle) as the clock.
//
//   g++ -O3 -mavx2 -mfma scripts/gguf_tile_time/row_floor.cpp -o /tmp/row_floor && taskset -c 1 /tmp/row_floor
//
// If a row of the real tiles (scripts/gguf_tile_time/tile_time.sh: the time per super-block one
// more row adds) costs about what this loop does, the tiles are bound by the vector instructions
// themselves, and only fewer of them per product (VNNI's VPDPBUSD) makes rows cheaper.
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Cycles per ns: a chain of dependent scalar adds retires one a cycle.
double clock_ghz() {
    const long n = 200000000;
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < n; ++i)
        asm volatile("add $1, %%r8\n\tadd $1, %%r8\n\tadd $1, %%r8\n\tadd $1, %%r8\n\t"
                     "add $1, %%r8\n\tadd $1, %%r8\n\tadd $1, %%r8\n\tadd $1, %%r8" ::: "r8");
    return 8.0 * n / seconds_since(t0) / 1e9;
}

template <typename Body>
double per_cycle(double ghz, Body body) {
    const long n = 200000000;
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < n; ++i) body();
    return 8.0 * n / seconds_since(t0) / 1e9 / ghz;
}

#define EIGHT(OP) \
    asm volatile(OP " %%ymm15, %%ymm0, %%ymm0\n\t" OP " %%ymm15, %%ymm1, %%ymm1\n\t" OP " %%ymm15, %%ymm2, %%ymm2\n\t" \
                 OP " %%ymm15, %%ymm3, %%ymm3\n\t" OP " %%ymm15, %%ymm4, %%ymm4\n\t" OP " %%ymm15, %%ymm5, %%ymm5\n\t" \
                 OP " %%ymm15, %%ymm6, %%ymm6\n\t" OP " %%ymm15, %%ymm7, %%ymm7" ::: "xmm0", "xmm1", "xmm2", "xmm3", \
                 "xmm4", "xmm5", "xmm6", "xmm7")

constexpr int ROWS = 4, BLOCKS = 64;
alignas(64) int8_t x[BLOCKS][ROWS][256];
alignas(64) float dx[BLOCKS][ROWS];

inline __m256i at(const int8_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }

}  // namespace

int main() {
    for (int b = 0; b < BLOCKS; ++b)
        for (int r = 0; r < ROWS; ++r) {
            dx[b][r] = 1e-3f * static_cast<float>(r + 1);
            for (int k = 0; k < 256; ++k) x[b][r][k] = static_cast<int8_t>((k * 7 + r) % 100 - 50);
        }
    __m256i v[8];
    for (int e = 0; e < 8; ++e) v[e] = _mm256_set1_epi8(static_cast<char>(e + 1));
    const __m256i sc = _mm256_set1_epi16(3);
    __m256 f[ROWS];
    for (auto& a : f) a = _mm256_setzero_ps();
    const long blocks = 20000000;
    const auto t0 = std::chrono::steady_clock::now();
    for (long it = 0; it < blocks; ++it) {
        const int b = static_cast<int>(it & (BLOCKS - 1));
        for (int r = 0; r < ROWS; ++r) {
            const int8_t* xr = x[b][r];
            __m256i s0 = _mm256_maddubs_epi16(v[0], at(xr)), s1 = _mm256_maddubs_epi16(v[1], at(xr + 32));
            for (int e = 2; e < 8; e += 2) {
                s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(v[e], at(xr + 32 * e)));
                s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(v[e + 1], at(xr + 32 * e + 32)));
            }
            const __m256i lanes = _mm256_madd_epi16(_mm256_add_epi16(s0, s1), sc);
            f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_broadcast_ss(&dx[b][r]), f[r]);
        }
    }
    const double ns = seconds_since(t0) / (static_cast<double>(blocks) * ROWS) * 1e9;
    float out[8];
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(f[0], f[1]), _mm256_add_ps(f[2], f[3])));
    const double ghz = clock_ghz();
    std::printf("one row and super-block: %.2f ns, %.1f cycles (clock %.2f GHz; checksum %g)\n", ns, ns * ghz, ghz,
                static_cast<double>(out[0]));
    std::printf("independent VPADDW ymm: %.2f a cycle\n", per_cycle(ghz, [] { EIGHT("vpaddw"); }));
    std::printf("independent VPMADDUBSW ymm: %.2f a cycle\n", per_cycle(ghz, [] { EIGHT("vpmaddubsw"); }));
    return 0;
}
