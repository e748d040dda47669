// Bit-exactness harness for the kernel library (kernels/csrc/*.cpp), built for any target (x86-64 natively,
// AArch64 with a cross compiler, run under qemu-aarch64) and linked against the library's sources:
//
//   g++ -O2 -std=c++20 -ffp-contract=off [target flags] -pthread tests/native/neon_harness.cpp \
//       kernels/csrc/qgemv.cpp kernels/csrc/decoder.cpp kernels/csrc/moe.cpp -o harness
//   ./harness [SECTION ...]     SECTION: matmul rows dequant moe decoder (default: all)
//
// Prints one line per case, "<case> <64-bit FNV-1a hash of the output's bytes>", then "simd <level>". Two builds
// agree bit for bit when their lines are equal: the tests compare each AArch64 build's lines with the x86 scalar
// build's (matmuls, raw-row matmuls, row reads, MoE experts) and with the x86 AVX2 build's (the fused decoder
// step, whose vector kernels use 8 fp32 lanes on both). Inputs come from a fixed splitmix64 stream (no libm, no
// <random>), so every build sees the same bytes.

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../../kernels/csrc/moe.h"

extern "C" {
int nc_qg_matmul(int type, const uint8_t* w, int64_t rows, int64_t k, const void* x, int x_bf16, int64_t n,
                 int64_t ldx, void* y, int y_bf16, int64_t ldy, const float* bias, int x2, int threads);
int nc_qg_repack(int type, const uint8_t* src, int64_t rows, int64_t k, int64_t row_stride, uint8_t* dst, int threads);
int64_t nc_qg_packed_bytes(int type, int64_t rows, int64_t k);
int nc_qg_dequant_rows(int type, const uint8_t* tiles, int64_t rows, int64_t k, const int64_t* ids, int64_t n,
                       float* out);
int nc_qg_matmul_rows(int type, const uint8_t* w, int64_t rows, int64_t k, int64_t row_stride, const float* x,
                      int64_t n, int64_t ldx, float* y, int64_t ldy, int x2, int threads);
int nc_qg_simd();
int nc_dec_header_fields();
int nc_dec_layer_fields();
int nc_dec_moe_fields();
int nc_dec_forward(const int64_t* plan, float* x, int64_t n, const int64_t* positions, const int64_t* slots,
                   int64_t seqs, const int32_t* cu_q, const int32_t* block_tables, int64_t table_stride,
                   const int32_t* context_lens, const int64_t* window_slots, const int32_t* window_tables,
                   int64_t window_table_stride, int x2, int threads);
int nc_dec_activation(int op, const float* x, int64_t ldx, const float* u, int64_t ldu, int64_t rows, int64_t cols,
                      float* out, int64_t ldo, int threads);
}

