// Rotary positions (Su et al. 2021, RoFormer) on a packed projection qkv [B, T, 3d], the CPU
// kernel's pairing (rope.rs; Llama's and Mixtral's "half-split" one): within each head of h
// columns, columns i and i + h/2 of q and of k turn together by the angle pos · θ^(−2i/h); v is
// copied. The turn is orthogonal, so the backward is the same kernel turning the gradient by the
// opposite angle (`inverse`).
#pragma once
#include "common.cuh"

// cos and sin of every (position < t, pair i < half), [t, half] each, from angles computed in f64
// as the CPU's tables are, then rounded to the accumulator type.
template <class A>
__device__ void rope_tables(A* cos_out, A* sin_out, u32 t, u32 half, u32 head, double theta) {
    FOR_EACH(i, (u64)t * half) {
        const u64 pos = i / half, k = i % half;
        const double angle = (double)pos * pow(theta, -(double)(2 * k) / (double)head);
        cos_out[i] = (A)cos(angle);
        sin_out[i] = (A)sin(angle);
    }
}

// y[r, c] for every element of rows of 3d (row r at position r mod t): one thread per output
// element, reading its pair's two inputs; every output written once.
template <class T>
__device__ void rope_apply(const T* x, T* y, const typename AccOf<T>::type* cos_t, const typename AccOf<T>::type* sin_t, u64 rows,
                           u32 t, u32 d, u32 head, u32 inverse) {
    typedef typename AccOf<T>::type A;
    const u32 width = 3 * d, half = head / 2;
    FOR_EACH(i, rows * width) {
        const u64 r = i / width;
        const u32 c = (u32)(i % width);
        if (c >= 2 * d) {
            y[i] = x[i];
            continue;
        }
        const u32 in_head = c % head, k = in_head % half;
        const u64 base = i - in_head;  // the head's first column
        const u64 at = (r % t) * half + k;
        const A cs = cos_t[at], sn = inverse ? -sin_t[at] : sin_t[at];
        const A a = (A)to_acc(x[base + k]), b = (A)to_acc(x[base + k + half]);
        y[i] = from_acc<T>(in_head < half ? a * cs - b * sn : b * cs + a * sn);
    }
}

#define ROPE_KERNELS(SUF, T)                                                                                           \
    extern "C" __global__ void lazarus_rope_##SUF(const T* x, T* y, const AccOf<T>::type* cos_t, const AccOf<T>::type* sin_t, \
                                                  u64 rows, u32 t, u32 d, u32 head, u32 inverse) {                      \
        rope_apply<T>(x, y, cos_t, sin_t, rows, t, d, head, inverse);                                                   \
    }                                                                                                                  \
    EMU_REGISTER(lazarus_rope_##SUF)
ROPE_KERNELS(f32, float)
ROPE_KERNELS(f64, double)
ROPE_KERNELS(bf16, bf16)

#define ROPE_TABLE_KERNEL(SUF, A)                                                                                     \
    extern "C" __global__ void lazarus_rope_tables_##SUF(A* cos_t, A* sin_t, u32 t, u32 half, u32 head, double theta) { \
        rope_tables<A>(cos_t, sin_t, t, half, head, theta);                                                            \
    }                                                                                                                  \
    EMU_REGISTER(lazarus_rope_tables_##SUF)
ROPE_TABLE_KERNEL(f32, float)
ROPE_TABLE_KERNEL(f64, double)
