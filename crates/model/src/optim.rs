//! AdamW with explicit, inspectable state per tensor (m, v, step), gradient-norm clipping and a
//! warm-up + cosine learning-rate schedule. The state of one expert's tensors can be taken out
//! and put back, which is what moving an expert between processes needs.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::params::ParamStore;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 }
    }
}

/// Moments and step count of one tensor, as tensors (for export, checkpoints and transfer).
#[derive(Debug, Clone)]
pub struct TensorState {
    pub m: Tensor,
    pub v: Tensor,
    /// Updates applied to this tensor (an expert that received no tokens skips a step).
    pub step: u64,
}

/// A tensor's moments for a reader ([`AdamW::moments_anywhere`]).
#[derive(Debug, Clone)]
pub enum MomentsRef {
    /// Shared host vectors (m, v).
    Host(Arc<Vec<f32>>, Arc<Vec<f32>>),
    /// Tensors on a GPU (m, v).
    Device(Tensor, Tensor),
}

impl MomentsRef {
    /// Call `f` with m's values, then with v's (a device tensor copied to the host first).
    pub fn read(&self, mut f: impl FnMut(&[f32])) -> Result<()> {
        match self {
            MomentsRef::Host(m, v) => {
                f(m);
                f(v);
            }
            MomentsRef::Device(m, v) => {
                crate::ops::with_f32(m, &mut f)?;
                crate::ops::with_f32(v, &mut f)?;
            }
        }
        Ok(())
    }
}

/// Moments kept on the host in f32, updated in one fused pass per tensor (candle's elementwise
/// ops would allocate a dozen full-size temporaries per tensor per step). Shared, so that a
/// snapshot's copy can read them on another thread ([`AdamW::moments_anywhere`]); an update while
/// such a reader still holds them writes a fresh copy instead (copy on write); the snapshot
/// tier lets its copies finish first, so in a run that all but never happens.
#[derive(Debug, Clone)]
struct Moments {
    m: Arc<Vec<f32>>,
    v: Arc<Vec<f32>>,
    step: u64,
    shape: candle_core::Shape,
    /// For a parameter on a GPU: its (m, v) as f32 tensors on that device, updated there (no
    /// copy through the host each step); `m` and `v` above stay empty.
    device: Option<(Tensor, Tensor)>,
    /// The GPU the parameter lives on (None: the CPU), kept when its moments are released: where
    /// moments given back go.
    on: Option<candle_core::Device>,
}

pub struct AdamW {
    pub config: AdamWConfig,
    /// Aligned with the model's [`ParamStore`] order.
    state: Vec<Moments>,
    /// Whether weight decay applies (matrices yes; biases, norms, embeddings no).
    decay: Vec<bool>,
}

impl AdamW {
    pub fn new(config: AdamWConfig, params: &ParamStore) -> Result<Self> {
        let mut state = Vec::with_capacity(params.len());
        let mut decay = Vec::with_capacity(params.len());
        for (name, var) in params.iter() {
            let n = var.elem_count();
            let (m, v, device) = if var.device().is_cpu() {
                (Arc::new(vec![0.0; n]), Arc::new(vec![0.0; n]), None)
            } else {
                let zeros = || Tensor::zeros(var.shape(), DType::F32, var.device());
                (Arc::default(), Arc::default(), Some((zeros()?, zeros()?)))
            };
            let on = (!var.device().is_cpu()).then(|| var.device().clone());
            state.push(Moments { m, v, step: 0, shape: var.shape().clone(), device, on });
            decay.push(var.rank() >= 2 && !name.ends_with("_emb"));
        }
        Ok(AdamW { config, state, decay })
    }

    pub fn len(&self) -> usize {
        self.state.len()
    }

    pub fn is_empty(&self) -> bool {
        self.state.is_empty()
    }

