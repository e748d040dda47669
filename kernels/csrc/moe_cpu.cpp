// Routed MoE experts on the CPU, computed straight from GGML blocks (Q4_K, Q5_K, Q6_K, Q8_0).
//
// Activations are quantized on the fly to int8 (per 256-element block with an fp32 scale and
// 16-element block sums for the K-quants, "Q8_K"; per 32-element block for Q8_0 weights), so
// every dot product runs in integer arithmetic and the weights are read once, in their packed
// form, straight from the GGUF memory map: a row's blocks are unpacked once for up to 4 tokens
// routed to the same expert. Vectorised with AVX2 (AVX-512 VNNI where the compiler targets it:
// built with -march=native); a scalar path covers every other CPU.
//
// Plain C ABI (loaded with ctypes): no torch headers, so the first build takes seconds.
// Block layouts follow gguf-py / kernels/gguf_quants.py.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define NC_SIMD 1
#else
#define NC_SIMD 0
#endif

namespace {

constexpr int QK = 256;
constexpr int TYPE_Q8_0 = 8, TYPE_Q4_K = 12, TYPE_Q5_K = 13, TYPE_Q6_K = 14;
constexpr int64_t TILE = 16;  // weight rows per work item: a token's activations stay in L1 across them

// Error codes returned to Python (which turns them into ValueError).
constexpr int OK = 0, ERR_TYPE = 1, ERR_SHAPE = 2, ERR_EXPERT_ID = 3;

struct BlockQ8K {  // activations for K-quant weights
  float d;
  int8_t qs[QK];
  int16_t bsums[QK / 16];
};
struct BlockQ8_32 {  // activations for Q8_0 weights
  float d;
  int8_t qs[32];
};

int g_use_simd = NC_SIMD;
int g_last_threads = 0;

// ------------------------------------------------------------------ helpers

inline float fp16_to_fp32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    const float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  const uint32_t bits = exp == 31 ? (sign | 0x7f800000u | (mant << 13)) : (sign | ((exp + 112) << 23) | (mant << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline float read_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_fp32(h);
}

// Q4_K / Q5_K: eight 6-bit scales and mins packed in 12 bytes.
inline void k_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

// ------------------------------------------------------------------ activation quantization

template <int N>
inline float quantize_block(const float* x, int8_t* q) {
  float amax = 0.0f;
  for (int i = 0; i < N; ++i) amax = std::max(amax, std::fabs(x[i]));
  if (amax == 0.0f) {
    std::memset(q, 0, N);
    return 0.0f;
  }
  const float iscale = 127.0f / amax;
  for (int i = 0; i < N; ++i) {
    const int v = static_cast<int>(std::nearbyint(x[i] * iscale));
    q[i] = static_cast<int8_t>(std::min(127, std::max(-127, v)));
  }
  return 1.0f / iscale;
}

void quantize_row_q8k(const float* x, int64_t k, void* out) {
  auto* b = static_cast<BlockQ8K*>(out);
  for (int64_t i = 0; i < k / QK; ++i) {
    b[i].d = quantize_block<QK>(x + i * QK, b[i].qs);
    for (int g = 0; g < QK / 16; ++g) {
      int s = 0;
      for (int j = 0; j < 16; ++j) s += b[i].qs[g * 16 + j];
      b[i].bsums[g] = static_cast<int16_t>(s);
    }
  }
}

void quantize_row_q8_32(const float* x, int64_t k, void* out) {
  auto* b = static_cast<BlockQ8_32*>(out);
  for (int64_t i = 0; i < k / 32; ++i) b[i].d = quantize_block<32>(x + i * 32, b[i].qs);
}

// ------------------------------------------------------------------ scalar dot products
// Each returns the dot product of one weight row (nb blocks) with one quantized activation row.

float dot_q8_0_scalar(const uint8_t* w, const void* act, int64_t nb) {
  const auto* a = static_cast<const BlockQ8_32*>(act);
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 34;
    const auto* q = reinterpret_cast<const int8_t*>(blk + 2);
    int s = 0;
    for (int i = 0; i < 32; ++i) s += q[i] * a[b].qs[i];
    sum += read_f16(blk) * a[b].d * static_cast<float>(s);
  }
  return sum;
}

float dot_q4_k_scalar(const uint8_t* w, const void* act, int64_t nb) {
  const auto* a = static_cast<const BlockQ8K*>(act);
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 144;
    const uint8_t* q = blk + 16;
    const int8_t* y = a[b].qs;
    int isum = 0, msum = 0;
    for (int j = 0; j < 4; ++j) {  // 64 elements: low nibbles = sub-block 2j, high = 2j+1
      int sc0, m0, sc1, m1;
      k_scale_min(blk + 4, 2 * j, sc0, m0);
      k_scale_min(blk + 4, 2 * j + 1, sc1, m1);
      int s0 = 0, s1 = 0;
      for (int i = 0; i < 32; ++i) {
        s0 += (q[32 * j + i] & 15) * y[64 * j + i];
        s1 += (q[32 * j + i] >> 4) * y[64 * j + 32 + i];
      }
      isum += sc0 * s0 + sc1 * s1;
      msum += m0 * (a[b].bsums[4 * j] + a[b].bsums[4 * j + 1]) + m1 * (a[b].bsums[4 * j + 2] + a[b].bsums[4 * j + 3]);
    }
    sum += read_f16(blk) * a[b].d * isum - read_f16(blk + 2) * a[b].d * msum;
  }
  return sum;
}

