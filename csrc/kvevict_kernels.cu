// SPDX-License-Identifier: Apache-2.0
// CUDA kernels for the batched eviction operations of vllm-kvevict: the optional C++ counterpart of
// vllm_kvevict/kernels/triton_ops.py, with the semantics of vllm_kvevict/kernels/torch_ops.py (the
// specification; read its module docstring). Written against vLLM 0.32.0's KV-cache layouts.
//
// Pure CUDA: only the CUDA runtime and fp16/bf16 headers, no torch, so this file compiles with nvcc
// alone and links into the extension whatever torch build sits next to it (bindings.cpp holds the
// torch side). It must also compile under torch's own nvcc flags (-D__CUDA_NO_HALF_OPERATORS__ and
// friends), so half/bfloat16 values are only ever converted through explicit intrinsics.
//
// Ragged row sets: row r owns the packed tokens [cu[r], cu[r + 1]). The copy kernels (gather,
// scatter) run a 1-D grid over the packed tokens, a tile of tokens per thread block; each token finds
// its row by binary search in cu, so no grid dimension depends on the longest row (no host sync) and
// no block idles on a short row. The scoring kernels run per (row, KV head, chunk of the row).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "kvevict_kernels.h"

namespace kvevict {
namespace {

constexpr int kThreads = 256;        // threads per block, every kernel
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTile = 128;        // packed tokens per block in the copy kernels
constexpr int kTileElems = 4096;     // vectors per tensor a copy block moves, at most (16 per thread)
constexpr int64_t kChunk = 2048;     // keydiff: tokens per row chunk, on average over the set...
constexpr int64_t kMaxSplits = 32;   // ...and at most this many chunks per row

// ---------------------------------------------------------------------------------------------
// Helpers

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Conversions as torch's .to(): between float types through float32, rounding to nearest even; the
// float32 / int32 / int64 pairs by static_cast (what torch's CUDA cast does); a type to itself
// (the copy's vector units included) is a copy.
template <typename To, typename From>
__device__ __forceinline__ To convert(From x) { return static_cast<To>(x); }
template <> __device__ __forceinline__ __half convert<__half, float>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 convert<__nv_bfloat16, float>(float x) {
  return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ float convert<float, __half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float convert<float, __nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <> __device__ __forceinline__ __half convert<__half, __nv_bfloat16>(__nv_bfloat16 x) {
  return __float2half_rn(__bfloat162float(x));
}
template <> __device__ __forceinline__ __nv_bfloat16 convert<__nv_bfloat16, __half>(__half x) {
  return __float2bfloat16_rn(__half2float(x));
}

// The row r with cu[r] <= n < cu[r + 1] (0 <= n < cu[R]); empty rows are skipped over.
__device__ __forceinline__ int64_t find_row(const int64_t* __restrict__ cu, int64_t R, int64_t n) {
  int64_t lo = 0, hi = R;  // cu[lo] <= n < cu[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) >> 1;
    if (cu[mid] <= n) lo = mid; else hi = mid;
  }
  return lo;
}

// Element offset of (block, offset) of logical token `tok` of block-table row `row`, in units of the
// kernel's vector type (the layout's strides are converted on the host).
struct Paged {
  const void* bt;
  int bt64;
  int64_t bt_s0, bt_s1, bs, s_block, s_offset;
};

__device__ __forceinline__ int64_t slot_offset(const Paged& p, int64_t row, int64_t tok) {
  const int64_t i = row * p.bt_s0 + (tok / p.bs) * p.bt_s1;
  const int64_t blk = p.bt64 ? static_cast<const int64_t*>(p.bt)[i] : static_cast<const int32_t*>(p.bt)[i];
  return blk * p.s_block + (tok % p.bs) * p.s_offset;
}

// ---------------------------------------------------------------------------------------------
// torch_ops.gather_paged. Grid: one block per tile of packed output tokens. Vec is the unit moved by
// one load/store (uint4 = 16 bytes when head_dim and strides allow, down to one element); a (token,
// head) row is `nvec` Vecs, `s_v` apart in the cache (1, or the element stride of a strided head_dim).

template <typename Vec>
__global__ void __launch_bounds__(kThreads) gather_paged_kernel(
    const Vec* __restrict__ k, const Vec* __restrict__ v, Vec* __restrict__ out_k, Vec* __restrict__ out_v,
    const int64_t* __restrict__ cu, const int64_t* __restrict__ rows, const int64_t* __restrict__ starts,
    int64_t R, int64_t N, Paged p, int64_t s_h, int64_t s_v, int H, int nvec, int tile) {
  __shared__ int64_t src[kMaxTile];  // cache offset of each token of the tile
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * tile;
  const int nt = static_cast<int>(min(static_cast<int64_t>(tile), N - n0));
  for (int t = threadIdx.x; t < nt; t += blockDim.x) {
    const int64_t n = n0 + t;
    const int64_t r = find_row(cu, R, n);
    src[t] = slot_offset(p, rows[r], starts[r] + (n - cu[r]));
  }
  __syncthreads();
  const int per_tok = H * nvec;
  const int total = nt * per_tok;
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int t = i / per_tok;
    const int hc = i - t * per_tok;  // head * nvec + c
    const int h = hc / nvec;
    const int c = hc - h * nvec;
    const int64_t s = src[t] + h * s_h + c * s_v;
    const int64_t d = n0 * per_tok + i;  // outputs are contiguous [N, H, nvec]
    out_k[d] = k[s];
    out_v[d] = v[s];
  }
}

// ---------------------------------------------------------------------------------------------
// torch_ops.scatter_paged. Grid: one block per tile of kept tokens (rows of idx). A (token, head) row
// is `nunits` units `s_u` apart in the cache: same dtype, To = From = Vec (a copy, 16-byte units where
// head_dim and strides allow); otherwise one element per unit, converted (src.to(dst.dtype)).

template <typename To, typename From>
__global__ void __launch_bounds__(kThreads) scatter_paged_kernel(
    To* __restrict__ dst, const From* __restrict__ src, const int64_t* __restrict__ idx,
    const int64_t* __restrict__ cu, const int64_t* __restrict__ cu_keep, const int64_t* __restrict__ rows,
    const int64_t* __restrict__ dst_start, int64_t R, int64_t M, Paged p, int64_t s_h, int64_t s_u, int H,
    int nunits, int tile) {
  __shared__ int64_t dst_off[kMaxTile];  // cache offset each kept token is written to
  __shared__ int64_t src_row[kMaxTile];  // cu[r] of its row: idx is row-local
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * tile;
  const int nt = static_cast<int>(min(static_cast<int64_t>(tile), M - m0));
  for (int t = threadIdx.x; t < nt; t += blockDim.x) {
    const int64_t m = m0 + t;
    const int64_t r = find_row(cu_keep, R, m);
    dst_off[t] = slot_offset(p, rows[r], dst_start[r] + (m - cu_keep[r]));
    src_row[t] = cu[r];
  }
  __syncthreads();
  const int per_tok = H * nunits;
  const int total = nt * per_tok;
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int t = i / per_tok;
    const int hu = i - t * per_tok;  // head * nunits + u
    const int h = hu / nunits;
    const int u = hu - h * nunits;
    const int64_t tok = src_row[t] + idx[(m0 + t) * H + h];
    dst[dst_off[t] + h * s_h + u * s_u] = convert<To, From>(src[(tok * H + h) * nunits + u]);
  }
}