    /// The state of the tensor at `index`, as tensors.
    pub fn state(&self, index: usize) -> Result<TensorState> {
        self.held(index)?;
        let s = &self.state[index];
        if let Some((m, v)) = &s.device {
            return Ok(TensorState { m: m.clone(), v: v.clone(), step: s.step });
        }
        let dev = candle_core::Device::Cpu;
        Ok(TensorState {
            m: Tensor::from_slice(&s.m, s.shape.clone(), &dev)?,
            v: Tensor::from_slice(&s.v, s.shape.clone(), &dev)?,
            step: s.step,
        })
    }

    /// The moments (m, v) and step of the tensor at `index`, borrowed: what a snapshot writes
    /// to the wire every step without copying them into tensors first.
    pub fn moments(&self, index: usize) -> Result<(&[f32], &[f32], u64)> {
        self.host_resident(index)?;
        let s = &self.state[index];
        Ok((&s.m, &s.v, s.step))
    }

    /// The moments of the tensor at `index` wherever they live, for a reader on another thread
    /// (a snapshot's or a move's copy): shared host vectors, or the device tensors (read with
    /// one copy each; the next update waits for the reader, as for host moments).
    pub fn moments_anywhere(&self, index: usize) -> Result<(MomentsRef, u64)> {
        self.held(index)?;
        let s = &self.state[index];
        Ok(match &s.device {
            Some((m, v)) => (MomentsRef::Device(m.clone(), v.clone()), s.step),
            None => (MomentsRef::Host(s.m.clone(), s.v.clone()), s.step),
        })
    }

    /// Update counts of every tensor, in parameter order.
    pub fn steps(&self) -> Vec<u64> {
        self.state.iter().map(|s| s.step).collect()
    }

    /// Drop the moments of the tensor at `index` (its parameter was released, see
    /// [`crate::MoeModel::set_expert`]); [`AdamW::set_state`] gives them back.
    pub fn release(&mut self, index: usize) {
        let s = &mut self.state[index];
        s.m = Arc::default();
        s.v = Arc::default();
        s.device = None;
    }

    /// Whether the tensor at `index` has its moments (not released).
    pub fn resident(&self, index: usize) -> bool {
        let s = &self.state[index];
        s.device.is_some() || s.m.len() == s.shape.elem_count()
    }

    /// Ok when the tensor's moments are held here (not released), wherever they live.
    fn held(&self, index: usize) -> Result<()> {
        if !self.resident(index) {
            return Err(ModelError::config("optimizer state", index, "was released (the expert is not held here)"));
        }
        Ok(())
    }

    /// Ok when the tensor's moments are in host memory, borrowable: not released, not on a GPU.
    fn host_resident(&self, index: usize) -> Result<()> {
        self.held(index)?;
        if self.state[index].device.is_some() {
            return Err(ModelError::config("optimizer state", index, "lives on a GPU: read it with state()"));
        }
        Ok(())
    }

