// Python bindings of genlm_fast's compiled ops: module genlm_fast._C (or genlm_fast_C when
// JIT-built). Only the bindings live here; each op's checks and logic are in its own file
// (trie_reduce_cpu_op.cpp, trie_reduce_cuda_op.cpp, decoder_cpu.cpp, linear_cpu.cpp,
// linear_rows_cpu.cpp, cpu_threads.cpp, weight_watch.cpp).
//
//   trie_reduce_cpu(values, parent, node_of_leaf, leaf_token, empty_nodes, run_end, run_depth,
//                   run_child_slot, run_join_slot, run_leaf, run_of, max_depth, reduction,
//                   check_indices=True, num_threads=0, float64_result=False)
//                   -> (Tensor[B, N], bad_row)
//                   the result is float32, or float64 for sum/max of float64 values or with
//                   float64_result (float32 values are then read as they are)
//                   bad_row = -1, or the first row the kernel rejected (a NaN for sum/max;
//                   no finite maximum for log_mass), whose result is then incomplete
//   trie_reduce_cuda(values, leaf_token, column_leaf, tile_node_lo, tile_run_ptr, run_bounds,
//                    node_src, tile_scratch_ptr, scratch_src, scratch_slot, span_node,
//                    span_left, span_right, span_tile_lo, span_tile_hi, span_narrow,
//                    span_warp, scratch, reduction, num_nodes, num_scratch, tile)
//                    -> Tensor[B, num_nodes]   (only when built with -DWITH_CUDA; scratch is a
//                    float64 [B, num_scratch + 2] workspace the caller allocates, its last
//                    column each row's check, NaN exactly for a bad row (log_mass: else
//                    log(sum exp(x - m)) with the row max m in the column before; sum/max:
//                    else 0); spanning nodes [0, span_narrow) are narrow (a thread each),
//                    [span_narrow, span_warp) a warp each, the rest a block each)
//   cpu_team_size(bytes) -> int  the threads a CPU kernel's parallel region over about
//                   `bytes` of memory traffic gets now (cpu_threads.h: usable CPUs, contention,
//                   torch's setting, the work); cpu_free_cpus() -> int  the first two alone;
//                   cpu_threads_info() -> dict of what they are decided from
//   empty_output_cache()  frees the cached blocks large CPU results reuse (trie_reduce_cpu_op.cpp)
//   output_cache_sizes()  the bytes of each cached block, least recently returned first
//   DecoderSpec, DecoderCPU(spec, weights): a decoder-only transformer's forward over
//                   a few new tokens per row in one call (decoder_cpu.cpp; the Python side:
//                   genlm_fast/backend/llm/decoder.py); decoder_supported() -> bool
//   WeightWatch(params, dicts).changed() -> what was replaced or edited first (a dict of the
//                   model's structure, or a parameter), or -1; .reads() -> [(address, bytes)]
//                   it reads (weight_watch.cpp)
//   pack_linear_weight(weight, out=None) -> panels (written into out when given);
//                   linear_small_batch(x, panels, bias, out_features, isa="auto")
//                   -> x @ weight.T + bias in float32, the panels float32/bfloat16/float16;
//                   linear_best_isa() -> "avx512" | ...  the small-batch linear layer of
//                   linear_cpu.cpp (a float32 model's packed layers: cpu_linear.py; transformers'
//                   layers over the fused decoder's panels: panel_layers.py)
//   linear_rows(x, weight, bias, isa="auto") -> x @ weight.T + bias in float32, the weight
//                   float32/bfloat16/float16 read in place (linear_rows_cpu.cpp: a 16-bit
//                   model's transformers forward in float32, genlm_fast/backend/llm/widen.py);
//                   linear_rows_best_isa() -> "avx512" | "avx2" | "baseline"
//
// The index arrays are the int32 arrays of genlm_fast.ops.layout.TrieLayout.device_arrays,
// plus those the CUDA path derives once per layout (cuda_backend.py: `column_leaf[c]` = the
// leaf position reading column c, or -1) and the CPU path (cpu_backend.py caches them):
// `node_of_leaf[pos]` = the node receiving leaf position pos (non-decreasing), `empty_nodes` = the
// nodes with no leaves (they are 0 under "max"), the runs of single-child links the row sweep
// steps over (see trie_reduce_cpu.h) and the maximum depth. Validation of
// dtypes, devices, shapes and contiguity always runs; check_indices=True also checks every
// index (O(N + L)) so that malformed arrays raise instead of reading out of bounds.

