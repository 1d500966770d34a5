//! Host buffers in and out of the fused kernels: candle storage and tensors to flat slices and
//! vectors (the kernels work on contiguous row-major buffers), and back.

use std::mem::MaybeUninit;

use candle_core::{CpuStorage, Layout, Shape, Tensor};

/// Call `f` with the f32 elements of each tensor: borrowed from the storage where a tensor is a
/// contiguous f32 CPU tensor (what a backward's inputs and output gradient almost always are),
/// copied out otherwise. The fused kernels' backward reads its inputs through this: copying them
/// out (weights, activations, gradients: ~100 MB a step on the default model) was serial work on
/// the calling thread.
pub(super) fn with_host_f32<const N: usize, R>(tensors: [&Tensor; N], f: impl FnOnce([&[f32]; N]) -> R) -> candle_core::Result<R> {
    let tensors: Vec<Option<Tensor>> = tensors.iter().map(|&t| Some(t.clone())).collect();
    with_f32_slices(&tensors, |s| f(std::array::from_fn(|i| s[i].unwrap_or_default())))
}

/// A tensor's elements, flattened, as f64 (any float dtype).
pub(super) fn host_f64(t: &Tensor) -> candle_core::Result<Vec<f64>> {
    t.flatten_all()?.to_dtype(candle_core::DType::F64)?.to_vec1::<f64>()
}

/// A contiguous f32 or f64 storage's elements as f64.
pub(super) fn storage_f64(storage: &CpuStorage, layout: &Layout) -> candle_core::Result<Vec<f64>> {
    let Some((start, end)) = layout.contiguous_offsets() else { candle_core::bail!("fused op: input must be contiguous") };
    Ok(match storage {
        CpuStorage::F32(v) => v[start..end].iter().map(|&x| x as f64).collect(),
        CpuStorage::F64(v) => v[start..end].to_vec(),
        _ => candle_core::bail!("fused op: only f32 and f64 are supported"),
    })
}

/// f64 results as a storage of `storage`'s dtype (f32, else f64).
pub(super) fn storage_like(storage: &CpuStorage, data: Vec<f64>) -> CpuStorage {
    match storage {
        CpuStorage::F32(_) => CpuStorage::F32(data.into_iter().map(|x| x as f32).collect()),
        _ => CpuStorage::F64(data),
    }
}

/// f64 results as a tensor of `like`'s device and dtype.
pub(super) fn tensor_like(like: &Tensor, data: Vec<f64>, shape: &Shape) -> candle_core::Result<Tensor> {
    Tensor::from_vec(data, shape, like.device())?.to_dtype(like.dtype())
}

/// The elements a contiguous layout covers.
pub(super) fn contiguous_slice<'a, T>(v: &'a [T], l: &Layout) -> candle_core::Result<&'a [T]> {
    let Some((start, end)) = l.contiguous_offsets() else {
        candle_core::bail!("fused op: inputs must be contiguous (call .contiguous() first)")
    };
    Ok(&v[start..end])
}

/// `acc[j] += Σ_rows m[row][j]` for a row-major matrix with `acc.len()` columns (a bias gradient).
pub(super) fn add_row_sums<T: Copy + std::ops::AddAssign>(acc: &mut [T], m: &[T]) {
    for row in m.chunks(acc.len()) {
        acc.iter_mut().zip(row).for_each(|(a, &v)| *a += v);
    }
}

/// A buffer of `len` elements that a kernel writes in full before anything reads it, so its memory
/// is never zero-filled: `vec![0.0; n]` is a `calloc`, and once glibc's mmap threshold has risen
/// (it does, as the step frees its large buffers) that is a `memset` on the calling thread — serial
/// work while the pool waits (up to 80 MB a step for the expert backward's gradients). The kernel
/// writes through [`Unfilled::slots`] (`MaybeUninit`, nothing read) and the owner then takes the
/// elements with [`Unfilled::assume_written`].
pub(super) struct Unfilled<T> {
    buf: Vec<T>,
    len: usize,
}

impl<T> Unfilled<T> {
    pub(super) fn new(len: usize) -> Self {
        #[allow(unused_mut)]
        let mut buf = Vec::with_capacity(len);
        // Debug builds (the tests) poison the slots, every bit set (NaN for a float), so that a
        // kernel leaving one unwritten fails its tests instead of passing on a fresh page's zeroes.
        #[cfg(debug_assertions)]
        // SAFETY: the capacity holds `len` elements; writing bytes into it reads nothing.
        unsafe {
            std::ptr::write_bytes(buf.as_mut_ptr(), 0xFF, len)
        };
        Unfilled { buf, len }
    }

