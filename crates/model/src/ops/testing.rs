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

/// A kernel's output `ours` against its composite reference `theirs` over the same `inputs`:
/// the values within `tol`, and the gradient of every input (of both outputs' products with
/// one probe drawn from `seed`) within `grad_tol`.
pub fn assert_same_with_gradients(inputs: &[&Var], ours: &Tensor, theirs: &Tensor, seed: u64, tol: f64, grad_tol: f64) {
    let diff = max_diff(ours, theirs);
    assert!(diff < tol, "values differ by {diff}");
    let probe = Tensor::from_vec(data(ours.elem_count(), seed), ours.shape(), &Device::Cpu).unwrap().to_dtype(ours.dtype()).unwrap();
    let g1 = (ours * &probe).unwrap().sum_all().unwrap().backward().unwrap();
    let g2 = (theirs * &probe).unwrap().sum_all().unwrap().backward().unwrap();
    for (k, v) in inputs.iter().enumerate() {
        let diff = max_diff(g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap());
        assert!(diff < grad_tol, "the gradients of input {k} differ by {diff}");
    }
}
