// Multi-layer gather/scatter between a paged KV pool and one contiguous chunk (CPU + dispatch).
//
// gather(layers, slots, out):  out[l, t] = layers[l][slots[t]]
// scatter(src, slots, layers): layers[l][slots[t]] = src[l, t] for slots[t] != -1
//
// Every argument is validated before a byte is written (the Python wrapper checks the same
// things first; these checks keep the extension safe when called directly).
#include "kv_ops.h"

#include <ATen/Parallel.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace kvtier {
namespace {

// Rows are 0.5-4 KiB in practice; give each thread at least this much to copy per task so the
// scheduling cost stays small against the copy.
constexpr int64_t kGrainBytes = 256 * 1024;

// Asks for the whole row ahead of the copy; the hardware prefetcher only follows it once the
// copy has started, and each row starts at a random address.
inline void prefetch_row(const char* row, int64_t row_bytes) {
  for (int64_t k = 0; k < row_bytes; k += 64) __builtin_prefetch(row + k);
}

// Copies one row into a chunk with streaming stores where the row allows (x86-64, 16-byte
// aligned destination and size): a stored chunk is read next by a disk or Redis writer, not by
// this core, so its lines need not pass through the cache. Plain stores would first read every
// destination line (a read-for-ownership), a third memory stream on top of the copy's two.
inline void copy_row_streaming(char* dst, const char* src, int64_t row_bytes) {
#if defined(__SSE2__)
  if ((reinterpret_cast<uintptr_t>(dst) & 15) == 0 && (row_bytes & 15) == 0) {
    for (int64_t k = 0; k < row_bytes; k += 16) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k), v);
    }
    return;
  }
#endif
  std::memcpy(dst, src, row_bytes);
}

// Orders a thread's streaming stores before whatever it does next (the caller then hands
// the chunk to other threads).
inline void end_streaming() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// Validates the layers and the slot vector (not its values); returns the row size in bytes.
int64_t check_pool(const std::vector<at::Tensor>& layers, const at::Tensor& slots) {
  TORCH_CHECK_VALUE(!layers.empty(), "layers must not be empty");
  const auto& first = layers[0];
  TORCH_CHECK_VALUE(first.dim() == 2, "layers must be 2-D [num_slots, hidden], got ",
                    first.sizes());
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& layer = layers[i];
    TORCH_CHECK_VALUE(layer.sizes() == first.sizes() && layer.dtype() == first.dtype() &&
                          layer.device() == first.device(),
                      "layers[", i, "] is ", layer.dtype(), " ", layer.sizes(), " on ",
                      layer.device(), "; layers[0] is ", first.dtype(), " ", first.sizes(),
                      " on ", first.device(), ": they must match");
    TORCH_CHECK_VALUE(layer.is_contiguous(), "layers[", i, "] must be contiguous");
  }
  TORCH_CHECK_VALUE(slots.dim() == 1 && slots.scalar_type() == at::kLong,
                    "slots must be a 1-D int64 tensor");
  TORCH_CHECK_VALUE(slots.device() == first.device(), "slots must be on the layers' device");
  TORCH_CHECK_VALUE(slots.is_contiguous(), "slots must be contiguous");
  return first.size(1) * first.element_size();
}

// Every slot is a row of the layers (or -1 with allow_skip).
void check_range(const std::vector<at::Tensor>& layers, const at::Tensor& slots,
                 bool allow_skip) {
  const auto& first = layers[0];
  if (slots.numel() > 0) {
    // One pass on the host; on a GPU this is one reduction and one sync.
    auto [lo_t, hi_t] = at::aminmax(slots);
    const int64_t lo = lo_t.item<int64_t>(), hi = hi_t.item<int64_t>();
    const int64_t min_ok = allow_skip ? kSkipSlot : 0;
    TORCH_CHECK_VALUE(lo >= min_ok && hi < first.size(0), "slots must be in [", min_ok, ", ",
                      first.size(0), "), got values in [", lo, ", ", hi, "]");
  }
}

// Validates one contiguous [num_layers, num_tokens, hidden] chunk against the layers.
void check_chunk(const std::vector<at::Tensor>& layers, const at::Tensor& chunk,
                 int64_t num_tokens, const std::string& chunk_name) {
  const auto& first = layers[0];
  TORCH_CHECK_VALUE(chunk.device() == first.device() && chunk.dtype() == first.dtype(),
                    chunk_name, " must match the layers' dtype and device");
  TORCH_CHECK_VALUE(chunk.is_contiguous(), chunk_name, " must be contiguous");
  const int64_t n = static_cast<int64_t>(layers.size());
  TORCH_CHECK_VALUE(chunk.dim() == 3 && chunk.size(0) == n && chunk.size(1) == num_tokens &&
                        chunk.size(2) == first.size(1),
                    chunk_name, " must have shape [", n, ", ", num_tokens, ", ",
                    first.size(1), "], got ", chunk.sizes());
}

