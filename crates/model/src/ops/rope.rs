//! Rotary position embeddings (Su et al. 2021, RoFormer) on the packed projection qkv [B, T, 3d],
//! as one pass that turns the queries and keys and copies the values, instead of candle's
//! reshapes, narrows, six products and two concatenations (and their backward).
//!
//! The pairing is Llama's and Mixtral's "half-split" one (transformers' `rotate_half`): within
//! each head of width h, dimensions i and i + h/2 turn together by the angle t·θ^(−2i/h) at
//! position t, so the weights of a Hugging Face checkpoint apply unchanged. The turn is
//! orthogonal: the backward turns the gradient back by the opposite angle.

use super::host::{contiguous_slice, host_f64, with_host_f32, write_copy, Unfilled};
use super::parallel::{part_len, run_parallel, ROWWISE_MIN};
use candle_core::{CpuStorage, Layout, Shape, Tensor};

/// The autograd node of [`rope`]: qkv [B, T, 3d] → the same shape.
struct Rope {
    heads: usize,
    theta: f64,
    /// The backward's turn, by the opposite angle.
    inverse: bool,
}

macro_rules! rope_impl {
    ($name:ident, $t:ty) => {
        /// Turn q and k of every row of `x` (rows of 3d, `t` positions per sequence) into a new
        /// buffer; v copied.
        fn $name(x: &[$t], t: usize, d: usize, heads: usize, cos: &[f64], sin: &[f64], inverse: bool) -> Vec<$t> {
            let (dh, width) = (d / heads, 3 * d);
            let half = dh / 2;
            let cos: Vec<$t> = cos.iter().map(|&v| v as $t).collect();
            let sin: Vec<$t> = sin.iter().map(|&v| if inverse { -v as $t } else { v as $t }).collect();
            let mut y = Unfilled::<$t>::new(x.len());
            let rows = x.len() / width;
            let part = part_len(rows, width, ROWWISE_MIN);
            let first_rows: Vec<usize> = (0..rows).step_by((part / width).max(1)).collect();
            let work: Vec<_> = y.slots().chunks_mut(part).zip(x.chunks(part)).zip(first_rows).collect();
            run_parallel(work, |((ys, xs), first)| {
                for (r, (yr, xr)) in ys.chunks_exact_mut(width).zip(xs.chunks_exact(width)).enumerate() {
                    let pos = (first + r) % t;
                    let (c, s) = (&cos[pos * half..(pos + 1) * half], &sin[pos * half..(pos + 1) * half]);
                    for head in 0..2 * heads {
                        let at = head * dh;
                        let (a, b) = xr[at..at + dh].split_at(half);
                        let (ya, yb) = yr[at..at + dh].split_at_mut(half);
                        for i in 0..half {
                            ya[i].write(a[i] * c[i] - b[i] * s[i]);
                            yb[i].write(b[i] * c[i] + a[i] * s[i]);
                        }
                    }
                    write_copy(&mut yr[2 * d..], &xr[2 * d..]);
                }
            });
            // SAFETY: the parts cover every row, each written in full.
            unsafe { y.assume_written() }
        }
    };
}

rope_impl!(rope_f32, f32);
rope_impl!(rope_f64, f64);

custom_op!(Rope: CustomOp1 "lazarus-rope", cpu, "rope");

impl Rope {
    fn cpu(&self, [(storage, layout)]: [(&CpuStorage, &Layout); 1]) -> candle_core::Result<(CpuStorage, Shape)> {
        let (_, t, d3) = layout.shape().dims3()?;
        let d = d3 / 3;
        let (cos, sin) = super::composite::rope_tables(t, d / self.heads, self.theta);
        let out = match storage {
            CpuStorage::F32(x) => CpuStorage::F32(rope_f32(contiguous_slice(x, layout)?, t, d, self.heads, &cos, &sin, self.inverse)),
            CpuStorage::F64(x) => CpuStorage::F64(rope_f64(contiguous_slice(x, layout)?, t, d, self.heads, &cos, &sin, self.inverse)),
            _ => candle_core::bail!("rope: only f32 and f64 are supported"),
        };
        Ok((out, layout.shape().clone()))
    }

