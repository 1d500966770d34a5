//! The MoE layer's row movement as two autograd nodes: [`gather_rows`] takes each routed
//! assignment's token row into expert order, and [`combine_rows`] adds each expert output row,
//! times its router weight, back onto its token. They replace candle's index_select,
//! broadcast_mul, zeros_like and index_add — four nodes that each wrote a full [R, d] or [N, d]
//! buffer on one core, and whose backward zero-filled and accumulated as many more.
//!
//! A token's rows are added in increasing row order, forward and backward, whatever the number of
//! cores: the forward and the gradient of the rows are those of the candle ops they replace; the
//! router weights' gradient (a dot product per row) may differ from candle's in its last bits.

use super::host::{contiguous_slice, host_f64, with_host_f32, write_copy, zeroed, Unfilled};
use super::parallel::{part_len, run_parallel, ROWWISE_MIN};
use candle_core::{CpuStorage, Layout, Shape, Tensor};

/// For each of `n` tokens, the rows (in increasing order) whose token it is.
fn rows_of_tokens(tokens: &[u32], n: usize) -> candle_core::Result<Vec<Vec<u32>>> {
    let mut rows = vec![Vec::new(); n];
    for (r, &t) in tokens.iter().enumerate() {
        match rows.get_mut(t as usize) {
            Some(list) => list.push(r as u32),
            None => candle_core::bail!("moe rows: token {t} of {n}"),
        }
    }
    Ok(rows)
}

/// out[t] = Σ_{r of t, increasing} w[r]·src[r] (w = None: 1), for every token t, the tokens in
/// parts over the cores.
fn scatter_add<T>(src: &[T], w: Option<&[T]>, rows_of: &[Vec<u32>], d: usize) -> Vec<T>
where
    T: Copy + Send + Sync + Default + std::ops::AddAssign + std::ops::Mul<Output = T>,
{
    if d == 0 {
        return Vec::new();
    }
    let mut out = Unfilled::new(rows_of.len() * d);
    let part = part_len(rows_of.len(), d, ROWWISE_MIN);
    run_parallel(out.slots().chunks_mut(part).zip(rows_of.chunks(part / d)).collect(), |(o, lists)| {
        for (orow, list) in o.chunks_exact_mut(d).zip(lists) {
            let orow = zeroed(orow);
            for &r in list {
                let s = &src[r as usize * d..(r as usize + 1) * d];
                match w {
                    Some(w) => orow.iter_mut().zip(s).for_each(|(o, &v)| *o += w[r as usize] * v),
                    None => orow.iter_mut().zip(s).for_each(|(o, &v)| *o += v),
                }
            }
        }
    });
    // SAFETY: the parts cover every token's row, each zero-filled before its sum.
    unsafe { out.assume_written() }
}

/// out[r] = src[tokens[r]] (times w[r] when given), the rows in parts over the cores.
fn gather<T>(src: &[T], w: Option<&[T]>, tokens: &[u32], d: usize) -> Vec<T>
where
    T: Copy + Send + Sync + Default + std::ops::Mul<Output = T>,
{
    if d == 0 {
        return Vec::new();
    }
    let mut out = Unfilled::new(tokens.len() * d);
    let part = part_len(tokens.len(), d, ROWWISE_MIN);
    let starts: Vec<usize> = (0..tokens.len()).step_by(part / d).collect();
    run_parallel(out.slots().chunks_mut(part).zip(starts).collect(), |(o, first)| {
        for (i, orow) in o.chunks_exact_mut(d).enumerate() {
            let r = first + i;
            let t = tokens[r] as usize;
            let s = &src[t * d..(t + 1) * d];
            match w {
                Some(w) => orow.iter_mut().zip(s).for_each(|(o, &v)| {
                    o.write(v * w[r]);
                }),
                None => {
                    write_copy(orow, s);
                }
            }
        }
    });
    // SAFETY: the parts cover every row, each written in full.
    unsafe { out.assume_written() }
}

/// g_w[r] = Σ_j y[r][j]·g[tokens[r]][j]: the router weights' gradient.
fn weight_grads<T>(y: &[T], g: &[T], tokens: &[u32], d: usize) -> Vec<T>
where
    T: Copy + Send + Sync + Default + std::ops::AddAssign + std::ops::Mul<Output = T>,
{
    let mut out = vec![T::default(); tokens.len()];
    let part = part_len(tokens.len(), 1, ROWWISE_MIN / d.max(1));
    let starts: Vec<usize> = (0..tokens.len()).step_by(part.max(1)).collect();
    run_parallel(out.chunks_mut(part).zip(starts).collect(), |(o, first)| {
        for (i, o) in o.iter_mut().enumerate() {
            let r = first + i;
            let t = tokens[r] as usize;
            let mut acc = T::default();
            for (&a, &b) in y[r * d..(r + 1) * d].iter().zip(&g[t * d..(t + 1) * d]) {
                acc += a * b;
            }
            *o = acc;
        }
    });
    out
}