// ---------------------------------------------------------------------------------------------
// policies/keydiff.py keydiff_scores, in two kernels. Grid (row, KV head, chunk): chunk s of a row of n tokens
// is tokens [s * ceil(n / S), (s + 1) * ceil(n / S)). One warp per token, lanes over head_dim.
//
// Pass 1 (keydiff_partial_kernel): each chunk's sum of normalised keys k / max(||k||, EPS) into
// partial[r, h, s, :] (zeros for an empty chunk). Pass 2 (keydiff_cos_kernel): every block of the
// row sums the S partials in the same order (so they all see the same anchor; deterministic), divides
// by n (mu_r), and writes -(k . mu) / max(||mu|| ||k||, EPS) for its chunk. Everything in float32.

template <typename T>
__global__ void __launch_bounds__(kThreads) keydiff_partial_kernel(
    const T* __restrict__ K, const int64_t* __restrict__ cu, float* __restrict__ partial, int H, int D, int S,
    float eps) {
  extern __shared__ float acc[];  // [kWarps, D]: each warp's own sums
  const int64_t r = blockIdx.x;
  const int h = blockIdx.y, s = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t lo = cu[r], n = cu[r + 1] - lo;
  const int64_t chunk = (n + S - 1) / S;
  const int64_t t0 = s * chunk, t1 = min(n, t0 + chunk);
  float* mine = acc + warp * D;
  for (int d = lane; d < D; d += 32) mine[d] = 0.f;
  for (int64_t t = t0 + warp; t < t1; t += kWarps) {
    const T* k = K + ((lo + t) * H + h) * D;
    float ss = 0.f;
    for (int d = lane; d < D; d += 32) {
      const float x = to_float(k[d]);
      ss += x * x;
    }
    const float norm = fmaxf(sqrtf(warp_sum(ss)), eps);
    for (int d = lane; d < D; d += 32) mine[d] += to_float(k[d]) / norm;  // lanes own their d: no race
  }
  __syncthreads();
  float* out = partial + ((r * H + h) * S + s) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float x = 0.f;
    for (int w = 0; w < kWarps; ++w) x += acc[w * D + d];
    out[d] = x;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) keydiff_cos_kernel(
    const T* __restrict__ K, const int64_t* __restrict__ cu, const float* __restrict__ partial,
    float* __restrict__ scores, int H, int D, int S, float eps) {
  extern __shared__ float mu[];  // [D]
  __shared__ float red[kWarps];
  const int64_t r = blockIdx.x;
  const int h = blockIdx.y, s = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t lo = cu[r], n = cu[r + 1] - lo;
  const int64_t chunk = (n + S - 1) / S;
  const int64_t t0 = s * chunk, t1 = min(n, t0 + chunk);
  if (t0 >= t1) return;  // uniform over the block: nothing to score here
  const float count = static_cast<float>(n);
  const float* part = partial + (r * H + h) * S * D;
  float sq = 0.f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float x = 0.f;
    for (int j = 0; j < S; ++j) x += part[j * D + d];
    x = x / count;  // mu_r
    mu[d] = x;
    sq += x * x;
  }
  sq = warp_sum(sq);
  if (lane == 0) red[warp] = sq;
  __syncthreads();  // mu and red complete
  float mu_sq = 0.f;
  for (int w = 0; w < kWarps; ++w) mu_sq += red[w];
  const float mu_norm = sqrtf(mu_sq);
  for (int64_t t = t0 + warp; t < t1; t += kWarps) {
    const T* k = K + ((lo + t) * H + h) * D;
    float ss = 0.f, dot = 0.f;
    for (int d = lane; d < D; d += 32) {
      const float x = to_float(k[d]);
      ss += x * x;
      dot += x * mu[d];
    }
    ss = warp_sum(ss);
    dot = warp_sum(dot);
    if (lane == 0) scores[(lo + t) * H + h] = -(dot / fmaxf(mu_norm * sqrtf(ss), eps));
  }
}

