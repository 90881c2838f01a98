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
// Safety: pdkv/native.py validates arguments with layout.py's checks before
// calling in; everything that decides an address is checked again here
// (shapes, dtypes, contiguity, devices, every block id used) so a bad call
// raises instead of reading or writing out of bounds.
//
// Headers: only what is used (not <torch/extension.h>, which pulls in all of
// libtorch's C++ API) to keep the one-time JIT build short.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "kvcodec.h"
#include "kvcopy.h"
#include "workshare.h"

#ifdef PDKV_WITH_CUDA
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

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
  int64_t num_blocks;
};

// Check every argument that decides an address and derive the strides.
Plan make_plan(const std::vector<at::Tensor>& buffers, int64_t start, const at::Tensor& chunk, bool cross_layer,
               bool hnd, bool mla, int64_t block_size) {
  TORCH_CHECK_VALUE(chunk.dim() == 5 && chunk.is_contiguous(),
                    "pdkv kvcopy: chunk must be a contiguous [layers, kv, tokens, heads, head_dim] tensor, got shape ",
                    chunk.sizes());
  TORCH_CHECK_VALUE(block_size > 0, "pdkv kvcopy: block_size must be positive, got ", block_size);
  TORCH_CHECK_VALUE(start >= 0, "pdkv kvcopy: start must be non-negative, got ", start);
  hnd = hnd && !mla;  // MLA has no heads axis: its order is always token-major
  KVGeometry g{};
  g.layers = chunk.size(0);
  g.kv = chunk.size(1);
  g.tokens = chunk.size(2);
  g.heads = chunk.size(3);
  g.head_dim = chunk.size(4);
  g.block_size = block_size;
  g.start = start;
  g.element_size = static_cast<int64_t>(chunk.element_size());
  TORCH_CHECK_VALUE(g.layers > 0 && g.heads > 0 && g.head_dim > 0, "pdkv kvcopy: chunk shape ", chunk.sizes(),
                    " has an empty layers, heads or head_dim axis");
  TORCH_CHECK_VALUE(g.kv == (mla ? 1 : 2) && (!mla || g.heads == 1),
                    "pdkv kvcopy: chunk shape ", chunk.sizes(), " does not fit ", mla ? "an MLA" : "a K/V",
                    " layout (kv must be ", mla ? "1 with 1 head" : "2", ")");

  const int64_t expected_tensors = cross_layer ? 1 : g.layers;
  TORCH_CHECK_VALUE(static_cast<int64_t>(buffers.size()) == expected_tensors, "pdkv kvcopy: ",
                    cross_layer ? "cross_layer" : "per_layer", " layout needs ", expected_tensors,
                    " buffer tensors, got ", buffers.size());
  TORCH_CHECK_VALUE(buffers[0].dim() > 0, "pdkv kvcopy: buffer tensor 0 is a scalar");
  const int64_t num_blocks = buffers[0].size(0);

  std::vector<int64_t> shape{num_blocks};
  if (cross_layer) shape.push_back(g.layers);
  if (mla) {
    shape.insert(shape.end(), {block_size, g.head_dim});
  } else if (hnd) {
    shape.insert(shape.end(), {2, g.heads, block_size, g.head_dim});
  } else {
    shape.insert(shape.end(), {2, block_size, g.heads, g.head_dim});
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    const at::Tensor& t = buffers[i];
    TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef(shape), "pdkv kvcopy: buffer tensor ", i, " has shape ",
                      t.sizes(), ", expected ", at::IntArrayRef(shape));
    TORCH_CHECK_VALUE(t.scalar_type() == chunk.scalar_type(), "pdkv kvcopy: buffer tensor ", i, " is ",
                      t.scalar_type(), " but the chunk is ", chunk.scalar_type());
    TORCH_CHECK_VALUE(t.is_contiguous(), "pdkv kvcopy: buffer tensor ", i, " is not contiguous");
    TORCH_CHECK_VALUE(t.device() == chunk.device(), "pdkv kvcopy: buffer tensor ", i, " is on ", t.device(),
                      " but the chunk is on ", chunk.device());
  }

  const int64_t per_layer = g.kv * block_size * g.heads * g.head_dim;  // one block of one layer
  g.kv_stride = block_size * g.heads * g.head_dim;
  g.token_stride = hnd ? g.head_dim : g.heads * g.head_dim;
  g.head_stride = hnd ? block_size * g.head_dim : g.head_dim;
  g.block_stride = cross_layer ? g.layers * per_layer : per_layer;

  std::vector<char*> bases(g.layers);
  for (int64_t l = 0; l < g.layers; ++l) {
    bases[l] = cross_layer ? static_cast<char*>(buffers[0].data_ptr()) + l * per_layer * g.element_size
                           : static_cast<char*>(buffers[l].data_ptr());
  }
  return Plan{g, std::move(bases), num_blocks};
}

