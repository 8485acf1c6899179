"""The CPU emulator of the CUDA trie kernels (csrc/trie_reduce_cuda.cu), which
tests/ops/test_cuda_emulation.py runs. Over 500 lines only for the C++ harness (HARNESS), a
string of nearly 300 lines; the Python is the source rewrite, the build, one run, and the
reference, comparison and trie helpers the tests share.

No GPU here, so the .cu itself is compiled as host C++ (g++, with CUDA's host headers for
``__half``/``__nv_bfloat16``/``dim3``) after a mechanical rewrite of the few CUDA-only
constructs, and executed with real thread semantics:

* every launch ``k<<<grid, block, shmem, stream>>>(args)`` runs each block in turn, in order
  of linear index, each CUDA thread a fiber of its own (its own stack) that runs until it
  waits at a barrier or returns, so one thread of a block runs ahead of the others as far
  as the kernel lets it; the launch fails (as on a device) on a grid dimension of 0 or past
  its limit (x < 2^31, y and z <= 65535), more than 1024 threads, or more than 48 KiB of
  dynamic shared memory;
* ``__syncthreads()`` is a block-wide barrier, ``__shfl_xor_sync`` a warp-wide exchange
  that reports a lane missing from the full mask (an exited lane: undefined on a device);
  threads that wait at a barrier the others never reach are reported, not a hang;
* dynamic shared memory is a heap block of exactly the launch's size, filled with NaN, and
  each static ``__shared__`` array a heap block of its own per block, all bits set;
* the harness is built with AddressSanitizer + UBSan and every device array is a heap block
  of exactly its size, so an out-of-bounds read or write, or signed overflow, fails the run
  (a stand-in for compute-sanitizer's memcheck); outputs and scratch start as NaN, so a node
  the kernels never write shows up.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

from genlm_fast.backend.tokenization import Token
from genlm_fast.bytes import TokenByteTrie
from genlm_fast.ops import dispatch
from genlm_fast.ops.layout import SPAN_NARROW_TILES, SPAN_WARP_TILES, span_class_end
from tests.ops.cuda_toolkit import cuda_include_dirs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CU = os.path.join(REPO, "csrc", "trie_reduce_cuda.cu")
DTYPES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
REDUCTION = {"sum": 0, "max": 1, "log_mass": 2}
with open(os.path.join(REPO, "csrc", "trie_reduce_cuda.h")) as _header:
    # batches from this many rows up get the staging workspace (the binding's rule)
    STAGE_MIN_ROWS = int(re.search(r"kStageMinRows = (\d+);", _header.read()).group(1))
with open(CU) as _source:
    _cu = _source.read()
    # the tile kernel keeps this many of a tile's node sources, and one scratch value a
    # thread, in shared memory; more are read from global memory as they are written out
    TILE_THREADS = int(re.search(r"kTileThreads = (\d+);", _cu).group(1))
    SHARED_IDS = int(re.search(r"kSharedIds = (\d+) \* kTileThreads;", _cu).group(1)) * TILE_THREADS

HARNESS = r"""
#include <cmath>
#include <functional>
#include <map>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include <sanitizer/common_interface_defs.h>  // ASan's fiber annotations
#include <ucontext.h>

#include <cuda_runtime_api.h>  // cudaError_t, cudaStream_t, dim3 (host declarations only)
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define __launch_bounds__(...)