// ---------------------------------------------------------------------------------------------
// Host side

// The widest vector (16, 8, 4, 2 bytes, or one element) that every row of the copy can move: rows
// contiguous in head_dim, their byte length, the paged strides and both base pointers multiples of
// it. Returns the vector size in bytes; `elem_size` (and a strided head_dim) when none fits.
int64_t vector_bytes(int64_t elem_size, int64_t D, const PagedLayout& l, std::initializer_list<const void*> ptrs) {
  if (D > 1 && l.stride_dim != 1) return elem_size;
  const int64_t row = D * elem_size;
  for (int64_t vec = 16; vec > elem_size; vec >>= 1) {
    const bool ok = row % vec == 0 && (l.stride_block * elem_size) % vec == 0 &&
                    (l.stride_offset * elem_size) % vec == 0 && (l.stride_head * elem_size) % vec == 0;
    bool aligned = true;
    for (const void* p : ptrs) aligned = aligned && reinterpret_cast<uintptr_t>(p) % vec == 0;
    if (ok && aligned) return vec;
  }
  return elem_size;
}

// The layout in units of `unit` bytes (exact: vector_bytes checked divisibility).
Paged paged_in_units(const PagedLayout& l, int64_t elem_size, int64_t unit) {
  return Paged{l.block_table, l.block_table_int64, l.bt_stride_row, l.bt_stride_col, l.block_size,
               l.stride_block * elem_size / unit, l.stride_offset * elem_size / unit};
}

int tile_tokens(int64_t per_token) {
  const int64_t t = kTileElems / (per_token > 0 ? per_token : 1);
  return static_cast<int>(t < 1 ? 1 : (t > kMaxTile ? kMaxTile : t));
}

int finish() { return static_cast<int>(cudaGetLastError()); }

