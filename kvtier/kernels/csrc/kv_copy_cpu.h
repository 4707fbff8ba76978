// The CPU copy kernel's building blocks: streaming copies, the pieces a gather or scatter
// splits into (runs of adjacent slots), and the thread pool that hands them out.
// Included by kv_ops.cpp only.
#pragma once

#include "kv_ops.h"  // its ATen headers

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvtier {
namespace cpu_copy {

// Rows are 0.5-4 KiB in practice; give each thread at least this much to copy per task so the
// scheduling cost stays small against the copy.
constexpr int64_t kGrainBytes = 256 * 1024;

// Adjacent slots (a page, or a fresh server's whole request) are copied as one piece, cut at
// this size so that a fully contiguous copy still splits into tasks for every thread.
constexpr int64_t kMaxPieceBytes = kGrainBytes / 2;

// With 4 KiB pages every random pool row costs a TLB miss, and its page walk stalls the copy
// unless it started earlier: a scatter asks for the first line of the piece this far ahead
// (a gather asks for whole pieces, kRowsAhead).
constexpr int64_t kTlbAhead = 8;

// How far ahead of its copy a gather asks for the pool bytes: the hardware prefetcher only
// follows a stream once it has seen it start, and each random row starts a new one.
constexpr int64_t kPrefetchBytes = 4096;

// A gather also asks for the whole piece this far ahead into L2, whose miss queue is deeper
// than L1's: that many random rows in flight at once, their page walks included. Measured on 2
// threads of an AMD EPYC (KVM), 256 random 2 KiB rows a layer, against the same kernel without
// it in one process: 1.17-1.45x on huge pages, 1.11-1.15x on 4 KiB pages; 2-16 rows ahead all
// gained, 8 and more the most. Into L1 instead (as the next piece goes) it gained nothing.
constexpr int64_t kRowsAhead = 8;

// A scatter this large streams into the pool: its first rows leave the cache before the model
// reads them anyway. A smaller one keeps them cached for the forward pass that follows.
constexpr int64_t kStreamScatterBytes = 1 << 20;

#if defined(__x86_64__)
inline bool has_avx2() {
  static const bool avx2 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return avx2;
}

// n bytes to a 32-byte aligned dst, in streaming stores where whole 32-byte blocks allow.
__attribute__((target("avx2"))) inline void stream_avx2(char* dst, const char* src, int64_t n) {
  int64_t k = 0;
  for (; k + 128 <= n; k += 128) {  // four loads in flight before the stores wait on them
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k + 64));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + k), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + k + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + k + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + k + 96), d);
  }
  for (; k + 32 <= n; k += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + k),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k)));
  }
  std::memcpy(dst + k, src + k, n - k);
}
#endif

