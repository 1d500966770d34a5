// Elementwise kernels: GELU and SwiGLU with their derivatives, the expert FFNs' bias adds fused
// with the activation, casts, AdamW and the sums of squares of the gradient norm — what candle's
// ops would do in several launches per tensor, in one.
#pragma once
#include "common.cuh"

// GELU, tanh form, and its derivative: the CPU kernels' formulas (gelu.rs):
// gelu(x) = x·s, s = 1 / (1 + exp(−2c(x + a·x³))); gelu'(x) = s + 2x·s(1 − s)·c(1 + 3a·x²).
#define GELU_C 0.7978845608028654
#define GELU_A 0.044715
template <class A>
__device__ __forceinline__ A gelu_of(A v) {
    return v / ((A)1 + exp_acc((A)(-2.0 * GELU_C) * (v + (A)GELU_A * v * v * v)));
}
template <class A>
__device__ __forceinline__ A gelu_grad_of(A v) {
    const A s = (A)1 / ((A)1 + exp_acc((A)(-2.0 * GELU_C) * (v + (A)GELU_A * v * v * v)));
    return s + v * (A)2 * s * ((A)1 - s) * (A)GELU_C * ((A)1 + (A)(3.0 * GELU_A) * v * v);
}

template <class T>
__device__ void gelu_map(const T* x, T* y, u64 n) {
    typedef typename AccOf<T>::type A;
    FOR_EACH(i, n) y[i] = from_acc<T>(gelu_of((A)to_acc(x[i])));
}
template <class T>
__device__ void gelu_grad_map(const T* x, T* y, u64 n) {
    typedef typename AccOf<T>::type A;
    FOR_EACH(i, n) y[i] = from_acc<T>(gelu_grad_of((A)to_acc(x[i])));
}

// The segment (expert) of row r: the last e < groups with seg[e] ≤ r (seg: groups + 1 row
// offsets, seg[0] = 0).
__device__ __forceinline__ u32 segment_of(const u32* seg, u32 groups, u64 r) {
    u32 lo = 0, hi = groups;
    while (hi - lo > 1) {
        const u32 mid = (lo + hi) / 2;
        if (seg[mid] <= r) lo = mid;
        else hi = mid;
    }
    return lo;
}

// The first layer's epilogue of grouped FFNs over rows of f, a block per row: pre = h + b[e]
// (written over h, kept for the backward) and act = gelu(pre), e the row's segment (found once
// per row); `bias` holds each segment's bias address (null: no bias, as in a model without FFN
// biases).
template <class T, class Tb>
__device__ void bias_gelu_fwd(T* h, T* act, const u64* bias, const u32* seg, u32 groups, u64 rows, u32 f) {
    typedef typename AccOf<T>::type A;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const Tb* b = (const Tb*)bias[segment_of(seg, groups, r)];
        T* hr = h + r * f;
        T* ar = act + r * f;
        for (u32 c = threadIdx.x; c < f; c += blockDim.x) {
            // The activation is taken of the stored (rounded) pre-activation: the backward's
            // derivative is of the same value.
            const T pre = from_acc<T>((A)to_acc(hr[c]) + (b ? (A)to_acc(b[c]) : (A)0));
            hr[c] = pre;
            ar[c] = from_acc<T>(gelu_of((A)to_acc(pre)));
        }
    }
}

// g ← g · gelu'(pre), in place.
template <class T>
__device__ void gelu_bwd_inplace(const T* pre, T* g, u64 n) {
    typedef typename AccOf<T>::type A;
    FOR_EACH(i, n) g[i] = from_acc<T>((A)to_acc(g[i]) * gelu_grad_of((A)to_acc(pre[i])));
}

// SwiGLU (Shazeer 2020), the activation of Mixtral's experts: a hidden row h = [gate | up] of
// 2f values gives a = SiLU(gate) ⊙ up, SiLU(x) = x·σ(x); the backward from ga writes
// d gate = ga ⊙ up ⊙ SiLU'(gate), d up = ga ⊙ SiLU(gate), SiLU'(x) = σ(x)·(1 + x·(1 − σ(x))).
// The CPU kernels' formulas (swiglu.rs).
template <class A>
__device__ __forceinline__ A sigmoid_of(A v) {
    return (A)1 / ((A)1 + exp_acc(-v));
}

// a [rows, f] from h [rows, 2f], one thread per output.
template <class T>
__device__ void swiglu_fwd(const T* h, T* a, u64 rows, u32 f) {
    typedef typename AccOf<T>::type A;
    FOR_EACH(i, rows * f) {
        const u64 r = i / f, c = i % f;
        const A g = (A)to_acc(h[r * 2 * f + c]), u = (A)to_acc(h[r * 2 * f + f + c]);
        a[i] = from_acc<T>(g * sigmoid_of(g) * u);
    }
}

