// Native paged gather/scatter between a pdkv KVLayout buffer and the canonical
// wire chunk [layers, kv, tokens, heads, head_dim].
//
// Why native: the torch path (pdkv/layout.py) does one advanced-indexing read
// plus one permuted copy per layer, i.e. temporaries and ~2 passes over the
// data. Here every byte is moved once with memcpy over the longest runs the
// layout allows, split across up to torch.get_num_threads() threads (see Job
// below for why not an OpenMP region). The copy only moves bytes (element
// size from the dtype), so every dtype gives bit-identical results to the
// torch oracle.
//
// With a checksum (pdkv_kvcopy_sum_cpu) the copy also hashes the chunk it
// writes or reads (the staged frame's checksum, kvsum.h) in the same pass:
// each contiguous run is summed row by row as it is moved (a 4 KiB row is
// loaded once and stays in L1 for its copy), so the checksum costs close to
// nothing on top of the copy instead of a second read of the chunk.
//
// Safety: pdkv/native.py validates tensors with layout.py's checks and
// derives the geometry from them before calling in; everything here that
// decides an address is checked again (sizes positive, the geometry's kind,
// the block table long enough, every block id used in range) so a bad call
// returns an error instead of reading or writing out of bounds.
//
// A plain C ABI (kvcopy.h), no torch headers: built at install time by
// setup.py with the system compiler, loaded with ctypes.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvcopy.h"
#include "kvsum.h"
#include "workshare.h"

namespace pdkv {
namespace {

// Work a thread takes at a time: big enough to amortise the shared counter,
// small enough that a 256-token chunk still spreads over every thread.
constexpr int64_t kGrainBytes = 256 * 1024;

// Chunk tokens [t0, t0 + n) that sit in one block at offsets [off, off + n).
struct Run {
  int64_t t0;
  int64_t block;
  int64_t off;
  int64_t n;
};

struct Plan {
  KVGeometry g;
  std::vector<char*> layer_bases;  // base address of each layer's [blocks, ...] view
};

// An argument error: code PDKV_EINDEX or PDKV_EVALUE and its message.
struct ArgError : std::runtime_error {
  ArgError(int code_, const std::string& what) : std::runtime_error("pdkv kvcopy: " + what), code(code_) {}
  int code;
};

void check_geometry(const KVGeometry& g) {
  if (g.layers <= 0 || g.heads <= 0 || g.head_dim <= 0 || g.tokens < 0) {
    throw ArgError(PDKV_EVALUE, "the chunk shape has an empty layers, heads or head_dim axis");
  }
  if (g.kv != 1 && g.kv != 2) throw ArgError(PDKV_EVALUE, "kv must be 1 (MLA) or 2 (K and V), got " + std::to_string(g.kv));
  if (g.block_size <= 0) throw ArgError(PDKV_EVALUE, "block_size must be positive, got " + std::to_string(g.block_size));
  if (g.start < 0) throw ArgError(PDKV_EVALUE, "start must be non-negative, got " + std::to_string(g.start));
  if (g.element_size <= 0 || g.block_stride <= 0 || g.kv_stride <= 0 || g.token_stride <= 0 || g.head_stride <= 0) {
    throw ArgError(PDKV_EVALUE, "element size and strides must be positive");
  }
}

// Split the token range into per-block runs, bounds checking every block id
// the range touches (and only those, like the torch path).
std::vector<Run> make_runs(const KVGeometry& g, const int64_t* ids, int64_t table_len, int64_t num_blocks) {
  check_geometry(g);
  const int64_t end = g.start + g.tokens;
  const int64_t needed = g.tokens ? (end + g.block_size - 1) / g.block_size : 0;
  if (table_len < needed) {
    throw ArgError(PDKV_EINDEX, "block table has " + std::to_string(table_len) + " blocks, tokens up to " + std::to_string(end) + " need " +
                                    std::to_string(needed) + " (block size " + std::to_string(g.block_size) + ")");
  }
  std::vector<Run> runs;
  runs.reserve(g.tokens / g.block_size + 2);
  for (int64_t pos = g.start; pos < end;) {
    const int64_t index = pos / g.block_size;
    const int64_t off = pos % g.block_size;
    const int64_t block = ids[index];
    if (block < 0 || block >= num_blocks) {
      throw ArgError(PDKV_EINDEX, "block id " + std::to_string(block) + " at block table index " + std::to_string(index) +
                                      " is out of range [0, " + std::to_string(num_blocks) + ")");
    }
    const int64_t n = std::min(g.block_size - off, end - pos);
    runs.push_back(Run{pos - g.start, block, off, n});
    pos += n;
  }
  return runs;
}

int report(const ArgError& e, char* err, size_t err_len) {
  if (err && err_len) std::snprintf(err, err_len, "%s", e.what());
  return e.code;
}

inline void move_bytes(bool to_chunk, char* buf, char* chk, size_t n) {
  if (to_chunk) {
    std::memcpy(chk, buf, n);
  } else {
    std::memcpy(buf, chk, n);
  }
}

// One copy on the CPU: one task per (layer, kv, run). In NHD (and MLA) a run
// is one contiguous range on both sides; in HND each (token, head) row of
// head_dim elements is. Threads share the tasks in batches of ~kGrainBytes
// (workshare.h). With `hash`, each task also returns the checksum
// accumulator's part from the chunk bytes it moved (the whole chunk is one
// unit); its runs start at multiples of token_bytes, which the caller checks
// are whole words.
struct Job {
  Job(Plan plan_, std::vector<Run> runs_, char* chunk_, bool to_chunk_, bool hash_)
      : plan(std::move(plan_)),
        runs(std::move(runs_)),
        chunk(chunk_),
        to_chunk(to_chunk_),
        hash(hash_),
        cut(plan.g.layers * plan.g.kv * plan.g.tokens * plan.g.heads * plan.g.head_dim * plan.g.element_size) {
    const KVGeometry& g = plan.g;
    num_runs = static_cast<int64_t>(runs.size());
    tasks = g.layers * g.kv * num_runs;
    row_bytes = g.head_dim * g.element_size;
    token_bytes = g.heads * row_bytes;
    runs_contiguous = g.token_stride == g.heads * g.head_dim && (g.heads == 1 || g.head_stride == g.head_dim);
    batch = std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(1, token_bytes * g.block_size));
  }

