// y[m, n] = w[m, k] @ x[k, n] in float32 for few columns n, as an XLA FFI handler for the CPU.
//
// The model's projections multiply a weight matrix w [out, in] (row-major, as stored) by feature-major
// activations x [in, N], N = rows x new tokens. XLA:CPU has a fast matrix-vector path for N = 1 and a general
// GEMM for N >= 2 that repacks w on every call, so a forward over 2-16 tokens costs 2-4 one-token forwards
// although it reads the same weights (docs/cpu-performance.md). This kernel reads every weight once from
// memory for any N, so a forward over a few tokens costs about what a one-token forward costs.
//
// Two loop forms, both reading w in row tiles that stay in L1 while every column of x passes over them:
//   - dot form (few columns): vectors run along k; x is first transposed to xt [N, kp] (kp: k rounded up to
//     16, zero-padded) so a column of x is contiguous. A tile of R rows x C columns keeps R*C accumulators
//     in registers and reduces each to one float at the end. Its FMA count is m*k*N/16: with N <= 8 it
//     does not bound the time, memory does.
//   - broadcast form (more columns): vectors run along N; each w element is broadcast and multiplies a row
//     of x. No transpose, no horizontal sums, but a column block always costs 16 lanes, so it pays once
//     N fills most of a vector; up to 4 columns past the last full vector go through the dot form instead.
// Work is split over `out` rows: the calling thread and tasks on XLA's intra-op thread pool claim chunks of rows
// from an atomic counter, so a task that starts late (or never) costs nothing.
//
// Code paths chosen at run time: AVX-512 (both forms, intrinsics); AVX2+FMA (the portable dot form, and the
// broadcast form in intrinsics); the baseline ISA (the portable dot form alone). The portable dot form is one
// source compiled twice (portable_tiles.inc), and so is the broadcast form (broadcast_tiles.inc, over each ISA's
// vector operations). The FFI attributes `isa` and `form` can force a path.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "xla/ffi/api/ffi.h"

// The x86 SIMD paths use GCC's `#pragma GCC target` to compile one function set per ISA in this file; other
// compilers and CPUs get the portable path only.
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define JAXSPEC_X86 1
#endif

namespace ffi = xla::ffi;