/// The node of [`gather_rows`]: src [N, d] → [R, d].
struct GatherRows {
    tokens: Vec<u32>,
    n: usize,
}

/// The node of [`combine_rows`]: (y [R, d], w [R]) → [N, d].
struct CombineRows {
    tokens: Vec<u32>,
    n: usize,
}

custom_op!(GatherRows: CustomOp1 "lazarus-gather-rows", cpu, "gather-rows");

impl GatherRows {
    fn cpu(&self, [(s, l)]: [(&CpuStorage, &Layout); 1]) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, d) = l.shape().dims2()?;
        if n != self.n {
            candle_core::bail!("gather rows: {n} token rows, expected {}", self.n);
        }
        let out = match s {
            CpuStorage::F32(v) => CpuStorage::F32(gather(contiguous_slice(v, l)?, None, &self.tokens, d)),
            CpuStorage::F64(v) => CpuStorage::F64(gather(contiguous_slice(v, l)?, None, &self.tokens, d)),
            _ => candle_core::bail!("gather rows: f32 or f64"),
        };
        Ok((out, Shape::from((self.tokens.len(), d))))
    }

    fn grads(&self, [arg]: [&Tensor; 1], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads1> {
        let (n, d) = arg.dims2()?;
        let rows_of = rows_of_tokens(&self.tokens, n)?;
        let g = match arg.dtype() {
            candle_core::DType::F32 => {
                Tensor::from_vec(with_host_f32([grad], |[g]| scatter_add(g, None, &rows_of, d))?, (n, d), arg.device())?
            }
            _ => Tensor::from_vec(scatter_add(&host_f64(grad)?, None, &rows_of, d), (n, d), arg.device())?.to_dtype(arg.dtype())?,
        };
        Ok(Some(g))
    }
}

custom_op!(CombineRows: CustomOp2 "lazarus-combine-rows", cpu, "combine-rows");

impl CombineRows {
    fn cpu(&self, [(s1, l1), (s2, l2)]: [(&CpuStorage, &Layout); 2]) -> candle_core::Result<(CpuStorage, Shape)> {
        let (r, d) = l1.shape().dims2()?;
        if r != self.tokens.len() || l2.shape().dims1()? != r {
            candle_core::bail!("combine rows: shapes {:?} {:?} for {} rows", l1.shape(), l2.shape(), self.tokens.len());
        }
        let rows_of = rows_of_tokens(&self.tokens, self.n)?;
        let out = match (s1, s2) {
            (CpuStorage::F32(y), CpuStorage::F32(w)) => {
                CpuStorage::F32(scatter_add(contiguous_slice(y, l1)?, Some(contiguous_slice(w, l2)?), &rows_of, d))
            }
            (CpuStorage::F64(y), CpuStorage::F64(w)) => {
                CpuStorage::F64(scatter_add(contiguous_slice(y, l1)?, Some(contiguous_slice(w, l2)?), &rows_of, d))
            }
            _ => candle_core::bail!("combine rows: f32 or f64 inputs of one dtype"),
        };
        Ok((out, Shape::from((self.n, d))))
    }

    fn grads(&self, [y, w]: [&Tensor; 2], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads2> {
        let (r, d) = y.dims2()?;
        let dev = y.device();
        let (gy, gw) = match y.dtype() {
            candle_core::DType::F32 => {
                let (gy, gw) =
                    with_host_f32([y, w, grad], |[y, w, g]| (gather(g, Some(w), &self.tokens, d), weight_grads(y, g, &self.tokens, d)))?;
                (Tensor::from_vec(gy, (r, d), dev)?, Tensor::from_vec(gw, r, dev)?)
            }
            _ => {
                let (yv, wv, g) = (host_f64(y)?, host_f64(w)?, host_f64(grad)?);
                let gy = gather(&g, Some(&wv), &self.tokens, d);
                let gw = weight_grads(&yv, &g, &self.tokens, d);
                (Tensor::from_vec(gy, (r, d), dev)?.to_dtype(y.dtype())?, Tensor::from_vec(gw, r, dev)?.to_dtype(y.dtype())?)
            }
        };
        Ok((Some(gy), Some(gw)))
    }
}

/// Rows of `src` [N, d] in the order of `tokens` (each < N): [R, d] with row r = src[tokens[r]].
/// Differentiable in `src` (its gradient adds each token's rows back in row order).
pub fn gather_rows(src: &Tensor, tokens: &[u32]) -> candle_core::Result<Tensor> {
    let n = src.dim(0)?;
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= n) {
        candle_core::bail!("gather rows: token {t} of {n}")
    }
    #[cfg(feature = "cuda")]
    if super::cuda::takes(src) {
        return super::cuda::gather_rows(src, tokens);
    }
    if !super::fused_here(src) {
        return super::composite::gather_rows(src, &Tensor::from_slice(tokens, tokens.len(), src.device())?);
    }
    src.contiguous()?.apply_op1(GatherRows { tokens: tokens.to_vec(), n })
}

