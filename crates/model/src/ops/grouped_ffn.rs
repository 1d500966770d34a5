//! Every expert of one MoE layer as a single autograd node over rows grouped by expert: each
//! expert's rows run through the [expert FFN kernel](mod@super::expert_ffn), GELU(x·W1 + b1)·W2 + b2
//! as GEMMs on the raw buffers, one expert after the other.
//!
//! One node instead of one per expert plus a gather, a weight multiply and a scatter per expert:
//! the per-expert nodes each zero-filled and accumulated a full [N, d] input gradient in
//! backward. The forward keeps every expert's pre-activation and activation for the backward,
//! which recomputes them only if they are gone.

use super::expert_ffn::{ffn_bwd_f32, ffn_bwd_f64, ffn_fwd_f32, ffn_fwd_f64};
use super::host::{contiguous_slice, host_f32, host_f64};
use super::parallel::run_parallel;
use candle_core::{CpuStorage, Layout, Shape, Tensor};

/// Hidden pre-activation h and activation gelu(h) of one forward.
enum Saved {
    F32(Vec<f32>, Vec<f32>),
    F64(Vec<f64>, Vec<f64>),
}

/// All experts of one MoE layer as a single autograd node: x holds every routed row, grouped by
/// expert (`counts[e]` rows for expert e, in expert order), the weights come stacked as
/// W1b [E, d+1, f] and W2b [E, f+1, d] (bias as the last row, as in [`expert_ffn`](fn@super::expert_ffn)). One node
/// instead of one per expert plus a gather, a weight multiply and a scatter per expert: the
/// per-expert nodes each zero-filled and accumulated a full [N, d] input gradient in backward.
struct GroupedExpertFfn {
    counts: Vec<usize>,
    saved: std::sync::Mutex<Option<Vec<Saved>>>,
}

/// `buf` cut into consecutive parts of `sizes[i]` elements.
fn split_parts<T>(mut buf: &mut [T], sizes: impl Iterator<Item = usize>) -> Vec<&mut [T]> {
    let mut parts = Vec::new();
    for n in sizes {
        let (part, rest) = buf.split_at_mut(n);
        parts.push(part);
        buf = rest;
    }
    parts
}

macro_rules! grouped_ffn_impl {
    ($gfwd:ident, $gbwd:ident, $fwd:ident, $bwd:ident, $t:ty, $variant:ident) => {
        /// The experts run side by side on the pool (each writes its own rows of y): an expert's
        /// GEMMs alone are too small to keep many cores busy.
        fn $gfwd(x: &[$t], w1s: &[$t], w2s: &[$t], counts: &[usize], d: usize, f: usize) -> (Vec<$t>, Vec<Saved>) {
            let (s1, s2) = ((d + 1) * f, (f + 1) * d);
            let mut y: Vec<$t> = vec![0.0; x.len()];
            let starts: Vec<usize> = counts.iter().scan(0, |row, &n| Some(std::mem::replace(row, *row + n))).collect();
            let work: Vec<_> = split_parts(&mut y, counts.iter().map(|&n| n * d)).into_iter().enumerate().collect();
            let saved = run_parallel(work, |(e, ye)| {
                let (row, n) = (starts[e], counts[e]);
                let (h, a) = $fwd(&x[row * d..(row + n) * d], &w1s[e * s1..(e + 1) * s1], &w2s[e * s2..(e + 1) * s2], n, d, f, ye);
                Saved::$variant(h, a)
            });
            (y, saved)
        }

        /// As the forward: the experts side by side, each writing its own rows of the input
        /// gradient and its own block of the weight gradients.
        #[allow(clippy::too_many_arguments)]
        fn $gbwd(
            x: &[$t],
            w1s: &[$t],
            w2s: &[$t],
            g: &[$t],
            counts: &[usize],
            d: usize,
            f: usize,
            saved: Option<Vec<Saved>>,
        ) -> (Vec<$t>, Vec<$t>, Vec<$t>) {
            let (s1, s2) = ((d + 1) * f, (f + 1) * d);
            let mut kept: Vec<Option<(Vec<$t>, Vec<$t>)>> = match saved.filter(|s| s.len() == counts.len()) {
                Some(s) => s
                    .into_iter()
                    .map(|s| match s {
                        Saved::$variant(h, a) => Some((h, a)),
                        #[allow(unreachable_patterns)]
                        _ => None,
                    })
                    .collect(),
                None => counts.iter().map(|_| None).collect(),
            };
            let mut gx: Vec<$t> = vec![0.0; x.len()];
            let mut gw1: Vec<$t> = vec![0.0; w1s.len()];
            let mut gw2: Vec<$t> = vec![0.0; w2s.len()];
            let starts: Vec<usize> = counts.iter().scan(0, |row, &n| Some(std::mem::replace(row, *row + n))).collect();
            let work: Vec<_> = split_parts(&mut gx, counts.iter().map(|&n| n * d))
                .into_iter()
                .zip(gw1.chunks_mut(s1))
                .zip(gw2.chunks_mut(s2))
                .zip(kept.iter_mut().map(Option::take))
                .enumerate()
                .collect();
            run_parallel(work, |(e, (((ge, g1), g2), kept))| {
                let (row, n) = (starts[e], counts[e]);
                $bwd(
                    &x[row * d..(row + n) * d],
                    &w1s[e * s1..(e + 1) * s1],
                    &w2s[e * s2..(e + 1) * s2],
                    &g[row * d..(row + n) * d],
                    n,
                    d,
                    f,
                    kept,
                    (ge, g1, g2),
                );
            });
            (gx, gw1, gw2)
        }
    };
}

