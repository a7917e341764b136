// SPDX-License-Identifier: Apache-2.0
// Python bindings of the CUDA eviction kernels (kvevict_kernels.cu): argument checks, output
// allocation and the calls to the launchers. Only torch's CPU headers are used (no c10/cuda, no
// ATen/cuda), so this file builds against a CPU-only torch too; the CUDA stream comes from Python as
// an integer (torch.cuda.current_stream(device).cuda_stream). Python entry points with the
// reference's signatures: vllm_kvevict/kernels/cuda_ops.py.

#include <torch/extension.h>

#include <cstdint>

#include "kvevict_kernels.h"

namespace {

using torch::Tensor;

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kvevict::kF32;
    case at::kHalf: return kvevict::kF16;
    case at::kBFloat16: return kvevict::kBF16;
    case at::kInt: return kvevict::kI32;
    case at::kLong: return kvevict::kI64;
    default: return kvevict::kOther;
  }
}

bool is_float(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

void check_cuda(const Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "kvevict cuda_ops: ", name, " must be a CUDA tensor, got one on ", t.device());
}

void check_same_device(const Tensor& t, const Tensor& ref, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.device() == ref.device(), "kvevict cuda_ops: ", name, " is on ", t.device(), ", expected ",
              ref.device());
}

void check_index(const Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.dim() == dim, "kvevict cuda_ops: ", name, " must have ", dim, " dimension(s), got shape ",
              t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "kvevict cuda_ops: ", name,
              " must be int32 or int64, got ", t.scalar_type());
}

// A small index array (rows, starts, cu, ...) as contiguous int64 on `device`: a no-op when it is one.
Tensor as_index(const Tensor& t, const char* name, const at::Device& device) {
  check_index(t, name, 1);
  return t.to(device, at::kLong).contiguous();
}

void check_error(int err, const char* op) {
  TORCH_CHECK(err == 0, "kvevict cuda_ops: ", op, " failed: ", kvevict::error_string(err), " (CUDA error ", err,
              ")");
}

// The block table and the strides of a paged [num_blocks, block_size, H(, D)] tensor.
kvevict::PagedLayout layout_of(const Tensor& paged, const Tensor& block_table) {
  check_index(block_table, "block_table", 2);
  check_same_device(block_table, paged, "block_table");
  kvevict::PagedLayout l;
  l.block_table = block_table.data_ptr();
  l.block_table_int64 = block_table.scalar_type() == at::kLong ? 1 : 0;
  l.bt_stride_row = block_table.stride(0);
  l.bt_stride_col = block_table.stride(1);
  l.block_size = paged.size(1);
  l.stride_block = paged.stride(0);
  l.stride_offset = paged.stride(1);
  l.stride_head = paged.stride(2);
  l.stride_dim = paged.dim() == 4 ? paged.stride(3) : 0;
  return l;
}

