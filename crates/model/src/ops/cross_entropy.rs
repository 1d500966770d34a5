//! Mean cross-entropy of logits against class targets as one autograd node: each row's
//! log-sum-exp and picked logit in one pass (in f64), and the backward's softmax-minus-one-hot
//! in one more, the rows in parts over the cores. candle's composite (max, sub, exp, sum, log,
//! gather, sub, mean) was eight single-core nodes over the [N, V] logits, and as many again
//! backward.

use super::host::{contiguous_slice, host_f64, with_host_f32, Unfilled};
use super::parallel::{part_len, reduction_part_len, run_parallel, ROWWISE_MIN};
use candle_core::{CpuStorage, Layout, Shape, Tensor, WithDType};

/// The node of [`cross_entropy`]: logits [N, V] → scalar.
struct CrossEntropy {
    targets: Vec<u32>,
}

/// Row `r`'s log-sum-exp minus its target's logit, in f64 (each logit taken as f64).
fn row_loss<T: WithDType>(row: &[T], target: usize) -> f64 {
    let max = row.iter().map(|x| x.to_f64()).fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = row.iter().map(|x| (x.to_f64() - max).exp()).sum();
    max + sum.ln() - row[target].to_f64()
}

/// Rows of `v` columns in parts over the cores: `job(first_row, rows)` per part, results in
/// row order (parts of a size fixed by the shape: the caller adds their results).
fn by_rows<T: Sync, R: Send>(x: &[T], v: usize, job: impl Fn(usize, &[T]) -> R + Sync + Send) -> Vec<R> {
    let part = reduction_part_len(x.len() / v.max(1), v, ROWWISE_MIN).max(1);
    run_parallel(x.chunks(part).enumerate().map(|(i, c)| (i * part / v.max(1), c)).collect(), |(first, c)| job(first, c))
}

impl CrossEntropy {
    fn check(&self, n: usize, v: usize) -> candle_core::Result<()> {
        if n != self.targets.len() {
            candle_core::bail!("cross entropy: {n} rows of logits, {} targets", self.targets.len());
        }
        if let Some(&t) = self.targets.iter().find(|&&t| t as usize >= v) {
            candle_core::bail!("cross entropy: target {t} of {v} classes");
        }
        Ok(())
    }

    /// Mean loss over the rows (each row's loss in f64, summed in row order). The logits are read
    /// where they are, in their dtype: no f64 copy of them on the calling thread.
    fn loss<T: WithDType>(&self, x: &[T], v: usize) -> f64 {
        let parts = by_rows(x, v, |first, rows| {
            rows.chunks_exact(v).enumerate().map(|(i, row)| row_loss(row, self.targets[first + i] as usize)).sum::<f64>()
        });
        parts.iter().sum::<f64>() / self.targets.len().max(1) as f64
    }

    /// d loss / d logits, times the upstream gradient `g`: (softmax − one-hot) · g / N, computed
    /// in f64 and rounded to the logits' dtype, written over the cores straight into the output.
    fn grad<T: WithDType>(&self, x: &[T], v: usize, g: f64) -> Vec<T> {
        if v == 0 {
            return Vec::new();
        }
        let scale = g / self.targets.len().max(1) as f64;
        let mut out = Unfilled::<T>::new(x.len());
        let part = part_len(x.len() / v, v, ROWWISE_MIN).max(1);
        let parts: Vec<_> = x.chunks(part).zip(out.slots().chunks_mut(part)).enumerate().map(|(i, p)| (i * part / v, p)).collect();
        run_parallel(parts, |(first, (rows, o))| {
            let mut p = vec![0f64; v];
            for (i, (row, o)) in rows.chunks_exact(v).zip(o.chunks_exact_mut(v)).enumerate() {
                let max = row.iter().map(|x| x.to_f64()).fold(f64::NEG_INFINITY, f64::max);
                p.iter_mut().zip(row).for_each(|(p, x)| *p = (x.to_f64() - max).exp());
                let sum: f64 = p.iter().sum();
                p.iter_mut().for_each(|p| *p = *p / sum * scale);
                p[self.targets[first + i] as usize] -= scale;
                o.iter_mut().zip(&p).for_each(|(o, &p)| {
                    o.write(T::from_f64(p));
                });
            }
        });
        // SAFETY: the parts cover every row (whole rows of v), each element written.
        unsafe { out.assume_written() }
    }
}

