// The lower tiers' record codecs (kvtier/backends/codec.py: fp8 e4m3 and int8) in C++: a
// chunk [planes, layers, tokens, hidden] (bf16, fp16 or fp32, contiguous, on the CPU) to its
// record payload and back, single-threaded (each writer thread and load runs its own).
//
// The payload layout and every bit of it are codec.py's: the one-byte values in the chunk's
// order, then float32 scales per (layer, channel) for plane 0 (K, or MLA's latent), then
// (planes == 2) float32 scales per (layer, token) for plane 1 (V). Encode makes one pass for the
// scales and one for the values; decode writes straight into the destination tensor.
#pragma once

#include <cstdint>
#include <string>

#include "kv_ops.h"

namespace kvtier {

// Encodes `chunk` into `payload` (1-D uint8, exactly the codec's payload length). `codec` is
// "fp8" or "int8". Checks every argument before a byte is written (std::invalid_argument naming
// it), then calls `checked` (the GIL goes) and encodes. `simd` false keeps to the plain C++ rows
// even where the CPU has AVX2 (the tests compare both).
void codec_encode(const Checked& checked, const at::Tensor& chunk, at::Tensor payload,
                  const std::string& codec, bool simd);

// Decodes `payload` (1-D uint8, the codec's payload length for `out`'s shape) into `out`.
void codec_decode(const Checked& checked, const at::Tensor& payload, at::Tensor out,
                  const std::string& codec, bool simd);

// A payload's values piece by piece, the same bytes as `codec_decode`: block b = plane * layers +
// layer of the chunk, a block's values tokens x hidden bytes. `values` (1-D uint8) holds whole
// blocks from `first`; `scales` (1-D uint8) is the payload's tail (every scale, after the
// values). Decodes those blocks into `out`: a load reads the tail first, then decodes each
// piece as it is read, while it is in cache.
void codec_decode_blocks(const Checked& checked, const at::Tensor& values,
                         const at::Tensor& scales, at::Tensor out, int64_t first,
                         const std::string& codec, bool simd);

}  // namespace kvtier
