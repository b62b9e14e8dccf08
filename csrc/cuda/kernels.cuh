// The CUDA kernels of the nereus ops and the descriptors they read, without ATen: ops_cuda.cu
// launches them, and tests/runtime/kernels/emulate_cuda.cpp runs this same source on the CPU (a
// thread per CUDA thread, a barrier per __syncthreads) to check it where no GPU is.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "../geometry.h"

namespace nereus {

constexpr int kThreads = 256;
constexpr int64_t kTileElements = 1 << 14;  // per block of the checksum
constexpr int64_t kChunkBytes = 1 << 16;     // per block of pack/unpack
constexpr int64_t kMaxBlocks = 1 << 16;
// Blocks of kThreads that each kernel leaves room for on a multiprocessor, whose 64K registers
// they share: test_nvcc.py checks ptxas's register count against it (at this writing, nvcc 13.0:
// the copy 40 registers on sm_90, 48 on sm_80, room for 6 and 5; the checksum 48, room for 5).
// A copy's speed is its bytes in flight, a checksum's its integer issue rate: both need threads.
constexpr int kResidentBlocks = 5;

inline unsigned checksum_blocks(const Tiling& tiling) {
  return static_cast<unsigned>(std::min<int64_t>(tiling.count, kMaxBlocks));
}

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
      // A thread's element i is column j of row r; its next, blockDim.x further on, is found
      // from the step in rows and columns, without a division per element.
      const int64_t step_rows = blockDim.x / g.cols, step_cols = blockDim.x - step_rows * g.cols;
      int64_t r = threadIdx.x / g.cols, j = threadIdx.x - r * g.cols;
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const uint64_t index = static_cast<uint64_t>(row_start(g, tile.row + r) + j);
        sum += checksum_term(index, static_cast<uint64_t>(first[i]));
        r += step_rows;
        j += step_cols;
        if (j >= g.cols) {
          j -= g.cols;
          ++r;
        }
      }
    }
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (unsigned step = blockDim.x / 2; step > 0; step /= 2) {
    if (threadIdx.x < step) partial[threadIdx.x] += partial[threadIdx.x + step];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(out, partial[0]);
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

// Each thread copies kUnroll words a round, blockDim.x apart (so that a warp's accesses stay
// consecutive), and loads them all before it stores any, so that kUnroll loads are in flight at
// once: a copy is bound by the bytes in flight over the memory's latency, and a thread that loaded
// and stored one word at a time would wait out a whole round trip per word.
constexpr int kUnroll = 4;

// Where a thread is in a chunk's runs: word `w` of run `run`. It moves blockDim.x words at a time,
// which is `runs` runs and `words` words (found once: no division per word). One run: `w` alone.
template <bool kOneRun>
struct Cursor {
  int32_t run, w;
  __device__ __forceinline__ void advance(int32_t runs, int32_t words, int32_t per_run) {
    w += words;
    if (!kOneRun) {
      run += runs;
      if (w >= per_run) {  // words < per_run: one carry at most
        w -= per_run;
        ++run;
      }
    }
  }
  template <typename Word>
  __device__ __forceinline__ Word* in(uint8_t* base, int64_t step) const {
    return reinterpret_cast<Word*>(kOneRun ? base : base + run * step) + w;
  }
};

template <typename Word, bool kPack, bool kOneRun>
__device__ __forceinline__ void copy_rounds(const Run& r) {
  const int32_t total = r.nruns * r.words;  // a chunk holds at most kChunkBytes
  uint8_t* from = kPack ? r.tensor : r.buffer;
  uint8_t* to = kPack ? r.buffer : r.tensor;
  const int64_t from_step = kPack ? r.stride : r.block, to_step = kPack ? r.block : r.stride;
  const int32_t threads = static_cast<int32_t>(blockDim.x), thread = static_cast<int32_t>(threadIdx.x);
  const int32_t runs = kOneRun ? 0 : threads / r.words, words = kOneRun ? threads : threads - runs * r.words;
  Cursor<kOneRun> at{kOneRun ? 0 : thread / r.words, kOneRun ? thread : thread % r.words};
  for (int32_t first = thread; first < total; first += kUnroll * threads) {
    Word held[kUnroll];
    Cursor<kOneRun> stored = at;
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (first + k * threads < total) held[k] = *at.template in<Word>(from, from_step);
      at.advance(runs, words, r.words);
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (first + k * threads < total) *stored.template in<Word>(to, to_step) = held[k];
      stored.advance(runs, words, r.words);
    }
  }
}

template <typename Word, bool kPack>
__device__ __forceinline__ void copy_words(const Run& r) {
  if (r.nruns == 1) {
    copy_rounds<Word, kPack, true>(r);
  } else {
    copy_rounds<Word, kPack, false>(r);
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

inline int32_t widest_word(std::initializer_list<uint64_t> values) {
  int32_t unit = 16;
  for (uint64_t v : values) {
    while (unit > 1 && v % unit) unit /= 2;
  }
  return unit;
}

// The descriptors of a plan's chunks: `tensors` are the slices' tensors' first bytes.
inline std::vector<Run> make_runs(const std::vector<Slice>& plan, const std::vector<Chunk>& chunks,
                                  const std::vector<uint8_t*>& tensors, uint8_t* buffer) {
  std::vector<Run> runs;
  runs.reserve(chunks.size());
  for (const Chunk& c : chunks) {
    const Slice& p = plan[c.slice];
    uint8_t* t = tensors[p.tensor] + chunk_tensor_byte(c, p.first, p.stride, 0);
    uint8_t* b = buffer + chunk_buffer_byte(c, p.buffer_offset, p.block, 0);
    const int32_t unit = widest_word({reinterpret_cast<uintptr_t>(t), reinterpret_cast<uintptr_t>(b),
                                      static_cast<uint64_t>(c.bytes), static_cast<uint64_t>(c.nruns > 1 ? p.stride : 0),
                                      static_cast<uint64_t>(c.nruns > 1 ? p.block : 0)});
    runs.push_back(Run{t, b, p.stride, p.block, static_cast<int32_t>(c.nruns), static_cast<int32_t>(c.bytes / unit), unit});
  }
  return runs;
}

}  // namespace nereus
