// Linear layers on the CPU: y = x @ W^T (+ bias) with W in GGML blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4) or dense (F32, F16, BF16), for decode (a few rows of x) and prefill.
//
// Scheme for the quantized types (as llama.cpp does it): each row of x is quantized once per call to
// int8 blocks of 32 (fp32 scale d = amax / 127, integer sums of every 16), so the inner products are
// integer dot products of the weights' small unsigned codes with int8 activations (AVX-512 VNNI
// `vpdpbusd`, AVX2 `maddubs`, NEON `sdot` or `smull`), scaled per 32-block (per 16 for Q2_K, Q3_K, Q6_K)
// and accumulated in fp32. The result is x_hat @ W^T up to fp32 rounding, where x_hat is the int8-rounded x:
// |x_hat - x| <= d / 2 per element.
//
// "Two-level" mode (x2): the rounding residual is quantized again to int8 on a 256x finer grid
// (x = d * q1 + d / 256 * q2 + r, |r| <= d / 512, or d / 256 where q2 clamps at +-127, i.e.
// |r| <= amax / 32512) and both code sets are dotted with the same
// unpacked weights, combined exactly in int32 as 256 * dot(q1) + dot(q2). ~15-bit activations for
// twice the integer work, which is nearly free while decode waits on memory. (AVX2, which has no
// VNNI, dots the combined code as int16 in one pass instead: V256::dots_wide.)
//
// Dense weights are exact, so x is not quantized for them: fp32 x (bf16 converted exactly) times the
// fp32 weights with fp32 FMAs, 4 partial sums per output row (column i into partial i % 4: independent
// FMA chains), combined as (p0 + p1) + (p2 + p3). Within fp32 rounding of x @ W^T.
//
// Weights are repacked once at load into "tiles" of 16 output rows, the same number of bytes as
// the GGML blocks: per tile and block, the 16 rows' scales are stored side by side (one vector
// load) and the quants are interleaved 4 bytes per row, so one `vpdpbusd` against a broadcast
// group of 4 activations advances 16 rows at once and no horizontal sums are needed. A tile's
// codes are unpacked once per block for up to 8 rows of x; for prefill's many rows (two levels) a thread
// widens its tile once to int16 and dots 6-8 rows of x at a time against it (tile_gemm). Dense tiles hold
// the 16 rows' values of each column side by side: one vector load per column, FMA'd with x[i].
// The SIMD kernels prefetch the weight stream in software (PF_AHEAD): decode reads each weight once
// from DRAM, and the hardware prefetchers alone leave the K-quant kernels at a third to a half of the
// memory bandwidth.
//
// Code paths, the best one the build has (simd.h's NC_ISA) with a runtime override for tests:
// AVX-512 VNNI, AVX2 (+FMA, F16C), NEON (128 bits, 4 rows a vector; SDOT with dotprod) and scalar. All
// perform the same fp32 operations in the same order, so their outputs are bit-identical, and a row's
// output does not depend on the other rows of the batch.
//
// nc_qg_matmul_rows (and matmul_rows, for moe.cpp) computes the same products from weights left in
// GGML's row layout (see "raw GGML rows"). nc_qg_dequant_rows reads rows back from the tiles (a tied
// embedding / LM head keeps one copy), equal to gguf's dequantization of the raw rows bit for bit.
//
// Plain C ABI (ctypes). Parallel over tiles with a small pool of its own (see Pool): the caller
// never waits for a worker that has not started, so a busy machine costs at most the 1-thread time.

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "qgemv.h"
#include "simd.h"

namespace {

using nc::qg::Acts;
using nc::qg::ActBuffer;
using nc::qg::parallel_for;

constexpr int ROWS = 16;  // output rows per tile
constexpr int TMAX = 8;   // rows of x per pass over a tile
constexpr int TMAX_DENSE_AVX2 = 12;  // dense weights on AVX2: two of dense_split's 6-row passes
enum : int {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30, MXFP4 = 39
};
enum : int { OK = 0, ERR_TYPE = 1, ERR_SHAPE = 2, ERR_RANGE = 3 };

int g_simd = NC_ISA;
std::atomic<uint64_t> g_calls{0};  // nc_qg_matmul calls that widen their tiles once (tile_gemm)

// ------------------------------------------------------------------ formats
// Per type: raw GGML block (elements, bytes) and the layout of one tile block (16 rows x 1 block).
// Offsets inside a tile block:
//   D     16 x f16 d (MXFP4: 16 E8M0 bytes)   M   16 x f16 m (Q4_1, Q5_1) or dmin (Q2_K, Q4_K, Q5_K)
//   SC    K-quants: Q3_K/Q4_K/Q5_K the 12 packed scale bytes as 12 planes of 16 (plane k = byte k of
//         each row); Q2_K 16 planes of its scale bytes (scale | min << 4); Q6_K 16 planes of 16
//         int8 scales
//   QH    one bit per element as 64-bit masks, mask bit 4r+i = element 4G+i of row r (Q5_*: bit 4
//         of the code, one mask per group G; Q5_K: 8 per sub-block; Q3_K: bit 2 of the code, i.e.
//         the raw hmask bit, 8 per sub-block)
//   QS    4-bit codes: per 32 elements (two sub-blocks for K-quants) 4 or 8 chunks of 64 bytes,
//         byte 4r+i of chunk p: low nibble element 4p+i, high nibble element 16+4p+i (Q4_0..Q5_1)
//         or element 4p+i of the next sub-block (K-quants); Q8_0: 8 chunks of int8, byte 4r+i
//         of chunk G = element 4G+i
//   Q2    2-bit fields: per 4 sub-blocks 8 chunks of 64 bytes, bits 2k..2k+1 of byte 4r+i of
//         chunk G = element 4G+i of sub-block 4c+k; Q6_K's code bits 4..5, Q2_K's and Q3_K's 0..1
// Codes are unsigned: Q2_K 0..3, Q3_K 0..7 (q + 4), Q4 0..15, Q5 0..31, Q6_K 0..63 (q + 32). MXFP4's
// tiles hold its 4-bit indices as Q4_0's; the kernels look them up as MX_CODES (the doubled E2M1 value + 12).
// Dense types (elems 1): a tile block is one column, the 16 rows' values side by side.
struct Fmt {
  int type, elems, raw_bytes, tile_bytes;
  int d, m, sc, qh, qs, q2;
};

constexpr Fmt FMTS[] = {
    {Q4_0, 32, 18, 288, 0, -1, -1, -1, 32, -1},
    {Q4_1, 32, 20, 320, 0, 32, -1, -1, 64, -1},
    {Q5_0, 32, 22, 352, 0, -1, -1, 32, 96, -1},
    {Q5_1, 32, 24, 384, 0, 32, -1, 64, 128, -1},
    {Q8_0, 32, 34, 544, 0, -1, -1, -1, 32, -1},
    {Q2_K, 256, 84, 1344, 0, 32, 64, -1, -1, 320},
    {Q3_K, 256, 110, 1760, 0, -1, 32, 224, -1, 736},
    {Q4_K, 256, 144, 2304, 0, 32, 64, -1, 256, -1},
    {Q5_K, 256, 176, 2816, 0, 32, 64, 256, 768, -1},
    {Q6_K, 256, 210, 3360, 0, -1, 32, -1, 288, 2336},
    {MXFP4, 32, 17, 272, 0, -1, -1, -1, 16, -1},
    {F32, 1, 4, 64, -1, -1, -1, -1, -1, -1},
    {F16, 1, 2, 32, -1, -1, -1, -1, -1, -1},
    {BF16, 1, 2, 32, -1, -1, -1, -1, -1, -1},
};

// Offsets inside a raw GGML block: the fp16 d, the fp16 min (Q4_1, Q5_1) or dmin (Q2_K, Q4_K, Q5_K), the
// K-quants' scale bytes.
constexpr int raw_d(int type) { return type == Q6_K ? 208 : type == Q2_K ? 80 : type == Q3_K ? 108 : 0; }
constexpr int raw_m(int type) { return type == Q2_K ? 82 : 2; }
constexpr int raw_sc(int type) { return type == Q3_K ? 96 : type == Q6_K ? 192 : type == Q2_K ? 0 : 4; }
// Scale bytes of the K-quants: 16 (Q2_K, Q6_K) or 12 packed.
constexpr int raw_sc_bytes(int type) { return type == Q6_K || type == Q2_K ? 16 : 12; }

// Bytes of the block scale d: an fp16, or MXFP4's E8M0 exponent.
constexpr int d_bytes(int type) { return type == MXFP4 ? 1 : 2; }

// MXFP4: ggml's kvalues_mxfp4 (E2M1 values doubled, integers in [-12, 12]) + 12 per 4-bit index, so the codes
// are unsigned as the other types' (the kernels subtract 12 times the activation sums, as Q4_0's 8); the
// block's scale is then 2^(e - 128), half the E8M0 scale. Integer codes make the int8 dot products exact.
constexpr int MX_OFF = 12;
alignas(16) constexpr int8_t MX_CODES[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// 2^(e - 128) by its bits, as ggml_e8m0_to_fp32_half: e = 0, 1 the subnormals 2^-128, 2^-127.
inline float e8m0_half(uint8_t e) { return nc::as_float(e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23); }

// A block's scale d at p (an fp16, or MXFP4's E8M0 byte) as fp32.
inline float rd_scale(int type, const uint8_t* p) { return type == MXFP4 ? e8m0_half(*p) : nc::rd_f16(p); }

// Bit position of the Q2 fields in the code.
constexpr int q2_shift(int type) { return type == Q6_K ? 4 : 0; }

const Fmt* find_fmt(int type) {
  for (const Fmt& f : FMTS)
    if (f.type == type) return &f;
  return nullptr;
}

constexpr Fmt fmt_of(int type) {
  for (const Fmt& f : FMTS)
    if (f.type == type) return f;
  return FMTS[0];
}

// Software prefetch of the weight stream, PF_AHEAD bytes ahead of the block being read. A 1-row GEMV
// walks each tile (and, on one thread, the whole weight) front to back, but the hardware prefetchers
// do not run far enough ahead of these kernels (each 64-byte line is consumed over ~10-20 cycles of
// unpacking and dot products): without it a weight read from DRAM streams at 12-30 GB/s, with it at
// the machine's bandwidth (35-45 GB/s on one Zen 5 core). The lines are issued a few at a time, spread
// over a block's sub-blocks (measured: a burst of a whole block's 36-56 lines streams 15-30% slower, and
// as a loop costs ~20% in cache-resident calls). Prefetches never fault: running past the end is harmless.
// Only the pass over a tile for the first rows of x prefetches: the passes for the next rows find the
// tile in cache, and prefetching ahead again would only evict their working set (prefill: -10%). In the
// 1-row kernels that test is compile-time (T == 1): the compiler then interleaves the prefetches with
// the block's loads, where behind a runtime branch they go out as a burst before them and Q8_0 streams
// 20% slower. (The runtime test costs the 8-row Q6_K kernel 2-4% in cache; a template parameter instead
// cost Q8_0 prefill 8%.) F32 weights are not prefetched: the hardware keeps up with that kernel.
// The lines go to L2, not L1 (prefetcht1): weights then stream from DRAM faster, the same in cache
// (benchmarks/README.md, "Weights prefetched into L2").
constexpr int PF_AHEAD = 12 << 10;

template <int LINES>
__attribute__((always_inline)) inline void prefetch_lines(const uint8_t* p) {
#pragma GCC unroll 16
  for (int i = 0; i < LINES; ++i) __builtin_prefetch(p + 64 * i, 0, 2);  // prefetcht1: into L2
}

using nc::bf16_to_f32;
using nc::f16_to_f32;
using nc::f32_to_bf16;
using nc::rd_f16;

// Q4_K / Q5_K: scale and min j (0..7) of the 12 packed bytes.
inline void k_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q3_K: signed scale j (0..15) of the 12 packed bytes: low 4 bits in the nibbles of bytes 0..7
// (scales 0..7 low, 8..15 high), 2 high bits in bytes 8..11 (byte 8 + j % 4, bits 2 (j / 4)).
inline int q3_scale(const uint8_t* s, int j) {
  const int lo = j < 8 ? s[j] & 15 : s[j - 8] >> 4;
  return (lo | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
}

// ------------------------------------------------------------------ repacking
// Decode one raw block's codes into `q` (unsigned as in the tiles; Q8_0's int8 as its bytes in uint8_t,
// as values in int16_t; MXFP4's 4-bit indices).

template <class T>
void raw_codes(int type, const uint8_t* b, T* q) {
  switch (type) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case MXFP4: {
      const int qs = type == MXFP4 ? 1 : type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8;
      for (int j = 0; j < 16; ++j) {
        q[j] = b[qs + j] & 15;
        q[j + 16] = b[qs + j] >> 4;
      }
      if (type == Q5_0 || type == Q5_1) {
        uint32_t qh;
        std::memcpy(&qh, b + (type == Q5_0 ? 2 : 4), 4);
        for (int j = 0; j < 32; ++j) q[j] |= ((qh >> j) & 1) << 4;
      }
      break;
    }
    case Q8_0:
      for (int j = 0; j < 32; ++j) q[j] = static_cast<T>(static_cast<int8_t>(b[2 + j]));
      break;
    case Q4_K: case Q5_K: {
      const uint8_t* qs = b + (type == Q4_K ? 16 : 48);
      for (int c = 0; c < 4; ++c)
        for (int j = 0; j < 32; ++j) {
          q[64 * c + j] = qs[32 * c + j] & 15;
          q[64 * c + 32 + j] = qs[32 * c + j] >> 4;
        }
      if (type == Q5_K)
        for (int s = 0; s < 8; ++s)
          for (int j = 0; j < 32; ++j) q[32 * s + j] |= ((b[16 + j] >> s) & 1) << 4;
      break;
    }
    case Q2_K: case Q3_K:  // per 128 elements 32 bytes of 4 two-bit fields: element 32j + l in byte l
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 4; ++j)
          for (int l = 0; l < 32; ++l) {
            const int e = 128 * h + 32 * j + l;
            q[e] = (b[(type == Q2_K ? 16 : 32) + 32 * h + l] >> (2 * j)) & 3;
            if (type == Q3_K) q[e] |= ((b[l] >> (4 * h + j)) & 1) << 2;  // hmask bit e / 32 of byte l
          }
      break;
    case Q6_K:
      for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = b + 64 * h;
        const uint8_t* qh = b + 128 + 32 * h;
        for (int j = 0; j < 64; ++j) {
          q[128 * h + j] = ql[j] & 15;
          q[128 * h + 64 + j] = ql[j] >> 4;
        }
        for (int l = 0; l < 4; ++l)
          for (int j = 0; j < 32; ++j) q[128 * h + 32 * l + j] |= ((qh[j] >> (2 * l)) & 3) << 4;
      }
      break;
  }
}

// Write row r's block (raw bytes `b`, or zeros when b == nullptr) into tile block `t`.
void pack_row(const Fmt& f, const uint8_t* b, int r, uint8_t* t) {
  static const uint8_t zero[256] = {0};
  uint8_t q[256];
  if (b == nullptr) {
    b = zero;
    std::memset(q, 0, sizeof q);
  } else {
    raw_codes(f.type, b, q);
  }
  const int type = f.type;
  std::memcpy(t + f.d + d_bytes(type) * r, b + raw_d(type), d_bytes(type));
  if (f.m >= 0) std::memcpy(t + f.m + 2 * r, b + raw_m(type), 2);
  if (f.sc >= 0)
    for (int k = 0; k < raw_sc_bytes(type); ++k) t[f.sc + 16 * k + r] = b[raw_sc(type) + k];
  auto set_bit = [&](int off, int mask_index, int r_, int i, int bit) {
    if (bit) t[off + 8 * mask_index + (4 * r_ + i) / 8] |= static_cast<uint8_t>(1u << ((4 * r_ + i) % 8));
  };
  if (type == Q8_0) {
    for (int g = 0; g < 8; ++g) std::memcpy(t + f.qs + 64 * g + 4 * r, q + 4 * g, 4);
    return;
  }
  const int subs = f.elems / 32;
  for (int s = 0; s < subs; ++s) {
    const uint8_t* qq = q + 32 * s;
    for (int g = 0; g < 8; ++g)
      for (int i = 0; i < 4; ++i) {
        const int e = 4 * g + i;
        // the 4 low bits
        if (f.elems == 32) {  // nibble pairs inside the block: chunk g % 4, high nibble for g >= 4
          uint8_t& dst = t[f.qs + 64 * (g % 4) + 4 * r + i];
          dst |= static_cast<uint8_t>((qq[e] & 15) << (g >= 4 ? 4 : 0));
        } else if (f.qs >= 0) {  // sub-block pairs: chunk g of pair s / 2, high nibble for odd s
          uint8_t& dst = t[f.qs + 512 * (s / 2) + 64 * g + 4 * r + i];
          dst |= static_cast<uint8_t>((qq[e] & 15) << (s % 2 ? 4 : 0));
        }
        if (type == Q5_0 || type == Q5_1) set_bit(f.qh, g, r, i, (qq[e] >> 4) & 1);
        if (type == Q5_K) set_bit(f.qh, 8 * s + g, r, i, (qq[e] >> 4) & 1);
        if (type == Q3_K) set_bit(f.qh, 8 * s + g, r, i, (qq[e] >> 2) & 1);
        if (f.q2 >= 0) {
          uint8_t& dst = t[f.q2 + 512 * (s / 4) + 64 * g + 4 * r + i];
          dst |= static_cast<uint8_t>(((qq[e] >> q2_shift(type)) & 3) << (2 * (s % 4)));
        }
      }
  }
}

// ------------------------------------------------------------------ activations

inline float load_x(const void* x, int bf16, int64_t i) {
  return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(x)[i]) : static_cast<const float*>(x)[i];
}

inline int round_i8(float v) { return std::min(127, std::max(-127, static_cast<int>(std::nearbyint(v)))); }

// q2 == nullptr: one level. Else also the residual x - d * q on the grid d / 256 (power of two: the
// combined scale d / 256 is exact, and 256 q + q2 needs no rescaling).
void quantize_row(const void* x, int bf16, int64_t k, int8_t* q, int8_t* q2, float* d, int32_t* s16, float* ds) {
  float buf[32];
  for (int64_t b = 0; b < k / 32; ++b) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) {
      buf[i] = load_x(x, bf16, 32 * b + i);
      amax = std::max(amax, std::fabs(buf[i]));
    }
    const float scale = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sums[2] = {0, 0};
    for (int i = 0; i < 32; ++i) {
      const int v = round_i8(buf[i] * inv);
      q[32 * b + i] = static_cast<int8_t>(v);
      int c = v;
      if (q2) {
        const int v2 = round_i8((buf[i] - scale * static_cast<float>(v)) * (256.0f * inv));
        q2[32 * b + i] = static_cast<int8_t>(v2);
        c = 256 * v + v2;
      }
      sums[i / 16] += c;
    }
    d[b] = q2 ? scale * (1.0f / 256.0f) : scale;
    s16[2 * b] = sums[0];
    s16[2 * b + 1] = sums[1];
    ds[b] = d[b] * static_cast<float>(sums[0] + sums[1]);
  }
}

#if NC_HAS_AVX512
// quantize_row for float32 x with AVX-512: the same fp32 operations (cvtps rounds to nearest even
// like nearbyint; products and differences are separate ops), so the codes are identical.
inline __m512 load16(const void* x, int bf16, int64_t i) {  // 16 floats from float32 or bf16 input
  if (!bf16) return _mm512_loadu_ps(static_cast<const float*>(x) + i);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(x) + i));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

void quantize_row_avx512(const void* x, int bf16, int64_t k, int8_t* q, int8_t* q2, float* d, int32_t* s16,
                         float* ds) {
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
  auto codes = [&](__m512 v) { return _mm512_max_epi32(nlim, _mm512_min_epi32(lim, _mm512_cvtps_epi32(v))); };
  for (int64_t b = 0; b < k / 32; ++b) {
    const __m512 x0 = load16(x, bf16, 32 * b), x1 = load16(x, bf16, 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(x0, absmask), _mm512_and_ps(x1, absmask)));
    const float scale = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512 vinv = _mm512_set1_ps(inv);
    __m512i c0 = codes(_mm512_mul_ps(x0, vinv)), c1 = codes(_mm512_mul_ps(x1, vinv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b), _mm512_cvtepi32_epi8(c0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b + 16), _mm512_cvtepi32_epi8(c1));
    if (q2) {
      const __m512 vs = _mm512_set1_ps(scale), vinv2 = _mm512_set1_ps(256.0f * inv);
      const __m512i r0 = codes(_mm512_mul_ps(_mm512_sub_ps(x0, _mm512_mul_ps(vs, _mm512_cvtepi32_ps(c0))), vinv2));
      const __m512i r1 = codes(_mm512_mul_ps(_mm512_sub_ps(x1, _mm512_mul_ps(vs, _mm512_cvtepi32_ps(c1))), vinv2));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + 32 * b), _mm512_cvtepi32_epi8(r0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + 32 * b + 16), _mm512_cvtepi32_epi8(r1));
      c0 = _mm512_add_epi32(_mm512_slli_epi32(c0, 8), r0);
      c1 = _mm512_add_epi32(_mm512_slli_epi32(c1, 8), r1);
    }
    const int sum0 = _mm512_reduce_add_epi32(c0), sum1 = _mm512_reduce_add_epi32(c1);
    d[b] = q2 ? scale * (1.0f / 256.0f) : scale;
    s16[2 * b] = sum0;
    s16[2 * b + 1] = sum1;
    ds[b] = d[b] * static_cast<float>(sum0 + sum1);
  }
}
#endif

