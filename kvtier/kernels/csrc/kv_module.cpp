// The Python module: the copies of kv_ops.cpp, each returning its outcome instead of raising,
// and two host helpers for the serving path's argument checks.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "kv_codec.h"
#include "kv_ops.h"

namespace kvtier {
namespace {

py::object slot_bounds(const at::Tensor& slots) {
  if (!slots.is_cpu() || slots.dim() != 1 || slots.scalar_type() != at::kLong ||
      !slots.is_contiguous() || slots.numel() == 0) {
    return py::none();
  }
  const auto [lo, hi] = value_bounds(slots);
  return py::make_tuple(lo, hi);
}

py::object token_bytes(const at::Tensor& tokens) {
  const auto type = tokens.scalar_type();
  if (!tokens.is_cpu() || tokens.dim() != 1 || (type != at::kLong && type != at::kInt)) {
    return py::none();
  }
  const at::Tensor t = tokens.to(at::kLong).contiguous();  // no copy for the usual int64
  const int64_t n = t.numel();
  const int64_t* v = t.data_ptr<int64_t>();
  if (n > 0) {
    const auto [lo, hi] = std::minmax_element(v, v + n);
    if (*lo < 0 || *hi > int64_t{0xFFFFFFFF}) {
      throw py::value_error("token_ids must lie in [0, 2**32), got range [" +
                            std::to_string(*lo) + ", " + std::to_string(*hi) + "]");
    }
  }
  auto out = py::reinterpret_steal<py::bytes>(PyBytes_FromStringAndSize(nullptr, 4 * n));
  if (!out) throw py::error_already_set();
  auto* dst = reinterpret_cast<unsigned char*>(PyBytes_AS_STRING(out.ptr()));
  for (int64_t i = 0; i < n; ++i) {  // little-endian whatever the host's order
    const auto x = static_cast<uint32_t>(v[i]);
    dst[4 * i] = x & 0xFF;
    dst[4 * i + 1] = (x >> 8) & 0xFF;
    dst[4 * i + 2] = (x >> 16) & 0xFF;
    dst[4 * i + 3] = x >> 24;
  }
  return out;
}

// A copy's outcome for Python: ("", "") when it ran, else the Python exception to raise and its
// message (see `ops.check_result`). The GIL is held while the copy checks its arguments and
// released once they passed (`checked`), for the copy itself; nothing is thrown across the
// Python boundary. On the H100 machine (torch 2.11+cu130, Python 3.12), every exception leaving
// a call that released the GIL for its whole length killed the process with SIGSEGV, c10::Error
// and std exceptions alike.
using Outcome = std::pair<std::string, std::string>;

template <typename... Args>
auto reporting(void (*copy)(const Checked&, Args...)) {
  return [copy](Args... args) -> Outcome {
    std::optional<py::gil_scoped_release> released;  // the copies take milliseconds
    try {
      copy([&released] { released.emplace(); }, std::forward<Args>(args)...);
      return {};
    } catch (const std::invalid_argument& e) {
      return {"ValueError", e.what()};
    } catch (const std::exception& e) {
      return {"RuntimeError", e.what()};
    }
  };
}

}  // namespace
}  // namespace kvtier

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvtier multi-layer KV gather/scatter kernels";
#ifdef KVTIER_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
  // Each copy returns its Outcome instead of raising, and lets other Python threads (the
  // background writer) run while it copies.
  m.def("gather", kvtier::reporting(&kvtier::gather), "out[l, t] = layers[l][slots[t]]",
        py::arg("layers"), py::arg("slots"), py::arg("out"), py::arg("max_threads") = 0);
  m.def("scatter", kvtier::reporting(&kvtier::scatter),
        "layers[l][slots[t]] = src[l, t] for slots[t] != -1",
        py::arg("src"), py::arg("slots"), py::arg("layers"), py::arg("max_threads") = 0);
  m.def("gather_chunks", kvtier::reporting(&kvtier::gather_chunks),
        "gather(layers, slots[offset_c : offset_c + T_c], outs[c]) for every chunk c, with the "
        "slots checked once",
        py::arg("layers"), py::arg("slots"), py::arg("outs"), py::arg("max_threads") = 0);
  m.def("scatter_chunks", kvtier::reporting(&kvtier::scatter_chunks),
        "scatter(srcs[c], slots[offset_c : offset_c + T_c], layers) for every chunk c, with "
        "the slots checked once",
        py::arg("srcs"), py::arg("slots"), py::arg("layers"), py::arg("max_threads") = 0);
  // Host helpers that spare a cold serving call a few tensor dispatches each; both return None
  // for a tensor they do not take, whose caller then falls back to torch and its own messages.
  m.def("slot_bounds", &kvtier::slot_bounds,
        "(min, max) of a non-empty contiguous 1-D CPU int64 tensor, else None", py::arg("slots"));
  m.def("token_bytes", &kvtier::token_bytes,
        "a 1-D CPU integer tensor as little-endian uint32 bytes (ValueError outside [0, 2**32)), "
        "else None", py::arg("tokens"));
  // The record codecs (kv_codec.h), single-threaded, without the GIL once checked.
  m.def("codec_encode", kvtier::reporting(&kvtier::codec_encode),
        "chunk [planes, layers, tokens, hidden] -> its fp8/int8 record payload (codec.py)",
        py::arg("chunk"), py::arg("payload"), py::arg("codec"), py::arg("simd") = true);
  m.def("codec_decode", kvtier::reporting(&kvtier::codec_decode),
        "an fp8/int8 record payload -> out [planes, layers, tokens, hidden] (codec.py)",
        py::arg("payload"), py::arg("out"), py::arg("codec"), py::arg("simd") = true);
  m.def("codec_decode_blocks", kvtier::reporting(&kvtier::codec_decode_blocks),
        "a payload's blocks [first, ...) and its tail of scales -> those blocks of out",
        py::arg("values"), py::arg("scales"), py::arg("out"), py::arg("first"),
        py::arg("codec"), py::arg("simd") = true);
  m.def("gather_host", kvtier::reporting(&kvtier::gather_host),
        "outs[c][l, t] = layers[l][slots[first_c + t]] for CUDA layers and pinned host chunks, "
        "enqueued on the current stream; slots checked on the GPU into status",
        py::arg("layers"), py::arg("slots"), py::arg("outs"), py::arg("status"),
        py::arg("max_blocks"));
  m.def("scatter_host", kvtier::reporting(&kvtier::scatter_host),
        "layers[l][slots[first_c + t]] = srcs[c][l, t] for pinned host chunks and CUDA layers "
        "(-1 slots skipped), enqueued on the current stream; slots checked on the GPU",
        py::arg("srcs"), py::arg("slots"), py::arg("layers"), py::arg("status"),
        py::arg("max_blocks"));
}