namespace jaxspec_cpu {

// One product and the layouts every kernel reads.
struct Gemm {
  const float* w;   // [m, k] row-major
  const float* x;   // [k, n] row-major (feature-major activations)
  const float* xt;  // [n, kp] x transposed, each row zero-padded to kp (dot forms only)
  float* y;         // [m, n] row-major
  int64_t m, k, n, kp;
};

using RowsFn = void (*)(const Gemm&, int64_t row_begin, int64_t row_end);

// The baseline and AVX2 portable dot forms: the same source compiled for two targets.
namespace generic {
#include "portable_tiles.inc"
}  // namespace generic

#ifdef JAXSPEC_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "portable_tiles.inc"

// ---- broadcast form: R rows x V vectors of 8 columns, vectors along N (intrinsics) ----------------------------

// 6 rows x up to 2 vectors: 12 accumulators + 2 x vectors + a broadcast of the 16 registers. Few rows per tile
// made the dot form lose to XLA from 16 columns on AVX2: every 3-row tile of w re-reads all of x from L2, while
// this tile reads x once per 6 rows and needs no transpose.
constexpr int kBcastRows = 6;
constexpr int kBcastMaxVectors = 2;
// Columns past the last full vector, up to this many, go through the dot form on the same rows of w (in L1),
// 3 rows at a time (the portable dot form's tile: more would spill).
constexpr int kDotRemainder = 4;
constexpr int kRemainderRows = kDotRows;

struct Simd {
  using Vec = __m256;
  using Mask = __m256i;  // the lanes to load and store, as maskload/maskstore want them (sign bit set)
  static constexpr int kLanes = 8;
  static Vec Zero() { return _mm256_setzero_ps(); }
  static Vec Load(const float* p) { return _mm256_loadu_ps(p); }
  static Vec LoadMasked(const float* p, Mask m) { return _mm256_maskload_ps(p, m); }
  static Vec Splat(const float* p) { return _mm256_broadcast_ss(p); }
  static Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static void StoreMasked(float* p, Mask m, Vec v) { _mm256_maskstore_ps(p, m, v); }
  static Mask LastMask(int rest) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(rest), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
};

#include "broadcast_tiles.inc"

}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma")
namespace avx512 {

// ---- dot form: R rows x C columns, vectors along k ----------------------------------------------------------

// 4 rows x up to 6 columns: 24 accumulators + 4 w vectors of the 32 registers. The column tiles over N are
// near-equal: N = 8 runs as 4 + 4, not 6 + 2. (One pass of 2 rows x 8 columns was no faster over the model's
// shapes; 3 x 8 and 2 x 12 spilled registers.)
constexpr int kDotRows = 4;
constexpr int kDotMaxCols = 6;

template <int R, int C>
inline void DotTile(const Gemm& g, int64_t row, int64_t col, const float* next) {
  __m512 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const float* w = g.w + row * g.k;
  const float* xt = g.xt + col * g.kp;
  int64_t i = 0;
  for (; i + 16 <= g.k; i += 16) {
    __m512 wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_ps(w + r * g.k + i);
    if (next != nullptr) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(next + r * g.k + i), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m512 xv = _mm512_load_ps(xt + c * g.kp + i);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(wv[r], xv, acc[r][c]);
    }
  }
  if (i < g.k) {
    // Masked loads: lanes past the end of a w row read nothing. xt's padding is zero, so those lanes add 0.
    const __mmask16 tail = static_cast<__mmask16>((1u << (g.k - i)) - 1);
    __m512 wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_ps(tail, w + r * g.k + i);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m512 xv = _mm512_load_ps(xt + c * g.kp + i);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(wv[r], xv, acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) g.y[(row + r) * g.n + col + c] = _mm512_reduce_add_ps(acc[r][c]);
}

// One row tile against every column tile. While the first column tile streams this tile's rows of w from
// memory, it prefetches the next tile's rows (`next`, or null for the last tile), so memory keeps working
// while the later column tiles compute from L1.
template <int R>
inline void DotRowTile(const Gemm& g, int64_t row, const float* next) {
  // Column tiles of near-equal width, all over the same R rows of w (which stay in L1 meanwhile).
  const int64_t tiles = (g.n + kDotMaxCols - 1) / kDotMaxCols;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t c0 = t * g.n / tiles, c1 = (t + 1) * g.n / tiles;
    const float* pf = t == 0 ? next : nullptr;
    switch (c1 - c0) {
      case 1: DotTile<R, 1>(g, row, c0, pf); break;
      case 2: DotTile<R, 2>(g, row, c0, pf); break;
      case 3: DotTile<R, 3>(g, row, c0, pf); break;
      case 4: DotTile<R, 4>(g, row, c0, pf); break;
      case 5: DotTile<R, 5>(g, row, c0, pf); break;
      default: DotTile<R, 6>(g, row, c0, pf); break;
    }
  }
}

void DotRows(const Gemm& g, int64_t begin, int64_t end) {
  int64_t row = begin;
  for (; row + kDotRows <= end; row += kDotRows) {
    DotRowTile<kDotRows>(g, row, row + 2 * kDotRows <= end ? g.w + (row + kDotRows) * g.k : nullptr);
  }
  switch (end - row) {
    case 3: DotRowTile<3>(g, row, nullptr); break;
    case 2: DotRowTile<2>(g, row, nullptr); break;
    case 1: DotRowTile<1>(g, row, nullptr); break;
    default: break;
  }
}

// ---- broadcast form: R rows x V vectors of 16 columns, vectors along N ---------------------------------------

constexpr int kBcastRows = 6;  // 6 rows x up to 4 vectors: 24 accumulators + 4 x vectors + a broadcast
constexpr int kBcastMaxVectors = 4;
// Columns past the last full vector, up to this many, go through the dot form on the same rows of w (still in
// L1), where a masked vector would cost a whole vector's multiply-adds: with w in cache, 17 and 33 columns then
// cost less over 16 and 32 than with a masked last vector. A dot tile of all 6 rows x 4 columns fits the 32
// registers.
constexpr int kDotRemainder = 4;
constexpr int kRemainderRows = kBcastRows;

struct Simd {
  using Vec = __m512;
  using Mask = __mmask16;
  static constexpr int kLanes = 16;
  static Vec Zero() { return _mm512_setzero_ps(); }
  static Vec Load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec LoadMasked(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
  static Vec Splat(const float* p) { return _mm512_set1_ps(*p); }
  static Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static void StoreMasked(float* p, Mask m, Vec v) { _mm512_mask_storeu_ps(p, m, v); }
  static Mask LastMask(int rest) { return static_cast<Mask>((1u << rest) - 1); }
};

#include "broadcast_tiles.inc"

}  // namespace avx512
#pragma GCC pop_options
#endif  // JAXSPEC_X86

// ---- dispatch -------------------------------------------------------------------------------------------------

enum Isa : int64_t { kIsaAuto = 0, kIsaAvx512 = 1, kIsaAvx2 = 2, kIsaGeneric = 3 };
enum Form : int64_t { kFormAuto = 0, kFormDot = 1, kFormBroadcast = 2 };