grouped_ffn_impl!(grouped_fwd_f32, grouped_bwd_f32, ffn_fwd_f32, ffn_bwd_f32, f32, F32);
grouped_ffn_impl!(grouped_fwd_f64, grouped_bwd_f64, ffn_fwd_f64, ffn_bwd_f64, f64, F64);

impl candle_core::CustomOp3 for GroupedExpertFfn {
    fn name(&self) -> &'static str {
        "lazarus-grouped-expert-ffn"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, d) = l1.shape().dims2()?;
        let (e, d1, f) = l2.shape().dims3()?;
        if d1 != d + 1 || l3.shape().dims3()? != (e, f + 1, d) || e != self.counts.len() || self.counts.iter().sum::<usize>() != rows {
            candle_core::bail!(
                "grouped expert ffn: shapes {:?} {:?} {:?} do not match counts {:?}",
                l1.shape(),
                l2.shape(),
                l3.shape(),
                self.counts
            );
        }
        let (out, saved) = match (s1, s2, s3) {
            (CpuStorage::F32(x), CpuStorage::F32(w1), CpuStorage::F32(w2)) => {
                let (y, saved) =
                    grouped_fwd_f32(contiguous_slice(x, l1)?, contiguous_slice(w1, l2)?, contiguous_slice(w2, l3)?, &self.counts, d, f);
                (CpuStorage::F32(y), saved)
            }
            (CpuStorage::F64(x), CpuStorage::F64(w1), CpuStorage::F64(w2)) => {
                let (y, saved) =
                    grouped_fwd_f64(contiguous_slice(x, l1)?, contiguous_slice(w1, l2)?, contiguous_slice(w2, l3)?, &self.counts, d, f);
                (CpuStorage::F64(y), saved)
            }
            _ => candle_core::bail!("grouped expert ffn: f32 or f64 inputs of one dtype"),
        };
        if let Ok(mut slot) = self.saved.lock() {
            *slot = Some(saved);
        }
        Ok((out, Shape::from((rows, d))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w1s: &Tensor,
        w2s: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (_, d) = x.dims2()?;
        let f = w1s.dim(2)?;
        let dev = x.device();
        let saved = self.saved.lock().ok().and_then(|mut s| s.take());
        let (gx, g1, g2) = match x.dtype() {
            candle_core::DType::F32 => {
                let v = host_f32;
                let (gx, g1, g2) = grouped_bwd_f32(&v(x)?, &v(w1s)?, &v(w2s)?, &v(grad)?, &self.counts, d, f, saved);
                (Tensor::from_vec(gx, x.shape(), dev)?, Tensor::from_vec(g1, w1s.shape(), dev)?, Tensor::from_vec(g2, w2s.shape(), dev)?)
            }
            _ => {
                let v = host_f64;
                let saved = saved.filter(|_| x.dtype() == candle_core::DType::F64);
                let (gx, g1, g2) = grouped_bwd_f64(&v(x)?, &v(w1s)?, &v(w2s)?, &v(grad)?, &self.counts, d, f, saved);
                (Tensor::from_vec(gx, x.shape(), dev)?, Tensor::from_vec(g1, w1s.shape(), dev)?, Tensor::from_vec(g2, w2s.shape(), dev)?)
            }
        };
        Ok((Some(gx), Some(g1), Some(g2)))
    }
}

