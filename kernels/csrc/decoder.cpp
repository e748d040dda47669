// One decode step of a dense Llama / Qwen2 / Qwen3 decoder stack on the CPU, all layers in one call.
//
// Why: at one token per sequence the matmuls read ~80 MB of quantized weights in ~5 ms, while the
// same step as ~25 torch ops per layer spends as long again in dispatch and small-op overhead
// (rms_norm, RoPE, KV gather, softmax, casts). Here each layer is
//   x += o_proj(attn(rope(norm_qk(qkv_proj(rms(x))))));  x += down(silu(gate) * up(rms(x)))
// with the matmuls on the int8-activation kernels of qgemv.cpp (nc_qg_matmul, same library, same
// thread pool) and everything else in plain loops over the step's few rows. Arithmetic is fp32 in
// the order of the torch path (the compiler may not contract a*b+c: -ffp-contract=off), so results
// match it to summation-order rounding.
//
// The model is described once by an int64 "plan" (pointers as integers, see the layout below) built
// in Python from the model's own tensors; the KV cache is the engine's paged fp32 cache
// [num_blocks, block_size, kv_heads, head_dim] per layer, written and read in place.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

extern "C" int nc_qg_matmul(int type, const uint8_t* w, int64_t rows, int64_t k, const void* x, int x_bf16,
                            int64_t n, int64_t ldx, void* y, int y_bf16, int64_t ldy, const float* bias, int x2,
                            int threads);
extern "C" void nc_qg_parallel_for(int64_t items, int64_t chunk, int threads,
                                   void (*fn)(const void*, int64_t, int64_t), const void* ctx);

namespace {

// Plan layout (int64): header, then LAYER_FIELDS per layer. Weight = (ggml type, packed tiles).
enum Header : int {
  H_LAYERS, H_HIDDEN, H_HEADS, H_KV_HEADS, H_HEAD_DIM, H_INTER, H_ROT_DIM, H_BLOCK_SIZE, H_MAX_POS,
  H_COS, H_SIN, H_FINAL_NORM, H_EPS_BITS, H_FIELDS
};
enum Layer : int {
  L_IN_NORM, L_POST_NORM, L_QKV_TYPE, L_QKV_W, L_QKV_BIAS, L_Q_NORM, L_K_NORM, L_O_TYPE, L_O_W,
  L_GU_TYPE, L_GU_W, L_DOWN_TYPE, L_DOWN_W, L_K_CACHE, L_V_CACHE, L_FIELDS
};
enum : int { OK = 0, ERR_MATMUL = 3, ERR_POSITION = 4 };

template <class T>
T* ptr(int64_t v) {
  return reinterpret_cast<T*>(static_cast<intptr_t>(v));
}

struct Model {
  int64_t layers, hidden, heads, kv_heads, head_dim, inter, rot_dim, block_size, max_pos;
  const float *cos, *sin, *final_norm;
  float eps;

  explicit Model(const int64_t* p)
      : layers(p[H_LAYERS]), hidden(p[H_HIDDEN]), heads(p[H_HEADS]), kv_heads(p[H_KV_HEADS]),
        head_dim(p[H_HEAD_DIM]), inter(p[H_INTER]), rot_dim(p[H_ROT_DIM]), block_size(p[H_BLOCK_SIZE]),
        max_pos(p[H_MAX_POS]), cos(ptr<const float>(p[H_COS])), sin(ptr<const float>(p[H_SIN])),
        final_norm(ptr<const float>(p[H_FINAL_NORM])) {
    double e;
    std::memcpy(&e, &p[H_EPS_BITS], sizeof e);
    eps = static_cast<float>(e);
  }
  int64_t q_size() const { return heads * head_dim; }
  int64_t kv_size() const { return kv_heads * head_dim; }
};

// The step's sequences: one query row each.
struct Batch {
  int64_t n;
  const int64_t* positions;
  const int64_t* slots;
  const int32_t* block_tables;
  int64_t table_stride;
  const int32_t* context_lens;
};

// Sum of a[i] * b[i] in 16 independent fp32 lanes (vectorizes without reassociation flags).
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int j = 0; j < 16; ++j) s += acc[j];
  return s;
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

// Per-token work before attention: q/k head norms, RoPE, K/V written to their cache slots.
void prepare_qkv(const Model& m, const int64_t* L, const Batch& b, float* qkv) {
  const int64_t width = m.q_size() + 2 * m.kv_size();
  const float* q_norm = ptr<const float>(L[L_Q_NORM]);
  const float* k_norm = ptr<const float>(L[L_K_NORM]);
  float* k_cache = ptr<float>(L[L_K_CACHE]);
  float* v_cache = ptr<float>(L[L_V_CACHE]);
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
    std::memcpy(k_cache + slot * m.kv_size(), row + m.q_size(), m.kv_size() * sizeof(float));
    std::memcpy(v_cache + slot * m.kv_size(), row + m.q_size() + m.kv_size(), m.kv_size() * sizeof(float));
  }
}

