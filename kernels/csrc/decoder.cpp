// One step of a dense Llama / Qwen2 / Qwen3 decoder stack on the CPU, all layers in one call: any
// ragged batch of decode rows and prefill chunks.
//
// Why: at one token per sequence the matmuls read ~80 MB of quantized weights in ~5 ms, while the
// same step as ~25 torch ops per layer spent as long again in dispatch and small-op overhead
// (rms_norm, RoPE, KV gather, softmax, casts); in prefill the same ops cost ~25% of the step. Each
// layer is
//   x += o_proj(attn(rope(norm_qk(qkv_proj(rms(x))))));  x += down(silu(gate) * up(rms(x)))
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
// SIMD: the attention and elementwise kernels are written once over a vector of VL floats, AVX-512
// (16 lanes) or AVX2 + FMA + F16C (8 lanes), with scalar loops in builds that have neither.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define DEC_VL 16
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define DEC_VL 8
#else
#define DEC_VL 0
#endif

extern "C" int nc_qg_matmul(int type, const uint8_t* w, int64_t rows, int64_t k, const void* x, int x_bf16,
                            int64_t n, int64_t ldx, void* y, int y_bf16, int64_t ldy, const float* bias, int x2,
                            int threads);
extern "C" void nc_qg_parallel_for(int64_t items, int64_t chunk, int threads,
                                   void (*fn)(const void*, int64_t, int64_t), const void* ctx);

namespace {

// Plan layout (int64): header, then L_FIELDS per layer. Weight = (ggml type, packed tiles). The
// qkv and gate_up projections are row segments (type, tiles, rows), each with its own type (GGUF
// quantizers give q, k, v and gate, up different ones), in output order (q | k | v, gate | up, or
// one fused segment); unused segments at the end have rows = 0. L_QKV_BIAS (0 = none) spans all qkv
// segments. H_KV_F16: the caches are fp16 (else fp32).
constexpr int SEG_FIELDS = 3, QKV_SEGS = 3, GU_SEGS = 2;
enum Header : int {
  H_LAYERS, H_HIDDEN, H_HEADS, H_KV_HEADS, H_HEAD_DIM, H_INTER, H_ROT_DIM, H_BLOCK_SIZE, H_MAX_POS,
  H_COS, H_SIN, H_FINAL_NORM, H_EPS_BITS, H_KV_F16, H_FIELDS
};
enum Layer : int {
  L_IN_NORM, L_POST_NORM, L_QKV, L_QKV_BIAS = L_QKV + QKV_SEGS * SEG_FIELDS, L_Q_NORM, L_K_NORM, L_O_TYPE,
  L_O_W, L_GU, L_DOWN_TYPE = L_GU + GU_SEGS * SEG_FIELDS, L_DOWN_W, L_K_CACHE, L_V_CACHE, L_FIELDS
};
enum : int { OK = 0, ERR_MATMUL = 3, ERR_POSITION = 4, ERR_BATCH = 5 };

template <class T>
T* ptr(int64_t v) {
  return reinterpret_cast<T*>(static_cast<intptr_t>(v));
}

struct Model {
  int64_t layers, hidden, heads, kv_heads, head_dim, inter, rot_dim, block_size, max_pos;
  const float *cos, *sin, *final_norm;
  float eps;
  bool kv_f16;

