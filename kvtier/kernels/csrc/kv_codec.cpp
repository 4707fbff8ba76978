// The record codecs of kv_codec.h. Every result is bit-identical to codec.py's torch path (its
// reference and oracle, tests/backends/test_codec_kernel.py), which fixes each operation here:
//
// - a scale is max(amax |x|, 1e-12f) / MAX in float32 (MAX 448 for fp8, 127 for int8), and a
//   value is stored as x / scale, an IEEE division (torch divides by a broadcast tensor, not by
//   a reciprocal);
// - fp8: that quotient rounded to e4m3fn as torch's float -> float8_e4m3fn conversion rounds
//   (nearest even, e4m3 subnormals below 2**-6, |y| >= 480 and NaN to 0x7F);
// - int8: the quotient rounded half to even, clamped to [-127, 127];
// - decode: out = (stored value * scale) in float32, rounded once to the pool dtype (nearest
//   even). codec.py multiplies q * 2**-8 (exact) by scale * 2**8 (exact), the same product.
//   An fp8 byte 0x7F/0xFF (never encoded from finite input) reads as +-480, as codec.py's
//   `_widen` reads it.
//
// Inputs are finite (KV); a NaN in a chunk gives unspecified bytes, not a crash. The row
// operations live in kv_codec_rows.h (plain C++), kv_codec_avx2.h and kv_codec_avx512.h
// (intrinsics); this file has the chunk loops, the dispatch between them and the checks.
#include "kv_codec.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "kv_codec_avx512.h"  // and kv_codec_avx2.h, kv_codec_rows.h

namespace kvtier {
namespace {

using namespace codec_cpu;  // NOLINT: the rows and quantizers of kv_codec_rows.h / _avx*.h

#if defined(__x86_64__)
bool avx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0 && __builtin_cpu_supports("f16c") != 0 &&
           __builtin_cpu_supports("fma") != 0;
  }();
  return has;
}
#endif

struct Shape {
  int64_t planes, layers, tokens, hidden;
  int64_t values() const { return planes * layers * tokens * hidden; }
  int64_t payload_bytes() const {
    return values() + 4 * layers * hidden + (planes == 2 ? 4 * layers * tokens : 0);
  }
};


// Blocks [first, first + count) of the chunk, block b = plane * layers + layer (tokens x hidden
// values, in L2): each is read twice, for its scales and for its values, one call each. Its
// values go to values[(b - first) * block...], its scales to their place in `scales` (the
// payload's tail, unaligned). Encode always runs every block (a writer encoding piece by
// piece, each written out while in cache, measured no faster: see benchmarks/LOG.md); decode
// runs a load's pieces (codec_decode_blocks). Each quantizer call is told the next block, which
// the AVX-512 rows fetch into L2 while they quantize this one.
template <typename R, typename T, typename Q>
KV_INLINE void encode_blocks(const Shape& s, const T* x, int64_t first, int64_t count,
                             uint8_t* values, uint8_t* scales) {
  const int64_t L = s.layers, T_ = s.tokens, H = s.hidden, block = T_ * H;
  std::vector<float> scale(std::max(H, T_)), recips(std::max(H, T_));
  for (int64_t b = first; b < first + count; ++b) {
    const T* src = x + b * block;
    uint8_t* dst = values + (b - first) * block;
    const bool per_row = b >= L;  // plane 1 (V): a scale per (layer, token)
    const int64_t n = per_row ? T_ : H, l = b % L;
    std::fill(scale.begin(), scale.end(), 0.0f);  // both passes max into what is there
    if (per_row) {
      R::amax_rows(src, T_, H, scale.data());
    } else {
      R::amax_columns(src, T_, H, scale.data());
    }
    for (int64_t i = 0; i < n; ++i) {
      scale[i] = std::max(scale[i], kTiny) / Q::kMax;
      recips[i] = 1.0f / scale[i];
    }
    const T* next = b + 1 < first + count ? src + block : nullptr;
    R::template quantize<Q>(src, T_, H, scale.data(), recips.data(), per_row, dst, next);
    std::memcpy(scales + 4 * (per_row ? L * H + l * T_ : l * H), scale.data(), 4 * n);
  }
}

template <typename R, typename T, typename Q>
KV_INLINE void decode_blocks(const Shape& s, const uint8_t* values, const uint8_t* scales,
                             int64_t first, int64_t count, T* out) {
  const int64_t L = s.layers, T_ = s.tokens, H = s.hidden, block = T_ * H;
  std::vector<float> scale(std::max(H, T_));
  for (int64_t b = first; b < first + count; ++b) {
    const bool per_row = b >= L;
    const int64_t n = per_row ? T_ : H, l = b % L;
    std::memcpy(scale.data(), scales + 4 * (per_row ? L * H + l * T_ : l * H), 4 * n);
    for (int64_t i = 0; i < n; ++i) scale[i] *= Q::kUnit;
    R::template dequantize<Q>(values + (b - first) * block, T_, H, scale.data(), per_row,
                              out + b * block);
  }
}