namespace emu {
// Every CUDA thread of a block is a fiber (ucontext) on the launching OS thread, switched at
// barriers: the scheduler resumes each fiber in turn until it waits at a barrier that is not
// yet full or returns. One OS thread for the whole run, so its speed does not depend on how
// busy the machine is, and a barrier that can never fill is reported instead of hanging.
// ASan is told of every stack switch (its fiber annotations).
struct Barrier {
  int expected;
  int arrived = 0;
  long phase = 0;
  explicit Barrier(int n) : expected(n) {}
};
struct Warp {
  Barrier bar{32};
  double slots[32];
  int exited = 0;
};
struct Block {
  Barrier bar;
  std::vector<std::unique_ptr<Warp>> warps;
  unsigned char* shmem;
  size_t shmem_bytes;
  std::map<int, void*> statics;  // the static __shared__ arrays, by declaration
  Block(int threads, size_t bytes) : bar(threads), shmem_bytes(bytes) {
    for (int w = 0; w < threads / 32; ++w) warps.emplace_back(new Warp());
    shmem = static_cast<unsigned char*>(std::malloc(bytes ? bytes : 1));
    const double nan = std::nan("");
    for (size_t i = 0; i + sizeof(double) <= bytes; i += sizeof(double))
      std::memcpy(shmem + i, &nan, sizeof(double));
  }
  ~Block() {
    std::free(shmem);
    for (auto& entry : statics) std::free(entry.second);
  }
};
struct Fiber {
  ucontext_t context;
  void* stack = nullptr;
  Barrier* waits_on = nullptr;  // the barrier it waits at, in phase `wait_phase`
  long wait_phase = 0;
  bool done = false;
  void* fake_stack = nullptr;  // ASan's, while switched out
};
constexpr size_t kFiberStack = 256 * 1024;
uint3 tid, bid;
Block* blk = nullptr;
dim3 gdim, bdim;
int64_t max_grid_y = 65535;  // the kernels' row chunk (kMaxGridY), lowered by the tests
int64_t row_pass_blocks = 1024;  // (a1)'s blocks a launch (kRowPassTargetBlocks), set by tests
int errors = 0;
cudaError_t last_error = cudaSuccess;
long launches = 0;
ucontext_t scheduler;
const void* scheduler_stack = nullptr;
size_t scheduler_stack_size = 0;
Fiber* running = nullptr;
std::function<void()>* kernel_body = nullptr;

void fail(const char* what) {
  if (errors++ < 5) std::fprintf(stderr, "EMULATOR ERROR: %s\n", what);
}
cudaError_t get_last_error() { cudaError_t e = last_error; last_error = cudaSuccess; return e; }
cudaError_t memset2d_async(void* p, size_t pitch, int value, size_t width, size_t height,
                           cudaStream_t) {
  if (width > pitch) return cudaErrorInvalidValue;
  for (size_t r = 0; r < height; ++r) std::memset(static_cast<char*>(p) + r * pitch, value, width);
  return cudaSuccess;
}

// a static __shared__ array of the running block (declaration `id`), all bits set at first
template <class A>
A& shared_array(int id) {
  void*& p = blk->statics[id];
  if (p == nullptr) {
    p = std::malloc(sizeof(A));
    std::memset(p, 0xff, sizeof(A));
  }
  return *static_cast<A*>(p);
}

// the running fiber gives the OS thread back to the scheduler (`finished`: for good)
void switch_to_scheduler(bool finished) {
  Fiber* self = running;
  __sanitizer_start_switch_fiber(finished ? nullptr : &self->fake_stack, scheduler_stack,
                                 scheduler_stack_size);
  swapcontext(&self->context, &scheduler);
  __sanitizer_finish_switch_fiber(self->fake_stack, &scheduler_stack, &scheduler_stack_size);
}

void release_if_full(Barrier& b) {
  if (b.arrived > 0 && b.arrived >= b.expected) {
    b.arrived = 0;
    ++b.phase;
  }
}
void arrive_and_wait(Barrier& b) {
  ++b.arrived;
  const long phase = b.phase;
  release_if_full(b);
  if (b.phase != phase) return;  // the last to arrive goes on; the others resume in turn
  running->waits_on = &b;
  running->wait_phase = phase;
  switch_to_scheduler(false);
}
void arrive_and_drop(Barrier& b) {
  --b.expected;
  release_if_full(b);
}

inline void syncthreads() { arrive_and_wait(blk->bar); }
inline double longlong_as_double(long long v) { double d; std::memcpy(&d, &v, 8); return d; }
template <class T>
void stcs(T* p, T v) { *p = v; }  // a store with a cache hint: a store

template <class T>
T shfl_xor(unsigned mask, T v, int off) {
  static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
  if (mask != 0xffffffffu) fail("__shfl_xor_sync with a partial mask");
  const int lane = tid.x & 31;
  Warp& w = *blk->warps[tid.x >> 5];
  std::memcpy(&w.slots[lane], &v, sizeof(T));
  arrive_and_wait(w.bar);
  if (w.exited != 0) fail("__shfl_xor_sync while a lane of the full mask has exited");
  T r;
  std::memcpy(&r, &w.slots[lane ^ off], sizeof(T));
  arrive_and_wait(w.bar);
  return r;
}

// a fiber's whole life: the kernel's body for its thread, then it leaves its barriers as an
// exited thread does
void fiber_main() {
  __sanitizer_finish_switch_fiber(nullptr, &scheduler_stack, &scheduler_stack_size);
  (*kernel_body)();
  Warp& w = *blk->warps[tid.x >> 5];
  w.exited += 1;
  arrive_and_drop(w.bar);
  arrive_and_drop(blk->bar);
  running->done = true;
  switch_to_scheduler(true);
}

template <class F>
void launch(dim3 g, dim3 b, size_t shmem, cudaStream_t, F body) {
  launches++;
  const unsigned long long threads = 1ull * b.x * b.y * b.z;
  if (g.x == 0 || g.y == 0 || g.z == 0 || g.x > 2147483647u || g.y > 65535u || g.z > 65535u ||
      threads == 0 || threads > 1024 || b.y != 1 || b.z != 1 || b.x % 32 != 0 ||
      shmem > 48 * 1024) {
    std::fprintf(stderr, "EMULATOR: invalid launch grid (%u, %u, %u) block (%u, %u, %u) "
                 "shmem %zu\n", g.x, g.y, g.z, b.x, b.y, b.z, shmem);
    last_error = cudaErrorInvalidConfiguration;
    return;
  }
  gdim = g;
  bdim = b;
  std::function<void()> run = body;
  kernel_body = &run;
  std::vector<Fiber> pool(b.x);
  for (auto& f : pool) f.stack = std::malloc(kFiberStack);
  // the blocks one after another, in order of linear index, each a fresh Block (new
  // barriers, shared memory, statics) and fresh fibers on the same stacks
  const unsigned long long blocks = 1ull * g.x * g.y * g.z;
  for (unsigned long long i = 0; i < blocks; ++i) {
    Block block(static_cast<int>(b.x), shmem);
    blk = &block;
    bid = uint3{static_cast<unsigned>(i % g.x), static_cast<unsigned>(i / g.x % g.y),
                static_cast<unsigned>(i / g.x / g.y)};
    for (auto& f : pool) {
      f.waits_on = nullptr;
      f.done = false;
      f.fake_stack = nullptr;
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = f.stack;
      f.context.uc_stack.ss_size = kFiberStack;
      f.context.uc_link = nullptr;
      makecontext(&f.context, fiber_main, 0);
    }
    for (unsigned left = b.x; left > 0;) {
      bool resumed = false;
      for (unsigned t = 0; t < b.x; ++t) {
        Fiber& f = pool[t];
        if (f.done || (f.waits_on != nullptr && f.waits_on->phase == f.wait_phase)) continue;
        f.waits_on = nullptr;
        tid = uint3{t, 0, 0};
        running = &f;
        void* fake = nullptr;
        __sanitizer_start_switch_fiber(&fake, f.stack, kFiberStack);
        swapcontext(&scheduler, &f.context);
        __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
        resumed = true;
        if (f.done) --left;
      }
      if (!resumed) {
        fail("threads wait at a barrier that the block's other threads never reach");
        break;
      }
    }
    blk = nullptr;
  }
  for (auto& f : pool) std::free(f.stack);
  running = nullptr;
}
}  // namespace emu

