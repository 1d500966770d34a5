//! Matrix-product layers on a GPU: a linear layer and an MoE layer's experts as grouped products
//! (cuBLAS) with their bias and activation epilogues (ours: GELU or SwiGLU), and each activation
//! alone.
//!
//! Mixed precision without cast nodes: a layer takes its f32 parameters as its autograd inputs
//! (the gradients land on them in f32) and computes with their bf16 working copies, which the
//! AdamW kernel refreshes in its own pass (`AdamW::step_with_copies`).

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, DType, Layout, Shape, Tensor};
use lazarus_kernels::ops::{self, ExpertAddrs, GroupedFfnSaved};
use lazarus_kernels::Device as _;

use crate::config::Activation;

use super::{addr, dtype_of, storage_addr, CudaBuf, Gpu};
use crate::ops::WeightGradSink;

/// GELU, elementwise.
struct GpuGelu;

custom_op!(GpuGelu: CustomOp1 "lazarus-gpu-gelu", cuda, "gelu");

impl GpuGelu {
    fn cuda(&self, [(x, l)]: [(&CudaStorage, &Layout); 1]) -> candle_core::Result<(CudaStorage, Shape)> {
        let gpu = Gpu::of_storage(x);
        let dt = dtype_of(x.dtype())?;
        let n = l.shape().elem_count();
        let y = gpu.alloc(dt.into(), n)?;
        // SAFETY: x and y hold n elements of dt.
        unsafe { gpu.launch(&lazarus_kernels::gelu(dt, storage_addr(x, l)?, gpu.addr(&y), n))? };
        Ok((gpu.storage(y)?, l.shape().clone()))
    }

    fn grads(&self, [x]: [&Tensor; 1], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads1> {
        let gpu = Gpu::of(x)?;
        let x = x.contiguous()?;
        let dt = dtype_of(x.dtype())?;
        let n = x.elem_count();
        let d = gpu.alloc(dt.into(), n)?;
        // SAFETY: x and d hold n elements of dt.
        unsafe { gpu.launch(&lazarus_kernels::gelu_grad(dt, addr(&x)?, gpu.addr(&d), n))? };
        Ok(Some(grad.mul(&gpu.tensor(d, x.shape())?)?))
    }
}

/// GELU (tanh form) of an f32, f64 or bf16 tensor.
pub fn gelu(x: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op1(GpuGelu)
}

/// SwiGLU over rows h [.., 2f] = [gate | up] → [.., f].
struct GpuSwiglu;

custom_op!(GpuSwiglu: CustomOp1 "lazarus-gpu-swiglu", cuda, "swiglu");

impl GpuSwiglu {
    fn cuda(&self, [(h, l)]: [(&CudaStorage, &Layout); 1]) -> candle_core::Result<(CudaStorage, Shape)> {
        let gpu = Gpu::of_storage(h);
        let (rows, f) = swiglu_sizes(l.shape())?;
        let a = ops::swiglu_fwd(&gpu, dtype_of(h.dtype())?, storage_addr(h, l)?, rows, f)?;
        let mut dims = l.shape().dims().to_vec();
        *dims.last_mut().expect("checked to have a last dimension") = f;
        Ok((gpu.storage(a)?, Shape::from(dims)))
    }

