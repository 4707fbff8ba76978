// Multi-layer gather/scatter between a paged KV pool and one contiguous chunk (CPU + dispatch).
//
// gather(layers, slots, out):  out[l, t] = layers[l][slots[t]]
// scatter(src, slots, layers): layers[l][slots[t]] = src[l, t] for slots[t] != -1
//
// Every argument is validated before a byte is written; a bad one throws std::invalid_argument
// (KV_CHECK), which kv_module.cpp hands to Python as a value.
#include "kv_ops.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>

#include "kv_copy_cpu.h"

namespace kvtier {
namespace {

using namespace cpu_copy;  // this file is the kernel those pieces make up

// Validates the layers and the slot vector (not its values); returns the row size in bytes.
int64_t check_pool(const std::vector<at::Tensor>& layers, const at::Tensor& slots) {
  KV_CHECK(!layers.empty(), "layers must not be empty");
  const auto& first = layers[0];
  KV_CHECK(first.dim() == 2, "layers must be 2-D [num_slots, hidden], got ", first.sizes());
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& layer = layers[i];
    KV_CHECK(layer.sizes() == first.sizes() && layer.dtype() == first.dtype() &&
                 layer.device() == first.device(),
             "layers[", i, "] is ", layer.dtype(), " ", layer.sizes(), " on ", layer.device(),
             "; layers[0] is ", first.dtype(), " ", first.sizes(), " on ", first.device(),
             ": they must match");
    KV_CHECK(layer.is_contiguous(), "layers[", i, "] must be contiguous");
  }
  KV_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong,
           "slots must be a 1-D int64 tensor");
  KV_CHECK(slots.device() == first.device(), "slots must be on the layers' device");
  KV_CHECK(slots.is_contiguous(), "slots must be contiguous");
  return first.size(1) * first.element_size();
}

// Every slot is a row of the layers (or -1 with allow_skip).
void check_range(const std::vector<at::Tensor>& layers, const at::Tensor& slots,
                 bool allow_skip) {
  const auto& first = layers[0];
  if (slots.numel() > 0) {
    // One pass on the host; on a GPU this is one reduction and one sync.
    int64_t lo, hi;
    if (slots.is_cpu()) {
      std::tie(lo, hi) = value_bounds(slots);
    } else {
#ifdef KVTIER_WITH_CUDA
      auto [lo_t, hi_t] = at::aminmax(slots);
      lo = lo_t.item<int64_t>();
      hi = hi_t.item<int64_t>();
#else
      KV_CHECK(false, "slots must be on the CPU: kvtier._C was built without CUDA");
#endif
    }
    const int64_t min_ok = allow_skip ? kSkipSlot : 0;
    KV_CHECK(lo >= min_ok && hi < first.size(0), "slots must be in [", min_ok, ", ",
             first.size(0), "), got values in [", lo, ", ", hi, "]");
  }
}

// Validates one contiguous [num_layers, num_tokens, hidden] chunk against the layers.
void check_chunk(const std::vector<at::Tensor>& layers, const at::Tensor& chunk,
                 int64_t num_tokens, const std::string& chunk_name) {
  const auto& first = layers[0];
  KV_CHECK(chunk.device() == first.device() && chunk.dtype() == first.dtype(), chunk_name,
           " must match the layers' dtype and device");
  KV_CHECK(chunk.is_contiguous(), chunk_name, " must be contiguous");
  const int64_t n = static_cast<int64_t>(layers.size());
  KV_CHECK(chunk.dim() == 3 && chunk.size(0) == n && chunk.size(1) == num_tokens &&
               chunk.size(2) == first.size(1),
           chunk_name, " must have shape [", n, ", ", num_tokens, ", ", first.size(1),
           "], got ", chunk.sizes());
}

// Validates layers/slots/chunk and returns the row size in bytes.
int64_t check_args(const std::vector<at::Tensor>& layers, const at::Tensor& slots,
                   const at::Tensor& chunk, const char* chunk_name, bool allow_skip) {
  const int64_t row_bytes = check_pool(layers, slots);
  check_chunk(layers, chunk, slots.numel(), chunk_name);
  check_range(layers, slots, allow_skip);
  return row_bytes;
}

