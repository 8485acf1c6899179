// A decoder-only transformer's forward pass on the CPU in one call (AsyncTransformer's decoding
// steps): algorithm at the top of decoder_cpu.cpp, the Python side in
// genlm_fast/backend/llm/decoder.py.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace genlm_fast {
namespace cpu {

// What the forward computes besides the weights: read once from the HF model by decoder.py.
struct DecoderSpec {
  int64_t layers = 0, hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, inter = 0, vocab = 0;
  int64_t max_positions = 0;   // rows of the learned position table (learned_positions only)
  bool layer_norm = false;     // LayerNorm (weight and bias), else RMSNorm (weight)
  double eps = 1e-6;
  std::string act = "silu";    // silu, gelu_tanh, gelu_erf or relu
  bool gated = true;           // act(gate) * up, else act(fc)
  bool qk_norm = false;        // RMSNorm over each query and key head before the rotation
  bool post_norms = false;     // norms of the attention and MLP outputs before the residual
  bool learned_positions = false;  // a position embedding added to the token's, no rotation
  double embed_scale = 1.0;
  bool embed_from_head = false;  // the embedding is the LM head's weight (tied): its rows are
                                 // read from the head's panels, no "embed" weight is given
  double attn_softcap = 0.0;   // 0: none, else scores = cap * tanh(scores / cap)
  double final_softcap = 0.0;  // likewise for the logits
  std::vector<double> scaling;         // per layer: the scores' factor
  std::vector<int64_t> window;         // per layer: sliding window (0: none)
};

class DecoderCPU {
 public:
  // `weights`: the packed projections and the vectors, by name (decoder.py, `_pack`). The
  // embeddings and the packed projections are float32, bfloat16 or float16 (all the same;
  // the arithmetic is float32 either way), the vectors (norms, biases) float32.
  DecoderCPU(DecoderSpec spec, std::map<std::string, torch::Tensor> weights);

  // One forward over B rows of new tokens (row b: tokens[row_start[b] .. row_start[b + 1]),
  // at positions[...]) after each row's cached past, read through the run table (int64
  // [R, 4]: data pointer, positions between one head's block and the next, first and end
  // position; row b's runs are run_start[b] .. run_start[b + 1]); writes the new keys and
  // values into each row's last run; returns the logits of each row's last token [B, vocab].
  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& positions,
                        const torch::Tensor& row_start, const torch::Tensor& cos,
                        const torch::Tensor& sin, const torch::Tensor& runs,
                        const torch::Tensor& run_start) const;

  // bytes of packed weights one forward streams
  int64_t weight_bytes() const { return weight_bytes_; }
  // the dtype of the embeddings and packed projections: float32, bfloat16 or float16
  std::string weight_dtype() const { return c10::toString(weight_dtype_); }

 private:
  struct Layer {
    const float *norm1 = nullptr, *norm1_b = nullptr, *post1 = nullptr;
    const float *norm2 = nullptr, *norm2_b = nullptr, *post2 = nullptr;
    const float *q_norm = nullptr, *k_norm = nullptr;
    const float *qkv_b = nullptr, *o_b = nullptr, *up_b = nullptr, *down_b = nullptr;
    const void *qkv = nullptr, *o = nullptr, *up = nullptr, *down = nullptr;  // weight_dtype_
  };

  // the tensor `name` of `shape` and `dtype`: its data, or null if optional and missing
  const void* get(const std::string& name, std::vector<int64_t> shape, c10::ScalarType dtype,
                  bool optional = false);
  const float* vector(const std::string& name, std::vector<int64_t> shape, bool optional = false) {
    return static_cast<const float*>(get(name, std::move(shape), torch::kFloat32, optional));
  }

  DecoderSpec spec_;
  std::map<std::string, torch::Tensor> weights_;
  c10::ScalarType weight_dtype_ = torch::kFloat32;  // of the embeddings and packed projections
  std::vector<Layer> layers_;
  const void *embed_ = nullptr, *positions_ = nullptr, *head_ = nullptr;  // (embed_: null when
  // the head's panels hold the embedding)
  int64_t vocab_in_ = 0;  // rows of the embedding
  const float *final_norm_ = nullptr, *final_norm_b_ = nullptr, *head_b_ = nullptr;
  int64_t weight_bytes_ = 0;
};

// whether this CPU runs the decoder (AVX-512F)
bool decoder_supported();

}  // namespace cpu
}  // namespace genlm_fast
