// The raw-row kernels (matmul_rows: weights in GGML's own layout where they lie, as the MoE experts are read)
// without Python: time one row of x against ROWS x K of random blocks, to compare kernel variants.
//
//   g++ -O3 -std=c++20 -ffp-contract=off -march=native -pthread benchmarks/qgemv_raw_rows.cpp -o /tmp/qgemv_raw_rows
//   /tmp/qgemv_raw_rows TYPE ROWS K MATS LEVELS [SECONDS] [THREADS]
//
// TYPE: the GGML type id (2 Q4_0, 8 Q8_0, 12 Q4_K, 39 MXFP4); MATS: how many such weights, read in turn (1: the
// weight stays in cache when small, e.g. 64 x 2880 in L2; 48 x 2880 x 2880 streams from memory); LEVELS: activation
// levels (1 or 2); THREADS: rows split over the pool (default 1). Prints the best and the median of 10-call batches
// and a checksum of y, which a variant must reproduce bit for bit. HUGE=1 maps the weights with huge pages.
// Compile with -DQG_SOURCE='"path/to/variant.cpp"' to time a modified copy. QG_SIMD=avx2 forces a code path
// (benchmarks/qg_simd.h: which registers it keeps).

#ifndef QG_SOURCE
#define QG_SOURCE "../kernels/csrc/qgemv.cpp"
#endif
#include QG_SOURCE
#include "qg_simd.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>

using namespace nc::qg;

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s TYPE ROWS K MATS LEVELS [SECONDS] [THREADS]\n", argv[0]);
    return 2;
  }
  const int type = std::atoi(argv[1]);
  const int64_t rows = std::atoll(argv[2]), k = std::atoll(argv[3]), mats = std::atoll(argv[4]);
  const bool x2 = std::atoi(argv[5]) == 2;
  const double secs = argc > 6 ? std::atof(argv[6]) : 1.0;
  const int threads = argc > 7 ? std::atoi(argv[7]) : 1;
  if (!raw_type(type) || rows <= 0 || rows % 16 || k % block_elems(type) || k % 32 || mats < 1 || threads < 1) {
    std::fprintf(stderr, "bad arguments: a raw block type, ROWS a multiple of 16, K of 32 and the block size\n");
    return 2;
  }
  qg_bench::force_simd_from_env();
  const int bb = block_bytes(type);
  const int64_t stride = k / block_elems(type) * bb, msize = rows * stride, total = msize * mats;
  constexpr int64_t HUGE_PAGE = 2 << 20;
  auto* w = static_cast<uint8_t*>(std::aligned_alloc(HUGE_PAGE, (total + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE));
  madvise(w, total, std::getenv("HUGE") ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  std::mt19937 rng(1);
  for (int64_t i = 0; i < total; ++i) w[i] = rng() & 255;
  for (int64_t i = 0; i < total / bb; ++i) {  // finite scales of a few thousandths
    uint8_t* b = w + i * bb;
    const uint16_t h = 0x2000 + (rng() & 0x3ff);
    if (type == MXFP4) b[0] = static_cast<uint8_t>(119 + (rng() & 3));
    else if (type == Q6_K) std::memcpy(b + 208, &h, 2);
    else std::memcpy(b, &h, 2);
    if (type == Q4_K || type == Q5_K || type == Q2_K || type == Q4_1 || type == Q5_1)  // dmin, m
      std::memcpy(b + (type == Q2_K ? 82 : 2), &h, 2);
    if (type == Q2_K) std::memcpy(b + 80, &h, 2);
    if (type == Q3_K) std::memcpy(b + 108, &h, 2);
  }
  ActBuffer ab;
  ab.reserve(1, k, x2, wide_codes(1));
  std::vector<float> x(k), y(rows), y0(rows);
  std::normal_distribution<float> normal;
  for (auto& v : x) v = normal(rng);
  ab.quantize(0, x.data());
  const Acts a = ab.view();
  auto call = [&](const uint8_t* wm, float* out) {
    parallel_for(rows / 16, std::max<int64_t>(1, rows / 16 / (2 * threads)), threads, [&](int64_t i0, int64_t i1) {
      matmul_rows(type, wm, stride, i0 * 16, i1 * 16, a, nullptr, 1, out + i0 * 16, rows, i1 * 16);
    });
  };
  call(w, y0.data());
  std::vector<double> times;
  int64_t m = 0;
  const auto start = std::chrono::steady_clock::now();
  do {
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < 10; ++r, ++m) call(w + (m % mats) * msize, y.data());
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 10);
  } while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < secs);
  call(w, y.data());
  if (std::memcmp(y.data(), y0.data(), rows * sizeof(float)) != 0) {
    std::fprintf(stderr, "the timed calls gave another y than the first call\n");
    return 1;
  }
  std::sort(times.begin(), times.end());
  const double best = times.front(), median = times[times.size() / 2];
  double checksum = 0;
  for (float v : y) checksum += v;
  std::printf("type %d %ldx%ld x%ld, %d level(s), %s, %d thread(s): best %.1f us (%.2f GB/s), median %.1f us (%.2f GB/s), "
              "checksum %.9g\n", type, static_cast<long>(rows), static_cast<long>(k), static_cast<long>(mats), x2 ? 2 : 1,
              qg_bench::simd_label(), threads, best * 1e6, msize / best / 1e9, median * 1e6, msize / median / 1e9, checksum);
  std::free(w);
}