// Validates layers/slots/chunk and returns the row size in bytes.
int64_t check_args(const std::vector<at::Tensor>& layers, const at::Tensor& slots,
                   const at::Tensor& chunk, const char* chunk_name, bool allow_skip) {
  const int64_t row_bytes = check_pool(layers, slots);
  check_chunk(layers, chunk, slots.numel(), chunk_name);
  check_range(layers, slots, allow_skip);
  return row_bytes;
}

// Runs fn(begin, end) over [0, num_rows) in tasks of about kGrainBytes, handed out dynamically:
// when a thread is descheduled (the host is busy serving), the others take over its share instead
// of the whole call waiting for it. A small copy runs inline on the calling thread, and so does
// every copy with max_threads 1 (a background copy must not take the serving engine's cores).
template <typename F>
void parallel_rows(int64_t num_rows, int64_t row_bytes, int64_t max_threads, const F& fn) {
  const int64_t rows_per_task = std::max<int64_t>(1, kGrainBytes / row_bytes);
  const int64_t num_tasks = (num_rows + rows_per_task - 1) / rows_per_task;
  std::atomic<int64_t> next{0};
  const auto worker = [&](int64_t, int64_t) {
    for (int64_t t = next++; t < num_tasks; t = next++) {
      fn(t * rows_per_task, std::min(num_rows, (t + 1) * rows_per_task));
    }
  };
  int64_t threads = at::get_num_threads();
  if (max_threads > 0) threads = std::min(threads, max_threads);
  at::parallel_for(0, std::min(num_tasks, threads), 1, worker);
}

void gather_cpu(const std::vector<at::Tensor>& layers, const at::Tensor& slots, at::Tensor& out,
                int64_t row_bytes, int64_t max_threads) {
  const int64_t num_tokens = slots.numel();
  const int64_t num_rows = num_tokens * static_cast<int64_t>(layers.size());
  std::vector<const char*> base;
  for (const auto& layer : layers) base.push_back(static_cast<const char*>(layer.data_ptr()));
  const int64_t* slot = slots.data_ptr<int64_t>();
  char* dst = static_cast<char*>(out.data_ptr());
  const auto src_row = [&](int64_t r) {
    const RowIndex i = row_index(r, num_tokens);
    return base[i.layer] + slot_offset(slot[i.token], row_bytes);
  };
  parallel_rows(num_rows, row_bytes, max_threads, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      if (r + 1 < num_rows) prefetch_row(src_row(r + 1), row_bytes);
      copy_row_streaming(dst + chunk_offset(row_index(r, num_tokens), num_tokens, row_bytes),
                         src_row(r), row_bytes);
    }
    end_streaming();
  });
}

void scatter_cpu(const at::Tensor& src, const at::Tensor& slots,
                 const std::vector<at::Tensor>& layers, int64_t row_bytes, int64_t max_threads) {
  const int64_t num_tokens = slots.numel();
  const int64_t num_rows = num_tokens * static_cast<int64_t>(layers.size());
  std::vector<char*> base;
  for (const auto& layer : layers) base.push_back(static_cast<char*>(layer.data_ptr()));
  const int64_t* slot = slots.data_ptr<int64_t>();
  const char* from = static_cast<const char*>(src.data_ptr());
  parallel_rows(num_rows, row_bytes, max_threads, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const RowIndex i = row_index(r, num_tokens);
      if (slot[i.token] == kSkipSlot) continue;
      std::memcpy(base[i.layer] + slot_offset(slot[i.token], row_bytes),
                  from + chunk_offset(i, num_tokens, row_bytes), row_bytes);
    }
  });
}

