// CUDA implementations of the nereus ops (hipified by PyTorch's extension builder on ROCm).
// Joins the build only where PyTorch is a CUDA/ROCm build and a device compiler exists.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../slices.h"

namespace nereus {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kTileElements = 1 << 14;  // per block of the checksum
constexpr int64_t kChunkBytes = 1 << 16;     // per block of pack/unpack
constexpr int64_t kMaxBlocks = 1 << 16;

// Grid-stride over the tiles of geometry.h; each block sums its tiles' terms, then adds its sum
// to `out` (wrapping modulo 2**64, as the CPU sum does).
template <typename Bits>
__global__ void checksum_kernel(const Bits* data, Geometry g, Tiling tiling, unsigned long long* out) {
  __shared__ unsigned long long partial[kThreads];
  uint64_t sum = 0;
  for (int64_t t = blockIdx.x; t < tiling.count; t += gridDim.x) {
    const Tile tile = tile_at(g, tiling, t);
    if (tile.nrows == 1) {
      const uint64_t start = static_cast<uint64_t>(row_start(g, tile.row) + tile.col);
      const Bits* row = data + tile.row * g.cols + tile.col;
      for (int64_t j = threadIdx.x; j < tile.ncols; j += blockDim.x) {
        sum += checksum_term(start + static_cast<uint64_t>(j), static_cast<uint64_t>(row[j]));
      }
    } else {  // whole short rows: elements of the tile, row by row
      const int64_t n = tile.nrows * g.cols;
      const Bits* first = data + tile.row * g.cols;
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const int64_t r = i / g.cols, j = i - r * g.cols;
        const uint64_t index = static_cast<uint64_t>(row_start(g, tile.row + r) + j);
        sum += checksum_term(index, static_cast<uint64_t>(first[i]));
      }
    }
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int step = blockDim.x / 2; step > 0; step /= 2) {
    if (threadIdx.x < step) partial[threadIdx.x] += partial[threadIdx.x + step];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(out, partial[0]);
}

int64_t checksum_cuda(const at::Tensor& data, at::IntArrayRef global_shape, at::IntArrayRef global_offset) {
  const c10::cuda::CUDAGuard guard(data.device());
  const at::Tensor t = data.contiguous();
  const Geometry g = geometry_of(t, global_shape, global_offset);
  if (t.numel() == 0) return 0;
  const Tiling tiling = make_tiling(g, kTileElements);
  at::Tensor out = at::zeros({1}, t.options().dtype(at::kLong));
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(tiling.count, kMaxBlocks));
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto* result = reinterpret_cast<unsigned long long*>(out.data_ptr<int64_t>());
  switch (t.element_size()) {
    case 1: checksum_kernel<uint8_t><<<blocks, kThreads, 0, stream>>>(static_cast<const uint8_t*>(t.data_ptr()), g, tiling, result); break;
    case 2: checksum_kernel<uint16_t><<<blocks, kThreads, 0, stream>>>(static_cast<const uint16_t*>(t.data_ptr()), g, tiling, result); break;
    case 4: checksum_kernel<uint32_t><<<blocks, kThreads, 0, stream>>>(static_cast<const uint32_t*>(t.data_ptr()), g, tiling, result); break;
    case 8: checksum_kernel<uint64_t><<<blocks, kThreads, 0, stream>>>(static_cast<const uint64_t*>(t.data_ptr()), g, tiling, result); break;
    default: TORCH_CHECK(false, "checksum: unsupported element size ", t.element_size());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out.item<int64_t>();
}

// One descriptor per chunk of geometry.h (a block each): the chunk's runs, where they are in the
// tensor and in the buffer, and the widest word (16, 8, 4, 2 or 1 bytes) every address and length
// of the chunk is aligned to.
struct Run {
  uint8_t* tensor;
  uint8_t* buffer;  // the chunk's first run's bytes in the buffer
  int64_t stride;   // bytes between the chunk's runs in the tensor
  int64_t block;    // bytes between them in the buffer
  int32_t nruns;
  int32_t words;    // per run
  int32_t unit;
};

template <typename Word, bool kPack>
__device__ __forceinline__ void copy_word(const Run& r, int32_t run, int32_t w) {
  Word* t = reinterpret_cast<Word*>(r.tensor + run * r.stride) + w;
  Word* b = reinterpret_cast<Word*>(r.buffer + run * r.block) + w;
  if (kPack) {
    *b = *t;
  } else {
    *t = *b;
  }
}

template <typename Word, bool kPack>
__device__ __forceinline__ void copy_words(const Run& r) {
  if (r.nruns == 1) {
    for (int32_t w = threadIdx.x; w < r.words; w += blockDim.x) copy_word<Word, kPack>(r, 0, w);
    return;
  }
  const int32_t total = r.nruns * r.words;  // a chunk holds at most kChunkBytes
  for (int32_t i = threadIdx.x; i < total; i += blockDim.x) {
    const int32_t run = i / r.words;
    copy_word<Word, kPack>(r, run, i - run * r.words);
  }
}

template <bool kPack>
__global__ void copy_kernel(const Run* runs) {
  const Run r = runs[blockIdx.x];
  switch (r.unit) {
    case 16: copy_words<uint4, kPack>(r); break;
    case 8: copy_words<uint2, kPack>(r); break;
    case 4: copy_words<uint32_t, kPack>(r); break;
    case 2: copy_words<uint16_t, kPack>(r); break;
    default: copy_words<uint8_t, kPack>(r); break;
  }
}

int32_t widest_word(std::initializer_list<uint64_t> values) {
  int32_t unit = 16;
  for (uint64_t v : values) {
    while (unit > 1 && v % unit) unit /= 2;
  }
  return unit;
}

// Validation is done (plan_*); this only checks devices, before any byte is written, then
// launches one kernel for every chunk of every slice. Stream-ordered like any torch op: the
// descriptors go up from pageable memory, which the copy reads before it returns.
template <bool kPack>
void launch(const std::vector<at::Tensor>& tensors, const std::vector<Slice>& plan, at::Tensor& buffer) {
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.device() == buffer.device(), kPack ? "pack" : "unpack", ": every tensor must be on the buffer's device (",
                buffer.device(), "), not ", t.device());
  }
  const std::vector<Chunk> chunks = chunk_plan(plan, kChunkBytes);
  if (chunks.empty()) return;
  std::vector<Run> host;
  host.reserve(chunks.size());
  uint8_t* base = buffer.data_ptr<uint8_t>();
  for (const Chunk& c : chunks) {
    const Slice& p = plan[c.slice];
    uint8_t* t = static_cast<uint8_t*>(tensors[p.tensor].data_ptr()) + chunk_tensor_byte(c, p.first, p.stride, 0);
    uint8_t* b = base + chunk_buffer_byte(c, p.buffer_offset, p.block, 0);
    const int32_t unit = widest_word({reinterpret_cast<uintptr_t>(t), reinterpret_cast<uintptr_t>(b),
                                      static_cast<uint64_t>(c.bytes), static_cast<uint64_t>(c.nruns > 1 ? p.stride : 0),
                                      static_cast<uint64_t>(c.nruns > 1 ? p.block : 0)});
    host.push_back(Run{t, b, p.stride, p.block, static_cast<int32_t>(c.nruns), static_cast<int32_t>(c.bytes / unit), unit});
  }
  at::Tensor runs = at::empty({static_cast<int64_t>(host.size() * sizeof(Run))}, buffer.options());
  auto stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(cudaMemcpyAsync(runs.data_ptr(), host.data(), host.size() * sizeof(Run), cudaMemcpyHostToDevice,
                                 stream));
  for (size_t first = 0; first < host.size(); first += kMaxBlocks) {
    const unsigned blocks = static_cast<unsigned>(std::min<size_t>(kMaxBlocks, host.size() - first));
    copy_kernel<kPack><<<blocks, kThreads, 0, stream>>>(reinterpret_cast<const Run*>(runs.data_ptr()) + first);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

at::Tensor pack_cuda(at::TensorList sources, const at::Tensor& slices) {
  std::vector<at::Tensor> tensors(sources.begin(), sources.end());
  TORCH_CHECK(!tensors.empty(), "pack: no source tensors");
  const c10::cuda::CUDAGuard guard(tensors[0].device());
  const std::vector<Slice> plan = plan_slices(tensors, slices, "pack");
  at::Tensor buffer = at::empty({total_bytes(plan)}, tensors[0].options().dtype(at::kByte));
  launch<true>(tensors, plan, buffer);
  return buffer;
}

void pack_into_cuda(at::TensorList sources, const at::Tensor& slices, at::Tensor out) {
  const c10::cuda::CUDAGuard guard(out.device());
  std::vector<at::Tensor> tensors(sources.begin(), sources.end());
  const std::vector<Slice> plan = plan_pack_into(tensors, slices, out);
  launch<true>(tensors, plan, out);
}

void unpack_cuda(const at::Tensor& buffer, at::TensorList destinations, const at::Tensor& slices) {
  const c10::cuda::CUDAGuard guard(buffer.device());
  std::vector<at::Tensor> tensors(destinations.begin(), destinations.end());
  const std::vector<Slice> plan = plan_unpack(buffer, tensors, slices);
  at::Tensor source = buffer;
  launch<false>(tensors, plan, source);
}

}  // namespace

TORCH_LIBRARY_IMPL(nereus, CUDA, m) {
  m.impl("checksum", &checksum_cuda);
  m.impl("pack", &pack_cuda);
  m.impl("pack_into", &pack_into_cuda);
  m.impl("unpack", &unpack_cuda);
}

}  // namespace nereus
