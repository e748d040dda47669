// Routed MoE experts on the CPU, computed from their GGML blocks where they lie (a GGUF memory map):
//
//   out[t] = sum_j weights[t, j] * (down_e act(gate_e x_t + bg_e, up_e x_t + bu_e) + bd_e),   e = ids[t, j]
//
// with the biases optional (absent: zero) and act one of
//   ACT_SILU        silu(g) * u                                           (the SwiGLU of most MoE models)
//   ACT_SWIGLU_OAI  (clamp(u, -limit, limit) + 1) * (g' * sigmoid(alpha g')),  g' = min(g, limit)   (gpt-oss)
//
// on the matmul library's raw-row kernels and thread pool (qgemv.h): activations quantized as for every
// other matmul (one or two levels), each token once; each selected expert's rows read once per call for
// all the tokens routed to it. Two jobs on the pool, each over all active experts at once:
//   1. gate|up rows of each expert x its tokens -> gu [pairs, 2I]; whoever completes an expert's last rows
//      adds the biases, forms act(gate, up) for its tokens and quantizes it for the down projection;
//   2. down rows in groups: each group walks the experts in ascending order and adds weight x (result +
//      down bias) into out, so every output element sums its experts in one fixed order.
// A token's result depends on that token alone (its x, experts and weights): the same in any batch, on
// any number of threads, and on every code path (the kernels are bit-identical across them).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "moe.h"
#include "qgemv.h"

namespace {

enum : int { OK = 0, ERR_TYPE = 1, ERR_SHAPE = 2, ERR_EXPERT_ID = 3, ERR_ACTIVATION = 4 };
enum : int { ACT_SILU = 0, ACT_SWIGLU_OAI = 1 };
constexpr int64_t GROUP = 16;                  // weight rows per work item
constexpr int64_t MIN_PARALLEL_BYTES = 64 << 10;  // below this, a second thread costs more than it saves
// Chunks of work items per thread: few and large where every item costs alike (each thread streams its
// share of the rows), more where the experts' token counts differ (phase 1 of a prefill), for balance.
constexpr int64_t CHUNKS_PER_THREAD = 2, UNEVEN_CHUNKS_PER_THREAD = 8;

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

// gpt-oss's clamped SwiGLU, in the operation order of transformers' GptOssExperts (and moe_cpu.clamped_swiglu):
// glu = g * sigmoid(g * alpha), (u + 1) * glu.
inline float swiglu_oai(float g, float u, float alpha, float limit) {
  g = std::min(g, limit);
  u = std::min(std::max(u, -limit), limit);
  const float glu = g * (1.0f / (1.0f + std::exp(-(g * alpha))));
  return (u + 1.0f) * glu;
}

int64_t chunk_of(int64_t items, int threads, int64_t per_thread = CHUNKS_PER_THREAD) {
  return std::max<int64_t>(1, (items + threads * per_thread - 1) / (threads * per_thread));
}

}  // namespace