#if NC_HAS_AVX2
// quantize_row with AVX2, for the same reason and with the same fp32 operations (identical codes): prefill
// quantizes every row of x for each matmul, ~10% of an AVX2 prefill step when done in scalar code.
inline __m256 load8(const void* x, int bf16, int64_t i) {  // 8 floats from float32 or bf16 input
  if (!bf16) return _mm256_loadu_ps(static_cast<const float*>(x) + i);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 32 int32 codes in [-127, 127] (4 vectors, in order) -> 32 int8 (saturating packs are exact here).
inline void store_codes(int8_t* dst, const __m256i c[4]) {
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  // the packs work per 128-bit lane: dwords come out as c0[0:4] c1[0:4] c2[0:4] c3[0:4] c0[4:8] ...
  const __m256i order = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), order);
}

inline int hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

void quantize_row_avx2(const void* x, int bf16, int64_t k, int8_t* q, int8_t* q2, float* d, int32_t* s16,
                       float* ds) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
  auto codes = [&](__m256 v) { return _mm256_max_epi32(nlim, _mm256_min_epi32(lim, _mm256_cvtps_epi32(v))); };
  for (int64_t b = 0; b < k / 32; ++b) {
    __m256 xs[4];
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      xs[j] = load8(x, bf16, 32 * b + 8 * j);
      m = _mm256_max_ps(m, _mm256_and_ps(xs[j], absmask));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float scale = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i c[4];
    for (int j = 0; j < 4; ++j) c[j] = codes(_mm256_mul_ps(xs[j], vinv));
    store_codes(q + 32 * b, c);
    if (q2) {
      const __m256 vs = _mm256_set1_ps(scale), vinv2 = _mm256_set1_ps(256.0f * inv);
      __m256i r[4];
      for (int j = 0; j < 4; ++j) {
        r[j] = codes(_mm256_mul_ps(_mm256_sub_ps(xs[j], _mm256_mul_ps(vs, _mm256_cvtepi32_ps(c[j]))), vinv2));
      }
      store_codes(q2 + 32 * b, r);
      for (int j = 0; j < 4; ++j) c[j] = _mm256_add_epi32(_mm256_slli_epi32(c[j], 8), r[j]);
    }
    const int sum0 = hsum8(_mm256_add_epi32(c[0], c[1])), sum1 = hsum8(_mm256_add_epi32(c[2], c[3]));
    d[b] = q2 ? scale * (1.0f / 256.0f) : scale;
    s16[2 * b] = sum0;
    s16[2 * b + 1] = sum1;
    ds[b] = d[b] * static_cast<float>(sum0 + sum1);
  }
}
#endif

#if NC_HAS_NEON
// quantize_row with NEON, for the same reason and with the same fp32 operations: fcvtns rounds to nearest
// even as nearbyint does, products and differences are separate ops, so the codes are identical.
inline float32x4_t load4(const void* x, int bf16, int64_t i) {  // 4 floats from float32 or bf16 input
  if (!bf16) return vld1q_f32(static_cast<const float*>(x) + i);
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(static_cast<const uint16_t*>(x) + i), 16));
}

void quantize_row_neon(const void* x, int bf16, int64_t k, int8_t* q, int8_t* q2, float* d, int32_t* s16,
                       float* ds) {
  const int32x4_t lim = vdupq_n_s32(127), nlim = vdupq_n_s32(-127);
  auto codes = [&](float32x4_t v) { return vmaxq_s32(nlim, vminq_s32(lim, vcvtnq_s32_f32(v))); };
  // 32 int32 codes in [-127, 127] -> 32 int8 (the narrowing is exact)
  auto store = [](int8_t* dst, const int32x4_t c[8]) {
    for (int h = 0; h < 2; ++h) {
      const int16x8_t a = vcombine_s16(vmovn_s32(c[4 * h]), vmovn_s32(c[4 * h + 1]));
      const int16x8_t b = vcombine_s16(vmovn_s32(c[4 * h + 2]), vmovn_s32(c[4 * h + 3]));
      vst1q_s8(dst + 16 * h, vcombine_s8(vmovn_s16(a), vmovn_s16(b)));
    }
  };
  for (int64_t b = 0; b < k / 32; ++b) {
    float32x4_t xs[8];
    float32x4_t m = vdupq_n_f32(0.0f);
    for (int j = 0; j < 8; ++j) {
      xs[j] = load4(x, bf16, 32 * b + 4 * j);
      m = vmaxq_f32(m, vabsq_f32(xs[j]));
    }
    const float amax = vmaxvq_f32(m);
    const float scale = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32x4_t c[8];
    for (int j = 0; j < 8; ++j) c[j] = codes(vmulq_n_f32(xs[j], inv));
    store(q + 32 * b, c);
    if (q2) {
      const float32x4_t vs = vdupq_n_f32(scale);
      int32x4_t r[8];
      for (int j = 0; j < 8; ++j)
        r[j] = codes(vmulq_n_f32(vsubq_f32(xs[j], vmulq_f32(vs, vcvtq_f32_s32(c[j]))), 256.0f * inv));
      store(q2 + 32 * b, r);
      for (int j = 0; j < 8; ++j) c[j] = vaddq_s32(vshlq_n_s32(c[j], 8), r[j]);
    }
    const int sum0 = vaddvq_s32(vaddq_s32(vaddq_s32(c[0], c[1]), vaddq_s32(c[2], c[3])));
    const int sum1 = vaddvq_s32(vaddq_s32(vaddq_s32(c[4], c[5]), vaddq_s32(c[6], c[7])));
    d[b] = q2 ? scale * (1.0f / 256.0f) : scale;
    s16[2 * b] = sum0;
    s16[2 * b + 1] = sum1;
    ds[b] = d[b] * static_cast<float>(sum0 + sum1);
  }
}
#endif

void quantize_any(const void* x, int bf16, int64_t k, int8_t* q, int8_t* q2, float* d, int32_t* s16, float* ds) {
#if NC_HAS_AVX512
  if (g_simd >= NC_ISA_AVX512) return quantize_row_avx512(x, bf16, k, q, q2, d, s16, ds);
#endif
#if NC_HAS_AVX2
  if (g_simd >= NC_ISA_AVX2) return quantize_row_avx2(x, bf16, k, q, q2, d, s16, ds);
#endif
#if NC_HAS_NEON
  if (g_simd >= NC_ISA_NEON) return quantize_row_neon(x, bf16, k, q, q2, d, s16, ds);
#endif
  quantize_row(x, bf16, k, q, q2, d, s16, ds);
}

// ------------------------------------------------------------------ scalar kernel
// The reference for the SIMD paths: the same fp32 operations in the same order.

struct Out {  // where a tile's results go
  void* y;
  int bf16;
  int64_t ldy;
  const float* bias;
  int64_t rows;
};

inline void store_rows(const Out& o, int64_t t, int64_t row0, const float* acc) {
  const int64_t n = std::min<int64_t>(ROWS, o.rows - row0);
  for (int64_t r = 0; r < n; ++r) {
    float v = acc[r];
    if (o.bias) v += o.bias[row0 + r];
    if (o.bf16)
      static_cast<uint16_t*>(o.y)[t * o.ldy + row0 + r] = f32_to_bf16(v);
    else
      static_cast<float*>(o.y)[t * o.ldy + row0 + r] = v;
  }
}

// Codes of sub-block s (32 elements) of row r in tile block `b`.
inline int code(const Fmt& f, const uint8_t* b, int s, int r, int e) {
  const int g = e / 4, i = e % 4;
  auto bit = [&](int off, int mask_index) { return (b[off + 8 * mask_index + (4 * r + i) / 8] >> ((4 * r + i) % 8)) & 1; };
  if (f.type == Q8_0) return static_cast<int8_t>(b[f.qs + 64 * g + 4 * r + i]);
  int v = 0;
  if (f.elems == 32) {
    const uint8_t byte = b[f.qs + 64 * (g % 4) + 4 * r + i];
    v = g >= 4 ? byte >> 4 : byte & 15;
  } else if (f.qs >= 0) {
    const uint8_t byte = b[f.qs + 512 * (s / 2) + 64 * g + 4 * r + i];
    v = s % 2 ? byte >> 4 : byte & 15;
  }
  if (f.type == Q5_0 || f.type == Q5_1) v |= bit(f.qh, g) << 4;
  if (f.type == Q5_K) v |= bit(f.qh, 8 * s + g) << 4;
  if (f.type == Q3_K) v |= bit(f.qh, 8 * s + g) << 2;
  if (f.q2 >= 0) v |= ((b[f.q2 + 512 * (s / 4) + 64 * g + 4 * r + i] >> (2 * (s % 4))) & 3) << q2_shift(f.type);
  return v;
}

constexpr int int_offset(int type) { return type == Q4_0 ? 8 : type == Q5_0 ? 16 : type == MXFP4 ? MX_OFF : 0; }
// The offset a type's unsigned codes carry (Q6_K's q + 32, Q3_K's q + 4 besides int_offset's): what the widened
// int16 codes have taken out.
constexpr int wide_offset(int type) { return type == Q6_K ? 32 : type == Q3_K ? 4 : int_offset(type); }
// Whether a type's blocks scale each 16-element half on its own (the other types: each 32-element block).
constexpr bool half_scales(int type) { return type == Q6_K || type == Q3_K || type == Q2_K; }

// K-quants: the integer scale and min of the two 16-element halves of sub-block s from the block's scale
// bytes (Q4_K / Q5_K have one per 32: both halves alike).
inline void sub_scales(int type, const uint8_t* raw, int s, int sc[2], int mn[2]) {
  for (int h = 0; h < 2; ++h) {
    mn[h] = 0;
    switch (type) {
      case Q4_K: case Q5_K: k_scale_min(raw, s, sc[h], mn[h]); break;
      case Q6_K: sc[h] = static_cast<int8_t>(raw[2 * s + h]); break;
      case Q3_K: sc[h] = q3_scale(raw, 2 * s + h); break;
      default: sc[h] = raw[2 * s + h] & 15; mn[h] = raw[2 * s + h] >> 4; break;  // Q2_K
    }
  }
}

// One row's block as the scalar kernels read it: the codes, d, m (the min of Q4_1 / Q5_1, the dmin of
// Q2_K / Q4_K / Q5_K), and the K-quants' integer scales and mins of each sub-block's 16-element halves.
struct RowBlock {
  int16_t c[256];  // (int16: the dot loops below vectorize, e.g. NEON or SSE2 in portable builds)
  float d, m;
  int sc[8][2], mn[8][2];
  float dg[8][2], mg[8][2];  // d * sc and m * mn (32-element blocks: d and m), the kernels' fp32 products
};

// RowBlock's scale products, from d, m, sc and mn.
inline void block_scales(const Fmt& f, RowBlock& rb) {
  if (f.elems != 256) {
    rb.dg[0][0] = rb.d;
    rb.mg[0][0] = rb.m;
    return;
  }
  for (int s = 0; s < 8; ++s)
    for (int h = 0; h < 2; ++h) {
      rb.dg[s][h] = rb.d * static_cast<float>(rb.sc[s][h]);
      rb.mg[s][h] = rb.m * static_cast<float>(rb.mn[s][h]);
    }
}

// The scale products, and MXFP4's indices looked up as its codes.
inline void scale_products(const Fmt& f, RowBlock& rb) {
  if (f.type == MXFP4)
    for (int e = 0; e < 32; ++e) rb.c[e] = MX_CODES[rb.c[e]];
  block_scales(f, rb);
}

// Integer dot products of codes with activation codes, written in the vector extensions of GCC and
// Clang: the compilers do not vectorize them as loops inside the block loops, and they are the portable
// build's hot loop (SSE2, NEON). |code| <= 128 and |x| <= 127: a product, and the sum of two, fit int16.
typedef int16_t i16x8 __attribute__((vector_size(16)));
typedef int16_t i16x16 __attribute__((vector_size(32)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef int32_t i32x4 __attribute__((vector_size(16)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

// 4 lanes that add up to the dot product of 16 codes with 16 activation codes.
inline i32x4 dot16_parts(const int16_t* c, const int8_t* x) {
  i16x16 cv;
  i8x16 xv;
  std::memcpy(&cv, c, sizeof cv);
  std::memcpy(&xv, x, sizeof xv);
  const i16x16 p = cv * __builtin_convertvector(xv, i16x16);
  const i16x8 pairs = __builtin_shufflevector(p, p, 0, 1, 2, 3, 4, 5, 6, 7) +
                      __builtin_shufflevector(p, p, 8, 9, 10, 11, 12, 13, 14, 15);
  const i32x8 w = __builtin_convertvector(pairs, i32x8);
  return __builtin_shufflevector(w, w, 0, 1, 2, 3) + __builtin_shufflevector(w, w, 4, 5, 6, 7);
}

// isum[h] for the `halves` (an even number) 16-element halves of a block: the dot products of the
// codes with the activation codes x (with x2: 256 x + x2, the combined codes of two levels).
inline void dot_halves(const int16_t* c, const int8_t* x, const int8_t* x2, int halves, int* isum) {
  for (int h = 0; h < halves; h += 2) {
    i32x4 a = dot16_parts(c + 16 * h, x + 16 * h), b = dot16_parts(c + 16 * h + 16, x + 16 * h + 16);
    if (x2) {
      a = a * 256 + dot16_parts(c + 16 * h, x2 + 16 * h);
      b = b * 256 + dot16_parts(c + 16 * h + 16, x2 + 16 * h + 16);
    }
    const i32x4 t = __builtin_shufflevector(a, b, 0, 4, 1, 5) + __builtin_shufflevector(a, b, 2, 6, 3, 7);
    isum[h] = t[0] + t[2];
    isum[h + 1] = t[1] + t[3];
  }
}

// Row r of tile block b.
void tile_row_block(const Fmt& f, const uint8_t* b, int r, RowBlock& rb) {
  rb.d = rd_scale(f.type, b + f.d + d_bytes(f.type) * r);
  rb.m = f.m >= 0 ? rd_f16(b + f.m + 2 * r) : 0.0f;
  uint8_t raw[16];
  if (f.sc >= 0)
    for (int k = 0; k < raw_sc_bytes(f.type); ++k) raw[k] = b[f.sc + 16 * k + r];
  for (int s = 0; s < f.elems / 32; ++s) {
    if (f.elems == 256) sub_scales(f.type, raw, s, rb.sc[s], rb.mn[s]);
    for (int e = 0; e < 32; ++e) rb.c[32 * s + e] = static_cast<int16_t>(code(f, b, s, r, e));
  }
  scale_products(f, rb);
}

// A raw GGML block's scales (d, m and the K-quants' sub-block scales, with their products).
inline void raw_block_scales(const Fmt& f, const uint8_t* b, RowBlock& rb) {
  rb.d = rd_scale(f.type, b + raw_d(f.type));
  rb.m = f.m >= 0 ? rd_f16(b + raw_m(f.type)) : 0.0f;
  if (f.elems == 256)
    for (int s = 0; s < 8; ++s) sub_scales(f.type, b + raw_sc(f.type), s, rb.sc[s], rb.mn[s]);
  block_scales(f, rb);
}

// A raw GGML block.
void raw_row_block(const Fmt& f, const uint8_t* b, RowBlock& rb) {
  raw_codes(f.type, b, rb.c);
  if (f.type == MXFP4)
    for (int e = 0; e < 32; ++e) rb.c[e] = MX_CODES[rb.c[e]];
  raw_block_scales(f, b, rb);
}

// y += block kb of a weight row (scales in rb, sums: the integer dot products of each 16-element half with
// row `row` of x) : the fp32 operations of the SIMD kernels, in their order.
inline void apply_sums(const Fmt& f, const RowBlock& rb, int64_t kb, const Acts& a, int64_t row, const int* sums,
                       float& y) {
  const int subs = f.elems / 32;
  for (int s = 0; s < subs; ++s) {
    // the sub-block's weight scale and min (per 16 elements: dg, mg)
    const float* dg = rb.dg[s];
    const float* mg = rb.mg[s];
    const float dsc = dg[0], cm = mg[0];
    const int64_t blk = kb * subs + s;
    const float dx = a.d[row * (a.k / 32) + blk];
    const int32_t* s16 = a.s16 + row * (a.k / 16) + 2 * blk;
    const int* isum = sums + 2 * s;
    if (f.type == Q6_K || f.type == Q3_K) {
      for (int h = 0; h < 2; ++h)
        y = std::fma(dg[h] * dx, static_cast<float>(isum[h] - wide_offset(f.type) * s16[h]), y);
      continue;
    }
    if (f.type == Q2_K) {
      for (int h = 0; h < 2; ++h) y = std::fma(dg[h] * dx, static_cast<float>(isum[h]), y);
      for (int h = 0; h < 2; ++h) y = std::fma(-mg[h], dx * static_cast<float>(s16[h]), y);
      continue;
    }
    const int off = int_offset(f.type);
    const int total = isum[0] + isum[1] - off * (s16[0] + s16[1]);
    y = std::fma(dsc * dx, static_cast<float>(total), y);
    if (f.type == Q4_K || f.type == Q5_K)
      y = std::fma(-cm, a.ds[row * (a.k / 32) + blk], y);
    else if (f.m >= 0)
      y = std::fma(cm, a.ds[row * (a.k / 32) + blk], y);
  }
}

void scalar_block(const Fmt& f, const RowBlock& rb, int64_t kb, const Acts& a, int64_t row, float& y) {
  int sums[16];
  dot_halves(rb.c, a.q + row * a.k + kb * f.elems, a.q2 ? a.q2 + row * a.k + kb * f.elems : nullptr,
             f.elems / 16, sums);
  apply_sums(f, rb, kb, a, row, sums, y);
}

void tile_scalar(const Fmt& f, const uint8_t* w, int64_t nblk, const Acts& a, int64_t t0, int nt, const Out& o,
                 int64_t row0) {
  float acc[TMAX][ROWS] = {};
  RowBlock rb;
  for (int64_t kb = 0; kb < nblk; ++kb) {
    for (int r = 0; r < ROWS; ++r) {
      tile_row_block(f, w + kb * f.tile_bytes, r, rb);
      for (int t = 0; t < nt; ++t) scalar_block(f, rb, kb, a, t0 + t, acc[t][r]);
    }
  }
  for (int t = 0; t < nt; ++t) store_rows(o, t0 + t, row0, acc[t]);
}

// ------------------------------------------------------------------ SIMD kernels
// One kernel body for AVX-512 (16 rows per vector) and AVX2 (8 rows per vector, two halves).

#if NC_HAS_AVX2
// The 8 E8M0 bytes in the low half of e as fp32 lanes: e8m0_half's bits.
inline __m256 e8m0_lanes(__m128i e) {
  const __m256i v = _mm256_cvtepu8_epi32(e);
  const __m256i norm = _mm256_slli_epi32(_mm256_sub_epi32(v, _mm256_set1_epi32(1)), 23);
  const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), v);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(norm, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), v)));
}

