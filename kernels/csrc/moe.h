// The routed-experts kernel (moe.cpp) as the fused decoder step (decoder.cpp) calls it.

#pragma once

#include <cstdint>

extern "C" {

// One projection of every expert: row r of expert e at data + e * expert_stride + r * row_stride.
struct NcMat {
  int32_t type;
  int32_t reserved;
  const uint8_t* data;
  int64_t expert_stride;
  int64_t row_stride;
  int64_t rows;
  int64_t cols;
};

// out [T, H] = sum over each token's k (expert, weight) pairs of weight * expert(x) (moe.cpp).
int nc_moe_forward(const float* x, int64_t T, int64_t H, const int64_t* ids, const float* weights, int64_t k,
                   int64_t E, const NcMat* gate, const NcMat* up, const NcMat* down, float* out, int act, float alpha,
                   float limit, const float* gate_bias, const float* up_bias, const float* down_bias, int x2,
                   int threads);
}