/// out [n, d] with out[t] = Σ_{r: tokens[r] = t} w[r]·y[r], in increasing r: each expert output
/// row y [R, d] times its router weight w [R], added onto its token. Differentiable in y and w.
pub fn combine_rows(y: &Tensor, w: &Tensor, tokens: &[u32], n: usize) -> candle_core::Result<Tensor> {
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= n) {
        candle_core::bail!("combine rows: token {t} of {n}")
    }
    #[cfg(feature = "cuda")]
    if super::cuda::takes(y) && y.dtype() != candle_core::DType::BF16 && w.dtype() == y.dtype() {
        return super::cuda::combine_rows_to(y, w, None, tokens, n, y.dtype());
    }
    if !super::fused_here(y) {
        return super::composite::combine_rows(y, w, &Tensor::from_slice(tokens, tokens.len(), y.device())?, n);
    }
    y.contiguous()?.apply_op2(&w.contiguous()?, CombineRows { tokens: tokens.to_vec(), n })
}

#[cfg(test)]
mod tests {
    use super::super::testing;
    use super::*;

    #[test]
    fn gather_and_combine_match_candles_ops_with_gradients() {
        let (n, d) = (7, 5);
        // Top-2 style: most tokens twice, one never, one token's rows far apart.
        let tokens: Vec<u32> = vec![3, 0, 1, 3, 4, 6, 1, 0, 2, 4, 6, 2];
        let r = tokens.len();
        let mut var = testing::vars(23, 0.7);
        let (h, w, probe) = (var(&[n, d]), var(&[r]), var(&[n, d]));
        let idx = Tensor::from_vec(tokens.clone(), r, &candle_core::Device::Cpu).unwrap();

        let ours = combine_rows(&(gather_rows(h.as_tensor(), &tokens).unwrap() * 1.5).unwrap(), w.as_tensor(), &tokens, n).unwrap();
        let y = (super::super::composite::gather_rows(h.as_tensor(), &idx).unwrap() * 1.5).unwrap();
        let theirs = super::super::composite::combine_rows(&y, w.as_tensor(), &idx, n).unwrap();
        assert!(testing::max_diff(&ours, &theirs) < 1e-12);
        let g1 = (&ours * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (&theirs * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&h, &w] {
            assert!(testing::max_diff(g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap()) < 1e-12);
        }
        // A token out of range is an error, not a panic.
        assert!(gather_rows(h.as_tensor(), &[7]).is_err());
        assert!(combine_rows(&y, w.as_tensor(), &[0; 12].iter().map(|_| 9).collect::<Vec<u32>>(), n).is_err());
    }

    #[test]
    fn many_rows_split_over_the_cores_give_the_serial_result() {
        // Enough rows that the passes are split into parts.
        let (n, d) = (3000, 16);
        let tokens: Vec<u32> = (0..2 * n as u32).map(|i| (i * 7919) % n as u32).collect();
        let src: Vec<f32> = testing::data(n * d, 5).into_iter().map(|x| x as f32).collect();
        let w: Vec<f32> = testing::data(tokens.len(), 6).into_iter().map(|x| x as f32).collect();
        let g = gather(&src, Some(&w), &tokens, d);
        for (r, &t) in tokens.iter().enumerate() {
            for j in 0..d {
                assert_eq!(g[r * d + j], src[t as usize * d + j] * w[r]);
            }
        }
        let rows_of = rows_of_tokens(&tokens, n).unwrap();
        let s = scatter_add(&g, None, &rows_of, d);
        let mut serial = vec![0f32; n * d];
        for (r, &t) in tokens.iter().enumerate() {
            for j in 0..d {
                serial[t as usize * d + j] += g[r * d + j];
            }
        }
        assert_eq!(s, serial);
        let wg = weight_grads(&g, &src, &tokens, d);
        for (r, &t) in tokens.iter().enumerate() {
            let mut acc = 0f32;
            for j in 0..d {
                acc += g[r * d + j] * src[t as usize * d + j];
            }
            assert_eq!(wg[r], acc);
        }
    }
}