// Copies with streaming stores where the CPU has them (x86-64 with AVX2): a copy's destination
// is read next by another thread or much later, not by this core, so its lines need not pass
// through the cache, and plain stores would first read every destination line (a
// read-for-ownership), a third memory stream on top of the copy's two. glibc's memcpy streams
// only above a threshold our pieces never reach.
inline void copy_streaming(char* dst, const char* src, int64_t n) {
#if defined(__x86_64__)
  if (n >= 128 && has_avx2()) {
    const int64_t head = static_cast<int64_t>(-reinterpret_cast<uintptr_t>(dst) & 31);
    std::memcpy(dst, src, head);
    stream_avx2(dst + head, src + head, n - head);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

// Orders a thread's streaming stores before whatever it does next (the caller then hands
// the chunk or the pool to other threads).
inline void end_streaming() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

inline void prefetch_bytes(const char* p, int64_t n) {
  for (int64_t k = 0; k < n; k += 64) __builtin_prefetch(p + k);
}

inline void prefetch_bytes_l2(const char* p, int64_t n) {
  for (int64_t k = 0; k < n; k += 64) __builtin_prefetch(p + k, 0, 2);
}

// The rows of one copy as pieces. A piece is one layer's rows for a run of tokens of one chunk
// whose slots are consecutive: its pool rows are adjacent like its chunk rows, so it is one
// copy. Pieces are numbered layer by layer, then chunk by chunk, so a layer's pool rows are read
// in one stretch however many chunks the copy has (a gather of 8 chunks of 256 random slots
// took 1.27x as long chunk by chunk, on 2 threads of an AMD EPYC), while within each chunk the
// chunk side still streams. Tokens with a -1 slot belong to no piece.
class Pieces {
 public:
  struct Piece {
    char* chunk;    // the piece's first row in its chunk
    int64_t layer;
    int64_t pool;   // byte offset of its first row in the layer
    int64_t bytes;
  };

  // chunks[c] holds tokens[c] tokens of every layer; their slots follow each other in `slot`.
  Pieces(std::vector<char*> chunks, std::vector<int64_t> tokens, const int64_t* slot,
         int64_t num_layers, int64_t row_bytes)
      : chunks_(std::move(chunks)), tokens_(std::move(tokens)), row_bytes_(row_bytes) {
    const int64_t max_rows = std::max<int64_t>(1, kMaxPieceBytes / row_bytes);
    int64_t rows = 0;
    for (size_t c = 0; c < chunks_.size(); slot += tokens_[c++]) {
      first_run_.push_back(static_cast<int64_t>(runs_.size()));
      for (int64_t t = 0; t < tokens_[c];) {
        if (slot[t] == kSkipSlot) {
          ++t;
          continue;
        }
        int64_t n = 1;
        while (t + n < tokens_[c] && n < max_rows && slot[t + n] == slot[t] + n) ++n;
        runs_.push_back({t, slot[t], n});
        rows += n;
        t += n;
      }
    }
    size_ = num_layers * static_cast<int64_t>(runs_.size());
    bytes_ = rows * num_layers * row_bytes;
  }

  int64_t size() const { return size_; }
  int64_t bytes() const { return bytes_; }

  Piece operator[](int64_t p) const {
    const int64_t num_runs = static_cast<int64_t>(runs_.size());
    const int64_t layer = p / num_runs, r = p % num_runs;
    const Run& run = runs_[r];
    const int64_t c = find_chunk(first_run_.data(), static_cast<int64_t>(first_run_.size()), r);
    const RowIndex row{layer, run.token};
    return {chunks_[c] + chunk_offset(row, tokens_[c], row_bytes_), layer,
            slot_offset(run.slot, row_bytes_), run.rows * row_bytes_};
  }

 private:
  struct Run {
    int64_t token;  // within its chunk
    int64_t slot;
    int64_t rows;
  };

  std::vector<char*> chunks_;
  std::vector<int64_t> tokens_;
  int64_t row_bytes_;
  std::vector<Run> runs_;
  std::vector<int64_t> first_run_;  // per chunk: its first run
  int64_t size_ = 0, bytes_ = 0;
};

// Runs fn(begin, end) over the pieces in tasks of about kGrainBytes, handed out dynamically:
// when a thread is descheduled (the host is busy serving), the others take over its share
// instead of the whole call waiting for it. A small copy runs inline on the calling thread, and
// so does every copy with max_threads 1 (a background copy must not take the serving engine's
// cores).
template <typename F>
void parallel_pieces(const Pieces& pieces, int64_t max_threads, const F& fn) {
  const int64_t num_pieces = pieces.size();
  if (num_pieces == 0) return;
  const int64_t piece_bytes = std::max<int64_t>(1, pieces.bytes() / num_pieces);
  const int64_t per_task = std::max<int64_t>(1, kGrainBytes / piece_bytes);
  const int64_t num_tasks = (num_pieces + per_task - 1) / per_task;
  std::atomic<int64_t> next{0};
  const auto worker = [&](int64_t, int64_t) {
    for (int64_t t = next++; t < num_tasks; t = next++) {
      fn(t * per_task, std::min(num_pieces, (t + 1) * per_task));
    }
  };
  int64_t threads = at::get_num_threads();
  if (max_threads > 0) threads = std::min(threads, max_threads);
  at::parallel_for(0, std::min(num_tasks, threads), 1, worker);
}

template <typename T>
std::vector<T> layer_bases(const std::vector<at::Tensor>& layers) {
  std::vector<T> base;
  for (const auto& layer : layers) base.push_back(static_cast<T>(layer.data_ptr()));
  return base;
}

}  // namespace cpu_copy
}  // namespace kvtier
