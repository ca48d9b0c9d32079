// The order in which both backends sum a column over its rows (a linear
// layer's bias gradient), so that the CPU backend, the reference, and the
// CUDA backend give the same bits (docs/architecture.md "Kernels",
// determinism): rows in chunks of kColumnChunkRows, each chunk summed in
// row order in double from 0; then the chunks' sums in chunk order in
// double from 0; the total rounded to float once and added to the
// destination. Chunks let the GPU give every (column, chunk) a thread of
// its own; the CPU walks the same chunks.
#pragma once

namespace keel::trainer {

inline constexpr int kColumnChunkRows = 32;

}  // namespace keel::trainer
