// LayerNorm, RMSNorm, softmax and the softmax cross-entropy: one block per row, the row's statistics in the
// accumulator type (f32 for f32 and bf16, f64 for f64) by block sums in a fixed order.
//
// Parameter gradients summed over rows (LayerNorm's weight and bias, a bias's gradient) go in two
// passes, never by atomics: `column_partials` sums each column over a fixed part of the rows,
// `column_totals` adds the parts in order. The same bits on every run.
#pragma once
#include "common.cuh"

// y = (x − mean) · rstd · w + b over rows of d (x: Tin, y: Tout, w and b: Tw); mean and rstd of
// every row saved (accumulator type) for the backward. One block per row (grid-stride).
template <class Tin, class Tw, class Tout>
__device__ void layer_norm_fwd(const Tin* x, const Tw* w, const Tw* b, Tout* y, typename AccOf<Tw>::type* mean_out,
                               typename AccOf<Tw>::type* rstd_out, u64 rows, u32 d, double eps) {
    typedef typename AccOf<Tw>::type A;
    __shared__ A scratch[32];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const Tin* xr = x + r * d;
        A s = 0;
        for (u32 c = threadIdx.x; c < d; c += blockDim.x) s += (A)to_acc(xr[c]);
        const A mean = block_sum(s, scratch) / (A)d;
        A q = 0;
        for (u32 c = threadIdx.x; c < d; c += blockDim.x) {
            const A v = (A)to_acc(xr[c]) - mean;
            q += v * v;
        }
        const A var = block_sum(q, scratch) / (A)d;
        const A rstd = (A)1 / sqrt_acc(var + (A)eps);
        for (u32 c = threadIdx.x; c < d; c += blockDim.x) {
            y[r * d + c] = from_acc<Tout>(((A)to_acc(xr[c]) - mean) * rstd * (A)to_acc(w[c]) + (A)to_acc(b[c]));
        }
        if (threadIdx.x == 0) {
            mean_out[r] = mean;
            rstd_out[r] = rstd;
        }
    }
}

// dx = rstd · (g·w − mean(g·w) − x̂ · mean(g·w·x̂)), x̂ = (x − mean) · rstd, for each row (g: Tg, the
// output's gradient; dx: Tin). The weight and bias gradients go through gamma_beta_partials.
template <class Tin, class Tw, class Tg>
__device__ void layer_norm_bwd(const Tin* x, const Tw* w, const Tg* g, const typename AccOf<Tw>::type* mean_in,
                               const typename AccOf<Tw>::type* rstd_in, Tin* dx, u64 rows, u32 d) {
    typedef typename AccOf<Tw>::type A;
    __shared__ A scratch[32];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const A mean = mean_in[r], rstd = rstd_in[r];
        A m1 = 0, m2 = 0;
        for (u32 c = threadIdx.x; c < d; c += blockDim.x) {
            const A xhat = ((A)to_acc(x[r * d + c]) - mean) * rstd;
            const A dxhat = (A)to_acc(g[r * d + c]) * (A)to_acc(w[c]);
            m1 += dxhat;
            m2 += dxhat * xhat;
        }
        m1 = block_sum(m1, scratch) / (A)d;
        m2 = block_sum(m2, scratch) / (A)d;
        for (u32 c = threadIdx.x; c < d; c += blockDim.x) {
            const A xhat = ((A)to_acc(x[r * d + c]) - mean) * rstd;
            const A dxhat = (A)to_acc(g[r * d + c]) * (A)to_acc(w[c]);
            dx[r * d + c] = from_acc<Tin>(rstd * (dxhat - m1 - xhat * m2));
        }
    }
}