    /// Replace the state of the tensor at `index` (e.g. after fetching an expert from a peer).
    pub fn set_state(&mut self, index: usize, s: TensorState) -> Result<()> {
        let cur = &mut self.state[index];
        for t in [&s.m, &s.v] {
            if t.shape() != &cur.shape {
                return Err(ModelError::config("optimizer state", format!("{:?}", t.shape()), format!("expected {:?}", cur.shape)));
            }
        }
        if let Some(dev) = cur.on.clone() {
            let on_dev = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(DType::F32)?.to_device(&dev)?.contiguous()?) };
            cur.device = Some((on_dev(&s.m)?, on_dev(&s.v)?));
            cur.step = s.step;
            return Ok(());
        }
        let host = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?) };
        cur.m = Arc::new(host(&s.m)?);
        cur.v = Arc::new(host(&s.v)?);
        cur.step = s.step;
        Ok(())
    }

    /// One update with learning rate `lr`. Gradients are multiplied by `grad_scale` first (for
    /// clipping). Tensors without a gradient (an expert no token reached) are left untouched.
    pub fn step(&mut self, params: &ParamStore, grads: &GradStore, lr: f64, grad_scale: f64) -> Result<()> {
        self.step_with_copies(params, grads, lr, grad_scale, &[])
    }

    /// [`AdamW::step`] that also refreshes each parameter's working copy (`copies`, aligned with
    /// `params`; empty: none) from its new value: on a GPU in the update's own pass (the bf16
    /// copies a mixed-precision model's products read), elsewhere by a cast after it.
    pub fn step_with_copies(
        &mut self,
        params: &ParamStore,
        grads: &GradStore,
        lr: f64,
        grad_scale: f64,
        copies: &[Option<Tensor>],
    ) -> Result<()> {
        let tensors: Vec<Option<Tensor>> = params.vars().iter().map(|var| grads.get(var.as_tensor()).cloned()).collect();
        self.step_tensors(params, &tensors, lr, grad_scale, copies)
    }

    /// [`AdamW::step_with_copies`] with the gradients as tensors aligned with `params` (None: no
    /// update), e.g. after a distributed step summed them over the ranks. On a GPU they stay
    /// there: the update reads them where they are, a view into one buffer included.
    pub fn step_tensors(
        &mut self,
        params: &ParamStore,
        grads: &[Option<Tensor>],
        lr: f64,
        grad_scale: f64,
        copies: &[Option<Tensor>],
    ) -> Result<()> {
        if !copies.is_empty() && copies.len() != params.len() {
            return Err(ModelError::config("working copies", copies.len(), format!("expected one entry per parameter ({})", params.len())));
        }
        if self.state.iter().any(|s| s.device.is_some()) {
            return self.update_on_device(params, grads, lr, grad_scale, copies);
        }
        if copies.iter().any(Option::is_some) {
            return Err(ModelError::config("working copies", "on the CPU", "are made only for a GPU's bf16 products"));
        }
        crate::ops::with_f32_slices(grads, |g| self.update(params, g, lr, grad_scale))?
    }

    /// The coefficients of the next update of the tensor at `index`, counting the step.
    fn coeffs(&mut self, index: usize, lr: f64, grad_scale: f64) -> AdamWCoeffs {
        let c = &self.config;
        let s = &mut self.state[index];
        s.step += 1;
        let bc1 = 1.0 - c.beta1.powi(s.step as i32);
        let bc2 = 1.0 - c.beta2.powi(s.step as i32);
        AdamWCoeffs {
            b1: c.beta1 as f32,
            b2: c.beta2 as f32,
            scale: grad_scale as f32,
            step_size: (lr / bc1) as f32,
            inv_bc2_sqrt: (1.0 / bc2.sqrt()) as f32,
            eps: c.eps as f32,
            keep: if self.decay[index] { (1.0 - lr * c.weight_decay) as f32 } else { 1.0 },
        }
    }

    /// The update of parameters that live on a GPU: the same formula as [`adamw_pass`], in f32,
    /// by our kernel in place on CUDA, every tensor in one launch (`ops::cuda::adamw_update_all`),
    /// else by candle's elementwise ops with the parameter set to the result.
    fn update_on_device(
        &mut self,
        params: &ParamStore,
        grads: &[Option<Tensor>],
        lr: f64,
        grad_scale: f64,
        copies: &[Option<Tensor>],
    ) -> Result<()> {
        if grads.len() != params.len() {
            return Err(ModelError::config("gradients", grads.len(), format!("expected one entry per parameter ({})", params.len())));
        }
        // Our kernel's updates, launched together after the loop.
        #[cfg(feature = "cuda")]
        let mut listed = Vec::new();
        for (i, (var, g)) in params.vars().iter().zip(grads).enumerate() {
            let Some(g) = g else { continue };
            if g.elem_count() != var.elem_count() {
                return Err(ModelError::config(
                    "gradient",
                    &params.names()[i],
                    format!("has {} values, the tensor {}", g.elem_count(), var.elem_count()),
                ));
            }
            if self.state[i].device.is_none() {
                return Err(ModelError::config("optimizer state", &params.names()[i], "is not on the parameter's device"));
            }
            let k = self.coeffs(i, lr, grad_scale);
            let Some((m, v)) = self.state[i].device.as_mut() else { unreachable!("checked above") };
            let g = g.to_dtype(DType::F32)?.reshape(var.shape())?.contiguous()?;
            let copy = copies.get(i).and_then(Option::as_ref);
            #[cfg(feature = "cuda")]
            if var.dtype() == DType::F32 && var.is_contiguous() && var.device().is_cuda() && copy.is_none_or(|c| c.is_contiguous()) {
                let k = [k.b1, k.b2, k.scale, k.step_size, k.inv_bc2_sqrt, k.eps, k.keep];
                let (p, m, v, copy) = (var.as_tensor().clone(), m.clone(), v.clone(), copy.cloned());
                listed.push(crate::ops::cuda::AdamWUpdate { p, g, m, v, copy, k });
                continue;
            }
            *m = ((m.affine(k.b1 as f64, 0.0)? + g.affine(((1.0 - k.b1) * k.scale) as f64, 0.0)?)?).contiguous()?;
            let gs = g.affine(k.scale as f64, 0.0)?;
            *v = ((v.affine(k.b2 as f64, 0.0)? + (gs.sqr()? * (1.0 - k.b2) as f64)?)?).contiguous()?;
            let denom = v.sqrt()?.affine(k.inv_bc2_sqrt as f64, k.eps as f64)?;
            let p = var.as_tensor().to_dtype(DType::F32)?;
            let p = (p.affine(k.keep as f64, 0.0)? - (m.div(&denom)? * k.step_size as f64)?)?;
            var.set(&p.to_dtype(var.dtype())?)?;
            if let Some(c) = copy {
                c.slice_set(&var.as_tensor().to_dtype(c.dtype())?.reshape(c.shape())?, 0, 0)?;
            }
        }
        #[cfg(feature = "cuda")]
        crate::ops::cuda::adamw_update_all(&listed)?;
        Ok(())
    }

    /// The update itself: each f32 parameter in place in its storage (one fused pass over p, g,
    /// m and v, spread over the cores), others through a host copy.
    fn update(&mut self, params: &ParamStore, grads: &[Option<&[f32]>], lr: f64, grad_scale: f64) -> Result<()> {
        if grads.len() != params.len() {
            return Err(ModelError::config("gradients", grads.len(), format!("expected one entry per parameter ({})", params.len())));
        }
        for (i, (var, g)) in params.vars().iter().zip(grads).enumerate() {
            let Some(g) = *g else { continue };
            if g.len() != var.elem_count() {
                return Err(ModelError::config(
                    "gradient",
                    &params.names()[i],
                    format!("has {} values, the tensor {}", g.len(), var.elem_count()),
                ));
            }
            if self.state[i].m.len() != g.len() {
                return Err(ModelError::config("optimizer state", &params.names()[i], "was released (the expert is not held here)"));
            }
            let k = self.coeffs(i, lr, grad_scale);
            let s = &mut self.state[i];
            let (m, v) = (Arc::make_mut(&mut s.m), Arc::make_mut(&mut s.v));
            if var.dtype() == DType::F32 && var.device().is_cpu() && var.is_contiguous() {
                let op = InPlaceUpdate { g, m: std::cell::RefCell::new(m), v: std::cell::RefCell::new(v), k };
                var.as_tensor().inplace_op1(&op)?;
            } else {
                let dtype = var.dtype();
                let mut p = var.as_tensor().to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                adamw_pass(&mut p, g, m, v, &k);
                let new = Tensor::from_vec(p, s.shape.clone(), var.device())?.to_dtype(dtype)?;
                var.set(&new)?;
            }
        }
        Ok(())
    }
}