  explicit Model(const int64_t* p)
      : layers(p[H_LAYERS]), hidden(p[H_HIDDEN]), heads(p[H_HEADS]), kv_heads(p[H_KV_HEADS]),
        head_dim(p[H_HEAD_DIM]), inter(p[H_INTER]), rot_dim(p[H_ROT_DIM]), block_size(p[H_BLOCK_SIZE]),
        max_pos(p[H_MAX_POS]), cos(ptr<const float>(p[H_COS])), sin(ptr<const float>(p[H_SIN])),
        final_norm(ptr<const float>(p[H_FINAL_NORM])), kv_f16(p[H_KV_F16] != 0) {
    double e;
    std::memcpy(&e, &p[H_EPS_BITS], sizeof e);
    eps = static_cast<float>(e);
  }
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
#if DEC_VL == 16
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
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
inline float vhmax(vf a) { return _mm512_reduce_max_ps(a); }
// y * 2^n for integral n.
inline vf vscale2(vf y, vf n) { return _mm512_scalef_ps(y, n); }
// Lanes [0, k) (k < VL): their load (zeros above), store, and v with the other lanes zeroed.
inline __mmask16 lanes(int64_t k) { return static_cast<__mmask16>((1u << k) - 1); }
inline vf vload_part(const float* p, int64_t k) { return _mm512_maskz_loadu_ps(lanes(k), p); }
inline void vstore_part(float* p, vf v, int64_t k) { _mm512_mask_storeu_ps(p, lanes(k), v); }
inline vf vkeep(vf v, int64_t k) { return _mm512_maskz_mov_ps(lanes(k), v); }
#elif DEC_VL == 8
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
inline float vsum(vf a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
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
#endif

// One fp16 value <-> fp32, rounding to nearest even: F16C where compiled in, else the same in
// software (as in F. Giesen's half_to_float / float_to_half_fast3_rtne).
#if defined(__F16C__)
inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
inline uint16_t f32_to_f16(float f) { return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)); }
#else
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
inline float f16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h & 0x7fffu) << 13;  // exponent and mantissa in place
  const uint32_t exp = u & (0x7c00u << 13);
  u += (127u - 15u) << 23;
  if (exp == 0x7c00u << 13)
    u += (128u - 16u) << 23;                              // inf / nan: all exponent bits set
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

inline float widen(float v) { return v; }
inline float widen(uint16_t h) { return f16_to_f32(h); }

// A KV cache row of n values as fp32: the row itself (fp32 cache), or widened into buf (fp16).
inline const float* as_f32(const float* row, int64_t, float*) { return row; }
inline const float* as_f32(const uint16_t* row, int64_t n, float* buf) {
  int64_t i = 0;
#if DEC_VL
  for (; i + VL <= n; i += VL) vstore(buf + i, vload(row + i));
#endif
  for (; i < n; ++i) buf[i] = f16_to_f32(row[i]);
  return buf;
}

