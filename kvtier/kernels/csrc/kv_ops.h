// Shared index math and declarations for the multi-layer gather/scatter kernels.
//
// Both kernels treat KV as rows of bytes: a layer is [num_slots, row_bytes] and a chunk is
// [num_layers, num_tokens, row_bytes], so one implementation serves every dtype (fp8 included).
// The CPU kernel copies layer by layer, a run of adjacent slots as one piece, so consecutive
// pieces touch consecutive chunk bytes (the chunk side streams, the pool side jumps unless the
// slots run); the CUDA kernel maps (token, layer) to its grid directly. Both share the offsets
// below.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <utility>
#include <vector>

// ATen/ATen.h declares every operator: ~14 s of compile for each file that includes it, most of
// a user's first-use build of the CPU kernel. The CPU code needs the Tensor class and
// parallel_for; the CUDA build keeps the whole header.
#if defined(__CUDACC__) || defined(KVTIER_WITH_CUDA)
#include <ATen/ATen.h>
#else
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#endif
#include <c10/util/StringUtil.h>

#ifdef __CUDACC__
#define KV_HD __host__ __device__ __forceinline__
#else
#define KV_HD inline
#endif

// A bad argument, raised in Python as ValueError: thrown as std::invalid_argument, which pybind11
// translates itself. Not TORCH_CHECK: under torch 2.11+cu130 (the H100 machine) every c10::Error
// thrown from this extension killed the process with SIGSEGV instead of raising.
#define KV_CHECK(cond, ...)                                        \
  do {                                                             \
    if (!(cond)) throw std::invalid_argument(c10::str(__VA_ARGS__)); \
  } while (0)

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

// Per-chunk status bits of the host copies (gather_host/scatter_host), which check slots on the
// GPU instead of the host: a row with a bad slot is not copied and its chunk's word says why.
constexpr int32_t kStatusSkipSlot = 1;  // gather met a -1 slot: the chunk is incomplete
constexpr int32_t kStatusBadSlot = 2;   // a slot outside [-1, num_slots): its rows not copied

// The chunk holding concatenated token t: the last c with first[c] <= t (first[0, num_chunks)
// ascending; empty chunks share a start, and the last of them wins).
KV_HD int64_t find_chunk(const int64_t* first, int64_t num_chunks, int64_t t) {
  int64_t lo = 0, hi = num_chunks - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (first[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The smallest and largest value of a non-empty contiguous CPU int64 vector, in one pass and
// without the tensors and dispatches at::aminmax costs (tens of microseconds on a cold call).
std::pair<int64_t, int64_t> value_bounds(const at::Tensor& values);

// Called by each copy once its arguments are checked, before it copies: the Python module
// releases the GIL there, so no check ever throws without it (see kv_module.cpp).
using Checked = std::function<void()>;

// The copies (kv_ops.cpp; arguments as in `kvtier.kernels.ops` and `host_copy`). Each checks
// every argument before a byte is written, throwing std::invalid_argument (KV_CHECK) for a bad
// one, then calls `checked` and copies.
void gather(const Checked& checked, const std::vector<at::Tensor>& layers,
            const at::Tensor& slots, at::Tensor out, int64_t max_threads);
void scatter(const Checked& checked, const at::Tensor& src, const at::Tensor& slots,
             const std::vector<at::Tensor>& layers, int64_t max_threads);
void gather_chunks(const Checked& checked, const std::vector<at::Tensor>& layers,
                   const at::Tensor& slots, const std::vector<at::Tensor>& outs,
                   int64_t max_threads);
void scatter_chunks(const Checked& checked, const std::vector<at::Tensor>& srcs,
                    const at::Tensor& slots, const std::vector<at::Tensor>& layers,
                    int64_t max_threads);
void gather_host(const Checked& checked, const std::vector<at::Tensor>& layers,
                 const at::Tensor& slots, const std::vector<at::Tensor>& outs, at::Tensor status,
                 int64_t max_blocks);
void scatter_host(const Checked& checked, const std::vector<at::Tensor>& srcs,
                  const at::Tensor& slots, const std::vector<at::Tensor>& layers,
                  at::Tensor status, int64_t max_blocks);

#ifdef KVTIER_WITH_CUDA
void gather_cuda(const std::vector<at::Tensor>& layers, const at::Tensor& slots,
                 at::Tensor& out, int64_t row_bytes);
void scatter_cuda(const at::Tensor& src, const at::Tensor& slots,
                  const std::vector<at::Tensor>& layers, int64_t row_bytes);
// Between a CUDA pool and chunks in pinned host memory, which the kernel reads or writes
// directly (mapped, over PCIe): one launch for all chunks, on the current stream, no host
// synchronisation. `status` (pinned int32, one word per chunk) is written on the stream after
// the copy. `max_blocks` bounds the grid so that the forward pass keeps the other SMs.
void gather_host_cuda(const std::vector<at::Tensor>& layers, const at::Tensor& slots,
                      const std::vector<at::Tensor>& outs, at::Tensor& status, int64_t row_bytes,
                      int64_t max_blocks);
void scatter_host_cuda(const std::vector<at::Tensor>& srcs, const at::Tensor& slots,
                       const std::vector<at::Tensor>& layers, at::Tensor& status,
                       int64_t row_bytes, int64_t max_blocks);
#endif

}  // namespace kvtier
