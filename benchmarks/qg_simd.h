// The kernel benchmarks' code path (qgemv_tiles.cpp, qgemv_raw_rows.cpp; include after the kernels' source).
//
// QG_SIMD=avx2 (or scalar; on AArch64 neon, neon-dotprod) forces a path, as NANOCHAT_CPU_ISA does for the library;
// unset or anything else: the best one compiled. A lower path keeps its build's registers: the AVX2 path of a
// -march=native build on an AVX-512 machine has 32 vector registers, which an AVX2 CPU lacks, and there runs the
// one-row 4-bit tiles up to 40% faster than the AVX2 build itself does (`-mavx2 -mfma -mf16c` in place of
// -march=native compiles that one, as the library's NANOCHAT_CPU_ISA=avx2 does). The label says which it is.

#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace qg_bench {

inline const char* const ISA_NAMES[] = {"scalar", "avx2", "avx512", "neon", "neon-dotprod", "neon-i8mm"};

inline void force_simd_from_env() {
  if (const char* simd = std::getenv("QG_SIMD")) {
    int level = nc_qg_simd_compiled();
    for (int i = 0; i < 6; ++i)
      if (std::strcmp(simd, ISA_NAMES[i]) == 0) level = i;
    nc_qg_set_simd(level);
  }
}

// The path that runs, and the build's own where that is higher: "avx2 in an avx512 build".
inline const char* simd_label() {
  static char text[64];
  const int run = nc_qg_simd(), built = nc_qg_simd_compiled();
  std::snprintf(text, sizeof text, run == built || run == 0 ? "%s" : "%s in an %s build", ISA_NAMES[run],
                ISA_NAMES[built]);
  return text;
}

}  // namespace qg_bench