    fn grads(&self, [h]: [&Tensor; 1], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads1> {
        let gpu = Gpu::of(h)?;
        let (rows, f) = swiglu_sizes(h.shape())?;
        let (h, g) = (h.contiguous()?, grad.contiguous()?);
        let gh = ops::swiglu_bwd(&gpu, dtype_of(h.dtype())?, addr(&h)?, addr(&g)?, rows, f)?;
        Ok(Some(gpu.tensor(gh, h.shape())?))
    }
}

/// (rows, f) of SwiGLU's input [.., 2f].
fn swiglu_sizes(shape: &Shape) -> candle_core::Result<(usize, usize)> {
    match shape.dims().last() {
        Some(&w) if w % 2 == 0 => Ok((shape.elem_count() / w.max(1), w / 2)),
        _ => candle_core::bail!("swiglu: rows {shape:?} are not [gate | up] of an even width"),
    }
}

/// SwiGLU of an f32, f64 or bf16 tensor [.., 2f] → [.., f].
pub fn swiglu(h: &Tensor) -> candle_core::Result<Tensor> {
    h.contiguous()?.apply_op1(GpuSwiglu)
}

/// x [.., din] · W [din, dout] (+ b) → [.., dout] of `out`.
struct GpuLinear {
    /// The weight the product reads, when not the autograd input itself (its bf16 working copy).
    compute_w: Option<Tensor>,
    out: DType,
}

impl GpuLinear {
    fn weight_addr(&self, w: &CudaStorage, wl: &Layout, x_dt: DType) -> candle_core::Result<u64> {
        match &self.compute_w {
            Some(c) if c.dtype() == x_dt => addr(c),
            Some(c) => candle_core::bail!("linear: a {:?} working copy for {x_dt:?} rows", c.dtype()),
            None if w.dtype() == x_dt => storage_addr(w, wl),
            None => candle_core::bail!("linear: a {:?} weight for {x_dt:?} rows and no working copy", w.dtype()),
        }
    }

    fn forward(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
        b: Option<(&CudaStorage, &Layout)>,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let gpu = Gpu::of_storage(x);
        let (din, dout) = wl.shape().dims2()?;
        let dims = xl.shape().dims();
        if dims.last() != Some(&din) {
            candle_core::bail!("linear: rows {:?} for a weight {:?}", xl.shape(), wl.shape());
        }
        let n = xl.shape().elem_count() / din.max(1);
        let b_addr = match b {
            Some((b, bl)) => storage_addr(b, bl)?,
            None => 0,
        };
        let y = ops::linear_fwd(
            &gpu,
            dtype_of(x.dtype())?,
            dtype_of(self.out)?,
            storage_addr(x, xl)?,
            self.weight_addr(w, wl, x.dtype())?,
            b_addr,
            n,
            din,
            dout,
        )?;
        let mut out_dims = dims.to_vec();
        *out_dims.last_mut().expect("rows have a width") = dout;
        Ok((gpu.storage(y)?, Shape::from(out_dims)))
    }

    /// (dx, dW, db) from the output's gradient.
    fn backward(&self, x: &Tensor, w: &Tensor, grad: &Tensor, with_bias: bool) -> candle_core::Result<(Tensor, Tensor, Option<Tensor>)> {
        let gpu = Gpu::of(x)?;
        let (din, dout) = w.dims2()?;
        let n = x.elem_count() / din.max(1);
        let (x, g) = (x.contiguous()?, grad.contiguous()?);
        let wc = match &self.compute_w {
            Some(c) => c.clone(),
            None => w.contiguous()?,
        };
        let grads =
            ops::linear_bwd(&gpu, dtype_of(x.dtype())?, dtype_of(g.dtype())?, addr(&x)?, addr(&wc)?, addr(&g)?, with_bias, n, din, dout)?;
        let dx = gpu.tensor(grads.dx, x.shape())?;
        let dw = gpu.tensor(grads.dw, (din, dout))?.to_dtype(w.dtype())?;
        let db = match grads.db {
            Some(db) => Some(gpu.tensor(db, dout)?),
            None => None,
        };
        Ok((dx, dw, db))
    }
}

struct GpuLinearBias(GpuLinear);
struct GpuLinearNoBias(GpuLinear);

custom_op!(GpuLinearBias: CustomOp3 "lazarus-gpu-linear", cuda, "linear");

impl GpuLinearBias {
    fn cuda(&self, [(x, xl), (w, wl), (b, bl)]: [(&CudaStorage, &Layout); 3]) -> candle_core::Result<(CudaStorage, Shape)> {
        self.0.forward(x, xl, w, wl, Some((b, bl)))
    }

