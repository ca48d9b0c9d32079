#include "checkpoint/hdf5_handle.h"

#include "common/error.h"


namespace keel::checkpoint {

H5Handle::H5Handle(hid_t id, Closer close, const std::string& what) : id_(id), close_(close) {
  if (id < 0) throw common::Error(common::ErrorCode::kCheckpointFailure, what);
}

H5Handle& H5Handle::operator=(H5Handle&& other) noexcept {
  if (this != &other) {
    reset();
    id_ = std::exchange(other.id_, -1);
    close_ = other.close_;
  }
  return *this;
}

void H5Handle::reset() {
  if (id_ >= 0 && close_ != nullptr) close_(id_);
  id_ = -1;
}

void H5Handle::close(const std::string& what) {
  const hid_t id = std::exchange(id_, -1);
  if (id >= 0) h5_check(close_(id), what);
}

void h5_check(herr_t rc, const std::string& what) {
  if (rc < 0) throw common::Error(common::ErrorCode::kCheckpointFailure, what);
}

void quiet_hdf5() {
  // Per thread: a thread-safe HDF5 keeps the setting per thread.
  thread_local bool quiet = false;
  if (!quiet) H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  quiet = true;
}

void write_string_attribute(hid_t object, const char* name, const std::string& value) {
  H5Handle type(H5Tcopy(H5T_C_S1), H5Tclose, "H5Tcopy");
  h5_check(H5Tset_size(type.get(), value.empty() ? 1 : value.size()), "H5Tset_size");
  H5Handle space(H5Screate(H5S_SCALAR), H5Sclose, "H5Screate");
  H5Handle attribute(H5Acreate2(object, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose,
                     std::string("cannot create attribute ") + name);
  const std::string padded = value.empty() ? std::string(1, '\0') : value;
  h5_check(H5Awrite(attribute.get(), type.get(), padded.data()), std::string("cannot write attribute ") + name);
}

void write_int64_attribute(hid_t object, const char* name, const std::vector<int64_t>& values) {
  const hsize_t n = values.size();
  H5Handle space(H5Screate_simple(1, &n, nullptr), H5Sclose, "H5Screate_simple");
  H5Handle attribute(H5Acreate2(object, name, H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose,
                     std::string("cannot create attribute ") + name);
  h5_check(H5Awrite(attribute.get(), H5T_NATIVE_INT64, values.data()), std::string("cannot write attribute ") + name);
}

std::string read_string_attribute(hid_t object, const char* name) {
  H5Handle attribute(H5Aopen(object, name, H5P_DEFAULT), H5Aclose, std::string("no attribute ") + name);
  H5Handle type(H5Aget_type(attribute.get()), H5Tclose, "H5Aget_type");
  if (H5Tget_class(type.get()) != H5T_STRING || H5Tis_variable_str(type.get()) > 0) {
    throw common::Error(common::ErrorCode::kCheckpointFailure,
                        std::string("attribute ") + name + " is not a fixed-length string");
  }
  std::string value(H5Tget_size(type.get()), '\0');
  h5_check(H5Aread(attribute.get(), type.get(), value.data()), std::string("cannot read attribute ") + name);
  value.resize(value.find('\0') == std::string::npos ? value.size() : value.find('\0'));
  return value;
}

std::vector<int64_t> read_int64_attribute(hid_t object, const char* name) {
  H5Handle attribute(H5Aopen(object, name, H5P_DEFAULT), H5Aclose, std::string("no attribute ") + name);
  H5Handle space(H5Aget_space(attribute.get()), H5Sclose, "H5Aget_space");
  const hssize_t n = H5Sget_simple_extent_npoints(space.get());
  if (n < 0 || n > 16) {
    throw common::Error(common::ErrorCode::kCheckpointFailure, std::string("attribute ") + name + " has a bad size");
  }
  std::vector<int64_t> values(static_cast<size_t>(n));
  h5_check(H5Aread(attribute.get(), H5T_NATIVE_INT64, values.data()), std::string("cannot read attribute ") + name);
  return values;
}

}  // namespace keel::checkpoint
