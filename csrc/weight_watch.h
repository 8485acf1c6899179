// Whether a model's weights changed since the watch was made: what ModelState asks before each
// forward, to rebuild the fused decoder and the packed linear layers when they did (the
// Python side: genlm_fast/backend/llm/model_state.py, ModelWatch).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace genlm_fast {
namespace cpu {

// Tells whether a model still is what it was when the watch was made, cheaply enough to ask
// before every forward (pointers, version counters and a few sampled values, never the whole
// weights):
//   * its structure: each dict of the model (a module's _modules and _parameters) holds the
//     same keys, bound to the very same objects (no submodule or parameter replaced, no adapter
//     injected);
//   * its parameters: the same storage, dtype and version counter, and the same values at
//     sampled entries (every entry of a tensor of up to 4096, else 8 evenly spaced), which sees
//     edits made behind the version counter (through .data, as peft's merge does) that touch
//     the whole tensor. A few entries of a large tensor edited through .data go unseen: that is
//     what AsyncTransformer.reload_weights() is for.
// Needs the GIL (it reads Python dicts).
class WeightWatch {
 public:
  using DictItems = std::vector<std::pair<pybind11::object, pybind11::object>>;
  WeightWatch(std::vector<torch::Tensor> params,
              std::vector<std::pair<pybind11::dict, DictItems>> dicts);
  // what changed first: dict i as i, parameter j as dicts + j; or -1
  int64_t changed() const;
  // the memory changed() reads, as (address, bytes): the sampled entries and the tensors kept
  // whole (pages that must stay mapped for the check to stay cheap: file_pages.release)
  std::vector<std::pair<int64_t, int64_t>> reads() const;

 private:
  struct Entry {
    torch::Tensor tensor;
    const void* data;
    c10::ScalarType dtype;
    int64_t version;  // -1: an inference tensor, which has none
    // float32 and 16-bit float values (other dtypes are not sampled): a small tensor's bytes,
    // whole; of a large one, the bits of the entries at the indices `at`
    std::vector<unsigned char> whole;
    std::vector<int64_t> at;
    std::vector<uint32_t> bits;
  };
  std::vector<std::pair<pybind11::dict, DictItems>> dicts_;
  std::vector<Entry> entries_;
};

}  // namespace cpu
}  // namespace genlm_fast