// The first layer's epilogue of grouped SwiGLU FFNs over rows of 2f, a block per row: pre = h +
// b[e] (written over h, kept for the backward) and act = SiLU(gate) ⊙ up of the stored (rounded)
// pre-activation, e the row's segment (a null bias: none); each thread owns a column pair (c, f + c).
template <class T, class Tb>
__device__ void bias_swiglu_fwd(T* h, T* act, const u64* bias, const u32* seg, u32 groups, u64 rows, u32 f) {
    typedef typename AccOf<T>::type A;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const Tb* b = (const Tb*)bias[segment_of(seg, groups, r)];
        T* hr = h + r * 2 * f;
        T* ar = act + r * f;
        for (u32 c = threadIdx.x; c < f; c += blockDim.x) {
            const T gate = from_acc<T>((A)to_acc(hr[c]) + (b ? (A)to_acc(b[c]) : (A)0));
            const T up = from_acc<T>((A)to_acc(hr[f + c]) + (b ? (A)to_acc(b[f + c]) : (A)0));
            hr[c] = gate;
            hr[f + c] = up;
            const A g = (A)to_acc(gate);
            ar[c] = from_acc<T>(g * sigmoid_of(g) * (A)to_acc(up));
        }
    }
}

// gh [rows, 2f] from ga [rows, f] and the pre-activation h [rows, 2f], one thread per column pair.
template <class T>
__device__ void swiglu_bwd(const T* h, const T* ga, T* gh, u64 rows, u32 f) {
    typedef typename AccOf<T>::type A;
    FOR_EACH(i, rows * f) {
        const u64 r = i / f, c = i % f;
        const A x = (A)to_acc(h[r * 2 * f + c]), u = (A)to_acc(h[r * 2 * f + f + c]), g = (A)to_acc(ga[i]);
        const A s = sigmoid_of(x);
        gh[r * 2 * f + c] = from_acc<T>(g * u * (s * ((A)1 + x * ((A)1 - s))));
        gh[r * 2 * f + f + c] = from_acc<T>(g * x * s);
    }
}

// y ← y + b[e] over rows of d, e the row's segment (a null bias: y unchanged); a block per row.
template <class T, class Tb>
__device__ void bias_add_rows(T* y, const u64* bias, const u32* seg, u32 groups, u64 rows, u32 d) {
    typedef typename AccOf<T>::type A;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const Tb* b = (const Tb*)bias[segment_of(seg, groups, r)];
        if (!b) continue;  // the same in every thread of the block
        T* yr = y + r * d;
        for (u32 c = threadIdx.x; c < d; c += blockDim.x) yr[c] = from_acc<T>((A)to_acc(yr[c]) + (A)to_acc(b[c]));
    }
}

template <class Tin, class Tout>
__device__ void cast_map(const Tin* x, Tout* y, u64 n) {
    FOR_EACH(i, n) y[i] = from_acc<Tout>(to_acc(x[i]));
}

// AdamW on one f32 tensor, in place: the same formula, in the same order, as the CPU pass
// (optim.rs, adamw_pass): m and v move by the scaled gradient, then
// p <- p * keep - step_size * m / (sqrt(v) * inv_bc2_sqrt + eps). With `copy` not null, the bf16
// working copy of the parameter is refreshed from the new value in the same pass.
// One element's update: the one home of the formula (the list kernel below takes it too).
template <class Tg>
__device__ __forceinline__ void adamw_element(float* p, const Tg* g, float* m, float* v, bf16* copy, u64 i, float b1, float b2,
                                              float scale, float step_size, float inv_bc2_sqrt, float eps, float keep) {
    const float gi = to_acc(g[i]) * scale;
    const float mi = b1 * m[i] + (1.0f - b1) * gi;
    const float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float pi = p[i] * keep - step_size * mi / (sqrtf(vi) * inv_bc2_sqrt + eps);
    p[i] = pi;
    if (copy) copy[i] = __float2bfloat16(pi);
}

template <class Tg>
__device__ void adamw(float* p, const Tg* g, float* m, float* v, bf16* copy, u64 n, float b1, float b2, float scale,
                      float step_size, float inv_bc2_sqrt, float eps, float keep) {
    FOR_EACH(i, n) adamw_element(p, g, m, v, copy, i, b1, b2, scale, step_size, inv_bc2_sqrt, eps, keep);
}

