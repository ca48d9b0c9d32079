// RAII for HDF5 identifiers, and errors that say which call failed. HDF5's
// own error stack printing is switched off: failures become
// Error(kCheckpointFailure) naming the file and the step that failed.
#pragma once

#include <hdf5.h>

#include <string>
#include <utility>
#include <vector>

namespace keel::checkpoint {

class H5Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  H5Handle() = default;
  // Throws Error(kCheckpointFailure) with `what` when id is negative.
  H5Handle(hid_t id, Closer close, const std::string& what);
  ~H5Handle() { reset(); }
  H5Handle(H5Handle&& other) noexcept : id_(std::exchange(other.id_, -1)), close_(other.close_) {}
  H5Handle& operator=(H5Handle&& other) noexcept;
  H5Handle(const H5Handle&) = delete;
  H5Handle& operator=(const H5Handle&) = delete;

  hid_t get() const { return id_; }
  // Closes now, reporting a failure (H5Fclose flushes, so it can fail).
  void close(const std::string& what);

 private:
  void reset();
  hid_t id_ = -1;
  Closer close_ = nullptr;
};

// Throws Error(kCheckpointFailure) with `what` when rc is negative.
void h5_check(herr_t rc, const std::string& what);
// Switches off HDF5's printing of its error stack for the calling thread.
void quiet_hdf5();

void write_string_attribute(hid_t object, const char* name, const std::string& value);
void write_int64_attribute(hid_t object, const char* name, const std::vector<int64_t>& values);
std::string read_string_attribute(hid_t object, const char* name);
std::vector<int64_t> read_int64_attribute(hid_t object, const char* name);

}  // namespace keel::checkpoint
