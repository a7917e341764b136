// SPDX-License-Identifier: Apache-2.0
// CPU stand-in for cuda_bf16.h (see cuda_runtime.h here): bfloat16 as the top 16 bits of a float,
// rounded to nearest even like torch.
#pragma once
#include "cuda_runtime.h"

struct __nv_bfloat16 { uint16_t v; };
inline float __bfloat162float(__nv_bfloat16 b) {
  const uint32_t u = static_cast<uint32_t>(b.v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  if (std::isnan(f)) return __nv_bfloat16{0x7fc0};
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{static_cast<uint16_t>(u >> 16)};
}
