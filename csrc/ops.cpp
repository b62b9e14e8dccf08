// Schemas of the transition kernels, defined once; each backend registers its implementation in
// its own file (cpu/ beside this one, cuda/ where a CUDA build of PyTorch and nvcc exist).
#include <torch/library.h>

TORCH_LIBRARY(nereus, m) {
  // Sum over elements of mix(global_index * G ^ bits(element)) modulo 2**64: the same value for a
  // tensor however it is cut into pieces (each piece passing its place in the global tensor), on
  // any device.
  m.def("checksum(Tensor data, int[] global_shape, int[] global_offset) -> int");
  // Slices are rows (source, dim, start, length) of an int64 [n, 4] tensor: source.narrow(dim,
  // start, length), packed back to back (row-major) into one uint8 buffer.
  m.def("pack(Tensor[] sources, Tensor slices) -> Tensor");
  // The same into the first bytes of an existing uint8 buffer (at least as large as the slices).
  m.def("pack_into(Tensor[] sources, Tensor slices, Tensor(a!) out) -> ()");
  // The reverse: the buffer's bytes written into destination.narrow(dim, start, length).
  m.def("unpack(Tensor buffer, Tensor(a!)[] destinations, Tensor slices) -> ()");
}