template <typename Vec>
int launch_gather(const void* k, const void* v, void* ok, void* ov, int64_t elem_size, int64_t H, int64_t D,
                  const PagedLayout& l, const int64_t* cu, const int64_t* rows, const int64_t* starts, int64_t R,
                  int64_t N, cudaStream_t stream) {
  const int64_t unit = sizeof(Vec);
  const bool vectorised = unit > elem_size || l.stride_dim == 1 || D == 1;
  const int64_t nvec = D * elem_size / unit;
  const int64_t s_h = l.stride_head * elem_size / unit;
  const int64_t s_v = vectorised ? 1 : l.stride_dim;  // a vector, or one element of a strided head_dim
  const int tile = tile_tokens(H * nvec);
  const int64_t blocks = (N + tile - 1) / tile;
  gather_paged_kernel<Vec><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const Vec*>(k), static_cast<const Vec*>(v), static_cast<Vec*>(ok), static_cast<Vec*>(ov), cu,
      rows, starts, R, N, paged_in_units(l, elem_size, unit), s_h, s_v, static_cast<int>(H),
      static_cast<int>(nvec), tile);
  return finish();
}

template <typename Vec>
int launch_scatter_copy(void* dst, const void* src, int64_t elem_size, int64_t H, int64_t D, const PagedLayout& l,
                        const int64_t* idx, const int64_t* cu, const int64_t* cu_keep, const int64_t* rows,
                        const int64_t* dst_start, int64_t R, int64_t M, cudaStream_t stream) {
  const int64_t unit = sizeof(Vec);
  const bool vectorised = unit > elem_size || l.stride_dim == 1 || D == 1;
  const int64_t nvec = D * elem_size / unit;
  const int64_t s_h = l.stride_head * elem_size / unit;
  const int64_t s_v = vectorised ? 1 : l.stride_dim;
  const int tile = tile_tokens(H * nvec);
  const int64_t blocks = (M + tile - 1) / tile;
  scatter_paged_kernel<Vec, Vec><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<Vec*>(dst), static_cast<const Vec*>(src), idx, cu, cu_keep, rows, dst_start, R, M,
      paged_in_units(l, elem_size, unit), s_h, s_v, static_cast<int>(H), static_cast<int>(nvec), tile);
  return finish();
}

template <typename To, typename From>
int launch_scatter_convert(void* dst, const void* src, int64_t H, int64_t D, const PagedLayout& l, const int64_t* idx,
                           const int64_t* cu, const int64_t* cu_keep, const int64_t* rows, const int64_t* dst_start,
                           int64_t R, int64_t M, cudaStream_t stream) {
  const int tile = tile_tokens(H * D);
  const int64_t blocks = (M + tile - 1) / tile;
  scatter_paged_kernel<To, From><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<To*>(dst), static_cast<const From*>(src), idx, cu, cu_keep, rows, dst_start, R, M,
      paged_in_units(l, sizeof(To), sizeof(To)), l.stride_head, l.stride_dim, static_cast<int>(H),
      static_cast<int>(D), tile);
  return finish();
}

template <typename T>
int launch_keydiff(const void* K, const int64_t* cu, float* partial, float* out, int64_t R, int64_t N, int64_t H,
                   int64_t D, float eps, cudaStream_t stream) {
  const int64_t S = keydiff_splits(N);
  const dim3 grid(static_cast<unsigned>(R), static_cast<unsigned>(H), static_cast<unsigned>(S));
  const T* k = static_cast<const T*>(K);
  keydiff_partial_kernel<T><<<grid, kThreads, kWarps * D * sizeof(float), stream>>>(
      k, cu, partial, static_cast<int>(H), static_cast<int>(D), static_cast<int>(S), eps);
  const int err = finish();
  if (err) return err;
  keydiff_cos_kernel<T><<<grid, kThreads, D * sizeof(float), stream>>>(
      k, cu, partial, out, static_cast<int>(H), static_cast<int>(D), static_cast<int>(S), eps);
  return finish();
}

// The launch is asynchronous on the caller's stream, on the caller's device (also made current to
// this CUDA runtime, which may be a different copy than torch's).
int prepare(int device) { return static_cast<int>(cudaSetDevice(device)); }

