// WeightWatch: see weight_watch.h.

#include "weight_watch.h"

#include <cstring>

namespace genlm_fast {
namespace cpu {

namespace {

// whether WeightWatch samples a tensor's values: float32 and 16-bit floats (bfloat16,
// float16) on the CPU, contiguous
bool sampled(const torch::Tensor& t) {
  const c10::ScalarType d = t.scalar_type();
  return (d == torch::kFloat32 || d == torch::kBFloat16 || d == torch::kHalf) &&
         t.device().is_cpu() && t.is_contiguous();
}

// the bits of entry i of a sampled tensor (4 or 2 bytes)
uint32_t bits_at(const torch::Tensor& t, int64_t i) {
  if (t.element_size() == 4) return static_cast<const uint32_t*>(t.data_ptr())[i];
  return static_cast<const uint16_t*>(t.data_ptr())[i];
}

}  // namespace

WeightWatch::WeightWatch(std::vector<torch::Tensor> params,
                         std::vector<std::pair<pybind11::dict, DictItems>> dicts)
    : dicts_(std::move(dicts)) {
  for (torch::Tensor& t : params) {
    Entry e;
    e.data = t.data_ptr();
    e.dtype = t.scalar_type();
    e.version = t.is_inference() ? -1 : static_cast<int64_t>(t._version());
    if (sampled(t)) {
      // A small tensor (norm weights, biases) is kept whole. Each sample of a large one is a
      // cache and TLB miss once a forward has streamed the weights, so it gets few samples.
      const int64_t numel = t.numel();
      if (numel <= 4096) {
        const unsigned char* bytes = static_cast<const unsigned char*>(t.data_ptr());
        e.whole.assign(bytes, bytes + t.nbytes());
      } else {
        for (int64_t i = 0; i < numel; i += numel / 8) {
          e.at.push_back(i);
          e.bits.push_back(bits_at(t, i));
        }
      }
    }
    e.tensor = std::move(t);
    entries_.push_back(std::move(e));
  }
}

int64_t WeightWatch::changed() const {
  const int64_t D = static_cast<int64_t>(dicts_.size());
  for (int64_t i = 0; i < D; ++i) {
    PyObject* dict = dicts_[i].first.ptr();
    const DictItems& items = dicts_[i].second;
    if (PyDict_Size(dict) != static_cast<Py_ssize_t>(items.size())) return i;
    for (const auto& item : items) {
      PyObject* now = PyDict_GetItemWithError(dict, item.first.ptr());  // borrowed
      if (now != item.second.ptr()) {
        PyErr_Clear();  // (a key whose hash failed: changed as well)
        return i;
      }
    }
  }
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    const torch::Tensor& t = e.tensor;
    const int64_t at = D + static_cast<int64_t>(i);
    if (t.data_ptr() != e.data || t.scalar_type() != e.dtype ||
        (e.version >= 0 && (t.is_inference() || t._version() != e.version)))
      return at;
    if (e.whole.empty() && e.at.empty()) continue;
    if (!t.is_contiguous()) return at;
    if (!e.whole.empty()) {
      if (t.nbytes() < e.whole.size() ||
          std::memcmp(t.data_ptr(), e.whole.data(), e.whole.size()) != 0)
        return at;
      continue;
    }
    if (t.numel() <= e.at.back()) return at;
    for (size_t j = 0; j < e.at.size(); ++j)
      if (bits_at(t, e.at[j]) != e.bits[j]) return at;
  }
  return -1;
}

std::vector<std::pair<int64_t, int64_t>> WeightWatch::reads() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const Entry& e : entries_) {
    const int64_t base = reinterpret_cast<int64_t>(e.data);
    if (!e.whole.empty()) out.emplace_back(base, static_cast<int64_t>(e.whole.size()));
    const int64_t size = e.tensor.element_size();
    for (int64_t i : e.at) out.emplace_back(base + i * size, size);
  }
  return out;
}

}  // namespace cpu
}  // namespace genlm_fast
