// Shared index math and declarations for the multi-layer gather/scatter kernels.
//
// Both kernels treat KV as rows of bytes: a layer is [num_slots, row_bytes] and a chunk is
// [num_layers, num_tokens, row_bytes], so one implementation serves every dtype (fp8 included).
// The CPU kernel numbers rows by a flat index r in [0, num_layers * num_tokens), layer-major, so
// consecutive r touch consecutive chunk bytes (the chunk side streams, the pool side is random);
// the CUDA kernel maps (token, layer) to its grid directly. Both share the offsets below.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

#ifdef __CUDACC__
#define KV_HD __host__ __device__ __forceinline__
#else
#define KV_HD inline
#endif

namespace kvtier {

// The chunk row for flat index r: layer r / T, token r % T.
struct RowIndex {
  int64_t layer;
  int64_t token;
};

KV_HD RowIndex row_index(int64_t r, int64_t num_tokens) {
  return {r / num_tokens, r % num_tokens};
}

// Byte offset of (layer, token) in a contiguous [num_layers, num_tokens, row_bytes] chunk.
KV_HD int64_t chunk_offset(RowIndex i, int64_t num_tokens, int64_t row_bytes) {
  return (i.layer * num_tokens + i.token) * row_bytes;
}

// Byte offset of a slot's row in a contiguous [num_slots, row_bytes] layer.
KV_HD int64_t slot_offset(int64_t slot, int64_t row_bytes) { return slot * row_bytes; }

// -1 marks "do not touch" in scatter; anything else must be a valid slot.
constexpr int64_t kSkipSlot = -1;

#ifdef KVTIER_WITH_CUDA
void gather_cuda(const std::vector<at::Tensor>& layers, const at::Tensor& slots,
                 at::Tensor& out, int64_t row_bytes);
void scatter_cuda(const at::Tensor& src, const at::Tensor& slots,
                  const std::vector<at::Tensor>& layers, int64_t row_bytes);
#endif

}  // namespace kvtier