float dot_q5_k_scalar(const uint8_t* w, const void* act, int64_t nb) {
  const auto* a = static_cast<const BlockQ8K*>(act);
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 176;
    const uint8_t* qh = blk + 16;
    const uint8_t* ql = blk + 48;
    const int8_t* y = a[b].qs;
    int isum = 0, msum = 0;
    for (int j = 0; j < 4; ++j) {
      int sc0, m0, sc1, m1;
      k_scale_min(blk + 4, 2 * j, sc0, m0);
      k_scale_min(blk + 4, 2 * j + 1, sc1, m1);
      int s0 = 0, s1 = 0;
      for (int i = 0; i < 32; ++i) {
        const int lo = (ql[32 * j + i] & 15) | (((qh[i] >> (2 * j)) & 1) << 4);
        const int hi = (ql[32 * j + i] >> 4) | (((qh[i] >> (2 * j + 1)) & 1) << 4);
        s0 += lo * y[64 * j + i];
        s1 += hi * y[64 * j + 32 + i];
      }
      isum += sc0 * s0 + sc1 * s1;
      msum += m0 * (a[b].bsums[4 * j] + a[b].bsums[4 * j + 1]) + m1 * (a[b].bsums[4 * j + 2] + a[b].bsums[4 * j + 3]);
    }
    sum += read_f16(blk) * a[b].d * isum - read_f16(blk + 2) * a[b].d * msum;
  }
  return sum;
}

float dot_q6_k_scalar(const uint8_t* w, const void* act, int64_t nb) {
  const auto* a = static_cast<const BlockQ8K*>(act);
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 210;
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    const auto* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const int8_t* y = a[b].qs;
    int isum = 0;
    for (int h = 0; h < 2; ++h) {  // 128 elements per half
      int s[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // per 16-element group of this half
      for (int i = 0; i < 32; ++i) {
        const int hb = qh[32 * h + i];
        const int q0 = ((ql[64 * h + i] & 15) | ((hb & 3) << 4)) - 32;
        const int q1 = ((ql[64 * h + 32 + i] & 15) | (((hb >> 2) & 3) << 4)) - 32;
        const int q2 = ((ql[64 * h + i] >> 4) | (((hb >> 4) & 3) << 4)) - 32;
        const int q3 = ((ql[64 * h + 32 + i] >> 4) | (((hb >> 6) & 3) << 4)) - 32;
        const int g = i / 16;
        s[g] += q0 * y[128 * h + i];
        s[2 + g] += q1 * y[128 * h + 32 + i];
        s[4 + g] += q2 * y[128 * h + 64 + i];
        s[6 + g] += q3 * y[128 * h + 96 + i];
      }
      for (int g = 0; g < 8; ++g) isum += sc[8 * h + g] * s[g];
    }
    sum += read_f16(blk + 208) * a[b].d * isum;
  }
  return sum;
}

// ------------------------------------------------------------------ dot products of one row with n tokens
// out[j * ostride] = dot(w, act_j) for j < n, act_j = acts + (idx ? idx[j] : j) * astride.
// The SIMD versions decode each weight block (scales, nibbles) once for a chunk of CH tokens, so a
// prefill batch where many tokens share an expert does not redo the unpacking per token.

using MultiDotFn = void (*)(const uint8_t* w, int64_t nb, const uint8_t* acts, int64_t astride, const int64_t* idx,
                            int64_t n, float* out, int64_t ostride);
