// Causal multi-head attention over the packed projection qkv [B, T, 3d] → y [B, T, d], flash-style
// (FlashAttention-2's schedule, Dao 2023): the T × T scores and probabilities of a head are never
// stored. The forward walks each tile of queries over the tiles of keys up to the diagonal with an
// online softmax (running max m and sum l), keeping lse = m + log l per query row; the backward
// recomputes each probability from lse: one kernel for dQ over key tiles, one for dK and dV over
// query tiles, after a pass for D_i = Σ dO_i · O_i.
//
// Threads: each query (or key) row is held by a pair of adjacent lanes, each lane holding HALF of
// the head's columns in registers (dh ≤ 2·HALF; columns past dh are zero); a dot product is the
// two halves' sums added across the pair. Key (or query) tiles are staged in shared memory in the
// accumulator type, each half-row padded by four words: 16-byte aligned, so that f32 rows are read
// four columns per load, and the pair's two reads fall in different banks.
#pragma once
#include "common.cuh"

// Rows per block: 64 rows, 128 threads.
#define ATTN_ROWS 64
#define ATTN_THREADS 128

// Tile of keys (forward, dQ) or queries (dK, dV) staged in shared memory.
template <class A>
struct AttnTile {
    enum { ROWS = sizeof(A) == 8 ? 16 : 32 };
};

// Words of a staged row: two padded halves.
template <int HALF>
struct Stage {
    enum { ROW = 2 * (HALF + 4) };
};

template <int HALF>
__device__ __forceinline__ int stage_col(int part, int c) {
    return part * (HALF + 4) + c;
}

// Σ_c q[c]·row[c] over a half-row (q in registers, row staged and 16-byte aligned).
template <class A, int HALF>
__device__ __forceinline__ A dot_half(const A* q, const A* row) {
    A s = 0;
    if constexpr (sizeof(A) == 4) {
#pragma unroll
        for (int c = 0; c < HALF; c += 4) {
            const float4 v = *reinterpret_cast<const float4*>(row + c);
            s += q[c] * v.x + q[c + 1] * v.y + q[c + 2] * v.z + q[c + 3] * v.w;
        }
    } else {
#pragma unroll
        for (int c = 0; c < HALF; ++c) s += q[c] * row[c];
    }
    return s;
}

// acc[c] += p · row[c] over a half-row.
template <class A, int HALF>
__device__ __forceinline__ void axpy_half(A* acc, A p, const A* row) {
    if constexpr (sizeof(A) == 4) {
#pragma unroll
        for (int c = 0; c < HALF; c += 4) {
            const float4 v = *reinterpret_cast<const float4*>(row + c);
            acc[c] += p * v.x;
            acc[c + 1] += p * v.y;
            acc[c + 2] += p * v.z;
            acc[c + 3] += p * v.w;
        }
    } else {
#pragma unroll
        for (int c = 0; c < HALF; ++c) acc[c] += p * row[c];
    }
}

// Stage rows [r0, r0 + rows) of one head of a packed [B·T, 3d] buffer (the part starting at column
// `at`) into s[rows][Stage::ROW] in the accumulator type; rows past t and columns past dh are 0.
template <class T, class A, int HALF>
__device__ __forceinline__ void stage_rows(A* s, const T* base, u64 row_stride, int r0, int rows, int t, int dh) {
    const int width = 2 * HALF;
    for (int k = threadIdx.x; k < rows * width; k += blockDim.x) {
        const int rr = k / width, col = k % width, part = col / HALF, c = col % HALF;
        const int r = r0 + rr;
        A v = 0;
        if (r < t && col < dh) v = (A)to_acc(base[(u64)r * row_stride + col]);
        s[rr * Stage<HALF>::ROW + stage_col<HALF>(part, c)] = v;
    }
}

// One (sequence, head) of the packed projection [B·T, 3d] (Q, K, V side by side), as a block of
// a grid of (row tiles, sequences × heads) sees it, and this thread's row of the block's tile: a
// pair of lanes per row, `part` the half it holds.
template <class T>
struct Head {
    int d, bh, b, h, row0, row, part;
    u64 stride;
    const T* q;
    const T* k;
    const T* v;
    __device__ Head(const T* qkv, int t, int heads, int dh)
        : d(heads * dh), bh(blockIdx.y), b(bh / heads), h(bh % heads), row0(blockIdx.x * ATTN_ROWS), row(row0 + threadIdx.x / 2),
          part(threadIdx.x % 2), stride(3 * (u64)d), q(qkv + (u64)b * t * stride + (u64)h * dh), k(q + d), v(q + 2 * d) {}
    // Where row r of this head starts in a [B·T, d] tensor (the output and its gradient).
    __device__ u64 out_row(int t, int r, int dh) const { return ((u64)b * t + r) * d + (u64)h * dh; }
    // Where row r of this head's Q starts in a packed [B·T, 3d] tensor (qkv and its gradient).
    __device__ u64 packed_row(int t, int r, int dh) const { return ((u64)b * t + r) * stride + (u64)h * dh; }
    // The last row of the tiles this block's rows look at: the diagonal, or the sequence's end.
    __device__ int last(int t) const { return (row0 + ATTN_ROWS < t ? row0 + ATTN_ROWS : t) - 1; }
};

