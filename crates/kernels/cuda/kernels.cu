// Lazarus's CUDA kernels, one translation unit: compiled to PTX by build.rs with nvcc (the `cuda`
// feature), and, with LAZARUS_EMULATE, to host code run by the emulator in the tests. Each file
// holds one family; every kernel is `extern "C"` (its launch names it) and registered with the
// emulator (EMU_REGISTER, empty for the GPU).
#include "attention.cuh"
#include "attention_mma.cuh"
#include "elementwise.cuh"
#include "norm.cuh"
#include "rope.cuh"
#include "rows.cuh"
