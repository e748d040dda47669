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

struct AttnJob {
  const Model* m;
  const Batch* b;
  const float* qkv;
  const float* k_cache;
  const float* v_cache;
  float* out;  // [n, heads * head_dim]
  float scale;
};

// Softmax attention of one token's query heads of KV head g over its sequence's cached keys.
void attend(const AttnJob& j, int64_t t, int64_t g, std::vector<float>& scores) {
  const Model& m = *j.m;
  const int64_t group = m.heads / m.kv_heads, d = m.head_dim, len = j.b->context_lens[t];
  const int32_t* table = j.b->block_tables + t * j.b->table_stride;
  const float* q = j.qkv + t * (m.q_size() + 2 * m.kv_size()) + g * group * d;
  float* out = j.out + t * m.q_size() + g * group * d;
  scores.resize(group * len);
  auto row = [&](const float* cache, int64_t p) {
    return cache + ((table[p / m.block_size] * m.block_size + p % m.block_size) * m.kv_heads + g) * d;
  };
  for (int64_t p = 0; p < len; ++p) {
    const float* k = row(j.k_cache, p);
    for (int64_t h = 0; h < group; ++h) scores[h * len + p] = dot(q + h * d, k, d) * j.scale;
  }
  for (int64_t h = 0; h < group; ++h) {
    float* s = scores.data() + h * len;
    const float mx = *std::max_element(s, s + len);
    float sum = 0.f;
    for (int64_t p = 0; p < len; ++p) sum += (s[p] = std::exp(s[p] - mx));
    const float inv = 1.0f / sum;
    for (int64_t p = 0; p < len; ++p) s[p] *= inv;
  }
  std::fill(out, out + group * d, 0.f);
  for (int64_t p = 0; p < len; ++p) {
    const float* v = row(j.v_cache, p);
    for (int64_t h = 0; h < group; ++h) {
      const float w = scores[h * len + p];
      float* o = out + h * d;
      for (int64_t i = 0; i < d; ++i) o[i] += w * v[i];
    }
  }
}

void attention(const AttnJob& job, int threads) {
  const Model& m = *job.m;
  int64_t keys = 0;
  for (int64_t t = 0; t < job.b->n; ++t) keys += job.b->context_lens[t];
  // Small contexts: a second thread costs more than the work (~16 KB of K/V per kv head per 64 keys).
  const int nt = keys * m.kv_size() < (64 << 10) ? 1 : threads;
  nc_qg_parallel_for(job.b->n * m.kv_heads, 1, nt, [](const void* ctx, int64_t i0, int64_t i1) {
    const AttnJob& j = *static_cast<const AttnJob*>(ctx);
    thread_local std::vector<float> scores;
    for (int64_t i = i0; i < i1; ++i) attend(j, i / j.m->kv_heads, i % j.m->kv_heads, scores);
  }, &job);
}

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

struct Scratch {
  std::vector<float> normed, qkv, attn, proj, gate_up, act;
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
  const AttnJob job{&m, &b, s.qkv.data(), ptr<const float>(L[L_K_CACHE]), ptr<const float>(L[L_V_CACHE]),
                    s.attn.data(), 1.0f / std::sqrt(static_cast<float>(m.head_dim))};
  attention(job, mm.threads);
  if (!mm(L, L_O_TYPE, H, m.q_size(), s.attn.data(), n, s.proj.data())) return ERR_MATMUL;
  for (int64_t i = 0; i < n * H; ++i) x[i] += s.proj[i];

  for (int64_t t = 0; t < n; ++t) rms_norm(x + t * H, ptr<const float>(L[L_POST_NORM]), H, m.eps, &s.normed[t * H]);
  if (!mm(L, L_GU_TYPE, 2 * m.inter, H, s.normed.data(), n, s.gate_up.data())) return ERR_MATMUL;
  for (int64_t t = 0; t < n; ++t) {
    const float* g = &s.gate_up[t * 2 * m.inter];
    for (int64_t i = 0; i < m.inter; ++i) s.act[t * m.inter + i] = silu(g[i]) * g[m.inter + i];
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