// The tensor of part q of a list: the last t < tensors with starts[t] ≤ q (starts: each tensor's
// first part, ascending).
template <class S>
__device__ __forceinline__ u32 tensor_of_part(const S* starts, u32 tensors, u64 q) {
    u32 lo = 0, hi = tensors - 1;
    while (lo < hi) {
        const u32 mid = (lo + hi + 1) / 2;
        if ((u64)starts[mid] <= q) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// AdamW on every f32 tensor of a list in one launch (a model's hundreds of tensors would each be
// a launch of their own): `table` holds the parts' starts, then one record per tensor. starts[t]
// (t ≤ tensors) is the first part of tensor t, starts[tensors] the total; a record is ADAMW_RECORD
// u64s: p, g, m, v, copy (0: none), n, then the seven coefficients as f32 bits, two a word, in
// the kernel's order. Blocks stride over the parts (`part` elements each); each element takes
// adamw_element, the single-tensor kernel's, so the bits are its bits.
#define ADAMW_RECORD 10
__device__ void adamw_list(const u64* table, u32 tensors, u64 part) {
    const u64* starts = table;
    const u64* records = table + tensors + 1;
    const u64 total = starts[tensors];
    for (u64 q = blockIdx.x; q < total; q += gridDim.x) {
        // (An empty tensor has no part.)
        const u32 lo_t = tensor_of_part(starts, tensors, q);
        const u64* r = records + (u64)lo_t * ADAMW_RECORD;
        float k[8];
        for (int j = 0; j < 4; ++j) {
            const u64 w = r[6 + j];
            const u32 a = (u32)(w & 0xffffffffu), b = (u32)(w >> 32);
            k[2 * j] = __uint_as_float(a);
            k[2 * j + 1] = __uint_as_float(b);
        }
        float* p = (float*)r[0];
        const float* g = (const float*)r[1];
        float* m = (float*)r[2];
        float* v = (float*)r[3];
        bf16* copy = (bf16*)r[4];
        const u64 n = r[5], lo = (q - starts[lo_t]) * part, hi = lo + part < n ? lo + part : n;
        for (u64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            adamw_element(p, g, m, v, copy, i, k[0], k[1], k[2], k[3], k[4], k[5], k[6]);
        }
    }
}

// Sums of squares of f32 tensors in f64, in two launches and a fixed order (the same bits on every
// run, unlike atomics). Each block of a tensor's pass sums its contiguous part (part elements)
// into parts[first + blockIdx.x]; then one block per tensor adds its parts in order.
// Σ x² over each part (`part` elements) of every f32 tensor of a list, in f64: part p of the
// list (starts[t] ≤ p < starts[t+1]: tensor t, its (p - starts[t])-th part) into parts[p]. One
// launch for every tensor of a model; blocks stride over the parts.
__device__ void sum_squares_parts(const u64* addrs, const u64* lens, const u32* starts, u32 tensors, u64 part, double* parts) {
    __shared__ double scratch[32];
    const u32 total = starts[tensors];
    for (u32 p = blockIdx.x; p < total; p += gridDim.x) {
        // (An empty tensor has one part.)
        const u32 lo_t = tensor_of_part(starts, tensors, p);
        const float* x = (const float*)addrs[lo_t];
        const u64 n = lens[lo_t], lo = (u64)(p - starts[lo_t]) * part, hi = lo + part < n ? lo + part : n;
        double acc = 0.0;
        for (u64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            const double xi = (double)x[i];
            acc += xi * xi;
        }
        acc = block_sum(acc, scratch);
        if (threadIdx.x == 0) parts[p] = acc;
        __syncthreads();  // scratch is reused by the next part
    }
}

// out[t] = Σ_{p = starts[t]}^{starts[t+1]-1} parts[p], one block per tensor t.
__device__ void sum_parts(const double* parts, const u32* starts, double* out, u32 tensors) {
    __shared__ double scratch[32];
    for (u32 t = blockIdx.x; t < tensors; t += gridDim.x) {
        const u32 lo = starts[t], hi = starts[t + 1];
        double acc = 0.0;
        for (u32 p = lo + threadIdx.x; p < hi; p += blockDim.x) acc += parts[p];
        acc = block_sum(acc, scratch);
        if (threadIdx.x == 0) out[t] = acc;
    }
}

#define GELU_KERNELS(SUF, T)                                                                                          \
    extern "C" __global__ void lazarus_gelu_##SUF(const T* x, T* y, u64 n) { gelu_map<T>(x, y, n); }                 \
    EMU_REGISTER(lazarus_gelu_##SUF)                                                                                  \
    extern "C" __global__ void lazarus_gelu_grad_##SUF(const T* x, T* y, u64 n) { gelu_grad_map<T>(x, y, n); }       \
    EMU_REGISTER(lazarus_gelu_grad_##SUF)                                                                             \
    extern "C" __global__ void lazarus_gelu_bwd_inplace_##SUF(const T* pre, T* g, u64 n) { gelu_bwd_inplace<T>(pre, g, n); } \
    EMU_REGISTER(lazarus_gelu_bwd_inplace_##SUF)
GELU_KERNELS(f32, float)
GELU_KERNELS(f64, double)
GELU_KERNELS(bf16, bf16)

#define BIAS_KERNELS(SUF, T, TB)                                                                                          \
    extern "C" __global__ void lazarus_bias_gelu_fwd_##SUF(T* h, T* act, const u64* bias, const u32* seg, u32 groups,    \
                                                           u64 rows, u32 f) {                                            \
        bias_gelu_fwd<T, TB>(h, act, bias, seg, groups, rows, f);                                                        \
    }                                                                                                                     \
    EMU_REGISTER(lazarus_bias_gelu_fwd_##SUF)                                                                             \
    extern "C" __global__ void lazarus_bias_add_rows_##SUF(T* y, const u64* bias, const u32* seg, u32 groups, u64 rows,  \
                                                           u32 d) {                                                      \
        bias_add_rows<T, TB>(y, bias, seg, groups, rows, d);                                                             \
    }                                                                                                                     \
    EMU_REGISTER(lazarus_bias_add_rows_##SUF)
BIAS_KERNELS(f32, float, float)
BIAS_KERNELS(f64, double, double)
BIAS_KERNELS(bf16, bf16, float)

#define SWIGLU_KERNELS(SUF, T, TB)                                                                                        \
    extern "C" __global__ void lazarus_swiglu_fwd_##SUF(const T* h, T* a, u64 rows, u32 f) { swiglu_fwd<T>(h, a, rows, f); } \
    EMU_REGISTER(lazarus_swiglu_fwd_##SUF)                                                                                \
    extern "C" __global__ void lazarus_swiglu_bwd_##SUF(const T* h, const T* ga, T* gh, u64 rows, u32 f) {               \
        swiglu_bwd<T>(h, ga, gh, rows, f);                                                                                \
    }                                                                                                                     \
    EMU_REGISTER(lazarus_swiglu_bwd_##SUF)                                                                                \
    extern "C" __global__ void lazarus_bias_swiglu_fwd_##SUF(T* h, T* act, const u64* bias, const u32* seg, u32 groups,  \
                                                             u64 rows, u32 f) {                                          \
        bias_swiglu_fwd<T, TB>(h, act, bias, seg, groups, rows, f);                                                      \
    }                                                                                                                     \
    EMU_REGISTER(lazarus_bias_swiglu_fwd_##SUF)
SWIGLU_KERNELS(f32, float, float)
SWIGLU_KERNELS(f64, double, double)
SWIGLU_KERNELS(bf16, bf16, float)

#define CAST_KERNEL(SUF, TIN, TOUT)                                                                            \
    extern "C" __global__ void lazarus_cast_##SUF(const TIN* x, TOUT* y, u64 n) { cast_map<TIN, TOUT>(x, y, n); } \
    EMU_REGISTER(lazarus_cast_##SUF)
CAST_KERNEL(f32_bf16, float, bf16)
CAST_KERNEL(bf16_f32, bf16, float)

extern "C" __global__ void lazarus_adamw_f32(float* p, const float* g, float* m, float* v, bf16* copy, u64 n, float b1,
                                             float b2, float scale, float step_size, float inv_bc2_sqrt, float eps, float keep) {
    adamw<float>(p, g, m, v, copy, n, b1, b2, scale, step_size, inv_bc2_sqrt, eps, keep);
}
EMU_REGISTER(lazarus_adamw_f32)

extern "C" __global__ void lazarus_adamw_list_f32(const u64* table, u32 tensors, u64 part) { adamw_list(table, tensors, part); }
EMU_REGISTER(lazarus_adamw_list_f32)

extern "C" __global__ void lazarus_sum_squares_parts_f32(const u64* addrs, const u64* lens, const u32* starts, u32 tensors, u64 part,
                                                          double* parts) {
    sum_squares_parts(addrs, lens, starts, tensors, part, parts);
}
EMU_REGISTER(lazarus_sum_squares_parts_f32)

extern "C" __global__ void lazarus_sum_parts(const double* parts, const u32* starts, double* out, u32 tensors) {
    sum_parts(parts, starts, out, tensors);
}
EMU_REGISTER(lazarus_sum_parts)
