// The matmul library (qgemv.cpp) as its other sources use it: decoder.cpp runs whole layers on its
// matmul and thread pool, moe.cpp the routed experts on its raw-row kernels and the same pool.

#pragma once

#include <cstdint>
#include <vector>

extern "C" {
int nc_qg_matmul(int type, const uint8_t* w, int64_t rows, int64_t k, const void* x, int x_bf16, int64_t n,
                 int64_t ldx, void* y, int y_bf16, int64_t ldy, const float* bias, int x2, int threads);
void nc_qg_parallel_for(int64_t items, int64_t chunk, int threads, void (*fn)(const void*, int64_t, int64_t),
                        const void* ctx);
}

namespace nc::qg {

// Rows of x as the kernels take them (qgemv.cpp, "activations"): per row int8 codes q (and q2, the
// residual's, with two levels); per 32 values the scale d of one unit of the combined code (q, or
// 256 q + q2) and d * the sum of the combined codes; per 16 the sums of the combined codes. c16: the
// combined codes as int16, where the AVX2 kernels (several rows at once) and tile_gemm read them (two levels). x, ldx:
// dense weights' fp32 x.
struct Acts {
  const int8_t* q;
  const int8_t* q2;
  const int16_t* c16;
  const float* d;
  const int32_t* s16;
  const float* ds;
  int64_t k;
  const float* x;
  int64_t ldx;
  uint64_t call;  // nonzero: the AVX2 / AVX-512 kernels widen each tile once for this call's many rows (tile_gemm)
};

// Storage for quantized rows; grows, never shrinks (a thread's buffer serves all its calls).
struct ActBuffer {
  std::vector<int8_t> q, q2;
  std::vector<int16_t> c16;
  std::vector<float> d, ds;
  std::vector<int32_t> s16;
  int64_t k = 0;
  bool x2 = false, wide = false;

  // Room for n rows of k values (k a multiple of 32), two levels if x2, combined codes if wide.
  void reserve(int64_t n, int64_t k, bool x2, bool wide);
  // Row `row` from k values of x (float32, or bf16 if x_bf16).
  void quantize(int64_t row, const void* x, int x_bf16 = 0);
  Acts view() const;
};

// Whether matmul_rows reads the combined codes (ActBuffer's `wide`) for two-level activations of `rows`
// rows at once on the code path in use.
bool wide_codes(int64_t rows);

// Whether matmul_rows takes weights of this GGML type (the block types).
bool raw_type(int type);
// Elements and bytes of one block of the type (0 for an unknown type).
int block_elems(int type);
int block_bytes(int type);

// Rows [r0, r1) of a weight in GGML's own layout (row r's blocks at w + r * row_stride) times n rows of
// x: y[t * ldy + r - r0] = W[r] . x_hat_t, x_hat_t row idx[t] of a (row t when idx is null). The same
// products, bit for bit, as nc_qg_matmul gives for the weight packed, on every code path. Rows from
// r1 up to pf_end are prefetched too: the caller reads them next.
void matmul_rows(int type, const uint8_t* w, int64_t row_stride, int64_t r0, int64_t r1, const Acts& a,
                 const int64_t* idx, int64_t n, float* y, int64_t ldy, int64_t pf_end);

// body(i0, i1) over [0, items) in chunks of `chunk` items on up to `threads` threads of the pool.
template <class F>
void parallel_for(int64_t items, int64_t chunk, int threads, const F& body) {
  nc_qg_parallel_for(
      items, chunk, threads, [](const void* ctx, int64_t i0, int64_t i1) { (*static_cast<const F*>(ctx))(i0, i1); },
      &body);
}

}  // namespace nc::qg
