// The CPU matmul kernels without Python: time nc_qg_matmul on random GGML blocks, to compare kernel
// variants at the instruction level.
//
//   g++ -O3 -std=c++20 -ffp-contract=off -march=native -pthread benchmarks/qgemv_tiles.cpp -o /tmp/qgemv_tiles
//   /tmp/qgemv_tiles TYPE ROWS K N LEVELS [SECONDS] [THREADS]
//
// TYPE: Q4_0 Q4_1 Q5_0 Q8_0 Q4_K Q5_K Q6_K MXFP4; ROWS x K: the weight; N: rows of x; LEVELS: activation levels
// (1 or 2); THREADS: the kernels' threads (default 1). A call quantizes x and runs the tiles. Prints
// the best of 20-call batches over SECONDS (default 1) and a checksum of y, which a variant of the
// kernels must reproduce bit for bit, and the same on any THREADS. With ROWS x K a few hundred KB the
// weights stay in L2: the kernels' arithmetic, not the memory's bandwidth. Compile with
// -DQG_SOURCE='"path/to/variant.cpp"' to time a modified copy; QG_SIMD=avx2 forces a code path (benchmarks/qg_simd.h:
// which registers it keeps). On AArch64 build with -mcpu=native (or cross-compile with aarch64-linux-gnu-g++
// -march=armv8.2-a+dotprod and run under qemu-aarch64: the checksums, not the times).

#ifndef QG_SOURCE
#define QG_SOURCE "../kernels/csrc/qgemv.cpp"
#endif
#include QG_SOURCE
#include "qg_simd.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

namespace {

struct Raw {  // a GGML block: its bytes, values per block, where its fp16 scales are (MXFP4: its E8M0 byte, d0 = -2)
  const char* name;
  int type, bytes, elems, d0, d1;
};
constexpr Raw RAWS[] = {{"Q4_0", Q4_0, 18, 32, 0, -1}, {"Q4_1", Q4_1, 20, 32, 0, 2}, {"Q5_0", Q5_0, 22, 32, 0, -1}, {"Q8_0", Q8_0, 34, 32, 0, -1},
                        {"Q4_K", Q4_K, 144, 256, 0, 2}, {"Q5_K", Q5_K, 176, 256, 0, 2}, {"Q6_K", Q6_K, 210, 256, 208, -1},
                        {"MXFP4", MXFP4, 17, 32, -2, -1}};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s TYPE ROWS K N LEVELS [SECONDS] [THREADS]\n", argv[0]);
    return 2;
  }
  const Raw* raw = nullptr;
  for (const Raw& r : RAWS)
    if (std::string(argv[1]) == r.name) raw = &r;
  const int64_t rows = std::atoll(argv[2]), k = std::atoll(argv[3]), n = std::atoll(argv[4]);
  const bool x2 = std::atoi(argv[5]) == 2;
  const double secs = argc > 6 ? std::atof(argv[6]) : 1.0;
  const int threads = argc > 7 ? std::atoi(argv[7]) : 1;
  if (!raw || rows <= 0 || rows % ROWS || k <= 0 || k % raw->elems || n <= 0 || threads < 1) {
    std::fprintf(stderr, "bad arguments: TYPE one of Q4_0 Q4_1 Q5_0 Q8_0 Q4_K Q5_K Q6_K MXFP4, ROWS a multiple of %d, "
                         "K of the block size, THREADS >= 1\n", ROWS);
    return 2;
  }
  qg_bench::force_simd_from_env();
  std::mt19937 rng(1);
  const int64_t nb = rows * (k / raw->elems);
  std::vector<uint8_t> blocks(nb * raw->bytes);
  for (auto& b : blocks) b = rng() & 255;
  for (int64_t i = 0; i < nb; ++i) {  // finite scales of a few thousandths
    if (raw->d0 == -2) blocks[i * raw->bytes] = static_cast<uint8_t>(119 + (rng() & 3));  // 2^-9 .. 2^-6
    for (int off : {raw->d0, raw->d1})
      if (off >= 0) {
        const uint16_t h = 0x2000 + (rng() & 0x3ff);
        std::memcpy(&blocks[i * raw->bytes + off], &h, 2);
      }
  }
  std::vector<uint8_t> packed(nc_qg_packed_bytes(raw->type, rows, k));
  if (nc_qg_repack(raw->type, blocks.data(), rows, k, (k / raw->elems) * raw->bytes, packed.data(), 1) != OK) {
    std::fprintf(stderr, "repack failed\n");
    return 1;
  }
  std::vector<float> x(n * k), y(n * rows), y2(n * rows);
  std::normal_distribution<float> normal;
  for (auto& v : x) v = normal(rng);
  nc_qg_matmul(raw->type, packed.data(), rows, k, x.data(), 0, n, k, y.data(), 0, rows, nullptr, x2, 1);
  double best = 1e30;
  const auto start = std::chrono::steady_clock::now();
  do {
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < 20; ++r)
      nc_qg_matmul(raw->type, packed.data(), rows, k, x.data(), 0, n, k, y2.data(), 0, rows, nullptr, x2, threads);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 20);
  } while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < secs);
  if (std::memcmp(y.data(), y2.data(), y.size() * sizeof(float)) != 0) {
    std::fprintf(stderr, "the timed calls gave another y than the first call\n");
    return 1;
  }
  double checksum = 0;
  for (float v : y) checksum += v;
  std::printf("%s %ldx%ld, %ld rows of x, %d level(s), %s, %d thread(s): %.1f us, %.2f GMAC/s, checksum %.9g\n",
              raw->name, static_cast<long>(rows), static_cast<long>(k), static_cast<long>(n), x2 ? 2 : 1,
              qg_bench::simd_label(), threads, best * 1e6, static_cast<double>(n) * rows * k / best / 1e9, checksum);
}
