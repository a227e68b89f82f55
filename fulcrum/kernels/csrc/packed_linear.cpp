// oneDNN's prepacked linear (torch's mkldnn::_linear_pointwise on a weight from _reorder_linear_weight,
// cpu_prepack.py) as a C entry point, so that the decode stack (decode_stack.cpp) takes it for batches past the GEMV's
// rows instead of leaving those steps to the modules and their Python between kernels. The packed weight is an opaque
// tensor (no pointer to its data): it comes as its TensorImpl handle (`Tensor._cdata`), which the caller keeps alive.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/from_blob.h>

#include <cstring>

#include "exports.h"

// y [M, O] = x [M, I] @ W^T + bias, all in x's dtype (bf16 or fp32, the packed weight's); bias [O] or null.
// Returns 0, or -1 where the op failed (the stack's caller then raises).
extern "C" int64_t fulcrum_packed_linear(int64_t bf16, const void* x, const void* packed, const void* bias, void* y,
                                         int64_t M, int64_t I, int64_t O) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  try {
    const auto opts = at::TensorOptions().dtype(bf16 ? at::kBFloat16 : at::kFloat);
    // a second owning reference to the caller's tensor (reclaim_copy adds one; this Tensor drops it)
    at::Tensor w(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim_copy(
        static_cast<c10::TensorImpl*>(const_cast<void*>(packed))));
    torch::jit::Stack stack;
    stack.emplace_back(at::from_blob(const_cast<void*>(x), {M, I}, opts));
    stack.emplace_back(std::move(w));
    stack.emplace_back(bias ? c10::IValue(at::from_blob(const_cast<void*>(bias), {O}, opts)) : c10::IValue());
    stack.emplace_back(std::string("none"));
    stack.emplace_back(c10::List<std::optional<at::Scalar>>());
    stack.emplace_back(std::string(""));
    op.callBoxed(&stack);
    const at::Tensor out = stack.back().toTensor();
    std::memcpy(y, out.data_ptr(), size_t(M * O) * (bf16 ? 2 : 4));
    return 0;
  } catch (const std::exception&) {
    return -1;
  }
}
