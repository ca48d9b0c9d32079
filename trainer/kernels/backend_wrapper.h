// A Backend that forwards every kernel to another one: a fault injector or
// a test derives from it and overrides only the kernel it breaks (the
// FileSystemWrapper pattern of checkpoint/file_system.h).
#pragma once

#include "trainer/kernels/backend.h"

namespace keel::trainer {

class BackendWrapper : public Backend {
 public:
  explicit BackendWrapper(Backend& target) : target_(target) {}

  bool host_memory() const override { return target_.host_memory(); }
  const char* name() const override { return target_.name(); }
  void* alloc(size_t bytes) override { return target_.alloc(bytes); }
  void free(void* ptr) override { target_.free(ptr); }
  void zero(void* ptr, size_t bytes) override { target_.zero(ptr, bytes); }
  void copy_from_host(void* dst, const void* host_src, size_t bytes) override {
    target_.copy_from_host(dst, host_src, bytes);
  }
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override {
    target_.copy_to_host(host_dst, src, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) override { target_.copy(dst, src, bytes); }
  size_t scratch_bytes() const override { return target_.scratch_bytes(); }
  void pin_host(void* data, size_t bytes) override { target_.pin_host(data, bytes); }
  void unpin_host(void* data) override { target_.unpin_host(data); }
  void snapshot_to_host(const std::vector<HostCopy>& copies) override { target_.snapshot_to_host(copies); }
  Stream& compute_stream() override { return target_.compute_stream(); }
  DType gemm_inputs() const override { return target_.gemm_inputs(); }
#define KEEL_BACKEND_KERNEL(ret, name, params, args) \
  ret name params override { return target_.name args; }
#include "trainer/kernels/backend_kernels.def"
#undef KEEL_BACKEND_KERNEL

 protected:
  Backend& target_;
};

}  // namespace keel::trainer