// Per part p of the rows (blockIdx.y, `part` rows each) and column c: Σ g·x̂ and Σ g into
// partial[p][c] and partial[parts + p][c] (blockDim = (32, 8); columns along x).
template <class Tin, class Tw, class Tg>
__device__ void gamma_beta_partials(const Tin* x, const Tg* g, const typename AccOf<Tw>::type* mean_in,
                                    const typename AccOf<Tw>::type* rstd_in, typename AccOf<Tw>::type* partial, u64 rows,
                                    u32 d, u32 part) {
    typedef typename AccOf<Tw>::type A;
    __shared__ A sw[8][33], sb[8][33];
    const u32 c = blockIdx.x * 32 + threadIdx.x;
    const u64 lo = (u64)blockIdx.y * part, hi = lo + part < rows ? lo + part : rows;
    A aw = 0, ab = 0;
    if (c < d) {
        for (u64 r = lo + threadIdx.y; r < hi; r += 8) {
            const A gv = (A)to_acc(g[r * d + c]);
            aw += gv * ((A)to_acc(x[r * d + c]) - mean_in[r]) * rstd_in[r];
            ab += gv;
        }
    }
    sw[threadIdx.y][threadIdx.x] = aw;
    sb[threadIdx.y][threadIdx.x] = ab;
    __syncthreads();
    if (threadIdx.y == 0 && c < d) {
        for (u32 k = 1; k < 8; ++k) {
            aw += sw[k][threadIdx.x];
            ab += sb[k][threadIdx.x];
        }
        partial[(u64)blockIdx.y * d + c] = aw;
        partial[((u64)gridDim.y + blockIdx.y) * d + c] = ab;
    }
}

// RMSNorm (Zhang & Sennrich 2019; Llama's and Mixtral's norm): y = x · rstd · w with
// rstd = 1/√(mean(x²) + eps) over rows of d, rstd of every row saved for the backward. The CPU
// kernel's formula (rms_norm.rs). One block per row (grid-stride).
template <class Tin, class Tw, class Tout>
__device__ void rms_norm_fwd(const Tin* x, const Tw* w, Tout* y, typename AccOf<Tw>::type* rstd_out, u64 rows, u32 d,
                             double eps) {
    typedef typename AccOf<Tw>::type A;
    __shared__ A scratch[32];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const Tin* xr = x + r * d;
        A q = 0;
        for (u32 c = threadIdx.x; c < d; c += blockDim.x) {
            const A v = (A)to_acc(xr[c]);
            q += v * v;
        }
        const A rstd = (A)1 / sqrt_acc(block_sum(q, scratch) / (A)d + (A)eps);
        for (u32 c = threadIdx.x; c < d; c += blockDim.x) y[r * d + c] = from_acc<Tout>((A)to_acc(xr[c]) * rstd * (A)to_acc(w[c]));
        if (threadIdx.x == 0) rstd_out[r] = rstd;
    }
}

// dx = rstd · (g·w − x̂ · mean(g·w·x̂)), x̂ = x · rstd, for each row (g: Tg, the output's gradient;
// dx: Tin). The weight's gradient goes through rms_weight_partials.
template <class Tin, class Tw, class Tg>
__device__ void rms_norm_bwd(const Tin* x, const Tw* w, const Tg* g, const typename AccOf<Tw>::type* rstd_in, Tin* dx, u64 rows,
                             u32 d) {
    typedef typename AccOf<Tw>::type A;
    __shared__ A scratch[32];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const A rstd = rstd_in[r];
        A m = 0;
        for (u32 c = threadIdx.x; c < d; c += blockDim.x) {
            m += (A)to_acc(g[r * d + c]) * (A)to_acc(w[c]) * (A)to_acc(x[r * d + c]) * rstd;
        }
        m = block_sum(m, scratch) / (A)d;
        for (u32 c = threadIdx.x; c < d; c += blockDim.x) {
            const A xhat = (A)to_acc(x[r * d + c]) * rstd;
            dx[r * d + c] = from_acc<Tin>(rstd * ((A)to_acc(g[r * d + c]) * (A)to_acc(w[c]) - xhat * m));
        }
    }
}

// Per part p of the rows (blockIdx.y, `part` rows each) and column c: Σ g·x̂ into partial[p][c]
// (blockDim = (32, 8); columns along x); column_totals adds the parts in order.
template <class Tin, class Tw, class Tg>
__device__ void rms_weight_partials(const Tin* x, const Tg* g, const typename AccOf<Tw>::type* rstd_in,
                                    typename AccOf<Tw>::type* partial, u64 rows, u32 d, u32 part) {
    typedef typename AccOf<Tw>::type A;
    __shared__ A sw[8][33];
    const u32 c = blockIdx.x * 32 + threadIdx.x;
    const u64 lo = (u64)blockIdx.y * part, hi = lo + part < rows ? lo + part : rows;
    A aw = 0;
    if (c < d) {
        for (u64 r = lo + threadIdx.y; r < hi; r += 8) aw += (A)to_acc(g[r * d + c]) * (A)to_acc(x[r * d + c]) * rstd_in[r];
    }
    sw[threadIdx.y][threadIdx.x] = aw;
    __syncthreads();
    if (threadIdx.y == 0 && c < d) {
        for (u32 k = 1; k < 8; ++k) aw += sw[k][threadIdx.x];
        partial[(u64)blockIdx.y * d + c] = aw;
    }
}

