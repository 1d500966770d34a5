//! Shared helpers of the kernels' tests: seeded inputs and the largest elementwise difference
//! between a kernel and its composite reference.

use candle_core::{Device, Tensor, Var};

/// Seeded f64 variables of any shape with entries ~ N(0, scale²).
pub fn vars(seed: u64, scale: f64) -> impl FnMut(&[usize]) -> Var {
    let mut r = crate::rng::SplitMix64::new(seed);
    move |shape: &[usize]| {
        let n: usize = shape.iter().product();
        Var::from_vec((0..n).map(|_| r.normal() * scale).collect::<Vec<f64>>(), shape, &Device::Cpu).unwrap()
    }
}

/// `n` seeded standard normal values.
pub fn data(n: usize, seed: u64) -> Vec<f64> {
    let mut r = crate::rng::SplitMix64::new(seed);
    (0..n).map(|_| r.normal()).collect()
}

/// Largest absolute elementwise difference; infinite where either side has a NaN (candle's max
/// skips NaNs, which would let an unwritten element — poisoned to NaN in the tests — pass).
pub fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a - b).unwrap().abs().unwrap().flatten_all().unwrap().to_dtype(candle_core::DType::F64).unwrap().to_vec1::<f64>().unwrap();
    d.into_iter().fold(0.0, |m: f64, x| if x.is_nan() { f64::INFINITY } else { m.max(x) })
}