// Each kernel runs with the plain C++ rows or (where the CPU has them, unless `simd` is false)
// the AVX2 + F16C + FMA rows (FMA only where `divide8` wants it: ISO C++ builds contract
// nothing themselves, and a fused multiply-add elsewhere would round differently from torch),
// and where it also has AVX-512 the encode's Avx512Rows and the bf16 decode's Bf16Rows
// (kv_codec_avx512.h).
bool use_avx2(bool simd) {
#if defined(__x86_64__)
  return simd && avx2();
#else
  return false;
#endif
}

#if defined(__x86_64__)
// KVTIER_CODEC_AVX512=0 keeps the kernel on its AVX2 rows where the CPU has AVX-512 too (read
// at each call, a getenv: the tests compare the two).
bool avx512_allowed() {
  const char* env = std::getenv("KVTIER_CODEC_AVX512");
  return env == nullptr || std::strcmp(env, "0") != 0;
}

bool avx512() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0 && __builtin_cpu_supports("avx512bw") != 0;
  }();
  return has && avx512_allowed();
}
#endif

// The blocks a call codes and where their bytes are (`Blocks::of` checks them).
struct Blocks {
  uint8_t* values;  // blocks [first, first + count)'s one-byte values
  uint8_t* scales;  // the payload's whole tail: every scale, at its place
  int64_t first, count;
};

template <typename T, typename Q>
void encode_as(const Shape& s, const at::Tensor& chunk, const Blocks& b, bool simd) {
  const T* x = reinterpret_cast<const T*>(chunk.data_ptr());
#if defined(__x86_64__)
  if (use_avx2(simd) && avx512()) {
    return encode_blocks<Avx512Rows, T, Q>(s, x, b.first, b.count, b.values, b.scales);
  }
  if (use_avx2(simd)) {
    return encode_blocks<Avx2Rows, T, Q>(s, x, b.first, b.count, b.values, b.scales);
  }
#endif
  encode_blocks<ScalarRows, T, Q>(s, x, b.first, b.count, b.values, b.scales);
}

#if defined(__x86_64__)
bool avx512_bf16() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0 && __builtin_cpu_supports("avx512vl") != 0;
  }();
  return has && avx512_allowed();
}
#endif

// Whether every scale of blocks `b`, times Q::kUnit, is 0 or finite with |c| >= 2**-109: then
// each product (a stored level, at least 2**-17 in magnitude unless 0, times c) is 0, normal or
// infinite, never NaN or subnormal, where Bf16Rows rounds exactly as narrow() does.
template <typename Q>
bool bf16_safe(const Shape& s, const Blocks& b) {
  for (int64_t k = b.first; k < b.first + b.count; ++k) {
    const bool per_row = k >= s.layers;
    const int64_t n = per_row ? s.tokens : s.hidden, l = k % s.layers;
    const uint8_t* at = b.scales + 4 * (per_row ? s.layers * s.hidden + l * s.tokens : l * s.hidden);
    for (int64_t i = 0; i < n; ++i, at += 4) {
      float c;
      std::memcpy(&c, at, 4);
      c = std::fabs(c * Q::kUnit);
      if (c != 0.0f && !(c >= 0x1p-109f && c <= std::numeric_limits<float>::max())) return false;
    }
  }
  return true;
}

template <typename Q, typename T>
void decode_as(const Shape& s, const Blocks& b, at::Tensor& out, bool simd) {
  T* o = reinterpret_cast<T*>(out.data_ptr());
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (use_avx2(simd) && avx512_bf16() && bf16_safe<Q>(s, b)) {
      return decode_blocks<Bf16Rows, T, Q>(s, b.values, b.scales, b.first, b.count, o);
    }
  }
  if (use_avx2(simd)) {
    return decode_blocks<Avx2Rows, T, Q>(s, b.values, b.scales, b.first, b.count, o);
  }
#endif
  decode_blocks<ScalarRows, T, Q>(s, b.values, b.scales, b.first, b.count, o);
}

template <typename Q>
void decode_with(const Shape& s, const Blocks& b, at::Tensor& out, bool simd) {
  switch (out.scalar_type()) {
    case at::kBFloat16:
      return decode_as<Q, c10::BFloat16>(s, b, out, simd);
    case at::kHalf:
      return decode_as<Q, c10::Half>(s, b, out, simd);
    default:
      return decode_as<Q, float>(s, b, out, simd);
  }
}

template <typename Q>
void encode_with(const Shape& s, const at::Tensor& chunk, const Blocks& b, bool simd) {
  switch (chunk.scalar_type()) {
    case at::kBFloat16:
      return encode_as<c10::BFloat16, Q>(s, chunk, b, simd);
    case at::kHalf:
      return encode_as<c10::Half, Q>(s, chunk, b, simd);
    default:
      return encode_as<float, Q>(s, chunk, b, simd);
  }
}