/// The scalars of one tensor's AdamW update.
#[derive(Debug, Clone, Copy)]
struct AdamWCoeffs {
    b1: f32,
    b2: f32,
    scale: f32,
    step_size: f32,
    inv_bc2_sqrt: f32,
    eps: f32,
    /// 1 − lr·wd where weight decay applies, else 1.
    keep: f32,
}

/// Elements per part of the update spread over the cores (a fixed size: each element's update is
/// independent, so the split never changes a value).
const UPDATE_PART: usize = 1 << 15;

/// p ← p·(1 − lr·wd) − lr · m̂ / (√v̂ + ε), with m and v moved by the (scaled) gradient: one pass,
/// in parts over the cores.
fn adamw_pass(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: &AdamWCoeffs) {
    type Part<'a> = (((&'a mut [f32], &'a [f32]), &'a mut [f32]), &'a mut [f32]);
    let part = |(((p, g), m), v): Part| {
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            let g = g * k.scale;
            *m = k.b1 * *m + (1.0 - k.b1) * g;
            *v = k.b2 * *v + (1.0 - k.b2) * g * g;
            *p = *p * k.keep - k.step_size * *m / ((*v).sqrt() * k.inv_bc2_sqrt + k.eps);
        }
    };
    let len = p.len();
    let parts = p.chunks_mut(UPDATE_PART).zip(g.chunks(UPDATE_PART)).zip(m.chunks_mut(UPDATE_PART)).zip(v.chunks_mut(UPDATE_PART));
    if len <= UPDATE_PART {
        parts.for_each(part);
    } else {
        use rayon::prelude::*;
        parts.collect::<Vec<_>>().into_par_iter().for_each(part);
    }
}