#include "EMULATED_SOURCE"

// ---------------------------------------------------------------------------- driver
// argv[1]: input file (int64 header, then arrays each prefixed by its byte length);
// argv[2]: output file (int64 status, int64 emulator errors, out bytes, scratch bytes)

static void* read_array(FILE* f, int64_t* nbytes) {
  if (std::fread(nbytes, 8, 1, f) != 1) std::abort();
  void* p = std::malloc(*nbytes ? *nbytes : 1);  // exactly sized: ASan sees any overrun
  if (*nbytes && std::fread(p, 1, *nbytes, f) != static_cast<size_t>(*nbytes)) std::abort();
  return p;
}

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  FILE* f = std::fopen(argv[1], "rb");
  int64_t h[12];
  if (std::fread(h, 8, 12, f) != 12) return 3;
  genlm_fast::cuda::TrieArgs A{};
  A.dtype = static_cast<int>(h[0]);
  A.B = h[1];
  A.C = h[2];
  A.num_nodes = h[3];
  A.scratch_stride = h[4];
  A.tile = static_cast<int>(h[5]);
  A.out_double = h[6] != 0;
  A.reduction = static_cast<int>(h[7]);
  if (h[8] > 0) emu::row_pass_blocks = h[8];
  emu::max_grid_y = h[9];
  A.span_narrow = h[10];
  A.span_warp = h[11];
  int64_t n;
  A.values = read_array(f, &n);
  void* staged = read_array(f, &n);  // empty: none
  A.staged = n ? staged : nullptr;
  A.leaf_token = static_cast<int32_t*>(read_array(f, &n)); A.L = n / 4;
  A.column_leaf = static_cast<int32_t*>(read_array(f, &n)); A.n_column_leaf = n / 4;
  A.tile_node_lo = static_cast<int32_t*>(read_array(f, &n)); A.n_tiles = n / 4 - 1;
  A.tile_run_ptr = static_cast<int32_t*>(read_array(f, &n));
  A.run_bounds = static_cast<int32_t*>(read_array(f, &n));
  A.node_src = static_cast<int32_t*>(read_array(f, &n));
  A.tile_scratch_ptr = static_cast<int32_t*>(read_array(f, &n));
  A.scratch_src = static_cast<int32_t*>(read_array(f, &n));
  A.scratch_slot = static_cast<int32_t*>(read_array(f, &n));
  A.span_node = static_cast<int32_t*>(read_array(f, &n)); A.S = n / 4;
  A.span_left = static_cast<int32_t*>(read_array(f, &n));
  A.span_right = static_cast<int32_t*>(read_array(f, &n));
  A.span_tile_lo = static_cast<int32_t*>(read_array(f, &n));
  A.span_tile_hi = static_cast<int32_t*>(read_array(f, &n));
  int64_t scratch_bytes, out_bytes;
  A.scratch = static_cast<double*>(read_array(f, &scratch_bytes));
  A.out = read_array(f, &out_bytes);
  std::fclose(f);
  const cudaError_t status = genlm_fast::cuda::trie_reduce(A, nullptr);
  FILE* o = std::fopen(argv[2], "wb");
  const int64_t head[3] = {static_cast<int64_t>(status), emu::errors, emu::launches};
  std::fwrite(head, 8, 3, o);
  std::fwrite(A.out, 1, out_bytes, o);
  std::fwrite(A.scratch, 1, scratch_bytes, o);
  std::fclose(o);
  return 0;
}
"""


def _find_launch_end(src: str, start: int) -> int:
    """Index just past the ``);`` closing the argument list that opens at ``src[start]``."""
    assert src[start] == "("
    depth = 0
    for i in range(start, len(src)):
        if src[i] == "(":
            depth += 1
        elif src[i] == ")":
            depth -= 1
            if depth == 0:
                assert src[i + 1] == ";", src[start : i + 2]
                return i + 2
    raise AssertionError("unbalanced launch arguments")


def emulated_source(src: str) -> str:
    """The .cu with its CUDA-only constructs replaced by the emulator's (see HARNESS)."""
    optional = {r"\bgridDim\b", r"\bblockDim\b", r"__longlong_as_double\("}
    rewrites = [
        (r"\bthreadIdx\b", "emu::tid"),
        (r"\bblockIdx\b", "emu::bid"),
        (r"\bblockDim\b", "emu::bdim"),
        (r"\bgridDim\b", "emu::gdim"),
        (r"__syncthreads\(\)", "emu::syncthreads()"),
        (r"__shfl_xor_sync\(", "emu::shfl_xor("),
        (r"__stcs\(", "emu::stcs("),
        (r"__longlong_as_double\(", "emu::longlong_as_double("),
        (r"cudaGetLastError\(\)", "emu::get_last_error()"),
        (
            r"extern __shared__ (\w+) (\w+)\[\];",
            r"\1* \2 = reinterpret_cast<\1*>(emu::blk->shmem);",
        ),
        (r"cudaMemset2DAsync\(", "emu::memset2d_async("),
        (
            r"constexpr int64_t kMaxGridY = 65535;",
            "static const int64_t& kMaxGridY = emu::max_grid_y;",
        ),
        (
            r"constexpr int64_t kRowPassTargetBlocks = 1024;",
            "static const int64_t& kRowPassTargetBlocks = emu::row_pass_blocks;",
        ),
    ]
    for pattern, repl in rewrites:
        src, count = re.subn(pattern, repl, src)
        assert count or pattern in optional, (
            f"the CUDA source no longer contains {pattern!r}: update the emulator"
        )
    # static shared arrays: one of each per block
    declarations = iter(range(1 << 30))
    src, count = re.subn(
        r"__shared__ ([\w:]+) (\w+)((?:\[[^\]]+\])+);",
        lambda m: (
            f"{m[1]} (&{m[2]}){m[3]} = emu::shared_array<{m[1]} {m[3]}>({next(declarations)});"
        ),
        src,
    )
    assert count and "__shared__" not in src, "a __shared__ declaration the emulator cannot read"
    out, pos, launches = [], 0, 0
    while True:
        i = src.find("<<<", pos)
        if i < 0:
            break
        stmt = max(src.rfind(c, 0, i) for c in ";{}") + 1
        j = src.index(">>>", i)
        end = _find_launch_end(src, j + 3)
        kernel = src[stmt:i].strip()
        config = src[i + 3 : j]
        args = src[j + 4 : end - 2]
        indent = src[stmt:i][: len(src[stmt:i]) - len(src[stmt:i].lstrip())]
        out.append(src[pos:stmt])
        out.append(f"{indent}emu::launch({config}, [&]() {{ {kernel}({args}); }});")
        pos = end
        launches += 1
    assert launches == 1, (
        f"expected the one launch statement of trie_reduce_cuda.cu (enqueue), found {launches}"
    )
    out.append(src[pos:])
    return "".join(out)


