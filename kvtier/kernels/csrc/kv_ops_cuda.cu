// CUDA gather/scatter. Chunks on the GPU: one thread block per chunk row. Chunks in pinned host
// memory (the engine's path): a bounded grid of warps, one warp per row, that reads or writes
// the host memory directly over PCIe. Both copy 16-byte words when the rows allow it. Arguments
// are validated by kv_ops.cpp before these run; slot values are checked here, on the GPU.
#include "kv_ops.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

namespace kvtier {
namespace {

// A failed launch, raised in Python as RuntimeError (not C10_CUDA_KERNEL_LAUNCH_CHECK: see
// KV_CHECK for why this extension throws no c10::Error).
void launch_check() {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(c10::str("kvtier: CUDA kernel launch failed: ",
                                      cudaGetErrorString(err)));
  }
}

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
  KV_CHECK(layers.size() <= 65535, "at most 65535 layers per call, got ", layers.size());
  return dim3(static_cast<unsigned>(slots.numel()), static_cast<unsigned>(layers.size()));
}

// ---- chunks in pinned host memory ----

constexpr int kHostThreads = 256;
constexpr int kWarpsPerBlock = kHostThreads / 32;
// Words each lane loads before it stores them: reads over PCIe take about a microsecond, so
// the PCIe limit needs many in flight (32 blocks x 8 warps x 32 lanes x 4 x 16 B = 512 KiB).
constexpr int kUnroll = 4;

struct HostCopy {
  const int64_t* layer_ptrs;  // [num_layers] pool layer base addresses
  const int64_t* chunk_ptrs;  // [num_chunks] device addresses of the mapped host chunks
  const int64_t* first;       // [num_chunks + 1] first concatenated token of each chunk
  const int64_t* slots;       // [first[num_chunks]] pool row of each token
  int32_t* status;            // [num_chunks] on the device, zeroed
  int64_t num_chunks, num_layers, num_slots, row_bytes, num_rows;
};

// One warp copies one row of n words; all lanes take the same branch (no divergence).
template <typename T>
__device__ __forceinline__ void copy_row_warp(char* dst, const char* src, int64_t n, int lane) {
  T* d = reinterpret_cast<T*>(dst);
  const T* s = reinterpret_cast<const T*>(src);
  for (int64_t k = lane; k < n; k += 32 * kUnroll) {
    T v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (k + 32 * u < n) v[u] = s[k + 32 * u];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (k + 32 * u < n) d[k + 32 * u] = v[u];
    }
  }
}

// Flat row r runs over the chunks in order, layer-major inside each chunk (chunk c holds rows
// [L * first[c], L * first[c + 1])), so consecutive warps touch consecutive host bytes.
template <typename T, bool kToHost>
__global__ void host_copy_kernel(HostCopy a) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
       r < a.num_rows; r += warps) {
    const int64_t c = find_chunk(a.first, a.num_chunks, r / a.num_layers);
    const int64_t tokens = a.first[c + 1] - a.first[c];
    const RowIndex i = row_index(r - a.num_layers * a.first[c], tokens);
    const int64_t slot = a.slots[a.first[c] + i.token];
    if (slot < 0 || slot >= a.num_slots) {
      // A -1 in a scatter is a row to leave alone; in a gather it leaves the chunk incomplete.
      const bool skip = slot == kSkipSlot;
      if (lane == 0 && (kToHost || !skip)) {
        atomicOr(a.status + c, skip ? kStatusSkipSlot : kStatusBadSlot);
      }
      continue;
    }
    char* pool = reinterpret_cast<char*>(a.layer_ptrs[i.layer]) + slot_offset(slot, a.row_bytes);
    char* chunk = reinterpret_cast<char*>(a.chunk_ptrs[c]) +
                  chunk_offset(i, tokens, a.row_bytes);
    if (kToHost) {
      copy_row_warp<T>(chunk, pool, a.row_bytes / static_cast<int64_t>(sizeof(T)), lane);
    } else {
      copy_row_warp<T>(pool, chunk, a.row_bytes / static_cast<int64_t>(sizeof(T)), lane);
    }
  }
}

