//! The residual add, a + b, over the cores.
//!
//! candle's add runs on one thread and allocates its output there; on the residual stream of
//! every block (two adds a block, forward) that is serial work that does not shrink with more
//! cores. Here the sum is the same element by element (so values are bit for bit candle's), in
//! parts over the pool, and the backward hands the output gradient to both arguments unchanged
//! (our candle keeps such a first gradient as it is: `vendor/README.md`).

use super::host::{contiguous_slice, Unfilled};
use super::parallel::{part_len, run_parallel, ELEMENTWISE_MIN};
use candle_core::{CpuStorage, Layout, Shape, Tensor};

fn add_parts<T: Copy + Send + Sync + Default + std::ops::Add<Output = T>>(a: &[T], b: &[T]) -> Vec<T> {
    assert_eq!(a.len(), b.len());
    let mut out = Unfilled::new(a.len());
    let part = part_len(a.len(), 1, ELEMENTWISE_MIN);
    run_parallel(out.slots().chunks_mut(part).zip(a.chunks(part).zip(b.chunks(part))).collect(), |(o, (x, y))| {
        o.iter_mut().zip(x.iter().zip(y)).for_each(|(o, (&x, &y))| {
            o.write(x + y);
        })
    });
    // SAFETY: the parts cover every element, each written.
    unsafe { out.assume_written() }
}

struct ResidualAdd;

custom_op!(ResidualAdd: CustomOp2 "lazarus-residual-add", cpu, "residual-add");

impl ResidualAdd {
    fn cpu(&self, [(s1, l1), (s2, l2)]: [(&CpuStorage, &Layout); 2]) -> candle_core::Result<(CpuStorage, Shape)> {
        if l1.shape() != l2.shape() {
            candle_core::bail!("residual add: shapes {:?} and {:?} differ", l1.shape(), l2.shape());
        }
        let out = match (s1, s2) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => CpuStorage::F32(add_parts(contiguous_slice(a, l1)?, contiguous_slice(b, l2)?)),
            (CpuStorage::F64(a), CpuStorage::F64(b)) => CpuStorage::F64(add_parts(contiguous_slice(a, l1)?, contiguous_slice(b, l2)?)),
            _ => candle_core::bail!("residual add: two f32 or two f64 tensors"),
        };
        Ok((out, l1.shape().clone()))
    }

    fn grads(&self, [_a, _b]: [&Tensor; 2], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads2> {
        Ok((Some(grad.clone()), Some(grad.clone())))
    }
}

/// a + b (same shape and dtype): over the cores on the CPU in f32/f64, candle's add elsewhere.
pub fn residual_add(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    if !super::fused_here(a) || a.dtype() != b.dtype() || a.shape() != b.shape() || !b.device().same_device(a.device()) {
        return a + b;
    }
    a.contiguous()?.apply_op2(&b.contiguous()?, ResidualAdd)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    #[test]
    fn the_sum_and_both_gradients_are_candles_bit_for_bit() {
        for (n, dtype) in [(7usize, DType::F32), (3 * ELEMENTWISE_MIN + 5, DType::F32), (ELEMENTWISE_MIN + 1, DType::F64)] {
            let dev = Device::Cpu;
            let a = Var::from_tensor(&Tensor::randn(0f32, 1.0, (n,), &dev).unwrap().to_dtype(dtype).unwrap()).unwrap();
            let b = Var::from_tensor(&Tensor::randn(0f32, 1.0, (n,), &dev).unwrap().to_dtype(dtype).unwrap()).unwrap();
            let w = Tensor::randn(0f32, 1.0, (n,), &dev).unwrap().to_dtype(dtype).unwrap();
            let ours = residual_add(a.as_tensor(), b.as_tensor()).unwrap();
            let theirs = (a.as_tensor() + b.as_tensor()).unwrap();
            let bits = |t: &Tensor| t.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
            assert_eq!(bits(&ours), bits(&theirs), "n = {n}");
            // Through a product, so the gradients are not all ones.
            let (g_ours, g_theirs) = (
                (ours * &w).unwrap().sum_all().unwrap().backward().unwrap(),
                (theirs * &w).unwrap().sum_all().unwrap().backward().unwrap(),
            );
            for v in [&a, &b] {
                assert_eq!(bits(g_ours.get(v).unwrap()), bits(g_theirs.get(v).unwrap()));
            }
        }
    }

    #[test]
    fn mismatched_inputs_go_candles_way_and_fail_as_candle_does() {
        let dev = Device::Cpu;
        let a = Tensor::zeros((2, 3), DType::F32, &dev).unwrap();
        assert!(residual_add(&a, &Tensor::zeros((3, 2), DType::F32, &dev).unwrap()).is_err());
        assert!(residual_add(&a, &Tensor::zeros((2, 3), DType::F64, &dev).unwrap()).is_err());
        let t = a.t().unwrap();
        let sum = residual_add(&t, &t).unwrap();
        assert_eq!(sum.dims(), &[3, 2]);
    }
}