// From this many columns on, the AVX-512 broadcast form is faster than the dot form: on thirty [1536, 576]
// products the two tie at 12 columns, the dot form is faster below and the broadcast form above;
// scripts/bench_kernel.py verify-cost prints both forms.
constexpr int64_t kBroadcastFromColumns = 12;
// The same for the AVX2 path (timed on an AVX2-only CPU): the broadcast form is faster from 8 columns.
constexpr int64_t kAvx2BroadcastFromColumns = 8;

bool Supported(int64_t isa) {
#ifdef JAXSPEC_X86
  switch (isa) {
    case kIsaAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("fma");
    case kIsaAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    default:
      return isa == kIsaGeneric;
  }
#else
  return isa == kIsaGeneric;
#endif
}

int64_t BestIsa() {
  static const int64_t best = Supported(kIsaAvx512) ? kIsaAvx512 : Supported(kIsaAvx2) ? kIsaAvx2 : kIsaGeneric;
  return best;
}

// The kernel for an (isa, form) pair; form is resolved from n when auto. The portable paths have the dot form only.
RowsFn Kernel(int64_t isa, int64_t form, int64_t n, bool* needs_transpose) {
#ifdef JAXSPEC_X86
  if (isa == kIsaAvx512) {
    const bool bcast = form == kFormBroadcast || (form == kFormAuto && n >= kBroadcastFromColumns);
    *needs_transpose = !bcast || avx512::BcastNeedsTranspose(n);
    return bcast ? avx512::BcastRows : avx512::DotRows;
  }
  if (isa == kIsaAvx2) {
    const bool bcast = form == kFormBroadcast || (form == kFormAuto && n >= kAvx2BroadcastFromColumns);
    *needs_transpose = !bcast || avx2::BcastNeedsTranspose(n);
    return bcast ? avx2::BcastRows : avx2::DotRows;
  }
#endif
  *needs_transpose = true;
  return generic::DotRows;
}

// ---- threads --------------------------------------------------------------------------------------------------

// A product split into chunks of rows. Whoever holds a reference claims chunks until none is left; the caller
// waits only for chunks already claimed, so a helper that comes late finds nothing to do and touches no buffer
// (it may hold the job past the call: it owns a reference to the job, not to the buffers).
struct Job {
  Gemm g;
  RowsFn rows;
  int64_t chunk_rows, chunks;
  std::atomic<int64_t> next{0}, done{0};

  // Claims and runs chunks until none is left; returns how many this thread ran.
  int64_t Work() {
    int64_t ran = 0;
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks; ++ran) {
      rows(g, c * chunk_rows, std::min(g.m, (c + 1) * chunk_rows));
      done.fetch_add(1, std::memory_order_release);
    }
    return ran;
  }
};

// Below this many multiply-adds a product runs on the calling thread alone.
constexpr int64_t kMinParallelFlops = int64_t{1} << 18;

// Chunks are whole row tiles of both forms (4 and 6 rows), and several per thread, so a helper that joins
// late still takes a share.
constexpr int64_t kChunkAlign = 24;

// Helpers are tasks on XLA's own intra-op thread pool (the FFI `ThreadPool`), whose workers are the threads
// that run the model's other operations and poll for work between them, so a task starts within microseconds
// on an idle core. Helper threads of this library's own (one per further core, polling after each job) do
// worse: inside a model forward XLA's workers hold the other cores, such a helper seldom gets one, and a
// forward runs as on one thread (docs/cpu-performance.md compares the two). Chunks are small (a quarter of a thread's share), so a
// task that starts late still takes some.
void Run(const Gemm& g, RowsFn rows, int64_t threads, ffi::ThreadPool* pool) {
  int64_t helpers = threads == 1 || g.m * g.k * g.n < kMinParallelFlops ? 0 : pool->num_threads() - 1;
  if (threads > 1) helpers = std::min(helpers, threads - 1);
  if (helpers <= 0) {
    rows(g, 0, g.m);
    return;
  }
  auto job = std::make_shared<Job>();
  job->g = g;
  job->rows = rows;
  const int64_t per_chunk = (g.m + 4 * (helpers + 1) - 1) / (4 * (helpers + 1));
  job->chunk_rows = std::max<int64_t>(kChunkAlign, (per_chunk + kChunkAlign - 1) / kChunkAlign * kChunkAlign);
  job->chunks = (g.m + job->chunk_rows - 1) / job->chunk_rows;
  // A task holds the job, not the buffers: one that starts after the product is done finds no chunk left. Where
  // XLA has no pool, Schedule runs the task at once on this thread, which then does every chunk itself.
  for (int64_t h = 0; h < helpers; ++h) pool->Schedule([job] { job->Work(); });
  job->Work();
  // Only chunks a task already claimed remain: a task descheduled while holding one delays the product by its
  // chunk, never more (a back-off to the calling thread alone after such delays made a forward run as on one
  // thread whenever a task started late: c(2) 1.5 instead of 1.2 at batch 1).
  while (job->done.load(std::memory_order_acquire) < job->chunks) std::this_thread::yield();
}