// ------------------------------------------------------------------ exp
// exp over an array (attention probabilities, SiLU): AVX-512 where compiled in, else std::exp.
// exp(x) = 2^n e^r with n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), e^r by Cephes'
// degree-6 polynomial: within 2 ulp of std::exp for x in [-87, 88].
#if defined(__AVX512F__)
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}
#endif

// s[i] = exp(s[i] - shift); returns the sum.
float exp_shifted(float* s, int64_t n, float shift) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  const __m512 sh = _mm512_set1_ps(shift);
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), sh));
    _mm512_storeu_ps(s + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (i < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), sh));
    _mm512_mask_storeu_ps(s + i, k, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
    i = n;
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) sum += (s[i] = std::exp(s[i] - shift));
  return sum;
}

// out[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u.
void silu_mul(const float* g, const float* u, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

// ------------------------------------------------------------------ attention
// Each sequence's keys are cut into parts (one per item of the pool: several when there are fewer
// sequences than threads, "split-K" as in flash-decoding). A part keeps, per query head, the running
// max m, the sum l of exp(score - m) and the unnormalized output o; parts of a sequence are merged
// with their exp(m - M) weights. Keys are read a whole cached token row (all KV heads) at a time,
// straight through each block.
struct AttnJob {
  const Model* m;
  const Batch* b;
  const float* qkv;
  const float* k_cache;
  const float* v_cache;
  float scale;
  std::vector<int64_t> first_part;  // [n + 1]: parts of sequence t are first_part[t] .. first_part[t + 1]
  int64_t part_keys = 0;            // keys per part
  std::vector<float> ml;            // [parts, heads, 2]: m, l
  std::vector<float> o;             // [parts, heads, head_dim]

  void bind(const Model& model, const Batch& batch, const float* q, const float* kc, const float* vc) {
    m = &model;
    b = &batch;
    qkv = q;
    k_cache = kc;
    v_cache = vc;
    scale = 1.0f / std::sqrt(static_cast<float>(model.head_dim));
  }
};

// Scores, exp and weighted values of keys [p0, p1) of sequence t for all query heads.
void attend_part(AttnJob& j, int64_t t, int64_t part, int64_t p0, int64_t p1, std::vector<float>& scores) {
  const Model& m = *j.m;
  const int64_t heads = m.heads, group = m.heads / m.kv_heads, d = m.head_dim, bs = m.block_size;
  const int64_t len = p1 - p0, kv = m.kv_size();
  const int32_t* table = j.b->block_tables + t * j.b->table_stride;
  const float* q = j.qkv + t * (m.q_size() + 2 * kv);
  scores.resize(heads * len);
  auto for_rows = [&](auto&& body) {  // body(p - p0, cached row of position p), block by block
    for (int64_t p = p0; p < p1;) {
      const int64_t blk = p / bs, end = std::min(p1, (blk + 1) * bs);
      const int64_t base = static_cast<int64_t>(table[blk]) * bs - blk * bs;
      for (; p < end; ++p) body(p - p0, base + p);
    }
  };
  for_rows([&](int64_t i, int64_t slot) {
    const float* krow = j.k_cache + slot * kv;
    for (int64_t h = 0; h < heads; ++h) scores[h * len + i] = dot(q + h * d, krow + h / group * d, d) * j.scale;
  });
  float* ml = &j.ml[(part * heads) * 2];
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores.data() + h * len;
    ml[2 * h] = *std::max_element(s, s + len);
    ml[2 * h + 1] = exp_shifted(s, len, ml[2 * h]);
  }
  float* o = &j.o[part * heads * d];
  std::fill(o, o + heads * d, 0.f);
  for_rows([&](int64_t i, int64_t slot) {
    const float* vrow = j.v_cache + slot * kv;
    for (int64_t h = 0; h < heads; ++h) {
      const float w = scores[h * len + i];
      const float* v = vrow + h / group * d;
      float* oh = o + h * d;
      for (int64_t e = 0; e < d; ++e) oh[e] += w * v[e];
    }
  });
}