// Per part p (blockIdx.y) and column c: Σ over the part's rows of m[r, c] into partial[p][c].
// Rows [seg_lo, seg_hi) of m when `segments` is null; else segment s = blockIdx.z runs over rows
// [segments[s], segments[s + 1]) and writes partial[s][p][c] (an expert's rows, for its bias).
template <class T>
__device__ void column_partials(const T* m, const u32* segments, typename AccOf<T>::type* partial, u64 rows, u32 d, u32 part) {
    typedef typename AccOf<T>::type A;
    __shared__ A s[8][33];
    const u32 c = blockIdx.x * 32 + threadIdx.x;
    u64 first = 0, last = rows;
    if (segments) {
        first = segments[blockIdx.z];
        last = segments[blockIdx.z + 1];
    }
    const u64 lo = first + (u64)blockIdx.y * part, hi = lo + part < last ? lo + part : last;
    A acc = 0;
    if (c < d) {
        for (u64 r = lo + threadIdx.y; r < hi; r += 8) acc += (A)to_acc(m[r * d + c]);
    }
    s[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < d) {
        for (u32 k = 1; k < 8; ++k) acc += s[k][threadIdx.x];
        partial[((u64)blockIdx.z * gridDim.y + blockIdx.y) * d + c] = acc;
    }
}

// out[k][c] = Σ_{p < parts} partial[k][p][c], p in order, for k < groups, c < d.
template <class A, class Tout>
__device__ void column_totals(const A* partial, Tout* out, u32 groups, u32 parts, u32 d) {
    FOR_EACH(i, (u64)groups * d) {
        const u64 k = i / d, c = i % d;
        A acc = 0;
        for (u32 p = 0; p < parts; ++p) acc += partial[(k * parts + p) * d + c];
        out[i] = from_acc<Tout>(acc);
    }
}

// A row's maximum m and Σ exp(x − m), by the whole block (every thread gets both).
template <class T, class A>
__device__ __forceinline__ void row_max_and_sum(const T* xr, u32 v, A* scratch, A& m, A& s) {
    m = neg_inf<A>();
    for (u32 c = threadIdx.x; c < v; c += blockDim.x) m = max_acc(m, (A)to_acc(xr[c]));
    m = block_max(m, scratch);
    s = 0;
    for (u32 c = threadIdx.x; c < v; c += blockDim.x) s += exp_acc((A)to_acc(xr[c]) - m);
    s = block_sum(s, scratch);
}

// Softmax over rows of v: one block per row; y in x's type, computed in the accumulator type.
template <class T>
__device__ void softmax_fwd(const T* x, T* y, u64 rows, u32 v) {
    typedef typename AccOf<T>::type A;
    __shared__ A scratch[32];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * v;
        A m, s;
        row_max_and_sum(xr, v, scratch, m, s);
        for (u32 c = threadIdx.x; c < v; c += blockDim.x) y[r * v + c] = from_acc<T>(exp_acc((A)to_acc(xr[c]) - m) / s);
    }
}

// dx = y ⊙ (g − Σ g·y) per row.
template <class T>
__device__ void softmax_bwd(const T* y, const T* g, T* dx, u64 rows, u32 v) {
    typedef typename AccOf<T>::type A;
    __shared__ A scratch[32];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        A dot = 0;
        for (u32 c = threadIdx.x; c < v; c += blockDim.x) dot += (A)to_acc(g[r * v + c]) * (A)to_acc(y[r * v + c]);
        dot = block_sum(dot, scratch);
        for (u32 c = threadIdx.x; c < v; c += blockDim.x) {
            dx[r * v + c] = from_acc<T>((A)to_acc(y[r * v + c]) * ((A)to_acc(g[r * v + c]) - dot));
        }
    }
}

