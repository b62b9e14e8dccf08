// Planning shared by every backend: slice rows (tensor, dim, start, length) validated against the
// tensors and turned into runs of contiguous bytes, before any byte is written.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "geometry.h"

namespace nereus {

// `device` is the buffer's (or out's, or the sources'): the device the op's kernel runs on.
inline std::vector<Slice> plan_slices(const std::vector<at::Tensor>& tensors, const at::Tensor& slices,
                                      const at::Device& device, const char* op) {
  TORCH_CHECK(slices.scalar_type() == at::kLong && slices.dim() == 2 && slices.size(1) == 4, op,
              ": slices must be an int64 tensor of shape [n, 4] (tensor, dim, start, length)");
  // The slices are read on the host, from the CPU or the buffer's device. On a third device they
  // would choose the kernel (the dispatcher picks the slices' device for a GPU tensor among CPU
  // ones), which would then run on tensors of another device.
  TORCH_CHECK(slices.device().is_cpu() || slices.device() == device, op,
              ": slices must be on the CPU or on the buffer's device (", device, "), not ", slices.device());
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
    p = measure_slice(p.tensor, p.dim, p.start, p.length, t.dim(), t.sizes().data(), t.element_size(), offset);
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
// Both checks are O(n log n), so that a transition's thousands of small slices stay cheap.

// The bytes a tensor's elements can occupy, [begin, end), on its device (none if empty).
struct Span {
  int device_type, device_index;
  uintptr_t begin, end;
  size_t index;
};

inline std::vector<Span> spans_of(const std::vector<at::Tensor>& tensors) {
  std::vector<Span> spans;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() == 0) continue;
    int64_t last = 0;  // the furthest element from the first, in elements
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * std::abs(t.stride(d));
    const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
    spans.push_back(Span{static_cast<int>(t.device().type()), t.device().index(), begin,
                         begin + static_cast<uintptr_t>((last + 1) * t.element_size()), i});
  }
  return spans;
}

// The first two of `spans` (by address) that share a byte, as (lower index, higher index).
inline std::optional<std::pair<size_t, size_t>> first_overlap(std::vector<Span> spans) {
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return std::tie(a.device_type, a.device_index, a.begin) < std::tie(b.device_type, b.device_index, b.begin);
  });
  for (size_t k = 1, reach = 0; k < spans.size(); ++k) {
    const Span &x = spans[reach], &y = spans[k];
    if (x.device_type == y.device_type && x.device_index == y.device_index && y.begin < x.end) {
      return std::make_pair(std::min(x.index, y.index), std::max(x.index, y.index));
    }
    if (x.device_type != y.device_type || x.device_index != y.device_index || y.end > x.end) reach = k;
  }
  return std::nullopt;
}

inline void check_distinct(const std::vector<at::Tensor>& tensors, const char* op) {
  const auto pair = first_overlap(spans_of(tensors));
  TORCH_CHECK(!pair, op, ": destinations ", pair ? pair->first : 0, " and ", pair ? pair->second : 0,
              " overlap in memory");
}

inline void check_disjoint(const std::vector<Slice>& plan, const char* op) {
  std::vector<size_t> order;
  for (size_t i = 0; i < plan.size(); ++i) {
    if (plan[i].length) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const Slice &x = plan[a], &y = plan[b];
    return std::tie(x.tensor, x.start, a) < std::tie(y.tensor, y.start, b);
  });
  // Per destination, by start: slices along different dimensions always meet; along one, a
  // slice meets an earlier one if it starts before the furthest end so far (`reach`'s).
  size_t reach = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    const Slice& y = plan[order[k]];
    if (k == 0 || plan[order[k - 1]].tensor != y.tensor) {
      reach = order[k];
      continue;
    }
    const Slice& x = plan[reach];
    TORCH_CHECK(x.dim == y.dim && x.start + x.length <= y.start, op, ": slices ", std::min(reach, order[k]), " and ",
                std::max(reach, order[k]), " overlap in destination ", y.tensor);
    if (y.start + y.length > x.start + x.length) reach = order[k];
  }
}

// Every tensor must be on `device` (the buffer's, or out's): a kernel reads and writes one device.
inline void check_devices(const std::vector<at::Tensor>& tensors, const at::Device& device, const char* op) {
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.device() == device, op, ": every tensor must be on the buffer's device (", device, "), not ",
                t.device());
  }
}

