// CUDA implementations of the nereus ops (hipified by PyTorch's extension builder on ROCm).
// Joins the build only where PyTorch is a CUDA/ROCm build and a device compiler exists.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstring>

#include "../slices.h"
#include "kernels.cuh"

namespace nereus {
namespace {

int64_t checksum_cuda(const at::Tensor& data, at::IntArrayRef global_shape, at::IntArrayRef global_offset) {
  const c10::cuda::CUDAGuard guard(data.device());
  const at::Tensor t = checksum_input(data);
  const Geometry g = geometry_of(t, global_shape, global_offset);
  if (t.numel() == 0) return 0;
  const Tiling tiling = make_tiling(g, kTileElements);
  at::Tensor out = at::zeros({1}, t.options().dtype(at::kLong));
  const unsigned blocks = checksum_blocks(tiling);
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

// Validation is done (plan_*, devices included, before any byte is written); this launches one
// kernel for every chunk of every slice, stream-ordered like any torch op.
template <bool kPack>
void launch(const std::vector<at::Tensor>& tensors, const std::vector<Slice>& plan, at::Tensor& buffer) {
  const std::vector<Chunk> chunks = chunk_plan(plan, kChunkBytes);
  if (chunks.empty()) return;
  std::vector<uint8_t*> bases;
  for (const at::Tensor& t : tensors) bases.push_back(static_cast<uint8_t*>(t.data_ptr()));
  const std::vector<Run> host = make_runs(plan, chunks, bases, buffer.data_ptr<uint8_t>());
  // Up through pinned memory, stream-ordered: copy_ records the pinned block's use on the stream,
  // so PyTorch's host allocator does not hand it out again before the copy is done.
  const int64_t nbytes = static_cast<int64_t>(host.size() * sizeof(Run));
  at::Tensor staged = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(staged.data_ptr(), host.data(), nbytes);
  at::Tensor runs = at::empty({nbytes}, buffer.options());
  runs.copy_(staged, /*non_blocking=*/true);
  auto stream = c10::cuda::getCurrentCUDAStream();
  for (size_t first = 0; first < host.size(); first += kMaxBlocks) {
    const unsigned blocks = static_cast<unsigned>(std::min<size_t>(kMaxBlocks, host.size() - first));
    copy_kernel<kPack><<<blocks, kThreads, 0, stream>>>(reinterpret_cast<const Run*>(runs.data_ptr()) + first);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

at::Tensor pack_cuda(at::TensorList sources, const at::Tensor& slices) {
  std::vector<at::Tensor> tensors(sources.begin(), sources.end());
  TORCH_CHECK(!tensors.empty(), "pack: no source tensors");
  // Planning runs on the host, before the device guard (which needs a CUDA device): a tensor on
  // another device gets the planning's message, here as in every op below.
  const std::vector<Slice> plan = plan_pack(tensors, slices);
  const c10::cuda::CUDAGuard guard(tensors[0].device());
  at::Tensor buffer = at::empty({total_bytes(plan)}, tensors[0].options().dtype(at::kByte));
  launch<true>(tensors, plan, buffer);
  return buffer;
}

void pack_into_cuda(at::TensorList sources, const at::Tensor& slices, at::Tensor out) {
  std::vector<at::Tensor> tensors(sources.begin(), sources.end());
  const std::vector<Slice> plan = plan_pack_into(tensors, slices, out);
  const c10::cuda::CUDAGuard guard(out.device());
  launch<true>(tensors, plan, out);
}

void unpack_cuda(const at::Tensor& buffer, at::TensorList destinations, const at::Tensor& slices) {
  std::vector<at::Tensor> tensors(destinations.begin(), destinations.end());
  const std::vector<Slice> plan = plan_unpack(buffer, tensors, slices);
  const c10::cuda::CUDAGuard guard(buffer.device());
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
