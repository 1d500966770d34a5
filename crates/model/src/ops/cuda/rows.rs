//! The MoE layer's row movement and the embedding on a GPU: gathers forward, sums of listed rows
//! backward (no atomics, no candle index_add: see `lazarus-kernels`' rows kernels).

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, DType, Layout, Shape, Tensor};
use lazarus_kernels::ops;

use super::{addr, dtype_of, storage_addr, Gpu};

/// src [n, d] → [R, d], row r = src[tokens[r]].
struct GpuGatherRows {
    tokens: Vec<u32>,
}

custom_op!(GpuGatherRows: CustomOp1 "lazarus-gpu-gather-rows", cuda, "gather-rows");

impl GpuGatherRows {
    fn cuda(&self, [(src, l)]: [(&CudaStorage, &Layout); 1]) -> candle_core::Result<(CudaStorage, Shape)> {
        let gpu = Gpu::of_storage(src);
        let (n, d) = l.shape().dims2()?;
        let out = ops::gather_rows_fwd(&gpu, dtype_of(src.dtype())?, storage_addr(src, l)?, &self.tokens, n, d)?;
        Ok((gpu.storage(out)?, Shape::from((self.tokens.len(), d))))
    }

    fn grads(&self, [src]: [&Tensor; 1], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads1> {
        let gpu = Gpu::of(src)?;
        let (n, d) = src.dims2()?;
        let g = grad.contiguous()?;
        let ds = ops::gather_rows_bwd(&gpu, dtype_of(g.dtype())?, dtype_of(src.dtype())?, addr(&g)?, &self.tokens, n, d)?;
        Ok(Some(gpu.tensor(ds, (n, d))?))
    }
}

/// Rows of src [N, d] in the order of `tokens` (each below N).
pub fn gather_rows(src: &Tensor, tokens: &[u32]) -> candle_core::Result<Tensor> {
    src.contiguous()?.apply_op1(GpuGatherRows { tokens: tokens.to_vec() })
}

/// (y [R, d], w) → out [n, d], out[t] = Σ_{r of t} w[s(r)]·y[r]: w per row (s(r) = r), or per
/// assignment slot (s(r) = slots[r]).
struct GpuCombineRows {
    tokens: Vec<u32>,
    slots: Option<Vec<u32>>,
    n: usize,
    out: DType,
}

impl GpuCombineRows {
    fn weight_slots(&self, weights: usize) -> lazarus_kernels::ops::WeightSlots<'_> {
        self.slots.as_deref().map(|s| (s, weights))
    }
}

custom_op!(GpuCombineRows: CustomOp2 "lazarus-gpu-combine-rows", cuda, "combine-rows");

impl GpuCombineRows {
    fn cuda(&self, [(y, yl), (w, wl)]: [(&CudaStorage, &Layout); 2]) -> candle_core::Result<(CudaStorage, Shape)> {
        let gpu = Gpu::of_storage(y);
        let (r, d) = yl.shape().dims2()?;
        if r != self.tokens.len() || (self.slots.is_none() && wl.shape().elem_count() != r) {
            candle_core::bail!("combine rows: {r} rows, {} tokens, {} weights", self.tokens.len(), wl.shape().elem_count());
        }
        let (y_dt, out_dt) = (dtype_of(y.dtype())?, dtype_of(self.out)?);
        if dtype_of(w.dtype())? != y_dt.acc() {
            candle_core::bail!("combine rows: weights of {:?} for rows of {:?}", w.dtype(), y.dtype());
        }
        let slots = self.weight_slots(wl.shape().elem_count());
        let out = ops::combine_rows_fwd(&gpu, y_dt, out_dt, storage_addr(y, yl)?, storage_addr(w, wl)?, slots, &self.tokens, self.n, d)?;
        Ok((gpu.storage(out)?, Shape::from((self.n, d))))
    }

    fn grads(&self, [y, w]: [&Tensor; 2], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads2> {
        let gpu = Gpu::of(y)?;
        let (r, d) = y.dims2()?;
        let (y, w, g) = (y.contiguous()?, w.contiguous()?, grad.contiguous()?);
        let slots = self.weight_slots(w.elem_count());
        let (y_dt, g_dt) = (dtype_of(y.dtype())?, dtype_of(g.dtype())?);
        let (dy, dw) = ops::combine_rows_bwd(&gpu, y_dt, g_dt, addr(&y)?, addr(&w)?, slots, addr(&g)?, &self.tokens, self.n, d)?;
        Ok((Some(gpu.tensor(dy, (r, d))?), Some(gpu.tensor(dw, w.shape())?)))
    }
}

/// out [n, d] of `out` (y's type, or f32 from bf16 rows): each token's rows of y, weighted by w
/// (y's accumulator type; a weight per row, or with `slots` one per assignment slot — row r
/// takes w[slots[r]], and a slot no row names gets a zero gradient), summed in row order.
pub fn combine_rows_to(y: &Tensor, w: &Tensor, slots: Option<&[u32]>, tokens: &[u32], n: usize, out: DType) -> candle_core::Result<Tensor> {
    let op = GpuCombineRows { tokens: tokens.to_vec(), slots: slots.map(<[u32]>::to_vec), n, out };
    y.contiguous()?.apply_op2(&w.contiguous()?, op)
}

/// (tok [V, d], pos [t, d]) → [b·t, d]: each id's row plus its position's.
struct GpuEmbed {
    ids: Vec<u32>,
    t: usize,
}

custom_op!(GpuEmbed: CustomOp2 "lazarus-gpu-embed", cuda, "embedding");

impl GpuEmbed {
    fn cuda(&self, [(tok, tl), (pos, pl)]: [(&CudaStorage, &Layout); 2]) -> candle_core::Result<(CudaStorage, Shape)> {
        let gpu = Gpu::of_storage(tok);
        let (vocab, d) = tl.shape().dims2()?;
        if pl.shape().dims2()? != (self.t, d) {
            candle_core::bail!("embedding: positions {:?} for sequences of {} and width {d}", pl.shape(), self.t);
        }
        let out =
            ops::embed_fwd(&gpu, dtype_of(tok.dtype())?, storage_addr(tok, tl)?, storage_addr(pos, pl)?, &self.ids, vocab, self.t, d)?;
        Ok((gpu.storage(out)?, Shape::from((self.ids.len(), d))))
    }

    fn grads(&self, [tok, _pos]: [&Tensor; 2], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads2> {
        let gpu = Gpu::of(tok)?;
        let (vocab, d) = tok.dims2()?;
        let g = grad.contiguous()?;
        let (dtok, dpos) = ops::embed_bwd(&gpu, dtype_of(g.dtype())?, addr(&g)?, &self.ids, vocab, self.t, d)?;
        Ok((Some(gpu.tensor(dtok, (vocab, d))?), Some(gpu.tensor(dpos, (self.t, d))?)))
    }
}

/// The embedding of `ids` (sequences of t): tok[id] + pos[position] → [b·t, d].
pub fn embed(tok: &Tensor, pos: &Tensor, ids: &[u32], t: usize) -> candle_core::Result<Tensor> {
    tok.contiguous()?.apply_op2(&pos.contiguous()?, GpuEmbed { ids: ids.to_vec(), t })
}