// The address through which this device reaches pinned host memory at t's data (UVA); a
// ValueError if t is pageable, since the GPU cannot read or write that memory.
int64_t mapped_address(const at::Tensor& t, const char* name, size_t i) {
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, t.data_ptr());
  if (err != cudaSuccess) (void)cudaGetLastError();  // pageable memory on old runtimes
  KV_CHECK(err == cudaSuccess && attr.type == cudaMemoryTypeHost &&
                        attr.devicePointer != nullptr,
                    name, "[", i, "] is not in pinned (page-locked) host memory, so the GPU "
                    "cannot copy it directly; allocate it with pin_memory=True");
  return reinterpret_cast<int64_t>(attr.devicePointer);
}

template <bool kToHost>
void host_copy(const std::vector<at::Tensor>& layers, const at::Tensor& slots,
               const std::vector<at::Tensor>& chunks, at::Tensor& status, int64_t row_bytes,
               int64_t max_blocks, const char* name) {
  const c10::cuda::CUDAGuard guard(slots.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t num_layers = static_cast<int64_t>(layers.size());
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  // One table, one copy to the device: layer addresses, chunk addresses, chunk starts.
  auto table = at::empty({num_layers + 2 * num_chunks + 1},
                         at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* p = table.data_ptr<int64_t>();
  bool aligned = row_bytes % 16 == 0;
  for (int64_t l = 0; l < num_layers; ++l) {
    p[l] = reinterpret_cast<int64_t>(layers[l].data_ptr());
    aligned = aligned && p[l] % 16 == 0;
  }
  int64_t* chunk_ptrs = p + num_layers;
  int64_t* first = chunk_ptrs + num_chunks;
  first[0] = 0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    // An empty chunk has no rows, so its address is never used (and may be null).
    // A chunk on the device (a staging buffer) is addressed as it is.
    const auto& chunk = chunks[c];
    chunk_ptrs[c] = chunk.numel() == 0 ? 0
                    : chunk.is_cuda() ? reinterpret_cast<int64_t>(chunk.data_ptr())
                                      : mapped_address(chunk, name, c);
    aligned = aligned && chunk_ptrs[c] % 16 == 0;
    first[c + 1] = first[c] + chunks[c].size(1);
  }
  const auto dev_table = table.to(slots.device(), /*non_blocking=*/true);
  auto dev_status = at::zeros({num_chunks}, slots.options().dtype(at::kInt));
  const int64_t* d = dev_table.data_ptr<int64_t>();
  HostCopy args{d, d + num_layers, d + num_layers + num_chunks, slots.data_ptr<int64_t>(),
                dev_status.data_ptr<int32_t>(), num_chunks, num_layers,
                layers[0].size(0), row_bytes, num_layers * first[num_chunks]};
  if (args.num_rows > 0) {
    const int64_t want = (args.num_rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
    const auto blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min(want, max_blocks)));
    if (aligned) {
      host_copy_kernel<int4, kToHost><<<blocks, kHostThreads, 0, stream>>>(args);
    } else {
      host_copy_kernel<char, kToHost><<<blocks, kHostThreads, 0, stream>>>(args);
    }
    launch_check();
  }
  status.copy_(dev_status, /*non_blocking=*/true);
}

}  // namespace

void gather_host_cuda(const std::vector<at::Tensor>& layers, const at::Tensor& slots,
                      const std::vector<at::Tensor>& outs, at::Tensor& status, int64_t row_bytes,
                      int64_t max_blocks) {
  host_copy<true>(layers, slots, outs, status, row_bytes, max_blocks, "outs");
}

void scatter_host_cuda(const std::vector<at::Tensor>& srcs, const at::Tensor& slots,
                       const std::vector<at::Tensor>& layers, at::Tensor& status,
                       int64_t row_bytes, int64_t max_blocks) {
  host_copy<false>(layers, slots, srcs, status, row_bytes, max_blocks, "srcs");
}

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
  launch_check();
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
  launch_check();
}

}  // namespace kvtier