    fn grads(&self, [x, w, b]: [&Tensor; 3], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads3> {
        let (dx, dw, db) = self.0.backward(x, w, grad, true)?;
        let db = match db {
            Some(db) => Some(db.to_dtype(b.dtype())?),
            None => None,
        };
        Ok((Some(dx), Some(dw), db))
    }
}

custom_op!(GpuLinearNoBias: CustomOp2 "lazarus-gpu-linear-no-bias", cuda, "linear");

impl GpuLinearNoBias {
    fn cuda(&self, [(x, xl), (w, wl)]: [(&CudaStorage, &Layout); 2]) -> candle_core::Result<(CudaStorage, Shape)> {
        self.0.forward(x, xl, w, wl, None)
    }

    fn grads(&self, [x, w]: [&Tensor; 2], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads2> {
        let (dx, dw, _) = self.0.backward(x, w, grad, false)?;
        Ok((Some(dx), Some(dw)))
    }
}

/// x [.., din] · W [din, dout] (+ b [dout]) → [.., dout] of `out` (x's type, or f32 from bf16
/// rows). W and b are the autograd inputs (their gradients in their own type); `compute_w`, when
/// given, is the weight the product reads (W's bf16 working copy for bf16 rows).
pub fn linear_to(x: &Tensor, w: &Tensor, b: Option<&Tensor>, compute_w: Option<&Tensor>, out: DType) -> candle_core::Result<Tensor> {
    let op = GpuLinear { compute_w: compute_w.map(|c| c.contiguous()).transpose()?, out };
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    match b {
        Some(b) => x.apply_op3(&w, &b.contiguous()?, GpuLinearBias(op)),
        None => x.apply_op2(&w, GpuLinearNoBias(op)),
    }
}

/// Every expert of a layer over its rows as one node; the weights' gradients go to the sink.
struct GpuGroupedFfn {
    counts: Vec<usize>,
    act: Activation,
    /// Per expert its parameters, [W1, b1, W2, b2] or [W1, W2] (a model without FFN biases): the
    /// keys of their gradients in the sink.
    params: Vec<Vec<Tensor>>,
    /// Per expert [W1, W2] as the products read them (the parameters, or their working copies).
    compute: Vec<[Tensor; 2]>,
    saved: Mutex<Option<GroupedFfnSaved<CudaBuf>>>,
    sink: WeightGradSink,
}

impl GpuGroupedFfn {
    fn experts(&self) -> candle_core::Result<Vec<ExpertAddrs>> {
        // A missing bias is a null address: the kernels add nothing.
        let bias = |p: &[Tensor], i: usize| if p.len() == 4 { addr(&p[i]) } else { Ok(0) };
        self.params
            .iter()
            .zip(&self.compute)
            .map(|(p, c)| Ok(ExpertAddrs { w1: addr(&c[0])?, b1: bias(p, 1)?, w2: addr(&c[1])?, b2: bias(p, 3)? }))
            .collect()
    }

    /// The hidden width: W2 is [f, d].
    fn f(&self) -> usize {
        self.compute.first().map_or(0, |c| c[1].dims().first().copied().unwrap_or(0))
    }

    fn activation(&self) -> lazarus_kernels::Activation {
        self.act.into()
    }
}

custom_op!(GpuGroupedFfn: CustomOp1 "lazarus-gpu-grouped-expert-ffn", cuda, "grouped-expert-ffn");

impl GpuGroupedFfn {
    fn cuda(&self, [(x, l)]: [(&CudaStorage, &Layout); 1]) -> candle_core::Result<(CudaStorage, Shape)> {
        let gpu = Gpu::of_storage(x);
        let (rows, d) = l.shape().dims2()?;
        if self.counts.iter().sum::<usize>() != rows {
            candle_core::bail!("grouped expert ffn: {rows} rows, counts {:?}", self.counts);
        }
        let dt = dtype_of(x.dtype())?;
        let (y, saved) =
            ops::grouped_ffn_fwd(&gpu, dt, self.activation(), storage_addr(x, l)?, &self.experts()?, &self.counts, d, self.f())?;
        if let Ok(mut s) = self.saved.lock() {
            *s = Some(saved);
        }
        Ok((gpu.storage(y)?, l.shape().clone()))
    }