/// AdamW's update of one f32 parameter, applied in place in its storage.
struct InPlaceUpdate<'a> {
    g: &'a [f32],
    m: std::cell::RefCell<&'a mut Vec<f32>>,
    v: std::cell::RefCell<&'a mut Vec<f32>>,
    k: AdamWCoeffs,
}

impl candle_core::InplaceOp1 for InPlaceUpdate<'_> {
    fn name(&self) -> &'static str {
        "lazarus-adamw"
    }

    fn cpu_fwd(&self, storage: &mut candle_core::CpuStorage, layout: &candle_core::Layout) -> candle_core::Result<()> {
        let candle_core::CpuStorage::F32(p) = storage else { candle_core::bail!("adamw: an f32 parameter") };
        let Some((a, b)) = layout.contiguous_offsets() else { candle_core::bail!("adamw: a contiguous parameter") };
        let (mut m, mut v) = (self.m.borrow_mut(), self.v.borrow_mut());
        if b - a != self.g.len() || m.len() != self.g.len() || v.len() != self.g.len() {
            candle_core::bail!("adamw: {} values, gradient {}, moments {} and {}", b - a, self.g.len(), m.len(), v.len());
        }
        adamw_pass(&mut p[a..b], self.g, &mut m, &mut v, &self.k);
        Ok(())
    }
}

/// Global L2 norm of all gradients of `params`: squares summed in f64 per tensor (as the
/// distributed step sums them), the tensors over the cores, then added in parameter order.
pub fn grad_norm(params: &ParamStore, grads: &GradStore) -> Result<f64> {
    let tensors: Vec<Tensor> = params.vars().iter().filter_map(|var| grads.get(var.as_tensor()).cloned()).collect();
    Ok(sum_squares(&tensors)?.iter().sum::<f64>().sqrt())
}