// This thread's half of a row into registers (zero past dh, or when `valid` is false).
template <class T, class A, int HALF>
__device__ __forceinline__ void load_half(A* dst, const T* row, int part, int dh, bool valid) {
    for (int c = 0; c < HALF; ++c) {
        const int col = part * HALF + c;
        dst[c] = (valid && col < dh) ? (A)to_acc(row[col]) : (A)0;
    }
}

// The same, times `scale`.
template <class T, class A, int HALF>
__device__ __forceinline__ void load_half(A* dst, const T* row, int part, int dh, bool valid, A scale) {
    for (int c = 0; c < HALF; ++c) {
        const int col = part * HALF + c;
        dst[c] = (valid && col < dh) ? (A)to_acc(row[col]) * scale : (A)0;
    }
}

template <class T, int HALF>
__device__ void attn_fwd(const T* qkv, T* y, typename AccOf<T>::type* lse, int t, int heads, int dh, double scale_d) {
    typedef typename AccOf<T>::type A;
    const int BK = AttnTile<A>::ROWS;
    __shared__ __align__(16) A ks[BK * Stage<HALF>::ROW];
    __shared__ __align__(16) A vs[BK * Stage<HALF>::ROW];
    const Head<T> hd(qkv, t, heads, dh);
    const int i = hd.row, part = hd.part;
    const bool valid = i < t;
    A q[HALF], o[HALF];
    load_half<T, A, HALF>(q, hd.q + (u64)i * hd.stride, part, dh, valid, (A)scale_d);
    for (int c = 0; c < HALF; ++c) o[c] = 0;
    A m = neg_inf<A>(), l = 0;
    const int last = hd.last(t);
    for (int j0 = 0; j0 <= last; j0 += BK) {
        __syncthreads();
        stage_rows<T, A, HALF>(ks, hd.k, hd.stride, j0, BK, t, dh);
        stage_rows<T, A, HALF>(vs, hd.v, hd.stride, j0, BK, t, dh);
        __syncthreads();
        A s[BK];
        A mt = m;
#pragma unroll
        for (int jj = 0; jj < BK; ++jj) {
            A dot = dot_half<A, HALF>(q, ks + jj * Stage<HALF>::ROW + stage_col<HALF>(part, 0));
            dot += __shfl_xor_sync(0xffffffffu, dot, 1);
            const int j = j0 + jj;
            s[jj] = (valid && j <= i) ? dot : neg_inf<A>();
            mt = max_acc(mt, s[jj]);
        }
        if (mt == neg_inf<A>()) continue;  // every key of the tile masked for this row
        const A alpha = exp_acc(m - mt);
        l *= alpha;
        for (int c = 0; c < HALF; ++c) o[c] *= alpha;
#pragma unroll
        for (int jj = 0; jj < BK; ++jj) {
            const A p = exp_acc(s[jj] - mt);
            l += p;
            axpy_half<A, HALF>(o, p, vs + jj * Stage<HALF>::ROW + stage_col<HALF>(part, 0));
        }
        m = mt;
    }
    if (valid) {
        const A inv = (A)1 / l;
        for (int c = 0; c < HALF; ++c) {
            const int col = part * HALF + c;
            if (col < dh) y[hd.out_row(t, i, dh) + col] = from_acc<T>(o[c] * inv);
        }
        if (part == 0) lse[(u64)hd.bh * t + i] = m + log_acc(l);
    }
}

