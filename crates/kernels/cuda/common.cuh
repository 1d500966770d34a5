// What every kernel file shares: the element types, their accumulators and conversions, and
// warp and block sums. Compiled by nvcc for the GPU, or by a host C++ compiler against the
// emulator (emulator/emulate.h) for the tests.
#pragma once

#ifdef LAZARUS_EMULATE
#include "../emulator/emulate.h"
#else
#include <cuda_bf16.h>
#define DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#define EMU_REGISTER(name)
#endif

typedef __nv_bfloat16 bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

// The type sums and products are carried in: f32 for f32 and bf16 data, f64 for f64.
template <class T>
struct AccOf {
    typedef float type;
};
template <>
struct AccOf<double> {
    typedef double type;
};

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(bf16 v) { return __bfloat162float(v); }

template <class T>
__device__ __forceinline__ T from_acc(float v);
template <>
__device__ __forceinline__ float from_acc<float>(float v) {
    return v;
}
template <>
__device__ __forceinline__ bf16 from_acc<bf16>(float v) {
    return __float2bfloat16(v);
}
template <class T>
__device__ __forceinline__ T from_acc(double v);
template <>
__device__ __forceinline__ double from_acc<double>(double v) {
    return v;
}

__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }
__device__ __forceinline__ float sqrt_acc(float x) { return sqrtf(x); }
__device__ __forceinline__ double sqrt_acc(double x) { return sqrt(x); }
__device__ __forceinline__ float max_acc(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_acc(double a, double b) { return fmax(a, b); }

template <class A>
__device__ __forceinline__ A neg_inf();
template <>
__device__ __forceinline__ float neg_inf<float>() {
    return -INFINITY;
}
template <>
__device__ __forceinline__ double neg_inf<double>() {
    return -(double)INFINITY;
}

// Sum over the 32 lanes of a warp, the same tree on every lane (every lane gets the sum).
template <class A>
__device__ __forceinline__ A warp_sum(A v) {
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}
template <class A>
__device__ __forceinline__ A warp_max(A v) {
    for (int m = 16; m > 0; m >>= 1) v = max_acc(v, __shfl_xor_sync(0xffffffffu, v, m));
    return v;
}

struct WarpSum {
    template <class A>
    __device__ __forceinline__ A operator()(A v) const { return warp_sum(v); }
};
struct WarpMax {
    template <class A>
    __device__ __forceinline__ A operator()(A v) const { return warp_max(v); }
};

// `warp` (WarpSum, WarpMax) over the block (blockDim.x a multiple of 32, at most 1024; every
// thread calls it; every thread gets the result): each warp's, then the warps'. `none` is the
// value that changes nothing (0 for a sum). `scratch` holds 32 values; it may be reused after
// the call returns.
template <class A, class Warp>
__device__ __forceinline__ A block_reduce(A v, A* scratch, A none, Warp warp_op) {
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = warp_op(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_op(lane < warps ? scratch[lane] : none);
}
template <class A>
__device__ __forceinline__ A block_sum(A v, A* scratch) {
    return block_reduce(v, scratch, (A)0, WarpSum());
}
template <class A>
__device__ __forceinline__ A block_max(A v, A* scratch) {
    return block_reduce(v, scratch, neg_inf<A>(), WarpMax());
}

// A grid-stride loop over n elements.
#define FOR_EACH(i, n) for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < (n); i += (u64)blockDim.x * gridDim.x)