// The chunk pointers and token counts of `chunks` (each [layers, tokens, hidden]), for Pieces.
std::pair<std::vector<char*>, std::vector<int64_t>> chunk_rows(
    const std::vector<at::Tensor>& chunks) {
  std::pair<std::vector<char*>, std::vector<int64_t>> rows;
  for (const auto& chunk : chunks) {
    rows.first.push_back(static_cast<char*>(chunk.data_ptr()));
    rows.second.push_back(chunk.size(1));
  }
  return rows;
}

// outs[c] receives the rows of the slots after those of outs[0, c).
void gather_cpu(const std::vector<at::Tensor>& layers, const at::Tensor& slots,
                const std::vector<at::Tensor>& outs, int64_t row_bytes, int64_t max_threads) {
  const auto base = layer_bases<const char*>(layers);
  auto [chunks, tokens] = chunk_rows(outs);
  const Pieces pieces(std::move(chunks), std::move(tokens), slots.data_ptr<int64_t>(),
                      static_cast<int64_t>(layers.size()), row_bytes);
  const auto pool_row = [&](const Pieces::Piece& p) { return base[p.layer] + p.pool; };
  parallel_pieces(pieces, max_threads, [&](int64_t b, int64_t e) {
    const auto to_l2 = [&](int64_t i) {
      const Pieces::Piece q = pieces[i];
      prefetch_bytes_l2(pool_row(q), std::min(q.bytes, kPrefetchBytes));
    };
    for (int64_t i = b; i < std::min(b + kRowsAhead, e); ++i) to_l2(i);
    Pieces::Piece p = pieces[b];
    prefetch_bytes(pool_row(p), std::min(p.bytes, kPrefetchBytes));
    for (int64_t i = b; i < e; ++i) {
      if (i + kRowsAhead < e) to_l2(i + kRowsAhead);
      const bool last = i + 1 == e;
      const Pieces::Piece next = last ? p : pieces[i + 1];
      const char* src = pool_row(p);
      // Block by block, each asking for the block after it (in this piece, else the next one):
      // a long piece spans pages, and the hardware prefetcher stops at every page boundary.
      for (int64_t k = 0; k < p.bytes; k += kPrefetchBytes) {
        const int64_t ahead = k + kPrefetchBytes;
        if (ahead < p.bytes) {
          prefetch_bytes(src + ahead, std::min(kPrefetchBytes, p.bytes - ahead));
        } else if (!last) {
          prefetch_bytes(pool_row(next), std::min(next.bytes, kPrefetchBytes));
        }
        copy_streaming(p.chunk + k, src + k, std::min(kPrefetchBytes, p.bytes - k));
      }
      p = next;
    }
    end_streaming();
  });
}

// srcs[c] holds the rows of the slots after those of srcs[0, c); -1 slots are left alone.
void scatter_cpu(const std::vector<at::Tensor>& srcs, const at::Tensor& slots,
                 const std::vector<at::Tensor>& layers, int64_t row_bytes, int64_t max_threads) {
  const auto base = layer_bases<char*>(layers);
  auto [chunks, tokens] = chunk_rows(srcs);
  const Pieces pieces(std::move(chunks), std::move(tokens), slots.data_ptr<int64_t>(),
                      static_cast<int64_t>(layers.size()), row_bytes);
  const bool stream = pieces.bytes() >= kStreamScatterBytes;
  const auto pool_row = [&](const Pieces::Piece& p) { return base[p.layer] + p.pool; };
  parallel_pieces(pieces, max_threads, [&](int64_t b, int64_t e) {
    // A streaming store needs no line read first, but it does need its page's translation.
    for (int64_t i = b; i < std::min(b + kTlbAhead, e); ++i) {
      __builtin_prefetch(pool_row(pieces[i]), 1, 0);
    }
    for (int64_t i = b; i < e; ++i) {
      if (i + kTlbAhead < e) __builtin_prefetch(pool_row(pieces[i + kTlbAhead]), 1, 0);
      const Pieces::Piece p = pieces[i];
      if (stream) {
        copy_streaming(pool_row(p), p.chunk, p.bytes);
      } else {
        std::memcpy(pool_row(p), p.chunk, p.bytes);
      }
    }
    if (stream) end_streaming();
  });
}

}  // namespace

