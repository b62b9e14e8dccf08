// Schemas of the transition kernels, defined once; each backend registers its implementation in
// its own file (cpu/ beside this one, cuda/ where a CUDA build of PyTorch and nvcc exist). Here too,
// for every backend: what autograd needs of the two ops that write into their arguments.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <string>

namespace nereus {
namespace {

// Backend kernels take pack_into's out by value: the same C++ signature here (the dispatcher
// requires one per op).
using PackInto = void(at::TensorList, const at::Tensor&, at::Tensor);
using Unpack = void(const at::Tensor&, at::TensorList, const at::Tensor&);

const c10::TypedOperatorHandle<PackInto>& pack_into_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("nereus::pack_into", "").typed<PackInto>();
  return op;
}

const c10::TypedOperatorHandle<Unpack>& unpack_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("nereus::unpack", "").typed<Unpack>();
  return op;
}

// Autograd: the ops are not differentiable. Writing into a tensor that requires grad (a leaf such
// as a parameter, or one whose history autograd would have to rewrite) is refused, before any byte
// is written, while grad mode is on; under torch.no_grad() it is what loading weights does.
// pack_into writes only out, uint8, which never requires grad; what it reads needs no history.
constexpr const char* kNotDifferentiable =
    " requires grad and the op is not differentiable: write into it under torch.no_grad(), or into a tensor that "
    "does not require grad";

void pack_into_autograd(c10::DispatchKeySet keys, at::TensorList sources, const at::Tensor& slices, at::Tensor out) {
  TORCH_CHECK(!(at::GradMode::is_enabled() && out.requires_grad()), "pack_into: out", kNotDifferentiable);
  at::AutoDispatchBelowAutograd guard;
  pack_into_op().redispatch(keys & c10::after_autograd_keyset, sources, slices, out);
}

void unpack_autograd(c10::DispatchKeySet keys, const at::Tensor& buffer, at::TensorList destinations,
                     const at::Tensor& slices) {
  const bool grad = at::GradMode::is_enabled();
  for (size_t i = 0; i < destinations.size(); ++i) {
    TORCH_CHECK(!(grad && destinations[i].requires_grad()), "unpack: destination ", i, kNotDifferentiable);
  }
  at::AutoDispatchBelowAutograd guard;
  unpack_op().redispatch(keys & c10::after_autograd_keyset, buffer, destinations, slices);
}

// ADInplaceOrView (which runs for every call outside inference mode): like every in-place op, bump
// the version of what was written (views share it), so that autograd refuses a backward that saved
// the old values. Before any byte is written, refuse what that could not follow: an inference
// tensor outside inference mode has no version to bump (torch would raise after the write), and a
// conjugate or negative view's bytes are not its values (torch's fallback for those refuses a
// written one too, only later and in other words).
void check_writable(const at::Tensor& t, const char* op, const char* what, int64_t index = -1) {
  const auto name = index < 0 ? std::string(what) : std::string(what) + " " + std::to_string(index);
  TORCH_CHECK(!t.is_inference() || c10::InferenceMode::is_enabled(), op, ": ", name,
              " is an inference tensor, written outside inference mode: write into it under "
              "torch.inference_mode(), or into a tensor made outside it");
  TORCH_CHECK(!t.is_conj() && !t.is_neg(), op, ": ", name,
              " is a conjugate or negative view, whose bytes are not its values: write into a resolved "
              "tensor (resolve_conj(), resolve_neg())");
}

void pack_into_inplace(c10::DispatchKeySet keys, at::TensorList sources, const at::Tensor& slices, at::Tensor out) {
  check_writable(out, "pack_into", "out");
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    pack_into_op().redispatch(keys & c10::after_ADInplaceOrView_keyset, sources, slices, out);
  }
  out.unsafeGetTensorImpl()->bump_version();
}

void unpack_inplace(c10::DispatchKeySet keys, const at::Tensor& buffer, at::TensorList destinations,
                    const at::Tensor& slices) {
  for (size_t i = 0; i < destinations.size(); ++i) {
    check_writable(destinations[i], "unpack", "destination", static_cast<int64_t>(i));
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    unpack_op().redispatch(keys & c10::after_ADInplaceOrView_keyset, buffer, destinations, slices);
  }
  for (const at::Tensor& t : destinations) t.unsafeGetTensorImpl()->bump_version();
}

}  // namespace
}  // namespace nereus

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

TORCH_LIBRARY_IMPL(nereus, Autograd, m) {
  m.impl("pack_into", TORCH_FN(nereus::pack_into_autograd));
  m.impl("unpack", TORCH_FN(nereus::unpack_autograd));
}

TORCH_LIBRARY_IMPL(nereus, ADInplaceOrView, m) {
  m.impl("pack_into", TORCH_FN(nereus::pack_into_inplace));
  m.impl("unpack", TORCH_FN(nereus::unpack_inplace));
}