  uint64_t copy_task(int64_t i) const {
    const KVGeometry& g = plan.g;
    const int64_t E = g.element_size;
    const Run& run = runs[i % num_runs];
    const int64_t lk = i / num_runs;  // layer * kv + k: also the chunk's leading index
    const int64_t l = lk / g.kv;
    const int64_t k = lk % g.kv;
    char* buf = plan.layer_bases[l] + (run.block * g.block_stride + k * g.kv_stride + run.off * g.token_stride) * E;
    char* chk = chunk + (lk * g.tokens + run.t0) * token_bytes;
    const int64_t len = run.n * token_bytes;
    if (runs_contiguous) {
      if (hash) return hash_range<true>(cut, 0, chk - chunk, to_chunk ? buf : chk, to_chunk ? chk : buf, len);
      move_bytes(to_chunk, buf, chk, static_cast<size_t>(len));
      return 0;
    }
    switch (row_bytes) {  // head_dim 128 in 16-bit and 32-bit dtypes
      case 256:
        copy_rows<256>(buf, chk, run.n);
        break;
      case 512:
        copy_rows<512>(buf, chk, run.n);
        break;
      default:
        copy_rows<0>(buf, chk, run.n);
    }
    // HND: the run's chunk bytes are one range, just written or read row by row: hashed while still in cache.
    return hash ? hash_range<false>(cut, 0, chk - chunk, chk, nullptr, len) : 0;
  }

  // HND: one row of head_dim elements per (token, head). A compile-time row
  // size (kRowBytes > 0) lets the compiler inline each copy as vector moves
  // instead of a memcpy call per row: ~8% on the bf16 head_dim-128 gather.
  template <int64_t kRowBytes>
  void copy_rows(char* buf, char* chk, int64_t n) const {
    const KVGeometry& g = plan.g;
    const int64_t E = g.element_size;
    const size_t row = static_cast<size_t>(kRowBytes > 0 ? kRowBytes : row_bytes);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t h = 0; h < g.heads; ++h) {
        move_bytes(to_chunk, buf + (j * g.token_stride + h * g.head_stride) * E, chk + j * token_bytes + h * row_bytes, row);
      }
    }
  }

  const Plan plan;
  const std::vector<Run> runs;
  char* const chunk;
  const bool to_chunk;
  const bool hash;
  const Cut cut;
  int64_t num_runs, tasks, row_bytes, token_bytes, batch;
  bool runs_contiguous;
};