// Cross-entropy of each row of logits against its target: loss[r] = lse − x[target], and lse[r]
// kept for the backward. One block per row.
template <class T>
__device__ void cross_entropy_fwd(const T* x, const u32* targets, typename AccOf<T>::type* loss,
                                  typename AccOf<T>::type* lse_out, u64 rows, u32 v) {
    typedef typename AccOf<T>::type A;
    __shared__ A scratch[32];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * v;
        A m, s;
        row_max_and_sum(xr, v, scratch, m, s);
        if (threadIdx.x == 0) {
            const A lse = m + log_acc(s);
            lse_out[r] = lse;
            loss[r] = lse - (A)to_acc(xr[targets[r]]);
        }
    }
}

// The mean of `n` values in one block, in a fixed order: out[0] = Σ v / n.
template <class A>
__device__ void mean_of(const A* v, A* out, u64 n) {
    __shared__ A scratch[32];
    A s = 0;
    // Each thread sums a contiguous run, then the block sums the runs: the order is fixed by n and
    // blockDim alone.
    const u64 per = (n + blockDim.x - 1) / blockDim.x, lo = threadIdx.x * per;
    for (u64 i = lo; i < lo + per && i < n; ++i) s += v[i];
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) out[0] = n > 0 ? s / (A)n : (A)0;
}

// dx[r, c] = (softmax(x[r])[c] − [c = target]) · g[0] / rows, with g the loss's gradient (a
// device scalar: no copy to the host).
template <class T>
__device__ void cross_entropy_bwd(const T* x, const u32* targets, const typename AccOf<T>::type* lse_in, const T* g, T* dx,
                                  u64 rows, u32 v) {
    typedef typename AccOf<T>::type A;
    const A scale = (A)to_acc(g[0]) / (A)rows;
    FOR_EACH(i, rows * v) {
        const u64 r = i / v, c = i % v;
        A p = exp_acc((A)to_acc(x[i]) - lse_in[r]);
        if (c == targets[r]) p -= (A)1;
        dx[i] = from_acc<T>(p * scale);
    }
}

