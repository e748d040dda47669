// What every kernel source of the library shares: the one ISA selection and the number conversions.
//
// NC_ISA is fixed at compile time by the target flags (-march=native / -mcpu=native, or a test build's flags):
//   NC_ISA_AVX512   AVX-512 F, BW, DQ, VL and VNNI (with everything below)     x86-64
//   NC_ISA_AVX2     AVX2, FMA and F16C
//   NC_ISA_I8MM     ASIMD with SDOT and SMMLA (Armv8.6 i8mm: Graviton 3, Apple M2 and later)   AArch64
//   NC_ISA_DOTPROD  ASIMD with SDOT (Armv8.2 dotprod: Apple M1, Graviton 2, Raspberry Pi 5)
//   NC_ISA_NEON     baseline ASIMD (every AArch64 CPU)
//   NC_ISA_SCALAR   anything else, or a build with -DNC_NO_SIMD: plain C++
// The sources test the NC_HAS_* macros below (`#if NC_HAS_AVX2`), never the compiler's feature macros, so a
// build's code paths are decided here, in one place. The x86 and Arm levels are two separate ladders above
// scalar: a runtime override (nc_qg_set_simd) moves down its own ladder, or to scalar.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#define NC_ISA_SCALAR 0
#define NC_ISA_AVX2 1
#define NC_ISA_AVX512 2
#define NC_ISA_NEON 3
#define NC_ISA_DOTPROD 4
#define NC_ISA_I8MM 5

#if defined(NC_NO_SIMD)
#define NC_ISA NC_ISA_SCALAR
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define NC_ISA NC_ISA_AVX512
#else
#define NC_ISA NC_ISA_AVX2
#endif
#elif defined(__aarch64__) && defined(__ARM_NEON)
#if defined(__ARM_FEATURE_DOTPROD) && defined(__ARM_FEATURE_MATMUL_INT8)
#define NC_ISA NC_ISA_I8MM
#elif defined(__ARM_FEATURE_DOTPROD)
#define NC_ISA NC_ISA_DOTPROD
#else
#define NC_ISA NC_ISA_NEON
#endif
#else
#define NC_ISA NC_ISA_SCALAR
#endif

#define NC_HAS_AVX2 (NC_ISA == NC_ISA_AVX2 || NC_ISA == NC_ISA_AVX512)
#define NC_HAS_AVX512 (NC_ISA == NC_ISA_AVX512)
#define NC_HAS_NEON (NC_ISA >= NC_ISA_NEON)
#define NC_HAS_DOTPROD (NC_ISA >= NC_ISA_DOTPROD)
#define NC_HAS_I8MM (NC_ISA >= NC_ISA_I8MM)
#define NC_HAS_SIMD (NC_ISA != NC_ISA_SCALAR)
// The lowest level of this build's ladder: a runtime level below it (other than scalar) is not this build's.
#define NC_ISA_BASE (NC_HAS_NEON ? NC_ISA_NEON : NC_ISA_AVX2)

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // also for _mm_pause in scalar builds
#endif
#if NC_HAS_NEON
#include <arm_neon.h>
#endif

namespace nc {

inline float as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t as_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// One fp16 value <-> fp32, rounding to nearest even: F16C where compiled in, else the same in software
// (F. Giesen's half_to_float / float_to_half_fast3_rtne), so every build converts alike. AArch64's fcvt
// rounds to nearest even under the default FPCR, as F16C does.
#if NC_HAS_AVX2
inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
inline uint16_t f32_to_f16(float f) { return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)); }
#elif NC_HAS_NEON
inline float f16_to_f32(uint16_t h) { return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0); }
inline uint16_t f32_to_f16(float f) { return vget_lane_u16(vreinterpret_u16_f16(vcvt_f16_f32(vdupq_n_f32(f))), 0); }
#else
inline float f16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h & 0x7fffu) << 13;  // exponent and mantissa in place
  const uint32_t exp = u & (0x7c00u << 13);
  u += (127u - 15u) << 23;
  if (exp == 0x7c00u << 13)
    u += (128u - 16u) << 23;                                       // inf / nan: all exponent bits set
  else if (exp == 0)
    u = as_bits(as_float(u + (1u << 23)) - as_float(113u << 23));  // zero / subnormal: renormalized by fp32
  return as_float(u | static_cast<uint32_t>(h & 0x8000u) << 16);
}
inline uint16_t f32_to_f16(float f) {
  uint32_t u = as_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  uint32_t h;
  if (u >= (127u + 16u) << 23)   // |f| >= 2^16, inf or nan: inf (nan stays a quiet nan)
    h = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  else if (u < 113u << 23)       // below 2^-14: a subnormal, rounded by the fp32 add that aligns it
    h = as_bits(as_float(u) + 0.5f) - as_bits(0.5f);
  else                           // rebias, round the 13 dropped bits to nearest even (may carry to inf)
    h = (u + ((15u - 127u) << 23) + 0xfffu + ((u >> 13) & 1u)) >> 13;
  return static_cast<uint16_t>(h | sign);
}
#endif

// An fp16 stored at p (any alignment), as fp32.
inline float rd_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

inline float bf16_to_f32(uint16_t v) { return as_float(static_cast<uint32_t>(v) << 16); }

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t bits = as_bits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace nc