// xt [n, kp] for the dot forms: a per-thread buffer, 64-byte aligned rows, grown as needed and reused.
float* Transposed(const Gemm& g) {
  struct Buffer {
    float* data = nullptr;
    size_t size = 0;
    ~Buffer() { std::free(data); }
  };
  thread_local Buffer buffer;
  const size_t need = static_cast<size_t>(g.n * g.kp);
  if (need > buffer.size) {
    std::free(buffer.data);
    buffer.data = static_cast<float*>(std::aligned_alloc(64, need * sizeof(float)));
    buffer.size = buffer.data ? need : 0;
  }
  float* xt = buffer.data;
  if (xt == nullptr) return nullptr;
  for (int64_t c = 0; c < g.n; ++c) {
    float* row = xt + c * g.kp;
    for (int64_t i = 0; i < g.k; ++i) row[i] = g.x[i * g.n + c];
    std::fill(row + g.k, row + g.kp, 0.0f);
  }
  return xt;
}

std::string Shape(ffi::Buffer<ffi::F32>::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

ffi::Error SmallMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> x,
                       ffi::ResultBuffer<ffi::F32> y, int64_t isa, int64_t form, int64_t threads) {
  const auto wd = w.dimensions(), xd = x.dimensions(), yd = y->dimensions();
  if (wd.size() != 2 || xd.size() != 2 || yd.size() != 2 || wd[1] != xd[0] || yd[0] != wd[0] ||
      yd[1] != xd[1]) {
    return ffi::Error::InvalidArgument("jaxspec_small_matmul: expected w [m, k], x [k, n] -> y [m, n]; got w " +
                                       Shape(wd) + ", x " + Shape(xd) + ", y " + Shape(yd));
  }
  if (isa == kIsaAuto) isa = BestIsa();
  if (isa < kIsaAvx512 || isa > kIsaGeneric || !Supported(isa)) {
    return ffi::Error::InvalidArgument("jaxspec_small_matmul: isa " + std::to_string(isa) +
                                       " is not available on this CPU");
  }
  if (form < kFormAuto || form > kFormBroadcast || (form == kFormBroadcast && isa == kIsaGeneric)) {
    return ffi::Error::InvalidArgument("jaxspec_small_matmul: form " + std::to_string(form) +
                                       " is not available for isa " + std::to_string(isa));
  }
  if (threads < 0) return ffi::Error::InvalidArgument("jaxspec_small_matmul: threads must be >= 0");
  Gemm g{w.typed_data(), x.typed_data(), nullptr, y->typed_data(), wd[0], wd[1], xd[1], (wd[1] + 15) / 16 * 16};
  if (g.m == 0 || g.n == 0) return ffi::Error::Success();
  if (g.k == 0) {
    std::fill(g.y, g.y + g.m * g.n, 0.0f);
    return ffi::Error::Success();
  }
  bool needs_transpose = false;
  const RowsFn rows = Kernel(isa, form, g.n, &needs_transpose);
  if (needs_transpose && (g.xt = Transposed(g)) == nullptr) {
    return ffi::Error::Internal("jaxspec_small_matmul: out of memory for the transposed activations");
  }
  Run(g, rows, threads, &pool);
  return ffi::Error::Success();
}

}  // namespace jaxspec_cpu

// The library is built with -fvisibility=hidden; these are the symbols jaxspec.kernels.cpu looks up.
#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecSmallMatmul, jaxspec_cpu::SmallMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("isa")
                                  .Attr<int64_t>("form")
                                  .Attr<int64_t>("threads"));

// The code path `isa` = 0 picks on this CPU (1 AVX-512, 2 AVX2, 3 baseline), for jaxspec.kernels.cpu.isa().
extern "C" int64_t JaxspecSmallMatmulBestIsa() {
  return jaxspec_cpu::BestIsa();
}

// The hash of the sources (and jaxlib) this library was built from; the loader refuses any other.
extern "C" const char* JaxspecSmallMatmulSourceHash() {
  return JAXSPEC_SOURCE_HASH;
}

#pragma GCC visibility pop