// dst = src in the cache's type.
inline void store_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(uint16_t* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if DEC_VL
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

// a . b and o += w * b over one head of D dims (D = 0: d, known at run time), b in a KV cache row:
// decode attention's inner loops, FMA in VL lanes with one horizontal sum per dot where D allows,
// else the scalar loops (fp16 widened into buf, d floats).
template <int D, class T>
inline float head_dot(const float* a, const T* b, int64_t d, float* buf) {
#if DEC_VL
  if constexpr (D > 0 && D % VL == 0) {
    vf acc = vmul(vload(a), vload(b));
    for (int c = 1; c < D / VL; ++c) acc = vfmadd(vload(a + VL * c), vload(b + VL * c), acc);
    return vsum(acc);
  }
#endif
  return dot(a, as_f32(b, d, buf), d);
}

template <int D, class T>
inline void head_axpy(float* o, float w, const T* b, int64_t d) {
#if DEC_VL
  if constexpr (D > 0 && D % VL == 0) {
    const vf wv = vset(w);
    for (int c = 0; c < D / VL; ++c) vstore(o + VL * c, vfmadd(wv, vload(b + VL * c), vload(o + VL * c)));
    return;
  }
#endif
  for (int64_t e = 0; e < d; ++e) o[e] += w * widen(b[e]);
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
  for (int64_t t = 0; t < b.n; ++t) {
    float* row = qkv + t * width;
    const float* c = m.cos + b.positions[t] * (m.rot_dim / 2);
    const float* s = m.sin + b.positions[t] * (m.rot_dim / 2);
    for (int64_t h = 0; h < m.heads + m.kv_heads; ++h) {  // q heads then k heads: adjacent in the row
      float* head = row + h * m.head_dim;
      const float* nw = h < m.heads ? q_norm : k_norm;
      if (nw) rms_norm(head, nw, m.head_dim, m.eps, head);
      rope(head, c, s, m.rot_dim);
    }
    const int64_t slot = b.slots[t];
    store_row(k_cache + slot * m.kv_size(), row + m.q_size(), m.kv_size());
    store_row(v_cache + slot * m.kv_size(), row + m.q_size() + m.kv_size(), m.kv_size());
  }
}

// exp over an array (attention probabilities, SiLU): exp(x) = 2^n e^r with n = round(x / ln 2),
// r = x - n ln 2 (ln 2 in two parts), e^r by Cephes' degree-6 polynomial: within 2 ulp of std::exp
// for x in [-87, 88]. std::exp in builds without SIMD.
#if DEC_VL
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
#if DEC_VL
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
#if DEC_VL
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
#if DEC_VL
  const vf one = vset(1.0f);
  for (; i + VL <= n; i += VL) {
    const vf x = vload(g + i);
    const vf e = vexp(vsub(vset(0.f), x));
    vstore(out + i, vmul(vdiv(x, vadd(one, e)), vload(u + i)));
  }
#endif
  for (; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

// ------------------------------------------------------------------ attention
// Work items for the pool, per sequence by its query rows in this step:
// - one row (decode): its keys are cut into parts (several when there are fewer sequences than
//   threads, "split-K" as in flash-decoding). A part keeps, per query head, the max m of its scores,
//   the sum l of exp(score - m) and the unnormalized output o; a sequence's parts are merged with
//   exp(m - M) weights. Keys are read a whole cached row (all KV heads) at a time, block by block.
// - several rows (prefill chunk): first the sequence's keys are transposed per KV head into tiles of
//   16 (one item per KV head), then blocks of up to ROW_BLOCK rows x one KV head compute the scores
//   of all their query heads against those tiles (an outer-product form that vectorizes over keys),
//   a causal softmax per row and the weighted sum of values.
// The kernels over cached K/V are templates on the caches' element type T (float or fp16 bits).
constexpr int64_t ROW_BLOCK = 16, KEY_TILE = 16;

enum class Work { PART, TRANSPOSE, ROWS };

struct Item {
  int64_t seq;
  int64_t lo, hi;   // PART: keys [lo, hi); ROWS: batch rows [lo, hi)
  int64_t index;    // PART: the part's index in ml / o; TRANSPOSE, ROWS: the KV head
  Work work;
};

struct AttnJob {
  const Model* m;
  const Batch* b;
  const float* qkv;
  const void* k_cache;              // float or fp16 bits, as m->kv_f16 says
  const void* v_cache;
  float* out;                       // [n, heads * head_dim]
  float scale;
  std::vector<Item> items;
  std::vector<int64_t> first_part;  // [seqs + 1]: parts of sequence t (one-row sequences only)
  std::vector<float> ml;            // [parts, heads, 2]: m, l
  std::vector<float> o;             // [parts, heads, head_dim]
  // Several-row sequences: their keys' cache slots and transposed keys [kv_heads][tiles][head_dim][16].
  std::vector<int64_t> slots, slots_at, keys_t_at;
  std::vector<float> keys_t;

  int64_t tiles(int64_t t) const { return (b->context_lens[t] + KEY_TILE - 1) / KEY_TILE; }
  const float* key_tile(int64_t t, int64_t g, int64_t tile) const {
    return &keys_t[keys_t_at[t] + (g * tiles(t) + tile) * m->head_dim * KEY_TILE];
  }

  void bind(const Model& model, const Batch& batch, const float* q, const void* kc, const void* vc, float* dst) {
    m = &model;
    b = &batch;
    qkv = q;
    k_cache = kc;
    v_cache = vc;
    out = dst;
    scale = 1.0f / std::sqrt(static_cast<float>(model.head_dim));
  }
  int64_t width() const { return m->q_size() + 2 * m->kv_size(); }
  // Flat cache slot of key position p of sequence t.
  int64_t slot(int64_t t, int64_t p) const {
    const int64_t bs = m->block_size;
    return static_cast<int64_t>(b->block_tables[t * b->table_stride + p / bs]) * bs + p % bs;
  }
};

// A pool thread's buffers: scores, one cached row widened to fp32, a chunk of value rows widened.
struct Local {
  std::vector<float> scores, row, vals;
};

// Scores, exp and weighted values of keys [p0, p1) of one-row sequence t, for all query heads. Keys
// and values are read a whole cache row (all KV heads) at a time, in order: passes per KV head, as
// attend_rows makes them, stream a long context's cache slower. D: the head dimension as in
// attend_rows.
template <int D, class T>
void attend_part(AttnJob& j, const Item& it, Local& local) {
  const Model& m = *j.m;
  const int64_t heads = m.heads, group = m.heads / m.kv_heads, d = D ? D : m.head_dim, bs = m.block_size;
  const int64_t p0 = it.lo, p1 = it.hi, len = p1 - p0, kv = m.kv_size();
  const int64_t t = it.seq;
  const float* q = j.qkv + j.b->cu_q[t] * j.width();
  const T* k_cache = static_cast<const T*>(j.k_cache);
  const T* v_cache = static_cast<const T*>(j.v_cache);
  std::vector<float>& scores = local.scores;
  scores.resize(heads * len);
  local.row.resize(d);
  auto for_keys = [&](auto&& body) {  // body(p - p0, slot of position p), block by block
    for (int64_t p = p0; p < p1;) {
      const int64_t end = std::min(p1, (p / bs + 1) * bs), base = j.slot(t, p) - p;
      for (; p < end; ++p) body(p - p0, base + p);
    }
  };
  for_keys([&](int64_t i, int64_t slot) {
    const T* krow = k_cache + slot * kv;
    for (int64_t g = 0, h = 0; g < m.kv_heads; ++g)
      for (int64_t u = 0; u < group; ++u, ++h)
        scores[h * len + i] = head_dot<D>(q + h * d, krow + g * d, d, local.row.data()) * j.scale;
  });
  float* ml = &j.ml[(it.index * heads) * 2];
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores.data() + h * len;
    ml[2 * h] = max_of(s, len);
    ml[2 * h + 1] = exp_shifted(s, len, ml[2 * h]);
  }
  float* o = &j.o[it.index * heads * d];
  std::fill(o, o + heads * d, 0.f);
  for_keys([&](int64_t i, int64_t slot) {
    const T* vrow = v_cache + slot * kv;
    for (int64_t g = 0, h = 0; g < m.kv_heads; ++g)
      for (int64_t u = 0; u < group; ++u, ++h) head_axpy<D>(o + h * d, scores[h * len + i], vrow + g * d, d);
  });
}

// The parts of each one-row sequence, merged into its output row.
void merge_parts(AttnJob& j) {
  const Model& m = *j.m;
  const int64_t H = m.heads, d = m.head_dim;
  for (int64_t t = 0; t < j.b->seqs; ++t) {
    if (j.first_part[t + 1] == j.first_part[t]) continue;
    for (int64_t h = 0; h < H; ++h) {
      float mx = -INFINITY, l = 0.f;
      for (int64_t part = j.first_part[t]; part < j.first_part[t + 1]; ++part)
        mx = std::max(mx, j.ml[(part * H + h) * 2]);
      float* dst = j.out + j.b->cu_q[t] * m.q_size() + h * d;
      std::fill(dst, dst + d, 0.f);
      for (int64_t part = j.first_part[t]; part < j.first_part[t + 1]; ++part) {
        const float w = std::exp(j.ml[(part * H + h) * 2] - mx);
        l += w * j.ml[(part * H + h) * 2 + 1];
        const float* o = &j.o[(part * H + h) * d];
        for (int64_t e = 0; e < d; ++e) dst[e] += w * o[e];
      }
      const float inv = 1.0f / l;
      for (int64_t e = 0; e < d; ++e) dst[e] *= inv;
    }
  }
}

// s[v][c] = scale * q[v] . K[c] for NV query vectors and the 16 keys of a tile transposed into
// kt[e][c]. NV x 16 / VL independent accumulators: one would wait on its own FMA latency every step.
template <int NV>
inline void tile_scores(const float* const* q, const float* kt, int64_t d, float scale, float* const* s) {
#if DEC_VL
  constexpr int KV = KEY_TILE / VL;   // vectors per row of a tile
  vf acc[NV][KV];
  for (auto& row : acc)
    for (auto& a : row) a = vset(0.f);
  for (int64_t e = 0; e < d; ++e) {
    vf k[KV];
    for (int c = 0; c < KV; ++c) k[c] = vload(kt + e * KEY_TILE + c * VL);
    for (int v = 0; v < NV; ++v) {
      const vf qe = vset(q[v][e]);
      for (int c = 0; c < KV; ++c) acc[v][c] = vfmadd(qe, k[c], acc[v][c]);
    }
  }
  for (int v = 0; v < NV; ++v)
    for (int c = 0; c < KV; ++c) vstore(s[v] + c * VL, vmul(acc[v][c], vset(scale)));
#else
  for (int v = 0; v < NV; ++v) {
    float acc[KEY_TILE] = {};
    for (int64_t e = 0; e < d; ++e)
      for (int64_t c = 0; c < KEY_TILE; ++c) acc[c] += q[v][e] * kt[e * KEY_TILE + c];
    for (int64_t c = 0; c < KEY_TILE; ++c) s[v][c] = acc[c] * scale;
  }
#endif
}

#if DEC_VL
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

// Query vectors per pass over a block's values (weighted_values' NV) and over a key tile
// (tile_scores' NV): each value row or key tile loaded (and widened from fp16) once per pass serves
// them all. AVX2: 6 x 2 vectors of accumulators, 12 independent FMA chains (its 2 FMA units x 4
// cycles of latency need 8) in 15 of its 16 registers.
template <int D>
constexpr int values_per_pass() { return DEC_VL == 8 ? 6 : D > 64 ? 2 : 4; }
constexpr int QV = DEC_VL == 8 ? 6 : 8;

// out[v][e] (+)= sum_p w[v][p] * vals[p][e] for NV query vectors over the same n keys, whose values
// are fp32 rows of d in `vals`: each value row is loaded once per pass for all NV. accumulate: add to
// what out holds (the sums over the keys before these), in the same order as one pass over all.
template <int D, int NV>
void weighted_values(const float* const* w, int64_t n, const float* vals, int64_t d, bool accumulate,
                     float* const* out) {
#if DEC_VL
  if constexpr (D > 0 && D % VL == 0) {
    constexpr int CW = pass_cols<D, NV>();
    for (int c0 = 0; c0 < D / VL; c0 += CW) {
      vf acc[NV][CW];
      for (int u = 0; u < NV; ++u)
        for (int c = 0; c < CW; ++c) acc[u][c] = accumulate ? vload(out[u] + VL * (c0 + c)) : vset(0.f);
      for (int64_t p = 0; p < n; ++p) {
        const float* row = vals + p * D + c0 * VL;
        vf v[CW];
        for (int c = 0; c < CW; ++c) v[c] = vload(row + VL * c);
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
    for (int64_t p = 0; p < n; ++p)
      for (int64_t e = 0; e < d; ++e) out[u][e] += w[u][p] * vals[p * d + e];
  }
}

// Keys of several-row sequence t, KV head g, transposed into tiles: kt[e][c] = K[16 tile + c][g][e]
// (positions past the last key repeat it; their scores are never used).
template <class T>
void transpose_keys(AttnJob& j, int64_t t, int64_t g, Local& local) {
  const int64_t d = j.m->head_dim, kv = j.m->kv_size(), keys = j.b->context_lens[t];
  const int64_t* slots = &j.slots[j.slots_at[t]];
  const T* k_cache = static_cast<const T*>(j.k_cache);
  local.row.resize(d);
  for (int64_t tile = 0; tile < j.tiles(t); ++tile) {
    float* kt = const_cast<float*>(j.key_tile(t, g, tile));
    for (int64_t c = 0; c < KEY_TILE; ++c) {
      const float* krow = as_f32(k_cache + slots[std::min(tile * KEY_TILE + c, keys - 1)] * kv + g * d, d,
                                 local.row.data());
      for (int64_t e = 0; e < d; ++e) kt[e * KEY_TILE + c] = krow[e];
    }
  }
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
  const int64_t ld = (keys + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
  const int64_t* slots = &j.slots[j.slots_at[it.seq]];
  std::vector<float>& scores = local.scores;
  scores.resize(nq * ld);
  auto query = [&](int64_t i) { return j.qkv + (it.lo + i / group) * j.width() + (g * group + i % group) * d; };

  for (int64_t tile = 0; tile * KEY_TILE < keys; ++tile) {
    const float* kt = j.key_tile(it.seq, g, tile);
    const float* q[QV];
    float* s[QV];
    int64_t i = 0;
    for (; i < nq; ++i) {
      q[i % QV] = query(i);
      s[i % QV] = &scores[i * ld + tile * KEY_TILE];
      if (i % QV == QV - 1) tile_scores<QV>(q, kt, d, j.scale, s);
    }
    for (int64_t r = i - i % QV; r < nq; ++r) tile_scores<1>(&q[r % QV], kt, d, j.scale, &s[r % QV]);
  }
  // Causal softmax per query vector. A row's weights past its own last key are zero, so every query
  // vector of the block (all its rows and heads) can share the passes over the values up to the
  // block's last key: each value row is read once per pass for PV of them, not once per row. The
  // zero terms add +-0 to a sum of positive weights, which leaves it as it was bit for bit.
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t seen = j.b->positions[it.lo + i / group] + 1;
    float* s = &scores[i * ld];
    const float inv = 1.0f / exp_shifted(s, seen, max_of(s, seen));
    for (int64_t p = 0; p < seen; ++p) s[p] *= inv;
    std::fill(s + seen, s + keys, 0.f);
  }
  // The values in chunks of 16 KB, widened to fp32 once: a chunk stays in L1 for every pass of every
  // query vector over it, instead of each pass reading the cache's rows (strided, from L2 or further)
  // again.
  constexpr int PV = values_per_pass<D>();
  const int64_t chunk = std::max<int64_t>(1, 4096 / d);
  const T* vbase = static_cast<const T*>(j.v_cache) + g * d;
  local.vals.resize(chunk * d);
  for (int64_t p0 = 0; p0 < keys; p0 += chunk) {
    const int64_t n = std::min(chunk, keys - p0);
    for (int64_t p = 0; p < n; ++p) {
      float* dst = &local.vals[p * d];
      const float* row = as_f32(vbase + slots[p0 + p] * kv, d, dst);
      if (row != dst) std::memcpy(dst, row, d * sizeof(float));
    }
    for (int64_t i0 = 0; i0 < nq; i0 += PV) {
      const int64_t nv = std::min<int64_t>(PV, nq - i0);
      const float* w[PV];
      float* out[PV];
      for (int64_t u = 0; u < nv; ++u) {
        const int64_t i = i0 + u;
        w[u] = &scores[i * ld + p0];
        out[u] = j.out + (it.lo + i / group) * m.q_size() + (g * group + i % group) * d;
      }
      const float* vals = local.vals.data();
      const bool acc = p0 > 0;
      switch (nv) {
        case 6: if constexpr (PV >= 6) weighted_values<D, 6>(w, n, vals, d, acc, out); break;
        case 5: if constexpr (PV >= 5) weighted_values<D, 5>(w, n, vals, d, acc, out); break;
        case 4: if constexpr (PV >= 4) weighted_values<D, 4>(w, n, vals, d, acc, out); break;
        case 3: if constexpr (PV >= 3) weighted_values<D, 3>(w, n, vals, d, acc, out); break;
        case 2: weighted_values<D, 2>(w, n, vals, d, acc, out); break;
        default: weighted_values<D, 1>(w, n, vals, d, acc, out);
      }
    }
  }
}

template <class T>
void run_item(AttnJob& j, const Item& it, Local& local) {
  if (it.work == Work::TRANSPOSE)
    transpose_keys<T>(j, it.seq, it.index, local);
  else if (j.m->head_dim == 64)
    it.work == Work::PART ? attend_part<64, T>(j, it, local) : attend_rows<64, T>(j, it, local);
  else if (j.m->head_dim == 128)
    it.work == Work::PART ? attend_part<128, T>(j, it, local) : attend_rows<128, T>(j, it, local);
  else
    it.work == Work::PART ? attend_part<0, T>(j, it, local) : attend_rows<0, T>(j, it, local);
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
  int64_t keys = 0, longest = 0, one_row = 0;
  for (int64_t t = 0; t < b.seqs; ++t) {
    keys += b.context_lens[t] * (b.cu_q[t + 1] - b.cu_q[t]);
    if (b.cu_q[t + 1] - b.cu_q[t] == 1) {
      longest = std::max<int64_t>(longest, b.context_lens[t]);
      ++one_row;
    }
  }
  // Small contexts: a second thread costs more than the work (~16 KB of K/V per 64 keys here).
  const int nt = keys * m.kv_size() < (32 << 10) ? 1 : threads;
  int64_t part_keys = std::max<int64_t>(1, longest);
  if (one_row < 2 * nt && b.n == one_row)  // too few sequences to keep every thread busy: split keys
    part_keys = std::max<int64_t>(m.block_size, (longest + 2 * nt - 1) / (2 * nt));
  job.items.clear();
  job.first_part.assign(b.seqs + 1, 0);
  job.slots.clear();
  job.slots_at.assign(b.seqs, -1);
  job.keys_t_at.assign(b.seqs, -1);
  int64_t keys_t_size = 0;
  for (int64_t t = 0; t < b.seqs; ++t) {
    const int64_t r0 = b.cu_q[t], r1 = b.cu_q[t + 1];
    job.first_part[t + 1] = job.first_part[t];
    if (r1 - r0 == 1) {
      for (int64_t p = 0; p < b.context_lens[t]; p += part_keys)
        job.items.push_back({t, p, std::min<int64_t>(b.context_lens[t], p + part_keys), job.first_part[t + 1]++,
                             Work::PART});
    } else {
      job.slots_at[t] = static_cast<int64_t>(job.slots.size());
      for (int64_t p = 0; p < b.context_lens[t]; ++p) job.slots.push_back(job.slot(t, p));
      job.keys_t_at[t] = keys_t_size;
      keys_t_size += m.kv_heads * job.tiles(t) * m.head_dim * KEY_TILE;
      for (int64_t g = 0; g < m.kv_heads; ++g) job.items.push_back({t, 0, 0, g, Work::TRANSPOSE});
    }
  }
  job.ml.resize(job.first_part[b.seqs] * m.heads * 2);
  job.o.resize(job.first_part[b.seqs] * m.heads * m.head_dim);
  job.keys_t.resize(keys_t_size);
  run_items(job, nt);   // decode parts and key transposes
  job.items.clear();
  for (int64_t t = 0; t < b.seqs; ++t) {
    const int64_t r0 = b.cu_q[t], r1 = b.cu_q[t + 1];
    if (r1 - r0 > 1)
      for (int64_t r = r0; r < r1; r += ROW_BLOCK)
        for (int64_t g = 0; g < m.kv_heads; ++g) job.items.push_back({t, r, std::min(r1, r + ROW_BLOCK), g, Work::ROWS});
  }
  if (!job.items.empty()) run_items(job, nt);
  merge_parts(job);
}

struct Scratch {
  std::vector<float> normed, qkv, attn, proj, gate_up, act;
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
  // y [n, rows] = x [n, k] @ W^T for W = (type, tiles) at plan fields [field, field + 1].
  bool operator()(const int64_t* L, int field, int64_t rows, int64_t k, const float* x, int64_t n, float* y) const {
    return nc_qg_matmul(static_cast<int>(L[field]), ptr<const uint8_t>(L[field + 1]), rows, k, x, 0, n, k, y, 0,
                        rows, nullptr, x2, threads) == 0;
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

int layer_forward(const Model& m, const int64_t* L, const Batch& b, float* x, Scratch& s, const Matmul& mm) {
  const int64_t n = b.n, H = m.hidden, qkv_w = m.q_size() + 2 * m.kv_size();
  for (int64_t t = 0; t < n; ++t) rms_norm(x + t * H, ptr<const float>(L[L_IN_NORM]), H, m.eps, &s.normed[t * H]);
  if (!mm.segments(L, L_QKV, QKV_SEGS, H, s.normed.data(), n, s.qkv.data(), qkv_w, ptr<const float>(L[L_QKV_BIAS])))
    return ERR_MATMUL;
  if (m.kv_f16)
    prepare_qkv<uint16_t>(m, L, b, s.qkv.data());
  else
    prepare_qkv<float>(m, L, b, s.qkv.data());
  s.attn_job.bind(m, b, s.qkv.data(), ptr<const void>(L[L_K_CACHE]), ptr<const void>(L[L_V_CACHE]), s.attn.data());
  attention(s.attn_job, mm.threads);
  if (!mm(L, L_O_TYPE, H, m.q_size(), s.attn.data(), n, s.proj.data())) return ERR_MATMUL;
  for (int64_t i = 0; i < n * H; ++i) x[i] += s.proj[i];

  for (int64_t t = 0; t < n; ++t) rms_norm(x + t * H, ptr<const float>(L[L_POST_NORM]), H, m.eps, &s.normed[t * H]);
  if (!mm.segments(L, L_GU, GU_SEGS, H, s.normed.data(), n, s.gate_up.data(), 2 * m.inter)) return ERR_MATMUL;
  for (int64_t t = 0; t < n; ++t) {
    const float* g = &s.gate_up[t * 2 * m.inter];
    silu_mul(g, g + m.inter, m.inter, &s.act[t * m.inter]);
  }
  if (!mm(L, L_DOWN_TYPE, H, m.inter, s.act.data(), n, s.proj.data())) return ERR_MATMUL;
  for (int64_t i = 0; i < n * H; ++i) x[i] += s.proj[i];
  return OK;
}

thread_local Scratch g_scratch;

}  // namespace

extern "C" {

int nc_dec_header_fields() { return H_FIELDS; }
int nc_dec_layer_fields() { return L_FIELDS; }

// x [n, hidden] fp32: the embedded tokens in, the final-normed hidden states out. Rows as in Batch.
int nc_dec_forward(const int64_t* plan, float* x, int64_t n, const int64_t* positions, const int64_t* slots,
                   int64_t seqs, const int32_t* cu_q, const int32_t* block_tables, int64_t table_stride,
                   const int32_t* context_lens, int x2, int threads) {
  const Model m(plan);
  for (int64_t t = 0; t < n; ++t)
    if (positions[t] < 0 || positions[t] >= m.max_pos) return ERR_POSITION;
  if (seqs < 1 || cu_q[0] != 0 || cu_q[seqs] != n) return ERR_BATCH;
  for (int64_t t = 0; t < seqs; ++t)
    if (cu_q[t + 1] <= cu_q[t] || context_lens[t] != positions[cu_q[t + 1] - 1] + 1) return ERR_BATCH;
  const Batch b{n, positions, slots, seqs, cu_q, block_tables, table_stride, context_lens};
  Scratch& s = g_scratch;
  s.fit(m, n);
  const Matmul mm{x2, threads};
  for (int64_t l = 0; l < m.layers; ++l) {
    const int rc = layer_forward(m, plan + H_FIELDS + l * L_FIELDS, b, x, s, mm);
    if (rc) return rc;
  }
  for (int64_t t = 0; t < n; ++t) rms_norm(x + t * m.hidden, m.final_norm, m.hidden, m.eps, x + t * m.hidden);
  return OK;
}

}  // extern "C"