struct V256 {
  static constexpr int L = 8, HALVES = 2;
  using I = __m256i;
  using F = __m256;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I bcast(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  static I zero() { return _mm256_setzero_si256(); }
  static I lo4(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
  static I hi4(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  template <int SH, int TO>  // bits SH..SH+1 of each byte moved to TO..TO+1, the others cleared
  static I bits2(I v) {
    const I m = _mm256_set1_epi8(3 << TO);
    if constexpr (SH < TO) return _mm256_and_si256(_mm256_slli_epi16(v, TO - SH), m);
    else if constexpr (SH == TO) return _mm256_and_si256(v, m);
    else return _mm256_and_si256(_mm256_srli_epi16(v, SH - TO), m);
  }
  template <int BIT>
  static I setbit(I v, const uint8_t* mask, int h) {  // set bit BIT (clear) of the bytes whose mask bit is set
    uint32_t bits;
    std::memcpy(&bits, mask + 4 * h, 4);
    const I shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3,
                                    3, 3, 3, 3, 3);
    const I sel = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
    I m = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuf), sel);
    m = _mm256_cmpeq_epi8(m, sel);
    return _mm256_or_si256(v, _mm256_and_si256(m, _mm256_set1_epi8(1 << BIT)));
  }
  static I dotu(I acc, I u, I x) {  // u <= 63: the int16 pair sums cannot saturate
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
  }
  static I pairs16(I u, I x) { return _mm256_maddubs_epi16(u, x); }  // u <= 63: no int16 saturation
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I widen_pairs(I p) { return _mm256_madd_epi16(p, _mm256_set1_epi16(1)); }
  static constexpr int Q8_BIAS = 0;
  static I dot8(I acc, I w, I x) {  // signed weights: |w| times x with w's sign
    const I p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
  }
  // Two-level activations without VNNI: two maddubs/madd passes (q, then q2) cost twice one level. The
  // combined code c = 256 q + q2 fits int16, so the weight codes widened to int16 are dotted with c by
  // one vpmaddwd per 16 pairs: the multiplies of one level, and the same exact int32 sums as the two
  // passes. Per half of the groups, its 8 widened vectors stay in registers for all T rows of x.
  static constexpr bool WIDE_X2 = true;
  static constexpr int GEMM_T = 6;  // rows of x per pass of tile_gemm
  // Which passes widen: several rows of x share each widening; one row (decode) gains nothing from it,
  // bar Q8_0, whose sign handling it also saves. nc_qg_matmul fills the combined codes by the same rule.
  static constexpr bool widens(int type, int64_t rows) { return rows > 1 || type == Q8_0; }
  static I bcast4(const int16_t* p) {
    long long v;
    std::memcpy(&v, p, 8);
    return _mm256_set1_epi64x(v);
  }
  // For rows t < T of x (combined codes c + t * ld): lo[t], hi[t] as dot32 gives them, less OFF times the
  // sums of c over their 16 elements: the codes are widened as code - OFF, so the offset costs nothing per row.
  template <int T, bool SIGNED, int OFF>
  static void dots_wide(const I u[8], const int16_t* c, int64_t ld, I* lo, I* hi) {
    for (int half = 0; half < 2; ++half) {
      I wl[4], wh[4];  // group g: rows 0, 1 | 4, 5 (wl) and 2, 3 | 6, 7 (wh), 4 codes each
      for (int g = 0; g < 4; ++g) {
        const I v = u[4 * half + g], ext = SIGNED ? _mm256_cmpgt_epi8(zero(), v) : zero();
        wl[g] = _mm256_unpacklo_epi8(v, ext);
        wh[g] = _mm256_unpackhi_epi8(v, ext);
        if constexpr (OFF != 0) {
          wl[g] = _mm256_sub_epi16(wl[g], _mm256_set1_epi16(OFF));
          wh[g] = _mm256_sub_epi16(wh[g], _mm256_set1_epi16(OFF));
        }
      }
      for (int t = 0; t < T; ++t) {
        const int16_t* ct = c + t * ld + 16 * half;
        I al = zero(), ah = zero();
        for (int g = 0; g < 4; ++g) {
          const I x = bcast4(ct + 4 * g);
          al = add(al, _mm256_madd_epi16(wl[g], x));
          ah = add(ah, _mm256_madd_epi16(wh[g], x));
        }
        (half ? hi : lo)[t] = _mm256_hadd_epi32(al, ah);  // each row's two pair sums: rows 0..3 | 4..7
      }
    }
  }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I set1(int v) { return _mm256_set1_epi32(v); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I shl8(I a) { return _mm256_slli_epi32(a, 8); }
  static F f16(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F e8m0(const uint8_t* p) { return e8m0_lanes(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I mx_codes(I v) {  // MXFP4's indices (0..15) -> MX_CODES
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(MX_CODES))), v);
  }
  static F bf16(const uint8_t* p) {
    const I v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
  static void bf16_unpacked(const uint8_t* p, F& lo, F& hi) {  // 16 bf16: rows 0-3, 8-11 | 4-7, 12-15
    const I v = load(p);
    lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero(), v));
    hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero(), v));
  }
  static F loadf(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
  static F u8f(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
  static F s8f(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F addf(F a, F b) { return _mm256_add_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F set1f(float v) { return _mm256_set1_ps(v); }
  static F zerof() { return _mm256_setzero_ps(); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};
#endif

#if NC_HAS_AVX512
struct V512 {
  static constexpr int L = 16, HALVES = 1;
  using I = __m512i;
  using F = __m512;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I bcast(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static I zero() { return _mm512_setzero_si512(); }
  static I lo4(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
  static I hi4(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  template <int SH, int TO>
  static I bits2(I v) {
    const I m = _mm512_set1_epi8(3 << TO);
    if constexpr (SH < TO) return _mm512_and_si512(_mm512_slli_epi16(v, TO - SH), m);
    else if constexpr (SH == TO) return _mm512_and_si512(v, m);
    else return _mm512_and_si512(_mm512_srli_epi16(v, SH - TO), m);
  }
  template <int BIT>
  static I setbit(I v, const uint8_t* mask, int) {
    uint64_t bits;
    std::memcpy(&bits, mask, 8);
    return _mm512_mask_add_epi8(v, static_cast<__mmask64>(bits), v, _mm512_set1_epi8(1 << BIT));
  }
  static I dotu(I acc, I u, I x) { return _mm512_dpbusd_epi32(acc, u, x); }
  static constexpr int Q8_BIAS = 128;
  static I dot8(I acc, I w, I x) {  // (w + 128) as unsigned; the caller subtracts 128 * sum(x)
    return _mm512_dpbusd_epi32(acc, _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80))), x);
  }
  static constexpr bool WIDE_X2 = false;  // vpdpbusd: two passes cost no more than widening would
  static constexpr int GEMM_T = 8;        // rows of x per pass of tile_gemm
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I set1(int v) { return _mm512_set1_epi32(v); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I shl8(I a) { return _mm512_slli_epi32(a, 8); }
  static F f16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F e8m0(const uint8_t* p) {  // e8m0_half of 16 bytes
    const I v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const I norm = _mm512_slli_epi32(_mm512_sub_epi32(v, _mm512_set1_epi32(1)), 23);
    const I sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), v);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(v, _mm512_set1_epi32(2)), norm, sub));
  }
  static I mx_codes(I v) {
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(MX_CODES))), v);
  }
  static F bf16(const uint8_t* p) {
    const I v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  }
  static F loadf(const uint8_t* p) { return _mm512_loadu_ps(p); }
  static F u8f(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
  static F s8f(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F addf(F a, F b) { return _mm512_add_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F set1f(float v) { return _mm512_set1_ps(v); }
  static F zerof() { return _mm512_setzero_ps(); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#endif

#if NC_HAS_NEON
// `bit` in byte j where bit j % 8 of byte j / 8 of the 16 bits at m is set: the two bytes broadcast by one
// table lookup (element j of a group's mask, or of 16 elements' high bits).
inline uint8x16_t mask_bits16(const uint8_t* m, uint8_t bit) {
  uint16_t bits;
  std::memcpy(&bits, m, 2);
  const uint8x16_t lanes = vreinterpretq_u8_u64(vcombine_u64(vdup_n_u64(0), vdup_n_u64(0x0101010101010101ull)));
  const uint8x16_t spread = vqtbl1q_u8(vreinterpretq_u8_u16(vdupq_n_u16(bits)), lanes);
  return vandq_u8(vtstq_u8(spread, vreinterpretq_u8_u64(vdupq_n_u64(0x8040201008040201ull))), vdupq_n_u8(bit));
}

// 128-bit NEON: 4 rows per vector, four quarters of a tile (HALVES = 4). The codes are below 128 (Q8_0's are
// int8), so the signed int8 products of SDOT (dotprod) or of smull / smlal (baseline ASIMD, two groups summed in
// int16: at most 2 * 128 * 127) give the same exact int32 sums as the x86 kernels' unsigned ones. The i8mm level
// runs these SDOT kernels: SMMLA on pairs of rows of x needs the 4-byte groups zipped into 8-byte rows and the
// 2 x 2 results unzipped, and llvm-mca put that at 0.91-1.34x the SDOT prefill tile's cycles on Neoverse V1.
struct V128 {
  static constexpr int L = 4, HALVES = 4;
  using I = int32x4_t;
  using F = float32x4_t;
  static uint8x16_t u8(I v) { return vreinterpretq_u8_s32(v); }
  static int8x16_t s8(I v) { return vreinterpretq_s8_s32(v); }
  static I i32(uint8x16_t v) { return vreinterpretq_s32_u8(v); }
  static I load(const uint8_t* p) { return i32(vld1q_u8(p)); }
  static I zero() { return vdupq_n_s32(0); }
  static I lo4(I v) { return i32(vandq_u8(u8(v), vdupq_n_u8(15))); }
  static I hi4(I v) { return i32(vshrq_n_u8(u8(v), 4)); }
  static I or_(I a, I b) { return vorrq_s32(a, b); }
  template <int SH, int TO>  // bits SH..SH+1 of each byte moved to TO..TO+1, the others cleared
  static I bits2(I v) {
    const uint8x16_t m = vdupq_n_u8(3 << TO);
    if constexpr (SH < TO) return i32(vandq_u8(vshlq_n_u8(u8(v), TO - SH), m));
    else if constexpr (SH == TO) return i32(vandq_u8(u8(v), m));
    else return i32(vandq_u8(vshrq_n_u8(u8(v), SH - TO), m));
  }
  // setbit for groups 0..7 (masks 8 bytes apart): rows 4h .. 4h + 3 are mask bytes 2h, 2h + 1, spread to bytes
  // 0..7 and 8..15 by one table lookup in the 16 bytes that hold two groups' masks.
  template <int BIT>
  static void setbits8(I u[8], const uint8_t* qh, int h) {
    const uint8x16_t lanes = vreinterpretq_u8_u64(vcombine_u64(vdup_n_u64(0), vdup_n_u64(0x0101010101010101ull)));
    const uint8x16_t idx = vaddq_u8(vdupq_n_u8(static_cast<uint8_t>(2 * h)), lanes);
    const uint8x16_t idx2 = vaddq_u8(idx, vdupq_n_u8(8));
    const uint8x16_t sel = vreinterpretq_u8_u64(vdupq_n_u64(0x8040201008040201ull)), bit = vdupq_n_u8(1 << BIT);
    for (int p = 0; p < 4; ++p) {
      const uint8x16_t m = vld1q_u8(qh + 16 * p);
      u[2 * p] = i32(vorrq_u8(u8(u[2 * p]), vandq_u8(vtstq_u8(vqtbl1q_u8(m, idx), sel), bit)));
      u[2 * p + 1] = i32(vorrq_u8(u8(u[2 * p + 1]), vandq_u8(vtstq_u8(vqtbl1q_u8(m, idx2), sel), bit)));
    }
  }
  static constexpr int Q8_BIAS = 0;  // signed products: Q8_0's int8 as they are
  static constexpr bool WIDE_X2 = false;
  // Integer dot products of one 32-block (codes u, 8 groups of 4 per row) with one row's activation codes xq:
  // lo for groups 0..3, hi for 4..7 (lane r: row r).
  static void dot32(const I u[8], const int8_t* xq, I& lo, I& hi) {
    const int8x16_t x0 = vld1q_s8(xq), x1 = vld1q_s8(xq + 16);
#if NC_HAS_DOTPROD
    lo = vdotq_laneq_s32(vdupq_n_s32(0), s8(u[0]), x0, 0);
    hi = vdotq_laneq_s32(vdupq_n_s32(0), s8(u[4]), x1, 0);
    lo = vdotq_laneq_s32(lo, s8(u[1]), x0, 1);
    hi = vdotq_laneq_s32(hi, s8(u[5]), x1, 1);
    lo = vdotq_laneq_s32(lo, s8(u[2]), x0, 2);
    hi = vdotq_laneq_s32(hi, s8(u[6]), x1, 2);
    lo = vdotq_laneq_s32(lo, s8(u[3]), x0, 3);
    hi = vdotq_laneq_s32(hi, s8(u[7]), x1, 3);
#else
    lo = dot4(u, x0);
    hi = dot4(u + 4, x1);
#endif
  }
#if !NC_HAS_DOTPROD
  // Four groups (rows 0..3, 4 codes each) against the 4 x 4 activation codes in x.
  static I dot4(const I u[4], int8x16_t x) {
    auto xg = [&](int g) { return vreinterpretq_s8_s32(vdupq_laneq_s32(vreinterpretq_s32_s8(x), g)); };
    int32x4_t a01 = vdupq_n_s32(0), a23 = vdupq_n_s32(0);  // rows 0, 1 | rows 2, 3: two lanes each
    for (int g = 0; g < 4; g += 2) {
      const int8x16_t x0 = xg(g), x1 = xg(g + 1);
      int16x8_t p01 = vmull_s8(vget_low_s8(s8(u[g])), vget_low_s8(x0));
      int16x8_t p23 = vmull_high_s8(s8(u[g]), x0);
      p01 = vmlal_s8(p01, vget_low_s8(s8(u[g + 1])), vget_low_s8(x1));
      p23 = vmlal_high_s8(p23, s8(u[g + 1]), x1);
      a01 = vpadalq_s16(a01, p01);
      a23 = vpadalq_s16(a23, p23);
    }
    return vpaddq_s32(a01, a23);
  }
#endif
  static I add(I a, I b) { return vaddq_s32(a, b); }
  static I set1(int v) { return vdupq_n_s32(v); }
  static I sub(I a, I b) { return vsubq_s32(a, b); }
  static I shl8(I a) { return vshlq_n_s32(a, 8); }
  static uint32x4_t u8x4(const uint8_t* p) {  // 4 bytes widened to 4 lanes
    uint32_t v;
    std::memcpy(&v, p, 4);
    return vmovl_u16(vget_low_u16(vmovl_u8(vcreate_u8(v))));
  }
  static F f16(const uint8_t* p) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return vcvt_f32_f16(vreinterpret_f16_u64(vcreate_u64(v)));
  }
  static F e8m0(const uint8_t* p) {  // e8m0_half of 4 bytes
    const uint32x4_t v = u8x4(p);
    const uint32x4_t norm = vshlq_n_u32(vsubq_u32(v, vdupq_n_u32(1)), 23);
    const uint32x4_t sub = vshlq_u32(vdupq_n_u32(0x00200000), vreinterpretq_s32_u32(v));
    return vreinterpretq_f32_u32(vbslq_u32(vcltq_u32(v, vdupq_n_u32(2)), sub, norm));
  }
  static I mx_codes(I v) { return i32(vqtbl1q_u8(vld1q_u8(reinterpret_cast<const uint8_t*>(MX_CODES)), u8(v))); }
  static F bf16(const uint8_t* p) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return vreinterpretq_f32_u32(vshll_n_u16(vcreate_u16(v), 16));
  }
  static F loadf(const uint8_t* p) { return vld1q_f32(reinterpret_cast<const float*>(p)); }
  static F u8f(const uint8_t* p) { return vcvtq_f32_u32(u8x4(p)); }
  static F s8f(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vcreate_s8(v)))));
  }
  static F cvt(I v) { return vcvtq_f32_s32(v); }
  static F mul(F a, F b) { return vmulq_f32(a, b); }
  static F addf(F a, F b) { return vaddq_f32(a, b); }
  static F fma(F a, F b, F c) { return vfmaq_f32(c, a, b); }
  static F fnma(F a, F b, F c) { return vfmsq_f32(c, a, b); }
  static F set1f(float v) { return vdupq_n_f32(v); }
  static F zerof() { return vdupq_n_f32(0.0f); }
  static void store(float* p, F v) { vst1q_f32(p, v); }
};

// The K-quants' scale planes as k_scales16, q2k_scales16 and q3k_scales16 below decode them (the same bytes).
__attribute__((always_inline)) inline void k_scales16(const uint8_t* planes, uint8_t sc[8][16], uint8_t mn[8][16]) {
  uint8x16_t p[12];
  for (int k = 0; k < 12; ++k) p[k] = vld1q_u8(planes + 16 * k);
  const uint8x16_t m63 = vdupq_n_u8(63), m15 = vdupq_n_u8(15), m48 = vdupq_n_u8(48);
  for (int j = 0; j < 4; ++j) {
    vst1q_u8(sc[j], vandq_u8(p[j], m63));
    vst1q_u8(mn[j], vandq_u8(p[j + 4], m63));
    vst1q_u8(sc[j + 4], vorrq_u8(vandq_u8(p[j + 8], m15), vandq_u8(vshrq_n_u8(p[j], 2), m48)));
    vst1q_u8(mn[j + 4], vorrq_u8(vshrq_n_u8(p[j + 8], 4), vandq_u8(vshrq_n_u8(p[j + 4], 2), m48)));
  }
}

__attribute__((always_inline)) inline void q2k_scales16(const uint8_t* planes, uint8_t sc[16][16], uint8_t mn[16][16]) {
  for (int j = 0; j < 16; ++j) {
    const uint8x16_t p = vld1q_u8(planes + 16 * j);
    vst1q_u8(sc[j], vandq_u8(p, vdupq_n_u8(15)));
    vst1q_u8(mn[j], vshrq_n_u8(p, 4));
  }
}

__attribute__((always_inline)) inline void q3k_scales16(const uint8_t* planes, uint8_t sc[16][16]) {
  uint8x16_t p[12];
  for (int k = 0; k < 12; ++k) p[k] = vld1q_u8(planes + 16 * k);
  const uint8x16_t m15 = vdupq_n_u8(15), m48 = vdupq_n_u8(48), m32 = vdupq_n_u8(32);
  for (int i = 0; i < 4; ++i) {  // bits 2 (j / 4) of plane 8 + j % 4 land on bits 4..5
    const uint8x16_t h = p[8 + i];
    vst1q_u8(sc[i], vsubq_u8(vorrq_u8(vandq_u8(p[i], m15), vandq_u8(vshlq_n_u8(h, 4), m48)), m32));
    vst1q_u8(sc[i + 4], vsubq_u8(vorrq_u8(vandq_u8(p[i + 4], m15), vandq_u8(vshlq_n_u8(h, 2), m48)), m32));
    vst1q_u8(sc[i + 8], vsubq_u8(vorrq_u8(vshrq_n_u8(p[i], 4), vandq_u8(h, m48)), m32));
    vst1q_u8(sc[i + 12], vsubq_u8(vorrq_u8(vshrq_n_u8(p[i + 4], 4), vandq_u8(vshrq_n_u8(h, 2), m48)), m32));
  }
}
#endif

#if NC_HAS_AVX2
// Q4_K / Q5_K: the 16 rows' 6-bit scales and mins of all 8 sub-blocks from the 12 byte planes.
__attribute__((always_inline)) inline void k_scales16(const uint8_t* planes, uint8_t sc[8][16], uint8_t mn[8][16]) {
  __m128i p[12];
  for (int k = 0; k < 12; ++k) p[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes + 16 * k));
  const __m128i m63 = _mm_set1_epi8(63), m15 = _mm_set1_epi8(15), m48 = _mm_set1_epi8(48);
  auto st = [](uint8_t* dst, __m128i v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), v); };
  for (int j = 0; j < 4; ++j) {
    st(sc[j], _mm_and_si128(p[j], m63));
    st(mn[j], _mm_and_si128(p[j + 4], m63));
    // high two bits of byte j (or j + 4) land on bits 4..5: (x >> 2) & 48
    st(sc[j + 4], _mm_or_si128(_mm_and_si128(p[j + 8], m15), _mm_and_si128(_mm_srli_epi16(p[j], 2), m48)));
    st(mn[j + 4], _mm_or_si128(_mm_and_si128(_mm_srli_epi16(p[j + 8], 4), m15),
                               _mm_and_si128(_mm_srli_epi16(p[j + 4], 2), m48)));
  }
}

// Q2_K: the 16 rows' scales (low nibbles) and mins (high nibbles) of the 16 sub-blocks of 16.
__attribute__((always_inline)) inline void q2k_scales16(const uint8_t* planes, uint8_t sc[16][16], uint8_t mn[16][16]) {
  const __m128i m15 = _mm_set1_epi8(15);
  for (int j = 0; j < 16; ++j) {
    const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes + 16 * j));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(sc[j]), _mm_and_si128(p, m15));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(mn[j]), _mm_and_si128(_mm_srli_epi16(p, 4), m15));
  }
}