std::pair<int64_t, int64_t> value_bounds(const at::Tensor& values) {
  const int64_t* v = values.data_ptr<int64_t>();
  const auto [lo, hi] = std::minmax_element(v, v + values.numel());
  return {*lo, *hi};
}

// The device a copy runs on: the CPU, or a GPU where the kernels were built with CUDA.
void check_device(const at::Tensor& t, const char* name) {
  KV_CHECK(t.is_cpu() || t.is_cuda(), name, " must be on the CPU or a CUDA device");
#ifndef KVTIER_WITH_CUDA
  KV_CHECK(!t.is_cuda(), "kvtier._C was built without CUDA");
#endif
}

void gather(const Checked& checked, const std::vector<at::Tensor>& layers,
            const at::Tensor& slots, at::Tensor out, int64_t max_threads) {
  const int64_t row_bytes = check_args(layers, slots, out, "out", /*allow_skip=*/false);
  check_device(out, "out");
  checked();
  if (slots.numel() == 0 || row_bytes == 0) return;
#ifdef KVTIER_WITH_CUDA
  if (out.is_cuda()) return gather_cuda(layers, slots, out, row_bytes);
#endif
  gather_cpu(layers, slots, {out}, row_bytes, max_threads);
}

void scatter(const Checked& checked, const at::Tensor& src, const at::Tensor& slots,
             const std::vector<at::Tensor>& layers, int64_t max_threads) {
  const int64_t row_bytes = check_args(layers, slots, src, "src", /*allow_skip=*/true);
  check_device(src, "src");
  checked();
  if (slots.numel() == 0 || row_bytes == 0) return;
#ifdef KVTIER_WITH_CUDA
  if (src.is_cuda()) return scatter_cuda(src, slots, layers, row_bytes);
#endif
  scatter_cpu({src}, slots, layers, row_bytes, max_threads);
}

namespace {

// Validates a copy between the layers and consecutive chunks, everything (the slot range once,
// over all chunks) before a byte is written; returns the row size in bytes, 0 for no copy.
int64_t check_chunks(const std::vector<at::Tensor>& layers, const at::Tensor& slots,
                     const std::vector<at::Tensor>& chunks, const char* name, bool allow_skip) {
  KV_CHECK(!chunks.empty(), name, " must not be empty");
  const int64_t row_bytes = check_pool(layers, slots);
  int64_t total = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const std::string chunk_name = name + ("[" + std::to_string(c) + "]");
    KV_CHECK(chunks[c].dim() == 3, chunk_name, " must be 3-D [layers, tokens, hidden]");
    check_chunk(layers, chunks[c], chunks[c].size(1), chunk_name);
    total += chunks[c].size(1);
  }
  KV_CHECK(total == slots.numel(), name, " hold ", total, " tokens, slots has ", slots.numel());
  check_range(layers, slots, allow_skip);
  check_device(slots, "slots");
  return total == 0 ? 0 : row_bytes;
}

}  // namespace

void gather_chunks(const Checked& checked, const std::vector<at::Tensor>& layers,
                   const at::Tensor& slots, const std::vector<at::Tensor>& outs,
                   int64_t max_threads) {
  const int64_t row_bytes = check_chunks(layers, slots, outs, "outs", /*allow_skip=*/false);
  checked();
  if (row_bytes == 0) return;
#ifdef KVTIER_WITH_CUDA
  if (slots.is_cuda()) {
    int64_t offset = 0;  // one launch per chunk, all on the current stream
    for (auto out : outs) {
      gather_cuda(layers, slots.narrow(0, offset, out.size(1)), out, row_bytes);
      offset += out.size(1);
    }
    return;
  }
#endif
  gather_cpu(layers, slots, outs, row_bytes, max_threads);
}

