// CUDA gather/scatter: one thread block per chunk row, copying 16-byte words when the row
// allows it. Arguments are validated by kv_ops.cpp before these run.
#include "kv_ops.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace kvtier {
namespace {

constexpr int kThreads = 128;

// Copies one row of `n` words; T is int4 (16 B) when every row is 16-byte aligned, else char.
template <typename T>
__device__ __forceinline__ void copy_row(char* dst, const char* src, int64_t n) {
  T* d = reinterpret_cast<T*>(dst);
  const T* s = reinterpret_cast<const T*>(src);
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) d[k] = s[k];
}

// Grid: x = token, y = layer; each block copies one row.
template <typename T>
__global__ void gather_kernel(const int64_t* __restrict__ layer_ptrs,
                              const int64_t* __restrict__ slots, char* __restrict__ out,
                              int64_t num_tokens, int64_t row_bytes) {
  const RowIndex i{static_cast<int64_t>(blockIdx.y), static_cast<int64_t>(blockIdx.x)};
  const char* src = reinterpret_cast<const char*>(layer_ptrs[i.layer]) +
                    slot_offset(slots[i.token], row_bytes);
  copy_row<T>(out + chunk_offset(i, num_tokens, row_bytes), src, row_bytes / sizeof(T));
}

template <typename T>
__global__ void scatter_kernel(const char* __restrict__ src, const int64_t* __restrict__ slots,
                               const int64_t* __restrict__ layer_ptrs, int64_t num_tokens,
                               int64_t row_bytes) {
  const RowIndex i{static_cast<int64_t>(blockIdx.y), static_cast<int64_t>(blockIdx.x)};
  const int64_t slot = slots[i.token];
  if (slot == kSkipSlot) return;
  char* dst = reinterpret_cast<char*>(layer_ptrs[i.layer]) + slot_offset(slot, row_bytes);
  copy_row<T>(dst, src + chunk_offset(i, num_tokens, row_bytes), row_bytes / sizeof(T));
}

// The layers' base addresses as a device array (pinned staging, so the copy is asynchronous
// and the caching host allocator keeps the buffer alive until the copy has run).
at::Tensor layer_table(const std::vector<at::Tensor>& layers, const at::Device& dev) {
  auto host = at::empty({static_cast<int64_t>(layers.size())},
                        at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* p = host.data_ptr<int64_t>();
  for (size_t l = 0; l < layers.size(); ++l) {
    p[l] = reinterpret_cast<int64_t>(layers[l].data_ptr());
  }
  return host.to(dev, /*non_blocking=*/true);
}

bool aligned16(const std::vector<at::Tensor>& layers, const void* chunk, int64_t row_bytes) {
  if (row_bytes % 16 != 0 || reinterpret_cast<uintptr_t>(chunk) % 16 != 0) return false;
  for (const auto& l : layers) {
    if (reinterpret_cast<uintptr_t>(l.data_ptr()) % 16 != 0) return false;
  }
  return true;
}

// gridDim.y is limited to 65535 layers (two per model layer for MHA: far above any model).
dim3 grid_for(const at::Tensor& slots, const std::vector<at::Tensor>& layers) {
  TORCH_CHECK_VALUE(layers.size() <= 65535, "at most 65535 layers per call, got ", layers.size());
  return dim3(static_cast<unsigned>(slots.numel()), static_cast<unsigned>(layers.size()));
}

}  // namespace

void gather_cuda(const std::vector<at::Tensor>& layers, const at::Tensor& slots,
                 at::Tensor& out, int64_t row_bytes) {
  const c10::cuda::CUDAGuard guard(out.device());
  const auto table = layer_table(layers, out.device());
  const dim3 grid = grid_for(slots, layers);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  char* dst = static_cast<char*>(out.data_ptr());
  if (aligned16(layers, dst, row_bytes)) {
    gather_kernel<int4><<<grid, kThreads, 0, stream>>>(
        table.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), dst, slots.numel(), row_bytes);
  } else {
    gather_kernel<char><<<grid, kThreads, 0, stream>>>(
        table.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), dst, slots.numel(), row_bytes);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void scatter_cuda(const at::Tensor& src, const at::Tensor& slots,
                  const std::vector<at::Tensor>& layers, int64_t row_bytes) {
  const c10::cuda::CUDAGuard guard(src.device());
  const auto table = layer_table(layers, src.device());
  const dim3 grid = grid_for(slots, layers);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const char* from = static_cast<const char*>(src.data_ptr());
  if (aligned16(layers, from, row_bytes)) {
    scatter_kernel<int4><<<grid, kThreads, 0, stream>>>(
        from, slots.data_ptr<int64_t>(), table.data_ptr<int64_t>(), slots.numel(), row_bytes);
  } else {
    scatter_kernel<char><<<grid, kThreads, 0, stream>>>(
        from, slots.data_ptr<int64_t>(), table.data_ptr<int64_t>(), slots.numel(), row_bytes);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kvtier
