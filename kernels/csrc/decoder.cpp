// One step of a dense decoder stack (Llama, Qwen2/3, SmolLM3, Phi-3, Gemma 3 ...) on the CPU, all layers in one
// call: any ragged batch of decode rows and prefill chunks.
//
// Why: at one token per sequence the matmuls read ~80 MB of quantized weights in ~5 ms, while the
// same step as ~25 torch ops per layer spent as long again in dispatch and small-op overhead
// (rms_norm, RoPE, KV gather, softmax, casts); in prefill the same ops cost ~25% of the step. Each
// layer is
//   x += o_proj(attn(rope(norm_qk(qkv_proj(rms(x))))));  x += down(silu(gate) * up(rms(x)))
// (Gemma 3: GELU-tanh for silu, and an RMSNorm on each of the two terms before it is added)
// with the matmuls on the int8-activation kernels of qgemv.cpp (nc_qg_matmul, same library, same
// thread pool) and everything else in loops over the step's rows. Arithmetic is fp32 in the order
// of the torch path except where noted (FMA in the attention kernels, a polynomial exp), so
// results match it to rounding.
//
// The model is described once by an int64 "plan" (pointers as integers, see the layout below) built
// in Python from the model's own tensors; the KV cache is the engine's paged cache
// [num_blocks, block_size, kv_heads, head_dim] per layer, fp16 (as llama.cpp: half the memory
// traffic of attention; K/V rounded to nearest even when stored, widened to fp32 when read) or
// fp32, written and read in place.
//
// SIMD: the attention and elementwise kernels are written once over a vector of VL floats, 16 lanes in
// AVX-512 builds and 8 in AVX2 and NEON builds (simd.h's NC_ISA; NEON as two 128-bit halves, so its results are
// the AVX2 build's bit for bit), with scalar loops in builds that have neither.
//
// Batch invariance: a row's result depends only on that row (its values, position and cached K/V),
// never on the other rows of the step, their number, or where a prompt's chunks start: every
// reduction runs in an order fixed by the row alone (the matmuls' per row, attention's over fixed key
// parts, the same for a decode row and a prefill chunk), so a sequence's tokens are the same in any
// batch and after a preemption. The module-by-module forward on the CPU uses three pieces of this
// library for the same reason: attention alone (nc_dec_attention), elementwise activations
// (nc_dec_activation) and the Gated DeltaNet recurrence (nc_gdn_recurrent).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "moe.h"
#include "qgemv.h"
#include "simd.h"

namespace {

// Plan layout (int64): header, then L_FIELDS per layer. Weight = (ggml type, packed tiles). The
// qkv and gate_up projections are row segments (type, tiles, rows), each with its own type (GGUF
// quantizers give q, k, v and gate, up different ones), in output order (q | k | v, gate | up, or
// one fused segment); unused segments at the end have rows = 0. L_QKV_BIAS (0 = none) spans all qkv
// segments. H_KV_F16: the caches are fp16 (else fp32). Per layer, so families can mix layer kinds: its RoPE
// table (L_COS, L_SIN: [max_pos, rot_dim / 2], 0 = no RoPE on that layer) and its attention window (L_WINDOW:
// 0 = full, else W: a query at position p sees the keys at positions p - W + 1 .. p), and RMSNorms on the attention
// and MLP outputs before their residual adds (L_ATTN_OUT_NORM, L_MLP_OUT_NORM: 0 = none; Gemma 3). H_ACT: the gated
// MLP's activation (ACT_SILU, ACT_GELU_TANH); H_SCALE_BITS: the attention scale (a double's bits). L_SINKS: the
// layer's attention sinks (fp32 [heads], one logit per query head in the softmax's denominator, gpt-oss), 0 = none.
// L_O_BIAS: the output projection's bias (fp32 [hidden], gpt-oss), 0 = none. L_MOE: 0 for the gated MLP above, else
// the address of the layer's sparse MoE MLP (M_FIELDS int64, below), which replaces it: a router, top-k routing
// and the routed experts where they lie (moe.cpp's nc_moe_forward, the module path's own kernel).
constexpr int SEG_FIELDS = 3, QKV_SEGS = 3, GU_SEGS = 2;
enum Header : int {
  H_LAYERS, H_HIDDEN, H_HEADS, H_KV_HEADS, H_HEAD_DIM, H_INTER, H_ROT_DIM, H_BLOCK_SIZE, H_MAX_POS,
  H_FINAL_NORM, H_EPS_BITS, H_KV_F16, H_ACT, H_SCALE_BITS, H_FIELDS
};
enum Layer : int {
  L_IN_NORM, L_POST_NORM, L_QKV, L_QKV_BIAS = L_QKV + QKV_SEGS * SEG_FIELDS, L_Q_NORM, L_K_NORM, L_O_TYPE,
  L_O_W, L_GU, L_DOWN_TYPE = L_GU + GU_SEGS * SEG_FIELDS, L_DOWN_W, L_K_CACHE, L_V_CACHE, L_COS, L_SIN, L_WINDOW,
  L_ATTN_OUT_NORM, L_MLP_OUT_NORM, L_SINKS, L_O_BIAS, L_MOE, L_FIELDS
};
// A sparse MoE MLP: E experts, k per token; the router (type, tiles: [E, hidden]) and its bias (fp32 [E] or 0);
// M_ROUTING one of ROUTE_*; the experts' gate, up and down projections (addresses of NcMat, moe.h), their
// activation (moe.cpp's ACT_*) with alpha and limit (floats' bits), and their biases (fp32 [E, inter], [E, inter],
// [E, hidden], each 0 = none).
enum Moe : int {
  M_EXPERTS, M_TOP_K, M_ROUTING, M_ROUTER_TYPE, M_ROUTER_W, M_ROUTER_BIAS, M_GATE, M_UP, M_DOWN, M_ACT,
  M_ALPHA_BITS, M_LIMIT_BITS, M_GATE_BIAS, M_UP_BIAS, M_DOWN_BIAS, M_FIELDS
};
// Routing, as models/layers/moe.py's route: softmax over all experts then the top k, their probabilities as the
// weights (ROUTE_SOFTMAX_TOPK); or a softmax over the top k logits (ROUTE_TOPK_SOFTMAX: gpt-oss, and the same
// weights as a softmax over all experts renormalized over the top k).
enum : int { ROUTE_SOFTMAX_TOPK = 0, ROUTE_TOPK_SOFTMAX = 1 };
enum : int { ACT_SILU = 0, ACT_GELU_TANH = 1 };
enum : int { OK = 0, ERR_MATMUL = 3, ERR_POSITION = 4, ERR_BATCH = 5, ERR_MOE = 6 };

template <class T>
T* ptr(int64_t v) {
  return reinterpret_cast<T*>(static_cast<intptr_t>(v));
}

// A plan field holding a double's bits, as a float.
float bits_float(int64_t v) {
  double d;
  std::memcpy(&d, &v, sizeof d);
  return static_cast<float>(d);
}

struct Model {
  int64_t layers, hidden, heads, kv_heads, head_dim, inter, rot_dim, block_size, max_pos;
  const float* final_norm;
  float eps, scale;
  bool kv_f16;
  int act;