cudaStream_t as_stream(intptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers (declared in kvevict_kernels.h)

int gather_paged(const void* k, const void* v, void* out_k, void* out_v, int64_t elem_size, int64_t H, int64_t D,
                 const PagedLayout& layout, const int64_t* cu, const int64_t* rows, const int64_t* starts, int64_t R,
                 int64_t N, int device, intptr_t stream) {
  if (N <= 0 || R <= 0 || H <= 0 || D <= 0) return 0;
  if (int err = prepare(device)) return err;
  const cudaStream_t st = as_stream(stream);
#define KVEVICT_GATHER(Vec) \
  launch_gather<Vec>(k, v, out_k, out_v, elem_size, H, D, layout, cu, rows, starts, R, N, st)
  switch (vector_bytes(elem_size, D, layout, {k, v, out_k, out_v})) {
    case 16: return KVEVICT_GATHER(uint4);
    case 8: return KVEVICT_GATHER(uint2);
    case 4: return KVEVICT_GATHER(uint32_t);
    case 2: return KVEVICT_GATHER(uint16_t);
    case 1: return KVEVICT_GATHER(uint8_t);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
#undef KVEVICT_GATHER
}

int scatter_paged(void* dst, int dst_dtype, const void* src, int src_dtype, int64_t elem_size, int64_t H, int64_t D,
                  const PagedLayout& l, const int64_t* idx, const int64_t* cu, const int64_t* cu_keep,
                  const int64_t* rows, const int64_t* dst_start, int64_t R, int64_t M, int device, intptr_t stream) {
  if (M <= 0 || R <= 0 || H <= 0 || D <= 0) return 0;
  if (int err = prepare(device)) return err;
  const cudaStream_t st = as_stream(stream);
  if (dst_dtype == src_dtype) {  // a copy: by element size, vectorised where the layout allows
#define KVEVICT_COPY(Vec) \
  launch_scatter_copy<Vec>(dst, src, elem_size, H, D, l, idx, cu, cu_keep, rows, dst_start, R, M, st)
    switch (vector_bytes(elem_size, D, l, {dst, src})) {
      case 16: return KVEVICT_COPY(uint4);
      case 8: return KVEVICT_COPY(uint2);
      case 4: return KVEVICT_COPY(uint32_t);
      case 2: return KVEVICT_COPY(uint16_t);
      case 1: return KVEVICT_COPY(uint8_t);
      default: return static_cast<int>(cudaErrorInvalidValue);
    }
#undef KVEVICT_COPY
  }
#define KVEVICT_CONVERT(DT, ST, To, From) \
  if (dst_dtype == DT && src_dtype == ST) \
    return launch_scatter_convert<To, From>(dst, src, H, D, l, idx, cu, cu_keep, rows, dst_start, R, M, st);
  // The cache and its dtypes: float32 / float16 / bfloat16.
  KVEVICT_CONVERT(kF32, kF16, float, __half)
  KVEVICT_CONVERT(kF32, kBF16, float, __nv_bfloat16)
  KVEVICT_CONVERT(kF16, kF32, __half, float)
  KVEVICT_CONVERT(kF16, kBF16, __half, __nv_bfloat16)
  KVEVICT_CONVERT(kBF16, kF32, __nv_bfloat16, float)
  KVEVICT_CONVERT(kBF16, kF16, __nv_bfloat16, __half)
  // Per-slot state (positions, scores): float32 / int32 / int64.
  KVEVICT_CONVERT(kF32, kI32, float, int32_t)
  KVEVICT_CONVERT(kF32, kI64, float, int64_t)
  KVEVICT_CONVERT(kI32, kF32, int32_t, float)
  KVEVICT_CONVERT(kI32, kI64, int32_t, int64_t)
  KVEVICT_CONVERT(kI64, kF32, int64_t, float)
  KVEVICT_CONVERT(kI64, kI32, int64_t, int32_t)
#undef KVEVICT_CONVERT
  return static_cast<int>(cudaErrorInvalidValue);
}

int64_t keydiff_splits(int64_t N) {
  const int64_t s = (N + kChunk - 1) / kChunk;
  return s < 1 ? 1 : (s > kMaxSplits ? kMaxSplits : s);
}

int keydiff_scores(const void* K, int dtype, const int64_t* cu, float* partial, float* out, int64_t R, int64_t N,
                   int64_t H, int64_t D, float eps, int device, intptr_t stream) {
  if (N <= 0 || R <= 0 || H <= 0) return 0;
  if (D <= 0 || D > kMaxKeydiffDim) return static_cast<int>(cudaErrorInvalidValue);
  if (int err = prepare(device)) return err;
  const cudaStream_t st = as_stream(stream);
  switch (dtype) {
    case kF32: return launch_keydiff<float>(K, cu, partial, out, R, N, H, D, eps, st);
    case kF16: return launch_keydiff<__half>(K, cu, partial, out, R, N, H, D, eps, st);
    case kBF16: return launch_keydiff<__nv_bfloat16>(K, cu, partial, out, R, N, H, D, eps, st);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

const char* error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // namespace kvevict