using DotFn = float (*)(const uint8_t*, const void*, int64_t);

inline const uint8_t* act_row(const uint8_t* acts, int64_t astride, const int64_t* idx, int64_t j) {
  return acts + (idx ? idx[j] : j) * astride;
}

template <DotFn DOT>
void multi_scalar(const uint8_t* w, int64_t nb, const uint8_t* acts, int64_t astride, const int64_t* idx, int64_t n,
                  float* out, int64_t ostride) {
  for (int64_t j = 0; j < n; ++j) out[j * ostride] = DOT(w, act_row(acts, astride, idx, j), nb);
}

#if NC_SIMD

constexpr int CH = 4;  // tokens per chunk

inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// 8 x int32: each lane the sum of 4 adjacent u8 * s8 products.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// Integer scales in the lane form scaled_dot consumes: from 8 int32 scales v, the vector whose
// lanes for bytes 0..15 hold scale v[lo] and for bytes 16..31 hold v[hi] (one permute per use).
inline __m256i scale_lanes(__m256i v) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return v;                                                          // int32 lanes for mullo
#else
  return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(v, 16));  // int16 pairs
#endif
}

inline __m256i pick_scale(__m256i lanes, int lo, int hi) {
  return _mm256_permutevar8x32_epi32(lanes, _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi));
}

// 8 x int32: sums of 4 adjacent u8 * s8 products times the scale of their 16 bytes.
inline __m256i scaled_dot(__m256i u, __m256i s, __m256i scale) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_mullo_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s), scale);
#else
  // u <= 63 and |s| <= 127: the pair sums of maddubs stay within int16; madd applies the scale.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale);
#endif
}

// Q4_K / Q5_K: the 12 scale bytes -> 8 scales and 8 mins (one byte each) with 32-bit word ops
// (same packing as k_scale_min: low 6 bits in bytes 0..7, the top 2 bits of scales/mins 4..7 in the
// high bits of bytes 0..7 and their low 4 bits in bytes 8..11).
inline void k_scales_words(const uint8_t* s, uint64_t& scales, uint64_t& mins) {
  uint32_t a, b, c;
  std::memcpy(&a, s, 4);
  std::memcpy(&b, s + 4, 4);
  std::memcpy(&c, s + 8, 4);
  const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, low2 = 0x03030303u;
  const uint32_t sc_hi = (c & low4) | (((a >> 6) & low2) << 4);
  const uint32_t mn_hi = ((c >> 4) & low4) | (((b >> 6) & low2) << 4);
  scales = (a & low6) | (static_cast<uint64_t>(sc_hi) << 32);
  mins = (b & low6) | (static_cast<uint64_t>(mn_hi) << 32);
}

void multi_q8_0_avx2(const uint8_t* w, int64_t nb, const uint8_t* acts, int64_t astride, const int64_t* idx,
                     int64_t n, float* out, int64_t ostride) {
  for (int64_t j0 = 0; j0 < n; j0 += CH) {
    const int nc = static_cast<int>(std::min<int64_t>(CH, n - j0));
    const BlockQ8_32* a[CH];
    __m256 acc[CH];
    for (int c = 0; c < nc; ++c) {
      a[c] = reinterpret_cast<const BlockQ8_32*>(act_row(acts, astride, idx, j0 + c));
      acc[c] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * 34;
      const float d = read_f16(blk);
      const __m256i qw = load256(blk + 2);
      const __m256i aw = _mm256_sign_epi8(qw, qw);  // maddubs needs an unsigned side: |w|, a with w's sign
      for (int c = 0; c < nc; ++c) {
        const __m256i p = dot_u8s8(aw, _mm256_sign_epi8(load256(a[c][b].qs), qw));
        acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[c][b].d), _mm256_cvtepi32_ps(p), acc[c]);
      }
    }
    for (int c = 0; c < nc; ++c) out[(j0 + c) * ostride] = hsum_ps(acc[c]);
  }
}