namespace {

enum : int { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12,
             Q5_K = 13, Q6_K = 14, BF16 = 30, MXFP4 = 39 };

struct Type {  // a GGML type: block bytes and elements, where its fp16 scales are (MXFP4: its E8M0 byte, -2)
  const char* name;
  int type, bytes, elems, d0, d1;
};
constexpr Type TYPES[] = {
    {"Q4_0", Q4_0, 18, 32, 0, -1},   {"Q4_1", Q4_1, 20, 32, 0, 2},    {"Q5_0", Q5_0, 22, 32, 0, -1},
    {"Q5_1", Q5_1, 24, 32, 0, 2},    {"Q8_0", Q8_0, 34, 32, 0, -1},   {"Q2_K", Q2_K, 84, 256, 80, 82},
    {"Q3_K", Q3_K, 110, 256, 108, -1}, {"Q4_K", Q4_K, 144, 256, 0, 2}, {"Q5_K", Q5_K, 176, 256, 0, 2},
    {"Q6_K", Q6_K, 210, 256, 208, -1}, {"MXFP4", MXFP4, 17, 32, -2, -1}, {"F32", F32, 4, 1, -1, -1},
    {"F16", F16, 2, 1, -1, -1},      {"BF16", BF16, 2, 1, -1, -1}};

const Type& type_of(int t) {
  for (const Type& ty : TYPES)
    if (ty.type == t) return ty;
  return TYPES[0];
}

uint64_t g_state = 0x9e3779b97f4a7c15ull;
uint64_t next() {  // splitmix64
  uint64_t z = (g_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
float uniform() { return static_cast<float>(static_cast<int32_t>(next() >> 40) - (1 << 23)) / (1 << 23); }  // [-1, 1)

std::vector<float> floats(size_t n, float scale = 1.0f) {
  std::vector<float> v(n);
  for (auto& f : v) f = scale * uniform();
  return v;
}

// fp16 / bf16 bits of a float, by truncation (any finite value will do: the kernels read what is stored)
uint16_t f16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u, e = (u >> 23) & 255;
  if (e < 113) return static_cast<uint16_t>(sign);  // tiny: zero
  return static_cast<uint16_t>(sign | ((e - 112) << 10) | ((u >> 13) & 0x3ff));
}

// Raw GGML rows of `type`: random bytes with finite scales of a few thousandths (dense: values in [-1, 1)).
std::vector<uint8_t> raw_rows(int type, int64_t rows, int64_t k) {
  const Type& ty = type_of(type);
  const int64_t nb = rows * (k / ty.elems);
  std::vector<uint8_t> b(nb * ty.bytes);
  if (ty.elems == 1) {
    for (int64_t i = 0; i < nb; ++i) {
      const float v = uniform();
      if (type == F32) {
        std::memcpy(&b[4 * i], &v, 4);
      } else {
        uint32_t u;
        std::memcpy(&u, &v, 4);
        const uint16_t h = type == F16 ? f16_bits(v) : static_cast<uint16_t>(u >> 16);
        std::memcpy(&b[2 * i], &h, 2);
      }
    }
    return b;
  }
  for (auto& x : b) x = static_cast<uint8_t>(next());
  for (int64_t i = 0; i < nb; ++i) {
    uint8_t* blk = &b[i * ty.bytes];
    if (ty.d0 == -2) blk[0] = static_cast<uint8_t>(119 + (next() & 3));  // 2^-9 .. 2^-6
    for (int off : {ty.d0, ty.d1})
      if (off >= 0) {
        const uint16_t h = static_cast<uint16_t>(0x2000 + (next() & 0x3ff));
        std::memcpy(blk + off, &h, 2);
      }
  }
  return b;
}

std::vector<uint8_t> packed(int type, const std::vector<uint8_t>& raw, int64_t rows, int64_t k) {
  std::vector<uint8_t> p(nc_qg_packed_bytes(type, rows, k));
  const Type& ty = type_of(type);
  if (nc_qg_repack(type, raw.data(), rows, k, k / ty.elems * ty.bytes, p.data(), 1)) std::abort();
  return p;
}

void report(const std::string& label, const void* data, size_t bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < bytes; ++i) h = (h ^ static_cast<const uint8_t*>(data)[i]) * 0x100000001b3ull;
  std::printf("%s %016" PRIx64 "\n", label.c_str(), h);
}

template <class... A>
std::string fmt(const char* f, A... a) {
  char buf[256];
  std::snprintf(buf, sizeof buf, f, a...);
  return buf;
}

constexpr int64_t NS[] = {1, 3, 8, 17};

// nc_qg_matmul on every type, rows of x, levels, threads, and bf16 in / out with a bias.
void matmul() {
  const int64_t rows = 72, k = 512;
  for (const Type& ty : TYPES) {
    const std::vector<uint8_t> w = packed(ty.type, raw_rows(ty.type, rows, k), rows, k);
    const std::vector<float> x = floats(17 * k, 2.0f), bias = floats(rows);
    std::vector<uint16_t> xb(17 * k);
    for (size_t i = 0; i < xb.size(); ++i) {
      uint32_t u;
      std::memcpy(&u, &x[i], 4);
      xb[i] = static_cast<uint16_t>(u >> 16);
    }
    for (int64_t n : NS)
      for (int lv = 1; lv <= 2; ++lv)
        for (int th = 1; th <= 2; ++th) {
          std::vector<float> y(n * rows);
          if (nc_qg_matmul(ty.type, w.data(), rows, k, x.data(), 0, n, k, y.data(), 0, rows, nullptr, lv == 2, th))
            std::abort();
          report(fmt("matmul %s n=%d levels=%d threads=%d", ty.name, int(n), lv, th), y.data(), y.size() * 4);
        }
    std::vector<uint16_t> yb(8 * rows);
    if (nc_qg_matmul(ty.type, w.data(), rows, k, xb.data(), 1, 8, k, yb.data(), 1, rows, bias.data(), 1, 2))
      std::abort();
    report(fmt("matmul %s bf16 n=8 bias", ty.name), yb.data(), yb.size() * 2);
  }
}

// nc_qg_matmul_rows (the MoE experts' kernels on GGML's own row layout) on every block type.
void raw_matmul() {
  const int64_t rows = 40, k = 512;
  for (const Type& ty : TYPES) {
    if (ty.elems == 1) continue;
    const std::vector<uint8_t> w = raw_rows(ty.type, rows, k);
    const std::vector<float> x = floats(17 * k, 2.0f);
    for (int64_t n : NS)
      for (int lv = 1; lv <= 2; ++lv)
        for (int th = 1; th <= 2; ++th) {
          std::vector<float> y(n * rows);
          if (nc_qg_matmul_rows(ty.type, w.data(), rows, k, k / ty.elems * ty.bytes, x.data(), n, k, y.data(), rows,
                                lv == 2, th))
            std::abort();
          report(fmt("rows %s n=%d levels=%d threads=%d", ty.name, int(n), lv, th), y.data(), y.size() * 4);
        }
  }
}

void dequant() {
  const int64_t rows = 40, k = 512;
  const int64_t ids[] = {0, 17, 39, 5};
  for (const Type& ty : TYPES) {
    const std::vector<uint8_t> w = packed(ty.type, raw_rows(ty.type, rows, k), rows, k);
    std::vector<float> out(4 * k);
    if (nc_qg_dequant_rows(ty.type, w.data(), rows, k, ids, 4, out.data())) std::abort();
    report(fmt("dequant %s", ty.name), out.data(), out.size() * 4);
  }
}

// Routed experts: SwiGLU with Q4_K / Q6_K / Q8_0, gpt-oss's clamped SwiGLU with MXFP4 and biases.
void moe() {
  const int64_t H = 256, I = 256, E = 4, topk = 2;
  struct Case {
    const char* name;
    int gate, up, down, act;
  } cases[] = {{"swiglu-q4k-q6k", Q4_K, Q4_K, Q6_K, 0}, {"swiglu-q8-q5k", Q8_0, Q5_K, Q8_0, 0},
               {"oai-mxfp4", MXFP4, MXFP4, MXFP4, 1}};
  for (const Case& c : cases) {
    const Type &tg = type_of(c.gate), &tu = type_of(c.up), &td = type_of(c.down);
    const std::vector<uint8_t> g = raw_rows(c.gate, E * I, H), u = raw_rows(c.up, E * I, H);
    const std::vector<uint8_t> d = raw_rows(c.down, E * H, I);
    const NcMat gm{c.gate, 0, g.data(), I * (H / tg.elems) * tg.bytes, H / tg.elems * tg.bytes, I, H};
    const NcMat um{c.up, 0, u.data(), I * (H / tu.elems) * tu.bytes, H / tu.elems * tu.bytes, I, H};
    const NcMat dm{c.down, 0, d.data(), H * (I / td.elems) * td.bytes, I / td.elems * td.bytes, H, I};
    const std::vector<float> gb = floats(E * I, 0.1f), ub = floats(E * I, 0.1f), db = floats(E * H, 0.1f);
    for (int64_t T : {1, 5})
      for (int lv = 1; lv <= 2; ++lv)
        for (int th = 1; th <= 2; ++th) {
          const std::vector<float> x = floats(T * H, 2.0f);
          std::vector<int64_t> ids(T * topk);
          std::vector<float> wts(T * topk);
          for (int64_t t = 0; t < T; ++t) {
            ids[t * topk] = static_cast<int64_t>(next() % E);
            ids[t * topk + 1] = (ids[t * topk] + 1 + static_cast<int64_t>(next() % (E - 1))) % E;
            wts[t * topk] = 0.5f + 0.5f * uniform();
            wts[t * topk + 1] = 0.5f + 0.5f * uniform();
          }
          std::vector<float> out(T * H);
          const bool oai = c.act == 1;
          if (nc_moe_forward(x.data(), T, H, ids.data(), wts.data(), topk, E, &gm, &um, &dm, out.data(), c.act, 1.702f,
                             7.0f, oai ? gb.data() : nullptr, oai ? ub.data() : nullptr, oai ? db.data() : nullptr,
                             lv == 2, th))
            std::abort();
          report(fmt("moe %s T=%d levels=%d threads=%d", c.name, int(T), lv, th), out.data(), out.size() * 4);
        }
  }
}

// The plan layout of decoder.cpp (checked against nc_dec_header_fields / nc_dec_layer_fields).
enum : int { H_LAYERS, H_HIDDEN, H_HEADS, H_KV_HEADS, H_HEAD_DIM, H_INTER, H_ROT_DIM, H_BLOCK_SIZE, H_MAX_POS,
             H_FINAL_NORM, H_EPS_BITS, H_KV_F16, H_ACT, H_SCALE_BITS, H_FIELDS };
enum : int { L_IN_NORM, L_POST_NORM, L_QKV, L_QKV_BIAS = L_QKV + 9, L_Q_NORM, L_K_NORM, L_O_TYPE, L_O_W, L_GU,
             L_DOWN_TYPE = L_GU + 6, L_DOWN_W, L_K_CACHE, L_V_CACHE, L_COS, L_SIN, L_WINDOW, L_ATTN_OUT_NORM,
             L_MLP_OUT_NORM, L_SINKS, L_O_BIAS, L_MOE, L_FIELDS };
enum : int { M_EXPERTS, M_TOP_K, M_ROUTING, M_ROUTER_TYPE, M_ROUTER_W, M_ROUTER_BIAS, M_GATE, M_UP, M_DOWN, M_ACT,
             M_ALPHA_BITS, M_LIMIT_BITS, M_GATE_BIAS, M_UP_BIAS, M_DOWN_BIAS, M_FIELDS };

int64_t as_int(const void* p) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(p)); }
int64_t double_bits(double v) {
  int64_t b;
  std::memcpy(&b, &v, 8);
  return b;
}