/// Σ x² of each tensor, in f64 (one home for the norm's squares, the single process's and a
/// distributed step's): on a GPU summed there with one small copy of the sums to the host, on
/// the CPU read in place over the cores.
pub fn sum_squares(tensors: &[Tensor]) -> Result<Vec<f64>> {
    if tensors.iter().any(|g| !g.device().is_cpu()) {
        #[cfg(feature = "cuda")]
        if tensors.iter().all(|g| g.device().is_cuda() && g.dtype() == DType::F32) {
            let contiguous: Vec<Tensor> = tensors.iter().map(|g| g.contiguous()).collect::<candle_core::Result<_>>()?;
            return Ok(crate::ops::cuda::sum_squares(&contiguous.iter().collect::<Vec<_>>())?);
        }
        let parts: Vec<Tensor> = tensors.iter().map(|g| g.to_dtype(DType::F32)?.sqr()?.sum_all()).collect::<candle_core::Result<_>>()?;
        if parts.is_empty() {
            return Ok(Vec::new());
        }
        return Ok(Tensor::stack(&parts, 0)?.to_dtype(DType::F64)?.to_vec1()?);
    }
    let tensors: Vec<Option<Tensor>> = tensors.iter().cloned().map(Some).collect();
    Ok(crate::ops::with_f32_slices(&tensors, |g| {
        use rayon::prelude::*;
        g.par_iter().map(|g| g.map_or(0.0, |g| g.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>())).collect::<Vec<f64>>()
    })?)
}

/// Scale that clips a gradient of norm `norm` to at most `max_norm` (1 when it is already
/// smaller or clipping is off).
pub fn clip_scale(norm: f64, max_norm: Option<f64>) -> f64 {
    match max_norm {
        Some(m) if norm > m && norm > 0.0 => m / norm,
        _ => 1.0,
    }
}

/// Linear warm-up to `peak` over `warmup` steps, then cosine decay to `min` at `total`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    pub peak: f64,
    pub min: f64,
    pub warmup: u64,
    pub total: u64,
}