// Q4_K and Q5_K: x = d * sc * q - dmin * m per 32-element sub-block. HIGH adds Q5_K's fifth bit.
template <bool HIGH>
void multi_q45_k_avx2(const uint8_t* w, int64_t nb, const uint8_t* acts, int64_t astride, const int64_t* idx,
                      int64_t n, float* out, int64_t ostride) {
  constexpr int BYTES = HIGH ? 176 : 144, QS = HIGH ? 48 : 16;
  const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  for (int64_t j0 = 0; j0 < n; j0 += CH) {
    const int nc = static_cast<int>(std::min<int64_t>(CH, n - j0));
    const BlockQ8K* a[CH];
    __m256 acc[CH];
    __m128 acc_min[CH];
    for (int c = 0; c < nc; ++c) {
      a[c] = reinterpret_cast<const BlockQ8K*>(act_row(acts, astride, idx, j0 + c));
      acc[c] = _mm256_setzero_ps();
      acc_min[c] = _mm_setzero_ps();
    }
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * BYTES;
      const float d = read_f16(blk), dmin = read_f16(blk + 2);
      uint64_t sc_bytes, min_bytes;
      k_scales_words(blk + 4, sc_bytes, min_bytes);
      const __m128i mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(min_bytes)));
      __m256i q[8], scale[8];
      __m256i hb = HIGH ? load256(blk + 16) : _mm256_setzero_si256();  // bit s of byte i: element 32s + i
      for (int j = 0; j < 4; ++j) {
        const __m256i qb = load256(blk + QS + 32 * j);
        q[2 * j] = _mm256_and_si256(qb, m4);
        q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(qb, 4), m4);
        if (HIGH) {
          q[2 * j] = _mm256_or_si256(q[2 * j], _mm256_slli_epi16(_mm256_and_si256(hb, one), 4));
          hb = _mm256_srli_epi16(hb, 1);
          q[2 * j + 1] = _mm256_or_si256(q[2 * j + 1], _mm256_slli_epi16(_mm256_and_si256(hb, one), 4));
          hb = _mm256_srli_epi16(hb, 1);
        }
      }
      const __m256i sc_lanes = scale_lanes(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(sc_bytes))));
      for (int s = 0; s < 8; ++s) scale[s] = pick_scale(sc_lanes, s, s);
      for (int c = 0; c < nc; ++c) {
        const BlockQ8K& y = a[c][b];
        __m256i isum = _mm256_setzero_si256();
        for (int s = 0; s < 8; ++s) isum = _mm256_add_epi32(isum, scaled_dot(q[s], load256(y.qs + 32 * s), scale[s]));
        acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), _mm256_cvtepi32_ps(isum), acc[c]);
        // mins: sum_s m_s * (sum of the activations of sub-block s); pair sums of bsums fit int16
        const __m128i bsum32 = _mm_hadd_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(y.bsums)),
                                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(y.bsums + 8)));
        acc_min[c] = _mm_fmadd_ps(_mm_set1_ps(dmin * y.d), _mm_cvtepi32_ps(_mm_madd_epi16(mins, bsum32)), acc_min[c]);
      }
    }
    for (int c = 0; c < nc; ++c) {
      const __m128 m = acc_min[c];
      __m128 t = _mm_add_ps(m, _mm_movehl_ps(m, m));
      t = _mm_add_ss(t, _mm_movehdup_ps(t));
      out[(j0 + c) * ostride] = hsum_ps(acc[c]) - _mm_cvtss_f32(t);
    }
  }
}

// Q6_K: x = d * sc * (q - 32) per 16-element group; the -32 is folded in via the activation sums.
void multi_q6_k_avx2(const uint8_t* w, int64_t nb, const uint8_t* acts, int64_t astride, const int64_t* idx,
                     int64_t n, float* out, int64_t ostride) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
  for (int64_t j0 = 0; j0 < n; j0 += CH) {
    const int nc = static_cast<int>(std::min<int64_t>(CH, n - j0));
    const BlockQ8K* a[CH];
    __m256 acc[CH];
    for (int c = 0; c < nc; ++c) {
      a[c] = reinterpret_cast<const BlockQ8K*>(act_row(acts, astride, idx, j0 + c));
      acc[c] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * 210;
      const auto* sc = reinterpret_cast<const int8_t*>(blk + 192);
      const float d = read_f16(blk + 208);
      const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
      __m256i q[8], scale[8];
      for (int h = 0; h < 2; ++h) {  // chunk 4h + k holds elements 128h + 32k .. +31
        const __m256i l0 = load256(blk + 64 * h), l1 = load256(blk + 64 * h + 32);
        const __m256i qh = load256(blk + 128 + 32 * h);
        q[4 * h] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
        q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4));
        q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4));
        q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4));
      }
      const __m256i lanes_lo = scale_lanes(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))));
      const __m256i lanes_hi = scale_lanes(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8))));
      for (int i = 0; i < 4; ++i) {
        scale[i] = pick_scale(lanes_lo, 2 * i, 2 * i + 1);
        scale[i + 4] = pick_scale(lanes_hi, 2 * i, 2 * i + 1);
      }
      for (int c = 0; c < nc; ++c) {
        const BlockQ8K& y = a[c][b];
        __m256i isum = _mm256_setzero_si256();
        for (int i = 0; i < 8; ++i) isum = _mm256_add_epi32(isum, scaled_dot(q[i], load256(y.qs + 32 * i), scale[i]));
        const __m256i corr = _mm256_madd_epi16(sc16, load256(y.bsums));  // sum_g sc_g * bsum_g
        isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(corr, 5));
        acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), _mm256_cvtepi32_ps(isum), acc[c]);
      }
    }
    for (int c = 0; c < nc; ++c) out[(j0 + c) * ostride] = hsum_ps(acc[c]);
  }
}