// torch_ops.gather_paged
std::tuple<Tensor, Tensor, Tensor> gather_paged(const Tensor& k_cache, const Tensor& v_cache,
                                                const Tensor& block_table, const Tensor& rows, const Tensor& starts,
                                                const Tensor& ends, int64_t stream) {
  check_cuda(k_cache, "k_cache");
  check_same_device(v_cache, k_cache, "v_cache");
  TORCH_CHECK(k_cache.dim() == 4, "kvevict cuda_ops: gather_paged: k_cache must be [num_blocks, block_size, H, D], "
              "got shape ", k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(),
              "kvevict cuda_ops: gather_paged: v_cache must have k_cache's shape and strides, got ",
              v_cache.sizes(), " / ", v_cache.strides(), " and ", k_cache.sizes(), " / ", k_cache.strides());
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "kvevict cuda_ops: gather_paged: k_cache is ",
              k_cache.scalar_type(), " but v_cache is ", v_cache.scalar_type());
  const int64_t esize = k_cache.element_size();
  TORCH_CHECK(esize == 1 || esize == 2 || esize == 4 || esize == 8,
              "kvevict cuda_ops: gather_paged: unsupported element size ", esize);
  check_index(rows, "rows", 1);
  check_index(starts, "starts", 1);
  check_index(ends, "ends", 1);
  const int64_t R = rows.numel();
  TORCH_CHECK(starts.numel() == R && ends.numel() == R, "kvevict cuda_ops: gather_paged: rows, starts and ends "
              "must have one entry per row, got ", R, ", ", starts.numel(), ", ", ends.numel());
  TORCH_CHECK(starts.device() == ends.device(), "kvevict cuda_ops: gather_paged: starts and ends are on different "
              "devices");
  const auto layout = layout_of(k_cache, block_table);
  const at::Device dev = k_cache.device();
  const int64_t H = k_cache.size(2), D = k_cache.size(3);

  // cu exactly as the reference: int64 on the device of starts/ends.
  const Tensor lens = (ends - starts).to(at::kLong);
  const Tensor cu = at::cat({at::zeros({1}, lens.options()), at::cumsum(lens, 0)});
  const int64_t N = cu[R].item<int64_t>();  // the output size: one sync
  Tensor K = at::empty({N, H, D}, k_cache.options().memory_format(at::MemoryFormat::Contiguous));
  Tensor V = at::empty({N, H, D}, v_cache.options().memory_format(at::MemoryFormat::Contiguous));
  if (N == 0) return {K, V, cu};
  const Tensor cu_d = cu.to(dev).contiguous(), rows_d = as_index(rows, "rows", dev);
  const Tensor starts_d = as_index(starts, "starts", dev);
  check_error(kvevict::gather_paged(k_cache.data_ptr(), v_cache.data_ptr(), K.data_ptr(), V.data_ptr(), esize, H, D,
                                    layout, cu_d.data_ptr<int64_t>(), rows_d.data_ptr<int64_t>(),
                                    starts_d.data_ptr<int64_t>(), R, N, dev.index(), static_cast<intptr_t>(stream)),
              "gather_paged");
  return {K, V, cu};
}

// torch_ops.scatter_paged (in place)
void scatter_paged(Tensor dst, const Tensor& src, const Tensor& idx, const Tensor& cu, const Tensor& cu_keep,
                   const Tensor& block_table, const Tensor& rows, const Tensor& dst_start, int64_t stream) {
  check_cuda(dst, "dst");
  check_same_device(src, dst, "src");
  check_same_device(idx, dst, "idx");
  TORCH_CHECK(dst.dim() == 3 || dst.dim() == 4, "kvevict cuda_ops: scatter_paged: dst must be [num_blocks, "
              "block_size, H, D] or [num_blocks, block_size, H], got shape ", dst.sizes());
  TORCH_CHECK(src.dim() == dst.dim() - 1, "kvevict cuda_ops: scatter_paged: src must be [N, H", dst.dim() == 4 ?
              ", D" : "", "] for a ", dst.dim(), "-D dst, got shape ", src.sizes());
  const int64_t H = dst.size(2), D = dst.dim() == 4 ? dst.size(3) : 1;
  TORCH_CHECK(src.size(1) == H && (dst.dim() == 3 || src.size(2) == D), "kvevict cuda_ops: scatter_paged: src ",
              src.sizes(), " does not match dst ", dst.sizes());
  const auto dt = dst.scalar_type(), st = src.scalar_type();
  if (dt != st) {
    const bool ok = dst.dim() == 4 ? is_float(dt) && is_float(st)
                                   : (dt == at::kFloat || dt == at::kInt || dt == at::kLong) &&
                                         (st == at::kFloat || st == at::kInt || st == at::kLong);
    TORCH_CHECK(ok, "kvevict cuda_ops: scatter_paged: cannot convert ", st, " to ", dt, " (", dst.dim(),
                "-D dst: float32/float16/bfloat16 for the cache, float32/int32/int64 for per-slot state)");
  }
  const int64_t esize = dst.element_size();
  TORCH_CHECK(esize == 1 || esize == 2 || esize == 4 || esize == 8,
              "kvevict cuda_ops: scatter_paged: unsupported element size ", esize);
  check_index(idx, "idx", 2);
  TORCH_CHECK(idx.size(1) == H, "kvevict cuda_ops: scatter_paged: idx must be [sum keep, H=", H, "], got ",
              idx.sizes());
  const int64_t R = rows.numel();
  TORCH_CHECK(cu.numel() == R + 1 && cu_keep.numel() == R + 1 && dst_start.numel() == R,
              "kvevict cuda_ops: scatter_paged: expected cu, cu_keep [R + 1] and dst_start [R] for R=", R,
              " rows, got ", cu.numel(), ", ", cu_keep.numel(), ", ", dst_start.numel());
  const int64_t M = idx.size(0);  // == cu_keep[R] (not checked: that would sync)
  const auto layout = layout_of(dst, block_table);
  if (M == 0 || R == 0) return;
  const at::Device dev = dst.device();
  const Tensor src_c = src.reshape({src.size(0), H, D}).contiguous();
  const Tensor idx_c = idx.to(at::kLong).contiguous();
  const Tensor cu_d = as_index(cu, "cu", dev), keep_d = as_index(cu_keep, "cu_keep", dev);
  const Tensor rows_d = as_index(rows, "rows", dev), start_d = as_index(dst_start, "dst_start", dev);
  check_error(kvevict::scatter_paged(dst.data_ptr(), dtype_code(dt), src_c.data_ptr(), dtype_code(st), esize, H, D,
                                     layout, idx_c.data_ptr<int64_t>(), cu_d.data_ptr<int64_t>(),
                                     keep_d.data_ptr<int64_t>(), rows_d.data_ptr<int64_t>(),
                                     start_d.data_ptr<int64_t>(), R, M, dev.index(), static_cast<intptr_t>(stream)),
              "scatter_paged");
}

