//! Named trainable tensors in a fixed order, so the optimizer, checkpoints and (later) transfers
//! between processes all see the same list, and an expert's tensors can be picked out by
//! (MoE layer, expert).

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};

use crate::error::Result;
use crate::rng::SplitMix64;

#[derive(Debug, Clone, Default)]
pub struct ParamStore {
    names: Vec<String>,
    vars: Vec<Var>,
    index: HashMap<String, usize>,
}

impl ParamStore {
    pub(crate) fn add(&mut self, name: String, tensor: Tensor) -> Result<Var> {
        let var = Var::from_tensor(&tensor)?;
        self.index.insert(name.clone(), self.names.len());
        self.names.push(name);
        self.vars.push(var.clone());
        Ok(var)
    }

    /// Put `var` in place of the tensor at `index` (same name, new storage).
    pub(crate) fn replace(&mut self, index: usize, var: Var) {
        self.vars[index] = var;
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    pub fn get(&self, name: &str) -> Option<&Var> {
        self.index.get(name).map(|&i| &self.vars[i])
    }

    pub fn position(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.names.iter().map(String::as_str).zip(&self.vars)
    }

    /// Total number of scalar parameters.
    pub fn num_elements(&self) -> usize {
        self.vars.iter().map(|v| v.elem_count()).sum()
    }
}

/// Deterministic initialisation: values come from a seeded generator, not the device RNG, so the
/// same seed gives the same model on every machine and in every process.
pub(crate) struct Init {
    rng: SplitMix64,
    pub dtype: DType,
    pub device: Device,
}

impl Init {
    pub fn new(seed: u64, dtype: DType, device: Device) -> Self {
        Init { rng: SplitMix64::new(seed), dtype, device }
    }

    pub fn normal(&mut self, shape: &[usize], std: f64) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let data: Vec<f64> = (0..n).map(|_| self.rng.normal() * std).collect();
        Ok(Tensor::from_vec(data, shape, &self.device)?.to_dtype(self.dtype)?)
    }

    pub fn constant(&self, shape: &[usize], value: f64) -> Result<Tensor> {
        Ok((Tensor::ones(shape, self.dtype, &self.device)? * value)?)
    }
}