void scatter_chunks(const Checked& checked, const std::vector<at::Tensor>& srcs,
                    const at::Tensor& slots, const std::vector<at::Tensor>& layers,
                    int64_t max_threads) {
  const int64_t row_bytes = check_chunks(layers, slots, srcs, "srcs", /*allow_skip=*/true);
  checked();
  if (row_bytes == 0) return;
#ifdef KVTIER_WITH_CUDA
  if (slots.is_cuda()) {
    int64_t offset = 0;  // one launch per chunk, all on the current stream
    for (const auto& src : srcs) {
      scatter_cuda(src, slots.narrow(0, offset, src.size(1)), layers, row_bytes);
      offset += src.size(1);
    }
    return;
  }
#endif
  scatter_cpu(srcs, slots, layers, row_bytes, max_threads);
}

// Validates host copies' arguments: a CUDA pool, slots on it, pinned CPU chunks (or chunks in a
// staging buffer on the pool's device) of the pool's dtype and row size holding one token per
// slot, one int32 status word per chunk.
int64_t check_host_args(const std::vector<at::Tensor>& layers, const at::Tensor& slots,
                        const std::vector<at::Tensor>& chunks, const at::Tensor& status,
                        const char* name) {
  const int64_t row_bytes = check_pool(layers, slots);
  const auto& first = layers[0];
  KV_CHECK(first.is_cuda(), "layers must be on a CUDA device, got ", first.device());
  check_device(first, "layers");
  KV_CHECK(!chunks.empty(), name, " must not be empty");
  const int64_t n = static_cast<int64_t>(layers.size());
  int64_t total = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const auto& chunk = chunks[c];
    // Pinned host chunks (mapped), or a staging buffer on the layers' device.
    KV_CHECK((chunk.is_cpu() || chunk.device() == first.device()) &&
                 chunk.dtype() == first.dtype(),
             name, "[", c, "] must be a CPU tensor or one on ", first.device(),
             " of the layers' dtype ", first.dtype(), ", got ", chunk.dtype(), " on ",
             chunk.device());
    KV_CHECK(chunk.is_contiguous(), name, "[", c, "] must be contiguous");
    KV_CHECK(chunk.dim() == 3 && chunk.size(0) == n && chunk.size(2) == first.size(1), name,
             "[", c, "] must have shape [", n, ", tokens, ", first.size(1), "], got ",
             chunk.sizes());
    total += chunk.size(1);
  }
  KV_CHECK(total == slots.numel(), name, " hold ", total, " tokens, slots has ", slots.numel());
  KV_CHECK(status.is_cpu() && status.scalar_type() == at::kInt && status.is_contiguous() &&
               status.numel() == static_cast<int64_t>(chunks.size()),
           "status must be a contiguous CPU int32 tensor with one word per chunk (",
           chunks.size(), ")");
  return row_bytes;
}

void gather_host(const Checked& checked, const std::vector<at::Tensor>& layers,
                 const at::Tensor& slots, const std::vector<at::Tensor>& outs, at::Tensor status,
                 int64_t max_blocks) {
  const int64_t row_bytes = check_host_args(layers, slots, outs, status, "outs");
  checked();
#ifdef KVTIER_WITH_CUDA
  gather_host_cuda(layers, slots, outs, status, row_bytes, max_blocks);
#else
  (void)row_bytes;
  (void)max_blocks;
#endif
}

void scatter_host(const Checked& checked, const std::vector<at::Tensor>& srcs,
                  const at::Tensor& slots, const std::vector<at::Tensor>& layers,
                  at::Tensor status, int64_t max_blocks) {
  const int64_t row_bytes = check_host_args(layers, slots, srcs, status, "srcs");
  checked();
#ifdef KVTIER_WITH_CUDA
  scatter_host_cuda(srcs, slots, layers, status, row_bytes, max_blocks);
#else
  (void)row_bytes;
  (void)max_blocks;
#endif
}

}  // namespace kvtier