// The copy; with `sum`, the chunk's checksum accumulator into *sum as well (in the same pass where every run
// starts on a whole word, else in a second one over the chunk).
void copy_cpu(Plan plan, std::vector<Run> runs, char* chunk, bool to_chunk, int64_t threads, uint64_t* sum) {
  const int64_t token_bytes = plan.g.heads * plan.g.head_dim * plan.g.element_size;
  const bool fused = sum != nullptr && token_bytes % Cut(plan.g.layers * plan.g.kv * plan.g.tokens * token_bytes).word == 0;
  auto job = std::make_shared<const Job>(std::move(plan), std::move(runs), chunk, to_chunk, fused);
  auto acc = std::make_shared<std::atomic<uint64_t>>(0);
  share_work(job->tasks, job->batch, threads, [job, acc](int64_t begin, int64_t end) {
    uint64_t part = 0;
    for (int64_t i = begin; i < end; ++i) part += job->copy_task(i);
    acc->fetch_add(part, std::memory_order_relaxed);
  });
  if (sum == nullptr) return;
  *sum = fused ? acc->load() : hash_segments(job->cut, 0, {Segment{chunk, 0, job->cut.unit}}, threads);
}

int kvcopy(const KVGeometry* g, char* const* layer_bases, const int64_t* block_table, int64_t table_len, int64_t num_blocks, char* chunk,
           int to_chunk, int64_t threads, uint64_t* sum, char* err, size_t err_len) {
  try {
    if (sum != nullptr) *sum = 0;
    std::vector<Run> runs = make_runs(*g, block_table, table_len, num_blocks);
    if (runs.empty()) return PDKV_OK;
    Plan plan{*g, std::vector<char*>(layer_bases, layer_bases + g->layers)};
    copy_cpu(std::move(plan), std::move(runs), chunk, to_chunk != 0, threads, sum);
    return PDKV_OK;
  } catch (const ArgError& e) {
    return report(e, err, err_len);
  } catch (const std::exception& e) {  // std::bad_alloc: nothing may unwind through the C ABI
    return report(ArgError(PDKV_EVALUE, e.what()), err, err_len);
  }
}

}  // namespace
}  // namespace pdkv

PDKV_API int pdkv_kvcopy_check(const pdkv::KVGeometry* g, const int64_t* block_table, int64_t table_len, int64_t num_blocks, char* err,
                               size_t err_len) {
  try {
    pdkv::make_runs(*g, block_table, table_len, num_blocks);
    return PDKV_OK;
  } catch (const pdkv::ArgError& e) {
    return pdkv::report(e, err, err_len);
  } catch (const std::exception& e) {  // std::bad_alloc: nothing may unwind through the C ABI
    return pdkv::report(pdkv::ArgError(PDKV_EVALUE, e.what()), err, err_len);
  }
}

PDKV_API int pdkv_kvcopy_cpu(const pdkv::KVGeometry* g, char* const* layer_bases, const int64_t* block_table, int64_t table_len,
                             int64_t num_blocks, char* chunk, int to_chunk, int64_t threads, char* err, size_t err_len) {
  return pdkv::kvcopy(g, layer_bases, block_table, table_len, num_blocks, chunk, to_chunk, threads, nullptr, err, err_len);
}

PDKV_API int pdkv_kvcopy_sum_cpu(const pdkv::KVGeometry* g, char* const* layer_bases, const int64_t* block_table, int64_t table_len,
                                 int64_t num_blocks, char* chunk, int to_chunk, int64_t threads, uint64_t* sum, char* err, size_t err_len) {
  return pdkv::kvcopy(g, layer_bases, block_table, table_len, num_blocks, chunk, to_chunk, threads, sum, err, err_len);
}
