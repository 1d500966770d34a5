//! Row-major GEMMs on raw buffers through the `gemm` crate, with each operand given as
//! (pointer, row stride, column stride) so that transposed and strided views cost no copy.
//! Shared by the expert FFN, attention and linear kernels.

/// dst (m×n, row-major) = [dst +] A·B, with A (m×k) and B (k×n) given as (pointer, row stride,
/// column stride) so transposed views cost nothing.
///
/// # Safety
/// The pointers must cover the described matrices, and `dst` must not alias `a` or `b`.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm_rm<T: 'static + Copy>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    accumulate: bool,
    a: (*const T, isize, isize),
    b: (*const T, isize, isize),
    one: T,
) {
    // SAFETY: forwarded from the caller.
    unsafe { gemm_strided(m, n, k, (dst, n as isize), accumulate, a, b, (one, one), gemm::Parallelism::Rayon(0)) }
}

/// dst (m×n, row stride given, column stride 1) = alpha·dst + beta·A·B when accumulating, else
/// beta·A·B; A and B given as in [`gemm_rm`].
///
/// # Safety
/// As for [`gemm_rm`].
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm_strided<T: 'static + Copy>(
    m: usize,
    n: usize,
    k: usize,
    dst: (*mut T, isize),
    accumulate: bool,
    a: (*const T, isize, isize),
    b: (*const T, isize, isize),
    (alpha, beta): (T, T),
    parallelism: gemm::Parallelism,
) {
    unsafe {
        gemm::gemm(m, n, k, dst.0, 1, dst.1, accumulate, a.0, a.2, a.1, b.0, b.2, b.1, alpha, beta, false, false, false, parallelism)
    };
}