struct Stack {  // everything a plan points to
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<std::vector<float>> f32;
  std::vector<NcMat> mats = std::vector<NcMat>(3);
  std::vector<int64_t> moe = std::vector<int64_t>(M_FIELDS);
  // `rows` x k raw rows (GGML's own layout, as a file holds them)
  NcMat* raw(int i, int type, int64_t experts, int64_t rows, int64_t k) {
    bytes.push_back(raw_rows(type, experts * rows, k));
    const Type& ty = type_of(type);
    const int64_t row_bytes = k / ty.elems * ty.bytes;
    mats[i] = NcMat{type, 0, bytes.back().data(), rows * row_bytes, row_bytes, rows, k};
    return &mats[i];
  }
  const uint8_t* weight(int type, int64_t rows, int64_t k) {
    bytes.push_back(packed(type, raw_rows(type, rows, k), rows, k));
    return bytes.back().data();
  }
  const float* values(size_t n, float scale, float offset = 0.0f) {
    f32.push_back(floats(n, scale));
    for (auto& v : f32.back()) v += offset;
    return f32.back().data();
  }
};

// Two steps of a 2-layer stack on a ragged batch: a 9-row prefill chunk and a decode row over a cache that
// holds 5 earlier positions, then one decode row each.
void decoder_case(const char* name, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t hd, int64_t inter,
                  int64_t rot, bool kv_f16, int act, const int qkv_types[3], const int gu_types[2], int o_type,
                  int down_type, bool extras) {
  const int64_t block = 16, nblocks = 20, max_pos = 160, qs = heads * hd, kvs = kv_heads * hd;
  Stack st;
  std::vector<int64_t> plan(H_FIELDS + 2 * L_FIELDS, 0);
  plan[H_LAYERS] = 2;
  plan[H_HIDDEN] = hidden;
  plan[H_HEADS] = heads;
  plan[H_KV_HEADS] = kv_heads;
  plan[H_HEAD_DIM] = hd;
  plan[H_INTER] = inter;
  plan[H_ROT_DIM] = rot;
  plan[H_BLOCK_SIZE] = block;
  plan[H_MAX_POS] = max_pos;
  plan[H_FINAL_NORM] = as_int(st.values(hidden, 0.5f, 1.0f));
  plan[H_EPS_BITS] = double_bits(1e-6);
  plan[H_KV_F16] = kv_f16;
  plan[H_ACT] = act;
  plan[H_SCALE_BITS] = double_bits(0.125);
  const float* cos = st.values(max_pos * rot / 2, 1.0f);
  const float* sin = st.values(max_pos * rot / 2, 1.0f);
  const size_t cache_vals = nblocks * block * kvs;
  std::vector<std::vector<uint16_t>> caches16;
  for (int l = 0; l < 2; ++l) {
    int64_t* L = plan.data() + H_FIELDS + l * L_FIELDS;
    L[L_IN_NORM] = as_int(st.values(hidden, 0.5f, 1.0f));
    L[L_POST_NORM] = as_int(st.values(hidden, 0.5f, 1.0f));
    const int64_t seg_rows[3] = {qs, kvs, kvs};
    for (int s = 0; s < 3; ++s) {
      L[L_QKV + 3 * s] = qkv_types[s];
      L[L_QKV + 3 * s + 1] = as_int(st.weight(qkv_types[s], seg_rows[s], hidden));
      L[L_QKV + 3 * s + 2] = seg_rows[s];
    }
    if (extras) L[L_QKV_BIAS] = as_int(st.values(qs + 2 * kvs, 0.2f));
    L[L_Q_NORM] = as_int(st.values(hd, 0.5f, 1.0f));
    L[L_K_NORM] = as_int(st.values(hd, 0.5f, 1.0f));
    L[L_O_TYPE] = o_type;
    L[L_O_W] = as_int(st.weight(o_type, hidden, qs));
    for (int s = 0; s < 2; ++s) {
      L[L_GU + 3 * s] = gu_types[s];
      L[L_GU + 3 * s + 1] = as_int(st.weight(gu_types[s], inter, hidden));
      L[L_GU + 3 * s + 2] = inter;
    }
    L[L_DOWN_TYPE] = down_type;
    L[L_DOWN_W] = as_int(st.weight(down_type, hidden, inter));
    for (int kv = 0; kv < 2; ++kv) {  // random earlier keys / values
      const float* vals = st.values(cache_vals, 1.0f);
      if (kv_f16) {
        caches16.emplace_back(cache_vals);
        for (size_t i = 0; i < cache_vals; ++i) caches16.back()[i] = f16_bits(vals[i]);
        L[L_K_CACHE + kv] = as_int(caches16.back().data());
      } else {
        L[L_K_CACHE + kv] = as_int(vals);
      }
    }
    L[L_COS] = as_int(cos);
    L[L_SIN] = as_int(sin);
    if (extras && l == 1) {
      L[L_WINDOW] = 4;
      L[L_SINKS] = as_int(st.values(heads, 1.0f));
      L[L_ATTN_OUT_NORM] = as_int(st.values(hidden, 0.5f, 1.0f));
      L[L_MLP_OUT_NORM] = as_int(st.values(hidden, 0.5f, 1.0f));
      // gpt-oss's MLP in place of the gated one: 4 experts, top 2 by logit then a softmax over them; a biased Q8_0
      // router, MXFP4 gate / up and Q8_0 down rows where they lie, the clamped SwiGLU with biases; an o bias
      L[L_O_BIAS] = as_int(st.values(hidden, 0.2f));
      const int64_t E = 4;
      int64_t* M = st.moe.data();
      M[M_EXPERTS] = E;
      M[M_TOP_K] = 2;
      M[M_ROUTING] = 1;  // ROUTE_TOPK_SOFTMAX
      M[M_ROUTER_TYPE] = Q8_0;
      M[M_ROUTER_W] = as_int(st.weight(Q8_0, E, hidden));
      M[M_ROUTER_BIAS] = as_int(st.values(E, 0.5f));
      M[M_GATE] = as_int(st.raw(0, MXFP4, E, inter, hidden));
      M[M_UP] = as_int(st.raw(1, MXFP4, E, inter, hidden));
      M[M_DOWN] = as_int(st.raw(2, Q8_0, E, hidden, inter));
      M[M_ACT] = 1;
      M[M_ALPHA_BITS] = double_bits(1.702);
      M[M_LIMIT_BITS] = double_bits(7.0);
      M[M_GATE_BIAS] = as_int(st.values(E * inter, 0.5f));
      M[M_UP_BIAS] = as_int(st.values(E * inter, 0.5f));
      M[M_DOWN_BIAS] = as_int(st.values(E * hidden, 0.5f));
      L[L_MOE] = as_int(M);
    }
  }
  const int32_t tables[4] = {0, 1, 2, 3};  // sequence 0: blocks 0, 1; sequence 1: blocks 2, 3
  auto slot = [&](int seq, int64_t pos) { return tables[2 * seq + pos / block] * block + pos % block; };
  for (int th = 1; th <= 2; ++th) {
    // step 1: sequence 0 prefills positions 0..8, sequence 1 decodes position 5
    std::vector<int64_t> pos, slots;
    for (int64_t p = 0; p < 9; ++p) {
      pos.push_back(p);
      slots.push_back(slot(0, p));
    }
    pos.push_back(5);
    slots.push_back(slot(1, 5));
    const int32_t cu[3] = {0, 9, 10}, lens[2] = {9, 6};
    std::vector<float> x = floats(10 * hidden);
    if (nc_dec_forward(plan.data(), x.data(), 10, pos.data(), slots.data(), 2, cu, tables, 2, lens, nullptr, nullptr,
                       0, 1, th))
      std::abort();
    report(fmt("decoder %s step1 threads=%d", name, th), x.data(), x.size() * 4);
    // step 2: one decode row each, reading what step 1 stored
    const int64_t pos2[2] = {9, 6}, slots2[2] = {slot(0, 9), slot(1, 6)};
    const int32_t cu2[3] = {0, 1, 2}, lens2[2] = {10, 7};
    std::vector<float> x2 = floats(2 * hidden);
    if (nc_dec_forward(plan.data(), x2.data(), 2, pos2, slots2, 2, cu2, tables, 2, lens2, nullptr, nullptr, 0, 1, th))
      std::abort();
    report(fmt("decoder %s step2 threads=%d", name, th), x2.data(), x2.size() * 4);
    // step 3: a 4-row verification chunk at positions 130..133 of a third sequence (blocks 8..16), over the
    // caches' random earlier keys: its rows share the key part [0, 128) (attend_part_rows)
    const int32_t tables3[9] = {8, 9, 10, 11, 12, 13, 14, 15, 16};
    const int64_t pos3[4] = {130, 131, 132, 133};
    int64_t slots3[4];
    for (int r = 0; r < 4; ++r) slots3[r] = tables3[pos3[r] / block] * block + pos3[r] % block;
    const int32_t cu3[2] = {0, 4}, lens3[1] = {134};
    std::vector<float> x3 = floats(4 * hidden);
    if (nc_dec_forward(plan.data(), x3.data(), 4, pos3, slots3, 1, cu3, tables3, 9, lens3, nullptr, nullptr, 0, 1, th))
      std::abort();
    report(fmt("decoder %s step3 threads=%d", name, th), x3.data(), x3.size() * 4);
    for (int l = 0; l < 2; ++l)
      for (int kv = 0; kv < 2; ++kv) {
        const void* cache = reinterpret_cast<const void*>(plan[H_FIELDS + l * L_FIELDS + L_K_CACHE + kv]);
        report(fmt("decoder %s cache layer=%d %s threads=%d", name, l, kv ? "v" : "k", th), cache,
               cache_vals * (kv_f16 ? 2 : 4));
      }
  }
}

