// Planning shared by every backend: slice rows (tensor, dim, start, length) validated against the
// tensors and turned into runs of contiguous bytes, before any byte is written.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace nereus {

struct Slice {
  int64_t tensor, dim, start, length;
  int64_t outer, block;  // `outer` contiguous runs of `block` bytes each
  int64_t stride;        // bytes between runs in the tensor
  int64_t first;         // byte offset of the first run in the tensor
  int64_t buffer_offset;
};

inline std::vector<Slice> plan_slices(const std::vector<at::Tensor>& tensors, const at::Tensor& slices,
                                      const char* op) {
  TORCH_CHECK(slices.scalar_type() == at::kLong && slices.dim() == 2 && slices.size(1) == 4, op,
              ": slices must be an int64 tensor of shape [n, 4] (tensor, dim, start, length)");
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
    TORCH_CHECK(p.start >= 0 && p.length >= 0 && p.start <= size && p.length <= size - p.start, op, ": slice ", i, " [",
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

inline int64_t total_bytes(const std::vector<Slice>& plan) {
  int64_t total = 0;
  for (const Slice& p : plan) total += p.outer * p.block;
  return total;
}

// Overlapping destinations would make the result depend on the order: refuse before writing.
inline void check_distinct(const std::vector<at::Tensor>& tensors, const char* op) {
  for (size_t a = 0; a < tensors.size(); ++a) {
    for (size_t b = a + 1; b < tensors.size(); ++b) {
      TORCH_CHECK(!tensors[a].is_alias_of(tensors[b]), op, ": destinations ", a, " and ", b,
                  " share storage");
    }
  }
}

inline void check_disjoint(const std::vector<Slice>& plan, const char* op) {
  for (size_t a = 0; a < plan.size(); ++a) {
    for (size_t b = a + 1; b < plan.size(); ++b) {
      const Slice &x = plan[a], &y = plan[b];
      if (x.tensor != y.tensor || x.length == 0 || y.length == 0) continue;
      TORCH_CHECK(x.dim == y.dim && (x.start + x.length <= y.start || y.start + y.length <= x.start), op,
                  ": slices ", a, " and ", b, " overlap in destination ", x.tensor);
    }
  }
}

// Every check of pack_into and unpack, shared by the backends, before any byte is written.
inline std::vector<Slice> plan_pack_into(const std::vector<at::Tensor>& tensors, const at::Tensor& slices,
                                         const at::Tensor& out) {
  TORCH_CHECK(out.scalar_type() == at::kByte && out.dim() == 1 && out.is_contiguous(),
              "pack_into: out must be a contiguous 1-d uint8 tensor");
  std::vector<Slice> plan = plan_slices(tensors, slices, "pack_into");
  TORCH_CHECK(total_bytes(plan) <= out.numel(), "pack_into: slices need ", total_bytes(plan), " bytes, out holds ",
              out.numel());
  return plan;
}

inline std::vector<Slice> plan_unpack(const at::Tensor& buffer, const std::vector<at::Tensor>& tensors,
                                      const at::Tensor& slices) {
  TORCH_CHECK(buffer.scalar_type() == at::kByte && buffer.dim() == 1 && buffer.is_contiguous(),
              "unpack: buffer must be a contiguous 1-d uint8 tensor");
  std::vector<Slice> plan = plan_slices(tensors, slices, "unpack");
  TORCH_CHECK(total_bytes(plan) == buffer.numel(), "unpack: slices cover ", total_bytes(plan),
              " bytes, the buffer holds ", buffer.numel());
  check_distinct(tensors, "unpack");
  check_disjoint(plan, "unpack");
  return plan;
}

inline void check_global(const at::Tensor& data, at::IntArrayRef shape, at::IntArrayRef offset) {
  TORCH_CHECK(static_cast<int64_t>(shape.size()) == data.dim() && static_cast<int64_t>(offset.size()) == data.dim(),
              "checksum: global_shape and global_offset need one entry per dimension of data");
  for (int64_t d = 0; d < data.dim(); ++d) {
    TORCH_CHECK(offset[d] >= 0 && offset[d] <= shape[d] && data.size(d) <= shape[d] - offset[d], "checksum: dim ", d, " slice [",
                offset[d], ", ", offset[d] + data.size(d), ") outside [0, ", shape[d], ")");
  }
}

}  // namespace nereus