#define NORM_KERNELS(SUF, TIN, TW, TOUT)                                                                                  \
    extern "C" __global__ void lazarus_layer_norm_fwd_##SUF(const TIN* x, const TW* w, const TW* b, TOUT* y,            \
                                                            AccOf<TW>::type* mean, AccOf<TW>::type* rstd, u64 rows,      \
                                                            u32 d, double eps) {                                         \
        layer_norm_fwd<TIN, TW, TOUT>(x, w, b, y, mean, rstd, rows, d, eps);                                             \
    }                                                                                                                     \
    EMU_REGISTER(lazarus_layer_norm_fwd_##SUF)                                                                            \
    extern "C" __global__ void lazarus_layer_norm_bwd_##SUF(const TIN* x, const TW* w, const TOUT* g,                   \
                                                            const AccOf<TW>::type* mean, const AccOf<TW>::type* rstd,    \
                                                            TIN* dx, u64 rows, u32 d) {                                  \
        layer_norm_bwd<TIN, TW, TOUT>(x, w, g, mean, rstd, dx, rows, d);                                                 \
    }                                                                                                                     \
    EMU_REGISTER(lazarus_layer_norm_bwd_##SUF)                                                                            \
    extern "C" __global__ void lazarus_gamma_beta_partials_##SUF(const TIN* x, const TOUT* g, const AccOf<TW>::type* mean, \
                                                                 const AccOf<TW>::type* rstd, AccOf<TW>::type* partial,   \
                                                                 u64 rows, u32 d, u32 part) {                             \
        gamma_beta_partials<TIN, TW, TOUT>(x, g, mean, rstd, partial, rows, d, part);                                     \
    }                                                                                                                     \
    EMU_REGISTER(lazarus_gamma_beta_partials_##SUF)
// LayerNorm: (x, weights, y) in f32/f32/f32, f64, and f32 in with a bf16 output (mixed precision).
NORM_KERNELS(f32, float, float, float)
NORM_KERNELS(f64, double, double, double)
NORM_KERNELS(f32_bf16, float, float, bf16)

#define RMS_KERNELS(SUF, TIN, TW, TOUT)                                                                                   \
    extern "C" __global__ void lazarus_rms_norm_fwd_##SUF(const TIN* x, const TW* w, TOUT* y, AccOf<TW>::type* rstd,     \
                                                          u64 rows, u32 d, double eps) {                                 \
        rms_norm_fwd<TIN, TW, TOUT>(x, w, y, rstd, rows, d, eps);                                                          \
    }                                                                                                                     \
    EMU_REGISTER(lazarus_rms_norm_fwd_##SUF)                                                                              \
    extern "C" __global__ void lazarus_rms_norm_bwd_##SUF(const TIN* x, const TW* w, const TOUT* g,                     \
                                                          const AccOf<TW>::type* rstd, TIN* dx, u64 rows, u32 d) {       \
        rms_norm_bwd<TIN, TW, TOUT>(x, w, g, rstd, dx, rows, d);                                                           \
    }                                                                                                                     \
    EMU_REGISTER(lazarus_rms_norm_bwd_##SUF)                                                                              \
    extern "C" __global__ void lazarus_rms_weight_partials_##SUF(const TIN* x, const TOUT* g, const AccOf<TW>::type* rstd, \
                                                                 AccOf<TW>::type* partial, u64 rows, u32 d, u32 part) {   \
        rms_weight_partials<TIN, TW, TOUT>(x, g, rstd, partial, rows, d, part);                                            \
    }                                                                                                                     \
    EMU_REGISTER(lazarus_rms_weight_partials_##SUF)
// RMSNorm: the same three type combinations as LayerNorm.
RMS_KERNELS(f32, float, float, float)
RMS_KERNELS(f64, double, double, double)
RMS_KERNELS(f32_bf16, float, float, bf16)

#define COLUMN_KERNELS(SUF, T, A)                                                                                          \
    extern "C" __global__ void lazarus_column_partials_##SUF(const T* m, const u32* segments, A* partial, u64 rows, u32 d, \
                                                             u32 part) {                                                 \
        column_partials<T>(m, segments, partial, rows, d, part);                                                          \
    }                                                                                                                     \
    EMU_REGISTER(lazarus_column_partials_##SUF)
COLUMN_KERNELS(f32, float, float)
COLUMN_KERNELS(f64, double, double)
COLUMN_KERNELS(bf16, bf16, float)

#define TOTALS_KERNEL(SUF, A, TOUT)                                                                                         \
    extern "C" __global__ void lazarus_column_totals_##SUF(const A* partial, TOUT* out, u32 groups, u32 parts, u32 d) { \
        column_totals<A, TOUT>(partial, out, groups, parts, d);                                                           \
    }                                                                                                                     \
    EMU_REGISTER(lazarus_column_totals_##SUF)
TOTALS_KERNEL(f32, float, float)
TOTALS_KERNEL(f64, double, double)

#define SOFTMAX_KERNELS(SUF, T)                                                                                             \
    extern "C" __global__ void lazarus_softmax_fwd_##SUF(const T* x, T* y, u64 rows, u32 v) { softmax_fwd<T>(x, y, rows, v); } \
    EMU_REGISTER(lazarus_softmax_fwd_##SUF)                                                                                 \
    extern "C" __global__ void lazarus_softmax_bwd_##SUF(const T* y, const T* g, T* dx, u64 rows, u32 v) {               \
        softmax_bwd<T>(y, g, dx, rows, v);                                                                                \
    }                                                                                                                     \
    EMU_REGISTER(lazarus_softmax_bwd_##SUF)                                                                                 \
    extern "C" __global__ void lazarus_cross_entropy_fwd_##SUF(const T* x, const u32* targets, AccOf<T>::type* loss,    \
                                                               AccOf<T>::type* lse, u64 rows, u32 v) {                   \
        cross_entropy_fwd<T>(x, targets, loss, lse, rows, v);                                                             \
    }                                                                                                                     \
    EMU_REGISTER(lazarus_cross_entropy_fwd_##SUF)                                                                           \
    extern "C" __global__ void lazarus_cross_entropy_bwd_##SUF(const T* x, const u32* targets, const AccOf<T>::type* lse, \
                                                               const T* g, T* dx, u64 rows, u32 v) {                     \
        cross_entropy_bwd<T>(x, targets, lse, g, dx, rows, v);                                                            \
    }                                                                                                                     \
    EMU_REGISTER(lazarus_cross_entropy_bwd_##SUF)
SOFTMAX_KERNELS(f32, float)
SOFTMAX_KERNELS(f64, double)

#define MEAN_KERNEL(SUF, A)                                                                                 \
    extern "C" __global__ void lazarus_mean_##SUF(const A* v, A* out, u64 n) { mean_of<A>(v, out, n); } \
    EMU_REGISTER(lazarus_mean_##SUF)
MEAN_KERNEL(f32, float)
MEAN_KERNEL(f64, double)