// Split the token range into per-block runs, bounds checking every block id
// the range touches (and only those, like the torch path).
std::vector<Run> make_runs(const KVGeometry& g, const at::Tensor& block_table, int64_t num_blocks) {
  TORCH_CHECK_VALUE(block_table.dim() == 1 && block_table.scalar_type() == at::kLong && block_table.device().is_cpu(),
                    "pdkv kvcopy: block table must be a 1-D int64 CPU tensor, got ", block_table.sizes(), " ",
                    block_table.scalar_type(), " on ", block_table.device());
  const at::Tensor table = block_table.contiguous();
  const int64_t* ids = table.data_ptr<int64_t>();
  const int64_t end = g.start + g.tokens;
  const int64_t needed = g.tokens ? (end + g.block_size - 1) / g.block_size : 0;
  TORCH_CHECK_INDEX(table.numel() >= needed, "pdkv kvcopy: block table has ", table.numel(),
                    " blocks, tokens up to ", end, " need ", needed, " (block size ", g.block_size, ")");
  std::vector<Run> runs;
  runs.reserve(g.tokens / g.block_size + 2);
  for (int64_t pos = g.start; pos < end;) {
    const int64_t index = pos / g.block_size;
    const int64_t off = pos % g.block_size;
    const int64_t block = ids[index];
    TORCH_CHECK_INDEX(block >= 0 && block < num_blocks, "pdkv kvcopy: block id ", block, " at block table index ",
                      index, " is out of range [0, ", num_blocks, ")");
    const int64_t n = std::min(g.block_size - off, end - pos);
    runs.push_back(Run{pos - g.start, block, off, n});
    pos += n;
  }
  return runs;
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
// (workshare.h).
struct Job {
  Job(Plan plan_, std::vector<Run> runs_, char* chunk_, bool to_chunk_)
      : plan(std::move(plan_)), runs(std::move(runs_)), chunk(chunk_), to_chunk(to_chunk_) {
    const KVGeometry& g = plan.g;
    num_runs = static_cast<int64_t>(runs.size());
    tasks = g.layers * g.kv * num_runs;
    row_bytes = g.head_dim * g.element_size;
    token_bytes = g.heads * row_bytes;
    runs_contiguous = g.token_stride == g.heads * g.head_dim && (g.heads == 1 || g.head_stride == g.head_dim);
    batch = std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(1, token_bytes * g.block_size));
  }

  void copy_task(int64_t i) const {
    const KVGeometry& g = plan.g;
    const int64_t E = g.element_size;
    const Run& run = runs[i % num_runs];
    const int64_t lk = i / num_runs;  // layer * kv + k: also the chunk's leading index
    const int64_t l = lk / g.kv;
    const int64_t k = lk % g.kv;
    char* buf = plan.layer_bases[l] + (run.block * g.block_stride + k * g.kv_stride + run.off * g.token_stride) * E;
    char* chk = chunk + (lk * g.tokens + run.t0) * token_bytes;
    if (runs_contiguous) {
      move_bytes(to_chunk, buf, chk, static_cast<size_t>(run.n * token_bytes));
      return;
    }
    switch (row_bytes) {  // head_dim 128 in 16-bit and 32-bit dtypes
      case 256:
        return copy_rows<256>(buf, chk, run.n);
      case 512:
        return copy_rows<512>(buf, chk, run.n);
      default:
        return copy_rows<0>(buf, chk, run.n);
    }
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
  int64_t num_runs, tasks, row_bytes, token_bytes, batch;
  bool runs_contiguous;
};

// Thread count follows torch.set_num_threads like any other CPU op.
void copy_cpu(Plan plan, std::vector<Run> runs, char* chunk, bool to_chunk) {
  auto job = std::make_shared<const Job>(std::move(plan), std::move(runs), chunk, to_chunk);
  share_work(job->tasks, job->batch, [job](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) job->copy_task(i);
  });
}