void check_keys(const Tensor& K, const char* op) {
  check_cuda(K, "K");
  TORCH_CHECK(K.dim() == 3, "kvevict cuda_ops: ", op, ": K must be [N, H, D], got shape ", K.sizes());
  TORCH_CHECK(is_float(K.scalar_type()), "kvevict cuda_ops: ", op, ": K must be float32, float16 or bfloat16, got ",
              K.scalar_type());
}

// policies/keydiff.py keydiff_scores
Tensor keydiff_scores(const Tensor& K, const Tensor& cu, double eps, int64_t stream) {
  check_keys(K, "keydiff_scores");
  const int64_t N = K.size(0), H = K.size(1), D = K.size(2);
  TORCH_CHECK(D > 0 && D <= kvevict::kMaxKeydiffDim, "kvevict cuda_ops: keydiff_scores: head_dim ", D,
              " is not supported (1 to ", kvevict::kMaxKeydiffDim, ")");
  const at::Device dev = K.device();
  const Tensor cu_d = as_index(cu, "cu", dev);
  const int64_t R = cu_d.numel() - 1;
  Tensor out = at::empty({N, H}, K.options().dtype(at::kFloat).memory_format(at::MemoryFormat::Contiguous));
  if (N == 0 || H == 0 || R <= 0) return out;
  const Tensor Kc = K.contiguous();
  Tensor partial = at::empty({R, H, kvevict::keydiff_splits(N), D}, out.options());
  check_error(kvevict::keydiff_scores(Kc.data_ptr(), dtype_code(K.scalar_type()), cu_d.data_ptr<int64_t>(),
                                      partial.data_ptr<float>(), out.data_ptr<float>(), R, N, H, D,
                                      static_cast<float>(eps), dev.index(), static_cast<intptr_t>(stream)),
              "keydiff_scores");
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "vllm-kvevict CUDA kernels (see vllm_kvevict/kernels/cuda_ops.py for the Python entry points)";
  m.def("gather_paged", &gather_paged, "torch_ops.gather_paged -> (K, V, cu)", py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_table"), py::arg("rows"), py::arg("starts"), py::arg("ends"),
        py::arg("stream"));
  m.def("scatter_paged", &scatter_paged, "torch_ops.scatter_paged, in place", py::arg("dst"), py::arg("src"),
        py::arg("idx"), py::arg("cu"), py::arg("cu_keep"), py::arg("block_table"), py::arg("rows"),
        py::arg("dst_start"), py::arg("stream"));
  m.def("keydiff_scores", &keydiff_scores, "torch_ops.keydiff_scores -> [N, H] float32", py::arg("K"),
        py::arg("cu"), py::arg("eps"), py::arg("stream"));
}
