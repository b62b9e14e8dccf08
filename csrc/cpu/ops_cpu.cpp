// CPU implementations of the nereus ops, parallel over rows and slices with at::parallel_for.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

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
  TORCH_CHECK(static_cast<int64_t>(global_shape.size()) == data.dim() &&
                  static_cast<int64_t>(global_offset.size()) == data.dim(),
              "checksum: global_shape and global_offset need one entry per dimension of data");
  for (int64_t d = 0; d < data.dim(); ++d) {
    TORCH_CHECK(global_offset[d] >= 0 && global_offset[d] + data.size(d) <= global_shape[d],
                "checksum: dim ", d, " slice [", global_offset[d], ", ", global_offset[d] + data.size(d),
                ") outside [0, ", global_shape[d], ")");
  }
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

struct Slice {
  int64_t tensor, dim, start, length;
  int64_t outer, block;  // `outer` contiguous runs of `block` bytes each
  int64_t stride;        // bytes between runs in the tensor
  int64_t first;         // byte offset of the first run in the tensor
  int64_t buffer_offset;
};

std::vector<Slice> plan_slices(const std::vector<at::Tensor>& tensors, const at::Tensor& slices,
                               const char* op) {
  TORCH_CHECK(slices.scalar_type() == at::kLong && slices.dim() == 2 && slices.size(1) == 4,
              op, ": slices must be an int64 tensor of shape [n, 4] (tensor, dim, start, length)");
  const at::Tensor s = slices.cpu().contiguous();
  const int64_t* rows = s.data_ptr<int64_t>();
  std::vector<Slice> plan;
  int64_t offset = 0;
  for (int64_t i = 0; i < s.size(0); ++i) {
    Slice p{rows[4 * i], rows[4 * i + 1], rows[4 * i + 2], rows[4 * i + 3], 0, 0, 0, 0, 0};
    TORCH_CHECK(p.tensor >= 0 && p.tensor < static_cast<int64_t>(tensors.size()), op, ": slice ", i,
                " names tensor ", p.tensor, " of ", tensors.size());
    const at::Tensor& t = tensors[p.tensor];
    TORCH_CHECK(t.is_contiguous(), op, ": tensor ", p.tensor, " is not contiguous");
    TORCH_CHECK(p.dim >= 0 && p.dim < std::max<int64_t>(t.dim(), 1), op, ": slice ", i, " dim ", p.dim,
                " outside a ", t.dim(), "-d tensor");
    const int64_t size = t.dim() ? t.size(p.dim) : 1;
    TORCH_CHECK(p.start >= 0 && p.length >= 0 && p.start + p.length <= size, op, ": slice ", i, " [",
                p.start, ", ", p.start + p.length, ") outside [0, ", size, ") of tensor ", p.tensor);
    int64_t outer = 1, inner = 1;
    for (int64_t d = 0; d < p.dim; ++d) outer *= t.size(d);
    for (int64_t d = p.dim + 1; d < t.dim(); ++d) inner *= t.size(d);
    const int64_t e = t.element_size();
    p.outer = outer;
    p.block = p.length * inner * e;
    p.stride = size * inner * e;
    p.first = p.start * inner * e;
    p.buffer_offset = offset;
    offset += p.outer * p.block;
    plan.push_back(p);
  }
  return plan;
}

int64_t total_bytes(const std::vector<Slice>& plan) {
  int64_t total = 0;
  for (const Slice& p : plan) total += p.outer * p.block;
  return total;
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
  TORCH_CHECK(out.scalar_type() == at::kByte && out.dim() == 1 && out.is_contiguous(),
              "pack_into: out must be a contiguous 1-d uint8 tensor");
  std::vector<at::Tensor> tensors(sources.begin(), sources.end());
  const std::vector<Slice> plan = plan_slices(tensors, slices, "pack_into");
  TORCH_CHECK(total_bytes(plan) <= out.numel(), "pack_into: slices need ", total_bytes(plan),
              " bytes, out holds ", out.numel());
  pack_planned(tensors, plan, out);
}

void unpack_cpu(const at::Tensor& buffer, at::TensorList destinations, const at::Tensor& slices) {
  TORCH_CHECK(buffer.scalar_type() == at::kByte && buffer.dim() == 1 && buffer.is_contiguous(),
              "unpack: buffer must be a contiguous 1-d uint8 tensor");
  std::vector<at::Tensor> tensors(destinations.begin(), destinations.end());
  const std::vector<Slice> plan = plan_slices(tensors, slices, "unpack");
  TORCH_CHECK(total_bytes(plan) == buffer.numel(), "unpack: slices cover ", total_bytes(plan),
              " bytes, the buffer holds ", buffer.numel());
  // Overlapping destinations would make the result depend on the order: refuse before writing.
  for (size_t a = 0; a < plan.size(); ++a) {
    for (size_t b = a + 1; b < plan.size(); ++b) {
      const Slice &x = plan[a], &y = plan[b];
      if (x.tensor != y.tensor || x.length == 0 || y.length == 0) continue;
      TORCH_CHECK(x.dim == y.dim && (x.start + x.length <= y.start || y.start + y.length <= x.start),
                  "unpack: slices ", a, " and ", b, " overlap in destination ", x.tensor);
    }
  }
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
