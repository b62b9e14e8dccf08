// CPU implementations of the nereus ops, parallel over rows and slices with at::parallel_for.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../slices.h"

#include <atomic>
#include <cstring>
#include <vector>

namespace nereus {
namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

inline uint64_t mix(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

template <typename Bits>
uint64_t checksum_rows(const at::Tensor& data, at::IntArrayRef shape, at::IntArrayRef offset) {
  const int64_t dims = data.dim();
  const int64_t cols = dims ? data.size(dims - 1) : 1;
  const int64_t rows = cols ? data.numel() / cols : 0;
  std::vector<int64_t> gstride(dims, 1);
  for (int64_t d = dims - 2; d >= 0; --d) gstride[d] = gstride[d + 1] * shape[d + 1];
  const Bits* base = reinterpret_cast<const Bits*>(data.data_ptr());
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(cols, 1));
  // Addition modulo 2**64 is associative and commutative: any split into chunks gives the same sum.
  std::atomic<uint64_t> total{0};
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    uint64_t sum = 0;
    for (int64_t r = begin; r < end; ++r) {
      int64_t rest = r, start = dims ? offset[dims - 1] : 0;
      for (int64_t d = dims - 2; d >= 0; --d) {
        const int64_t local = rest % data.size(d);
        rest /= data.size(d);
        start += (offset[d] + local) * gstride[d];
      }
      const Bits* row = base + r * cols;
      for (int64_t j = 0; j < cols; ++j) {
        const uint64_t index = static_cast<uint64_t>(start + j);
        sum += mix((index * kGolden) ^ static_cast<uint64_t>(row[j]));
      }
    }
    total.fetch_add(sum, std::memory_order_relaxed);
  });
  return total.load();
}

int64_t checksum_cpu(const at::Tensor& data, at::IntArrayRef global_shape, at::IntArrayRef global_offset) {
  check_global(data, global_shape, global_offset);
  const at::Tensor t = data.contiguous();
  uint64_t sum = 0;
  switch (t.element_size()) {
    case 1: sum = checksum_rows<uint8_t>(t, global_shape, global_offset); break;
    case 2: sum = checksum_rows<uint16_t>(t, global_shape, global_offset); break;
    case 4: sum = checksum_rows<uint32_t>(t, global_shape, global_offset); break;
    case 8: sum = checksum_rows<uint64_t>(t, global_shape, global_offset); break;
    default: TORCH_CHECK(false, "checksum: unsupported element size ", t.element_size());
  }
  return static_cast<int64_t>(sum);
}

void pack_planned(const std::vector<at::Tensor>& tensors, const std::vector<Slice>& plan,
                  at::Tensor& buffer) {
  uint8_t* out = buffer.data_ptr<uint8_t>();
  at::parallel_for(0, static_cast<int64_t>(plan.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Slice& p = plan[i];
      const uint8_t* src = static_cast<const uint8_t*>(tensors[p.tensor].data_ptr());
      for (int64_t o = 0; o < p.outer; ++o) {
        std::memcpy(out + p.buffer_offset + o * p.block, src + p.first + o * p.stride, p.block);
      }
    }
  });
}

at::Tensor pack_cpu(at::TensorList sources, const at::Tensor& slices) {
  std::vector<at::Tensor> tensors(sources.begin(), sources.end());
  const std::vector<Slice> plan = plan_slices(tensors, slices, "pack");
  at::Tensor buffer = at::empty({total_bytes(plan)}, at::TensorOptions().dtype(at::kByte));
  pack_planned(tensors, plan, buffer);
  return buffer;
}

void pack_into_cpu(at::TensorList sources, const at::Tensor& slices, at::Tensor out) {
  std::vector<at::Tensor> tensors(sources.begin(), sources.end());
  const std::vector<Slice> plan = plan_pack_into(tensors, slices, out);
  pack_planned(tensors, plan, out);
}

void unpack_cpu(const at::Tensor& buffer, at::TensorList destinations, const at::Tensor& slices) {
  std::vector<at::Tensor> tensors(destinations.begin(), destinations.end());
  const std::vector<Slice> plan = plan_unpack(buffer, tensors, slices);
  const uint8_t* in = buffer.data_ptr<uint8_t>();
  at::parallel_for(0, static_cast<int64_t>(plan.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Slice& p = plan[i];
      uint8_t* dst = static_cast<uint8_t*>(tensors[p.tensor].data_ptr());
      for (int64_t o = 0; o < p.outer; ++o) {
        std::memcpy(dst + p.first + o * p.stride, in + p.buffer_offset + o * p.block, p.block);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(nereus, CPU, m) {
  m.impl("checksum", &checksum_cpu);
  m.impl("pack", &pack_cpu);
  m.impl("pack_into", &pack_into_cpu);
  m.impl("unpack", &unpack_cpu);
}

}  // namespace nereus
