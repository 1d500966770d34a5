// Lazarus's own CUDA kernels: what candle's ops would do in a dozen launches per tensor, in one.
// Compiled to PTX by build.rs (nvcc, only with the `cuda` feature), loaded by ops/cuda/mod.rs.

// AdamW on one f32 tensor, in place: the same formula, in the same order, as the CPU pass
// (optim.rs, adamw_pass): m and v move by the scaled gradient, then
// p <- p * keep - step_size * m / (sqrt(v) * inv_bc2_sqrt + eps).
extern "C" __global__ void lazarus_adamw_f32(float *p, const float *g, float *m, float *v, unsigned long long n, float b1,
                                             float b2, float scale, float step_size, float inv_bc2_sqrt, float eps,
                                             float keep) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        float gi = g[i] * scale;
        float mi = b1 * m[i] + (1.0f - b1) * gi;
        float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] = p[i] * keep - step_size * mi / (sqrtf(vi) * inv_bc2_sqrt + eps);
    }
}

// The sum of squares of one f32 tensor, in f64, into out[slot]: one block of 1024 threads, a
// fixed order of additions (deterministic from run to run, unlike atomics).
extern "C" __global__ void lazarus_sum_squares_f32(const float *x, unsigned long long n, double *out,
                                                   unsigned int slot) {
    __shared__ double part[1024];
    double acc = 0.0;
    for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
        double xi = (double)x[i];
        acc += xi * xi;
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[slot] = part[0];
}

// GELU, tanh form, and its derivative, elementwise: the same formulas as the CPU kernels
// (gelu.rs): gelu(x) = x·s, s = 1 / (1 + exp(-2c(x + a·x³))); gelu'(x) = s + 2x·s(1 − s)·c(1 + 3a·x²).
#define GELU_C 0.7978845608028654
#define GELU_A 0.044715
#define GELU_KERNELS(T, EXP)                                                                              \
    extern "C" __global__ void lazarus_gelu_##T(const T *x, T *y, unsigned long long n) {                \
        for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;      \
             i += (unsigned long long)blockDim.x * gridDim.x) {                                            \
            T v = x[i];                                                                                    \
            y[i] = v / ((T)1 + EXP((T)(-2.0 * GELU_C) * (v + (T)GELU_A * v * v * v)));                     \
        }                                                                                                  \
    }                                                                                                      \
    extern "C" __global__ void lazarus_gelu_grad_##T(const T *x, T *y, unsigned long long n) {           \
        for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;      \
             i += (unsigned long long)blockDim.x * gridDim.x) {                                            \
            T v = x[i];                                                                                    \
            T s = (T)1 / ((T)1 + EXP((T)(-2.0 * GELU_C) * (v + (T)GELU_A * v * v * v)));                   \
            y[i] = s + v * (T)2 * s * ((T)1 - s) * (T)GELU_C * ((T)1 + (T)(3.0 * GELU_A) * v * v);         \
        }                                                                                                  \
    }
GELU_KERNELS(float, expf)
GELU_KERNELS(double, exp)