// Q3_K: the 16 rows' signed scales (int8 bytes) of the 16 sub-blocks from the 12 planes (q3_scale).
__attribute__((always_inline)) inline void q3k_scales16(const uint8_t* planes, uint8_t sc[16][16]) {
  __m128i p[12], lo[16], hi[16];
  for (int k = 0; k < 12; ++k) p[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes + 16 * k));
  const __m128i m15 = _mm_set1_epi8(15), m48 = _mm_set1_epi8(48);
  for (int j = 0; j < 8; ++j) {
    lo[j] = _mm_and_si128(p[j], m15);
    lo[j + 8] = _mm_and_si128(_mm_srli_epi16(p[j], 4), m15);
  }
  for (int i = 0; i < 4; ++i) {  // bits 2 (j / 4) of plane 8 + j % 4 land on bits 4..5
    hi[i] = _mm_and_si128(_mm_slli_epi16(p[8 + i], 4), m48);
    hi[i + 4] = _mm_and_si128(_mm_slli_epi16(p[8 + i], 2), m48);
    hi[i + 8] = _mm_and_si128(p[8 + i], m48);
    hi[i + 12] = _mm_and_si128(_mm_srli_epi16(p[8 + i], 2), m48);
  }
  for (int j = 0; j < 16; ++j)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(sc[j]), _mm_sub_epi8(_mm_or_si128(lo[j], hi[j]), _mm_set1_epi8(32)));
}
#endif

#if NC_HAS_SIMD
// Bit BIT of the codes of groups 0..7 (half h) from their masks (8 bytes per group, from qh): the trait's own
// for all 8 at once where it has one.
template <class V, int BIT>
__attribute__((always_inline)) inline void set_bits(typename V::I u[8], const uint8_t* qh, int h) {
  if constexpr (requires { V::template setbits8<BIT>(u, qh, h); })
    V::template setbits8<BIT>(u, qh, h);
  else
    for (int g = 0; g < 8; ++g) u[g] = V::template setbit<BIT>(u[g], qh + 8 * g, h);
}

// Unsigned codes of sub-block s (groups G = 0..7 of 4 elements) for half h of a tile block.
template <class V, int TYPE>
inline void unpack(const uint8_t* b, int s, int h, typename V::I u[8]) {
  constexpr Fmt f = fmt_of(TYPE);
  constexpr int B = V::L * 4;  // bytes of one half of a 64-byte chunk
  if constexpr (TYPE == Q8_0) {
    for (int g = 0; g < 8; ++g) u[g] = V::load(b + f.qs + 64 * g + B * h);
  } else if constexpr (f.elems == 32) {
    for (int p = 0; p < 4; ++p) {
      const typename V::I c = V::load(b + f.qs + 64 * p + B * h);
      u[p] = V::lo4(c);
      u[p + 4] = V::hi4(c);
    }
    if constexpr (TYPE == Q5_0 || TYPE == Q5_1)
      set_bits<V, 4>(u, b + f.qh, h);
    if constexpr (TYPE == MXFP4)
      for (int g = 0; g < 8; ++g) u[g] = V::mx_codes(u[g]);
  } else {
    if constexpr (f.qs >= 0) {
      const uint8_t* q = b + f.qs + 512 * (s / 2) + B * h;
      for (int g = 0; g < 8; ++g) {
        const typename V::I c = V::load(q + 64 * g);
        u[g] = (s & 1) ? V::hi4(c) : V::lo4(c);
      }
    }
    if constexpr (f.q2 >= 0) {
      constexpr int TO = q2_shift(TYPE);
      const uint8_t* q2 = b + f.q2 + 512 * (s / 4) + B * h;
      for (int g = 0; g < 8; ++g) {
        const typename V::I c = V::load(q2 + 64 * g);
        typename V::I v;
        switch (s % 4) {
          case 0: v = V::template bits2<0, TO>(c); break;
          case 1: v = V::template bits2<2, TO>(c); break;
          case 2: v = V::template bits2<4, TO>(c); break;
          default: v = V::template bits2<6, TO>(c); break;
        }
        if constexpr (f.qs >= 0) u[g] = V::or_(u[g], v);
        else u[g] = v;
      }
    }
    if constexpr (TYPE == Q5_K || TYPE == Q3_K)
      set_bits<V, TYPE == Q5_K ? 4 : 2>(u, b + f.qh + 64 * s, h);
  }
}

// Integer dot products of one 32-block for one row of x: groups 0..3 and 4..7 separately.
template <class V, int TYPE>
inline void dot32(const typename V::I u[8], const int8_t* xq, typename V::I& lo, typename V::I& hi) {
  if constexpr (requires { V::dot32(u, xq, lo, hi); }) {  // a trait's own (NEON: lane-indexed products)
    V::dot32(u, xq, lo, hi);
  } else if constexpr (requires { V::pairs16(u[0], u[0]); } && TYPE != Q8_0) {
    // Without VNNI (AVX2): the int16 pair sums of G groups are added before one vpmaddwd widens them to
    // the rows' int32 sums. Exact: a pair sum is at most 2 * 127 * the largest code, so G of them stay
    // below 2^15 (codes <= 31: 4 groups; Q6_K's <= 63: 2).
    constexpr int G = TYPE == Q6_K ? 2 : 4;
    auto half = [&](const typename V::I* uh, const int8_t* xh) {
      typename V::I acc = V::zero();
      for (int g0 = 0; g0 < 4; g0 += G) {
        typename V::I p = V::pairs16(uh[g0], V::bcast(xh + 4 * g0));
        for (int g = g0 + 1; g < g0 + G; ++g) p = V::add16(p, V::pairs16(uh[g], V::bcast(xh + 4 * g)));
        acc = g0 ? V::add(acc, V::widen_pairs(p)) : V::widen_pairs(p);
      }
      return acc;
    };
    lo = half(u, xq);
    hi = half(u + 4, xq + 16);
  } else {
    lo = V::zero();
    hi = V::zero();
    for (int g = 0; g < 4; ++g) {
      if constexpr (TYPE == Q8_0) {
        lo = V::dot8(lo, u[g], V::bcast(xq + 4 * g));
        hi = V::dot8(hi, u[g + 4], V::bcast(xq + 16 + 4 * g));
      } else {
        lo = V::dotu(lo, u[g], V::bcast(xq + 4 * g));
        hi = V::dotu(hi, u[g + 4], V::bcast(xq + 16 + 4 * g));
      }
    }
  }
}

// The fp32 factors of sub-block s of a tile block for the rows of part h (a vector's rows): the scale and
// min of the sub-block (dsc, cm), or of its 16-element halves (dg0 / dg1, cm0 / cm1); d and m are the part's.
template <class V>
struct Factors {
  typename V::F dsc, cm, dg0, dg1, cm0, cm1;
};

template <class V, int TYPE>
__attribute__((always_inline)) inline Factors<V> factors(const uint8_t* b, const uint8_t (*sc)[16],
                                                         const uint8_t (*mn)[16], int s, int h, typename V::F d,
                                                         typename V::F m) {
  constexpr Fmt f = fmt_of(TYPE);
  Factors<V> z{d, m, d, d, m, m};
  if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
    z.dsc = V::mul(d, V::u8f(sc[s] + V::L * h));
    z.cm = V::mul(m, V::u8f(mn[s] + V::L * h));
  } else if constexpr (TYPE == Q6_K || TYPE == Q3_K) {
    const uint8_t* planes = TYPE == Q6_K ? b + f.sc : sc[0];
    z.dg0 = V::mul(d, V::s8f(planes + 16 * (2 * s) + V::L * h));
    z.dg1 = V::mul(d, V::s8f(planes + 16 * (2 * s + 1) + V::L * h));
  } else if constexpr (TYPE == Q2_K) {
    z.dg0 = V::mul(d, V::u8f(sc[2 * s] + V::L * h));
    z.dg1 = V::mul(d, V::u8f(sc[2 * s + 1] + V::L * h));
    z.cm0 = V::mul(m, V::u8f(mn[2 * s] + V::L * h));
    z.cm1 = V::mul(m, V::u8f(mn[2 * s + 1] + V::L * h));
  }
  return z;
}

// acc plus 32-block blk of row `row` of x against the factors' rows: lo and hi are the integer dot products of
// the block's two 16-element halves (WIDE: the codes' offset already out of them). The fp32 operations of
// every code path, in their order (apply_sums).
template <class V, int TYPE, bool WIDE>
__attribute__((always_inline)) inline typename V::F fold(typename V::F acc, const Factors<V>& z, typename V::I lo,
                                                         typename V::I hi, const Acts& a, int64_t row, int64_t blk,
                                                         int64_t kb32) {
  constexpr Fmt f = fmt_of(TYPE);
  constexpr int OFF = TYPE == Q8_0 ? V::Q8_BIAS : int_offset(TYPE);
  const int32_t* s16 = a.s16 + row * 2 * kb32 + 2 * blk;
  const typename V::F dx = V::set1f(a.d[row * kb32 + blk]);
  if constexpr (TYPE == Q6_K || TYPE == Q3_K) {
    if constexpr (!WIDE) {
      lo = V::sub(lo, V::set1(wide_offset(TYPE) * s16[0]));
      hi = V::sub(hi, V::set1(wide_offset(TYPE) * s16[1]));
    }
    acc = V::fma(V::mul(z.dg0, dx), V::cvt(lo), acc);
    return V::fma(V::mul(z.dg1, dx), V::cvt(hi), acc);
  } else if constexpr (TYPE == Q2_K) {
    const float dxs = a.d[row * kb32 + blk];
    acc = V::fma(V::mul(z.dg0, dx), V::cvt(lo), acc);
    acc = V::fma(V::mul(z.dg1, dx), V::cvt(hi), acc);
    acc = V::fnma(z.cm0, V::set1f(dxs * static_cast<float>(s16[0])), acc);
    return V::fnma(z.cm1, V::set1f(dxs * static_cast<float>(s16[1])), acc);
  } else {
    typename V::I tot = V::add(lo, hi);
    if constexpr (OFF != 0 && !WIDE) tot = V::sub(tot, V::set1(OFF * (s16[0] + s16[1])));
    acc = V::fma(V::mul(z.dsc, dx), V::cvt(tot), acc);
    if constexpr (TYPE == Q4_K || TYPE == Q5_K)
      acc = V::fnma(z.cm, V::set1f(a.ds[row * kb32 + blk]), acc);
    else if constexpr (f.m >= 0)
      acc = V::fma(z.cm, V::set1f(a.ds[row * kb32 + blk]), acc);
    return acc;
  }
}

template <class V, int TYPE, int T, bool X2>
inline void tile_simd(const uint8_t* w, int64_t nblk, const Acts& a, int64_t t0, const Out& o, int64_t row0) {
  constexpr Fmt f = fmt_of(TYPE);
  constexpr int SUBS = f.elems / 32;
  constexpr bool WIDE = [] {
    if constexpr (X2 && V::WIDE_X2) return V::widens(TYPE, T);
    return false;
  }();
  const int64_t kb32 = a.k / 32;
  alignas(64) float out[T][ROWS];
  // Vectors narrower than a tile (AVX2, NEON) take its rows a part (half, quarter) at a time. One row of x
  // (decode) takes all parts of a block in one pass, so the tile streams from memory once, front to back,
  // with every byte it brings used at once: a pass per part had the memory idle during the later passes
  // (their bytes already in L2) and the first pass bringing twice what it used. Several rows of x take a
  // pass per part: their accumulators fill the registers.
  constexpr int PARTS = T == 1 ? V::HALVES : 1;
  for (int h0 = 0; h0 < V::HALVES; h0 += PARTS) {
    typename V::F accs[PARTS][T];
    for (int p = 0; p < PARTS; ++p)
      for (int t = 0; t < T; ++t) accs[p][t] = V::zerof();
    for (int64_t kb = 0; kb < nblk; ++kb) {
      const uint8_t* b = w + kb * f.tile_bytes;
      alignas(16) uint8_t sc[16][16], mn[16][16];  // K-quants: the 16 rows' scales (and mins) decoded
      if constexpr (TYPE == Q4_K || TYPE == Q5_K) k_scales16(b + f.sc, sc, mn);
      if constexpr (TYPE == Q2_K) q2k_scales16(b + f.sc, sc, mn);
      if constexpr (TYPE == Q3_K) q3k_scales16(b + f.sc, sc);
      for (int h = h0; h < h0 + PARTS; ++h) {
        typename V::F* acc = accs[h - h0];
        // In the AVX2 build, x's levels through pointers the compiler cannot see are the same for every part:
        // else it hoists x's broadcasts out of this loop (they do not depend on h) and, with 16 vector
        // registers, spills them to the stack (the one-row Q4_0, Q4_1 and MXFP4 tiles ran 15% slower). With 32
        // (AVX-512 builds, NEON) the hoisted broadcasts stay in registers, and pay.
        const int8_t* xq1 = a.q;
        const int8_t* xq2 = a.q2;
        if constexpr (PARTS > 1 && NC_ISA == NC_ISA_AVX2) asm volatile("" : "+r"(xq1), "+r"(xq2));
        typename V::F d;
        if constexpr (TYPE == MXFP4) d = V::e8m0(b + f.d + V::L * h);
        else d = V::f16(b + f.d + 2 * V::L * h);
        typename V::F m = V::zerof();
        if constexpr (f.m >= 0) m = V::f16(b + f.m + 2 * V::L * h);
        for (int s = 0; s < SUBS; ++s) {
          // this sub-block's share of the block PF_AHEAD bytes ahead (the first pass over the tile prefetches it)
          if (h0 == 0 && (T == 1 || t0 == 0)) {
            constexpr int N = (f.tile_bytes + 64 * SUBS * PARTS - 1) / (64 * SUBS * PARTS);
            prefetch_lines<N>(b + PF_AHEAD + 64 * N * ((h - h0) * SUBS + s));
          }
          typename V::I u[8];
          unpack<V, TYPE>(b, s, h, u);
          const Factors<V> fz = factors<V, TYPE>(b, sc, mn, s, h, d, m);
          const int64_t blk = kb * SUBS + s;
          // The codes' offset (Q6_K's 32, Q3_K's 4, OFF), subtracted from the integer sums as sums of x; WIDE
          // dots take it out of the widened codes instead.
          constexpr int OFF16 = wide_offset(TYPE);  // (widening is AVX2's: its Q8_BIAS is 0)
          [[maybe_unused]] typename V::I wide_lo[T], wide_hi[T];
          if constexpr (WIDE)
            V::template dots_wide<T, TYPE == Q8_0, OFF16>(u, a.c16 + t0 * a.k + 32 * blk, a.k, wide_lo, wide_hi);
          for (int t = 0; t < T; ++t) {
            const int64_t row = t0 + t;
            typename V::I lo, hi;
            if constexpr (WIDE) {
              lo = wide_lo[t];
              hi = wide_hi[t];
            } else if constexpr (X2) {  // combined code 256 q + q2: at most 2^28 in magnitude, exact in int32
              dot32<V, TYPE>(u, xq1 + row * a.k + 32 * blk, lo, hi);
              typename V::I lo2, hi2;
              dot32<V, TYPE>(u, xq2 + row * a.k + 32 * blk, lo2, hi2);
              lo = V::add(V::shl8(lo), lo2);
              hi = V::add(V::shl8(hi), hi2);
            } else {
              dot32<V, TYPE>(u, xq1 + row * a.k + 32 * blk, lo, hi);
            }
            acc[t] = fold<V, TYPE, WIDE>(acc[t], fz, lo, hi, a, row, blk, kb32);
          }
        }
      }
    }
    for (int p = 0; p < PARTS; ++p)
      for (int t = 0; t < T; ++t) V::store(out[t] + V::L * (h0 + p), accs[p][t]);
  }
  for (int t = 0; t < T; ++t) store_rows(o, t0 + t, row0, out[t]);
}

template <class V, int TYPE, bool X2>
void tile_split(const uint8_t* w, int64_t nblk, const Acts& a, int64_t t0, int nt, const Out& o, int64_t row0) {
  // Split nt into passes of 8, 6, 5, 4, 3, 2, 1: per row of x the arithmetic is the same whatever the split, and
  // a pass of 3 or 5 costs less than 2 + 1 or 4 + 1 (speculative verification steps have any number of rows).
  while (nt > 0) {
    if (nt >= 8) { tile_simd<V, TYPE, 8, X2>(w, nblk, a, t0, o, row0); t0 += 8; nt -= 8; }
    else if (nt >= 6) { tile_simd<V, TYPE, 6, X2>(w, nblk, a, t0, o, row0); t0 += 6; nt -= 6; }
    else if (nt >= 5) { tile_simd<V, TYPE, 5, X2>(w, nblk, a, t0, o, row0); t0 += 5; nt -= 5; }
    else if (nt >= 4) { tile_simd<V, TYPE, 4, X2>(w, nblk, a, t0, o, row0); t0 += 4; nt -= 4; }
    else if (nt >= 3) { tile_simd<V, TYPE, 3, X2>(w, nblk, a, t0, o, row0); t0 += 3; nt -= 3; }
    else if (nt >= 2) { tile_simd<V, TYPE, 2, X2>(w, nblk, a, t0, o, row0); t0 += 2; nt -= 2; }
    else { tile_simd<V, TYPE, 1, X2>(w, nblk, a, t0, o, row0); t0 += 1; nt -= 1; }
  }
}

#if NC_HAS_AVX2
// ------------------------------------------------------------------ prefill: a tile's codes widened once
// For many rows of x (prefill, two activation levels) a thread widens its tile once (WideTile: per pair of
// elements, the 16 rows' codes less their offset as int16, one row per int32 lane; the blocks' fp32 factors)
// and dots V::GEMM_T rows of x at a time against it, with the combined codes 256 q + q2 as int16: per pair, one
// load of the codes (two on AVX2), then per row of x a broadcast of its pair and one vpdpwssd (AVX-512 VNNI) or a
// vpmaddwd and an add (AVX2), into int32 accumulators that hold a block's (or a half's) sums in registers. The
// per-pass work of tile_simd goes: the codes' unpacking (and, on AVX2, widening) for every 8 rows of x, AVX2's
// horizontal adds (its vectors hold 4 rows x 4 elements), and on AVX-512 the second level's products. Per block
// the same integer sums and the same fp32 operations (fold) as every other path.
// Fewer rows of x do not repay a tile's widening (nor a pass's overlap). AVX-512's own passes unpack 16 rows of
// codes a vector and keep up with this path until x outgrows the caches (benchmarks/README.md, "Prefill: a tile
// widened once").
constexpr int64_t GEMM_MIN_ROWS_AVX2 = 12, GEMM_MIN_ROWS_AVX512 = 64;
constexpr int GEMM_GROUP = 24;         // rows of x per work item (nc_qg_matmul): 4 AVX2 passes, 3 AVX-512 ones

struct WideTile {  // one thread's widened tile
  const uint8_t* w = nullptr;
  uint64_t call = 0;
  std::vector<int16_t> codes;  // per 32-block: 16 pairs x 16 rows x 2 codes (a pair's rows 0-7 | 8-15: 64 bytes)
  std::vector<float> factors;  // per 32-block: planes of 16 rows (Factors: dsc, cm or dg0, dg1, cm0, cm1)
};
thread_local WideTile t_wide;

constexpr int FPLANES = 4;

template <int TYPE>
void widen_tile(const uint8_t* w, int64_t nblk, WideTile& wt) {
  constexpr Fmt f = fmt_of(TYPE);
  constexpr int SUBS = f.elems / 32;
  constexpr int OFF = wide_offset(TYPE);
  const int64_t nsb = nblk * SUBS;
  if (static_cast<int64_t>(wt.codes.size()) < 512 * nsb) wt.codes.resize(512 * nsb);
  if (static_cast<int64_t>(wt.factors.size()) < FPLANES * 16 * nsb) wt.factors.resize(FPLANES * 16 * nsb);
  for (int64_t kb = 0; kb < nblk; ++kb) {
    const uint8_t* b = w + kb * f.tile_bytes;
    prefetch_lines<(f.tile_bytes + 63) / 64>(b + PF_AHEAD);
    alignas(16) uint8_t sc[16][16], mn[16][16];
    if constexpr (TYPE == Q4_K || TYPE == Q5_K) k_scales16(b + f.sc, sc, mn);
    if constexpr (TYPE == Q2_K) q2k_scales16(b + f.sc, sc, mn);
    if constexpr (TYPE == Q3_K) q3k_scales16(b + f.sc, sc);
    for (int h = 0; h < 2; ++h) {
      __m256 d, m = V256::zerof();
      if constexpr (TYPE == MXFP4) d = V256::e8m0(b + f.d + 8 * h);
      else d = V256::f16(b + f.d + 16 * h);
      if constexpr (f.m >= 0) m = V256::f16(b + f.m + 16 * h);
      for (int s = 0; s < SUBS; ++s) {
        const int64_t blk = kb * SUBS + s;
        const Factors<V256> z = factors<V256, TYPE>(b, sc, mn, s, h, d, m);
        float* fp = wt.factors.data() + FPLANES * 16 * blk + 8 * h;
        const __m256 planes[FPLANES] = {half_scales(TYPE) ? z.dg0 : z.dsc, half_scales(TYPE) ? z.dg1 : z.cm, z.cm0,
                                        z.cm1};
        for (int p = 0; p < FPLANES; ++p) V256::store(fp + 16 * p, planes[p]);
        __m256i u[8];
        unpack<V256, TYPE>(b, s, h, u);
        int16_t* dst = wt.codes.data() + 512 * blk + 16 * h;  // pair p's rows 8h..8h+7 at dst + 32 p
        for (int g = 0; g < 8; ++g) {  // elements 4g..4g+3 of the 8 rows -> pairs 2g, 2g + 1, a row per lane
          const __m256i ext = TYPE == Q8_0 ? _mm256_cmpgt_epi8(_mm256_setzero_si256(), u[g]) : _mm256_setzero_si256();
          const __m256i off = _mm256_set1_epi16(OFF);
          // rows 0, 1 | 4, 5 (lo) and 2, 3 | 6, 7 (hi), 4 codes each; then a row per lane, pair 2g and 2g + 1
          const __m256 lo = _mm256_castsi256_ps(_mm256_sub_epi16(_mm256_unpacklo_epi8(u[g], ext), off));
          const __m256 hi = _mm256_castsi256_ps(_mm256_sub_epi16(_mm256_unpackhi_epi8(u[g], ext), off));
          auto store = [&](int p, __m256 v) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * p), _mm256_castps_si256(v));
          };
          store(2 * g, _mm256_shuffle_ps(lo, hi, 0x88));
          store(2 * g + 1, _mm256_shuffle_ps(lo, hi, 0xdd));
        }
      }
    }
  }
}