  Model() = default;
  explicit Model(const int64_t* p)
      : layers(p[H_LAYERS]), hidden(p[H_HIDDEN]), heads(p[H_HEADS]), kv_heads(p[H_KV_HEADS]),
        head_dim(p[H_HEAD_DIM]), inter(p[H_INTER]), rot_dim(p[H_ROT_DIM]), block_size(p[H_BLOCK_SIZE]),
        max_pos(p[H_MAX_POS]), final_norm(ptr<const float>(p[H_FINAL_NORM])),
        eps(bits_float(p[H_EPS_BITS])), scale(bits_float(p[H_SCALE_BITS])), kv_f16(p[H_KV_F16] != 0),
        act(static_cast<int>(p[H_ACT])) {}
  int64_t q_size() const { return heads * head_dim; }
  int64_t kv_size() const { return kv_heads * head_dim; }
};

// The step's ragged batch: n token rows, sequence t owning rows cu_q[t] .. cu_q[t + 1] (consecutive
// positions, one row for a decode step, a prefill chunk otherwise).
struct Batch {
  int64_t n;
  const int64_t* positions;     // [n]
  const int64_t* slots;         // [n] flat cache slot of each row's K/V
  int64_t seqs;
  const int32_t* cu_q;          // [seqs + 1]
  const int32_t* block_tables;  // [seqs, table_stride]
  int64_t table_stride;
  const int32_t* context_lens;  // [seqs] KV length after this step
};

// ------------------------------------------------------------------ SIMD
// vf: VL fp32 lanes. Loads and stores of uint16_t are fp16 (widened; rounded to nearest even).
#if NC_HAS_AVX512
constexpr int VL = 16;
using vf = __m512;
inline vf vset(float a) { return _mm512_set1_ps(a); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline void vstore(uint16_t* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
inline vf vfnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// The 8 lanes a[l] + a[l + 8]: the first step of vsum (below).
inline __m256 fold8(vf a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
inline float vhmax(vf a) { return _mm512_reduce_max_ps(a); }
// y * 2^n for integral n.
inline vf vscale2(vf y, vf n) { return _mm512_scalef_ps(y, n); }
// Lanes [0, k) (k < VL): their load (zeros above), store, and v with the other lanes zeroed.
inline __mmask16 lanes(int64_t k) { return static_cast<__mmask16>((1u << k) - 1); }
inline vf vload_part(const float* p, int64_t k) { return _mm512_maskz_loadu_ps(lanes(k), p); }
inline void vstore_part(float* p, vf v, int64_t k) { _mm512_mask_storeu_ps(p, lanes(k), v); }
inline vf vkeep(vf v, int64_t k) { return _mm512_maskz_mov_ps(lanes(k), v); }
// a where |x| < t, else b.
inline vf vsmall(vf x, float t, vf a, vf b) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(_mm512_abs_ps(x), vset(t), _CMP_LT_OQ), b, a);
}
#elif NC_HAS_AVX2
constexpr int VL = 8;
using vf = __m256;
inline vf vset(float a) { return _mm256_set1_ps(a); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline void vstore(uint16_t* p, vf v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vfnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline __m256 fold8(vf a) { return a; }
inline float vhmax(vf a) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}
// y * 2^n for integral n in [-126, 127]: no scalef in AVX2, but such a 2^n is a normal float, built
// directly in the exponent field (the products are then the same as scalef's).
inline vf vscale2(vf y, vf n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
inline __m256i lanes(int64_t k) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(k)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf vload_part(const float* p, int64_t k) { return _mm256_maskload_ps(p, lanes(k)); }
inline void vstore_part(float* p, vf v, int64_t k) { _mm256_maskstore_ps(p, lanes(k), v); }
inline vf vkeep(vf v, int64_t k) { return _mm256_and_ps(v, _mm256_castsi256_ps(lanes(k))); }
inline vf vsmall(vf x, float t, vf a, vf b) {
  const vf abs = _mm256_andnot_ps(vset(-0.0f), x);
  return _mm256_blendv_ps(b, a, _mm256_cmp_ps(abs, vset(t), _CMP_LT_OQ));
}
#elif NC_HAS_NEON
// NEON: 8 lanes as two 128-bit halves, the AVX2 build's vector width, so the attention and elementwise
// kernels do the AVX2 build's fp32 operations lane for lane and reduce in its order: the same bits.
constexpr int VL = 8;
struct vf {
  float32x4_t lo, hi;
};
inline vf vset(float a) { return {vdupq_n_f32(a), vdupq_n_f32(a)}; }
inline vf vload(const float* p) { return {vld1q_f32(p), vld1q_f32(p + 4)}; }
inline vf vload(const uint16_t* p) {
  const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(p));
  return {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
}
inline void vstore(float* p, vf v) {
  vst1q_f32(p, v.lo);
  vst1q_f32(p + 4, v.hi);
}
inline void vstore(uint16_t* p, vf v) {  // fcvtn rounds to nearest even (default FPCR), as vcvtps2ph does here
  vst1q_u16(p, vreinterpretq_u16_f16(vcvt_high_f16_f32(vcvt_f16_f32(v.lo), v.hi)));
}
inline vf vadd(vf a, vf b) { return {vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)}; }
inline vf vsub(vf a, vf b) { return {vsubq_f32(a.lo, b.lo), vsubq_f32(a.hi, b.hi)}; }
inline vf vmul(vf a, vf b) { return {vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi)}; }
inline vf vdiv(vf a, vf b) { return {vdivq_f32(a.lo, b.lo), vdivq_f32(a.hi, b.hi)}; }
// x86's minps / maxps (a < b ? a : b, a > b ? a : b), not fmin / fmax: the same result for NaN and signed zeros.
inline vf vmin(vf a, vf b) {
  return {vbslq_f32(vcltq_f32(a.lo, b.lo), a.lo, b.lo), vbslq_f32(vcltq_f32(a.hi, b.hi), a.hi, b.hi)};
}
inline vf vmax(vf a, vf b) {
  return {vbslq_f32(vcgtq_f32(a.lo, b.lo), a.lo, b.lo), vbslq_f32(vcgtq_f32(a.hi, b.hi), a.hi, b.hi)};
}
inline vf vfmadd(vf a, vf b, vf c) { return {vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)}; }
inline vf vfnmadd(vf a, vf b, vf c) { return {vfmsq_f32(c.lo, a.lo, b.lo), vfmsq_f32(c.hi, a.hi, b.hi)}; }
inline vf vround(vf a) { return {vrndnq_f32(a.lo), vrndnq_f32(a.hi)}; }
inline float vhmax(vf a) { return vmaxvq_f32(vmaxq_f32(a.lo, a.hi)); }  // max is exact: any order
inline vf vscale2(vf y, vf n) {  // as the AVX2 build: 2^n built in the exponent field
  auto e = [](float32x4_t m) {
    return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(m), vdupq_n_s32(127)), 23));
  };
  return {vmulq_f32(y.lo, e(n.lo)), vmulq_f32(y.hi, e(n.hi))};
}
inline vf vload_part(const float* p, int64_t k) {
  float buf[VL] = {};
  std::memcpy(buf, p, k * sizeof(float));
  return vload(buf);
}
inline void vstore_part(float* p, vf v, int64_t k) {
  float buf[VL];
  vstore(buf, v);
  std::memcpy(p, buf, k * sizeof(float));
}
inline vf vkeep(vf v, int64_t k) {
  static const int32_t iota[VL] = {0, 1, 2, 3, 4, 5, 6, 7};
  const int32x4_t kk = vdupq_n_s32(static_cast<int32_t>(k));
  return {vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(v.lo), vcltq_s32(vld1q_s32(iota), kk))),
          vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(v.hi), vcltq_s32(vld1q_s32(iota + 4), kk)))};
}
inline vf vsmall(vf x, float t, vf a, vf b) {
  const float32x4_t tv = vdupq_n_f32(t);
  return {vbslq_f32(vcltq_f32(vabsq_f32(x.lo), tv), a.lo, b.lo), vbslq_f32(vcltq_f32(vabsq_f32(x.hi), tv), a.hi, b.hi)};
}
#endif

#if NC_HAS_AVX2
// Horizontal sums in one fixed order: (s0 + s2) + (s1 + s3) of s_l = a_l + a_{l+4}, a the 8 lanes of fold8.
// vsum sums one vector, vsum8 eight at once with a transposing tree of the same additions, so an attention
// score comes out the same whether its key is scored alone (decode) or beside others (prefill).
inline float vsum(vf v) {
  const __m256 a = fold8(v);
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));   // s0 + s2, s1 + s3
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// out[c] = vsum(v[c]) for c < 8.
__attribute__((always_inline)) inline void vsum8(const vf v[8], float* out) {
  __m256 s[4];
  for (int c = 0; c < 4; ++c) {   // s of v[c] in the low half, of v[c + 4] in the high half
    const __m256 x = fold8(v[c]), y = fold8(v[c + 4]);
    s[c] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
  }
  // per half: s0 + s2, s1 + s3 of two vectors, interleaved (vectors c, c + 1 | c + 4, c + 5)
  const __m256 t01 = _mm256_add_ps(_mm256_unpacklo_ps(s[0], s[1]), _mm256_unpackhi_ps(s[0], s[1]));
  const __m256 t23 = _mm256_add_ps(_mm256_unpacklo_ps(s[2], s[3]), _mm256_unpackhi_ps(s[2], s[3]));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_shuffle_ps(t01, t23, 0x44), _mm256_shuffle_ps(t01, t23, 0xee)));
}
#elif NC_HAS_NEON
// The AVX2 build's order: s = lo + hi, then (s0 + s2) + (s1 + s3).
inline float32x2_t vsum_pairs(vf v) {  // s0 + s2, s1 + s3
  const float32x4_t s = vaddq_f32(v.lo, v.hi);
  return vadd_f32(vget_low_f32(s), vget_high_f32(s));
}
inline float vsum(vf v) { return vpadds_f32(vsum_pairs(v)); }
__attribute__((always_inline)) inline void vsum8(const vf v[8], float* out) {
  for (int c = 0; c < 8; c += 4) {
    const float32x4_t a = vcombine_f32(vsum_pairs(v[c]), vsum_pairs(v[c + 1]));
    const float32x4_t b = vcombine_f32(vsum_pairs(v[c + 2]), vsum_pairs(v[c + 3]));
    vst1q_f32(out + c, vpaddq_f32(a, b));
  }
}
#endif

using nc::f16_to_f32;
using nc::f32_to_f16;

inline float widen(float v) { return v; }
inline float widen(uint16_t h) { return f16_to_f32(h); }

// A KV cache row of n values as fp32: the row itself (fp32 cache), or widened into buf (fp16).
inline const float* as_f32(const float* row, int64_t, float*) { return row; }
inline const float* as_f32(const uint16_t* row, int64_t n, float* buf) {
  int64_t i = 0;
#if NC_HAS_SIMD
  for (; i < n / VL * VL; i += VL) vstore(buf + i, vload(row + i));  // (i + VL <= n: a false g++ 12 warning)
#endif
  for (; i < n; ++i) buf[i] = f16_to_f32(row[i]);
  return buf;
}

// dst = a KV cache row of n values as fp32.
template <class T>
inline void widen_into(const T* row, int64_t n, float* dst) {
  const float* w = as_f32(row, n, dst);
  if (w != dst) std::memcpy(dst, w, n * sizeof(float));
}

