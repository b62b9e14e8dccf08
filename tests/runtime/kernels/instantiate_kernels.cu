// Every kernel of csrc/cuda/kernels.cuh, instantiated as ops_cuda.cu launches them, for
// test_nvcc.py to compile with nvcc alone (no ATen, no GPU).
#include "kernels.cuh"

namespace nereus {
template __global__ void checksum_kernel<uint8_t>(const uint8_t*, Geometry, Tiling, unsigned long long*);
template __global__ void checksum_kernel<uint16_t>(const uint16_t*, Geometry, Tiling, unsigned long long*);
template __global__ void checksum_kernel<uint32_t>(const uint32_t*, Geometry, Tiling, unsigned long long*);
template __global__ void checksum_kernel<uint64_t>(const uint64_t*, Geometry, Tiling, unsigned long long*);
template __global__ void copy_kernel<true>(const Run*);
template __global__ void copy_kernel<false>(const Run*);
}  // namespace nereus
