// The arithmetic every backend's kernels share, on the host and on the device: the checksum's
// mixing function, where a piece's elements sit in its global tensor, and how the work is cut
// into independent pieces (tiles of a checksum, chunks of a pack or unpack). The CPU backend runs
// the same functions as the CUDA one, so the CPU tests against the pure-PyTorch oracle check the
// index arithmetic the GPU runs too. No ATen here: this header is compiled for the device.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define NEREUS_HD __host__ __device__ __forceinline__
#else
#define NEREUS_HD inline
#endif

namespace nereus {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
constexpr int kMaxDims = 16;

// SplitMix64's finaliser.
NEREUS_HD uint64_t mix(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Whether `data` is aligned to its elements of `width` bytes. The checksum loads each element as
// one word of that width, which a GPU faults on (and C++ leaves undefined) at any other address: a
// tensor can start anywhere in its storage (torch.frombuffer's offset, a storage sliced at a
// byte), so the backends checksum an aligned copy of such a piece.
NEREUS_HD bool element_aligned(const void* data, int64_t width) {
  return reinterpret_cast<uintptr_t>(data) % static_cast<uintptr_t>(width) == 0;
}

// One element's term of the checksum: the sum of these modulo 2**64 over a tensor's elements is
// the same however the tensor is cut into pieces.
NEREUS_HD uint64_t checksum_term(uint64_t global_index, uint64_t bits) {
  return mix((global_index * kGolden) ^ bits);
}

// A contiguous piece of a global tensor as rows of `cols` elements, each row's elements at
// consecutive global indices. Dimensions are merged wherever the piece spans the whole global
// extent of the dimensions inside them (a whole tensor, or one cut along its first dimension,
// is a single row), so the leading dimensions that are left locate rows, not elements.
struct Geometry {
  int dims = 0;                  // leading (row) dimensions left after merging
  int64_t local[kMaxDims] = {};  // the piece's size in each, outermost first
  int64_t gstride[kMaxDims] = {};// global stride of each, in elements
  int64_t base = 0;              // global index of the piece's first element
  int64_t rows = 1, cols = 1;
};

// `sizes`, `shape` and `offset` have `ndim` entries: the piece, its global tensor, and where the
// piece starts in it. Returns false when more than kMaxDims leading dimensions are left.
inline bool make_geometry(int64_t ndim, const int64_t* sizes, const int64_t* shape, const int64_t* offset,
                          Geometry* g) {
  *g = Geometry{};
  if (ndim == 0) return true;
  // A piece without elements has no place to compute: its global shape need not even have an
  // int64 element count ([0, 2**40, 2**40] is valid), so the strides below could overflow.
  for (int64_t d = 0; d < ndim; ++d) {
    if (sizes[d] == 0) {
      g->rows = g->cols = 0;
      return true;
    }
  }
  // From the innermost dimension out: a dimension joins the block inside it while that block
  // spans its dimensions' whole global extent; otherwise the block is closed (the first one
  // closed is the columns, the others are row dimensions) and the dimension starts a new one.
  int64_t found_local[kMaxDims + 1], found_stride[kMaxDims + 1];
  int found = 0;  // blocks closed so far, innermost first
  int64_t stride = 1, run = 1, run_stride = 1;
  bool whole = true;
  for (int64_t d = ndim - 1; d >= 0; --d) {
    g->base += offset[d] * stride;
    // A dimension of size 1 locates no element (its offset is in `base`): it opens no block, so
    // that a piece cut to size 1 along many dimensions stays within kMaxDims. Cut from a larger
    // extent, it still keeps the block inside it from merging with the one outside.
    if (sizes[d] == 1) {
      whole = whole && shape[d] == 1;
      stride *= shape[d];
      continue;
    }
    if (d < ndim - 1 && !whole) {
      if (found == kMaxDims + 1) return false;
      found_local[found] = run;
      found_stride[found] = run_stride;
      ++found;
      run = 1;
      run_stride = stride;
      whole = true;
    }
    run *= sizes[d];
    whole = whole && sizes[d] == shape[d];
    stride *= shape[d];
  }
  if (found == kMaxDims + 1) return false;
  found_local[found] = run;
  found_stride[found] = run_stride;
  ++found;
  g->cols = found_local[0];
  g->dims = found - 1;
  for (int i = 0; i < g->dims; ++i) {  // outermost first
    g->local[i] = found_local[found - 1 - i];
    g->gstride[i] = found_stride[found - 1 - i];
    g->rows *= g->local[i];
  }
  return true;
}

// Global index of the first element of row `row` (0 <= row < rows).
NEREUS_HD int64_t row_start(const Geometry& g, int64_t row) {
  int64_t index = g.base;
  for (int d = g.dims - 1; d > 0; --d) {  // the outermost needs no division
    index += (row % g.local[d]) * g.gstride[d];
    row /= g.local[d];
  }
  return g.dims ? index + row * g.gstride[0] : index;
}

// Checksum work is cut into tiles of at most `tile` elements: part of one row where rows are
// long, whole rows where they are short. Tile `t` covers rows [row, row + nrows) and, in each,
// columns [col, col + ncols).
struct Tile {
  int64_t row, nrows, col, ncols;
};

struct Tiling {
  int64_t per_row;   // tiles per row (rows are split), or 0 (tiles hold whole rows)
  int64_t row_span;  // rows per tile where tiles hold whole rows
  int64_t cols;      // columns per tile where rows are split
  int64_t count;
};

inline Tiling make_tiling(const Geometry& g, int64_t tile) {
  if (g.cols >= tile) {
    const int64_t per_row = (g.cols + tile - 1) / tile;
    return Tiling{per_row, 1, tile, per_row * g.rows};
  }
  const int64_t span = g.cols ? tile / g.cols : 1;
  return Tiling{0, span, g.cols, (g.rows + span - 1) / span};
}

NEREUS_HD Tile tile_at(const Geometry& g, const Tiling& t, int64_t index) {
  if (t.per_row) {
    const int64_t row = index / t.per_row, col = (index % t.per_row) * t.cols;
    return Tile{row, 1, col, (g.cols - col < t.cols) ? g.cols - col : t.cols};
  }
  const int64_t row = index * t.row_span;
  return Tile{row, (g.rows - row < t.row_span) ? g.rows - row : t.row_span, 0, g.cols};
}

// A slice row, validated and measured in bytes (slices.h plans them).
struct Slice {
  int64_t tensor, dim, start, length;
  int64_t outer, block;  // `outer` contiguous runs of `block` bytes each
  int64_t stride;        // bytes between runs in the tensor
  int64_t first;         // byte offset of the first run in the tensor
  int64_t buffer_offset;
};

// The runs of a slice row (already checked against its tensor) of a contiguous tensor of `ndim`
// dimensions, `sizes`, whose bytes start at `buffer_offset` in the buffer.
inline Slice measure_slice(int64_t tensor, int64_t dim, int64_t start, int64_t length, int64_t ndim,
                           const int64_t* sizes, int64_t element_size, int64_t buffer_offset) {
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= sizes[d];
  for (int64_t d = dim + 1; d < ndim; ++d) inner *= sizes[d];
  const int64_t size = ndim ? sizes[dim] : 1;
  Slice p{tensor, dim, start, length, outer, length * inner * element_size, size * inner * element_size,
          start * inner * element_size, buffer_offset};
  if (p.stride == p.block) {  // the slice spans its dimension: one contiguous run
    p.block *= p.outer;
    p.stride = p.block;
    p.outer = p.block ? 1 : 0;
  }
  return p;
}

// Pack and unpack work is cut into chunks of at most `limit` bytes of one slice: whole runs
// (a slice is `outer` runs of `block` contiguous bytes, `stride` bytes apart in its tensor,
// starting at byte `first`) where runs are short, part of one run where they are long.
struct Chunk {
  int64_t slice;
  int64_t run, nruns;        // runs [run, run + nruns) of the slice
  int64_t skip, bytes;       // bytes [skip, skip + bytes) of each of them
};

// Byte offsets of a chunk's `r`-th run in the tensor and in the buffer.
NEREUS_HD int64_t chunk_tensor_byte(const Chunk& c, int64_t first, int64_t stride, int64_t r) {
  return first + (c.run + r) * stride + c.skip;
}

NEREUS_HD int64_t chunk_buffer_byte(const Chunk& c, int64_t buffer_offset, int64_t block, int64_t r) {
  return buffer_offset + (c.run + r) * block + c.skip;
}

// The copy work of a plan in chunks of at most `limit` bytes (host only).
inline std::vector<Chunk> chunk_plan(const std::vector<Slice>& plan, int64_t limit) {
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < plan.size(); ++i) {
    const Slice& p = plan[i];
    const int64_t slice = static_cast<int64_t>(i);
    if (p.outer == 0 || p.block == 0) continue;
    if (p.block >= limit) {
      for (int64_t o = 0; o < p.outer; ++o) {
        for (int64_t k = 0; k < p.block; k += limit) {
          chunks.push_back(Chunk{slice, o, 1, k, std::min(limit, p.block - k)});
        }
      }
    } else {
      const int64_t span = limit / p.block;
      for (int64_t o = 0; o < p.outer; o += span) {
        chunks.push_back(Chunk{slice, o, std::min(span, p.outer - o), 0, p.block});
      }
    }
  }
  return chunks;
}

}  // namespace nereus
