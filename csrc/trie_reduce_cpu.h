// The CPU trie kernel's entry point (trie_reduce_cpu.cpp), shared with the torch bindings.
#pragma once

#include <cstdint>

namespace genlm_fast {
namespace cpu {

enum Reduction : int { kSum = 0, kMax = 1, kLogMass = 2 };
enum InType : int { kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3 };

struct Args {
  const void* values;  // [B, C] contiguous, of type in_type
  int in_type;
  int64_t B, C;
  const int32_t* parent;  // [N] parent id (> n), -1 for the root
  // Runs: maximal chains of node ids [start, end) in which every node above `start` has
  // `start`'s chain as its only child and no leaf, so all of them hold one value. Run i is
  // [run_end[i - 1] (0 for i = 0), run_end[i]); its leaves are the leaf positions
  // [run_leaf[i], run_leaf[i + 1]), all at its first node.
  const int32_t* run_end;          // [R] exclusive end node, increasing; the last is N
  // The depth-stack sweep keeps slot d for the siblings at depth d; slot max_depth + 1 is
  // never written, so it always holds the identity. A run reads its children's combined
  // value from run_child_slot, combines it with run_join_slot (its earlier siblings' value)
  // and writes the result to run_depth. Taking the identity slot for a run with no children
  // and for a first child (whose slot still holds another subtree's stale value) is what
  // lets the sweep skip resetting slots after reading them.
  const int32_t* run_depth;       // [R] depth of the run's last (top) node: the slot it writes
  const int32_t* run_child_slot;  // [R] depth of its first node + 1 (where its children sit),
                                  //     or max_depth + 1 if that node has no children
  const int32_t* run_join_slot;   // [R] run_depth, or max_depth + 1 if the top node is its
                                  //     parent's first child (or the root)
  const int32_t* run_leaf;         // [R + 1] first leaf position of each run; run_leaf[R] = L
  const int32_t* run_of;           // [N] the run holding each node
  int64_t num_runs;
  int32_t max_depth;  // >= every depth
  const int32_t* node_of_leaf;   // [L] node of each leaf position, non-decreasing
  const int32_t* leaf_token;  // [L] value column of each leaf position
  int64_t N, L;
  const int32_t* empty_nodes;  // [E] nodes with no leaves
  int64_t E;
  void* out;  // [B, N] float32, or float64 when out_double
  bool out_double;
  int reduction;
  int num_threads;  // <= 0: team_size() decides (cpu_threads.h)
};

// Fills A.out. Returns 0 on success, or 1 + the first row that fails its check (the rows are
// checked as they are read, so callers need no pass of their own): a NaN anywhere in the row
// (sum, max), or no finite maximum (log_mass: a NaN, a +inf, or all -inf).
int64_t trie_reduce(const Args& A);

}  // namespace cpu
}  // namespace genlm_fast