bool is_fp8(const std::string& codec) {
  KV_CHECK(codec == "fp8" || codec == "int8", "codec must be 'fp8' or 'int8', got '", codec,
           "'");
  return codec == "fp8";
}

// The chunk's shape, once `chunk` (named `name`) is a contiguous CPU [1 or 2, L, T, H] tensor
// of a pool dtype the codecs take.
Shape check_chunk(const at::Tensor& chunk, const char* name) {
  KV_CHECK(chunk.is_cpu() && chunk.dim() == 4 && chunk.is_contiguous(), name,
           " must be a contiguous 4-D [planes, layers, tokens, hidden] CPU tensor");
  const auto type = chunk.scalar_type();
  KV_CHECK(type == at::kBFloat16 || type == at::kHalf || type == at::kFloat, name,
           " must be bfloat16, float16 or float32, got ", type);
  const Shape s{chunk.size(0), chunk.size(1), chunk.size(2), chunk.size(3)};
  KV_CHECK(s.planes == 1 || s.planes == 2, name, " must have 1 or 2 planes, got ", s.planes);
  KV_CHECK(s.values() > 0, name, " must not be empty");
  return s;
}

// `bytes` (named `name`) as a contiguous CPU uint8 vector of `n` bytes.
uint8_t* check_bytes(const at::Tensor& bytes, const char* name, int64_t n) {
  KV_CHECK(bytes.is_cpu() && bytes.dim() == 1 && bytes.scalar_type() == at::kByte &&
               bytes.is_contiguous(),
           name, " must be a contiguous 1-D uint8 CPU tensor");
  KV_CHECK(bytes.numel() == n, name, ": ", bytes.numel(), " bytes for a chunk of ", n);
  return bytes.data_ptr<uint8_t>();
}

// The whole payload: every block, then the scales.
Blocks whole(const Shape& s, const at::Tensor& payload) {
  uint8_t* p = check_bytes(payload, "payload", s.payload_bytes());
  return Blocks{p, p + s.values(), 0, s.planes * s.layers};
}

// Whole blocks from `first` (values: a positive multiple of a block's bytes, within the chunk)
// and the payload's tail (scales).
Blocks part(const Shape& s, const at::Tensor& values, const at::Tensor& scales, int64_t first) {
  const int64_t block = s.tokens * s.hidden, blocks = s.planes * s.layers;
  KV_CHECK(values.is_cpu() && values.dim() == 1 && values.scalar_type() == at::kByte &&
               values.is_contiguous(),
           "values must be a contiguous 1-D uint8 CPU tensor");
  const int64_t count = values.numel() / block;
  KV_CHECK(values.numel() % block == 0 && count > 0, "values: ", values.numel(),
           " bytes are not whole blocks of ", block);
  KV_CHECK(first >= 0 && first + count <= blocks, "first: blocks ", first, "..", first + count,
           " outside the chunk's ", blocks);
  uint8_t* t = check_bytes(scales, "scales", s.payload_bytes() - s.values());
  return Blocks{values.data_ptr<uint8_t>(), t, first, count};
}

void encode(const Checked& checked, const at::Tensor& chunk, const Shape& s, const Blocks& b,
            bool fp8, bool simd) {
  checked();
  return fp8 ? encode_with<Fp8>(s, chunk, b, simd) : encode_with<Int8>(s, chunk, b, simd);
}

void decode(const Checked& checked, at::Tensor& out, const Shape& s, const Blocks& b, bool fp8,
            bool simd) {
  checked();
  return fp8 ? decode_with<Fp8>(s, b, out, simd) : decode_with<Int8>(s, b, out, simd);
}

}  // namespace

void codec_encode(const Checked& checked, const at::Tensor& chunk, at::Tensor payload,
                  const std::string& codec, bool simd) {
  const bool fp8 = is_fp8(codec);
  const Shape s = check_chunk(chunk, "chunk");
  encode(checked, chunk, s, whole(s, payload), fp8, simd);
}

void codec_decode(const Checked& checked, const at::Tensor& payload, at::Tensor out,
                  const std::string& codec, bool simd) {
  const bool fp8 = is_fp8(codec);
  const Shape s = check_chunk(out, "out");
  decode(checked, out, s, whole(s, payload), fp8, simd);
}

void codec_decode_blocks(const Checked& checked, const at::Tensor& values,
                         const at::Tensor& scales, at::Tensor out, int64_t first,
                         const std::string& codec, bool simd) {
  const bool fp8 = is_fp8(codec);
  const Shape s = check_chunk(out, "out");
  decode(checked, out, s, part(s, values, scales, first), fp8, simd);
}

}  // namespace kvtier
