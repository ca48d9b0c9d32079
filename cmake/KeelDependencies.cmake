# Every dependency comes from Debian's packages (scripts/setup installs them);
# nothing is vendored.
find_package(PkgConfig REQUIRED)
find_package(Threads REQUIRED)
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(Boost 1.74 REQUIRED COMPONENTS system)
# TLS to etcd (store/etcd_gateway.cpp), through Boost.Asio's ssl streams.
find_package(OpenSSL REQUIRED)
find_package(spdlog REQUIRED)
find_package(fmt REQUIRED)
find_package(doctest REQUIRED)
find_package(tomlplusplus REQUIRED)
find_package(CLI11 REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(Gloo REQUIRED)
find_package(HDF5 REQUIRED COMPONENTS C)
pkg_check_modules(URING REQUIRED IMPORTED_TARGET liburing)
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)
pkg_check_modules(SYSTEMD REQUIRED IMPORTED_TARGET libsystemd)
# keelctl stragglers --plot draws its heat map with cairo.
pkg_check_modules(CAIRO REQUIRED IMPORTED_TARGET cairo)
pkg_check_modules(SENTENCEPIECE REQUIRED IMPORTED_TARGET sentencepiece)

# OpenBLAS: link the OpenMP build explicitly. It shares libgomp's thread pool
# with keel's own kernels and runs single-threaded when called from inside a
# parallel region, so the two never oversubscribe the cores. Debian's
# alternatives symlink would otherwise pick whichever variant has priority.
set(KEEL_OPENBLAS_DIR /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-openmp)
find_library(KEEL_OPENBLAS_LIB NAMES openblas PATHS ${KEEL_OPENBLAS_DIR} NO_DEFAULT_PATH)
find_path(KEEL_CBLAS_INCLUDE cblas.h PATHS /usr/include/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-openmp NO_DEFAULT_PATH)
if(NOT KEEL_OPENBLAS_LIB OR NOT KEEL_CBLAS_INCLUDE)
  message(FATAL_ERROR "OpenBLAS (OpenMP build) not found: run scripts/setup or apt-get install libopenblas-openmp-dev")
endif()
add_library(keel_openblas INTERFACE)
target_link_libraries(keel_openblas INTERFACE ${KEEL_OPENBLAS_LIB} OpenMP::OpenMP_CXX)
target_include_directories(keel_openblas INTERFACE ${KEEL_CBLAS_INCLUDE})

add_library(keel_hdf5 INTERFACE)
target_include_directories(keel_hdf5 INTERFACE ${HDF5_C_INCLUDE_DIRS})
target_link_libraries(keel_hdf5 INTERFACE ${HDF5_C_LIBRARIES})

# The PyTorch oracle and the benchmark need Debian's python3-torch, so they
# run with the system interpreter, not whatever python3 comes first on PATH.
set(KEEL_SYSTEM_PYTHON /usr/bin/python3 CACHE FILEPATH
    "Python interpreter with Debian's python3-torch and numpy, for the PyTorch oracle and benchmarks")