#endif  // NC_SIMD

// ------------------------------------------------------------------ type table

using QuantFn = void (*)(const float*, int64_t, void*);

struct TypeInfo {
  int block_elems, block_bytes;
  int act_block_elems, act_block_bytes;  // activation format: Q8_K (256) or Q8_0-like (32)
  QuantFn quantize;
  MultiDotFn dot_scalar, dot_simd;
};

const TypeInfo* type_info(int type) {
#if NC_SIMD
#define SIMD(f) f
#else
#define SIMD(f) nullptr
#endif
  static const TypeInfo q8_0 = {32, 34, 32, sizeof(BlockQ8_32), quantize_row_q8_32, multi_scalar<dot_q8_0_scalar>,
                                SIMD(multi_q8_0_avx2)};
  static const TypeInfo q4_k = {QK, 144, QK, sizeof(BlockQ8K), quantize_row_q8k, multi_scalar<dot_q4_k_scalar>,
                                SIMD(multi_q45_k_avx2<false>)};
  static const TypeInfo q5_k = {QK, 176, QK, sizeof(BlockQ8K), quantize_row_q8k, multi_scalar<dot_q5_k_scalar>,
                                SIMD(multi_q45_k_avx2<true>)};
  static const TypeInfo q6_k = {QK, 210, QK, sizeof(BlockQ8K), quantize_row_q8k, multi_scalar<dot_q6_k_scalar>,
                                SIMD(multi_q6_k_avx2)};
#undef SIMD
  switch (type) {
    case TYPE_Q8_0: return &q8_0;
    case TYPE_Q4_K: return &q4_k;
    case TYPE_Q5_K: return &q5_k;
    case TYPE_Q6_K: return &q6_k;
    default: return nullptr;
  }
}

inline MultiDotFn pick_dot(const TypeInfo* t) { return (g_use_simd && t->dot_simd) ? t->dot_simd : t->dot_scalar; }

inline int64_t act_row_bytes(const TypeInfo* t, int64_t k) { return k / t->act_block_elems * t->act_block_bytes; }

inline int clamp_threads(int n) { return n < 1 ? 1 : n; }

#ifndef _OPENMP
#define omp_unused(n) (void)(n)
#else
#define omp_unused(n)
#endif

}  // namespace

// ------------------------------------------------------------------ C API

