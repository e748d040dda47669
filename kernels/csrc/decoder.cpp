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
enum : int { OK = 0, ERR_MATMUL = 3, ERR_POSITION = 4, ERR_BATCH = 5 };

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
// Work items for the pool, per sequence by its query rows in this step:
// - one row (decode): its keys are cut into parts (several when there are fewer sequences than
//   threads, "split-K" as in flash-decoding). A part keeps, per query head, the max m of its scores,
//   the sum l of exp(score - m) and the unnormalized output o; a sequence's parts are merged with
//   exp(m - M) weights. Keys are read a whole cached row (all KV heads) at a time, block by block.
// - several rows (prefill chunk): first the sequence's keys are transposed per KV head into tiles of
//   16 (one item per KV head), then blocks of up to ROW_BLOCK rows x one KV head compute the scores
//   of all their query heads against those tiles (an outer-product form that vectorizes over keys),
//   a causal softmax per row and the weighted sum of values.
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
  const float* k_cache;
  const float* v_cache;
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

  void bind(const Model& model, const Batch& batch, const float* q, const float* kc, const float* vc,
            float* dst) {
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

// Scores, exp and weighted values of keys [p0, p1) of one-row sequence t, for all query heads.
void attend_part(AttnJob& j, const Item& it, std::vector<float>& scores) {
  const Model& m = *j.m;
  const int64_t heads = m.heads, group = m.heads / m.kv_heads, d = m.head_dim, bs = m.block_size;
  const int64_t p0 = it.lo, p1 = it.hi, len = p1 - p0, kv = m.kv_size();
  const int64_t t = it.seq;
  const float* q = j.qkv + j.b->cu_q[t] * j.width();
  scores.resize(heads * len);
  auto for_keys = [&](auto&& body) {  // body(p - p0, slot of position p), block by block
    for (int64_t p = p0; p < p1;) {
      const int64_t end = std::min(p1, (p / bs + 1) * bs), base = j.slot(t, p) - p;
      for (; p < end; ++p) body(p - p0, base + p);
    }
  };
  for_keys([&](int64_t i, int64_t slot) {
    const float* krow = j.k_cache + slot * kv;
    for (int64_t h = 0; h < heads; ++h) scores[h * len + i] = dot(q + h * d, krow + h / group * d, d) * j.scale;
  });
  float* ml = &j.ml[(it.index * heads) * 2];
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores.data() + h * len;
    ml[2 * h] = *std::max_element(s, s + len);
    ml[2 * h + 1] = exp_shifted(s, len, ml[2 * h]);
  }
  float* o = &j.o[it.index * heads * d];
  std::fill(o, o + heads * d, 0.f);
  for_keys([&](int64_t i, int64_t slot) {
    const float* vrow = j.v_cache + slot * kv;
    for (int64_t h = 0; h < heads; ++h) {
      const float w = scores[h * len + i];
      const float* v = vrow + h / group * d;
      float* oh = o + h * d;
      for (int64_t e = 0; e < d; ++e) oh[e] += w * v[e];
    }
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
// kt[e][c]. NV independent accumulators: one would wait on its own FMA latency every step.
template <int NV>
inline void tile_scores(const float* const* q, const float* kt, int64_t d, float scale, float* const* s) {
#if defined(__AVX512F__)
  __m512 acc[NV];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t e = 0; e < d; ++e) {
    const __m512 k = _mm512_loadu_ps(kt + e * KEY_TILE);
    for (int v = 0; v < NV; ++v) acc[v] = _mm512_fmadd_ps(_mm512_set1_ps(q[v][e]), k, acc[v]);
  }
  for (int v = 0; v < NV; ++v) _mm512_storeu_ps(s[v], _mm512_mul_ps(acc[v], _mm512_set1_ps(scale)));
#else
  for (int v = 0; v < NV; ++v) {
    float acc[KEY_TILE] = {};
    for (int64_t e = 0; e < d; ++e)
      for (int64_t c = 0; c < KEY_TILE; ++c) acc[c] += q[v][e] * kt[e * KEY_TILE + c];
    for (int64_t c = 0; c < KEY_TILE; ++c) s[v][c] = acc[c] * scale;
  }
#endif
}

// out[v][e] = sum_p w[v][p] * V[slot[p]][e] for NV query vectors over the same keys (one head's
// values, row stride `stride` floats): each value row is loaded once for all NV.
template <int D, int NV>
void weighted_values(const float* const* w, int64_t n, const float* v, int64_t stride, const int64_t* slots,
                     int64_t d, float* const* out) {
#if defined(__AVX512F__)
  if constexpr (D > 0 && D % 16 == 0) {
    __m512 acc[NV][D / 16];
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    for (int64_t p = 0; p < n; ++p) {
      const float* row = v + slots[p] * stride;
      __m512 vals[D / 16];
      for (int c = 0; c < D / 16; ++c) vals[c] = _mm512_loadu_ps(row + 16 * c);
      for (int u = 0; u < NV; ++u) {
        const __m512 wp = _mm512_set1_ps(w[u][p]);
        for (int c = 0; c < D / 16; ++c) acc[u][c] = _mm512_fmadd_ps(wp, vals[c], acc[u][c]);
      }
    }
    for (int u = 0; u < NV; ++u)
      for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(out[u] + 16 * c, acc[u][c]);
    return;
  }
#endif
  for (int u = 0; u < NV; ++u) {
    std::fill(out[u], out[u] + d, 0.f);
    for (int64_t p = 0; p < n; ++p) {
      const float* row = v + slots[p] * stride;
      for (int64_t e = 0; e < d; ++e) out[u][e] += w[u][p] * row[e];
    }
  }
}

// Keys of several-row sequence t, KV head g, transposed into tiles: kt[e][c] = K[16 tile + c][g][e]
// (positions past the last key repeat it; their scores are never used).
void transpose_keys(AttnJob& j, int64_t t, int64_t g) {
  const int64_t d = j.m->head_dim, kv = j.m->kv_size(), keys = j.b->context_lens[t];
  const int64_t* slots = &j.slots[j.slots_at[t]];
  for (int64_t tile = 0; tile < j.tiles(t); ++tile) {
    float* kt = const_cast<float*>(j.key_tile(t, g, tile));
    for (int64_t c = 0; c < KEY_TILE; ++c) {
      const float* krow = j.k_cache + slots[std::min(tile * KEY_TILE + c, keys - 1)] * kv + g * d;
      for (int64_t e = 0; e < d; ++e) kt[e * KEY_TILE + c] = krow[e];
    }
  }
}

// Causal attention of batch rows [lo, hi) (consecutive positions of one sequence) for the query
// heads of KV head g. D: the head dimension (a constant for the common sizes, so the inner loops
// have fixed trip counts; 0 = read it from the model).
template <int D>
void attend_rows(AttnJob& j, const Item& it, std::vector<float>& scores) {
  const Model& m = *j.m;
  const int64_t d = D ? D : m.head_dim, group = m.heads / m.kv_heads, g = it.index, kv = m.kv_size();
  const int64_t nq = (it.hi - it.lo) * group;             // query vectors: (row, head of the group)
  const int64_t keys = j.b->positions[it.hi - 1] + 1;     // the last row sees the most keys
  const int64_t ld = (keys + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
  const int64_t* slots = &j.slots[j.slots_at[it.seq]];
  scores.resize(nq * ld);
  auto query = [&](int64_t i) { return j.qkv + (it.lo + i / group) * j.width() + (g * group + i % group) * d; };

  constexpr int QV = 8;   // query vectors per pass over a key tile
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
  for (int64_t row = it.lo; row < it.hi; ++row) {   // a row's query heads share their keys
    const int64_t seen = j.b->positions[row] + 1;
    const float* w[8];
    float* out[8];
    for (int64_t h = 0; h < group; ++h) {
      float* s = &scores[((row - it.lo) * group + h) * ld];
      const float inv = 1.0f / exp_shifted(s, seen, *std::max_element(s, s + seen));
      for (int64_t p = 0; p < seen; ++p) s[p] *= inv;
    }
    constexpr int PV = D > 64 ? 2 : 4;   // accumulators: PV x D / 16 registers
    for (int64_t h0 = 0; h0 < group; h0 += PV) {
      const int64_t nv = std::min<int64_t>(PV, group - h0);
      for (int64_t u = 0; u < nv; ++u) {
        w[u] = &scores[((row - it.lo) * group + h0 + u) * ld];
        out[u] = j.out + row * m.q_size() + (g * group + h0 + u) * d;
      }
      const float* vbase = j.v_cache + g * d;
      switch (nv) {
        case 4: weighted_values<D, 4>(w, seen, vbase, kv, slots, d, out); break;
        case 3: weighted_values<D, 3>(w, seen, vbase, kv, slots, d, out); break;
        case 2: weighted_values<D, 2>(w, seen, vbase, kv, slots, d, out); break;
        default: weighted_values<D, 1>(w, seen, vbase, kv, slots, d, out);
      }
    }
  }
}

void run_item(AttnJob& j, const Item& it) {
  thread_local std::vector<float> scores;
  if (it.work == Work::PART)
    attend_part(j, it, scores);
  else if (it.work == Work::TRANSPOSE)
    transpose_keys(j, it.seq, it.index);
  else if (j.m->head_dim == 64)
    attend_rows<64>(j, it, scores);
  else if (j.m->head_dim == 128)
    attend_rows<128>(j, it, scores);
  else
    attend_rows<0>(j, it, scores);
}

void run_items(AttnJob& job, int threads) {
  nc_qg_parallel_for(static_cast<int64_t>(job.items.size()), 1, threads, [](const void* ctx, int64_t i0, int64_t i1) {
    AttnJob& j = *const_cast<AttnJob*>(static_cast<const AttnJob*>(ctx));
    for (int64_t i = i0; i < i1; ++i) run_item(j, j.items[i]);
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
  s.attn_job.bind(m, b, s.qkv.data(), ptr<const float>(L[L_K_CACHE]), ptr<const float>(L[L_V_CACHE]),
                  s.attn.data());
  attention(s.attn_job, mm.threads);
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