impl LrSchedule {
    pub fn at(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup).max(1);
        let progress = ((step - self.warmup) as f64 / span as f64).min(1.0);
        self.min + 0.5 * (self.peak - self.min) * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

/// The optimizer state of the named tensors, as (name → m, v) tensors and steps, e.g. to send
/// one expert's state to a peer or to write a checkpoint.
pub fn export_state(params: &ParamStore, opt: &AdamW, names: &[String]) -> Result<(HashMap<String, Tensor>, HashMap<String, u64>)> {
    let mut tensors = HashMap::new();
    let mut steps = HashMap::new();
    for name in names {
        let i = params.position(name).ok_or_else(|| ModelError::config("parameter", name, "no such tensor"))?;
        let s = opt.state(i)?;
        tensors.insert(format!("m/{name}"), s.m);
        tensors.insert(format!("v/{name}"), s.v);
        steps.insert(name.clone(), s.step);
    }
    Ok((tensors, steps))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays() {
        let s = LrSchedule { peak: 1e-3, min: 1e-4, warmup: 10, total: 110 };
        assert!((s.at(0) - 1e-4).abs() < 1e-12);
        assert!((s.at(9) - 1e-3).abs() < 1e-12);
        assert!((s.at(10) - 1e-3).abs() < 1e-12);
        assert!((s.at(60) - 5.5e-4).abs() < 1e-9);
        assert!((s.at(110) - 1e-4).abs() < 1e-12);
        assert!((s.at(500) - 1e-4).abs() < 1e-12);
    }

    /// A reader holding the shared moments across an update (a snapshot's copy on another
    /// thread) keeps the values it took; the update itself comes out the same as with no reader.
    #[test]
    fn shared_moments_keep_their_values_across_an_update() {
        let run = |hold: bool| {
            let mut store = ParamStore::default();
            store.add("w".into(), Tensor::new(&[[1.0f32, -2.0], [0.5, 3.0]], &candle_core::Device::Cpu).unwrap()).unwrap();
            let mut opt = AdamW::new(AdamWConfig::default(), &store).unwrap();
            let g = Tensor::new(&[0.1f32, -0.2, 0.3, 0.4], &candle_core::Device::Cpu).unwrap();
            opt.step_tensors(&store, &[Some(g.clone())], 1e-2, 1.0, &[]).unwrap();
            let held = hold.then(|| match opt.moments_anywhere(0).unwrap() {
                (MomentsRef::Host(m, v), step) => (m, v, step),
                (MomentsRef::Device(..), _) => panic!("a CPU parameter's moments are on the host"),
            });
            let before = held.as_ref().map(|(m, v, step)| (m.to_vec(), v.to_vec(), *step));
            opt.step_tensors(&store, &[Some(g)], 1e-2, 1.0, &[]).unwrap();
            if let (Some((m, v, step)), Some(before)) = (&held, &before) {
                assert_eq!((m.to_vec(), v.to_vec(), *step), before.clone(), "the reader's moments changed under it");
                let (m_now, _, step_now) = opt.moments(0).unwrap();
                assert_ne!(m_now, &m[..], "the update wrote a copy");
                assert_eq!(step_now, 2);
            }
            let (m, v, _) = opt.moments(0).unwrap();
            (m.to_vec(), v.to_vec(), store.vars()[0].as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap())
        };
        assert_eq!(run(true), run(false));
    }

    /// AdamW on a GPU (its own kernel in a cuda build, candle's ops otherwise) against the CPU
    /// pass: the same parameters, moments and gradient norm after three steps, with and without
    /// weight decay. Skipped without a GPU.
    #[test]
    fn the_update_on_a_gpu_is_the_cpu_update() {
        let Some(gpu) = crate::ops::on_device_gpu() else { return };
        let run = |device: &candle_core::Device| {
            let mut store = ParamStore::default();
            let w: Vec<f32> = crate::ops::testing_data(3000, 1).iter().map(|&x| x as f32).collect();
            store.add("w".into(), Tensor::from_vec(w, (60, 50), device).unwrap()).unwrap();
            store.add("b".into(), Tensor::from_vec(vec![0.5f32; 50], 50, device).unwrap()).unwrap();
            let mut opt = AdamW::new(AdamWConfig::default(), &store).unwrap();
            let mut norms = Vec::new();
            for step in 0..3u64 {
                let x = store.vars()[0].as_tensor();
                let loss = ((x.sqr().unwrap().sum_all().unwrap() * 0.5).unwrap()
                    + store.vars()[1].as_tensor().sum_all().unwrap() * (step as f64 + 1.0))
                    .unwrap();
                let grads = loss.backward().unwrap();
                norms.push(grad_norm(&store, &grads).unwrap());
                opt.step(&store, &grads, 1e-2, 0.7).unwrap();
            }
            let host = |t: &Tensor| t.flatten_all().unwrap().to_device(&candle_core::Device::Cpu).unwrap().to_vec1::<f32>().unwrap();
            let state: Vec<Vec<f32>> = (0..2).flat_map(|i| opt.state(i).map(|s| [host(&s.m), host(&s.v)]).unwrap()).collect();
            (store.vars().iter().map(|v| host(v.as_tensor())).collect::<Vec<_>>(), state, norms)
        };
        let (p_cpu, s_cpu, n_cpu) = run(&candle_core::Device::Cpu);
        let (p_gpu, s_gpu, n_gpu) = run(&gpu);
        let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-6 * x.abs().max(1.0));
        assert!(p_cpu.iter().zip(&p_gpu).all(|(a, b)| close(a, b)), "parameters differ");
        assert!(s_cpu.iter().zip(&s_gpu).all(|(a, b)| close(a, b)), "moments differ");
        // The first norm is of identical gradients; later ones inherit the updates' f32 rounding.
        assert!((n_cpu[0] - n_gpu[0]).abs() <= 1e-12 * n_cpu[0], "{n_cpu:?} vs {n_gpu:?}");
        assert!(n_cpu.iter().zip(&n_gpu).all(|(a, b)| (a - b).abs() <= 1e-6 * a), "{n_cpu:?} vs {n_gpu:?}");
    }

    #[test]
    fn clipping_scale() {
        assert_eq!(clip_scale(0.5, Some(1.0)), 1.0);
        assert_eq!(clip_scale(4.0, Some(1.0)), 0.25);
        assert_eq!(clip_scale(4.0, None), 1.0);
    }
}