// acc[2t + h] += the dot products of pairs [p0, p1) of a widened block (codes) with row t < 6 of x's combined
// codes (x + t * ld): rows 8h..8h+7 of the tile, one per lane. In assembly: the compilers keep fewer than the 12
// accumulators in the 16 registers and spill them on every pair.
__attribute__((always_inline)) inline void gemm_dots(V256, const int16_t* codes, const int16_t* x, int64_t ld, int p0,
                                                     int p1, __m256i acc[12]) {
  __m256i a0 = acc[0], a1 = acc[1], a2 = acc[2], a3 = acc[3], a4 = acc[4], a5 = acc[5], a6 = acc[6], a7 = acc[7],
          a8 = acc[8], a9 = acc[9], a10 = acc[10], a11 = acc[11];
  const int64_t ldb = 2 * ld;
  for (int p = p0; p < p1; ++p) {
    const int16_t* c = codes + 32 * p;
    const int16_t* x0 = x + 2 * p;
    const int16_t* x3 = x0 + 3 * ld;
    asm("vmovdqu (%[c]), %%ymm12\n\t"
        "vmovdqu 32(%[c]), %%ymm13\n\t"
        "vpbroadcastd (%[x0]), %%ymm14\n\t"
        "vpmaddwd %%ymm14, %%ymm12, %%ymm15\n\tvpaddd %%ymm15, %[a0], %[a0]\n\t"
        "vpmaddwd %%ymm14, %%ymm13, %%ymm15\n\tvpaddd %%ymm15, %[a1], %[a1]\n\t"
        "vpbroadcastd (%[x0],%[ld]), %%ymm14\n\t"
        "vpmaddwd %%ymm14, %%ymm12, %%ymm15\n\tvpaddd %%ymm15, %[a2], %[a2]\n\t"
        "vpmaddwd %%ymm14, %%ymm13, %%ymm15\n\tvpaddd %%ymm15, %[a3], %[a3]\n\t"
        "vpbroadcastd (%[x0],%[ld],2), %%ymm14\n\t"
        "vpmaddwd %%ymm14, %%ymm12, %%ymm15\n\tvpaddd %%ymm15, %[a4], %[a4]\n\t"
        "vpmaddwd %%ymm14, %%ymm13, %%ymm15\n\tvpaddd %%ymm15, %[a5], %[a5]\n\t"
        "vpbroadcastd (%[x3]), %%ymm14\n\t"
        "vpmaddwd %%ymm14, %%ymm12, %%ymm15\n\tvpaddd %%ymm15, %[a6], %[a6]\n\t"
        "vpmaddwd %%ymm14, %%ymm13, %%ymm15\n\tvpaddd %%ymm15, %[a7], %[a7]\n\t"
        "vpbroadcastd (%[x3],%[ld]), %%ymm14\n\t"
        "vpmaddwd %%ymm14, %%ymm12, %%ymm15\n\tvpaddd %%ymm15, %[a8], %[a8]\n\t"
        "vpmaddwd %%ymm14, %%ymm13, %%ymm15\n\tvpaddd %%ymm15, %[a9], %[a9]\n\t"
        "vpbroadcastd (%[x3],%[ld],2), %%ymm14\n\t"
        "vpmaddwd %%ymm14, %%ymm12, %%ymm15\n\tvpaddd %%ymm15, %[a10], %[a10]\n\t"
        "vpmaddwd %%ymm14, %%ymm13, %%ymm15\n\tvpaddd %%ymm15, %[a11], %[a11]\n\t"
        : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3), [a4] "+x"(a4), [a5] "+x"(a5), [a6] "+x"(a6),
          [a7] "+x"(a7), [a8] "+x"(a8), [a9] "+x"(a9), [a10] "+x"(a10), [a11] "+x"(a11)
        : [c] "r"(c), [x0] "r"(x0), [x3] "r"(x3), [ld] "r"(ldb), "m"(*(const int16_t(*)[32])c)
        : "xmm12", "xmm13", "xmm14", "xmm15");
  }
  acc[0] = a0, acc[1] = a1, acc[2] = a2, acc[3] = a3, acc[4] = a4, acc[5] = a5;
  acc[6] = a6, acc[7] = a7, acc[8] = a8, acc[9] = a9, acc[10] = a10, acc[11] = a11;
}

#if NC_HAS_AVX512
// acc[t] += the dot products of pairs [p0, p1) of a widened block with row t < 8 of x's combined codes: the 16
// rows of the tile, one per lane, each row's broadcast folded into vpdpwssd's memory operand. In assembly: GCC
// copied the accumulators between registers and spilled the codes on every pair.
__attribute__((always_inline)) inline void gemm_dots(V512, const int16_t* codes, const int16_t* x, int64_t ld, int p0,
                                                     int p1, __m512i acc[8]) {
  __m512i a0 = acc[0], a1 = acc[1], a2 = acc[2], a3 = acc[3], a4 = acc[4], a5 = acc[5], a6 = acc[6], a7 = acc[7];
  const int64_t ldb = 2 * ld;
  for (int p = p0; p < p1; ++p) {
    const int16_t* c = codes + 32 * p;
    const int16_t* x0 = x + 2 * p;
    const int16_t* x3 = x0 + 3 * ld;
    const int16_t* x6 = x0 + 6 * ld;
    __m512i w;
    asm("vmovdqu64 (%[c]), %[w]\n\t"
        "vpdpwssd (%[x0])%{1to16%}, %[w], %[a0]\n\t"
        "vpdpwssd (%[x0],%[ld])%{1to16%}, %[w], %[a1]\n\t"
        "vpdpwssd (%[x0],%[ld],2)%{1to16%}, %[w], %[a2]\n\t"
        "vpdpwssd (%[x3])%{1to16%}, %[w], %[a3]\n\t"
        "vpdpwssd (%[x3],%[ld])%{1to16%}, %[w], %[a4]\n\t"
        "vpdpwssd (%[x3],%[ld],2)%{1to16%}, %[w], %[a5]\n\t"
        "vpdpwssd (%[x6])%{1to16%}, %[w], %[a6]\n\t"
        "vpdpwssd (%[x6],%[ld])%{1to16%}, %[w], %[a7]\n\t"
        : [a0] "+v"(a0), [a1] "+v"(a1), [a2] "+v"(a2), [a3] "+v"(a3), [a4] "+v"(a4), [a5] "+v"(a5), [a6] "+v"(a6),
          [a7] "+v"(a7), [w] "=&v"(w)
        : [c] "r"(c), [x0] "r"(x0), [x3] "r"(x3), [x6] "r"(x6), [ld] "r"(ldb), "m"(*(const int16_t(*)[32])c));
  }
  acc[0] = a0, acc[1] = a1, acc[2] = a2, acc[3] = a3, acc[4] = a4, acc[5] = a5, acc[6] = a6, acc[7] = a7;
}
#endif

// Rows t0 .. t0 + nt of x against a tile, V::GEMM_T (T) at a time through its widened codes; returns how many it
// took from t0, the rest (fewer than T - 2 rows) left to tile_split. A last pass of T - 2 or T - 1 rows runs as a
// whole pass that starts earlier (rows of x before t0 + nt - T exist: a call has at least GEMM_MIN_ROWS_*) and
// stores only its new rows: a row's bits do not depend on the pass that computes it.
template <class V, int TYPE>
int tile_gemm(const uint8_t* w, int64_t nblk, const Acts& a, int64_t t0, int nt, const Out& o, int64_t row0) {
  constexpr Fmt f = fmt_of(TYPE);
  constexpr bool HALVES = half_scales(TYPE);
  constexpr int T = V::GEMM_T, P = ROWS / V::L;  // rows of x per pass, vectors per row of x
  static_assert(GEMM_MIN_ROWS_AVX2 >= T && GEMM_MIN_ROWS_AVX512 >= T);
  const int done = nt % T >= T - 2 ? nt : nt / T * T;
  if (!done) return 0;
  WideTile& wt = t_wide;
  if (wt.w != w || wt.call != a.call) {
    widen_tile<TYPE>(w, nblk, wt);
    wt.w = w;
    wt.call = a.call;
  }
  const int64_t nsb = nblk * (f.elems / 32), kb32 = a.k / 32;
  for (int64_t next = t0; next < t0 + done; next += T) {
    const int64_t t1 = std::min(next, t0 + done - T);
    typename V::F acc[P * T];  // a local array: its stores do not alias x's scales (fold's loads)
    for (typename V::F& v : acc) v = V::zerof();
    for (int64_t blk = 0; blk < nsb; ++blk) {
      const int16_t* codes = wt.codes.data() + 512 * blk;
      const int16_t* x = a.c16 + t1 * a.k + 32 * blk;
      typename V::I lo[P * T], hi[P * T];
      for (int i = 0; i < P * T; ++i) lo[i] = hi[i] = V::zero();
      gemm_dots(V{}, codes, x, a.k, 0, HALVES ? 8 : 16, lo);
      if constexpr (HALVES) gemm_dots(V{}, codes, x, a.k, 8, 16, hi);
      const float* fp = wt.factors.data() + FPLANES * 16 * blk;
      for (int h = 0; h < P; ++h) {
        auto plane = [&](int i) { return V::loadf(reinterpret_cast<const uint8_t*>(fp + 16 * i + V::L * h)); };
        Factors<V> z;
        z.dsc = z.dg0 = plane(0);
        z.cm = z.dg1 = plane(1);
        z.cm0 = plane(2);
        z.cm1 = plane(3);
        for (int t = 0; t < T; ++t)
          acc[P * t + h] = fold<V, TYPE, true>(acc[P * t + h], z, lo[P * t + h], hi[P * t + h], a, t1 + t, blk, kb32);
      }
    }
    for (int t = static_cast<int>(next - t1); t < T; ++t) {
      alignas(64) float out[ROWS];
      for (int h = 0; h < P; ++h) V::store(out + V::L * h, acc[P * t + h]);
      store_rows(o, t1 + t, row0, out);
    }
  }
  return done;
}
#endif

template <class V, int TYPE>
void tile_any(const uint8_t* w, int64_t nblk, const Acts& a, int64_t t0, int nt, const Out& o, int64_t row0) {
  if (a.q2) {
#if NC_HAS_AVX2
    if constexpr (requires { V::GEMM_T; })
      if (a.call) {
        const int done = tile_gemm<V, TYPE>(w, nblk, a, t0, nt, o, row0);
        t0 += done;
        nt -= done;
      }
#endif
    tile_split<V, TYPE, true>(w, nblk, a, t0, nt, o, row0);
  } else {
    tile_split<V, TYPE, false>(w, nblk, a, t0, nt, o, row0);
  }
}
#endif

// ------------------------------------------------------------------ dense weights (F32, F16, BF16)
// A tile block is one column of the 16 rows. Per row of x and output row, partial p (0..3) sums the
// columns i = p mod 4 with fp32 FMAs in column order (4 independent chains), y = (p0 + p1) + (p2 + p3).

constexpr int DSPLIT = 4;