extern "C" {

// out [T, H] as above for x [T, H], ids / weights [T, k] (experts [0, E)); act (ACT_*) with alpha and limit
// (ACT_SWIGLU_OAI); biases gate_bias / up_bias [E, I] and down_bias [E, H], each may be null; x2: two-level
// activations.
int nc_moe_forward(const float* x, int64_t T, int64_t H, const int64_t* ids, const float* weights, int64_t k,
                   int64_t E, const NcMat* gate, const NcMat* up, const NcMat* down, float* out, int act, float alpha,
                   float limit, const float* gate_bias, const float* up_bias, const float* down_bias, int x2,
                   int threads) {
  using namespace nc::qg;
  if (act != ACT_SILU && act != ACT_SWIGLU_OAI) return ERR_ACTIVATION;
  for (const NcMat* m : {gate, up, down})
    if (!raw_type(m->type)) return ERR_TYPE;
  const int64_t I = gate->rows;
  if (up->rows != I || gate->cols != H || up->cols != H || down->rows != H || down->cols != I) return ERR_SHAPE;
  for (const NcMat* m : {gate, up, down})
    if (m->cols % block_elems(m->type) || m->cols % 32) return ERR_SHAPE;
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
  std::vector<int64_t> pair_tok(P), pairs(P), fill(offs.begin(), offs.end() - 1);
  std::vector<float> pair_w(P);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t slot = fill[ids[p]]++;
    pair_tok[slot] = p / k;
    pair_w[slot] = weights[p];
  }
  std::iota(pairs.begin(), pairs.end(), 0);
  std::vector<int64_t> active;
  int64_t max_tokens = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (offs[e + 1] > offs[e]) active.push_back(e);
    max_tokens = std::max(max_tokens, offs[e + 1] - offs[e]);
  }
  const int64_t n_active = static_cast<int64_t>(active.size());
  auto bytes = [](const NcMat* m, int64_t rows) { return rows * (m->cols / block_elems(m->type)) * block_bytes(m->type); };
  const int nt = bytes(gate, 2 * I) * n_active < MIN_PARALLEL_BYTES ? 1 : std::max(1, threads);

  // The calling thread's buffers, reused. (References: a lambda run by a pool thread that named a
  // thread_local itself would get that thread's.)
  thread_local ActBuffer tls_xq, tls_hq;
  thread_local std::vector<float> tls_gu;
  ActBuffer &xq = tls_xq, &hq = tls_hq;
  std::vector<float>& gu = tls_gu;
  xq.reserve(T, H, x2, wide_codes(max_tokens));
  hq.reserve(P, I, x2, wide_codes(max_tokens));
  const Acts xa = xq.view(), ha = hq.view();
  parallel_for(T, T < 32 ? T : 8, T < 32 ? 1 : nt, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) xq.quantize(t, x + t * H);
  });

  // 1. gate | up rows (I a multiple of 32: a group is all gate or all up rows).
  if (static_cast<int64_t>(gu.size()) < P * 2 * I) gu.resize(P * 2 * I);
  std::unique_ptr<std::atomic<int64_t>[]> groups_done(new std::atomic<int64_t>[n_active]);
  for (int64_t a = 0; a < n_active; ++a) groups_done[a].store(0, std::memory_order_relaxed);
  const int64_t gu_groups = 2 * I / GROUP;
  const int64_t gu_chunk = chunk_of(n_active * gu_groups, nt, max_tokens > 1 ? UNEVEN_CHUNKS_PER_THREAD : CHUNKS_PER_THREAD);
  parallel_for(n_active * gu_groups, gu_chunk, nt, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t a = item / gu_groups, e = active[a], r0 = item % gu_groups * GROUP;
      const int64_t p0 = offs[e], n = offs[e + 1] - p0;
      // gate rows or up rows; this chunk reads its matrix's rows up to pf_end next
      const NcMat* m = r0 < I ? gate : up;
      const int64_t end = (std::min(i1, (a + 1) * gu_groups) - a * gu_groups) * GROUP;
      const int64_t m0 = r0 < I ? r0 : r0 - I, pf_end = r0 < I ? std::min(I, end) : end - I;
      matmul_rows(m->type, m->data + e * m->expert_stride, m->row_stride, m0, m0 + GROUP, xa, pair_tok.data() + p0,
                  n, gu.data() + p0 * 2 * I + r0, 2 * I, pf_end);
      if (groups_done[a].fetch_add(1, std::memory_order_acq_rel) + 1 == gu_groups) {
        const float* bg = gate_bias ? gate_bias + e * I : nullptr;
        const float* bu = up_bias ? up_bias + e * I : nullptr;
        for (int64_t p = p0; p < p0 + n; ++p) {  // act(gate, up) over the gate half, then quantized
          float* g = gu.data() + p * 2 * I;
          float* u = g + I;
          if (bg)
            for (int64_t i = 0; i < I; ++i) g[i] += bg[i];
          if (bu)
            for (int64_t i = 0; i < I; ++i) u[i] += bu[i];
          if (act == ACT_SILU)
            for (int64_t i = 0; i < I; ++i) g[i] = silu(g[i]) * u[i];
          else
            for (int64_t i = 0; i < I; ++i) g[i] = swiglu_oai(g[i], u[i], alpha, limit);
          hq.quantize(p, g);
        }
      }
    }
  });

  // 2. down rows, each group over the experts in ascending order.
  const int64_t down_groups = (H + GROUP - 1) / GROUP;
  parallel_for(down_groups, chunk_of(down_groups, nt), nt, [&](int64_t i0, int64_t i1) {
    const int64_t r0 = i0 * GROUP, r1 = std::min(H, i1 * GROUP), nr = r1 - r0;
    std::vector<float> y(max_tokens * nr);
    for (int64_t e : active) {
      const int64_t p0 = offs[e], n = offs[e + 1] - p0;
      matmul_rows(down->type, down->data + e * down->expert_stride, down->row_stride, r0, r1, ha, pairs.data() + p0,
                  n, y.data(), nr, r1);
      const float* bd = down_bias ? down_bias + e * H + r0 : nullptr;
      for (int64_t j = 0; j < n; ++j) {
        float* o = out + pair_tok[p0 + j] * H + r0;
        const float w = pair_w[p0 + j];
        if (bd)
          for (int64_t r = 0; r < nr; ++r) o[r] += w * (y[j * nr + r] + bd[r]);
        else
          for (int64_t r = 0; r < nr; ++r) o[r] += w * y[j * nr + r];
      }
    }
  });
  return OK;
}

}  // extern "C"
