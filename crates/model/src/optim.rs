//! AdamW with explicit, inspectable state per tensor (m, v, step), gradient-norm clipping and a
//! warm-up + cosine learning-rate schedule. The state of one expert's tensors can be taken out
//! and put back, which is what moving an expert between processes needs.

use std::collections::HashMap;

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

/// Moments kept on the host in f32, updated in one fused pass per tensor (candle's elementwise
/// ops would allocate a dozen full-size temporaries per tensor per step).
#[derive(Debug, Clone)]
struct Moments {
    m: Vec<f32>,
    v: Vec<f32>,
    step: u64,
    shape: candle_core::Shape,
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
            state.push(Moments { m: vec![0.0; n], v: vec![0.0; n], step: 0, shape: var.shape().clone() });
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
        let s = &self.state[index];
        if !self.resident(index) {
            return Err(ModelError::config("optimizer state", index, "was released (the expert is not held here)"));
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
        if !self.resident(index) {
            return Err(ModelError::config("optimizer state", index, "was released (the expert is not held here)"));
        }
        let s = &self.state[index];
        Ok((&s.m, &s.v, s.step))
    }

    /// Update counts of every tensor, in parameter order.
    pub fn steps(&self) -> Vec<u64> {
        self.state.iter().map(|s| s.step).collect()
    }

    /// Drop the moments of the tensor at `index` (its parameter was released, see
    /// [`crate::MoeModel::set_expert`]); [`AdamW::set_state`] gives them back.
    pub fn release(&mut self, index: usize) {
        let s = &mut self.state[index];
        s.m = Vec::new();
        s.v = Vec::new();
    }

    /// Whether the tensor at `index` has its moments (not released).
    pub fn resident(&self, index: usize) -> bool {
        let s = &self.state[index];
        s.m.len() == s.shape.elem_count()
    }

    /// Replace the state of the tensor at `index` (e.g. after fetching an expert from a peer).
    pub fn set_state(&mut self, index: usize, s: TensorState) -> Result<()> {
        let cur = &mut self.state[index];
        for t in [&s.m, &s.v] {
            if t.shape() != &cur.shape {
                return Err(ModelError::config("optimizer state", format!("{:?}", t.shape()), format!("expected {:?}", cur.shape)));
            }
        }
        let host = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?) };
        cur.m = host(&s.m)?;
        cur.v = host(&s.v)?;
        cur.step = s.step;
        Ok(())
    }

    /// One update with learning rate `lr`. Gradients are multiplied by `grad_scale` first (for
    /// clipping). Tensors without a gradient (an expert no token reached) are left untouched.
    pub fn step(&mut self, params: &ParamStore, grads: &GradStore, lr: f64, grad_scale: f64) -> Result<()> {
        let host = params
            .vars()
            .iter()
            .map(|var| grads.get(var.as_tensor()).map(|g| g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()).transpose())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        self.step_host(params, &host, lr, grad_scale)
    }

    /// [`AdamW::step`] with gradients as host vectors aligned with `params` (None: no update),
    /// e.g. after they were summed over the ranks of a distributed step.
    pub fn step_host(&mut self, params: &ParamStore, grads: &[Option<Vec<f32>>], lr: f64, grad_scale: f64) -> Result<()> {
        if grads.len() != params.len() {
            return Err(ModelError::config("gradients", grads.len(), format!("expected one entry per parameter ({})", params.len())));
        }
        let c = self.config.clone();
        for (i, (var, g)) in params.vars().iter().zip(grads).enumerate() {
            let Some(g) = g else { continue };
            if g.len() != var.elem_count() {
                return Err(ModelError::config(
                    "gradient",
                    &params.names()[i],
                    format!("has {} values, the tensor {}", g.len(), var.elem_count()),
                ));
            }
            let dtype = var.dtype();
            let mut p = var.as_tensor().to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            let s = &mut self.state[i];
            s.step += 1;
            let bc1 = 1.0 - c.beta1.powi(s.step as i32);
            let bc2 = 1.0 - c.beta2.powi(s.step as i32);
            let (b1, b2) = (c.beta1 as f32, c.beta2 as f32);
            let scale = grad_scale as f32;
            let step_size = (lr / bc1) as f32;
            let inv_bc2_sqrt = (1.0 / bc2.sqrt()) as f32;
            let eps = c.eps as f32;
            let keep = if self.decay[i] { (1.0 - lr * c.weight_decay) as f32 } else { 1.0 };
            for (((p, &g), m), v) in p.iter_mut().zip(g).zip(s.m.iter_mut()).zip(s.v.iter_mut()) {
                let g = g * scale;
                *m = b1 * *m + (1.0 - b1) * g;
                *v = b2 * *v + (1.0 - b2) * g * g;
                // p ← p·(1 − lr·wd) − lr · m̂ / (√v̂ + ε)
                *p = *p * keep - step_size * *m / ((*v).sqrt() * inv_bc2_sqrt + eps);
            }
            let new = Tensor::from_vec(p, s.shape.clone(), var.device())?.to_dtype(dtype)?;
            var.set(&new)?;
        }
        Ok(())
    }
}

/// Global L2 norm of all gradients of `params`.
pub fn grad_norm(params: &ParamStore, grads: &GradStore) -> Result<f64> {
    let mut sum = 0.0f64;
    for var in params.vars() {
        if let Some(g) = grads.get(var.as_tensor()) {
            sum += g.sqr()?.sum_all()?.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
        }
    }
    Ok(sum.sqrt())
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

    #[test]
    fn clipping_scale() {
        assert_eq!(clip_scale(0.5, Some(1.0)), 1.0);
        assert_eq!(clip_scale(4.0, Some(1.0)), 0.25);
        assert_eq!(clip_scale(4.0, None), 1.0);
    }
}