// D[bh, i] = Σ_c dO[i, c] · O[i, c] over the head's columns; one warp per (bh, i).
template <class T>
__device__ void attn_bwd_dot(const T* y, const T* dy, typename AccOf<T>::type* dvec, int b, int t, int heads, int dh) {
    typedef typename AccOf<T>::type A;
    const u64 rows = (u64)b * heads * t, warps = (u64)gridDim.x * (blockDim.x / 32);
    const int lane = threadIdx.x % 32, d = heads * dh;
    for (u64 w = blockIdx.x * (u64)(blockDim.x / 32) + threadIdx.x / 32; w < rows; w += warps) {
        const u64 bh = w / t, i = w % t, bb = bh / heads, h = bh % heads;
        const u64 at = (bb * t + i) * d + h * dh;
        A s = 0;
        for (int c = lane; c < dh; c += 32) s += (A)to_acc(y[at + c]) * (A)to_acc(dy[at + c]);
        s = warp_sum(s);
        if (lane == 0) dvec[w] = s;
    }
}

// dQ for a tile of 64 query rows, over the key tiles up to the diagonal.
template <class T, int HALF>
__device__ void attn_bwd_dq(const T* qkv, const T* dy, const typename AccOf<T>::type* lse, const typename AccOf<T>::type* dvec,
                            T* dqkv, int t, int heads, int dh, double scale_d) {
    typedef typename AccOf<T>::type A;
    const int BK = AttnTile<A>::ROWS;
    __shared__ __align__(16) A ks[BK * Stage<HALF>::ROW];
    __shared__ __align__(16) A vs[BK * Stage<HALF>::ROW];
    const Head<T> hd(qkv, t, heads, dh);
    const int i = hd.row, part = hd.part;
    const bool valid = i < t;
    const A scale = (A)scale_d;
    A q[HALF], go[HALF], dq[HALF];
    load_half<T, A, HALF>(q, hd.q + (u64)i * hd.stride, part, dh, valid, scale);
    load_half<T, A, HALF>(go, dy + hd.out_row(t, i, dh), part, dh, valid);
    for (int c = 0; c < HALF; ++c) dq[c] = 0;
    const A lse_i = valid ? lse[(u64)hd.bh * t + i] : (A)0, d_i = valid ? dvec[(u64)hd.bh * t + i] : (A)0;
    const int last = hd.last(t);
    for (int j0 = 0; j0 <= last; j0 += BK) {
        __syncthreads();
        stage_rows<T, A, HALF>(ks, hd.k, hd.stride, j0, BK, t, dh);
        stage_rows<T, A, HALF>(vs, hd.v, hd.stride, j0, BK, t, dh);
        __syncthreads();
#pragma unroll
        for (int jj = 0; jj < BK; ++jj) {
            const A* kr = ks + jj * Stage<HALF>::ROW + stage_col<HALF>(part, 0);
            const A* vr = vs + jj * Stage<HALF>::ROW + stage_col<HALF>(part, 0);
            A s = dot_half<A, HALF>(q, kr), dp = dot_half<A, HALF>(go, vr);
            s += __shfl_xor_sync(0xffffffffu, s, 1);
            dp += __shfl_xor_sync(0xffffffffu, dp, 1);
            const int j = j0 + jj;
            const A p = (valid && j <= i) ? exp_acc(s - lse_i) : (A)0;
            const A ds = p * (dp - d_i);
            axpy_half<A, HALF>(dq, ds, kr);
        }
    }
    if (valid) {
        for (int c = 0; c < HALF; ++c) {
            const int col = part * HALF + c;
            if (col < dh) dqkv[hd.packed_row(t, i, dh) + col] = from_acc<T>(dq[c] * scale);
        }
    }
}