    /// Zero-filled, for a kernel that will not write every slot (shapes it cannot cover).
    pub(super) fn zeroed(len: usize) -> Self
    where
        T: Copy + Default,
    {
        let mut out = Self::new(len);
        zeroed(out.slots());
        out
    }

    /// The `len` slots to write.
    pub(super) fn slots(&mut self) -> &mut [MaybeUninit<T>] {
        &mut self.buf.spare_capacity_mut()[..self.len]
    }

    /// The written elements.
    ///
    /// # Safety
    /// Every slot must have been written.
    pub(super) unsafe fn assume_written(mut self) -> Vec<T> {
        // SAFETY: the capacity holds `len` slots, all written (the caller's promise).
        unsafe { self.buf.set_len(self.len) };
        self.buf
    }
}

/// `slots` filled with zeroes, as the initialized elements they now are.
pub(super) fn zeroed<T: Copy + Default>(slots: &mut [MaybeUninit<T>]) -> &mut [T] {
    slots.fill(MaybeUninit::new(T::default()));
    // SAFETY: every element was just written; MaybeUninit<T> has T's layout.
    unsafe { &mut *(slots as *mut [MaybeUninit<T>] as *mut [T]) }
}

/// `src` copied into `dst` (same length), as the initialized elements they now are.
pub(super) fn write_copy<'a, T: Copy>(dst: &'a mut [MaybeUninit<T>], src: &[T]) -> &'a mut [T] {
    assert_eq!(dst.len(), src.len());
    // SAFETY: same length, and a shared and a unique borrow cannot overlap.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast::<T>(), src.len()) };
    // SAFETY: every element was just written.
    unsafe { &mut *(dst as *mut [MaybeUninit<T>] as *mut [T]) }
}

/// Initialized elements seen as slots, for a kernel that writes every one of them with an
/// initialized value (a buffer that has been zero-filled anyway).
///
/// # Safety
/// Nothing may write `MaybeUninit::uninit()` (or leave a partial value) through the slots: the
/// elements must stay initialized.
pub(super) unsafe fn as_slots<T>(v: &mut [T]) -> &mut [MaybeUninit<T>] {
    // SAFETY: MaybeUninit<T> has T's layout; the caller keeps the elements initialized.
    unsafe { &mut *(v as *mut [T] as *mut [MaybeUninit<T>]) }
}

/// Call `f` with `t`'s elements as an f32 slice, borrowed from its storage when it is a
/// contiguous f32 CPU tensor, copied out otherwise (a snapshot's or a gradient's way to the wire).
pub fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    with_f32_slices(&[Some(t.clone())], |s| f(s[0].unwrap_or_default()))
}

/// Call `f` with each tensor's elements as an f32 slice (None stays None): borrowed straight from
/// the storage of contiguous f32 CPU tensors, copied out of any other. What the optimizer reads
/// its gradients through: no 38 MB copy of every gradient each step.
pub fn with_f32_slices<R>(tensors: &[Option<Tensor>], f: impl FnOnce(&[Option<&[f32]>]) -> R) -> candle_core::Result<R> {
    let direct = |t: &Tensor| t.dtype() == candle_core::DType::F32 && t.device().is_cpu() && t.is_contiguous();
    // Copies first, with no storage lock held.
    let mut owned: Vec<Option<Vec<f32>>> = Vec::with_capacity(tensors.len());
    for t in tensors {
        owned.push(match t {
            Some(t) if !direct(t) => Some(t.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
            _ => None,
        });
    }
    let guards: Vec<_> = tensors.iter().map(|t| t.as_ref().filter(|t| direct(t)).map(|t| t.storage_and_layout())).collect();
    let mut slices: Vec<Option<&[f32]>> = Vec::with_capacity(tensors.len());
    for (own, guard) in owned.iter().zip(&guards) {
        slices.push(match (own, guard) {
            (Some(v), _) => Some(v.as_slice()),
            (None, Some((storage, layout))) => match (&**storage, layout.contiguous_offsets()) {
                (candle_core::Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => Some(&v[a..b]),
                _ => candle_core::bail!("with_f32_slices: a contiguous f32 CPU tensor without its storage"),
            },
            (None, None) => None,
        });
    }
    Ok(f(&slices))
}