inline float dense_w(int type, const uint8_t* p) {
  if (type == F32) {
    float v;
    std::memcpy(&v, p, 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return type == F16 ? f16_to_f32(h) : bf16_to_f32(h);
}

void dense_scalar(const Fmt& f, const uint8_t* w, int64_t k, const Acts& a, int64_t t0, int nt, const Out& o,
                  int64_t row0) {
  for (int t = 0; t < nt; ++t) {
    const float* x = a.x + (t0 + t) * a.ldx;
    float acc[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      float p[DSPLIT] = {};
      for (int64_t i = 0; i < k; ++i)
        p[i % DSPLIT] = std::fma(dense_w(f.type, w + (i * ROWS + r) * f.raw_bytes), x[i], p[i % DSPLIT]);
      acc[r] = (p[0] + p[1]) + (p[2] + p[3]);
    }
    store_rows(o, t0 + t, row0, acc);
  }
}

#if NC_HAS_SIMD
template <class V, int TYPE>
inline typename V::F dense_load(const uint8_t* p) {
  if constexpr (TYPE == F32) return V::loadf(p);
  else if constexpr (TYPE == F16) return V::f16(p);
  else return V::bf16(p);
}

template <class V, int TYPE, int T>
inline void dense_simd(const uint8_t* w, int64_t k, const Acts& a, int64_t t0, const Out& o, int64_t row0) {
  constexpr int ESZ = fmt_of(TYPE).raw_bytes, COL = ROWS * ESZ;
  alignas(64) float out[T][ROWS];
  constexpr int PARTS = T == 1 ? V::HALVES : 1;  // one row of x: all parts in one pass, as tile_simd
  for (int h0 = 0; h0 < V::HALVES; h0 += PARTS) {
    const float* x[T];
    typename V::F p[PARTS][T][DSPLIT];
    for (int t = 0; t < T; ++t) {
      x[t] = a.x + (t0 + t) * a.ldx;
      for (int h = 0; h < PARTS; ++h)
        for (int j = 0; j < DSPLIT; ++j) p[h][t][j] = V::zerof();
    }
    // The columns [i, i + n) of the pass's parts into their partials (n <= DSPLIT; constant indices keep p
    // in registers).
    auto columns = [&](int64_t i, int n) {
      for (int h = 0; h < PARTS; ++h) {
        const uint8_t* wh = w + V::L * ESZ * (h0 + h);
        for (int j = 0; j < n; ++j) {
          const typename V::F wv = dense_load<V, TYPE>(wh + (i + j) * COL);
          for (int t = 0; t < T; ++t) p[h][t][j] = V::fma(wv, V::set1f(x[t][i + j]), p[h][t][j]);
        }
      }
    };
    int64_t i = 0;
    for (; i + DSPLIT <= k; i += DSPLIT) {
      if (TYPE != F32 && h0 == 0 && (T == 1 || t0 == 0))  // F32: the hardware prefetchers keep up
        prefetch_lines<(DSPLIT * COL + 63) / 64>(w + i * COL + PF_AHEAD);
      columns(i, DSPLIT);
    }
    switch (k - i) {  // the last k % 4 columns
      case 3: columns(i, 3); break;
      case 2: columns(i, 2); break;
      case 1: columns(i, 1); break;
    }
    for (int h = 0; h < PARTS; ++h)
      for (int t = 0; t < T; ++t)
        V::store(out[t] + V::L * (h0 + h), V::addf(V::addf(p[h][t][0], p[h][t][1]), V::addf(p[h][t][2], p[h][t][3])));
  }
  for (int t = 0; t < T; ++t) store_rows(o, t0 + t, row0, out[t]);
}

// AVX2, 3 or more rows of x. dense_simd keeps a row's 4 partials of an 8-row half in registers, so its
// 16 registers hold 2 rows and each column costs a widening and 2 broadcasts per 2 FMAs (~57% of the
// FMA peak). Here a pass runs one partial (columns j, j + 4, ...) of up to 6 rows over both halves:
// 12 accumulators, each column widened once for 12 FMAs; the partials wait in `part` between passes
// and chunks of KC columns (the chunk stays in L1 for its 4 passes). The arithmetic per output is
// dense_simd's and the scalar's: 4 column-order chains, y = (p0 + p1) + (p2 + p3).
template <class V, int TYPE, int T>
inline void dense_split(const uint8_t* w, int64_t k, const Acts& a, int64_t t0, const Out& o, int64_t row0) {
  constexpr int ESZ = fmt_of(TYPE).raw_bytes, COL = ROWS * ESZ, KC = 128, H = V::HALVES;
  // BF16: a column's 16 values widened by two unpacks, rows 0-3, 8-11 | 4-7, 12-15 (put back at the end)
  constexpr bool UNPACKED = TYPE == BF16;
  alignas(64) float part[DSPLIT][T][ROWS];
  const float* x[T];
  for (int t = 0; t < T; ++t) x[t] = a.x + (t0 + t) * a.ldx;
  for (int64_t c0 = 0; c0 < k; c0 += KC) {
    const int64_t c1 = std::min<int64_t>(k, c0 + KC);
    for (int j = 0; j < DSPLIT; ++j) {
      typename V::F p[H][T];
      for (int h = 0; h < H; ++h)
        for (int t = 0; t < T; ++t)
          p[h][t] = c0 == 0 ? V::zerof() : V::loadf(reinterpret_cast<const uint8_t*>(part[j][t] + V::L * h));
      for (int64_t i = c0 + j; i < c1; i += DSPLIT) {
        if (j == 0 && t0 == 0)  // the strided passes defeat the hardware prefetchers, F32's too
          prefetch_lines<(DSPLIT * COL + 63) / 64>(w + i * COL + PF_AHEAD);
        typename V::F wv[H];
        if constexpr (UNPACKED) {
          V::bf16_unpacked(w + i * COL, wv[0], wv[1]);
        } else {
          for (int h = 0; h < H; ++h) wv[h] = dense_load<V, TYPE>(w + i * COL + V::L * ESZ * h);
        }
        for (int t = 0; t < T; ++t) {
          const typename V::F xb = V::set1f(x[t][i]);
          for (int h = 0; h < H; ++h) p[h][t] = V::fma(wv[h], xb, p[h][t]);
        }
      }
      for (int h = 0; h < H; ++h)
        for (int t = 0; t < T; ++t) V::store(part[j][t] + V::L * h, p[h][t]);
    }
  }
  alignas(64) float out[ROWS], ordered[ROWS];
  for (int t = 0; t < T; ++t) {
    for (int c = 0; c < ROWS; c += V::L) {
      auto ld = [&](int j) { return V::loadf(reinterpret_cast<const uint8_t*>(part[j][t] + c)); };
      V::store(out + c, V::addf(V::addf(ld(0), ld(1)), V::addf(ld(2), ld(3))));
    }
    if constexpr (UNPACKED)
      for (int r = 0; r < ROWS; ++r) ordered[r] = out[(r & 3) | (r >> 2 & 1) << 3 | (r >> 3) << 2];
    store_rows(o, t0 + t, row0, UNPACKED ? ordered : out);
  }
}

template <class V, int TYPE>
void dense_any(const uint8_t* w, int64_t k, const Acts& a, int64_t t0, int nt, const Out& o, int64_t row0) {
  if constexpr (V::L == 8) {
    if (nt >= 3) {
      for (int groups = (nt + 5) / 6; groups > 0; --groups) {
        const int m = (nt + groups - 1) / groups;  // the rows left spread evenly: 8 = 4 + 4, not 6 + 2
        switch (m) {
          case 6: dense_split<V, TYPE, 6>(w, k, a, t0, o, row0); break;
          case 5: dense_split<V, TYPE, 5>(w, k, a, t0, o, row0); break;
          case 4: dense_split<V, TYPE, 4>(w, k, a, t0, o, row0); break;
          default: dense_split<V, TYPE, 3>(w, k, a, t0, o, row0); break;
        }
        t0 += m;
        nt -= m;
      }
      return;
    }
  }
  // Passes over up to 4 rows of x (AVX2: 1 or 2 rows, the rest above) keep the 4 partials per row in
  // registers; the tile stays in cache between passes.
  while (nt > 0) {
    if constexpr (V::L == 16) {
      if (nt >= 4) { dense_simd<V, TYPE, 4>(w, k, a, t0, o, row0); t0 += 4; nt -= 4; continue; }
    }
    if (nt >= 2) { dense_simd<V, TYPE, 2>(w, k, a, t0, o, row0); t0 += 2; nt -= 2; }
    else { dense_simd<V, TYPE, 1>(w, k, a, t0, o, row0); t0 += 1; nt -= 1; }
  }
}
#endif

// Both kinds: (tile, blocks per row (dense: k), activations, first row of x, rows of x, out, first output row).
using TileFn = void (*)(const uint8_t*, int64_t, const Acts&, int64_t, int, const Out&, int64_t);

template <class V>
TileFn simd_fn(int type) {
#if NC_HAS_SIMD
  switch (type) {
    case Q4_0: return tile_any<V, Q4_0>;
    case Q4_1: return tile_any<V, Q4_1>;
    case Q5_0: return tile_any<V, Q5_0>;
    case Q5_1: return tile_any<V, Q5_1>;
    case Q8_0: return tile_any<V, Q8_0>;
    case Q2_K: return tile_any<V, Q2_K>;
    case Q3_K: return tile_any<V, Q3_K>;
    case Q4_K: return tile_any<V, Q4_K>;
    case Q5_K: return tile_any<V, Q5_K>;
    case Q6_K: return tile_any<V, Q6_K>;
    case MXFP4: return tile_any<V, MXFP4>;
    case F32: return dense_any<V, F32>;
    case F16: return dense_any<V, F16>;
    case BF16: return dense_any<V, BF16>;
  }
#endif
  (void)type;
  return nullptr;
}

TileFn pick(int type) {
#if NC_HAS_AVX512
  if (g_simd >= NC_ISA_AVX512) return simd_fn<V512>(type);
#endif
#if NC_HAS_AVX2
  if (g_simd >= NC_ISA_AVX2) return simd_fn<V256>(type);
#endif
#if NC_HAS_NEON
  if (g_simd >= NC_ISA_NEON) return simd_fn<V128>(type);
#endif
  return nullptr;
}

// ------------------------------------------------------------------ raw GGML rows
// The same products for a weight left in GGML's row layout (a memory map's MoE experts: too many to
// repack, each read about once per token). Per output row the integer sums of each 16 elements and the
// fp32 operations on them are those of the tile kernels, in their order, so a row's result equals the
// tiled matmul's bit for bit on every code path. The scalar path decodes a row's block at a time; the
// SIMD path (raw_rows8) runs 8 rows with one vector lane per row for the fp32 work, as tile_simd's
// lanes. Where a sub-block has one scale (all types but Q2_K, Q3_K, Q6_K) two rows share a vector, their
// halves side by side, and each dot sums all 32 products; the others dot each row's 32 codes in a vector
// of its own and keep the 16-element halves apart. Horizontal adds then fold the 8 rows' partial sums into
// one vector. Groups of fewer than 8 rows (a matrix's last) take the scalar path.

constexpr int RAW_TOKENS = 32;  // rows of x per pass over 8 weight rows: their activations stay in L2

// y[t * ldy + r - r0] for rows [r0, r1) and rows t < n of x (row idx[t] of a, or t).
void raw_scalar(const Fmt& f, const uint8_t* w, int64_t row_stride, int64_t r0, int64_t r1, int64_t nblk,
                const Acts& a, const int64_t* idx, int64_t n, float* y, int64_t ldy) {
  float acc[RAW_TOKENS];
  RowBlock rb;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t t0 = 0; t0 < n; t0 += RAW_TOKENS) {
      const int64_t nt = std::min<int64_t>(RAW_TOKENS, n - t0);
      std::fill(acc, acc + nt, 0.0f);
      for (int64_t kb = 0; kb < nblk; ++kb) {
        const uint8_t* b = w + r * row_stride + kb * f.raw_bytes;
        if (t0 == 0)  // the same block a few rows on (prefetches never fault)
          for (int i = 0; i < f.raw_bytes; i += 64) __builtin_prefetch(b + 4 * row_stride + i, 0, 3);
        raw_row_block(f, b, rb);
        for (int64_t t = 0; t < nt; ++t) scalar_block(f, rb, kb, a, idx ? idx[t0 + t] : t0 + t, acc[t]);
      }
      for (int64_t t = 0; t < nt; ++t) y[(t0 + t) * ldy + r - r0] = acc[t];
    }
}

#if NC_HAS_NEON
// NEON: raw_scalar's loop, its fp32 operations (apply_sums) on each row's block, with the codes unpacked and
// dotted in vectors: per 16-element half one SDOT (or smull / smlal, two products summed in int16) and an add
// across the lanes.

// The codes of a raw block, element e in c[e] as raw_codes gives them (MXFP4: looked up as MX_CODES).
template <int TYPE>
__attribute__((always_inline)) inline void raw_codes_neon(const uint8_t* b, int8_t* c) {
  const uint8x16_t m4 = vdupq_n_u8(15);
  auto st = [&](int e, uint8x16_t v) { vst1q_s8(c + e, vreinterpretq_s8_u8(v)); };
  if constexpr (TYPE == Q8_0) {
    std::memcpy(c, b + 2, 32);
  } else if constexpr (fmt_of(TYPE).elems == 32) {
    constexpr int QS = TYPE == MXFP4 ? 1 : TYPE == Q4_0 ? 2 : TYPE == Q4_1 ? 4 : TYPE == Q5_0 ? 6 : 8;
    const uint8x16_t q = vld1q_u8(b + QS);
    uint8x16_t lo = vandq_u8(q, m4), hi = vshrq_n_u8(q, 4);
    if constexpr (TYPE == Q5_0 || TYPE == Q5_1) {  // bit j of qh: bit 4 of element j
      const uint8_t* qh = b + (TYPE == Q5_0 ? 2 : 4);
      lo = vorrq_u8(lo, mask_bits16(qh, 16));
      hi = vorrq_u8(hi, mask_bits16(qh + 2, 16));
    }
    if constexpr (TYPE == MXFP4) {
      const uint8x16_t tbl = vld1q_u8(reinterpret_cast<const uint8_t*>(MX_CODES));
      lo = vqtbl1q_u8(tbl, lo);
      hi = vqtbl1q_u8(tbl, hi);
    }
    st(0, lo);
    st(16, hi);
  } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {  // 32 bytes per two sub-blocks: low nibbles, then high
    const uint8_t* qs = b + (TYPE == Q4_K ? 16 : 48);
    for (int p = 0; p < 4; ++p)
      for (int j = 0; j < 2; ++j) {
        const uint8x16_t q = vld1q_u8(qs + 32 * p + 16 * j);
        uint8x16_t lo = vandq_u8(q, m4), hi = vshrq_n_u8(q, 4);
        if constexpr (TYPE == Q5_K) {  // qh byte l, bit s: bit 4 of element l of sub-block s
          const uint8x16_t qh = vld1q_u8(b + 16 + 16 * j);
          lo = vorrq_u8(lo, vandq_u8(vtstq_u8(qh, vdupq_n_u8(1 << (2 * p))), vdupq_n_u8(16)));
          hi = vorrq_u8(hi, vandq_u8(vtstq_u8(qh, vdupq_n_u8(2 << (2 * p))), vdupq_n_u8(16)));
        }
        st(64 * p + 16 * j, lo);
        st(64 * p + 32 + 16 * j, hi);
      }
  } else if constexpr (TYPE == Q6_K) {  // per 128 elements: 64 bytes of nibbles, 32 of 2-bit fields
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 2; ++j) {
        const uint8x16_t qh = vld1q_u8(b + 128 + 32 * h + 16 * j);
        const uint8x16_t l0 = vld1q_u8(b + 64 * h + 16 * j), l1 = vld1q_u8(b + 64 * h + 32 + 16 * j);
        const uint8x16_t m48 = vdupq_n_u8(48);
        st(128 * h + 16 * j, vorrq_u8(vandq_u8(l0, m4), vandq_u8(vshlq_n_u8(qh, 4), m48)));
        st(128 * h + 32 + 16 * j, vorrq_u8(vandq_u8(l1, m4), vandq_u8(vshlq_n_u8(qh, 2), m48)));
        st(128 * h + 64 + 16 * j, vorrq_u8(vshrq_n_u8(l0, 4), vandq_u8(qh, m48)));
        st(128 * h + 96 + 16 * j, vorrq_u8(vshrq_n_u8(l1, 4), vandq_u8(vshrq_n_u8(qh, 2), m48)));
      }
  } else {  // Q2_K, Q3_K: per 128 elements 32 bytes of four 2-bit fields; Q3_K's bit 2 in hmask bit 4h + j
    const uint8x16_t m3 = vdupq_n_u8(3);
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 2; ++l) {
        const uint8x16_t q = vld1q_u8(b + (TYPE == Q2_K ? 16 : 32) + 32 * h + 16 * l);
        [[maybe_unused]] const uint8x16_t hm = vld1q_u8(b + 16 * l);
        const uint8x16_t f[4] = {vandq_u8(q, m3), vandq_u8(vshrq_n_u8(q, 2), m3), vandq_u8(vshrq_n_u8(q, 4), m3),
                                 vshrq_n_u8(q, 6)};
        for (int j = 0; j < 4; ++j) {
          uint8x16_t v = f[j];
          if constexpr (TYPE == Q3_K)
            v = vorrq_u8(v, vandq_u8(vtstq_u8(hm, vdupq_n_u8(1 << (4 * h + j))), vdupq_n_u8(4)));
          st(128 * h + 32 * j + 16 * l, v);
        }
      }
  }
}

// The dot product of 16 codes with 16 activation codes (|products| <= 128 * 127: two of them fit int16).
inline int dot16_neon(const int8_t* c, const int8_t* x) {
  const int8x16_t cv = vld1q_s8(c), xv = vld1q_s8(x);
#if NC_HAS_DOTPROD
  return vaddvq_s32(vdotq_s32(vdupq_n_s32(0), cv, xv));
#else
  return vaddlvq_s16(vmlal_high_s8(vmull_s8(vget_low_s8(cv), vget_low_s8(xv)), cv, xv));
#endif
}

template <int TYPE>
void raw_rows_neon(const uint8_t* w, int64_t row_stride, int64_t r0, int64_t r1, int64_t nblk, const Acts& a,
                   const int64_t* idx, int64_t n, float* y, int64_t ldy) {
  constexpr Fmt f = fmt_of(TYPE);
  constexpr int HALVES = f.elems / 16;
  float acc[RAW_TOKENS];
  RowBlock rb;
  alignas(16) int8_t c[256];
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t t0 = 0; t0 < n; t0 += RAW_TOKENS) {
      const int64_t nt = std::min<int64_t>(RAW_TOKENS, n - t0);
      std::fill(acc, acc + nt, 0.0f);
      for (int64_t kb = 0; kb < nblk; ++kb) {
        const uint8_t* b = w + r * row_stride + kb * f.raw_bytes;
        if (t0 == 0) prefetch_lines<(f.raw_bytes + 63) / 64>(b + 4 * row_stride);  // the same block a few rows on
        raw_codes_neon<TYPE>(b, c);
        raw_block_scales(f, b, rb);
        for (int64_t t = 0; t < nt; ++t) {
          const int64_t row = idx ? idx[t0 + t] : t0 + t;
          const int8_t* xq = a.q + row * a.k + kb * f.elems;
          int sums[16];
          for (int h = 0; h < HALVES; ++h) sums[h] = dot16_neon(c + 16 * h, xq + 16 * h);
          if (a.q2) {  // combined code 256 q + q2: exact in int32
            const int8_t* xq2 = a.q2 + row * a.k + kb * f.elems;
            for (int h = 0; h < HALVES; ++h) sums[h] = 256 * sums[h] + dot16_neon(c + 16 * h, xq2 + 16 * h);
          }
          apply_sums(f, rb, kb, a, row, sums, acc[t]);
        }
      }
      for (int64_t t = 0; t < nt; ++t) y[(t0 + t) * ldy + r - r0] = acc[t];
    }
}

using RawNeonFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, int64_t, const Acts&, const int64_t*, int64_t,
                           float*, int64_t);

RawNeonFn pick_raw_neon(int type) {
  switch (type) {
    case Q4_0: return raw_rows_neon<Q4_0>;
    case Q4_1: return raw_rows_neon<Q4_1>;
    case Q5_0: return raw_rows_neon<Q5_0>;
    case Q5_1: return raw_rows_neon<Q5_1>;
    case Q8_0: return raw_rows_neon<Q8_0>;
    case Q2_K: return raw_rows_neon<Q2_K>;
    case Q3_K: return raw_rows_neon<Q3_K>;
    case Q4_K: return raw_rows_neon<Q4_K>;
    case Q5_K: return raw_rows_neon<Q5_K>;
    case Q6_K: return raw_rows_neon<Q6_K>;
    case MXFP4: return raw_rows_neon<MXFP4>;
  }
  return nullptr;
}
#endif

#if NC_HAS_AVX2

template <int N, class F>
__attribute__((always_inline)) inline void unroll(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) { (f(std::integral_constant<int, I>{}), ...); }(
      std::make_integer_sequence<int, N>{});
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// `bit` in byte i where byte i of `mask` has `sel` set.
inline __m256i bit_where(__m256i mask, int sel, int bit) {
  const __m256i s = _mm256_set1_epi8(static_cast<char>(sel));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(mask, s), s), _mm256_set1_epi8(static_cast<char>(bit)));
}

// Codes of sub-block S of a raw block, element i in byte i: unsigned as in the tiles (raw_codes), Q8_0's int8.
template <int TYPE, int S>
__attribute__((always_inline)) inline __m256i raw_codes32(const uint8_t* b) {
  const __m256i m4 = _mm256_set1_epi8(15);
  if constexpr (TYPE == Q8_0) {
    return load32(b + 2);
  } else if constexpr (fmt_of(TYPE).elems == 32) {  // low nibbles elements 0..15, high 16..31
    constexpr int QS = TYPE == MXFP4 ? 1 : TYPE == Q4_0 ? 2 : TYPE == Q4_1 ? 4 : TYPE == Q5_0 ? 6 : 8;
    const __m128i q = load16(b + QS);
    __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
    if constexpr (TYPE == Q5_0 || TYPE == Q5_1) {  // bit j of qh: bit 4 of element j
      uint32_t qh;
      std::memcpy(&qh, b + (TYPE == Q5_0 ? 2 : 4), 4);
      const __m256i spread = _mm256_shuffle_epi8(
          _mm256_set1_epi32(static_cast<int>(qh)),
          _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
      const __m256i sel = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
      u = _mm256_or_si256(u, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel),
                                              _mm256_set1_epi8(16)));
    }
    if constexpr (TYPE == MXFP4) u = V256::mx_codes(u);
    return u;
  } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {  // 32 bytes per two sub-blocks: low nibbles, then high
    const __m256i q = load32(b + (TYPE == Q4_K ? 16 : 48) + 32 * (S / 2));
    __m256i u = S % 2 ? _mm256_and_si256(_mm256_srli_epi16(q, 4), m4) : _mm256_and_si256(q, m4);
    if constexpr (TYPE == Q5_K) u = _mm256_or_si256(u, bit_where(load32(b + 16), 1 << S, 16));  // qh bit S
    return u;
  } else if constexpr (TYPE == Q6_K) {  // per 128 elements: 64 bytes of nibbles, 32 of 2-bit fields
    constexpr int H = S / 4, L = S % 4;
    const __m256i ql = load32(b + 64 * H + 32 * (L % 2));
    const __m256i lo = L >= 2 ? _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4) : _mm256_and_si256(ql, m4);
    const __m256i qh = load32(b + 128 + 32 * H);
    __m256i hi;  // bits 2L, 2L + 1 of qh to bits 4, 5
    if constexpr (2 * L < 4) hi = _mm256_slli_epi16(qh, 4 - 2 * L);
    else if constexpr (2 * L == 4) hi = qh;
    else hi = _mm256_srli_epi16(qh, 2 * L - 4);
    return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
  } else {  // Q2_K, Q3_K: per 128 elements 32 bytes of four 2-bit fields; Q3_K's bit 2 in hmask bit 4H + J
    constexpr int H = S / 4, J = S % 4;
    const __m256i q = load32(b + (TYPE == Q2_K ? 16 : 32) + 32 * H);
    __m256i u = _mm256_and_si256(_mm256_srli_epi16(q, 2 * J), _mm256_set1_epi8(3));
    if constexpr (TYPE == Q3_K) u = _mm256_or_si256(u, bit_where(load32(b), 1 << (4 * H + J), 4));
    return u;
  }
}

// Bytes [off, off + 16) of 8 blocks as 16 planes of 8 bytes: p[j][r] = byte off + j of block r.
__attribute__((always_inline)) inline void planes8(const uint8_t* const b[8], int off, uint8_t p[16][8]) {
  __m128i a[8], c[8];
  for (int i = 0; i < 4; ++i) {  // bytes 0..7 (a[2i]) and 8..15 (a[2i + 1]) of rows 2i, 2i + 1 interleaved
    const __m128i x = load16(b[2 * i] + off), y = load16(b[2 * i + 1] + off);
    a[2 * i] = _mm_unpacklo_epi8(x, y);
    a[2 * i + 1] = _mm_unpackhi_epi8(x, y);
  }
  for (int h = 0; h < 2; ++h) {  // rows 4h .. 4h + 3: bytes 0..3, 4..7, 8..11, 12..15 (4 bytes per byte index)
    c[4 * h] = _mm_unpacklo_epi16(a[4 * h], a[4 * h + 2]);
    c[4 * h + 1] = _mm_unpackhi_epi16(a[4 * h], a[4 * h + 2]);
    c[4 * h + 2] = _mm_unpacklo_epi16(a[4 * h + 1], a[4 * h + 3]);
    c[4 * h + 3] = _mm_unpackhi_epi16(a[4 * h + 1], a[4 * h + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // planes 4i .. 4i + 3
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p[4 * i]), _mm_unpacklo_epi32(c[i], c[4 + i]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p[4 * i + 2]), _mm_unpackhi_epi32(c[i], c[4 + i]));
  }
}

// The fp16 at byte `off` of 8 blocks, as fp32 lanes.
inline __m256 f16_lanes(const uint8_t* const b[8], int off) {
  uint16_t h[8];
  for (int r = 0; r < 8; ++r) std::memcpy(&h[r], b[r] + off, 2);
  return _mm256_cvtph_ps(_mm_setr_epi16(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]));
}

// fp16 values from two planes (low and high bytes) as fp32 lanes.
inline __m256 f16_planes(const uint8_t lo[8], const uint8_t hi[8]) {
  return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(lo)),
                                           _mm_loadl_epi64(reinterpret_cast<const __m128i*>(hi))));
}

// The 8 blocks' d and min (m: Q4_1, Q5_1, Q2_K, Q4_K, Q5_K), and their K-quant scales (and mins), one
// plane of 8 bytes per sub-block (Q4_K, Q5_K) or per half of one (Q2_K, Q3_K, Q6_K): the values
// sub_scales gives.
template <int TYPE>
__attribute__((always_inline)) inline void raw_scales8(const uint8_t* const b[8], __m256& d, __m256& m,
                                                        uint8_t sc[16][8], uint8_t mn[16][8]) {
  constexpr Fmt f = fmt_of(TYPE);
  alignas(16) uint8_t p[16][8];
  auto ld = [&](int j) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[j])); };  // planes j, j + 1
  auto st = [](uint8_t* dst, __m128i v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), v); };
  const __m128i m15 = _mm_set1_epi8(15), m48 = _mm_set1_epi8(48), m63 = _mm_set1_epi8(63);
  if constexpr (TYPE == MXFP4) {
    auto byte = [&](int r) { return static_cast<uint64_t>(b[r][0]) << (8 * r); };
    const uint64_t e = ((byte(0) | byte(1)) | (byte(2) | byte(3))) | ((byte(4) | byte(5)) | (byte(6) | byte(7)));
    d = e8m0_lanes(_mm_cvtsi64_si128(static_cast<long long>(e)));
  } else if constexpr (TYPE != Q4_K && TYPE != Q5_K && TYPE != Q3_K) {
    d = f16_lanes(b, raw_d(TYPE));
    if constexpr (f.m >= 0) m = f16_lanes(b, raw_m(TYPE));
  }
  if constexpr (TYPE == Q4_K || TYPE == Q5_K) {  // d, dmin, then as k_scales16 (plane 4 + j: scale byte j)
    planes8(b, 0, p);
    d = f16_planes(p[0], p[1]);
    m = f16_planes(p[2], p[3]);
    auto s = [&](int j) { return ld(4 + j); };
    for (int j = 0; j < 4; j += 2) {
      st(sc[j], _mm_and_si128(s(j), m63));
      st(mn[j], _mm_and_si128(s(j + 4), m63));
      st(sc[j + 4], _mm_or_si128(_mm_and_si128(s(j + 8), m15), _mm_and_si128(_mm_srli_epi16(s(j), 2), m48)));
      st(mn[j + 4], _mm_or_si128(_mm_and_si128(_mm_srli_epi16(s(j + 8), 4), m15),
                                 _mm_and_si128(_mm_srli_epi16(s(j + 4), 2), m48)));
    }
  } else if constexpr (TYPE == Q6_K) {  // int8 scales
    planes8(b, 192, sc);
  } else if constexpr (TYPE == Q2_K) {  // scale | min << 4
    planes8(b, 0, p);
    for (int j = 0; j < 16; j += 2) {
      st(sc[j], _mm_and_si128(ld(j), m15));
      st(mn[j], _mm_and_si128(_mm_srli_epi16(ld(j), 4), m15));
    }
  } else if constexpr (TYPE == Q3_K) {  // as q3k_scales16; bytes 94.. so as not to read past the block
    planes8(b, 94, p);
    d = f16_planes(p[14], p[15]);
    auto s = [&](int k) { return ld(2 + k); };  // scale bytes k, k + 1
    for (int j = 0; j < 8; j += 2) {
      const __m128i hi_lo = j < 4 ? _mm_slli_epi16(s(8 + j), 4) : _mm_slli_epi16(s(8 + j - 4), 2);
      const __m128i hi_hi = j < 4 ? s(8 + j) : _mm_srli_epi16(s(8 + j - 4), 2);
      st(sc[j], _mm_sub_epi8(_mm_or_si128(_mm_and_si128(s(j), m15), _mm_and_si128(hi_lo, m48)), _mm_set1_epi8(32)));
      st(sc[j + 8], _mm_sub_epi8(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(s(j), 4), m15), _mm_and_si128(hi_hi, m48)),
                                 _mm_set1_epi8(32)));
    }
  }
  (void)mn;
}