#include <torch/extension.h>

#include "cpu_threads.h"
#include "trie_reduce_ops.h"
#ifndef GF_TRIE_ONLY  // (-DGF_TRIE_ONLY: the trie op alone, genlm_fast/ops/sources.py)
#include "decoder_cpu.h"
#include "linear_cpu.h"
#include "linear_rows_cpu.h"
#include "weight_watch.h"
#endif

#include <pybind11/stl.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

static pybind11::dict cpu_threads_info() {
  const genlm_fast::cpu::ThreadsInfo info = genlm_fast::cpu::threads_info();
  pybind11::dict d;
  d["affinity_cpus"] = info.affinity_cpus;
  d["quota_cpus"] = info.quota_cpus;
  d["usable_cpus"] = info.usable_cpus;
  d["others_busy"] = info.others_busy;
  d["free_cpus"] = info.free_cpus;
  d["torch_threads"] = info.torch_threads;
  d["contention_known"] = info.contention_known;
  return d;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "genlm_fast trie reduction kernels";
  // the first contention reading: the window of the next one starts now
  genlm_fast::cpu::threads_info();
  m.def("cpu_team_size", &genlm_fast::cpu::team_size,
        "Threads for a CPU parallel region over about `bytes` of memory traffic, now",
        pybind11::arg("bytes"));
  m.def("cpu_free_cpus", &genlm_fast::cpu::free_cpus,
        "The usable CPUs other work leaves free now (affinity, cgroup quota, contention)");
  m.def("cpu_threads_info", &cpu_threads_info,
        "What the CPU kernels' team sizes are decided from: usable CPUs (affinity, cgroup "
        "quota), CPUs other work keeps busy, torch's thread setting");
  m.def("trie_reduce_cpu", &genlm_fast::trie_reduce_cpu, "Per-node sum/max/log_mass of a vocabulary trie (CPU)",
        pybind11::arg("values"), pybind11::arg("parent"), pybind11::arg("node_of_leaf"),
        pybind11::arg("leaf_token"), pybind11::arg("empty_nodes"), pybind11::arg("run_end"),
        pybind11::arg("run_depth"), pybind11::arg("run_child_slot"),
        pybind11::arg("run_join_slot"), pybind11::arg("run_leaf"), pybind11::arg("run_of"),
        pybind11::arg("max_depth"), pybind11::arg("reduction"),
        pybind11::arg("check_indices") = true, pybind11::arg("num_threads") = 0,
        pybind11::arg("float64_result") = false);
  m.def("empty_output_cache", &genlm_fast::empty_output_cache,
        "Free the cached blocks that large CPU results are reused from");
  m.def("output_cache_sizes", &genlm_fast::output_cache_sizes,
        "Bytes of each cached result block, least recently returned first");
#ifndef GF_TRIE_ONLY
  m.def("pack_linear_weight", &genlm_fast::cpu::pack_linear_weight,
        "A [N, K] weight as the panels linear_small_batch and the fused decoder read (into "
        "`out` when given)",
        pybind11::arg("weight"), pybind11::arg("out") = pybind11::none());
  m.def("linear_small_batch", &genlm_fast::cpu::linear_small_batch,
        "x @ weight.T + bias for a few rows of x, weight given as its panels",
        pybind11::arg("x"), pybind11::arg("panels"), pybind11::arg("bias"),
        pybind11::arg("out_features"), pybind11::arg("isa") = "auto");
  m.def("linear_best_isa", &genlm_fast::cpu::linear_best_isa,
        "The widest linear_small_batch kernel this CPU runs: avx512 or baseline");
  m.def("linear_rows", &genlm_fast::cpu::linear_rows,
        "x @ weight.T + bias in float32 from a float32, bfloat16 or float16 weight read in place",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"),
        pybind11::arg("isa") = "auto");
  m.def("linear_rows_best_isa", &genlm_fast::cpu::linear_rows_best_isa,
        "The widest linear_rows kernel this CPU runs: avx512, avx2 or baseline");
  {
    using genlm_fast::cpu::DecoderCPU;
    using genlm_fast::cpu::DecoderSpec;
    // module_local: another build of these sources in the same process (a JIT build beside
    // the prebuilt module) can then register its own classes
    pybind11::class_<DecoderSpec>(m, "DecoderSpec", "What a DecoderCPU computes besides weights",
                                 pybind11::module_local())
        .def(pybind11::init<>())
        .def_readwrite("layers", &DecoderSpec::layers)
        .def_readwrite("hidden", &DecoderSpec::hidden)
        .def_readwrite("heads", &DecoderSpec::heads)
        .def_readwrite("kv_heads", &DecoderSpec::kv_heads)
        .def_readwrite("head_dim", &DecoderSpec::head_dim)
        .def_readwrite("inter", &DecoderSpec::inter)
        .def_readwrite("vocab", &DecoderSpec::vocab)
        .def_readwrite("max_positions", &DecoderSpec::max_positions)
        .def_readwrite("layer_norm", &DecoderSpec::layer_norm)
        .def_readwrite("eps", &DecoderSpec::eps)
        .def_readwrite("act", &DecoderSpec::act)
        .def_readwrite("gated", &DecoderSpec::gated)
        .def_readwrite("qk_norm", &DecoderSpec::qk_norm)
        .def_readwrite("post_norms", &DecoderSpec::post_norms)
        .def_readwrite("learned_positions", &DecoderSpec::learned_positions)
        .def_readwrite("embed_scale", &DecoderSpec::embed_scale)
        .def_readwrite("embed_from_head", &DecoderSpec::embed_from_head)
        .def_readwrite("attn_softcap", &DecoderSpec::attn_softcap)
        .def_readwrite("final_softcap", &DecoderSpec::final_softcap)
        .def_readwrite("scaling", &DecoderSpec::scaling)
        .def_readwrite("window", &DecoderSpec::window);
    pybind11::class_<DecoderCPU>(m, "DecoderCPU",
                                 "A decoder-only transformer's forward in one call",
                                 pybind11::module_local())
        .def(pybind11::init<DecoderSpec, std::map<std::string, torch::Tensor>>(),
             pybind11::arg("spec"), pybind11::arg("weights"))
        .def("forward", &DecoderCPU::forward, pybind11::arg("tokens"), pybind11::arg("positions"),
             pybind11::arg("row_start"), pybind11::arg("cos"), pybind11::arg("sin"),
             pybind11::arg("runs"), pybind11::arg("run_start"))
        .def_property_readonly("weight_bytes", &DecoderCPU::weight_bytes)
        .def_property_readonly("weight_dtype", &DecoderCPU::weight_dtype);
    pybind11::class_<genlm_fast::cpu::WeightWatch>(
        m, "WeightWatch", "Whether a model's parameters changed since it was built",
        pybind11::module_local())
        .def(pybind11::init<std::vector<torch::Tensor>,
                            std::vector<std::pair<pybind11::dict,
                                                  genlm_fast::cpu::WeightWatch::DictItems>>>(),
             pybind11::arg("params"), pybind11::arg("dicts"))
        .def("changed", &genlm_fast::cpu::WeightWatch::changed,
             "What changed first (dict i: i, parameter j: len(dicts) + j), or -1")
        .def("reads", &genlm_fast::cpu::WeightWatch::reads,
             "The memory changed() reads: [(address, bytes)]");
    m.def("decoder_supported", &genlm_fast::cpu::decoder_supported,
          "Whether this CPU runs DecoderCPU (AVX-512F)");
  }
#endif
#ifdef WITH_CUDA
  m.def("trie_reduce_cuda", &genlm_fast::trie_reduce_cuda,
        "Per-node sum/max/log_mass of a vocabulary trie (CUDA, tile decomposition)",
        pybind11::arg("values"), pybind11::arg("leaf_token"), pybind11::arg("column_leaf"),
        pybind11::arg("tile_node_lo"), pybind11::arg("tile_run_ptr"),
        pybind11::arg("run_bounds"), pybind11::arg("node_src"),
        pybind11::arg("tile_scratch_ptr"), pybind11::arg("scratch_src"),
        pybind11::arg("scratch_slot"), pybind11::arg("span_node"), pybind11::arg("span_left"),
        pybind11::arg("span_right"), pybind11::arg("span_tile_lo"), pybind11::arg("span_tile_hi"),
        pybind11::arg("span_narrow"), pybind11::arg("span_warp"), pybind11::arg("scratch"),
        pybind11::arg("reduction"), pybind11::arg("num_nodes"), pybind11::arg("num_scratch"),
        pybind11::arg("tile"));
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
}