@functools.cache
def build_emulator(build_dir: str) -> str:
    cxx = shutil.which("g++") or shutil.which("c++")
    includes = cuda_include_dirs()
    if cxx is None or includes is None:
        pytest.skip("needs g++ and the CUDA toolkit's headers (nvcc on PATH)")
    with open(CU) as f:
        src = emulated_source(f.read())
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, "emulated.cu.h"), "w") as f:
        f.write(src)
    main = os.path.join(build_dir, "harness.cpp")
    with open(main, "w") as f:
        f.write(HARNESS.replace("EMULATED_SOURCE", "emulated.cu.h"))
    exe = os.path.join(build_dir, "trie_reduce_cuda_emulated")
    cmd = [
        cxx,
        "-std=c++20",
        "-O1",
        "-g",
        "-pthread",
        "-fsanitize=address,undefined",
        "-fno-sanitize-recover=undefined",
        "-fno-omit-frame-pointer",
        *(f"-I{d}" for d in includes),
        f"-I{os.path.dirname(CU)}",
        f"-I{build_dir}",
        main,
        "-o",
        exe,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return exe


def run_emulated(
    exe,
    tmp_dir,
    values: torch.Tensor,
    layout,
    reduction: str,
    mode: str = "without_eos",
    max_grid_y: int = 65535,
    tile: int | None = None,
    span_narrow: int | None = None,
    span_warp: int | None = None,
    stage: bool = True,
    column_leaf: np.ndarray | None = None,
    row_pass_blocks: int = 0,
):
    """(launch status, emulator errors, launches, result, scratch): the CUDA kernels' result
    for ``values`` (what cuda_backend.trie_reduce would return) and their per-row scratch
    (log_mass: the row max and log(sum exp(x - max)) in its last two columns). Spanning
    nodes [0, ``span_narrow``) are narrow (a thread each), [``span_narrow``, ``span_warp``)
    the span pass's warp-per-node path, the rest a block each (default: the layout's
    splits). The staging workspace is given as the binding gives it (B >= 8: a
    NaN-filled copy's worth), unless ``stage`` is False (the kernels then gather from the
    input rows, as below 8 rows);
    ``column_leaf`` (each column's leaf position, -1 for none) is built here from the
    layout unless given. ``row_pass_blocks`` (> 0) is the number of blocks the row pass aims
    at (on a GPU: one wave of them; here 1024 by default)."""
    ml = layout.modes[mode]
    tile = ml.tile if tile is None else tile
    span_narrow = span_class_end(ml, SPAN_NARROW_TILES) if span_narrow is None else span_narrow
    span_warp = span_class_end(ml, SPAN_WARP_TILES) if span_warp is None else span_warp
    values = values.contiguous()
    B, C = values.shape
    out_double = values.dtype == torch.float64 and reduction != "log_mass"
    stride = ml.num_scratch + 2
    out = np.full((B, layout.num_nodes), np.nan, dtype=np.float64 if out_double else np.float32)
    scratch = np.full((B, stride), np.nan)
    raw = (
        values.view(torch.int16).numpy()
        if values.dtype in (torch.float16, torch.bfloat16)
        else values.numpy()
    )
    staged = (
        np.full(raw.shape, np.nan if raw.dtype.kind == "f" else -1, dtype=raw.dtype)
        if B >= STAGE_MIN_ROWS and stage
        else raw[:0]
    )  # int16 -1: a NaN in float16, bfloat16
    header = np.array(
        [
            DTYPES[values.dtype],
            B,
            C,
            layout.num_nodes,
            stride,
            tile,
            int(out_double),
            REDUCTION[reduction],
            row_pass_blocks,
            max_grid_y,
            span_narrow,
            span_warp,
        ],
        dtype=np.int64,
    )
    if column_leaf is None:
        column_leaf = np.full(layout.num_columns, -1, dtype=np.int32)
        column_leaf[ml.leaf_token] = np.arange(len(ml.leaf_token), dtype=np.int32)
    arrays = [
        raw,
        staged,
        ml.leaf_token,
        np.asarray(column_leaf, dtype=np.int32),
        ml.tile_node_lo,
        ml.tile_run_ptr,
        ml.run_bounds,
        ml.node_src,
        ml.tile_scratch_ptr,
        ml.scratch_src,
        ml.scratch_slot,
        ml.span_node,
        ml.span_left,
        ml.span_right,
        ml.span_tile_lo,
        ml.span_tile_hi,
        scratch,
        out,
    ]
    path_in = os.path.join(tmp_dir, "in.bin")
    path_out = os.path.join(tmp_dir, "out.bin")
    with open(path_in, "wb") as f:
        f.write(header.tobytes())
        for a in arrays:
            b = np.ascontiguousarray(a).tobytes()
            f.write(np.int64(len(b)).tobytes())
            f.write(b)
    env = dict(
        os.environ,
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=0",
        UBSAN_OPTIONS="print_stacktrace=1",
    )
    proc = subprocess.run(
        [exe, path_in, path_out], capture_output=True, text=True, timeout=600, env=env, check=False
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "EMULATOR ERROR" not in proc.stderr, proc.stderr
    with open(path_out, "rb") as f:
        status, errors, launches = np.frombuffer(f.read(24), dtype=np.int64)
        got = np.frombuffer(f.read(out.nbytes), dtype=out.dtype).reshape(out.shape)
        scratch = np.frombuffer(f.read(scratch.nbytes), dtype=np.float64).reshape(scratch.shape)
    return int(status), int(errors), int(launches), got, scratch


def reference(values, layout, reduction, mode="without_eos"):
    out, _ = dispatch.trie_reduce(
        values.double() if values.dtype != torch.float64 else values,
        layout,
        reduction,
        mode=mode,
        backend="reference",
    )
    return out.numpy()


def assert_matches(got, want, reduction, label=""):
    """Same -inf/0 pattern; max exact, sums (double accumulation) to ~1 float ulp, log-masses
    (float arithmetic: log-probabilities, exp, log, the shift) to a few float ulps of
    max(1, |value|): 50x inside the design's 1e-4."""
    assert not np.isnan(got).any(), f"{label}: NaN (a node never written, or a bad lse)"
    got = got.astype(np.float64)
    if reduction == "max":
        np.testing.assert_array_equal(
            got,
            want.astype(got.dtype if got.dtype == want.dtype else np.float32).astype(np.float64),
            err_msg=label,
        )
        return
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=label)
    fin = np.isfinite(want)
    if reduction == "sum":
        np.testing.assert_allclose(got[fin], want[fin], rtol=3e-7, atol=0, err_msg=label)
    else:
        err = np.abs(got[fin] - want[fin]) / np.maximum(1.0, np.abs(want[fin]))
        assert err.max(initial=0) <= 2e-6, f"{label}: log-mass error {err.max():.3g}"


def make_trie(words, eos=()):
    vocab = [Token(i, w) for i, w in enumerate(words)]
    return TokenByteTrie(
        vocab, device="cpu", eos_byte_strings=list(eos), cache=False, kernel_backend="reference"
    )


def make_values(rng, B, C, reduction, spread=10.0, neg_inf=0.0, dtype=torch.float32):
    if reduction == "log_mass":
        rows = rng.standard_normal((B, C)) * spread
    elif reduction == "sum":
        rows = rng.random((B, C)) ** 8
        rows[rng.random((B, C)) < 0.1] = 0.0
    else:
        rows = rng.standard_normal((B, C)) * 5
    if neg_inf and reduction != "sum":
        rows[rng.random((B, C)) < neg_inf] = -np.inf
        rows[:, 0] = 0.0  # a normalisable row
    return torch.from_numpy(rows).to(dtype)


def check(
    emulator,
    tmp_path,
    words,
    reduction,
    *,
    B=3,
    extra=0,
    eos=(),
    spread=10.0,
    neg_inf=0.0,
    dtype=torch.float32,
    seed=0,
    max_grid_y=65535,
    rows=None,
    stage=True,
):
    trie = make_trie(words, eos)
    layout = trie.layout
    rng = np.random.default_rng(seed)
    C = layout.num_columns + extra
    x = rows if rows is not None else make_values(rng, B, C, reduction, spread, neg_inf, dtype)
    modes = ["without_eos"] + (["with_eos"] if "with_eos" in layout.modes and eos else [])
    for mode in modes:
        status, errors, launches, got, _ = run_emulated(
            emulator, str(tmp_path), x, layout, reduction, mode, max_grid_y, stage=stage
        )
        assert status == 0, f"launch failed with cudaError {status}"
        assert errors == 0
        want = reference(x, layout, reduction, mode)
        assert_matches(got, want, reduction, f"{reduction}/{mode}/{dtype}")
    return launches


def staged_and_not(emulator, tmp_path, x, layout, reduction, label, **kwargs):
    """The kernels on ``x`` staged and not (without the workspace, they gather from the input
    rows), each result checked against the reference: {stage: (launches, result,
    scratch)}."""
    want = reference(x, layout, reduction)
    runs = {}
    for stage in (True, False):
        status, errors, launches, got, scratch = run_emulated(
            emulator, str(tmp_path), x, layout, reduction, stage=stage, **kwargs
        )
        assert status == 0 and errors == 0
        assert_matches(got, want, reduction, f"{label}/stage={stage}")
        runs[stage] = (launches, got, scratch)
    return runs


def use_emulated_binding(monkeypatch, emulator, tmp_path, layout):
    """The CUDA extension replaced by the emulated kernels, for ``layout``: the real
    cuda_backend runs as on a GPU and its arguments reach the emulator (its column_leaf,
    the mode whose leaf_token it passes); scratch is filled in place as the binding does."""
    from genlm_fast.ops import extension

    class EmulatedBinding:
        @staticmethod
        def trie_reduce_cuda(values, leaf_token, column_leaf, *args):
            scratch, reduction = args[14], args[15]
            mode = next(
                m
                for m, ml in layout.modes.items()
                if np.array_equal(ml.leaf_token, leaf_token.numpy())
            )
            status, errors, _, out, filled = run_emulated(
                emulator,
                str(tmp_path),
                values,
                layout,
                reduction,
                mode=mode,
                column_leaf=column_leaf.numpy(),
            )
            assert status == 0 and errors == 0
            scratch.copy_(torch.from_numpy(filled.copy()))
            return torch.from_numpy(out.copy())

    monkeypatch.setattr(extension, "has", lambda kind: kind == "cuda")
    monkeypatch.setattr(extension, "load_module", lambda: EmulatedBinding)
    # "auto" takes the CUDA backend; an explicit one (the tests' reference) is kept
    real_resolve = dispatch.resolve_backend
    monkeypatch.setattr(
        dispatch,
        "resolve_backend",
        lambda backend, device, reduction: (
            "cuda" if backend == "auto" else real_resolve(backend, device, reduction)
        ),
    )