// 8 x int32 for one row: lanes 0..3 add up to the dot product of elements 0..15 of u and x, lanes 4..7 of
// elements 16..31 (combined codes with two levels: 256 q + q2).
template <int TYPE, bool X2, bool VNNI>
__attribute__((always_inline)) inline __m256i raw_dot(__m256i u, __m256i q, __m256i q2) {
  if constexpr (TYPE == Q8_0) {  // unsigned |w| times x with w's sign
    q = _mm256_sign_epi8(q, u);
    if constexpr (X2) q2 = _mm256_sign_epi8(q2, u);
    u = _mm256_abs_epi8(u);
  }
#if NC_HAS_AVX512
  if constexpr (VNNI) {
    __m256i v = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, q);
    if constexpr (X2) v = _mm256_dpbusd_epi32(_mm256_slli_epi32(v, 8), u, q2);
    return v;
  }
#endif
  // |u| <= 128 and |q| <= 127: maddubs's pair sums fit int16
  const __m256i v = _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), _mm256_set1_epi16(X2 ? 256 : 1));
  if constexpr (!X2) return v;
  else return _mm256_add_epi32(v, _mm256_madd_epi16(_mm256_maddubs_epi16(u, q2), _mm256_set1_epi16(1)));
}

// Codes of sub-block S of two raw blocks, halves side by side: lo = [b0's elements 0..15 | b1's 0..15],
// hi = the same of elements 16..31. The 4-bit types split one load of both blocks' nibbles.
template <int TYPE, int S>
__attribute__((always_inline)) inline void raw_codes_pair(const uint8_t* b0, const uint8_t* b1, __m256i& lo,
                                                          __m256i& hi) {
  if constexpr (TYPE == Q4_0 || TYPE == Q4_1 || TYPE == MXFP4) {
    constexpr int QS = TYPE == MXFP4 ? 1 : TYPE == Q4_0 ? 2 : 4;
    const __m256i m4 = _mm256_set1_epi8(15), q = _mm256_set_m128i(load16(b1 + QS), load16(b0 + QS));
    lo = _mm256_and_si256(q, m4);
    hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    if constexpr (TYPE == MXFP4) {
      lo = V256::mx_codes(lo);
      hi = V256::mx_codes(hi);
    }
  } else {
    const __m256i u0 = raw_codes32<TYPE, S>(b0), u1 = raw_codes32<TYPE, S>(b1);
    lo = _mm256_permute2x128_si256(u0, u1, 0x20);
    hi = _mm256_permute2x128_si256(u0, u1, 0x31);
  }
}

// 8 x int32 for two rows whose halves raw_codes_pair gives (ul, uh): lanes 0..3 add up to the first row's dot
// product of all 32 elements with x, lanes 4..7 to the second's. q, q2: x's two levels, laid out as the codes
// (xl = [x 0..15 | x 0..15], xh = [x 16..31 | x 16..31]).
template <int TYPE, bool X2, bool VNNI>
__attribute__((always_inline)) inline __m256i raw_dot_pair(__m256i ul, __m256i uh, __m256i ql, __m256i qh,
                                                           __m256i q2l, __m256i q2h) {
  if constexpr (TYPE == Q8_0) {
    return _mm256_add_epi32(raw_dot<TYPE, X2, VNNI>(ul, ql, q2l), raw_dot<TYPE, X2, VNNI>(uh, qh, q2h));
  } else if constexpr (!VNNI) {  // codes <= 31, |x| <= 127: both halves' pair sums add up within int16
    auto sum16 = [&](__m256i a, __m256i b) {
      return _mm256_add_epi16(_mm256_maddubs_epi16(ul, a), _mm256_maddubs_epi16(uh, b));
    };
    const __m256i v = _mm256_madd_epi16(sum16(ql, qh), _mm256_set1_epi16(X2 ? 256 : 1));
    if constexpr (!X2) return v;
    else return _mm256_add_epi32(v, _mm256_madd_epi16(sum16(q2l, q2h), _mm256_set1_epi16(1)));
  } else {
#if NC_HAS_AVX512
    __m256i v = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), ul, ql), uh, qh);
    if constexpr (X2) v = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_slli_epi32(v, 8), ul, q2l), uh, q2h);
    return v;
#else
    static_assert(!VNNI);
#endif
  }
}

// v[p] of raw_dot_pair for rows p and p + 4 -> lane r: row r's sum of all 32 elements.
__attribute__((always_inline)) inline __m256i fold_pairs4(const __m256i v[4]) {
  return _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
}

// v[r] of raw_dot for 8 rows -> lo (lane r: row r's sum of elements 0..15) and hi (16..31).
__attribute__((always_inline)) inline void fold_rows8(const __m256i v[8], __m256i& lo, __m256i& hi) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  lo = _mm256_permute2x128_si256(a, b, 0x20);
  hi = _mm256_permute2x128_si256(a, b, 0x31);
}

// acc[t] (8 rows' fp32 sums for row t0 + t of x) += blocks [0, nblk) of 8 weight rows (row r at w + r * stride)
// times x rows idx[t0 + t] (or t0 + t), t < n. WIDE: two-level dots on the combined int16 codes (AVX2, several rows
// of x: the codes widened once per row serve them all). pf: prefetch distance (0: none). NT = 1: n is 1, and
// its sums stay in a register (in memory, each sub-block's fp32 chain waits on a store and a load).
template <int TYPE, bool X2, bool WIDE, bool VNNI, int NT>
void raw_rows8(const uint8_t* w, int64_t stride, int64_t nblk, int64_t pf, const Acts& a, const int64_t* idx,
               int64_t t0, int64_t n, __m256* acc_out) {
  using V = V256;
  __m256 acc_reg = acc_out[0];
  __m256* acc = NT == 1 ? &acc_reg : acc_out;
  if constexpr (NT == 1) n = 1;
  constexpr Fmt f = fmt_of(TYPE);
  constexpr int SUBS = f.elems / 32, RAW = f.raw_bytes;
  constexpr int OFF = int_offset(TYPE);
  // One scale for all 32 elements of a sub-block: rows are dotted two per vector, both halves summed in the dot.
  constexpr bool PAIRED = !WIDE && !half_scales(TYPE);
  const int64_t kb32 = a.k / 32, kb16 = a.k / 16;
  // Rows 4..7 addressed from rows 0..3 (+ s4): 8 row pointers would not fit the general registers.
  const int64_t s4 = 4 * stride;
  const uint8_t* p[4] = {w, w + stride, w + 2 * stride, w + 3 * stride};
  const int64_t row1 = NT == 1 ? (idx ? idx[t0] : t0) : 0;  // NT = 1: x's row, its pointers hoisted
  constexpr int PF_EVERY = std::max(1, 64 / RAW);  // blocks per prefetch of each row
  for (int64_t kb = 0; kb < nblk; ++kb, p[0] += RAW, p[1] += RAW, p[2] += RAW, p[3] += RAW) {
    const uint8_t* b[8];
    for (int r = 0; r < 4; ++r) {
      b[r] = p[r];
      b[r + 4] = p[r] + s4;
    }
    // Blocks are contiguous: an address every 64 bytes or less reaches every line.
    if (pf && kb % PF_EVERY == 0)
      for (int r = 0; r < 8; ++r) prefetch_lines<(RAW + 63) / 64>(b[r] + pf);
    __m256 d, m = V::zerof();
    alignas(16) uint8_t sc[16][8], mn[16][8];
    raw_scales8<TYPE>(b, d, m, sc, mn);
    unroll<SUBS>([&](auto S_) {
      constexpr int S = S_;
      __m256 dsc = d, cm = m, dg0 = d, dg1 = d, cm0 = m, cm1 = m;
      if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
        dsc = V::mul(d, V::u8f(sc[S]));
        cm = V::mul(m, V::u8f(mn[S]));
      } else if constexpr (TYPE == Q6_K || TYPE == Q3_K) {
        dg0 = V::mul(d, V::s8f(sc[2 * S]));
        dg1 = V::mul(d, V::s8f(sc[2 * S + 1]));
      } else if constexpr (TYPE == Q2_K) {
        dg0 = V::mul(d, V::u8f(sc[2 * S]));
        dg1 = V::mul(d, V::u8f(sc[2 * S + 1]));
        cm0 = V::mul(m, V::u8f(mn[2 * S]));
        cm1 = V::mul(m, V::u8f(mn[2 * S + 1]));
      }
      const int64_t blk = kb * SUBS + S;
      // y += a sub-block with one scale: its 32-element sums tot for x row `row` (tile_simd's operations)
      auto one_scale = [&](__m256 y, __m256i tot, int64_t row, bool offset = true) {
        const int32_t* s16 = a.s16 + row * kb16 + 2 * blk;
        if (OFF != 0 && offset) tot = V::sub(tot, V::set1(OFF * (s16[0] + s16[1])));
        y = V::fma(V::mul(dsc, V::set1f(a.d[row * kb32 + blk])), V::cvt(tot), y);
        if constexpr (TYPE == Q4_K || TYPE == Q5_K) return V::fnma(cm, V::set1f(a.ds[row * kb32 + blk]), y);
        else if constexpr (f.m >= 0) return V::fma(cm, V::set1f(a.ds[row * kb32 + blk]), y);
        else return y;
      };
      if constexpr (PAIRED) {
        __m256i ul[4], uh[4];
        for (int p = 0; p < 4; ++p) raw_codes_pair<TYPE, S>(b[p], b[p + 4], ul[p], uh[p]);
        for (int64_t t = 0; t < n; ++t) {
          const int64_t row = NT == 1 ? row1 : idx ? idx[t0 + t] : t0 + t;
          // x's halves, each in both 128-bit lanes: broadcast loads, no shuffles (the kernel's bound on Zen)
          auto both = [](const int8_t* p) {
            return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
          };
          const int8_t* xq = a.q + row * a.k + 32 * blk;
          const __m256i ql = both(xq), qh = both(xq + 16);
          __m256i q2l = ql, q2h = qh;
          if constexpr (X2) {
            const int8_t* xq2 = a.q2 + row * a.k + 32 * blk;
            q2l = both(xq2);
            q2h = both(xq2 + 16);
          }
          __m256i v[4];
          for (int p = 0; p < 4; ++p) v[p] = raw_dot_pair<TYPE, X2, VNNI>(ul[p], uh[p], ql, qh, q2l, q2h);
          acc[t] = one_scale(acc[t], fold_pairs4(v), row);
        }
      } else {
        __m256i u[8];
        for (int r = 0; r < 8; ++r) u[r] = raw_codes32<TYPE, S>(b[r]);
        // WIDE: the codes less their offset as int16 (tile_simd's dots_wide), elements 0..7 | 16..23 and 8..15 | 24..31
        constexpr int OFF16 = wide_offset(TYPE);
        [[maybe_unused]] __m256i wl[8], wh[8];
        if constexpr (WIDE)
          for (int r = 0; r < 8; ++r) {
            const __m256i ext = TYPE == Q8_0 ? _mm256_cmpgt_epi8(_mm256_setzero_si256(), u[r]) : _mm256_setzero_si256();
            wl[r] = _mm256_sub_epi16(_mm256_unpacklo_epi8(u[r], ext), _mm256_set1_epi16(OFF16));
            wh[r] = _mm256_sub_epi16(_mm256_unpackhi_epi8(u[r], ext), _mm256_set1_epi16(OFF16));
          }
        for (int64_t t = 0; t < n; ++t) {
          const int64_t row = NT == 1 ? row1 : idx ? idx[t0 + t] : t0 + t;
          __m256i v[8];
          if constexpr (WIDE) {
            const int16_t* c = a.c16 + row * a.k + 32 * blk;
            const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
            const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 16));
            const __m256i ca = _mm256_permute2x128_si256(x0, x1, 0x20), cb = _mm256_permute2x128_si256(x0, x1, 0x31);
            for (int r = 0; r < 8; ++r) v[r] = _mm256_add_epi32(_mm256_madd_epi16(wl[r], ca), _mm256_madd_epi16(wh[r], cb));
          } else {
            const __m256i q = load32(reinterpret_cast<const uint8_t*>(a.q + row * a.k + 32 * blk));
            const __m256i q2 = X2 ? load32(reinterpret_cast<const uint8_t*>(a.q2 + row * a.k + 32 * blk)) : q;
            for (int r = 0; r < 8; ++r) v[r] = raw_dot<TYPE, X2, VNNI>(u[r], q, q2);
          }
          __m256i lo, hi;
          fold_rows8(v, lo, hi);
          // from here on tile_simd's operations, lane for lane
          const int32_t* s16 = a.s16 + row * kb16 + 2 * blk;
          const __m256 dx = V::set1f(a.d[row * kb32 + blk]);
          __m256 y = acc[t];
          if constexpr (TYPE == Q6_K || TYPE == Q3_K) {
            if constexpr (!WIDE) {
              lo = V::sub(lo, V::set1(OFF16 * s16[0]));
              hi = V::sub(hi, V::set1(OFF16 * s16[1]));
            }
            y = V::fma(V::mul(dg0, dx), V::cvt(lo), y);
            y = V::fma(V::mul(dg1, dx), V::cvt(hi), y);
          } else if constexpr (TYPE == Q2_K) {
            const float dxs = a.d[row * kb32 + blk];
            y = V::fma(V::mul(dg0, dx), V::cvt(lo), y);
            y = V::fma(V::mul(dg1, dx), V::cvt(hi), y);
            y = V::fnma(cm0, V::set1f(dxs * static_cast<float>(s16[0])), y);
            y = V::fnma(cm1, V::set1f(dxs * static_cast<float>(s16[1])), y);
          } else {
            y = one_scale(y, V::add(lo, hi), row, !WIDE);
          }
          acc[t] = y;
        }
      }
    });
  }
  if constexpr (NT == 1) acc_out[0] = acc_reg;
}

using RawFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const Acts&, const int64_t*, int64_t, int64_t,
                      __m256*);

template <int TYPE>
RawFn raw_fn(bool x2, bool wide, bool vnni, bool one) {
#if NC_HAS_AVX512
  if (vnni && one) return x2 ? raw_rows8<TYPE, true, false, true, 1> : raw_rows8<TYPE, false, false, true, 1>;
  if (vnni) return x2 ? raw_rows8<TYPE, true, false, true, 0> : raw_rows8<TYPE, false, false, true, 0>;
#endif
  (void)vnni;
  if (one) return x2 ? raw_rows8<TYPE, true, false, false, 1> : raw_rows8<TYPE, false, false, false, 1>;
  if (!x2) return raw_rows8<TYPE, false, false, false, 0>;
  return wide ? raw_rows8<TYPE, true, true, false, 0> : raw_rows8<TYPE, true, false, false, 0>;
}

RawFn pick_raw(int type, bool x2, bool wide, bool vnni, bool one) {
  switch (type) {
    case Q4_0: return raw_fn<Q4_0>(x2, wide, vnni, one);
    case Q4_1: return raw_fn<Q4_1>(x2, wide, vnni, one);
    case Q5_0: return raw_fn<Q5_0>(x2, wide, vnni, one);
    case Q5_1: return raw_fn<Q5_1>(x2, wide, vnni, one);
    case Q8_0: return raw_fn<Q8_0>(x2, wide, vnni, one);
    case Q2_K: return raw_fn<Q2_K>(x2, wide, vnni, one);
    case Q3_K: return raw_fn<Q3_K>(x2, wide, vnni, one);
    case Q4_K: return raw_fn<Q4_K>(x2, wide, vnni, one);
    case Q5_K: return raw_fn<Q5_K>(x2, wide, vnni, one);
    case Q6_K: return raw_fn<Q6_K>(x2, wide, vnni, one);
    case MXFP4: return raw_fn<MXFP4>(x2, wide, vnni, one);
  }
  return nullptr;
}
#endif

// ------------------------------------------------------------------ reading rows back

// Row r of a tile as fp32 into out[k]: gguf's dequantization formulas, the same fp32 operations.
void dequant_row(const Fmt& f, const uint8_t* w, int64_t nblk, int r, float* out) {
  for (int64_t kb = 0; kb < nblk; ++kb) {
    const uint8_t* b = w + kb * f.tile_bytes;
    float* o = out + kb * f.elems;
    if (f.elems == 1) {
      o[0] = dense_w(f.type, b + r * f.raw_bytes);
      continue;
    }
    RowBlock rb;
    tile_row_block(f, b, r, rb);
    const float d = rb.d, m = rb.m;
    for (int s = 0; s < f.elems / 32; ++s) {
      const int* sc = rb.sc[s];
      const int* mn = rb.mn[s];
      for (int e = 0; e < 32; ++e) {
        const int c = rb.c[32 * s + e], h = e / 16;
        float v;
        switch (f.type) {
          case Q4_0: v = d * static_cast<float>(c - 8); break;
          case Q5_0: v = d * static_cast<float>(c - 16); break;
          case Q4_1: case Q5_1: v = d * static_cast<float>(c) + m; break;
          case Q8_0: v = static_cast<float>(c) * d; break;
          case MXFP4: v = static_cast<float>(c - MX_OFF) * d; break;  // ggml: kvalue * d
          case Q6_K: v = d * static_cast<float>(sc[h]) * static_cast<float>(c - 32); break;
          case Q3_K: v = d * static_cast<float>(sc[h]) * static_cast<float>(c - 4); break;
          default:  // Q2_K, Q4_K, Q5_K
            v = d * static_cast<float>(sc[h]) * static_cast<float>(c) - m * static_cast<float>(mn[h]);
        }
        o[32 * s + e] = v;
      }
    }
  }
}

// ------------------------------------------------------------------ thread pool
// OpenMP's fork/join makes the caller wait at the end of every region for all its threads; on a
// machine with other busy processes a woken worker can wait a scheduler tick (4-8 ms) for a core,
// and a decode token makes ~120 calls. Here work is split into chunks that threads claim with a
// CAS on one state word (generation | next chunk | chunk count); the caller claims chunks too and
// then waits only for chunks already claimed. A worker that wakes late finds nothing left to do.
// Workers spin for a while after a job (decode calls come every few tens of microseconds), then
// sleep on a futex (std::atomic::wait).

using RangeFn = void (*)(const void* ctx, int64_t i0, int64_t i1);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#else
  std::this_thread::yield();
#endif
}

class Pool {
 public:
  static constexpr int64_t MAX_CHUNKS = 0xffff;
  // After a job a worker polls with `pause` for HOT, then with sched_yield (any other runnable thread,
  // e.g. torch's OpenMP worker, gets the core at once) until SPIN, then sleeps. SPIN outlasts the engine's
  // Python between two steps (0.3-1 ms): a sleeping worker woke late (on a VM, most of a millisecond) while
  // the caller ran the next step's first matmuls alone.
  static constexpr auto HOT = std::chrono::microseconds(20), SPIN = std::chrono::microseconds(3000);
  std::atomic<int> last_threads{1};  // threads the last job could use (tests: the count reaches the pool)