/// GELU(x·W1 + b1)·W2 + b2 for x [n, d], W1 [d, f], b1 [f], W2 [f, d], b2 [d]; differentiable in
/// all five: one expert is a group of one.
pub fn expert_ffn(x: &Tensor, w1: &Tensor, b1: &Tensor, w2: &Tensor, b2: &Tensor) -> candle_core::Result<Tensor> {
    grouped_expert_ffn(x, &[[w1, b1, w2, b2]], &[x.dim(0)?])
}

/// Every expert of a layer over rows grouped by expert: x [R, d] with `counts[e]` rows for expert
/// e (in expert order, Σ counts = R); `experts[e]` = (W1 [d, f], b1 [f], W2 [f, d], b2 [d]).
/// Returns [R, d], each row through its own expert; differentiable in x and every weight.
pub fn grouped_expert_ffn(x: &Tensor, experts: &[[&Tensor; 4]], counts: &[usize]) -> candle_core::Result<Tensor> {
    if experts.len() != counts.len() {
        candle_core::bail!("grouped expert ffn: {} experts but {} counts", experts.len(), counts.len())
    }
    let (d, f) = experts.first().map_or(Ok((x.dim(1)?, 0)), |[w1, ..]| w1.dims2())?;
    // One cat per stack (W1, b1, W1, b1, … rows, then a free reshape): a single copy of the
    // weights forward, and a single narrow per tensor backward.
    let mut w1: Vec<Tensor> = Vec::with_capacity(2 * experts.len());
    let mut w2: Vec<Tensor> = Vec::with_capacity(2 * experts.len());
    for [a, b, c, e] in experts {
        w1.extend([(*a).clone(), b.unsqueeze(0)?]);
        w2.extend([(*c).clone(), e.unsqueeze(0)?]);
    }
    let n = experts.len();
    let op = GroupedExpertFfn { counts: counts.to_vec(), saved: std::sync::Mutex::new(None) };
    x.contiguous()?.apply_op3(&Tensor::cat(&w1, 0)?.reshape((n, d + 1, f))?, &Tensor::cat(&w2, 0)?.reshape((n, f + 1, d))?, op)
}

#[cfg(test)]
mod tests {
    use super::super::gelu::gelu;
    use super::super::testing;
    use super::*;
    use candle_core::Var;

    #[test]
    fn grouped_experts_match_the_composite_per_expert_with_gradients() {
        let (d, f) = (5, 6);
        let counts = [3usize, 0, 4, 1];
        let mut var = testing::vars(17, 0.5);
        let rows: usize = counts.iter().sum();
        let x = var(&[rows, d]);
        let probe = var(&[rows, d]);
        let weights: Vec<[Var; 4]> = counts.iter().map(|_| [var(&[d, f]), var(&[f]), var(&[f, d]), var(&[d])]).collect();
        let refs: Vec<[&Tensor; 4]> =
            weights.iter().map(|w| [w[0].as_tensor(), w[1].as_tensor(), w[2].as_tensor(), w[3].as_tensor()]).collect();
        let ours = grouped_expert_ffn(x.as_tensor(), &refs, &counts).unwrap();
        let mut parts = Vec::new();
        let mut row = 0;
        for (e, &n) in counts.iter().enumerate() {
            if n > 0 {
                let w = &refs[e];
                let h = x.as_tensor().narrow(0, row, n).unwrap().matmul(w[0]).unwrap().broadcast_add(w[1]).unwrap();
                parts.push(gelu(&h).unwrap().matmul(w[2]).unwrap().broadcast_add(w[3]).unwrap());
            }
            row += n;
        }
        let theirs = Tensor::cat(&parts, 0).unwrap();
        let diff = testing::max_diff;
        assert!(diff(&ours, &theirs) < 1e-12);
        let g1 = (&ours * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (&theirs * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(diff(g1.get(x.as_tensor()).unwrap(), g2.get(x.as_tensor()).unwrap()) < 1e-10);
        for (e, w) in weights.iter().enumerate() {
            for v in w {
                match (g1.get(v.as_tensor()), g2.get(v.as_tensor())) {
                    (Some(a), Some(b)) => assert!(diff(a, b) < 1e-10),
                    (Some(a), None) => {
                        assert_eq!(counts[e], 0, "gradient only on our side");
                        assert_eq!(a.abs().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap(), 0.0);
                    }
                    (None, _) => panic!("no gradient for expert {e}"),
                }
            }
        }
    }
}
