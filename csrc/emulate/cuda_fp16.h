// SPDX-License-Identifier: Apache-2.0
// CPU stand-in for cuda_fp16.h (see cuda_runtime.h here): IEEE half through GCC's _Float16.
#pragma once
#include "cuda_runtime.h"

struct __half { _Float16 v; };
inline float __half2float(__half h) { return static_cast<float>(h.v); }
inline __half __float2half_rn(float f) { return __half{static_cast<_Float16>(f)}; }
