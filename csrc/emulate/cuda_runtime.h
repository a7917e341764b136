// SPDX-License-Identifier: Apache-2.0
// A CPU stand-in for the part of the CUDA runtime and device language kvevict_kernels.cu uses, so its
// kernels can be *run* on a machine without a GPU (tests/test_csrc.py, KVEVICT_CSRC_EMULATE=1): the
// test compiles a copy of the .cu with g++ -std=c++20 against these headers, after two textual
// rewrites (`extern __shared__ T x[];` -> emu::dyn_smem, `k<<<cfg>>>(args)` -> emu::launch).
//
// Model: blocks run one after another; a block's threads are real std::threads (so __syncthreads is
// a barrier and __shared__ memory is one `static` array shared by them); warp shuffles exchange
// through a per-warp slot array between two warp barriers. Slow, but it runs the kernels' own index
// arithmetic, vector widths and reductions. Never used by the real build (only -Icsrc is on its path).
#pragma once

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };

typedef void* cudaStream_t;
typedef int cudaError_t;
enum { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaSetDevice(int) { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t e) { return e ? "invalid argument (emulated)" : "no error"; }

using std::max;
using std::min;

namespace emu {

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
inline std::vector<char> dynamic_smem;  // the running block's `extern __shared__` memory
inline std::barrier<>* block_barrier = nullptr;
inline std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
inline float shuffle_slots[1024];

struct Cfg {
  dim3 grid;
  unsigned threads;
  size_t smem;
  Cfg(dim3 g, unsigned t, size_t s, cudaStream_t) : grid(g), threads(t), smem(s) {}
};

template <typename T>
T* dyn_smem() { return reinterpret_cast<T*>(dynamic_smem.data()); }

template <typename Kernel, typename... Args>
void launch(Kernel kernel, Cfg c, Args... args) {
  gridDim = c.grid;
  blockDim = dim3(c.threads);
  for (unsigned z = 0; z < c.grid.z; ++z)
    for (unsigned y = 0; y < c.grid.y; ++y)
      for (unsigned x = 0; x < c.grid.x; ++x) {
        dynamic_smem.assign(c.smem + 16, static_cast<char>(0x7f));  // garbage, as on a GPU
        std::barrier<> block(c.threads);
        block_barrier = &block;
        warp_barriers.clear();
        for (unsigned w = 0; w < c.threads / 32; ++w) warp_barriers.emplace_back(new std::barrier<>(32));
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < c.threads; ++t)
          threads.emplace_back([&, t] {
            threadIdx = dim3(t);
            blockIdx = dim3(x, y, z);
            kernel(args...);
          });
        for (auto& t : threads) t.join();
      }
}

}  // namespace emu

using emu::blockDim;
using emu::blockIdx;
using emu::gridDim;
using emu::threadIdx;

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  const unsigned t = threadIdx.x, w = t / 32;
  emu::shuffle_slots[t] = v;
  emu::warp_barriers[w]->arrive_and_wait();
  const float r = emu::shuffle_slots[w * 32 + ((t % 32) ^ static_cast<unsigned>(lane_mask))];
  emu::warp_barriers[w]->arrive_and_wait();
  return r;
}