// dst = src in the cache's type.
inline void store_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(uint16_t* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if NC_HAS_SIMD
  for (; i + VL <= n; i += VL) vstore(dst + i, vload(src + i));
#endif
  for (; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}

// ------------------------------------------------------------------ elementwise
// Sum of a[i] * b[i] in 16 independent fp32 lanes (vectorizes without reassociation flags). The tail
// starts at n16 rather than where the main loop stopped: g++ 12 warns falsely otherwise
// (-Waggressive-loop-optimizations) where n is a constant.
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[16] = {};
  const int64_t n16 = n / 16 * 16;
  for (int64_t i = 0; i < n16; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (int64_t i = n16; i < n; ++i) s += a[i] * b[i];
  for (int j = 0; j < 16; ++j) s += acc[j];
  return s;
}

// a . b over one head of D dims (D = 0: d, known at run time), b in a KV cache row: FMA in VL lanes with one
// horizontal sum per dot where D allows, else the scalar loop (fp16 widened into buf, d floats).
template <int D, class T>
inline float head_dot(const float* a, const T* b, int64_t d, float* buf) {
#if NC_HAS_SIMD
  if constexpr (D > 0 && D % VL == 0) {
    vf acc = vmul(vload(a), vload(b));
    for (int c = 1; c < D / VL; ++c) acc = vfmadd(vload(a + VL * c), vload(b + VL * c), acc);
    return vsum(acc);
  }
#endif
  return dot(a, as_f32(b, d, buf), d);
}

// s[c] = head_dot(q, k + c * d) for the 8 fp32 key rows from k: the same lanes and sums.
template <int D>
__attribute__((always_inline)) inline void head_dots8(const float* q, const float* k, int64_t d, float* s) {
#if NC_HAS_SIMD
  if constexpr (D > 0 && D % VL == 0) {
    vf acc[8];
    const vf q0 = vload(q);
    for (int c = 0; c < 8; ++c) acc[c] = vmul(q0, vload(k + c * D));
#pragma GCC unroll 16
    for (int e = 1; e < D / VL; ++e) {
      const vf qe = vload(q + VL * e);
      for (int c = 0; c < 8; ++c) acc[c] = vfmadd(qe, vload(k + c * D + VL * e), acc[c]);
    }
    vsum8(acc, s);
    return;
  }
#endif
  for (int c = 0; c < 8; ++c) s[c] = dot(q, k + c * d, d);
}

// out = x * rsqrt(mean(x^2) + eps) * w (out may alias x).
void rms_norm(const float* x, const float* w, int64_t n, float eps, float* out) {
  const float ss = dot(x, x, n);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

// NeoX (rotate-half) RoPE of one head's first rot_dim dims, in place.
void rope(float* h, const float* cos, const float* sin, int64_t rot_dim) {
  const int64_t half = rot_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = h[i], x2 = h[i + half];
    h[i] = x1 * cos[i] - x2 * sin[i];
    h[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

// Per-token work before attention: q/k head norms, RoPE, K/V written to their cache slots (T: the
// caches' element type, float or fp16 bits).
template <class T>
void prepare_qkv(const Model& m, const int64_t* L, const Batch& b, float* qkv) {
  const int64_t width = m.q_size() + 2 * m.kv_size();
  const float* q_norm = ptr<const float>(L[L_Q_NORM]);
  const float* k_norm = ptr<const float>(L[L_K_NORM]);
  T* k_cache = ptr<T>(L[L_K_CACHE]);
  T* v_cache = ptr<T>(L[L_V_CACHE]);
  const float* cos = ptr<const float>(L[L_COS]);
  const float* sin = ptr<const float>(L[L_SIN]);
  for (int64_t t = 0; t < b.n; ++t) {
    float* row = qkv + t * width;
    for (int64_t h = 0; h < m.heads + m.kv_heads; ++h) {  // q heads then k heads: adjacent in the row
      float* head = row + h * m.head_dim;
      const float* nw = h < m.heads ? q_norm : k_norm;
      if (nw) rms_norm(head, nw, m.head_dim, m.eps, head);
      if (cos) rope(head, cos + b.positions[t] * (m.rot_dim / 2), sin + b.positions[t] * (m.rot_dim / 2), m.rot_dim);
    }
    const int64_t slot = b.slots[t];
    store_row(k_cache + slot * m.kv_size(), row + m.q_size(), m.kv_size());
    store_row(v_cache + slot * m.kv_size(), row + m.q_size() + m.kv_size(), m.kv_size());
  }
}

// exp over an array (attention probabilities, SiLU): exp(x) = 2^n e^r with n = round(x / ln 2),
// r = x - n ln 2 (ln 2 in two parts), e^r by Cephes' degree-6 polynomial: within 2 ulp of std::exp
// for x in [-87, 88]. std::exp in builds without SIMD.
#if NC_HAS_SIMD
inline vf vexp(vf x) {
  x = vmin(vmax(x, vset(-87.3f)), vset(88.3f));   // so n is in [-126, 127]
  const vf n = vround(vmul(x, vset(1.44269504088896341f)));
  vf r = vfnmadd(n, vset(0.693359375f), x);
  r = vfnmadd(n, vset(-2.12194440e-4f), r);
  vf p = vset(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = vfmadd(p, r, vset(c));
  const vf y = vadd(vfmadd(vmul(p, r), r, r), vset(1.0f));
  return vscale2(y, n);
}
#endif

// The largest of s[0 .. n), n >= 1 (std::max_element is a scalar loop).
float max_of(const float* s, int64_t n) {
  int64_t i = 0;
  float mx = s[0];
#if NC_HAS_SIMD
  if (n >= VL) {
    vf acc = vload(s);
    for (i = VL; i + VL <= n; i += VL) acc = vmax(acc, vload(s + i));
    mx = vhmax(acc);
  }
#endif
  for (; i < n; ++i) mx = std::max(mx, s[i]);
  return mx;
}

// s[i] = exp(s[i] - shift); returns the sum.
float exp_shifted(float* s, int64_t n, float shift) {
  int64_t i = 0;
  float sum = 0.f;
#if NC_HAS_SIMD
  vf acc = vset(0.f);
  const vf sh = vset(shift);
  for (; i + VL <= n; i += VL) {
    const vf e = vexp(vsub(vload(s + i), sh));
    vstore(s + i, e);
    acc = vadd(acc, e);
  }
  if (i < n) {
    const vf e = vexp(vsub(vload_part(s + i, n - i), sh));
    vstore_part(s + i, e, n - i);
    acc = vadd(acc, vkeep(e, n - i));
    i = n;
  }
  sum = vsum(acc);
#endif
  for (; i < n; ++i) sum += (s[i] = std::exp(s[i] - shift));
  return sum;
}

// out[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u.
void silu_mul(const float* g, const float* u, int64_t n, float* out) {
  int64_t i = 0;
#if NC_HAS_SIMD
  const vf one = vset(1.0f);
  for (; i + VL <= n; i += VL) {
    const vf x = vload(g + i);
    const vf e = vexp(vsub(vset(0.f), x));
    vstore(out + i, vmul(vdiv(x, vadd(one, e)), vload(u + i)));
  }
#endif
  for (; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

// One row of nc_dec_activation: every element through the same code (vexp, with the row's last < VL values
// as a masked vector; std::exp / std::tanh in builds without SIMD; softplus in scalar code, log1p having no
// vector form here). GELU-tanh as x * sigmoid(2 y), y = sqrt(2 / pi) (x + 0.044715 x^3), which is
// 0.5 x (1 + tanh(y)) exactly; tanh as Cephes' tanhf: an odd polynomial below |x| 0.625 (where 1 - 2 / (1 + e^2x)
// would lose the small values' digits), else that (exp clamped, so +-1 at the ends).
void activation_row(int op, const float* x, const float* u, int64_t n, float* out) {
  if (op == 2) {
    for (int64_t i = 0; i < n; ++i) {
      const float v = x[i] > 20.0f ? x[i] : std::log1p(std::exp(x[i]));
      out[i] = u ? v * u[i] : v;
    }
    return;
  }
  int64_t i = 0;
#if NC_HAS_SIMD
  const vf one = vset(1.0f);
  auto f = [&](vf v) {
    if (op == 3) return vexp(v);
    if (op == 5) {
      const vf z = vmul(v, v);
      vf p = vset(-5.70498872745e-3f);
      for (const float c : {2.06390887954e-2f, -5.37397155531e-2f, 1.33314422036e-1f, -3.33332819422e-1f})
        p = vfmadd(p, z, vset(c));
      return vsmall(v, 0.625f, vfmadd(vmul(p, z), v, v), vsub(one, vdiv(vset(2.0f), vadd(one, vexp(vadd(v, v))))));
    }
    if (op == 4) {   // e = exp(-2 y)
      const vf y2 = vmul(vmul(v, vset(-1.5957691216057308f)), vfmadd(vmul(v, v), vset(0.044715f), one));
      return vdiv(v, vadd(one, vexp(y2)));
    }
    const vf e = vexp(vsub(vset(0.f), v));
    return op == 0 ? vdiv(v, vadd(one, e)) : vdiv(one, vadd(one, e));
  };
  for (; i + VL <= n; i += VL) vstore(out + i, u ? vmul(f(vload(x + i)), vload(u + i)) : f(vload(x + i)));
  if (i < n) {
    const vf v = f(vload_part(x + i, n - i));
    vstore_part(out + i, u ? vmul(v, vload_part(u + i, n - i)) : v, n - i);
  }
#else
  for (; i < n; ++i) {
    float v;
    if (op == 4)
      v = 0.5f * x[i] * (1.0f + std::tanh(0.7978845608028654f * x[i] * (1.0f + 0.044715f * x[i] * x[i])));
    else if (op == 5)
      v = std::tanh(x[i]);
    else {
      v = std::exp(op == 3 ? x[i] : -x[i]);
      if (op != 3) v = op == 0 ? x[i] / (1.0f + v) : 1.0f / (1.0f + v);
    }
    out[i] = u ? v * u[i] : v;
  }
#endif
}

// ------------------------------------------------------------------ attention
// A query vector's output (one row, one head) depends only on that query, its position and the cached
// K/V: never on the other rows of the step, on where its chunk starts, or on how the work is split over
// threads, so a sequence's tokens are the same in any batch, with any chunk boundaries, after a
// preemption. Decode rows and prefill chunks run different loops over the same arithmetic:
// - the keys in fixed parts of PART positions ([0, PART), [PART, 2 PART), ...); per part the scores
//   (head_dot: FMA in VL lanes over the head's dims, vsum's tree; head_dots8 gives the same sums), their
//   max m, l = sum exp(score - m) (exp_shifted) and o = sum exp(score - m) v (one FMA chain per output
//   dim, in key order);
// - the parts merged in order: sum exp(m - M) o / sum exp(m - M) l, M their largest m (merge_part).
// Work items for the pool:
// - PART: whole parts of one query row's keys, all its query heads, reading the cache where it lies. The rows
//   that go this way: a one-row sequence (a decode row, or a chunk of one token) and each row of a short chunk
//   (up to SHORT_ROWS: speculative verification), whose keys end at its own position. With fewer rows than
//   threads a long context is several items ("split-K" as in flash-decoding) that the threads share.
// - SHARED: the parts that every row of a short chunk sees whole (all but its last part or two, and a window's
//   partial first part): each key and value row widened once for all the rows' query heads, the scores 8 keys
//   at a time, each value row loaded once per pass for up to PV query vectors of any of the rows. Each query
//   vector's part sums are those a PART item gives it.
// - WIDEN: the keys of a longer several-row sequence (a prefill chunk) for one KV head, as fp32 rows, once
//   for all its row blocks.
// - ROWS: up to ROW_BLOCK rows of a several-row sequence x one KV head: the scores of all their query
//   heads, 8 keys at a time, then per part a causal softmax and the weighted values, each value row
//   loaded once per pass for several query vectors.
// The kernels over cached K/V are templates on the caches' element type T (float or fp16 bits).
// A sliding window (first_key) keeps the same fixed parts: the part holding a row's first key is summed from
// that key, the parts before it are skipped (never read), so a windowed row costs O(window), and decode and
// prefill still sum the same keys in the same order. In a block of prefill rows, the keys before a row's
// window get weight 0, as those past its last key do.
constexpr int64_t ROW_BLOCK = 16, PART = 128;
// Chunks of up to this many rows attend row by row (PART items): widening a long context's keys to fp32 for a
// few rows read and wrote the cache twice over, and their KV heads were too few items to share out.
constexpr int64_t SHORT_ROWS = 8;

enum class Work { PART, SHARED, WIDEN, ROWS };

// A query row attended part by part: its sequence, its batch row, the keys it sees (its position + 1) and
// where its first part starts (the part holding its window's first key).
struct OneRow {
  int64_t seq, row, keys, start;
};

struct Item {
  int64_t seq;      // PART: the OneRow; SHARED: the first of its OneRows; WIDEN, ROWS: the sequence
  int64_t lo, hi;   // PART, SHARED: keys [lo, hi) (whole parts but PART's last); ROWS: batch rows [lo, hi)
  int64_t index;    // PART: the first part's index in ml / o; SHARED: the OneRow after its last; WIDEN, ROWS:
                    // the KV head
  Work work;
};

struct AttnJob {
  const Model* m;
  const Batch* b;
  const float* qkv;                 // row r's query heads at qkv + r * ldq
  int64_t ldq;
  const void* k_cache;              // float or fp16 bits, as m->kv_f16 says
  const void* v_cache;
  float* out;                       // [n, heads * head_dim]
  float scale;
  int64_t window;                   // 0: full attention, else the window W (keys p - W + 1 .. p)
  const float* sinks;               // [heads]: a logit per query head in the denominator only, or null
  std::vector<Item> items;
  std::vector<Item> part_items;     // attention()'s PART items, queued after its SHARED ones (larger: the pool
                                    // hands items out in order)
  std::vector<OneRow> one_rows;     // the rows attended part by part
  std::vector<int64_t> first_part;  // [one_rows + 1]: parts of one_rows[i] (its part at key p: part_index)
  std::vector<float> ml;            // [parts, heads, 2]: m, l
  std::vector<float> o;             // [parts, heads, head_dim]
  // Several-row sequences: their keys' cache slots and fp32 keys [kv_heads][context][head_dim].
  std::vector<int64_t> slots, slots_at, keys_at;
  std::vector<float> keys;

  float* key_rows(int64_t t, int64_t g) { return &keys[keys_at[t] + g * b->context_lens[t] * m->head_dim]; }
  // Where one_rows[i]'s part holding key p keeps its (m, l) and output in ml / o.
  int64_t part_index(int64_t i, int64_t p) const { return first_part[i] + (p - one_rows[i].start) / PART; }

  void bind(const Model& model, const Batch& batch, const float* q, int64_t q_stride, float q_scale, const void* kc,
            const void* vc, float* dst, int64_t win, const float* sink_logits) {
    m = &model;
    b = &batch;
    qkv = q;
    ldq = q_stride;
    k_cache = kc;
    v_cache = vc;
    out = dst;
    scale = q_scale;
    window = win;
    sinks = sink_logits;
  }
  // Where a query vector of head h starts its merge: the largest m of its parts is at least its sink, and
  // the sum of exp(m - top) l starts from exp(sink - top) (the sink's term, which has no value). Decode and
  // prefill both start this way, so they add the same terms in the same order.
  float top_start(int64_t h) const { return sinks ? sinks[h] : -INFINITY; }
  float l_start(int64_t h, float top) const { return sinks ? std::exp(sinks[h] - top) : 0.f; }
  // The first key position a query at position p sees.
  int64_t first_key(int64_t p) const { return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0; }
  // Flat cache slot of key position p of sequence t.
  int64_t slot(int64_t t, int64_t p) const {
    const int64_t bs = m->block_size;
    return static_cast<int64_t>(b->block_tables[t * b->table_stride + p / bs]) * bs + p % bs;
  }
  // Into out: where the cached rows of keys [p0, p1) of sequence t start (element offsets), a block at a time.
  const std::vector<int64_t>& part_slots(int64_t t, int64_t p0, int64_t p1, std::vector<int64_t>& out) const {
    const int64_t bs = m->block_size, kv = m->kv_size();
    out.resize(p1 - p0);
    for (int64_t p = p0; p < p1;) {
      const int64_t end = std::min(p1, (p / bs + 1) * bs), base = slot(t, p) - p;
      for (; p < end; ++p) out[p - p0] = (base + p) * kv;
    }
    return out;
  }
};

// A pool thread's buffers: scores, one cached row widened to fp32, a chunk of value rows widened, and
// for a block of rows per query vector its parts' (m, l), merged sum of l, largest m, a part's output and
// where the query is.
struct Local {
  std::vector<float> scores, row, vals, ml, l_sum, top, o, keys;
  std::vector<int64_t> slots;
  std::vector<const float*> queries;
};

// One part of a query vector's merge: dst (+)= exp(m - top) o, l_sum += exp(m - top) l. dst starts at 0,
// l_sum at the sink's term (AttnJob::l_start); merge_end divides by l_sum.
inline void merge_part(float* dst, float& l_sum, float top, float m, float l, const float* o, int64_t d) {
  const float w = std::exp(m - top);
  l_sum += w * l;
  for (int64_t e = 0; e < d; ++e) dst[e] += w * o[e];
}

inline void merge_end(float* dst, float l_sum, int64_t d) {
  const float inv = 1.0f / l_sum;
  for (int64_t e = 0; e < d; ++e) dst[e] *= inv;
}

// The parts of each row attended part by part, merged into its output row.
void merge_parts(AttnJob& j) {
  const Model& m = *j.m;
  const int64_t H = m.heads, d = m.head_dim;
  for (int64_t i = 0; i < static_cast<int64_t>(j.one_rows.size()); ++i) {
    for (int64_t h = 0; h < H; ++h) {
      float top = j.top_start(h);
      for (int64_t part = j.first_part[i]; part < j.first_part[i + 1]; ++part)
        top = std::max(top, j.ml[(part * H + h) * 2]);
      float l_sum = j.l_start(h, top);
      float* dst = j.out + j.one_rows[i].row * m.q_size() + h * d;
      std::fill(dst, dst + d, 0.f);
      for (int64_t part = j.first_part[i]; part < j.first_part[i + 1]; ++part)
        merge_part(dst, l_sum, top, j.ml[(part * H + h) * 2], j.ml[(part * H + h) * 2 + 1], &j.o[(part * H + h) * d],
                   d);
      merge_end(dst, l_sum, d);
    }
  }
}

#if NC_HAS_SIMD
// Columns (of VL floats) of the output that weighted_values<D, NV> accumulates per pass over the
// keys: NV x cols accumulators, at most 16 of AVX-512's 32 registers (one pass for the sizes used);
// on AVX2 as many as fit its 16 beside the cols values and one broadcast weight (12 for NV = 6).
template <int D, int NV>
constexpr int pass_cols() {
  int c = std::min(D / VL, VL == 16 ? 16 / NV : std::max(1, 15 / (NV + 1)));
  while ((D / VL) % c) --c;
  return c;
}
#endif

// Query vectors per pass over a block's values (weighted_values' NV): each value row loaded once per
// pass serves them all. AVX2: 6 x 2 vectors of accumulators, 12 independent FMA chains (its 2 FMA units
// x 4 cycles of latency need 8) in 15 of its 16 registers; NEON's 8-lane vectors take 2 of its 32 each, alike.
template <int D>
constexpr int values_per_pass() { return NC_HAS_AVX2 && !NC_HAS_AVX512 ? 6 : NC_HAS_NEON ? 6 : D > 64 ? 2 : 4; }

// out[v][e] (+)= sum_p w[v][p] * row(p)[e] for NV query vectors over the same n keys, whose values are rows
// of d (fp32, or fp16 bits widened as they are loaded): each value row is loaded once per pass for all NV.
// accumulate: add to what out holds (the sums over the keys before these), in the same order as one pass over
// all. Per output dim one FMA chain from 0 in key order.
template <int D, int NV, class Row>
void weighted_values(const float* const* w, int64_t n, Row row, int64_t d, bool accumulate, float* const* out) {
#if NC_HAS_SIMD
  if constexpr (D > 0 && D % VL == 0) {
    constexpr int CW = pass_cols<D, NV>();
    for (int c0 = 0; c0 < D / VL; c0 += CW) {
      vf acc[NV][CW];
      for (int u = 0; u < NV; ++u)
        for (int c = 0; c < CW; ++c) acc[u][c] = accumulate ? vload(out[u] + VL * (c0 + c)) : vset(0.f);
      for (int64_t p = 0; p < n; ++p) {
        const auto* r = row(p) + c0 * VL;
        vf v[CW];
        for (int c = 0; c < CW; ++c) v[c] = vload(r + VL * c);
        for (int u = 0; u < NV; ++u) {
          const vf wp = vset(w[u][p]);
          for (int c = 0; c < CW; ++c) acc[u][c] = vfmadd(wp, v[c], acc[u][c]);
        }
      }
      for (int u = 0; u < NV; ++u)
        for (int c = 0; c < CW; ++c) vstore(out[u] + VL * (c0 + c), acc[u][c]);
    }
    return;
  }
#endif
  for (int u = 0; u < NV; ++u) {
    if (!accumulate) std::fill(out[u], out[u] + d, 0.f);
    for (int64_t p = 0; p < n; ++p) {
      const auto* r = row(p);
      for (int64_t e = 0; e < d; ++e) out[u][e] += w[u][p] * widen(r[e]);
    }
  }
}

// weighted_values for nv <= PV query vectors.
template <int D, int PV, class Row>
void weighted_values_n(int64_t nv, const float* const* w, int64_t n, Row row, int64_t d, bool accumulate,
                       float* const* out) {
  switch (nv) {
    case 6: if constexpr (PV >= 6) weighted_values<D, 6>(w, n, row, d, accumulate, out); break;
    case 5: if constexpr (PV >= 5) weighted_values<D, 5>(w, n, row, d, accumulate, out); break;
    case 4: if constexpr (PV >= 4) weighted_values<D, 4>(w, n, row, d, accumulate, out); break;
    case 3: if constexpr (PV >= 3) weighted_values<D, 3>(w, n, row, d, accumulate, out); break;
    case 2: weighted_values<D, 2>(w, n, row, d, accumulate, out); break;
    default: weighted_values<D, 1>(w, n, row, d, accumulate, out);
  }
}

// Scores, exp and weighted values of the keys [p0, p1) of one part of query row qr, for all its query
// heads, into part `index` of ml / o. The scores read a whole cached key row (all KV heads) at a time, in
// order: a part's K from memory streams best so (decode's case). The values go in blocks of VBLOCK keys, each
// KV head's query heads sharing every load of a value row (weighted_values), the sums in registers: one FMA
// chain per output dim in key order, as attend_rows makes them. D: the head dimension as in attend_rows. Not
// inlined: inside the pool's loop with attend_rows its loops ran ~15% slower (decode at 2,000 keys, AVX2).
template <int D, class T>
__attribute__((noinline)) void attend_part(AttnJob& j, const OneRow& qr, int64_t p0, int64_t p1, int64_t index,
                                           Local& local) {
  const Model& m = *j.m;
  const int64_t heads = m.heads, group = m.heads / m.kv_heads, d = D ? D : m.head_dim;
  const int64_t len = p1 - p0;
  const float* q = j.qkv + qr.row * j.ldq;
  const T* k_cache = static_cast<const T*>(j.k_cache);
  const T* v_cache = static_cast<const T*>(j.v_cache);
  std::vector<float>& scores = local.scores;
  scores.resize(heads * len);
  local.row.resize(d);
  const std::vector<int64_t>& slots = j.part_slots(qr.seq, p0, p1, local.slots);
  float* const sc = scores.data();
  for (int64_t i = 0; i < len; ++i) {
    const T* krow = k_cache + slots[i];
    for (int64_t g = 0, h = 0; g < m.kv_heads; ++g)
      for (int64_t u = 0; u < group; ++u, ++h)
        sc[h * len + i] = head_dot<D>(q + h * d, krow + g * d, d, local.row.data()) * j.scale;
  }
  float* ml = &j.ml[(index * heads) * 2];
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores.data() + h * len;
    ml[2 * h] = max_of(s, len);
    ml[2 * h + 1] = exp_shifted(s, len, ml[2 * h]);
  }
  float* o = &j.o[index * heads * d];
  constexpr int PV = values_per_pass<D>();
  constexpr int64_t VBLOCK = 32;
  for (int64_t i0 = 0; i0 < len; i0 += VBLOCK) {
    const int64_t n = std::min(VBLOCK, len - i0);
    for (int64_t g = 0; g < m.kv_heads; ++g) {
      const T* vg = v_cache + g * d;
      for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += PV) {
        const int64_t nv = std::min<int64_t>(PV, (g + 1) * group - h0);
        const float* w[PV];
        float* out[PV];
        for (int64_t u = 0; u < nv; ++u) {
          w[u] = sc + (h0 + u) * len + i0;
          out[u] = o + (h0 + u) * d;
        }
        weighted_values_n<D, PV>(nv, w, n, [&](int64_t i) { return vg + slots[i0 + i]; }, d, i0 > 0, out);
      }
    }
  }
}

// attend_part for one part [p0, p1) that one_rows [i0, i1) (a short chunk's rows) all see whole: per KV head the
// part's keys widened once (local.keys) and its query vectors' scores by head_dots8 (head_dot's sums, 8 keys at a
// time), their (m, l) as attend_part's, and per block of VBLOCK keys the value rows widened once (local.vals) for
// passes of PV query vectors from any of the rows: the same FMA chains as attend_part's.
template <int D, class T>
__attribute__((noinline)) void attend_part_rows(AttnJob& j, int64_t i0, int64_t i1, int64_t p0, int64_t p1,
                                                Local& local) {
  const Model& m = *j.m;
  const int64_t heads = m.heads, kvh = m.kv_heads, group = heads / kvh, d = D ? D : m.head_dim;
  const int64_t len = p1 - p0, kv = m.kv_size(), rows = i1 - i0;
  const T* k_cache = static_cast<const T*>(j.k_cache);
  const T* v_cache = static_cast<const T*>(j.v_cache);
  const std::vector<int64_t>& slots = j.part_slots(j.one_rows[i0].seq, p0, p1, local.slots);
  // Per KV head, its keys as fp32 rows (in L1 or L2 for every query vector of its group), then their scores.
  local.keys.resize(len * d);
  float* const kb = local.keys.data();
  local.scores.resize(rows * heads * len);
  float* const sc = local.scores.data();
  const int64_t len8 = len / 8 * 8;
  for (int64_t g = 0; g < kvh; ++g) {
    for (int64_t i = 0; i < len; ++i) widen_into(k_cache + slots[i] + g * d, d, kb + i * d);
    for (int64_t r = 0; r < rows; ++r) {
      const float* q = j.qkv + j.one_rows[i0 + r].row * j.ldq;
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        float* s = sc + (r * heads + h) * len;
        for (int64_t i = 0; i < len8; i += 8) head_dots8<D>(q + h * d, kb + i * d, d, s + i);
        for (int64_t i = len8; i < len; ++i) s[i] = head_dot<D>(q + h * d, kb + i * d, d, nullptr);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* ml = &j.ml[j.part_index(i0 + r, p0) * heads * 2];
    for (int64_t h = 0; h < heads; ++h) {
      float* s = sc + (r * heads + h) * len;
      for (int64_t i = 0; i < len; ++i) s[i] *= j.scale;
      ml[2 * h] = max_of(s, len);
      ml[2 * h + 1] = exp_shifted(s, len, ml[2 * h]);
    }
  }
  constexpr int PV = values_per_pass<D>();
  constexpr int64_t VBLOCK = 32;
  local.vals.resize(VBLOCK * kv);
  float* const vb = local.vals.data();
  for (int64_t b0 = 0; b0 < len; b0 += VBLOCK) {
    const int64_t n = std::min(VBLOCK, len - b0);
    for (int64_t i = 0; i < n; ++i) widen_into(v_cache + slots[b0 + i], kv, vb + i * kv);
    for (int64_t g = 0; g < kvh; ++g) {
      // The group's query vectors of every row, (row, head) in order, PV per pass.
      const int64_t nq = rows * group;
      for (int64_t q0 = 0; q0 < nq; q0 += PV) {
        const int64_t nv = std::min<int64_t>(PV, nq - q0);
        const float* w[PV];
        float* out[PV];
        for (int64_t u = 0; u < nv; ++u) {
          const int64_t r = (q0 + u) / group, h = g * group + (q0 + u) % group;
          w[u] = sc + (r * heads + h) * len + b0;
          out[u] = &j.o[(j.part_index(i0 + r, p0) * heads + h) * d];
        }
        weighted_values_n<D, PV>(nv, w, n, [&](int64_t i) { return vb + i * kv + g * d; }, d, b0 > 0, out);
      }
    }
  }
}

// Keys of several-row sequence t, KV head g, as fp32 rows: key_rows(t, g)[p * d + e] = K[p][g][e].
template <class T>
void widen_keys(AttnJob& j, int64_t t, int64_t g) {
  const int64_t d = j.m->head_dim, kv = j.m->kv_size();
  const int64_t* slots = &j.slots[j.slots_at[t]];
  const T* k_cache = static_cast<const T*>(j.k_cache);
  float* dst = j.key_rows(t, g);
  for (int64_t p = j.first_key(j.b->positions[j.b->cu_q[t]]) / 8 * 8; p < j.b->context_lens[t]; ++p)
    widen_into(k_cache + slots[p] * kv + g * d, d, dst + p * d);
}

// Causal attention of batch rows [lo, hi) (consecutive positions of one sequence) for the query
// heads of KV head g. D: the head dimension (a constant for the common sizes, so the inner loops
// have fixed trip counts; 0 = read it from the model).
template <int D, class T>
void attend_rows(AttnJob& j, const Item& it, Local& local) {
  const Model& m = *j.m;
  const int64_t d = D ? D : m.head_dim, group = m.heads / m.kv_heads, g = it.index, kv = m.kv_size();
  const int64_t nq = (it.hi - it.lo) * group;             // query vectors: (row, head of the group)
  const int64_t keys = j.b->positions[it.hi - 1] + 1;     // the last row sees the most keys
  const int64_t parts = (keys + PART - 1) / PART;
  const int64_t* slots = &j.slots[j.slots_at[it.seq]];
  const float* krows = j.key_rows(it.seq, g);
  auto seen = [&](int64_t i) { return j.b->positions[it.lo + i / group] + 1; };
  auto from = [&](int64_t i) { return j.first_key(j.b->positions[it.lo + i / group]); };
  auto out_row = [&](int64_t i) { return j.out + (it.lo + i / group) * m.q_size() + (g * group + i % group) * d; };
  // The first row's window start bounds every row's (8-aligned: scored 8 keys at a time, widened from there).
  const int64_t k_first = from(0) / 8 * 8;
  std::vector<float>& scores = local.scores;
  scores.resize(nq * keys);
  local.ml.resize(nq * parts * 2);
  local.l_sum.resize(nq);
  local.top.resize(nq);
  for (int64_t i = 0; i < nq; ++i) local.top[i] = j.top_start(g * group + i % group);
  std::vector<const float*>& query = local.queries;
  query.resize(nq);
  for (int64_t i = 0; i < nq; ++i) query[i] = j.qkv + (it.lo + i / group) * j.ldq + (g * group + i % group) * d;
  // The scores per 64 keys (16 KB of fp32 keys for d = 64, in L1 beside the block's queries), 8 at a time.
  const int64_t keys8 = keys / 8 * 8;
  float* const sc = scores.data();
  for (int64_t k0 = k_first; k0 < keys8; k0 += 64) {
    const int64_t k1 = std::min(keys8, k0 + 64);
    for (int64_t i = 0; i < nq; ++i) {
      const float* q = query[i];
      float* s = sc + i * keys;
      for (int64_t p = k0; p < k1; p += 8) head_dots8<D>(q, krows + p * d, d, s + p);
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    float* s = &scores[i * keys];
    for (int64_t p = keys8; p < keys; ++p) s[p] = head_dot<D>(query[i], krows + p * d, d, nullptr);
    for (int64_t p = k_first; p < keys; ++p) s[p] *= j.scale;
    // Causal softmax per part. A row's weights outside its window (past its own last key, before its first)
    // are zero, so every query vector of the block (all its rows and heads) can share the passes over the
    // values: the zero terms add +0 to sums of positive weights, which leaves them as they were.
    const int64_t n = seen(i), f = from(i);
    for (int64_t a = f / PART * PART; a < n; a += PART) {
      const int64_t lo = std::max(a, f), hi = std::min(a + PART, n);
      float* ml = &local.ml[(i * parts + a / PART) * 2];
      ml[0] = max_of(s + lo, hi - lo);
      ml[1] = exp_shifted(s + lo, hi - lo, ml[0]);
      local.top[i] = std::max(local.top[i], ml[0]);
    }
    local.l_sum[i] = j.l_start(g * group + i % group, local.top[i]);
    std::fill(s + k_first, s + f, 0.f);
    std::fill(s + n, s + keys, 0.f);
    float* dst = out_row(i);
    std::fill(dst, dst + d, 0.f);
  }
  // Per part, the values in chunks of up to 16 KB, widened to fp32 once: a chunk stays in L1 for every
  // pass of every query vector over it, instead of each pass reading the cache's rows (strided, from L2
  // or further) again.
  constexpr int PV = values_per_pass<D>();
  const int64_t chunk = std::min<int64_t>(PART, std::max<int64_t>(1, 4096 / d));
  const T* vbase = static_cast<const T*>(j.v_cache) + g * d;
  local.vals.resize(chunk * d);
  local.o.resize(nq * d);
  for (int64_t a = from(0) / PART * PART; a < keys; a += PART) {
    const int64_t end = std::min(keys, a + PART);
    int64_t first = 0;   // query vectors before it (rows at earlier positions) see no key of this part
    while (seen(first) <= a) first += group;
    int64_t last = first;   // and from `last` on (rows at later positions) their windows start after it
    while (last < nq && from(last) < end) last += group;
    const int64_t start = std::max(a, from(first));   // the keys before it have weight 0 for all of them
    for (int64_t p0 = start; p0 < end; p0 += chunk) {
      const int64_t n = std::min(chunk, end - p0);
      for (int64_t p = 0; p < n; ++p) widen_into(vbase + slots[p0 + p] * kv, d, &local.vals[p * d]);
      for (int64_t i0 = first; i0 < last; i0 += PV) {
        const int64_t nv = std::min<int64_t>(PV, last - i0);
        const float* w[PV];
        float* out[PV];
        for (int64_t u = 0; u < nv; ++u) {
          w[u] = &scores[(i0 + u) * keys + p0];
          out[u] = &local.o[(i0 + u) * d];
        }
        const float* vals = local.vals.data();
        weighted_values_n<D, PV>(nv, w, n, [&](int64_t p) { return vals + p * d; }, d, p0 > start, out);
      }
    }
    for (int64_t i = first; i < last; ++i) {
      const float* ml = &local.ml[(i * parts + a / PART) * 2];
      merge_part(out_row(i), local.l_sum[i], local.top[i], ml[0], ml[1], &local.o[i * d], d);
    }
  }
  for (int64_t i = 0; i < nq; ++i) merge_end(out_row(i), local.l_sum[i], d);
}

// The parts of a PART or SHARED item, each on its own (the item's bounds follow the threads; a part's do not).
template <int D, class T>
void attend_parts(AttnJob& j, const Item& it, Local& local) {
  if (it.work == Work::SHARED) {
    for (int64_t p = it.lo; p < it.hi; p += PART) attend_part_rows<D, T>(j, it.seq, it.index, p, p + PART, local);
    return;
  }
  const OneRow& qr = j.one_rows[it.seq];
  const int64_t from = j.first_key(qr.keys - 1);
  for (int64_t p = it.lo; p < it.hi; p += PART)
    attend_part<D, T>(j, qr, std::max(p, from), std::min(it.hi, p + PART), it.index + (p - it.lo) / PART, local);
}

template <class T>
void run_item(AttnJob& j, const Item& it, Local& local) {
  if (it.work == Work::WIDEN)
    widen_keys<T>(j, it.seq, it.index);
  else if (j.m->head_dim == 64)
    it.work != Work::ROWS ? attend_parts<64, T>(j, it, local) : attend_rows<64, T>(j, it, local);
  else if (j.m->head_dim == 96)   // Phi-3
    it.work != Work::ROWS ? attend_parts<96, T>(j, it, local) : attend_rows<96, T>(j, it, local);
  else if (j.m->head_dim == 128)
    it.work != Work::ROWS ? attend_parts<128, T>(j, it, local) : attend_rows<128, T>(j, it, local);
  else if (j.m->head_dim == 256)  // Gemma 3
    it.work != Work::ROWS ? attend_parts<256, T>(j, it, local) : attend_rows<256, T>(j, it, local);
  else
    it.work != Work::ROWS ? attend_parts<0, T>(j, it, local) : attend_rows<0, T>(j, it, local);
}

void run_items(AttnJob& job, int threads) {
  nc_qg_parallel_for(static_cast<int64_t>(job.items.size()), 1, threads, [](const void* ctx, int64_t i0, int64_t i1) {
    thread_local Local local;
    AttnJob& j = *const_cast<AttnJob*>(static_cast<const AttnJob*>(ctx));
    for (int64_t i = i0; i < i1; ++i) {
      if (j.m->kv_f16)
        run_item<uint16_t>(j, j.items[i], local);
      else
        run_item<float>(j, j.items[i], local);
    }
  }, &job);
}

// out [n, heads * head_dim] = softmax(q k^T * scale) v per row over its sequence's cached keys
// (positions up to its own: this step's K/V are already in the cache).
void attention(AttnJob& job, int threads) {
  const Model& m = *job.m;
  const Batch& b = *job.b;
  int64_t keys = 0, longest = 0;
  job.one_rows.clear();
  for (int64_t t = 0; t < b.seqs; ++t) {
    const int64_t r0 = b.cu_q[t], r1 = b.cu_q[t + 1];
    keys += (b.context_lens[t] - job.first_key(b.context_lens[t] - 1)) * (r1 - r0);
    if (r1 - r0 > SHORT_ROWS) continue;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t seen = b.context_lens[t] - (r1 - 1 - r);   // a sequence's rows end at its context length
      const int64_t start = job.first_key(seen - 1) / PART * PART;   // from its window's first part
      job.one_rows.push_back({t, r, seen, start});
      longest = std::max<int64_t>(longest, seen - start);
    }
  }
  const int64_t one_row = static_cast<int64_t>(job.one_rows.size());
  // Small contexts: a second thread costs more than the work (~16 KB of K/V per 64 keys here).
  const int nt = keys * m.kv_size() < (32 << 10) ? 1 : threads;
  // Parts per PART item: a row's all, or with too few rows to keep every thread busy (decode alone, or a
  // verification chunk) a share of the longest's.
  int64_t per_item = std::max<int64_t>(1, (longest + PART - 1) / PART);
  if (one_row < 2 * nt && b.n == one_row) per_item = std::max<int64_t>(1, (per_item * one_row + 2 * nt - 1) / (2 * nt));
  job.items.clear();
  job.first_part.assign(one_row + 1, 0);
  for (int64_t i = 0; i < one_row; ++i)
    job.first_part[i + 1] = job.first_part[i] + (job.one_rows[i].keys - job.one_rows[i].start + PART - 1) / PART;
  job.part_items.clear();
  auto queue_parts = [&](int64_t i, int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; p += per_item * PART)
      job.part_items.push_back({i, p, std::min(hi, p + per_item * PART), job.part_index(i, p), Work::PART});
  };
  for (int64_t i = 0, e; i < one_row; i = e) {
    for (e = i + 1; e < one_row && job.one_rows[e].seq == job.one_rows[i].seq;) ++e;   // a sequence's rows [i, e)
    // The parts all its rows see whole: from past every row's window start to its first row's last whole part.
    int64_t lo = 0;
    for (int64_t r = i; r < e; ++r) lo = std::max(lo, (job.first_key(job.one_rows[r].keys - 1) + PART - 1) / PART * PART);
    const int64_t hi = e - i > 1 ? job.one_rows[i].keys / PART * PART : lo;
    if (hi > lo) {
      const int64_t share = std::max<int64_t>(1, (hi - lo) / PART / (2 * nt));
      for (int64_t p = lo; p < hi; p += share * PART) job.items.push_back({i, p, std::min(hi, p + share * PART), e, Work::SHARED});
    }
    for (int64_t r = i; r < e; ++r) {
      if (hi > lo) {
        queue_parts(r, job.one_rows[r].start, lo);
        queue_parts(r, hi, job.one_rows[r].keys);
      } else {
        queue_parts(r, job.one_rows[r].start, job.one_rows[r].keys);
      }
    }
  }
  job.items.insert(job.items.end(), job.part_items.begin(), job.part_items.end());
  job.slots.clear();
  job.slots_at.assign(b.seqs, -1);
  job.keys_at.assign(b.seqs, -1);
  int64_t keys_size = 0;
  for (int64_t t = 0; t < b.seqs; ++t) {
    if (b.cu_q[t + 1] - b.cu_q[t] <= SHORT_ROWS) continue;
    job.slots_at[t] = static_cast<int64_t>(job.slots.size());
    for (int64_t p = 0; p < b.context_lens[t]; ++p) job.slots.push_back(job.slot(t, p));
    job.keys_at[t] = keys_size;
    keys_size += m.kv_heads * b.context_lens[t] * m.head_dim;
    for (int64_t g = 0; g < m.kv_heads; ++g) job.items.push_back({t, 0, 0, g, Work::WIDEN});
  }
  job.ml.resize(job.first_part[one_row] * m.heads * 2);
  job.o.resize(job.first_part[one_row] * m.heads * m.head_dim);
  job.keys.resize(keys_size);
  run_items(job, nt);   // row parts and key widening
  job.items.clear();
  for (int64_t t = 0; t < b.seqs; ++t) {
    const int64_t r0 = b.cu_q[t], r1 = b.cu_q[t + 1];
    if (r1 - r0 > SHORT_ROWS)
      for (int64_t r = r0; r < r1; r += ROW_BLOCK)
        for (int64_t g = 0; g < m.kv_heads; ++g) job.items.push_back({t, r, std::min(r1, r + ROW_BLOCK), g, Work::ROWS});
  }
  if (!job.items.empty()) run_items(job, nt);
  merge_parts(job);
}

struct Scratch {
  std::vector<float> normed, qkv, attn, proj, gate_up, act, logits, route_w;
  std::vector<int64_t> route_ids;
  std::vector<int> order;
  AttnJob attn_job;
  void fit(const Model& m, int64_t n) {
    normed.resize(n * m.hidden);
    qkv.resize(n * (m.q_size() + 2 * m.kv_size()));
    attn.resize(n * m.q_size());
    proj.resize(n * m.hidden);
    gate_up.resize(n * 2 * m.inter);
    act.resize(n * m.inter);
  }
};

struct Matmul {
  int x2, threads;
  // y [n, rows] = x [n, k] @ W^T (+ bias) for W = (type, tiles) at plan fields [field, field + 1].
  bool operator()(const int64_t* L, int field, int64_t rows, int64_t k, const float* x, int64_t n, float* y,
                  const float* bias = nullptr) const {
    return nc_qg_matmul(static_cast<int>(L[field]), ptr<const uint8_t>(L[field + 1]), rows, k, x, 0, n, k, y, 0,
                        rows, bias, x2, threads) == 0;
  }
  // y [n, ldy] = x [n, k] @ [W_0; W_1; ...]^T (+ bias) for the row segments at plan field `field`:
  // one call per segment (its own weight type) into its columns of y, with its slice of the bias.
  bool segments(const int64_t* L, int field, int count, int64_t k, const float* x, int64_t n, float* y,
                int64_t ldy, const float* bias = nullptr) const {
    int64_t col = 0;
    for (const int64_t* seg = L + field; seg < L + field + count * SEG_FIELDS && seg[2] > 0; seg += SEG_FIELDS) {
      if (nc_qg_matmul(static_cast<int>(seg[0]), ptr<const uint8_t>(seg[1]), seg[2], k, x, 0, n, k, y + col, 0, ldy,
                       bias ? bias + col : nullptr, x2, threads))
        return false;
      col += seg[2];
    }
    return true;
  }
};

// x += y, or x += rms_norm(y) * w per row where the layer has that output norm (w non-null).
void add_normed(float* x, float* y, const float* w, int64_t n, int64_t H, float eps) {
  if (w)
    for (int64_t t = 0; t < n; ++t) rms_norm(y + t * H, w, H, eps, y + t * H);
  for (int64_t i = 0; i < n * H; ++i) x[i] += y[i];
}

// One row's routing: the k experts (ids) and their weights from the router's E logits (M_ROUTING). The top k
// by logit, highest first, ties to the lower id (softmax keeps the logits' order).
void route_row(const float* logits, int64_t E, int64_t k, int routing, int* order, int64_t* ids, float* w) {
  for (int e = 0; e < E; ++e) order[e] = e;
  std::partial_sort(order, order + k, order + E, [&](int a, int b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  const float top = logits[order[0]];
  float total = 0.f;
  for (int64_t j = 0; j < k; ++j) {
    ids[j] = order[j];
    total += (w[j] = std::exp(logits[order[j]] - top));
  }
  if (routing == ROUTE_SOFTMAX_TOPK)
    for (int64_t e = k; e < E; ++e) total += std::exp(logits[order[e]] - top);
  for (int64_t j = 0; j < k; ++j) w[j] /= total;
}

// y [n, hidden] = the sparse MoE MLP (M_FIELDS at mp) of x [n, hidden].
int moe_forward(const Model& m, const int64_t* mp, const float* x, int64_t n, float* y, Scratch& s, const Matmul& mm) {
  const int64_t E = mp[M_EXPERTS], k = mp[M_TOP_K], H = m.hidden;
  if (k < 1 || k > E) return ERR_MOE;
  s.logits.resize(n * E);
  s.route_ids.resize(n * k);
  s.route_w.resize(n * k);
  s.order.resize(E);
  if (!mm(mp, M_ROUTER_TYPE, E, H, x, n, s.logits.data(), ptr<const float>(mp[M_ROUTER_BIAS]))) return ERR_MATMUL;
  for (int64_t t = 0; t < n; ++t)
    route_row(&s.logits[t * E], E, k, static_cast<int>(mp[M_ROUTING]), s.order.data(), &s.route_ids[t * k],
              &s.route_w[t * k]);
  return nc_moe_forward(x, n, H, s.route_ids.data(), s.route_w.data(), k, E, ptr<const NcMat>(mp[M_GATE]),
                        ptr<const NcMat>(mp[M_UP]), ptr<const NcMat>(mp[M_DOWN]), y, static_cast<int>(mp[M_ACT]),
                        bits_float(mp[M_ALPHA_BITS]), bits_float(mp[M_LIMIT_BITS]), ptr<const float>(mp[M_GATE_BIAS]),
                        ptr<const float>(mp[M_UP_BIAS]), ptr<const float>(mp[M_DOWN_BIAS]), mm.x2, mm.threads)
             ? ERR_MOE
             : OK;
}

int layer_forward(const Model& m, const int64_t* L, const Batch& b, float* x, Scratch& s, const Matmul& mm) {
  const int64_t n = b.n, H = m.hidden, qkv_w = m.q_size() + 2 * m.kv_size();
  for (int64_t t = 0; t < n; ++t) rms_norm(x + t * H, ptr<const float>(L[L_IN_NORM]), H, m.eps, &s.normed[t * H]);
  if (!mm.segments(L, L_QKV, QKV_SEGS, H, s.normed.data(), n, s.qkv.data(), qkv_w, ptr<const float>(L[L_QKV_BIAS])))
    return ERR_MATMUL;
  if (m.kv_f16)
    prepare_qkv<uint16_t>(m, L, b, s.qkv.data());
  else
    prepare_qkv<float>(m, L, b, s.qkv.data());
  s.attn_job.bind(m, b, s.qkv.data(), qkv_w, m.scale, ptr<const void>(L[L_K_CACHE]), ptr<const void>(L[L_V_CACHE]),
                  s.attn.data(), L[L_WINDOW], ptr<const float>(L[L_SINKS]));
  attention(s.attn_job, mm.threads);
  if (!mm(L, L_O_TYPE, H, m.q_size(), s.attn.data(), n, s.proj.data(), ptr<const float>(L[L_O_BIAS])))
    return ERR_MATMUL;
  add_normed(x, s.proj.data(), ptr<const float>(L[L_ATTN_OUT_NORM]), n, H, m.eps);

  for (int64_t t = 0; t < n; ++t) rms_norm(x + t * H, ptr<const float>(L[L_POST_NORM]), H, m.eps, &s.normed[t * H]);
  if (L[L_MOE]) {
    if (const int rc = moe_forward(m, ptr<const int64_t>(L[L_MOE]), s.normed.data(), n, s.proj.data(), s, mm)) return rc;
    add_normed(x, s.proj.data(), ptr<const float>(L[L_MLP_OUT_NORM]), n, H, m.eps);
    return OK;
  }
  if (!mm.segments(L, L_GU, GU_SEGS, H, s.normed.data(), n, s.gate_up.data(), 2 * m.inter)) return ERR_MATMUL;
  for (int64_t t = 0; t < n; ++t) {
    const float* g = &s.gate_up[t * 2 * m.inter];
    if (m.act == ACT_GELU_TANH)
      activation_row(4, g, g + m.inter, m.inter, &s.act[t * m.inter]);
    else
      silu_mul(g, g + m.inter, m.inter, &s.act[t * m.inter]);
  }
  if (!mm(L, L_DOWN_TYPE, H, m.inter, s.act.data(), n, s.proj.data())) return ERR_MATMUL;
  add_normed(x, s.proj.data(), ptr<const float>(L[L_MLP_OUT_NORM]), n, H, m.eps);
  return OK;
}

thread_local Scratch g_scratch;

}  // namespace

extern "C" {

int nc_dec_header_fields() { return H_FIELDS; }
int nc_dec_layer_fields() { return L_FIELDS; }
int nc_dec_moe_fields() { return M_FIELDS; }

// x [n, hidden] fp32: the embedded tokens (times any embedding scale) in, the final-normed hidden states out. Rows
// as in Batch. window_slots / window_tables (null: none): the windowed layers' own cache slots and block tables,
// for models whose windowed layers keep a KV group of their own beside the full-attention layers'.
int nc_dec_forward(const int64_t* plan, float* x, int64_t n, const int64_t* positions, const int64_t* slots,
                   int64_t seqs, const int32_t* cu_q, const int32_t* block_tables, int64_t table_stride,
                   const int32_t* context_lens, const int64_t* window_slots, const int32_t* window_tables,
                   int64_t window_table_stride, int x2, int threads) {
  const Model m(plan);
  for (int64_t t = 0; t < n; ++t)
    if (positions[t] < 0 || positions[t] >= m.max_pos) return ERR_POSITION;
  if (seqs < 1 || cu_q[0] != 0 || cu_q[seqs] != n) return ERR_BATCH;
  for (int64_t t = 0; t < seqs; ++t)
    if (cu_q[t + 1] <= cu_q[t] || context_lens[t] != positions[cu_q[t + 1] - 1] + 1) return ERR_BATCH;
  const Batch b{n, positions, slots, seqs, cu_q, block_tables, table_stride, context_lens};
  const Batch bw{n, positions, window_slots, seqs, cu_q, window_tables, window_table_stride, context_lens};
  Scratch& s = g_scratch;
  s.fit(m, n);
  const Matmul mm{x2, threads};
  for (int64_t l = 0; l < m.layers; ++l) {
    const int64_t* L = plan + H_FIELDS + l * L_FIELDS;
    const int rc = layer_forward(m, L, L[L_WINDOW] > 0 && window_tables ? bw : b, x, s, mm);
    if (rc) return rc;
  }
  for (int64_t t = 0; t < n; ++t) rms_norm(x + t * m.hidden, m.final_norm, m.hidden, m.eps, x + t * m.hidden);
  return OK;
}


// Attention alone (the module-by-module forward): out [n, heads * head_dim] = softmax(q k^T * scale) v of each
// row over its sequence's cached keys (this step's K/V already stored), rows as in Batch, the row positions
// implied (a sequence's rows end at its context length). q: fp32 rows of heads * head_dim at stride ldq;
// caches [num_blocks, block_size, kv_heads, head_dim], fp16 (kv_f16) or fp32; window as L_WINDOW, sinks as
// L_SINKS (null: none).
int nc_dec_attention(const float* q, int64_t ldq, int64_t n, int64_t seqs, const int32_t* cu_q,
                     const int32_t* block_tables, int64_t table_stride, const int32_t* context_lens,
                     const void* k_cache, const void* v_cache, int kv_f16, int64_t heads, int64_t kv_heads,
                     int64_t head_dim, int64_t block_size, float scale, int64_t window, const float* sinks,
                     float* out, int threads) {
  if (seqs < 1 || cu_q[0] != 0 || cu_q[seqs] != n || window < 0) return ERR_BATCH;
  std::vector<int64_t> positions(n);
  for (int64_t t = 0; t < seqs; ++t) {
    if (cu_q[t + 1] <= cu_q[t] || context_lens[t] < cu_q[t + 1] - cu_q[t]) return ERR_BATCH;
    for (int64_t r = cu_q[t]; r < cu_q[t + 1]; ++r) positions[r] = context_lens[t] - (cu_q[t + 1] - r);
  }
  Model m{};
  m.heads = heads;
  m.kv_heads = kv_heads;
  m.head_dim = head_dim;
  m.block_size = block_size;
  m.kv_f16 = kv_f16 != 0;
  const Batch b{n, positions.data(), nullptr, seqs, cu_q, block_tables, table_stride, context_lens};
  AttnJob& job = g_scratch.attn_job;
  job.bind(m, b, q, ldq, scale, k_cache, v_cache, out, window, sinks);
  attention(job, threads);
  return OK;
}

// Elementwise activations (the module-by-module forward): out[r][i] = f(x[r][i]), times u[r][i] when u is
// given, over rows of `cols` values (strides ldx, ldu, ldo). f: 0 silu, 1 sigmoid, 2 softplus (log(1 + e^x),
// x past 20 as is, as torch), 3 exp, 4 GELU with the tanh approximation, 5 tanh. Each element is a function of its own value only, the last elements of a row
// running the same vector code (masked), so a row's results do not depend on the rows beside it (torch's
// kernels finish a flat range in scalar code, which rounds differently).
int nc_dec_activation(int op, const float* x, int64_t ldx, const float* u, int64_t ldu, int64_t rows, int64_t cols,
                      float* out, int64_t ldo, int threads) {
  if (op < 0 || op > 5) return ERR_BATCH;
  struct Ctx {
    int op;
    const float *x, *u;
    int64_t ldx, ldu, cols, ldo;
    float* out;
  } ctx{op, x, u, ldx, ldu, cols, ldo, out};
  auto body = [](const void* c, int64_t r0, int64_t r1) {
    const Ctx& a = *static_cast<const Ctx*>(c);
    for (int64_t r = r0; r < r1; ++r) activation_row(a.op, a.x + r * a.ldx, a.u ? a.u + r * a.ldu : nullptr, a.cols,
                                                     a.out + r * a.ldo);
  };
  nc_qg_parallel_for(rows, std::max<int64_t>(1, (16 << 10) / std::max<int64_t>(cols, 1)), threads, body, &ctx);
  return OK;
}


// The gated delta rule token by token (Gated DeltaNet layers on the CPU, every chunk in decode's form):
// per sequence b and value head h, state S [dk, dv] at state + (slots[b] * nv + h) * dk * dv (fp32, updated in
// place; zeros first where fresh[b]), for each of its rows t in order:
//   S = decay_t S;  u = k_t^T S;  S += k_t (x) beta_t (v_t - u);  o_t = q_t^T S
// with q, k [n, nv, dk] (normalized, scaled, one per value head), v and out [n, nv, dv], decay (exp of the
// log decay) and beta [n, nv]. Each (sequence, head) is one work item over its own rows, summed in one order
// over i (the S rows) and elementwise across the dv columns, so a token's output and state do not depend on
// the other sequences of the call or on where its prompt's chunks start.
int nc_gdn_recurrent(const float* q, const float* k, const float* v, const float* decay, const float* beta, int64_t n,
                     int64_t seqs, const int32_t* cu, const int64_t* slots, const uint8_t* fresh, int64_t nv, int64_t dk,
                     int64_t dv, float* state, float* out, int threads) {
  if (seqs < 1 || cu[0] != 0 || cu[seqs] != n) return ERR_BATCH;
  struct Ctx {
    const float *q, *k, *v, *decay, *beta;
    const int32_t* cu;
    const int64_t* slots;
    const uint8_t* fresh;
    int64_t nv, dk, dv;
    float *state, *out;
  } ctx{q, k, v, decay, beta, cu, slots, fresh, nv, dk, dv, state, out};
  auto body = [](const void* c, int64_t i0, int64_t i1) {
    const Ctx& a = *static_cast<const Ctx*>(c);
    thread_local std::vector<float> u;
    u.resize(a.dv);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / a.nv, h = item % a.nv, dk = a.dk, dv = a.dv;
      float* S = a.state + (a.slots[b] * a.nv + h) * dk * dv;
      if (a.fresh && a.fresh[b]) std::fill(S, S + dk * dv, 0.f);
      for (int64_t t = a.cu[b]; t < a.cu[b + 1]; ++t) {
        const int64_t th = t * a.nv + h;
        const float *qt = a.q + th * dk, *kt = a.k + th * dk, *vt = a.v + th * dv;
        const float dec = a.decay[th], bt = a.beta[th];
        float* o = a.out + th * dv;
        std::fill(u.begin(), u.end(), 0.f);
        for (int64_t i = 0; i < dk; ++i) {
          float* row = S + i * dv;
          for (int64_t j = 0; j < dv; ++j) {
            row[j] *= dec;
            u[j] += kt[i] * row[j];
          }
        }
        for (int64_t j = 0; j < dv; ++j) u[j] = bt * (vt[j] - u[j]);   // the update's values
        std::fill(o, o + dv, 0.f);
        for (int64_t i = 0; i < dk; ++i) {
          float* row = S + i * dv;
          for (int64_t j = 0; j < dv; ++j) {
            row[j] += kt[i] * u[j];
            o[j] += qt[i] * row[j];
          }
        }
      }
    }
  };
  nc_qg_parallel_for(seqs * nv, 1, threads, body, &ctx);
  return OK;
}

}  // extern "C"