extern "C" {

// One projection of every expert: row r of expert e starts at data + e*expert_stride + r*row_stride.
struct NcMat {
  int32_t type;
  int32_t reserved;
  const uint8_t* data;
  int64_t expert_stride;
  int64_t row_stride;
  int64_t rows;
  int64_t cols;
};

int nc_has_simd() { return NC_SIMD; }

int nc_has_vnni() {
#if NC_SIMD && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return 1;
#else
  return 0;
#endif
}

void nc_set_simd(int on) { g_use_simd = on && NC_SIMD; }

int nc_omp_threads(int n) {
  int used = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(clamp_threads(n))
  {
#pragma omp single
    used = omp_get_num_threads();
  }
#else
  (void)n;
#endif
  return used;
}

int nc_last_threads() { return g_last_threads; }

// The activations exactly as the kernels see them (int8 * scale), for reference computations.
int nc_dequantized_acts(int type, const float* x, int64_t n, int64_t k, float* out) {
  const TypeInfo* t = type_info(type);
  if (!t) return ERR_TYPE;
  if (k % t->act_block_elems) return ERR_SHAPE;
  std::vector<uint8_t> buf(act_row_bytes(t, k));
  for (int64_t r = 0; r < n; ++r) {
    t->quantize(x + r * k, k, buf.data());
    for (int64_t b = 0; b < k / t->act_block_elems; ++b) {
      const uint8_t* blk = buf.data() + b * t->act_block_bytes;
      float d;
      std::memcpy(&d, blk, 4);
      const auto* q = reinterpret_cast<const int8_t*>(blk + 4);
      for (int i = 0; i < t->act_block_elems; ++i) out[r * k + b * t->act_block_elems + i] = d * q[i];
    }
  }
  return OK;
}

// y[n, rows] = x[n, cols] @ W^T for one quantized matrix (row r at w + r*row_stride).
int nc_quant_matmul(int type, const uint8_t* w, int64_t rows, int64_t cols, int64_t row_stride, const float* x,
                    int64_t n, float* y, int nthreads) {
  omp_unused(nthreads);
  const TypeInfo* t = type_info(type);
  if (!t) return ERR_TYPE;
  if (cols % t->block_elems || cols % t->act_block_elems) return ERR_SHAPE;
  const int64_t ab = act_row_bytes(t, cols), nb = cols / t->block_elems;
  std::vector<uint8_t> xq(n * ab);
  const MultiDotFn dot = pick_dot(t);
  const int64_t tiles = (rows + TILE - 1) / TILE;
#pragma omp parallel num_threads(clamp_threads(nthreads))
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r) t->quantize(x + r * cols, cols, xq.data() + r * ab);
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < tiles; ++tile) {
      for (int64_t r = tile * TILE; r < std::min(rows, (tile + 1) * TILE); ++r)
        dot(w + r * row_stride, nb, xq.data(), ab, nullptr, n, y + r, rows);
    }
  }
  return OK;
}