void decoder() {
  if (nc_dec_header_fields() != H_FIELDS || nc_dec_layer_fields() != L_FIELDS || nc_dec_moe_fields() != M_FIELDS) {
    std::fprintf(stderr, "the harness's plan layout is not decoder.cpp's\n");
    std::exit(1);
  }
  const int qkv_a[3] = {Q4_K, Q8_0, Q6_K}, gu_a[2] = {Q4_0, Q5_1};
  decoder_case("hd64-f16-silu", 256, 4, 2, 64, 256, 64, true, 0, qkv_a, gu_a, Q5_K, Q6_K, true);
  const int qkv_b[3] = {Q8_0, Q4_1, MXFP4}, gu_b[2] = {Q5_0, Q8_0};
  decoder_case("hd32-f32-gelu", 64, 2, 1, 32, 64, 16, false, 1, qkv_b, gu_b, Q4_1, Q8_0, false);
  for (int op : {0, 1, 3, 4, 5}) {  // the elementwise activations (2, softplus, calls log1p: libm's own)
    const int64_t rows = 3, cols = 37;
    const std::vector<float> x = floats(rows * cols, 12.0f), u = floats(rows * cols);
    std::vector<float> out(rows * cols);
    if (nc_dec_activation(op, x.data(), cols, op == 0 ? u.data() : nullptr, cols, rows, cols, out.data(), cols, 1))
      std::abort();
    report(fmt("activation op=%d", op), out.data(), out.size() * 4);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> want(argv + 1, argv + argc);
  if (want.empty()) want = {"matmul", "rows", "dequant", "moe", "decoder"};
  for (const std::string& s : want) {
    g_state = 0x9e3779b97f4a7c15ull;  // each section from the same stream start, whatever else runs
    if (s == "matmul") matmul();
    else if (s == "rows") raw_matmul();
    else if (s == "dequant") dequant();
    else if (s == "moe") moe();
    else if (s == "decoder") decoder();
    else {
      std::fprintf(stderr, "unknown section %s (have matmul rows dequant moe decoder)\n", s.c_str());
      return 2;
    }
  }
  std::printf("simd %d\n", nc_qg_simd());
}