#ifdef PDKV_WITH_CUDA
// Widest vector (<= 16 bytes) that every row start is aligned to.
int vector_bytes(const Plan& plan, const char* chunk) {
  uint64_t bits = static_cast<uint64_t>(plan.g.head_dim * plan.g.element_size) | reinterpret_cast<uint64_t>(chunk);
  for (char* base : plan.layer_bases) bits |= reinterpret_cast<uint64_t>(base);
  int width = 16;
  while (width > 1 && (bits % width) != 0) width /= 2;
  return width;
}

void copy_cuda(const Plan& plan, const at::Tensor& block_table, const at::Tensor& chunk, bool to_chunk) {
  const c10::cuda::CUDAGuard guard(chunk.device());
  at::Tensor bases = at::empty({plan.g.layers}, at::TensorOptions().dtype(at::kLong));
  int64_t* base_ids = bases.data_ptr<int64_t>();
  for (int64_t l = 0; l < plan.g.layers; ++l) base_ids[l] = reinterpret_cast<int64_t>(plan.layer_bases[l]);
  // Both uploads and the launch are ordered on the current stream, so the
  // temporaries may be freed (back to the caching allocator) on return.
  const at::Tensor bases_dev = bases.to(chunk.device());
  const at::Tensor table_dev = block_table.contiguous().to(chunk.device());
  char* chunk_ptr = static_cast<char*>(chunk.data_ptr());
  const cudaError_t err =
      launch_kvcopy_cuda(plan.g, bases_dev.data_ptr<int64_t>(), table_dev.data_ptr<int64_t>(), chunk_ptr, to_chunk,
                         vector_bytes(plan, chunk_ptr), c10::cuda::getCurrentCUDAStream(chunk.device().index()).stream());
  TORCH_CHECK(err == cudaSuccess, "pdkv kvcopy: CUDA launch failed: ", cudaGetErrorString(err));
}
#endif

void copy(const std::vector<at::Tensor>& buffers, const at::Tensor& block_table, int64_t start, const at::Tensor& chunk,
          bool cross_layer, bool hnd, bool mla, int64_t block_size, bool to_chunk) {
  Plan plan = make_plan(buffers, start, chunk, cross_layer, hnd, mla, block_size);
  std::vector<Run> runs = make_runs(plan.g, block_table, plan.num_blocks);
  if (runs.empty()) return;
  if (chunk.device().is_cpu()) {
    copy_cpu(std::move(plan), std::move(runs), static_cast<char*>(chunk.data_ptr()), to_chunk);
    return;
  }
#ifdef PDKV_WITH_CUDA
  if (chunk.device().is_cuda()) {
    copy_cuda(plan, block_table, chunk, to_chunk);
    return;
  }
#endif
  TORCH_CHECK_VALUE(false, "pdkv kvcopy: this build has no kernel for device ", chunk.device(),
                    "; use the torch path (pdkv.layout)");
}

void gather(const std::vector<at::Tensor>& buffers, const at::Tensor& block_table, int64_t start, const at::Tensor& out,
            bool cross_layer, bool hnd, bool mla, int64_t block_size) {
  copy(buffers, block_table, start, out, cross_layer, hnd, mla, block_size, /*to_chunk=*/true);
}

void scatter(const std::vector<at::Tensor>& buffers, const at::Tensor& block_table, int64_t start,
             const at::Tensor& chunk, bool cross_layer, bool hnd, bool mla, int64_t block_size) {
  copy(buffers, block_table, start, chunk, cross_layer, hnd, mla, block_size, /*to_chunk=*/false);
}

bool has_cuda() {
#ifdef PDKV_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace pdkv

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pdkv native paged KV gather/scatter (see pdkv/native.py)";
  // The copies release the GIL: sender/receiver threads keep running while a
  // chunk moves.
  m.def("gather", &pdkv::gather, "Copy tokens [start, start+T) of the paged buffer into `out` (canonical chunk).",
        py::arg("buffers"), py::arg("block_table"), py::arg("start"), py::arg("out"), py::arg("cross_layer"),
        py::arg("hnd"), py::arg("mla"), py::arg("block_size"), py::call_guard<py::gil_scoped_release>());
  m.def("scatter", &pdkv::scatter, "Copy a canonical chunk into tokens [start, start+T) of the paged buffer.",
        py::arg("buffers"), py::arg("block_table"), py::arg("start"), py::arg("chunk"), py::arg("cross_layer"),
        py::arg("hnd"), py::arg("mla"), py::arg("block_size"), py::call_guard<py::gil_scoped_release>());
  m.def("has_cuda", &pdkv::has_cuda, "Whether this build includes the CUDA kernel.");
  pdkv::register_codec_ops(m);
}
