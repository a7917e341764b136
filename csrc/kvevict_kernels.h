// SPDX-License-Identifier: Apache-2.0
// Host launchers of the CUDA eviction kernels (kvevict_kernels.cu), callable from code that sees no
// CUDA header (bindings.cpp is compiled by the host compiler against torch's CPU headers only).
//
// Every launcher takes raw device pointers, sizes and strides in elements, the CUDA device index and
// the stream as an integer (torch.cuda.current_stream(device).cuda_stream), launches asynchronously
// on that stream and returns a cudaError_t as an int (0: success; error_string() describes others).
//
// Semantics: those of vllm_kvevict/kernels/torch_ops.py (the specification), written against
// vLLM 0.32.0's cache layouts (FlashAttention [num_blocks, 2, block_size, H, D] and the
// [num_blocks, H, block_size, 2D] views the plugin's tests use; any strides work).
#pragma once

#include <cstdint>

namespace kvevict {

// Element types the launchers understand (others: kOther, copied bytewise where a copy is enough).
enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kI32 = 3, kI64 = 4, kOther = -1 };

// A paged tensor [num_blocks, block_size, H, D] (or [num_blocks, block_size, H], D = 1) addressed
// through vLLM's block table [num_reqs, max_blocks] (int32 or int64): logical token `tok` of
// block-table row `row` lives in block block_table[row, tok / block_size] at offset tok % block_size.
struct PagedLayout {
  const void* block_table;
  int block_table_int64;  // 0: int32 entries, 1: int64
  int64_t bt_stride_row, bt_stride_col;
  int64_t block_size;
  int64_t stride_block, stride_offset, stride_head, stride_dim;  // of the paged tensor, in elements
};

// torch_ops.gather_paged: out_k/out_v [N, H, D] contiguous; packed token n of row r (cu[r] <= n <
// cu[r + 1]) is logical token starts[r] + n - cu[r] of block-table row rows[r]. k and v share the
// layout. cu/rows/starts: int64 device arrays of R + 1, R, R entries; N = cu[R].
int gather_paged(const void* k, const void* v, void* out_k, void* out_v, int64_t elem_size, int64_t H,
                 int64_t D, const PagedLayout& layout, const int64_t* cu, const int64_t* rows,
                 const int64_t* starts, int64_t R, int64_t N, int device, intptr_t stream);

// torch_ops.scatter_paged: dst[slot of logical token dst_start[r] + j, h, :] =
// src[cu[r] + idx[cu_keep[r] + j, h], h, :] for j < cu_keep[r + 1] - cu_keep[r]; src [N, H, D]
// contiguous, idx [M, H] int64 contiguous, M = cu_keep[R]. dst_dtype == src_dtype: a copy (any
// element size 1/2/4/8); otherwise converted like torch's .to(dst.dtype) among float32/float16/
// bfloat16, or among float32/int32/int64.
int scatter_paged(void* dst, int dst_dtype, const void* src, int src_dtype, int64_t elem_size, int64_t H,
                  int64_t D, const PagedLayout& layout, const int64_t* idx, const int64_t* cu,
                  const int64_t* cu_keep, const int64_t* rows, const int64_t* dst_start, int64_t R, int64_t M,
                  int device, intptr_t stream);

// How many token chunks keydiff_scores splits each row into (its scratch is [R, H, splits, D] floats).
int64_t keydiff_splits(int64_t N);

// policies/keydiff.py keydiff_scores: out [N, H] float32 = -cos(k, mu_r), K [N, H, D] contiguous (float32,
// float16 or bfloat16), cu int64 [R + 1]; partial: float32 scratch [R, H, keydiff_splits(N), D].
int keydiff_scores(const void* K, int dtype, const int64_t* cu, float* partial, float* out, int64_t R,
                   int64_t N, int64_t H, int64_t D, float eps, int device, intptr_t stream);

// cudaGetErrorString of a launcher's return value.
const char* error_string(int err);

// The largest head_dim keydiff_scores supports (its per-warp partial sums live in shared memory).
constexpr int64_t kMaxKeydiffDim = 1024;

}  // namespace kvevict
