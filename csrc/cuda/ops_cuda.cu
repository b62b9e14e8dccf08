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

constexpr int kMaxDims = 8;
constexpr int kThreads = 256;

struct Geometry {
  int64_t dims;
  int64_t local[kMaxDims];
  int64_t offset[kMaxDims];
  int64_t gstride[kMaxDims];
};

__device__ __forceinline__ uint64_t mix(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

template <typename Bits>
__global__ void checksum_kernel(const Bits* data, int64_t n, Geometry g, unsigned long long* out) {
  __shared__ unsigned long long partial[kThreads];
  uint64_t sum = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t rest = i, index = 0;
    for (int64_t d = g.dims - 1; d >= 0; --d) {
      const int64_t local = rest % g.local[d];
      rest /= g.local[d];
      index += (g.offset[d] + local) * g.gstride[d];
    }
    sum += mix((static_cast<uint64_t>(index) * 0x9E3779B97F4A7C15ULL) ^ static_cast<uint64_t>(data[i]));
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int step = blockDim.x / 2; step > 0; step /= 2) {
    if (threadIdx.x < step) partial[threadIdx.x] += partial[threadIdx.x + step];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(out, partial[0]);  // wraps modulo 2**64, like the CPU sum
}

int64_t checksum_cuda(const at::Tensor& data, at::IntArrayRef global_shape, at::IntArrayRef global_offset) {
  check_global(data, global_shape, global_offset);
  TORCH_CHECK(data.dim() <= kMaxDims, "checksum: at most ", kMaxDims, " dimensions");
  const c10::cuda::CUDAGuard guard(data.device());
  const at::Tensor t = data.contiguous();
  Geometry g{};
  g.dims = t.dim();
  int64_t stride = 1;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    g.local[d] = t.size(d);
    g.offset[d] = global_offset[d];
    g.gstride[d] = stride;
    stride *= global_shape[d];
  }
  if (t.dim() == 0) {
    g.dims = 1;
    g.local[0] = 1;
    g.offset[0] = 0;
    g.gstride[0] = 1;
  }
  at::Tensor out = at::zeros({1}, t.options().dtype(at::kLong));
  const int64_t n = t.numel();
  if (n == 0) return 0;
  const int blocks = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 4096));
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto* result = reinterpret_cast<unsigned long long*>(out.data_ptr<int64_t>());
  switch (t.element_size()) {
    case 1: checksum_kernel<uint8_t><<<blocks, kThreads, 0, stream>>>(static_cast<const uint8_t*>(t.data_ptr()), n, g, result); break;
    case 2: checksum_kernel<uint16_t><<<blocks, kThreads, 0, stream>>>(static_cast<const uint16_t*>(t.data_ptr()), n, g, result); break;
    case 4: checksum_kernel<uint32_t><<<blocks, kThreads, 0, stream>>>(static_cast<const uint32_t*>(t.data_ptr()), n, g, result); break;
    case 8: checksum_kernel<uint64_t><<<blocks, kThreads, 0, stream>>>(static_cast<const uint64_t*>(t.data_ptr()), n, g, result); break;
    default: TORCH_CHECK(false, "checksum: unsupported element size ", t.element_size());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out.item<int64_t>();
}

// One descriptor per slice; one kernel moves all of them (a block per slice, 16-byte words where
// every run is aligned, bytes otherwise).
struct Run {
  uint8_t* tensor;
  int64_t buffer_offset, outer, block, stride, first;
};

template <bool kPack>
__global__ void copy_kernel(const Run* runs, uint8_t* buffer) {
  const Run r = runs[blockIdx.x];
  const bool wide = (r.block % 16 == 0) && (r.stride % 16 == 0) && (r.first % 16 == 0) &&
                    (r.buffer_offset % 16 == 0) && (reinterpret_cast<uintptr_t>(r.tensor) % 16 == 0) &&
                    (reinterpret_cast<uintptr_t>(buffer) % 16 == 0);
  const int64_t unit = wide ? 16 : 1;
  const int64_t per_run = r.block / unit;
  const int64_t total = r.outer * per_run;
  for (int64_t i = threadIdx.x; i < total; i += blockDim.x) {
    const int64_t o = i / per_run, k = i % per_run;
    uint8_t* t = r.tensor + r.first + o * r.stride + k * unit;
    uint8_t* b = buffer + r.buffer_offset + o * r.block + k * unit;
    if (wide) {
      if (kPack) *reinterpret_cast<uint4*>(b) = *reinterpret_cast<const uint4*>(t);
      else *reinterpret_cast<uint4*>(t) = *reinterpret_cast<const uint4*>(b);
    } else {
      if (kPack) *b = *t;
      else *t = *b;
    }
  }
}

template <bool kPack>
void launch(const std::vector<at::Tensor>& tensors, const std::vector<Slice>& plan, at::Tensor& buffer) {
  if (plan.empty()) return;
  std::vector<Run> host;
  for (const Slice& p : plan) {
    TORCH_CHECK(tensors[p.tensor].device() == buffer.device(), kPack ? "pack" : "unpack",
                ": every tensor must be on the buffer's device");
    host.push_back(Run{static_cast<uint8_t*>(tensors[p.tensor].data_ptr()), p.buffer_offset, p.outer, p.block,
                       p.stride, p.first});
  }
  at::Tensor runs = at::empty({static_cast<int64_t>(host.size() * sizeof(Run))}, buffer.options());
  auto stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(cudaMemcpyAsync(runs.data_ptr(), host.data(), host.size() * sizeof(Run), cudaMemcpyHostToDevice,
                                 stream));
  copy_kernel<kPack><<<static_cast<unsigned>(host.size()), kThreads, 0, stream>>>(
      reinterpret_cast<const Run*>(runs.data_ptr()), buffer.data_ptr<uint8_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));  // `host` and `runs` must outlive the copy
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