// scatter_cpu over consecutive chunks in one parallel loop: flat row r of the whole batch is
// chunk c's row r - first_row[c], so the threads never wait at a chunk boundary.
void scatter_chunks_cpu(const std::vector<at::Tensor>& srcs, const at::Tensor& slots,
                        const std::vector<at::Tensor>& layers, int64_t row_bytes,
                        int64_t max_threads) {
  const int64_t num_layers = static_cast<int64_t>(layers.size());
  std::vector<char*> base;
  for (const auto& layer : layers) base.push_back(static_cast<char*>(layer.data_ptr()));
  std::vector<const char*> from;
  std::vector<int64_t> first_row, first_token, tokens;
  int64_t num_rows = 0, num_tokens = 0;
  for (const auto& src : srcs) {
    from.push_back(static_cast<const char*>(src.data_ptr()));
    first_row.push_back(num_rows);
    first_token.push_back(num_tokens);
    tokens.push_back(src.size(1));
    num_rows += num_layers * src.size(1);
    num_tokens += src.size(1);
  }
  const int64_t* slot = slots.data_ptr<int64_t>();
  parallel_rows(num_rows, row_bytes, max_threads, [&](int64_t b, int64_t e) {
    // The last chunk starting at or before b (empty chunks share a start: take the last).
    size_t c = static_cast<size_t>(
        find_chunk(first_row.data(), static_cast<int64_t>(first_row.size()), b));
    for (int64_t r = b; r < e; ++r) {
      while (c + 1 < first_row.size() && r >= first_row[c + 1]) ++c;
      const RowIndex i = row_index(r - first_row[c], tokens[c]);
      const int64_t s = slot[first_token[c] + i.token];
      if (s == kSkipSlot) continue;
      std::memcpy(base[i.layer] + slot_offset(s, row_bytes),
                  from[c] + chunk_offset(i, tokens[c], row_bytes), row_bytes);
    }
  });
}

}  // namespace

void gather(const std::vector<at::Tensor>& layers, const at::Tensor& slots, at::Tensor out,
            int64_t max_threads) {
  const int64_t row_bytes = check_args(layers, slots, out, "out", /*allow_skip=*/false);
  if (slots.numel() == 0 || row_bytes == 0) return;
  if (out.is_cuda()) {
#ifdef KVTIER_WITH_CUDA
    gather_cuda(layers, slots, out, row_bytes);
    return;
#else
    TORCH_CHECK_VALUE(false, "kvtier._C was built without CUDA");
#endif
  }
  TORCH_CHECK_VALUE(out.is_cpu(), "out must be on the CPU or a CUDA device");
  gather_cpu(layers, slots, out, row_bytes, max_threads);
}

void scatter(const at::Tensor& src, const at::Tensor& slots,
             const std::vector<at::Tensor>& layers, int64_t max_threads) {
  const int64_t row_bytes = check_args(layers, slots, src, "src", /*allow_skip=*/true);
  if (slots.numel() == 0 || row_bytes == 0) return;
  if (src.is_cuda()) {
#ifdef KVTIER_WITH_CUDA
    scatter_cuda(src, slots, layers, row_bytes);
    return;
#else
    TORCH_CHECK_VALUE(false, "kvtier._C was built without CUDA");
#endif
  }
  TORCH_CHECK_VALUE(src.is_cpu(), "src must be on the CPU or a CUDA device");
  scatter_cpu(src, slots, layers, row_bytes, max_threads);
}

void scatter_chunks(const std::vector<at::Tensor>& srcs, const at::Tensor& slots,
                    const std::vector<at::Tensor>& layers, int64_t max_threads) {
  // Everything is validated (the slot range once, over all chunks) before a byte is written.
  TORCH_CHECK_VALUE(!srcs.empty(), "srcs must not be empty");
  const int64_t row_bytes = check_pool(layers, slots);
  int64_t total = 0;
  for (size_t c = 0; c < srcs.size(); ++c) {
    TORCH_CHECK_VALUE(srcs[c].dim() == 3, "srcs[", c, "] must be 3-D [layers, tokens, hidden]");
    check_chunk(layers, srcs[c], srcs[c].size(1), "srcs[" + std::to_string(c) + "]");
    total += srcs[c].size(1);
  }
  TORCH_CHECK_VALUE(total == slots.numel(), "srcs hold ", total, " tokens, slots has ",
                    slots.numel());
  check_range(layers, slots, /*allow_skip=*/true);
  if (total == 0 || row_bytes == 0) return;
  if (slots.is_cuda()) {
#ifdef KVTIER_WITH_CUDA
    int64_t offset = 0;  // one launch per chunk, all on the current stream
    for (const auto& src : srcs) {
      scatter_cuda(src, slots.narrow(0, offset, src.size(1)), layers, row_bytes);
      offset += src.size(1);
    }
    return;
#else
    TORCH_CHECK_VALUE(false, "kvtier._C was built without CUDA");
#endif
  }
  TORCH_CHECK_VALUE(slots.is_cpu(), "slots must be on the CPU or a CUDA device");
  scatter_chunks_cpu(srcs, slots, layers, row_bytes, max_threads);
}

