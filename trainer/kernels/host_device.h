// KEEL_HOST_DEVICE marks per-element math that the host compiler and nvcc
// both compile, so that the CPU backend (the reference) and the CUDA
// backend run one formula (adamw_step.h, gelu.h).
#pragma once

#if defined(__CUDACC__)
#define KEEL_HOST_DEVICE __host__ __device__
#else
#define KEEL_HOST_DEVICE
#endif