// `one` (written, or read while `tensors` are written) shares no byte with any of `tensors`:
// "<what> <index> in memory" names the first that does.
inline void check_apart(const at::Tensor& one, const std::vector<at::Tensor>& tensors, const char* what) {
  for (const Span& span : spans_of({one})) {
    for (const Span& other : spans_of(tensors)) {
      const bool same_device = other.device_type == span.device_type && other.device_index == span.device_index;
      TORCH_CHECK(!(same_device && other.begin < span.end && span.begin < other.end), what, " ", other.index,
                  " in memory");
    }
  }
}

// Every check of pack, pack_into and unpack, shared by the backends, before any byte is written.
inline std::vector<Slice> plan_pack(const std::vector<at::Tensor>& tensors, const at::Tensor& slices) {
  const at::Device device = tensors.empty() ? at::Device(at::kCPU) : tensors[0].device();
  std::vector<Slice> plan = plan_slices(tensors, slices, device, "pack");
  check_devices(tensors, device, "pack");
  return plan;
}

inline std::vector<Slice> plan_pack_into(const std::vector<at::Tensor>& tensors, const at::Tensor& slices,
                                         const at::Tensor& out) {
  TORCH_CHECK(out.scalar_type() == at::kByte && out.dim() == 1 && out.is_contiguous(),
              "pack_into: out must be a contiguous 1-d uint8 tensor");
  std::vector<Slice> plan = plan_slices(tensors, slices, out.device(), "pack_into");
  check_devices(tensors, out.device(), "pack_into");
  TORCH_CHECK(total_bytes(plan) <= out.numel(), "pack_into: slices need ", total_bytes(plan), " bytes, out holds ",
              out.numel());
  // Sources may share bytes with each other (they are only read), not with out.
  check_apart(out, tensors, "pack_into: out overlaps source");
  return plan;
}

inline std::vector<Slice> plan_unpack(const at::Tensor& buffer, const std::vector<at::Tensor>& tensors,
                                      const at::Tensor& slices) {
  TORCH_CHECK(buffer.scalar_type() == at::kByte && buffer.dim() == 1 && buffer.is_contiguous(),
              "unpack: buffer must be a contiguous 1-d uint8 tensor");
  std::vector<Slice> plan = plan_slices(tensors, slices, buffer.device(), "unpack");
  check_devices(tensors, buffer.device(), "unpack");
  TORCH_CHECK(total_bytes(plan) == buffer.numel(), "unpack: slices cover ", total_bytes(plan),
              " bytes, the buffer holds ", buffer.numel());
  // A destination sharing bytes with the buffer would be read after it was (partly) written.
  check_apart(buffer, tensors, "unpack: buffer overlaps destination");
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
  // Global indices are int64: the global tensor's count must be one (none if any extent is 0,
  // however large the others).
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return;
  int64_t elements = 1;
  for (int64_t d = 0; d < data.dim(); ++d) {
    TORCH_CHECK(!__builtin_mul_overflow(elements, shape[d], &elements),
                "checksum: global_shape has more than 2**63 elements");
  }
}

// What a checksum reads: `data`'s elements, contiguous, at an address aligned to them (a copy if
// `data` starts anywhere else in its storage: see element_aligned).
inline at::Tensor checksum_input(const at::Tensor& data) {
  const at::Tensor t = data.contiguous();
  return element_aligned(t.data_ptr(), t.element_size()) ? t : t.clone(at::MemoryFormat::Contiguous);
}

// The checked geometry of a checksum's piece (callers pass checksum_input(data)). Every check
// comes first, an empty piece's too: the backends return 0 for one only after this.
inline Geometry geometry_of(const at::Tensor& data, at::IntArrayRef shape, at::IntArrayRef offset) {
  check_global(data, shape, offset);
  Geometry g;
  TORCH_CHECK(make_geometry(data.dim(), data.sizes().data(), shape.data(), offset.data(), &g),
              "checksum: more than ", kMaxDims, " dimensions that cannot be merged");
  const int64_t width = data.element_size();
  TORCH_CHECK(width == 1 || width == 2 || width == 4 || width == 8, "checksum: unsupported element size ", width);
  return g;
}

}  // namespace nereus
