//! Mean cross-entropy of logits against class targets as one autograd node: each row's
//! log-sum-exp and picked logit in one pass (in f64), and the backward's softmax-minus-one-hot
//! in one more, the rows in parts over the cores. candle's composite (max, sub, exp, sum, log,
//! gather, sub, mean) was eight single-core nodes over the [N, V] logits, and as many again
//! backward.

use super::host::{contiguous_slice, host_f64};
use super::parallel::{part_len, run_parallel, ROWWISE_MIN};
use candle_core::{CpuStorage, Layout, Shape, Tensor};

/// The node of [`cross_entropy`]: logits [N, V] → scalar.
struct CrossEntropy {
    targets: Vec<u32>,
}

/// Row `r`'s log-sum-exp minus its target's logit, in f64.
fn row_loss(row: &[f64], target: usize) -> f64 {
    let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = row.iter().map(|&x| (x - max).exp()).sum();
    max + sum.ln() - row[target]
}

/// Rows of `v` columns in parts over the cores: `job(first_row, rows)` per part, results in
/// row order.
fn by_rows<T: Sync, R: Send>(x: &[T], v: usize, job: impl Fn(usize, &[T]) -> R + Sync + Send) -> Vec<R> {
    let part = part_len(x.len() / v.max(1), v, ROWWISE_MIN).max(1);
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

    /// Mean loss over the rows (each row's loss in f64, summed in row order).
    fn loss(&self, x: &[f64], v: usize) -> f64 {
        let parts = by_rows(x, v, |first, rows| {
            rows.chunks_exact(v).enumerate().map(|(i, row)| row_loss(row, self.targets[first + i] as usize)).sum::<f64>()
        });
        parts.iter().sum::<f64>() / self.targets.len().max(1) as f64
    }

    /// d loss / d logits, times the upstream gradient `g`: (softmax − one-hot) · g / N.
    fn grad(&self, x: &[f64], v: usize, g: f64) -> Vec<f64> {
        let scale = g / self.targets.len().max(1) as f64;
        by_rows(x, v, |first, rows| {
            let mut out = Vec::with_capacity(rows.len());
            for (i, row) in rows.chunks_exact(v).enumerate() {
                let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let start = out.len();
                out.extend(row.iter().map(|&x| (x - max).exp()));
                let sum: f64 = out[start..].iter().sum();
                out[start..].iter_mut().for_each(|p| *p = *p / sum * scale);
                out[start + self.targets[first + i] as usize] -= scale;
            }
            out
        })
        .concat()
    }
}

impl candle_core::CustomOp1 for CrossEntropy {
    fn name(&self) -> &'static str {
        "lazarus-cross-entropy"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let _profile = crate::profile::kernel("cross-entropy.fwd");
        let (n, v) = l.shape().dims2()?;
        self.check(n, v)?;
        let out = match s {
            CpuStorage::F32(x) => {
                let x: Vec<f64> = contiguous_slice(x, l)?.iter().map(|&a| a as f64).collect();
                CpuStorage::F32(vec![self.loss(&x, v) as f32])
            }
            CpuStorage::F64(x) => CpuStorage::F64(vec![self.loss(contiguous_slice(x, l)?, v)]),
            _ => candle_core::bail!("cross entropy: f32 or f64 logits"),
        };
        Ok((out, Shape::from(())))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let _profile = crate::profile::kernel("cross-entropy.bwd");
        let (_, v) = arg.dims2()?;
        let g = grad.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
        let gx = self.grad(&host_f64(arg)?, v, g);
        Ok(Some(Tensor::from_vec(gx, arg.shape(), arg.device())?.to_dtype(arg.dtype())?))
    }
}

/// Mean cross-entropy of `logits` [N, V] against `targets` (N class ids, each < V): a scalar,
/// differentiable in the logits.
pub fn cross_entropy(logits: &Tensor, targets: &[u32]) -> candle_core::Result<Tensor> {
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