custom_op!(CrossEntropy: CustomOp1 "lazarus-cross-entropy", cpu, "cross-entropy");

impl CrossEntropy {
    fn cpu(&self, [(s, l)]: [(&CpuStorage, &Layout); 1]) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, v) = l.shape().dims2()?;
        self.check(n, v)?;
        let out = match s {
            CpuStorage::F32(x) => CpuStorage::F32(vec![self.loss(contiguous_slice(x, l)?, v) as f32]),
            CpuStorage::F64(x) => CpuStorage::F64(vec![self.loss(contiguous_slice(x, l)?, v)]),
            _ => candle_core::bail!("cross entropy: f32 or f64 logits"),
        };
        Ok((out, Shape::from(())))
    }

    fn grads(&self, [arg]: [&Tensor; 1], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads1> {
        let (_, v) = arg.dims2()?;
        let g = grad.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
        let gx = match arg.dtype() {
            candle_core::DType::F32 => Tensor::from_vec(with_host_f32([arg], |[x]| self.grad(x, v, g))?, arg.shape(), arg.device())?,
            _ => Tensor::from_vec(self.grad(&host_f64(arg)?, v, g), arg.shape(), arg.device())?.to_dtype(arg.dtype())?,
        };
        Ok(Some(gx))
    }
}

/// Mean cross-entropy of `logits` [N, V] against `targets` (N class ids, each < V): a scalar,
/// differentiable in the logits.
pub fn cross_entropy(logits: &Tensor, targets: &[u32]) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if super::cuda::takes(logits) && logits.dtype() != candle_core::DType::BF16 {
        return super::cuda::cross_entropy(logits, targets);
    }
    let op = CrossEntropy { targets: targets.to_vec() };
    if !super::fused_here(logits) {
        // The fused kernel checks the targets in its forward; candle's gather on a device would not.
        let (n, v) = logits.dims2()?;
        op.check(n, v)?;
        return super::composite::cross_entropy(logits, &Tensor::from_slice(targets, n, logits.device())?);
    }
    logits.contiguous()?.apply_op1(op)
}

#[cfg(test)]
mod tests {
    use super::super::testing;
    use super::*;

    #[test]
    fn fused_cross_entropy_matches_the_composite_with_gradients() {
        for (n, v) in [(5usize, 7usize), (2000, 33)] {
            let mut var = testing::vars(31, 3.0);
            let x = var(&[n, v]);
            let targets: Vec<u32> = (0..n as u32).map(|i| (i * 5 + 3) % v as u32).collect();
            let ours = cross_entropy(x.as_tensor(), &targets).unwrap();
            let t = Tensor::from_vec(targets.clone(), n, &candle_core::Device::Cpu).unwrap();
            let logits = x.as_tensor();
            let theirs = super::super::composite::cross_entropy(logits, &t).unwrap();
            let diff = (ours.to_scalar::<f64>().unwrap() - theirs.to_scalar::<f64>().unwrap()).abs();
            assert!(diff < 1e-12, "{diff}");
            let g1 = (&ours * 2.5).unwrap().backward().unwrap();
            let g2 = (&theirs * 2.5).unwrap().backward().unwrap();
            assert!(testing::max_diff(g1.get(logits).unwrap(), g2.get(logits).unwrap()) < 1e-12);
        }
        let x = Tensor::zeros((2, 3), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        assert!(cross_entropy(&x, &[0, 3]).is_err(), "a target beyond the classes");
        assert!(cross_entropy(&x, &[0]).is_err(), "a target per row");
    }
}