// out [n, heads * head_dim] = softmax(q k^T * scale) v per sequence over its cached keys.
void attention(AttnJob& job, float* out, int threads) {
  const Model& m = *job.m;
  const Batch& b = *job.b;
  int64_t keys = 0, longest = 0;
  for (int64_t t = 0; t < b.n; ++t) {
    keys += b.context_lens[t];
    longest = std::max<int64_t>(longest, b.context_lens[t]);
  }
  // Small contexts: a second thread costs more than the work (~16 KB of K/V per 64 keys here).
  const int nt = keys * m.kv_size() < (32 << 10) ? 1 : threads;
  job.part_keys = std::max<int64_t>(1, longest);
  if (b.n < 2 * nt)  // too few sequences to keep every thread busy: split the keys too
    job.part_keys = std::max<int64_t>(m.block_size, (longest + 2 * nt - 1) / (2 * nt));
  job.first_part.assign(b.n + 1, 0);
  for (int64_t t = 0; t < b.n; ++t)
    job.first_part[t + 1] = job.first_part[t] + (b.context_lens[t] + job.part_keys - 1) / job.part_keys;
  const int64_t parts = job.first_part[b.n];
  job.ml.resize(parts * m.heads * 2);
  job.o.resize(parts * m.heads * m.head_dim);
  nc_qg_parallel_for(parts, 1, nt, [](const void* ctx, int64_t i0, int64_t i1) {
    AttnJob& j = *const_cast<AttnJob*>(static_cast<const AttnJob*>(ctx));
    thread_local std::vector<float> scores;
    for (int64_t part = i0; part < i1; ++part) {
      const int64_t t = std::upper_bound(j.first_part.begin(), j.first_part.end(), part) - j.first_part.begin() - 1;
      const int64_t p0 = (part - j.first_part[t]) * j.part_keys;
      attend_part(j, t, part, p0, std::min<int64_t>(j.b->context_lens[t], p0 + j.part_keys), scores);
    }
  }, &job);
  const int64_t H = m.heads, d = m.head_dim;
  for (int64_t t = 0; t < b.n; ++t)
    for (int64_t h = 0; h < H; ++h) {
      float mx = -INFINITY, l = 0.f;
      for (int64_t part = job.first_part[t]; part < job.first_part[t + 1]; ++part)
        mx = std::max(mx, job.ml[(part * H + h) * 2]);
      float* dst = out + t * m.q_size() + h * d;
      std::fill(dst, dst + d, 0.f);
      for (int64_t part = job.first_part[t]; part < job.first_part[t + 1]; ++part) {
        const float w = std::exp(job.ml[(part * H + h) * 2] - mx);
        l += w * job.ml[(part * H + h) * 2 + 1];
        const float* o = &job.o[(part * H + h) * d];
        for (int64_t e = 0; e < d; ++e) dst[e] += w * o[e];
      }
      const float inv = 1.0f / l;
      for (int64_t e = 0; e < d; ++e) dst[e] *= inv;
    }
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
  // y [n, rows] = x [n, k] @ W^T (+ bias) for W = (type, tiles) at plan fields [type_field, type_field + 1].
  bool operator()(const int64_t* L, int type_field, int64_t rows, int64_t k, const float* x, int64_t n, float* y,
                  const float* bias = nullptr) const {
    return nc_qg_matmul(static_cast<int>(L[type_field]), ptr<const uint8_t>(L[type_field + 1]), rows, k, x, 0, n,
                        k, y, 0, rows, bias, x2, threads) == 0;
  }
};

int layer_forward(const Model& m, const int64_t* L, const Batch& b, float* x, Scratch& s, const Matmul& mm) {
  const int64_t n = b.n, H = m.hidden, qkv_w = m.q_size() + 2 * m.kv_size();
  for (int64_t t = 0; t < n; ++t) rms_norm(x + t * H, ptr<const float>(L[L_IN_NORM]), H, m.eps, &s.normed[t * H]);
  if (!mm(L, L_QKV_TYPE, qkv_w, H, s.normed.data(), n, s.qkv.data(), ptr<const float>(L[L_QKV_BIAS])))
    return ERR_MATMUL;
  prepare_qkv(m, L, b, s.qkv.data());
  s.attn_job.bind(m, b, s.qkv.data(), ptr<const float>(L[L_K_CACHE]), ptr<const float>(L[L_V_CACHE]));
  attention(s.attn_job, s.attn.data(), mm.threads);
  if (!mm(L, L_O_TYPE, H, m.q_size(), s.attn.data(), n, s.proj.data())) return ERR_MATMUL;
  for (int64_t i = 0; i < n * H; ++i) x[i] += s.proj[i];

  for (int64_t t = 0; t < n; ++t) rms_norm(x + t * H, ptr<const float>(L[L_POST_NORM]), H, m.eps, &s.normed[t * H]);
  if (!mm(L, L_GU_TYPE, 2 * m.inter, H, s.normed.data(), n, s.gate_up.data())) return ERR_MATMUL;
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

// x [n, hidden] fp32: the embedded tokens in, the final-normed hidden states out (one row per
// sequence). slots: flat cache slot of each token; block_tables [n, table_stride] int32.
int nc_dec_forward(const int64_t* plan, float* x, int64_t n, const int64_t* positions, const int64_t* slots,
                   const int32_t* block_tables, int64_t table_stride, const int32_t* context_lens, int x2,
                   int threads) {
  const Model m(plan);
  for (int64_t t = 0; t < n; ++t)
    if (positions[t] < 0 || positions[t] >= m.max_pos) return ERR_POSITION;
  const Batch b{n, positions, slots, block_tables, table_stride, context_lens};
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
