// CPU implementations of the nereus ops, parallel with at::parallel_for over the tiles and chunks
// that geometry.h cuts the work into (the CUDA kernels run the same arithmetic).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../slices.h"

#include <atomic>
#include <cstring>
#include <vector>

namespace nereus {
namespace {

constexpr int64_t kTileElements = 1 << 16;  // per checksum task
constexpr int64_t kChunkBytes = 1 << 20;     // per pack/unpack task

template <typename Bits>
uint64_t checksum_tiles(const at::Tensor& data, const Geometry& g) {
  const Tiling tiling = make_tiling(g, kTileElements);
  const Bits* base = reinterpret_cast<const Bits*>(data.data_ptr());
  // Addition modulo 2**64 is associative and commutative: any split into tiles gives the same sum.
  std::atomic<uint64_t> total{0};
  at::parallel_for(0, tiling.count, 1, [&](int64_t begin, int64_t end) {
    uint64_t sum = 0;
    for (int64_t t = begin; t < end; ++t) {
      const Tile tile = tile_at(g, tiling, t);
      for (int64_t r = tile.row; r < tile.row + tile.nrows; ++r) {
        const uint64_t start = static_cast<uint64_t>(row_start(g, r) + tile.col);
        const Bits* row = base + r * g.cols + tile.col;
        for (int64_t j = 0; j < tile.ncols; ++j) {
          sum += checksum_term(start + static_cast<uint64_t>(j), static_cast<uint64_t>(row[j]));
        }
      }
    }
    total.fetch_add(sum, std::memory_order_relaxed);
  });
  return total.load();
}

int64_t checksum_cpu(const at::Tensor& data, at::IntArrayRef global_shape, at::IntArrayRef global_offset) {
  const at::Tensor t = checksum_input(data);
  const Geometry g = geometry_of(t, global_shape, global_offset);
  if (t.numel() == 0) return 0;
  uint64_t sum = 0;
  switch (t.element_size()) {
    case 1: sum = checksum_tiles<uint8_t>(t, g); break;
    case 2: sum = checksum_tiles<uint16_t>(t, g); break;
    case 4: sum = checksum_tiles<uint32_t>(t, g); break;
    case 8: sum = checksum_tiles<uint64_t>(t, g); break;
    default: TORCH_CHECK(false, "checksum: unsupported element size ", t.element_size());
  }
  return static_cast<int64_t>(sum);
}

// Pack (buffer <- tensors) or unpack (tensors <- buffer), chunk by chunk in parallel.
template <bool kPack>
void copy_planned(const std::vector<at::Tensor>& tensors, const std::vector<Slice>& plan, uint8_t* buffer) {
  const std::vector<Chunk> chunks = chunk_plan(plan, kChunkBytes);
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Chunk& c = chunks[i];
      const Slice& p = plan[c.slice];
      uint8_t* tensor = static_cast<uint8_t*>(tensors[p.tensor].data_ptr());
      for (int64_t r = 0; r < c.nruns; ++r) {
        uint8_t* t = tensor + chunk_tensor_byte(c, p.first, p.stride, r);
        uint8_t* b = buffer + chunk_buffer_byte(c, p.buffer_offset, p.block, r);
        if (kPack) {
          std::memcpy(b, t, c.bytes);
        } else {
          std::memcpy(t, b, c.bytes);
        }
      }
    }
  });
}

at::Tensor pack_cpu(at::TensorList sources, const at::Tensor& slices) {
  std::vector<at::Tensor> tensors(sources.begin(), sources.end());
  const std::vector<Slice> plan = plan_pack(tensors, slices);
  at::Tensor buffer = at::empty({total_bytes(plan)}, at::TensorOptions().dtype(at::kByte));
  copy_planned<true>(tensors, plan, buffer.data_ptr<uint8_t>());
  return buffer;
}

void pack_into_cpu(at::TensorList sources, const at::Tensor& slices, at::Tensor out) {
  std::vector<at::Tensor> tensors(sources.begin(), sources.end());
  const std::vector<Slice> plan = plan_pack_into(tensors, slices, out);
  copy_planned<true>(tensors, plan, out.data_ptr<uint8_t>());
}

void unpack_cpu(const at::Tensor& buffer, at::TensorList destinations, const at::Tensor& slices) {
  std::vector<at::Tensor> tensors(destinations.begin(), destinations.end());
  const std::vector<Slice> plan = plan_unpack(buffer, tensors, slices);
  copy_planned<false>(tensors, plan, buffer.data_ptr<uint8_t>());
}

}  // namespace

TORCH_LIBRARY_IMPL(nereus, CPU, m) {
  m.impl("checksum", &checksum_cpu);
  m.impl("pack", &pack_cpu);
  m.impl("pack_into", &pack_into_cpu);
  m.impl("unpack", &unpack_cpu);
}

}  // namespace nereus
