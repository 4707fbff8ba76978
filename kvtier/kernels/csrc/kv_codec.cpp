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


// Layer by layer: a layer's block (tokens x hidden values, in L2) is read twice, for its
// scales and for its values, one call each.
template <typename R, typename T, typename Q>
KV_INLINE void encode_chunk(const Shape& s, const T* x, uint8_t* payload) {
  const int64_t L = s.layers, T_ = s.tokens, H = s.hidden, block = T_ * H;
  std::vector<float> chan(L * H, 0.0f);  // plane 0: a scale per (layer, channel)
  std::vector<float> recips(std::max(H, T_));
  for (int64_t l = 0; l < L; ++l) {
    float* scale = chan.data() + l * H;
    R::amax_columns(x + l * block, T_, H, scale);
    for (int64_t h = 0; h < H; ++h) {
      scale[h] = std::max(scale[h], kTiny) / Q::kMax;
      recips[h] = 1.0f / scale[h];
    }
    R::template quantize<Q>(x + l * block, T_, H, scale, recips.data(), false,
                            payload + l * block);
  }
  std::memcpy(payload + s.values(), chan.data(), 4 * L * H);  // unaligned in the payload
  if (s.planes != 2) return;
  std::vector<float> tok(L * T_, 0.0f);  // plane 1: a scale per (layer, token)
  const int64_t plane = L * block;
  for (int64_t l = 0; l < L; ++l) {
    float* scale = tok.data() + l * T_;
    R::amax_rows(x + plane + l * block, T_, H, scale);
    for (int64_t t = 0; t < T_; ++t) {
      scale[t] = std::max(scale[t], kTiny) / Q::kMax;
      recips[t] = 1.0f / scale[t];
    }
    R::template quantize<Q>(x + plane + l * block, T_, H, scale, recips.data(), true,
                            payload + plane + l * block);
  }
  std::memcpy(payload + s.values() + 4 * L * H, tok.data(), 4 * L * T_);
}