    fn grads(&self, [_arg]: [&Tensor; 1], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads1> {
        let (_, t, d3) = grad.dims3()?;
        let d = d3 / 3;
        let (cos, sin) = super::composite::rope_tables(t, d / self.heads, self.theta);
        let back = !self.inverse;
        let g = match grad.dtype() {
            candle_core::DType::F32 => {
                let g = with_host_f32([grad], |[g]| rope_f32(g, t, d, self.heads, &cos, &sin, back))?;
                Tensor::from_vec(g, grad.shape(), grad.device())?
            }
            _ => {
                let g = rope_f64(&host_f64(grad)?, t, d, self.heads, &cos, &sin, back);
                Tensor::from_vec(g, grad.shape(), grad.device())?.to_dtype(grad.dtype())?
            }
        };
        Ok(Some(g))
    }
}

/// Rotary positions on the queries and keys of qkv [B, T, 3d] with `heads` heads and base
/// `theta` (the values pass unchanged); differentiable.
pub fn rope(qkv: &Tensor, heads: usize, theta: f64) -> candle_core::Result<Tensor> {
    let (_, _, d3) = qkv.dims3()?;
    if !d3.is_multiple_of(3) || heads == 0 || !(d3 / 3).is_multiple_of(heads) || !(d3 / 3 / heads).is_multiple_of(2) {
        candle_core::bail!("rope: qkv width {d3} is not 3 × {heads} heads of an even width")
    }
    #[cfg(feature = "cuda")]
    if super::cuda::takes(qkv) {
        return super::cuda::rope(qkv, heads, theta);
    }
    if !super::fused_here(qkv) {
        return super::composite::rope(qkv, heads, theta);
    }
    qkv.contiguous()?.apply_op1(Rope { heads, theta, inverse: false })
}

#[cfg(test)]
mod tests {
    use super::super::testing::{data, max_diff};
    use super::*;
    use candle_core::{Device, Var};

    /// Ours against the composite, forward and the gradient, for a batch of sequences long enough
    /// to be split over the cores (the position of a row is its index within its sequence).
    #[test]
    fn rope_matches_composite_with_gradients() {
        for (b, t, heads, dh) in [(2, 5, 2, 4), (3, 97, 4, 32)] {
            let d = heads * dh;
            let x = Var::from_vec(data(b * t * 3 * d, 3), (b, t, 3 * d), &Device::Cpu).unwrap();
            let probe = Tensor::from_vec(data(b * t * 3 * d, 4), (b, t, 3 * d), &Device::Cpu).unwrap();
            let ours = rope(x.as_tensor(), heads, 10_000.0).unwrap();
            let theirs = super::super::composite::rope(x.as_tensor(), heads, 10_000.0).unwrap();
            assert!(max_diff(&ours, &theirs) < 1e-12);
            let g1 = (&ours * &probe).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = (&theirs * &probe).unwrap().sum_all().unwrap().backward().unwrap();
            assert!(max_diff(g1.get(x.as_tensor()).unwrap(), g2.get(x.as_tensor()).unwrap()) < 1e-12);
            let x32 = x.as_tensor().to_dtype(candle_core::DType::F32).unwrap();
            let y32 = rope(&x32, heads, 10_000.0).unwrap().to_dtype(candle_core::DType::F64).unwrap();
            assert!(max_diff(&y32, &theirs) < 1e-5);
        }
    }

    /// Position 0 is not turned, and a query and a key turned by their positions have a dot
    /// product that depends only on the distance between them: what makes the positions relative.
    #[test]
    fn position_zero_is_unturned_and_scores_depend_on_distance_only() {
        let (heads, dh, t) = (1, 8, 6);
        let d = heads * dh;
        let q: Vec<f64> = data(dh, 1);
        let k: Vec<f64> = data(dh, 2);
        // Every row holds the same q and k; v zero.
        let row: Vec<f64> = q.iter().chain(&k).copied().chain(std::iter::repeat_n(0.0, d)).collect();
        let x: Vec<f64> = (0..t).flat_map(|_| row.clone()).collect();
        let y = rope(&Tensor::from_vec(x, (1, t, 3 * d), &Device::Cpu).unwrap(), heads, 100.0).unwrap();
        let y: Vec<Vec<f64>> = y.squeeze(0).unwrap().to_vec2().unwrap();
        assert_eq!(&y[0][..2 * d], &row[..2 * d]);
        let score = |i: usize, j: usize| (0..dh).map(|c| y[i][c] * y[j][d + c]).sum::<f64>();
        assert!((score(3, 1) - score(5, 3)).abs() < 1e-12);
        assert!((score(2, 2) - score(0, 0)).abs() < 1e-12);
        assert!((score(3, 1) - score(3, 2)).abs() > 1e-6, "different distances, different scores");
    }
}
