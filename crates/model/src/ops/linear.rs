//! A linear layer, x·W + b, as one autograd node: the bias is written as the GEMM's initial
//! value, and backward is two GEMMs plus one row sum, instead of candle's matmul and
//! broadcast-add nodes whose backward reduces the [N, dout] gradient over a strided axis and
//! zero-fills extra buffers.

use super::gemm::gemm_rm;
use super::host::{add_row_sums, contiguous_slice, host_f64, with_host_f32, write_copy, Unfilled};
use super::parallel::{join, part_len, run_parallel, SharedMut, ELEMENTWISE_MIN};
use candle_core::{CpuStorage, Layout, Shape, Tensor};

/// The autograd node of [`linear`]: inputs x, W, b.
struct LinearOp;

macro_rules! linear_impl {
    ($fwd:ident, $bwd:ident, $t:ty) => {
        fn $fwd(x: &[$t], w: &[$t], b: &[$t], n: usize, din: usize, dout: usize) -> Vec<$t> {
            let mut y = Unfilled::<$t>::new(n * dout);
            let part = part_len(n, dout, ELEMENTWISE_MIN).max(1); // dout = 0: an empty y
            run_parallel(y.slots().chunks_mut(part).collect(), |rows| {
                rows.chunks_mut(dout).for_each(|row| {
                    write_copy(row, b);
                })
            });
            // SAFETY: every row holds the bias now.
            let mut y = unsafe { y.assume_written() };
            // SAFETY: x is n×din, w is din×dout, y is n×dout; no aliasing.
            unsafe { gemm_rm(n, dout, din, y.as_mut_ptr(), true, (x.as_ptr(), din as isize, 1), (w.as_ptr(), dout as isize, 1), 1.0) };
            y
        }

        /// (dx, dW, db) from g (n×dout).
        fn $bwd(x: &[$t], w: &[$t], g: &[$t], n: usize, din: usize, dout: usize) -> (Vec<$t>, Vec<$t>, Vec<$t>) {
            // The products write every element unless their inner dimension is empty.
            let (mut gx, mut gw) = match (dout, n) {
                (0, _) | (_, 0) => (Unfilled::<$t>::zeroed(n * din), Unfilled::<$t>::zeroed(din * dout)),
                _ => (Unfilled::new(n * din), Unfilled::new(din * dout)),
            };
            let (gx_slots, gw_slots) = (SharedMut(gx.slots().as_mut_ptr().cast::<$t>()), SharedMut(gw.slots().as_mut_ptr().cast::<$t>()));
            // The two products side by side on the pool: each packs its operands on the thread
            // that calls it, which would otherwise be the calling thread while the pool waits.
            join(
                || {
                    #[allow(clippy::redundant_locals)] // capture the whole Send wrapper, not its raw pointer field
                    let gx_slots = gx_slots;
                    // SAFETY: g is n×dout, Wᵀ is dout×din (row stride 1, column stride dout); dst
                    // is gx's n×din slots, every one written (k = dout > 0, no read of dst) or
                    // zeroed above, and nothing else touches them meanwhile.
                    unsafe {
                        gemm_rm(n, din, dout, gx_slots.0, false, (g.as_ptr(), dout as isize, 1), (w.as_ptr(), 1, dout as isize), 1.0)
                    };
                },
                || {
                    #[allow(clippy::redundant_locals)]
                    let gw_slots = gw_slots;
                    // SAFETY: xᵀ is din×n (row stride 1, column stride din), g is n×dout; dst is
                    // gw's din×dout slots, every one written (k = n > 0) or zeroed above.
                    unsafe { gemm_rm(din, dout, n, gw_slots.0, false, (x.as_ptr(), 1, din as isize), (g.as_ptr(), dout as isize, 1), 1.0) };
                },
            );
            // SAFETY: as just said.
            let (gx, gw) = unsafe { (gx.assume_written(), gw.assume_written()) };
            let mut gb: Vec<$t> = vec![0.0; dout];
            add_row_sums_by_columns(&mut gb, g);
            (gx, gw, gb)
        }
    };
}

/// [`add_row_sums`] over the cores for a large matrix: each part of the columns is summed by one
/// job, row by row in row order — the order of the serial pass, so the same bits.
fn add_row_sums_by_columns<T: Copy + Send + Sync + std::ops::AddAssign>(acc: &mut [T], m: &[T]) {
    let width = acc.len();
    let cores = super::threads();
    if width == 0 || m.len() < ELEMENTWISE_MIN || cores == 1 {
        return add_row_sums(acc, m);
    }
    // Parts of whole 16-column blocks (a cache line of f32), one per core.
    let part = width.div_ceil(cores).div_ceil(16) * 16;
    let parts: Vec<(usize, &mut [T])> = acc.chunks_mut(part).enumerate().map(|(i, a)| (i * part, a)).collect();
    run_parallel(parts, |(start, acc)| {
        let end = start + acc.len();
        for row in m.chunks(width) {
            acc.iter_mut().zip(&row[start..end]).for_each(|(a, &v)| *a += v);
        }
    });
}