template <typename R, typename T, typename Q>
KV_INLINE void decode_chunk(const Shape& s, const uint8_t* payload, T* out) {
  const int64_t L = s.layers, T_ = s.tokens, H = s.hidden, block = T_ * H;
  std::vector<float> chan(L * H);
  std::memcpy(chan.data(), payload + s.values(), 4 * L * H);  // unaligned in the payload
  for (float& c : chan) c *= Q::kUnit;
  for (int64_t l = 0; l < L; ++l) {
    R::template dequantize<Q>(payload + l * block, T_, H, chan.data() + l * H, false,
                              out + l * block);
  }
  if (s.planes != 2) return;
  std::vector<float> tok(L * T_);
  std::memcpy(tok.data(), payload + s.values() + 4 * L * H, 4 * L * T_);
  for (float& t : tok) t *= Q::kUnit;
  const int64_t plane = L * block;
  R::template dequantize<Q>(payload + plane, L * T_, H, tok.data(), true, out + plane);
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

template <typename T, typename Q>
void encode_as(const Shape& s, const at::Tensor& chunk, uint8_t* p, bool simd) {
  const T* x = reinterpret_cast<const T*>(chunk.data_ptr());
#if defined(__x86_64__)
  if (use_avx2(simd) && avx512()) return encode_chunk<Avx512Rows, T, Q>(s, x, p);
  if (use_avx2(simd)) return encode_chunk<Avx2Rows, T, Q>(s, x, p);
#endif
  encode_chunk<ScalarRows, T, Q>(s, x, p);
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

// Whether every scale of the payload, times Q::kUnit, is 0 or finite with |c| >= 2**-109: then
// each product (a stored level, at least 2**-17 in magnitude unless 0, times c) is 0, normal or
// infinite, never NaN or subnormal, where Bf16Rows rounds exactly as narrow() does.
template <typename Q>
bool bf16_safe(const Shape& s, const uint8_t* p) {
  const int64_t count = s.layers * s.hidden + (s.planes == 2 ? s.layers * s.tokens : 0);
  const uint8_t* at = p + s.values();
  for (int64_t i = 0; i < count; ++i, at += 4) {
    float c;
    std::memcpy(&c, at, 4);
    c = std::fabs(c * Q::kUnit);
    if (c != 0.0f && !(c >= 0x1p-109f && c <= std::numeric_limits<float>::max())) return false;
  }
  return true;
}

template <typename Q, typename T>
void decode_as(const Shape& s, const uint8_t* p, at::Tensor& out, bool simd) {
  T* o = reinterpret_cast<T*>(out.data_ptr());
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (use_avx2(simd) && avx512_bf16() && bf16_safe<Q>(s, p)) {
      return decode_chunk<Bf16Rows, T, Q>(s, p, o);
    }
  }
  if (use_avx2(simd)) return decode_chunk<Avx2Rows, T, Q>(s, p, o);
#endif
  decode_chunk<ScalarRows, T, Q>(s, p, o);
}

template <typename Q>
void decode_with(const Shape& s, const uint8_t* p, at::Tensor& out, bool simd) {
  switch (out.scalar_type()) {
    case at::kBFloat16:
      return decode_as<Q, c10::BFloat16>(s, p, out, simd);
    case at::kHalf:
      return decode_as<Q, c10::Half>(s, p, out, simd);
    default:
      return decode_as<Q, float>(s, p, out, simd);
  }
}

template <typename Q>
void encode_with(const Shape& s, const at::Tensor& chunk, uint8_t* p, bool simd) {
  switch (chunk.scalar_type()) {
    case at::kBFloat16:
      return encode_as<c10::BFloat16, Q>(s, chunk, p, simd);
    case at::kHalf:
      return encode_as<c10::Half, Q>(s, chunk, p, simd);
    default:
      return encode_as<float, Q>(s, chunk, p, simd);
  }
}

bool is_fp8(const std::string& codec) {
  KV_CHECK(codec == "fp8" || codec == "int8", "codec must be 'fp8' or 'int8', got '", codec,
           "'");
  return codec == "fp8";
}

// The chunk's shape, once `chunk` (named `name`) is a contiguous CPU [1 or 2, L, T, H] tensor
// of a pool dtype the codecs take and `payload` a contiguous CPU uint8 vector of its length.
Shape check(const at::Tensor& chunk, const char* name, const at::Tensor& payload) {
  KV_CHECK(chunk.is_cpu() && chunk.dim() == 4 && chunk.is_contiguous(), name,
           " must be a contiguous 4-D [planes, layers, tokens, hidden] CPU tensor");
  const auto type = chunk.scalar_type();
  KV_CHECK(type == at::kBFloat16 || type == at::kHalf || type == at::kFloat, name,
           " must be bfloat16, float16 or float32, got ", type);
  const Shape s{chunk.size(0), chunk.size(1), chunk.size(2), chunk.size(3)};
  KV_CHECK(s.planes == 1 || s.planes == 2, name, " must have 1 or 2 planes, got ", s.planes);
  KV_CHECK(s.values() > 0, name, " must not be empty");
  KV_CHECK(payload.is_cpu() && payload.dim() == 1 && payload.scalar_type() == at::kByte &&
               payload.is_contiguous(),
           "payload must be a contiguous 1-D uint8 CPU tensor");
  KV_CHECK(payload.numel() == s.payload_bytes(), "payload: ", payload.numel(),
           " bytes for a chunk of ", s.payload_bytes());
  return s;
}

}  // namespace

void codec_encode(const Checked& checked, const at::Tensor& chunk, at::Tensor payload,
                  const std::string& codec, bool simd) {
  const bool fp8 = is_fp8(codec);
  const Shape s = check(chunk, "chunk", payload);
  checked();
  auto* p = payload.data_ptr<uint8_t>();
  return fp8 ? encode_with<Fp8>(s, chunk, p, simd) : encode_with<Int8>(s, chunk, p, simd);
}

void codec_decode(const Checked& checked, const at::Tensor& payload, at::Tensor out,
                  const std::string& codec, bool simd) {
  const bool fp8 = is_fp8(codec);
  const Shape s = check(out, "out", payload);
  checked();
  const auto* p = payload.data_ptr<uint8_t>();
  return fp8 ? decode_with<Fp8>(s, p, out, simd) : decode_with<Int8>(s, p, out, simd);
}

}  // namespace kvtier