// dK and dV for a tile of 64 key rows, over the query tiles from the diagonal on.
template <class T, int HALF>
__device__ void attn_bwd_dkv(const T* qkv, const T* dy, const typename AccOf<T>::type* lse, const typename AccOf<T>::type* dvec,
                             T* dqkv, int t, int heads, int dh, double scale_d) {
    typedef typename AccOf<T>::type A;
    const int BQ = AttnTile<A>::ROWS;
    __shared__ __align__(16) A qs[BQ * Stage<HALF>::ROW];
    __shared__ __align__(16) A gs[BQ * Stage<HALF>::ROW];
    __shared__ A ls[BQ], ds_[BQ];
    const Head<T> hd(qkv, t, heads, dh);
    const T* gb = dy + hd.out_row(t, 0, dh);
    const int j = hd.row, part = hd.part;
    const bool valid = j < t;
    const A scale = (A)scale_d;
    A k[HALF], v[HALF], dk[HALF], dv[HALF];
    load_half<T, A, HALF>(k, hd.k + (u64)j * hd.stride, part, dh, valid, scale);
    load_half<T, A, HALF>(v, hd.v + (u64)j * hd.stride, part, dh, valid);
    for (int c = 0; c < HALF; ++c) {
        dk[c] = 0;
        dv[c] = 0;
    }
    for (int i0 = hd.row0; i0 < t; i0 += BQ) {
        __syncthreads();
        stage_rows<T, A, HALF>(qs, hd.q, hd.stride, i0, BQ, t, dh);
        stage_rows<T, A, HALF>(gs, gb, (u64)hd.d, i0, BQ, t, dh);
        for (int r = threadIdx.x; r < BQ; r += blockDim.x) {
            const int i = i0 + r;
            ls[r] = i < t ? lse[(u64)hd.bh * t + i] : (A)0;
            ds_[r] = i < t ? dvec[(u64)hd.bh * t + i] : (A)0;
        }
        __syncthreads();
#pragma unroll 4
        for (int ii = 0; ii < BQ; ++ii) {
            const A* qr = qs + ii * Stage<HALF>::ROW + stage_col<HALF>(part, 0);
            const A* gr = gs + ii * Stage<HALF>::ROW + stage_col<HALF>(part, 0);
            A s = dot_half<A, HALF>(k, qr), dp = dot_half<A, HALF>(v, gr);
            s += __shfl_xor_sync(0xffffffffu, s, 1);
            dp += __shfl_xor_sync(0xffffffffu, dp, 1);
            const int i = i0 + ii;
            const A p = (valid && i < t && j <= i) ? exp_acc(s - ls[ii]) : (A)0;
            const A dsc = p * (dp - ds_[ii]);
            axpy_half<A, HALF>(dv, p, gr);
            axpy_half<A, HALF>(dk, dsc, qr);
        }
    }
    if (valid) {
        for (int c = 0; c < HALF; ++c) {
            const int col = part * HALF + c;
            if (col < dh) {
                const u64 at = hd.packed_row(t, j, dh) + col;
                dqkv[at + hd.d] = from_acc<T>(dk[c] * scale);
                dqkv[at + 2 * hd.d] = from_acc<T>(dv[c]);
            }
        }
    }
}

#define ATTN_KERNELS(SUF, T, HALF)                                                                                      \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS)                                                          \
        lazarus_attn_fwd_##SUF##_##HALF(const T* qkv, T* y, AccOf<T>::type* lse, int t, int heads, int dh, double scale) { \
        attn_fwd<T, HALF>(qkv, y, lse, t, heads, dh, scale);                                                            \
    }                                                                                                                   \
    EMU_REGISTER(lazarus_attn_fwd_##SUF##_##HALF)                                                                       \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS)                                                          \
        lazarus_attn_bwd_dq_##SUF##_##HALF(const T* qkv, const T* dy, const AccOf<T>::type* lse,                        \
                                           const AccOf<T>::type* dvec, T* dqkv, int t, int heads, int dh, double scale) { \
        attn_bwd_dq<T, HALF>(qkv, dy, lse, dvec, dqkv, t, heads, dh, scale);                                            \
    }                                                                                                                   \
    EMU_REGISTER(lazarus_attn_bwd_dq_##SUF##_##HALF)                                                                    \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS)                                                          \
        lazarus_attn_bwd_dkv_##SUF##_##HALF(const T* qkv, const T* dy, const AccOf<T>::type* lse,                       \
                                            const AccOf<T>::type* dvec, T* dqkv, int t, int heads, int dh, double scale) { \
        attn_bwd_dkv<T, HALF>(qkv, dy, lse, dvec, dqkv, t, heads, dh, scale);                                           \
    }                                                                                                                   \
    EMU_REGISTER(lazarus_attn_bwd_dkv_##SUF##_##HALF)

#define ATTN_DOT_KERNEL(SUF, T)                                                                                          \
    extern "C" __global__ void lazarus_attn_bwd_dot_##SUF(const T* y, const T* dy, AccOf<T>::type* dvec, int b, int t,   \
                                                          int heads, int dh) {                                          \
        attn_bwd_dot<T>(y, dy, dvec, b, t, heads, dh);                                                                  \
    }                                                                                                                   \
    EMU_REGISTER(lazarus_attn_bwd_dot_##SUF)

ATTN_KERNELS(f32, float, 16)
ATTN_KERNELS(f32, float, 32)
ATTN_KERNELS(f32, float, 64)
ATTN_KERNELS(f64, double, 16)
ATTN_KERNELS(f64, double, 32)
ATTN_KERNELS(f64, double, 64)
ATTN_KERNELS(bf16, bf16, 16)
ATTN_KERNELS(bf16, bf16, 32)
ATTN_KERNELS(bf16, bf16, 64)
ATTN_DOT_KERNEL(f32, float)
ATTN_DOT_KERNEL(f64, double)
ATTN_DOT_KERNEL(bf16, bf16)