  // Run fn over [0, items) in chunks of `chunk` items on up to `threads` threads (the caller included).
  void run(int64_t items, int64_t chunk, int threads, RangeFn fn, const void* ctx) {
    chunk = std::max<int64_t>({chunk, 1, (items + MAX_CHUNKS - 1) / MAX_CHUNKS});
    const int64_t total = (items + chunk - 1) / chunk;
    std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
    if (threads <= 1 || total <= 1 || !lock.owns_lock()) {  // (a concurrent caller runs alone)
      last_threads.store(1, std::memory_order_relaxed);
      fn(ctx, 0, items);
      return;
    }
    last_threads.store(threads, std::memory_order_relaxed);
    grow(threads - 1);
    fn_ = fn;
    ctx_ = ctx;
    items_ = items;
    chunk_ = chunk;
    active_.store(threads - 1, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint32_t g = ++gen_;
    state_.store((static_cast<uint64_t>(g) << 32) | static_cast<uint64_t>(total), std::memory_order_release);
    wake_.store(g);
    if (sleeping_.load() > 0) wake_.notify_all();
    work(g);
    while (done_.load(std::memory_order_acquire) < total) cpu_relax();  // chunks still in flight
  }

 private:
  // Claim and run chunks of job g until none are left (or a newer job has started).
  void work(uint32_t g) {
    for (;;) {
      uint64_t s = state_.load(std::memory_order_acquire);
      const uint64_t next = (s >> 16) & 0xffff, total = s & 0xffff;
      if (static_cast<uint32_t>(s >> 32) != g || next >= total) return;
      if (!state_.compare_exchange_weak(s, s + (1u << 16), std::memory_order_acq_rel)) continue;
      // Claimed: job g cannot complete, nor its fields change, before done_ counts this chunk.
      const int64_t i0 = static_cast<int64_t>(next) * chunk_;
      fn_(ctx_, i0, std::min(items_, i0 + chunk_));
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void worker(int index) {
    uint32_t seen = wake_.load();
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      bool hot = true;
      for (int spins = 0;; ++spins) {
        if (static_cast<uint32_t>(state_.load(std::memory_order_acquire) >> 32) != seen) break;
        if (hot) {
          cpu_relax();
          if ((spins & 63) != 63) continue;
          hot = std::chrono::steady_clock::now() - start < HOT;
        } else {
          std::this_thread::yield();
          if (std::chrono::steady_clock::now() - start > SPIN) {
            sleeping_.fetch_add(1);
            wake_.wait(seen);  // returns at once if a job was published meanwhile
            sleeping_.fetch_sub(1);
            start = std::chrono::steady_clock::now();
            hot = true;
          }
        }
      }
      seen = static_cast<uint32_t>(state_.load(std::memory_order_acquire) >> 32);
      if (index < active_.load(std::memory_order_relaxed)) work(seen);
    }
  }

  void grow(int n) {
    while (static_cast<int>(workers_) < n) {
      const int index = static_cast<int>(workers_++);
      std::thread([this, index] { worker(index); }).detach();
    }
  }

  alignas(64) std::atomic<uint64_t> state_{0};
  alignas(64) std::atomic<uint32_t> done_{0};
  alignas(64) std::atomic<uint32_t> wake_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<int> active_{0};
  RangeFn fn_ = nullptr;
  const void* ctx_ = nullptr;
  int64_t items_ = 0, chunk_ = 1;
  uint32_t gen_ = 0;
  size_t workers_ = 0;
  std::mutex busy_;
};

// Leaked on purpose (detached workers may outlive static destructors); a forked child starts a fresh
// one, since the parent's workers do not exist there.
Pool* g_pool = new Pool;
void reset_pool_in_child() { g_pool = new Pool; }
const int g_atfork = pthread_atfork(nullptr, nullptr, reset_pool_in_child);

thread_local ActBuffer g_acts;     // per calling thread: the quantized activations
thread_local std::vector<float> g_xf;  // dense weights' bf16 x as fp32

constexpr int64_t MIN_PARALLEL_BYTES = 64 << 10;  // below this, a second thread costs more than it saves
constexpr int64_t CHUNK_BYTES = 32 << 10;          // min weight bytes (times rows of x) per claimed chunk
// Chunks per thread (at least CHUNK_BYTES each): each thread streams its chunks front to back, and each
// chunk start costs a prefetch ramp (its first PF_AHEAD bytes are read on demand), so few large chunks
// stream best. 1-row calls on 2 threads, weights from DRAM: 4096 x 1024 Q4_K 55 us with 32 KB chunks,
// 44-47 us with 4 chunks per thread; 576 x 1536 Q4_1 14-15 us with 4 per thread, 12-14 us with 2 or 1.
// 2 still lets a faster (or less busy) core take a larger share of a prefill.
constexpr int64_t CHUNKS_PER_THREAD = 2;

// Threads for a call that reads `work` bytes of weights (times the rows of x, up to a tile pass's).
int call_threads(int64_t work, int threads) { return work < MIN_PARALLEL_BYTES ? 1 : std::max(1, threads); }

// Chunk size for `items` items of `per_item` bytes each on nt threads.
int64_t chunk_items(int64_t items, int64_t per_item, int nt) {
  const int64_t chunks = nt * CHUNKS_PER_THREAD;
  return std::max<int64_t>({1, CHUNK_BYTES / std::max<int64_t>(1, per_item), (items + chunks - 1) / chunks});
}

// Quantize rows [0, n) of x (row stride ldx elements) into buf, on the pool when there are many.
void quantize_rows(ActBuffer& buf, const void* x, int x_bf16, int64_t n, int64_t ldx, int nt) {
  const size_t esz = x_bf16 ? 2 : 4;
  parallel_for(n, n < 4 * TMAX ? n : TMAX, n < 4 * TMAX ? 1 : nt, [&](int64_t r0, int64_t r1) {
    for (int64_t t = r0; t < r1; ++t) buf.quantize(t, static_cast<const char*>(x) + t * ldx * esz, x_bf16);
  });
}

}  // namespace

namespace nc::qg {

void ActBuffer::reserve(int64_t n, int64_t k_, bool x2_, bool wide_) {
  k = k_;
  x2 = x2_;
  wide = x2_ && wide_;
  auto grow = [](auto& v, int64_t size) {
    if (static_cast<int64_t>(v.size()) < size) v.resize(size);
  };
  grow(q, n * k);
  if (x2) grow(q2, n * k);
  if (wide) grow(c16, n * k);
  grow(d, n * k / 32);
  grow(ds, n * k / 32);
  grow(s16, n * k / 16);
}

void ActBuffer::quantize(int64_t row, const void* x, int x_bf16) {
  int8_t* qr = q.data() + row * k;
  int8_t* q2r = x2 ? q2.data() + row * k : nullptr;
  quantize_any(x, x_bf16, k, qr, q2r, d.data() + row * (k / 32), s16.data() + row * (k / 16), ds.data() + row * (k / 32));
  if (wide)
    for (int64_t i = 0; i < k; ++i) c16[row * k + i] = static_cast<int16_t>(256 * qr[i] + q2r[i]);
}

Acts ActBuffer::view() const {
  Acts a{};
  a.q = q.data();
  a.q2 = x2 ? q2.data() : nullptr;
  a.c16 = wide ? c16.data() : nullptr;
  a.d = d.data();
  a.s16 = s16.data();
  a.ds = ds.data();
  a.k = k;
  return a;
}

bool wide_codes(int64_t rows) { return g_simd == NC_ISA_AVX2 && rows > 1; }

bool raw_type(int type) {
  const Fmt* f = find_fmt(type);
  return f && f->elems > 1;
}

int block_elems(int type) {
  const Fmt* f = find_fmt(type);
  return f ? f->elems : 0;
}

int block_bytes(int type) {
  const Fmt* f = find_fmt(type);
  return f ? f->raw_bytes : 0;
}

void matmul_rows(int type, const uint8_t* w, int64_t row_stride, int64_t r0, int64_t r1, const Acts& a,
                 const int64_t* idx, int64_t n, float* y, int64_t ldy, int64_t pf_end) {
  const Fmt& f = *find_fmt(type);
  const int64_t nblk = a.k / f.elems;
#if NC_HAS_AVX2
  if (g_simd >= NC_ISA_AVX2) {
    const RawFn fn = pick_raw(type, a.q2 != nullptr, a.c16 != nullptr && n > 1, g_simd >= NC_ISA_AVX512, n == 1);
    // Prefetch the rows a few groups of 8 ahead (the next ones this thread reads when rows are contiguous),
    // up to row pf_end.
    const int64_t group = 8 * row_stride, ahead = (PF_AHEAD + group - 1) / group * 8, pf = ahead * row_stride;
    pf_end = std::max(pf_end, r1);
    int64_t g = r0;
    alignas(32) __m256 acc[RAW_TOKENS];
    for (; g + 8 <= r1; g += 8)
      for (int64_t t0 = 0; t0 < n; t0 += RAW_TOKENS) {
        const int64_t nt = std::min<int64_t>(RAW_TOKENS, n - t0);
        for (int64_t t = 0; t < nt; ++t) acc[t] = _mm256_setzero_ps();
        fn(w + g * row_stride, row_stride, nblk, t0 == 0 && g + ahead < pf_end ? pf : 0, a, idx, t0, nt, acc);
        for (int64_t t = 0; t < nt; ++t) _mm256_storeu_ps(y + (t0 + t) * ldy + g - r0, acc[t]);
      }
    if (g < r1) raw_scalar(f, w, row_stride, g, r1, nblk, a, idx, n, y + (g - r0), ldy);  // the same bits
    return;
  }
#endif
#if NC_HAS_NEON
  if (g_simd >= NC_ISA_NEON) return pick_raw_neon(type)(w, row_stride, r0, r1, nblk, a, idx, n, y, ldy);
#endif
  raw_scalar(f, w, row_stride, r0, r1, nblk, a, idx, n, y, ldy);
}

}  // namespace nc::qg

// One tile of a dense weight: element i of row r to slot i * ROWS + r, written in order (the 16 rows are read as
// 16 streams). Typed copies of a fixed size: a memcpy call of the run-time size per element made a bf16 folder's
// repacking 3x slower (benchmarks/README.md, "Hugging Face folders on the CPU kernels").
template <typename T>
static void repack_dense_tile(const uint8_t* src, int64_t row0, int64_t rows, int64_t k, int64_t row_stride,
                              uint8_t* dst) {
  const int n = static_cast<int>(std::min<int64_t>(ROWS, rows - row0));
  const uint8_t* in[ROWS];
  for (int r = 0; r < n; ++r) in[r] = src + (row0 + r) * row_stride;
  T* out = reinterpret_cast<T*>(dst);
  if (n == ROWS) {  // a whole tile: a fixed trip count the compiler unrolls
    for (int64_t i = 0; i < k; ++i)
      for (int r = 0; r < ROWS; ++r) std::memcpy(&out[i * ROWS + r], in[r] + i * sizeof(T), sizeof(T));
    return;
  }
  for (int64_t i = 0; i < k; ++i) {
    T part[ROWS] = {};
    for (int r = 0; r < n; ++r) std::memcpy(&part[r], in[r] + i * sizeof(T), sizeof(T));
    std::memcpy(out + i * ROWS, part, sizeof(part));
  }
}

extern "C" {

int nc_qg_simd_compiled() { return NC_ISA; }
int nc_qg_simd() { return g_simd; }
int nc_qg_last_threads() { return g_pool->last_threads.load(std::memory_order_relaxed); }
// A level of this build's ladder (x86 or Arm), at most the compiled one; another ladder's level is scalar.
void nc_qg_set_simd(int level) {
  const bool same_ladder = (level >= NC_ISA_NEON) == (NC_ISA_BASE == NC_ISA_NEON);
  g_simd = level > NC_ISA_SCALAR && same_ladder ? std::min(level, nc_qg_simd_compiled()) : NC_ISA_SCALAR;
}

// The pool for other kernels of this library (decoder.cpp): fn over [0, items) in chunks.
void nc_qg_parallel_for(int64_t items, int64_t chunk, int threads, void (*fn)(const void*, int64_t, int64_t),
                        const void* ctx) {
  g_pool->run(items, chunk, threads, fn, ctx);
}

int64_t nc_qg_packed_bytes(int type, int64_t rows, int64_t k) {
  const Fmt* f = find_fmt(type);
  if (!f || k % f->elems) return -1;
  return (rows + ROWS - 1) / ROWS * (k / f->elems) * f->tile_bytes;
}

// Raw GGML rows (row_stride bytes apart) -> tiles [ceil(rows / 16)][k / elems][tile_bytes].
int nc_qg_repack(int type, const uint8_t* src, int64_t rows, int64_t k, int64_t row_stride, uint8_t* dst,
                 int threads) {
  const Fmt* f = find_fmt(type);
  if (!f) return ERR_TYPE;
  if (k % f->elems) return ERR_SHAPE;
  const int64_t nblk = k / f->elems, tiles = (rows + ROWS - 1) / ROWS;
  const Fmt fm = *f;
  parallel_for(tiles, 16, threads, [&](int64_t t0, int64_t t1) {
    for (int64_t tile = t0; tile < t1; ++tile) {
      if (fm.elems == 1) {  // dense: element i of row r at column block i, slot r
        uint8_t* t = dst + tile * nblk * fm.tile_bytes;
        if (fm.raw_bytes == 4)
          repack_dense_tile<uint32_t>(src, tile * ROWS, rows, k, row_stride, t);
        else
          repack_dense_tile<uint16_t>(src, tile * ROWS, rows, k, row_stride, t);
        continue;
      }
      for (int64_t kb = 0; kb < nblk; ++kb) {
        uint8_t* t = dst + (tile * nblk + kb) * fm.tile_bytes;
        std::memset(t, 0, fm.tile_bytes);
        for (int r = 0; r < ROWS; ++r) {
          const int64_t row = tile * ROWS + r;
          pack_row(fm, row < rows ? src + row * row_stride + kb * fm.raw_bytes : nullptr, r, t);
        }
      }
    }
  });
  return OK;
}

// Rows ids[0..n) of a packed [rows, k] weight as fp32 into out [n, k], equal to gguf's dequantization
// of the raw rows. ERR_RANGE (nothing written) for an id outside [0, rows).
int nc_qg_dequant_rows(int type, const uint8_t* tiles, int64_t rows, int64_t k, const int64_t* ids, int64_t n,
                       float* out) {
  const Fmt* f = find_fmt(type);
  if (!f) return ERR_TYPE;
  if (k % f->elems) return ERR_SHAPE;
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= rows) return ERR_RANGE;
  const int64_t nblk = k / f->elems, tile_stride = nblk * f->tile_bytes;
  for (int64_t i = 0; i < n; ++i)
    dequant_row(*f, tiles + ids[i] / ROWS * tile_stride, nblk, static_cast<int>(ids[i] % ROWS), out + i * k);
  return OK;
}

// x as the kernels see it (float32 [n, k]): x_hat = d * (q or 256 q + q2), in double then rounded.
int nc_qg_dequantized_acts(const float* x, int64_t n, int64_t k, int x2, float* out) {
  if (k % 32) return ERR_SHAPE;
  std::vector<int8_t> q(k), q2(k);
  std::vector<float> d(k / 32), ds(k / 32);
  std::vector<int32_t> s16(k / 16);
  for (int64_t t = 0; t < n; ++t) {
    quantize_row(x + t * k, 0, k, q.data(), x2 ? q2.data() : nullptr, d.data(), s16.data(), ds.data());
    for (int64_t i = 0; i < k; ++i) {
      const int c = x2 ? 256 * q[i] + q2[i] : q[i];
      out[t * k + i] = static_cast<float>(static_cast<double>(c) * d[i / 32]);
    }
  }
  return OK;
}

// y [n, rows] (row stride ldy; float32 or bf16) = x [n, k] (row stride ldx; float32 or bf16) @ W^T + bias.
// x2: two-level activations (quantized types; dense weights take x as it is).
int nc_qg_matmul(int type, const uint8_t* w, int64_t rows, int64_t k, const void* x, int x_bf16, int64_t n,
                 int64_t ldx, void* y, int y_bf16, int64_t ldy, const float* bias, int x2, int threads) {
  const Fmt* f = find_fmt(type);
  if (!f) return ERR_TYPE;
  const bool dense = f->elems == 1;
  if (!dense && (k % f->elems || k % 32)) return ERR_SHAPE;
  if (n <= 0 || rows <= 0) return OK;
  const int64_t nblk = k / f->elems, tiles = (rows + ROWS - 1) / ROWS;
  const int64_t tile_stride = nblk * f->tile_bytes;
#if NC_HAS_AVX2
  const bool gemm = !dense && x2 && ((g_simd == NC_ISA_AVX2 && n >= GEMM_MIN_ROWS_AVX2) ||
                                     (g_simd == NC_ISA_AVX512 && n >= GEMM_MIN_ROWS_AVX512));
  const int gsize = dense && g_simd == NC_ISA_AVX2 ? TMAX_DENSE_AVX2 : gemm ? GEMM_GROUP : TMAX;
#else
  const bool gemm = false;
  const int gsize = TMAX;
#endif
  const int64_t groups = (n + gsize - 1) / gsize, items = tiles * groups;
  const int64_t per_item = tile_stride * std::min<int64_t>(n, gsize);
  const int nt = call_threads(tiles * per_item, threads);
  Acts a{};
  a.k = k;
  if (dense && !x_bf16) {  // read in place
    a.x = static_cast<const float*>(x);
    a.ldx = ldx;
  } else if (dense) {  // bf16 converted once, exactly
    if (static_cast<int64_t>(g_xf.size()) < n * k) g_xf.resize(n * k);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < k; ++i) g_xf[t * k + i] = load_x(static_cast<const uint16_t*>(x) + t * ldx, 1, i);
    a.x = g_xf.data();
    a.ldx = k;
  } else {
    // The V256 kernels' widened passes read the combined codes (a pass has at most n rows).
#if NC_HAS_AVX2
    const bool wide = gemm || (g_simd == NC_ISA_AVX2 && V256::widens(type, n));
#else
    const bool wide = false;
#endif
    g_acts.reserve(n, k, x2, wide);
    quantize_rows(g_acts, x, x_bf16, n, ldx, nt);
    a = g_acts.view();
    if (gemm) a.call = ++g_calls;  // its tiles widened once per thread (tile_gemm)
  }
  const Out o{y, y_bf16, ldy, bias, rows};
  const TileFn fn = pick(type);
  const Fmt fm = *f;
  // Items are (tile, group of gsize rows of x), tile-major: a chunk's tile stays in cache across its groups.
  parallel_for(items, chunk_items(items, per_item, nt), nt, [&](int64_t i0, int64_t i1) {
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t tile = it / groups, t0 = (it % groups) * gsize;
      const int cnt_t = static_cast<int>(std::min<int64_t>(gsize, n - t0));
      const uint8_t* tw = w + tile * tile_stride;
      if (fn)
        fn(tw, nblk, a, t0, cnt_t, o, tile * ROWS);
      else if (dense)
        dense_scalar(fm, tw, nblk, a, t0, cnt_t, o, tile * ROWS);
      else
        tile_scalar(fm, tw, nblk, a, t0, cnt_t, o, tile * ROWS);
    }
  });
  return OK;
}

// y [n, rows] (fp32, row stride ldy) = x [n, k] (fp32, row stride ldx) @ W^T for a block type's weight in
// GGML's own layout (row r's blocks at w + r * row_stride): what nc_qg_matmul gives for it packed.
int nc_qg_matmul_rows(int type, const uint8_t* w, int64_t rows, int64_t k, int64_t row_stride, const float* x,
                      int64_t n, int64_t ldx, float* y, int64_t ldy, int x2, int threads) {
  if (!nc::qg::raw_type(type)) return ERR_TYPE;
  const Fmt* f = find_fmt(type);
  if (k % f->elems || k % 32) return ERR_SHAPE;
  if (n <= 0 || rows <= 0) return OK;
  const int64_t items = (rows + ROWS - 1) / ROWS, per_item = ROWS * (k / f->elems) * f->raw_bytes;
  const int nt = call_threads(items * per_item * std::min<int64_t>(n, TMAX), threads);
  g_acts.reserve(n, k, x2, nc::qg::wide_codes(n));
  quantize_rows(g_acts, x, 0, n, ldx, nt);
  const Acts a = g_acts.view();
  parallel_for(items, chunk_items(items, per_item * std::min<int64_t>(n, TMAX), nt), nt, [&](int64_t i0, int64_t i1) {
    nc::qg::matmul_rows(type, w, row_stride, i0 * ROWS, std::min(rows, i1 * ROWS), a, nullptr, n, y + i0 * ROWS, ldy,
                        std::min(rows, i1 * ROWS));
  });
  return OK;
}

// nc_qg_matmul with its 14 arguments in one int64 array (in order; pointers as integers): ctypes
// converts one pointer argument in ~0.2 us, fourteen in ~3 us, a decode token makes ~120 calls.
int nc_qg_matmul_packed(const int64_t* a) {
  auto ptr = [](int64_t v) { return reinterpret_cast<void*>(static_cast<intptr_t>(v)); };
  return nc_qg_matmul(static_cast<int>(a[0]), static_cast<const uint8_t*>(ptr(a[1])), a[2], a[3], ptr(a[4]),
                      static_cast<int>(a[5]), a[6], a[7], ptr(a[8]), static_cast<int>(a[9]), a[10],
                      static_cast<const float*>(ptr(a[11])), static_cast<int>(a[12]), static_cast<int>(a[13]));
}

}  // extern "C"
