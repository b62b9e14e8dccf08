// Runs the CUDA kernels of csrc/cuda/kernels.cuh on the CPU, for the tests of a machine without a
// GPU: every CUDA thread of a block is a std::thread, __syncthreads is a std::barrier, blocks run
// one after another, with the grid and block sizes ops_cuda.cu launches. The kernels' source and
// the descriptors they read are the very ones the GPU build compiles; only the CUDA built-ins
// below stand in. test_cuda_emulated.py builds this with g++ and UBSan; with the checks of uint4
// and uint2 below, any word the kernels would read or write at an address not aligned to its size
// is reported, as is any other undefined behaviour UBSan sees (a signed overflow in geometry.h).
//
// This checks the kernels' arithmetic, their word widths and their block reduction. It does not
// check what only a GPU shows: the memory model beyond a block's barrier, timing, or the
// compiler's device code (benchmarks/device_kernels.sh does, on a GPU machine).
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
thread_local std::barrier<>* block_barrier = nullptr;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
inline void __syncthreads() { block_barrier->arrive_and_wait(); }
// CUDA's 16- and 8-byte words. A GPU faults on one at an address not a multiple of its size; here
// each assignment checks both addresses and says so in UBSan's words (UBSan itself checks the
// scalar words), so that a test sees it and the process lives on.
inline void check_aligned(const void* address, uintptr_t width, const char* type) {
  if (reinterpret_cast<uintptr_t>(address) % width) {
    std::fprintf(stderr, "runtime error: misaligned address %p for type %s\n", address, type);
  }
}
struct uint4 {
  unsigned x, y, z, w;
  uint4& operator=(const uint4& other) {
    check_aligned(this, 16, "uint4");
    check_aligned(&other, 16, "uint4");
    x = other.x, y = other.y, z = other.z, w = other.w;
    return *this;
  }
};
struct uint2 {
  unsigned x, y;
  uint2& operator=(const uint2& other) {
    check_aligned(this, 8, "uint2");
    check_aligned(&other, 8, "uint2");
    x = other.x, y = other.y;
    return *this;
  }
};
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  return __atomic_fetch_add(address, value, __ATOMIC_RELAXED);
}

#include "../../../csrc/cuda/kernels.cuh"

namespace {

template <typename Kernel, typename... Args>
void launch(unsigned grid, unsigned block, Kernel kernel, Args... args) {
  gridDim = dim3{grid};
  blockDim = dim3{block};
  for (unsigned b = 0; b < grid; ++b) {
    std::barrier<> barrier(block);
    std::vector<std::thread> threads;
    threads.reserve(block);
    for (unsigned t = 0; t < block; ++t) {
      threads.emplace_back([&, b, t] {
        blockIdx = dim3{b};
        threadIdx = dim3{t};
        block_barrier = &barrier;
        kernel(args...);
      });
    }
    for (std::thread& thread : threads) thread.join();
  }
}

}  // namespace

extern "C" {

// Pack (pack != 0: buffer <- tensors) or unpack: `rows` holds n_rows validated slice rows
// (tensor, dim, start, length); tensor i has ndims[i] sizes, in `sizes` one tensor after another.
// Returns the number of blocks launched.
int64_t nereus_emulate_copy(int pack, int64_t n_tensors, const int64_t* addresses, const int64_t* ndims,
                            const int64_t* sizes, const int64_t* element_sizes, int64_t n_rows, const int64_t* rows,
                            int64_t buffer_address) {
  std::vector<uint8_t*> tensors;
  std::vector<const int64_t*> shapes;
  const int64_t* cursor = sizes;
  for (int64_t i = 0; i < n_tensors; ++i) {
    tensors.push_back(reinterpret_cast<uint8_t*>(addresses[i]));
    shapes.push_back(cursor);
    cursor += ndims[i];
  }
  std::vector<nereus::Slice> plan;
  int64_t offset = 0;
  for (int64_t i = 0; i < n_rows; ++i) {
    const int64_t* r = rows + 4 * i;
    plan.push_back(nereus::measure_slice(r[0], r[1], r[2], r[3], ndims[r[0]], shapes[r[0]], element_sizes[r[0]], offset));
    offset += plan.back().outer * plan.back().block;
  }
  const std::vector<nereus::Chunk> chunks = nereus::chunk_plan(plan, nereus::kChunkBytes);
  const std::vector<nereus::Run> runs =
      nereus::make_runs(plan, chunks, tensors, reinterpret_cast<uint8_t*>(buffer_address));
  if (runs.empty()) return 0;
  if (pack) {
    launch(static_cast<unsigned>(runs.size()), nereus::kThreads, nereus::copy_kernel<true>, runs.data());
  } else {
    launch(static_cast<unsigned>(runs.size()), nereus::kThreads, nereus::copy_kernel<false>, runs.data());
  }
  return static_cast<int64_t>(runs.size());
}

// The checksum of a contiguous piece (`sizes`) at `offset` in a global tensor (`shape`), with
// the host side of ops_cuda.cu's checksum_cuda: geometry first, then an aligned copy of a piece
// whose address is not a multiple of its element size (checksum_input's clone there).
uint64_t nereus_emulate_checksum(int64_t address, int64_t element_size, int64_t ndim, const int64_t* sizes,
                                 const int64_t* shape, const int64_t* offset) {
  nereus::Geometry g;
  if (!nereus::make_geometry(ndim, sizes, shape, offset, &g)) return 0;
  int64_t numel = 1;
  for (int64_t d = 0; d < ndim; ++d) numel *= sizes[d];
  if (numel == 0) return 0;
  const nereus::Tiling tiling = nereus::make_tiling(g, nereus::kTileElements);
  const unsigned blocks = nereus::checksum_blocks(tiling);
  unsigned long long out = 0;
  const void* data = reinterpret_cast<const void*>(address);
  std::vector<uint64_t> aligned;  // 8-byte words: aligned to any element size
  if (!nereus::element_aligned(data, element_size)) {
    aligned.resize((numel * element_size + 7) / 8);
    std::memcpy(aligned.data(), data, numel * element_size);
    data = aligned.data();
  }
  switch (element_size) {
    case 1: launch(blocks, nereus::kThreads, nereus::checksum_kernel<uint8_t>, static_cast<const uint8_t*>(data), g, tiling, &out); break;
    case 2: launch(blocks, nereus::kThreads, nereus::checksum_kernel<uint16_t>, static_cast<const uint16_t*>(data), g, tiling, &out); break;
    case 4: launch(blocks, nereus::kThreads, nereus::checksum_kernel<uint32_t>, static_cast<const uint32_t*>(data), g, tiling, &out); break;
    case 8: launch(blocks, nereus::kThreads, nereus::checksum_kernel<uint64_t>, static_cast<const uint64_t*>(data), g, tiling, &out); break;
    default: return 0;
  }
  return out;
}

}  // extern "C"

extern "C" {

// Copies a 16-byte and a 4-byte word at odd addresses, as a kernel with a wrong width would: the
// tests call it to see that this build reports both.
void nereus_emulate_misaligned_canary() {
  static uint8_t bytes[64] = {};
  volatile uintptr_t odd = reinterpret_cast<uintptr_t>(bytes) + 1;
  uint4* wide = reinterpret_cast<uint4*>(odd);
  wide[1] = wide[0];
  volatile uint32_t* word = reinterpret_cast<uint32_t*>(odd + 32);
  word[1] = word[0];
}

}  // extern "C"