    fn grads(&self, [x]: [&Tensor; 1], _res: &Tensor, grad: &Tensor) -> candle_core::Result<crate::ops::Grads1> {
        let gpu = Gpu::of(x)?;
        let (_, d) = x.dims2()?;
        let f = self.f();
        let f1 = self.act.first_width(f);
        let e = self.params.len();
        let (x, g) = (x.contiguous()?, grad.contiguous()?);
        let saved = self.saved.lock().map_err(|_| candle_core::Error::Msg("grouped expert ffn: poisoned".into()))?;
        let Some(saved) = saved.as_ref() else { candle_core::bail!("grouped expert ffn: backward before forward") };
        let dt = dtype_of(x.dtype())?;
        let grads = ops::grouped_ffn_bwd(&gpu, dt, self.activation(), addr(&x)?, addr(&g)?, &self.experts()?, &self.counts, saved, d, f)?;
        let dw1 = gpu.tensor(grads.dw1, (e, d, f1))?;
        let db1 = gpu.tensor(grads.db1, (e, f1))?;
        let dw2 = gpu.tensor(grads.dw2, (e, f, d))?;
        let db2 = gpu.tensor(grads.db2, (e, d))?;
        for (i, p) in self.params.iter().enumerate() {
            // The gradients in the parameters' order; a model without FFN biases drops theirs.
            let all: &[&Tensor] = if p.len() == 4 { &[&dw1, &db1, &dw2, &db2] } else { &[&dw1, &dw2] };
            for (t, all) in p.iter().zip(all) {
                self.sink.push(t, all.get(i)?.to_dtype(t.dtype())?);
            }
        }
        Ok(Some(gpu.tensor(grads.dx, x.shape())?))
    }
}

/// The experts of a layer over rows grouped by expert (x [R, d], `counts[e]` rows of expert e),
/// each act(x·W1 + b1)·W2 + b2; the weights' gradients go to `sink`. `params[e]` = [W1, b1, W2,
/// b2], or [W1, W2] for experts without biases; `copies[e]`, when given, the [W1, W2] the products
/// read (bf16 working copies for bf16 rows).
pub fn grouped_expert_ffn_to_sink(
    x: &Tensor,
    params: &[&[&Tensor]],
    copies: Option<&[[Tensor; 2]]>,
    counts: &[usize],
    act: Activation,
    sink: &WeightGradSink,
) -> candle_core::Result<Tensor> {
    if params.iter().any(|p| p.len() != 2 && p.len() != 4) {
        candle_core::bail!("grouped expert ffn: an expert has 2 or 4 tensors")
    }
    let params: Vec<Vec<Tensor>> =
        params.iter().map(|p| p.iter().map(|t| t.contiguous()).collect::<candle_core::Result<_>>()).collect::<candle_core::Result<_>>()?;
    let compute: Vec<[Tensor; 2]> = match copies {
        Some(c) => c.iter().map(|[a, b]| Ok([a.contiguous()?, b.contiguous()?])).collect::<candle_core::Result<_>>()?,
        None => params.iter().map(|p| [p[0].clone(), p[p.len() / 2].clone()]).collect(),
    };
    if compute.len() != params.len() || compute.iter().any(|c| c[0].dtype() != x.dtype() || c[1].dtype() != x.dtype()) {
        candle_core::bail!("grouped expert ffn: the products' weights must be of the rows' type {:?}", x.dtype());
    }
    let op = GpuGroupedFfn { counts: counts.to_vec(), act, params, compute, saved: Mutex::new(None), sink: sink.clone() };
    x.contiguous()?.apply_op1(op)
}