// Validates host copies' arguments: a CUDA pool, slots on it, pinned CPU chunks (or chunks in a
// staging buffer on the pool's device) of the pool's dtype and row size holding one token per
// slot, one int32 status word per chunk.
int64_t check_host_args(const std::vector<at::Tensor>& layers, const at::Tensor& slots,
                        const std::vector<at::Tensor>& chunks, const at::Tensor& status,
                        const char* name) {
  const int64_t row_bytes = check_pool(layers, slots);
  const auto& first = layers[0];
  TORCH_CHECK_VALUE(first.is_cuda(), "layers must be on a CUDA device, got ", first.device());
  TORCH_CHECK_VALUE(!chunks.empty(), name, " must not be empty");
  const int64_t n = static_cast<int64_t>(layers.size());
  int64_t total = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const auto& chunk = chunks[c];
    // Pinned host chunks (mapped), or a staging buffer on the layers' device.
    TORCH_CHECK_VALUE((chunk.is_cpu() || chunk.device() == first.device()) &&
                          chunk.dtype() == first.dtype(),
                      name, "[", c, "] must be a CPU tensor or one on ", first.device(),
                      " of the layers' dtype ", first.dtype(), ", got ", chunk.dtype(), " on ",
                      chunk.device());
    TORCH_CHECK_VALUE(chunk.is_contiguous(), name, "[", c, "] must be contiguous");
    TORCH_CHECK_VALUE(chunk.dim() == 3 && chunk.size(0) == n && chunk.size(2) == first.size(1),
                      name, "[", c, "] must have shape [", n, ", tokens, ", first.size(1),
                      "], got ", chunk.sizes());
    total += chunk.size(1);
  }
  TORCH_CHECK_VALUE(total == slots.numel(), name, " hold ", total, " tokens, slots has ",
                    slots.numel());
  TORCH_CHECK_VALUE(status.is_cpu() && status.scalar_type() == at::kInt &&
                        status.is_contiguous() &&
                        status.numel() == static_cast<int64_t>(chunks.size()),
                    "status must be a contiguous CPU int32 tensor with one word per chunk (",
                    chunks.size(), ")");
  return row_bytes;
}

void gather_host(const std::vector<at::Tensor>& layers, const at::Tensor& slots,
                 const std::vector<at::Tensor>& outs, at::Tensor status, int64_t max_blocks) {
  const int64_t row_bytes = check_host_args(layers, slots, outs, status, "outs");
#ifdef KVTIER_WITH_CUDA
  gather_host_cuda(layers, slots, outs, status, row_bytes, max_blocks);
#else
  (void)row_bytes;
  (void)max_blocks;
  TORCH_CHECK_VALUE(false, "kvtier._C was built without CUDA");
#endif
}

void scatter_host(const std::vector<at::Tensor>& srcs, const at::Tensor& slots,
                  const std::vector<at::Tensor>& layers, at::Tensor status, int64_t max_blocks) {
  const int64_t row_bytes = check_host_args(layers, slots, srcs, status, "srcs");
#ifdef KVTIER_WITH_CUDA
  scatter_host_cuda(srcs, slots, layers, status, row_bytes, max_blocks);
#else
  (void)row_bytes;
  (void)max_blocks;
  TORCH_CHECK_VALUE(false, "kvtier._C was built without CUDA");
#endif
}

}  // namespace kvtier

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvtier multi-layer KV gather/scatter kernels";
#ifdef KVTIER_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
  // The copies can take milliseconds: let other Python threads (the background writer) run.
  m.def("gather", &kvtier::gather, "out[l, t] = layers[l][slots[t]]",
        py::arg("layers"), py::arg("slots"), py::arg("out"), py::arg("max_threads") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("scatter", &kvtier::scatter, "layers[l][slots[t]] = src[l, t] for slots[t] != -1",
        py::arg("src"), py::arg("slots"), py::arg("layers"), py::arg("max_threads") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("scatter_chunks", &kvtier::scatter_chunks,
        "scatter(srcs[c], slots[offset_c : offset_c + T_c], layers) for every chunk c, with "
        "the slots checked once",
        py::arg("srcs"), py::arg("slots"), py::arg("layers"), py::arg("max_threads") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("gather_host", &kvtier::gather_host,
        "outs[c][l, t] = layers[l][slots[first_c + t]] for CUDA layers and pinned host chunks, "
        "enqueued on the current stream; slots checked on the GPU into status",
        py::arg("layers"), py::arg("slots"), py::arg("outs"), py::arg("status"),
        py::arg("max_blocks"), py::call_guard<py::gil_scoped_release>());
  m.def("scatter_host", &kvtier::scatter_host,
        "layers[l][slots[first_c + t]] = srcs[c][l, t] for pinned host chunks and CUDA layers "
        "(-1 slots skipped), enqueued on the current stream; slots checked on the GPU",
        py::arg("srcs"), py::arg("slots"), py::arg("layers"), py::arg("status"),
        py::arg("max_blocks"), py::call_guard<py::gil_scoped_release>());
}