// out[T, H] = sum_k weights[t, k] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, k].
// Parallel phases over all active experts at once (one barrier between them, not per expert):
//   1. gate|up rows x the tokens routed to each expert -> gu [pairs, 2I] (fp32); the thread that
//      completes an expert then forms silu(gate) * up for its tokens, re-quantized for the down
//      projection
//   2. down rows in tiles; each tile walks the experts in ascending order and accumulates
//      into out, so every output element sums its experts in a fixed order (deterministic).
int nc_moe_forward(const float* x, int64_t T, int64_t H, const int64_t* ids, const float* weights, int64_t k,
                   int64_t E, const NcMat* gate, const NcMat* up, const NcMat* down, float* out, int nthreads) {
  omp_unused(nthreads);
  const TypeInfo *tg = type_info(gate->type), *tu = type_info(up->type), *td = type_info(down->type);
  if (!tg || !tu || !td) return ERR_TYPE;
  const int64_t I = gate->rows;
  if (up->rows != I || gate->cols != H || up->cols != H || down->rows != H || down->cols != I) return ERR_SHAPE;
  for (const auto& p : {std::make_pair(tg, H), std::make_pair(tu, H), std::make_pair(td, I)}) {
    if (p.second % p.first->block_elems || p.second % p.first->act_block_elems) return ERR_SHAPE;
  }
  std::memset(out, 0, sizeof(float) * T * H);
  const int64_t P = T * k;
  if (P == 0) return OK;

  // (token, slot) pairs grouped by expert, in token order within an expert.
  std::vector<int64_t> offs(E + 1, 0);
  for (int64_t p = 0; p < P; ++p) {
    if (ids[p] < 0 || ids[p] >= E) return ERR_EXPERT_ID;
    ++offs[ids[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) offs[e + 1] += offs[e];
  std::vector<int64_t> pair_tok(P), fill(offs.begin(), offs.end() - 1);
  std::vector<float> pair_w(P);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t slot = fill[ids[p]]++;
    pair_tok[slot] = p / k;
    pair_w[slot] = weights[p];
  }
  std::vector<int64_t> active;
  int64_t max_tokens = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (offs[e + 1] > offs[e]) active.push_back(e);
    max_tokens = std::max(max_tokens, offs[e + 1] - offs[e]);
  }
  const int64_t n_active = static_cast<int64_t>(active.size());

  const bool same_act = tg->quantize == tu->quantize;
  const int64_t ab_g = act_row_bytes(tg, H), ab_u = act_row_bytes(tu, H), ab_d = act_row_bytes(td, I);
  std::vector<uint8_t> xq_g(T * ab_g), xq_u(same_act ? 0 : T * ab_u), hq(P * ab_d);
  const uint8_t* xq_up = same_act ? xq_g.data() : xq_u.data();
  std::vector<float> gu(P * 2 * I);
  const MultiDotFn dot_g = pick_dot(tg), dot_u = pick_dot(tu), dot_d = pick_dot(td);
  std::unique_ptr<std::atomic<int64_t>[]> tiles_done(new std::atomic<int64_t>[n_active]);
  for (int64_t a = 0; a < n_active; ++a) tiles_done[a].store(0, std::memory_order_relaxed);
  const bool parallel_quant = T > 8;
  uint8_t* const xq_g_ptr = xq_g.data();
  auto quantize_x = [&](int64_t t) {
    tg->quantize(x + t * H, H, xq_g_ptr + t * ab_g);
    if (!same_act) tu->quantize(x + t * H, H, xq_u.data() + t * ab_u);
  };
  const int64_t nb_g = H / tg->block_elems, nb_u = H / tu->block_elems, nb_d = I / td->block_elems;
  const int64_t gu_tiles = (2 * I + TILE - 1) / TILE, down_tiles = (H + TILE - 1) / TILE;

  // A few tokens are quantized faster than a barrier costs: before the team starts, then.
  if (!parallel_quant)
    for (int64_t t = 0; t < T; ++t) quantize_x(t);
#pragma omp parallel num_threads(clamp_threads(nthreads))
  {
#ifdef _OPENMP
#pragma omp master
    g_last_threads = omp_get_num_threads();
#else
    g_last_threads = 1;
#endif
    if (parallel_quant) {
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) quantize_x(t);
    }
    // Phase 1: gate and up rows of the active experts; whoever finishes an expert's last tile
    // computes silu(gate) * up for its tokens and quantizes it for the down projection (phase 2),
    // so no barrier separates the two. Dynamic scheduling: on a busy machine a descheduled thread
    // would otherwise hold a static share and stall the barrier for a whole time slice.
    std::vector<float> h(I), y(max_tokens);
#pragma omp for schedule(dynamic, 2)
    for (int64_t item = 0; item < n_active * gu_tiles; ++item) {
      const int64_t a = item / gu_tiles, e = active[a], tile = item % gu_tiles;
      for (int64_t r = tile * TILE; r < std::min(2 * I, (tile + 1) * TILE); ++r) {
        const bool is_gate = r < I;
        const NcMat* m = is_gate ? gate : up;
        const uint8_t* row = m->data + e * m->expert_stride + (is_gate ? r : r - I) * m->row_stride;
        const uint8_t* xq = is_gate ? xq_g_ptr : xq_up;
        const int64_t ab = is_gate ? ab_g : ab_u, nb = is_gate ? nb_g : nb_u;
        const MultiDotFn dot = is_gate ? dot_g : dot_u;
        dot(row, nb, xq, ab, pair_tok.data() + offs[e], offs[e + 1] - offs[e], gu.data() + offs[e] * 2 * I + r, 2 * I);
      }
      if (tiles_done[a].fetch_add(1, std::memory_order_acq_rel) + 1 == gu_tiles) {
        for (int64_t p = offs[e]; p < offs[e + 1]; ++p) {
          const float* g = gu.data() + p * 2 * I;
          for (int64_t i = 0; i < I; ++i) h[i] = silu(g[i]) * g[I + i];
          td->quantize(h.data(), I, hq.data() + p * ab_d);
        }
      }
    }
    // Phase 2: down rows, weighted sum over each token's experts.
#pragma omp for schedule(dynamic, 1)
    for (int64_t tile = 0; tile < down_tiles; ++tile) {
      const int64_t r0 = tile * TILE, r1 = std::min(H, (tile + 1) * TILE);
      for (int64_t e : active) {
        const int64_t n_e = offs[e + 1] - offs[e];
        for (int64_t r = r0; r < r1; ++r) {
          dot_d(down->data + e * down->expert_stride + r * down->row_stride, nb_d, hq.data() + offs[e] * ab_d, ab_d,
                nullptr, n_e, y.data(), 1);
          for (int64_t j = 0; j < n_e; ++j) out[pair_tok[offs[e] + j] * H + r] += pair_w[offs[e] + j] * y[j];
        }
      }
    }
  }
  return OK;
}

}  // extern "C"