linear_impl!(linear_fwd_f32, linear_bwd_f32, f32);
linear_impl!(linear_fwd_f64, linear_bwd_f64, f64);

custom_op!(LinearOp: CustomOp3 "lazarus-linear", cpu, "linear");

impl LinearOp {
    fn cpu(&self, [(s1, l1), (s2, l2), (s3, l3)]: [(&CpuStorage, &Layout); 3]) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, din) = l1.shape().dims2()?;
        let (din2, dout) = l2.shape().dims2()?;
        if din2 != din || l3.shape().dims1()? != dout {
            candle_core::bail!("linear: shapes {:?} {:?} {:?} do not match", l1.shape(), l2.shape(), l3.shape());
        }
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(x), CpuStorage::F32(w), CpuStorage::F32(b)) => {
                CpuStorage::F32(linear_fwd_f32(contiguous_slice(x, l1)?, contiguous_slice(w, l2)?, contiguous_slice(b, l3)?, n, din, dout))
            }
            (CpuStorage::F64(x), CpuStorage::F64(w), CpuStorage::F64(b)) => {
                CpuStorage::F64(linear_fwd_f64(contiguous_slice(x, l1)?, contiguous_slice(w, l2)?, contiguous_slice(b, l3)?, n, din, dout))
            }
            _ => candle_core::bail!("linear: f32 or f64 inputs of one dtype"),
        };
        Ok((out, Shape::from((n, dout))))
    }

    fn grads(&self, [x, w, _b]: [&Tensor; 3], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads3> {
        let (n, din) = x.dims2()?;
        let dout = w.dim(1)?;
        let dev = x.device();
        let (gx, gw, gb) = match x.dtype() {
            candle_core::DType::F32 => {
                let (gx, gw, gb) = with_host_f32([x, w, grad], |[x, w, g]| linear_bwd_f32(x, w, g, n, din, dout))?;
                (Tensor::from_vec(gx, (n, din), dev)?, Tensor::from_vec(gw, (din, dout), dev)?, Tensor::from_vec(gb, dout, dev)?)
            }
            _ => {
                let v = host_f64;
                let (gx, gw, gb) = linear_bwd_f64(&v(x)?, &v(w)?, &v(grad)?, n, din, dout);
                (Tensor::from_vec(gx, (n, din), dev)?, Tensor::from_vec(gw, (din, dout), dev)?, Tensor::from_vec(gb, dout, dev)?)
            }
        };
        Ok((Some(gx), Some(gw), Some(gb)))
    }
}

/// x [N, din] · W [din, dout] + b [dout], differentiable in all three.
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if super::cuda::takes(x) && w.dtype() == x.dtype() && b.dtype() == x.dtype() {
        return super::cuda::linear_to(x, w, Some(b), None, x.dtype());
    }
    if !super::fused_here(x) {
        return super::composite::linear(x, w, b);
    }
    x.contiguous()?.apply_op3(&w.contiguous()?, &b.contiguous()?, LinearOp)
}

#[cfg(test)]
mod tests {
    use super::super::testing;
    use super::*;

    #[test]
    fn fused_linear_matches_composite_with_gradients() {
        // Small, and large enough that the bias rows and its gradient's sums are split over the
        // cores (n·dout ≥ 2^16).
        for [n, din, dout] in [[9, 4, 6], [700, 20, 100]] {
            linear_against_composite(n, din, dout);
        }
        // No outputs: an empty result, not a panic.
        let mut var = testing::vars(6, 1.0);
        let y = linear(var(&[70_000, 2]).as_tensor(), var(&[2, 0]).as_tensor(), var(&[0]).as_tensor()).unwrap();
        assert_eq!(y.dims(), &[70_000, 0]);
    }

    #[test]
    fn row_sums_by_columns_are_the_serial_sums_bit_for_bit() {
        for (rows, width) in [(1000usize, 100usize), (200, 768), (70_000, 1), (3, 5)] {
            let m: Vec<f32> = (0..rows * width).map(|i| ((i * 7919 % 1013) as f32).sin() * 1e3).collect();
            let (mut serial, mut split) = (vec![0.5f32; width], vec![0.5f32; width]);
            add_row_sums(&mut serial, &m);
            add_row_sums_by_columns(&mut split, &m);
            assert!(serial.iter().zip(&split).all(|(a, b)| a.to_bits() == b.to_bits()), "{rows} x {width}");
        }
    }

    fn linear_against_composite(n: usize, din: usize, dout: usize) {
        let mut var = testing::vars(5, 1.0);
        let (x, w, b, probe) = (var(&[n, din]), var(&[din, dout]), var(&[dout]), var(&[n, dout]));
        let ours = linear(x.as_tensor(), w.as_tensor(), b.as_tensor()).unwrap();
        let theirs = super::super::composite::linear(x.as_tensor(), w.as_tensor(), b.as_tensor()).unwrap();
        let diff = testing::max_diff;
        assert!(diff(&ours, &theirs) < 1e-12);
        let g1 = (&ours * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (&theirs * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&x, &w, &b] {
            assert!(diff(g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap()) < 1e-10);
        }
    }
}
