//! Every kernel on a GPU against the fused CPU kernel: the same inputs, forward and gradients, in
//! f64 (and the f32 forward). Each test skips with a message where no GPU can be opened (every
//! build without the `cuda` feature, every machine without a GPU).

use candle_core::{DType, Device, Tensor, Var};

use super::testing;

/// The first GPU, or None with the reason printed.
pub fn gpu() -> Option<Device> {
    match crate::device::parse("cuda:0") {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("skipped (no GPU): {e}");
            None
        }
    }
}

/// Run `f` on the inputs on the CPU and on `gpu`, and compare the output and the gradient of
/// every input (Σ output · probe, a seeded probe) within `tol` (absolute, scaled by the largest
/// CPU value where that is above 1).
fn check(gpu: &Device, what: &str, shapes: &[&[usize]], tol: f64, f: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>) {
    let mut var = testing::vars(41, 0.8);
    let host: Vec<Var> = shapes.iter().map(|s| var(s)).collect();
    let dev: Vec<Var> = host.iter().map(|v| Var::from_tensor(&v.as_tensor().to_device(gpu).unwrap()).unwrap()).collect();
    let run = |vars: &[Var]| {
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = f(&ts).unwrap();
        let probe = Tensor::from_vec(testing::data(y.elem_count(), 7), y.shape(), y.device()).unwrap();
        let grads = (&y * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        // An input nothing depends on (an expert without rows) may have no gradient: zero.
        let grad = |v: &Var| grads.get(v.as_tensor()).cloned().unwrap_or_else(|| v.as_tensor().zeros_like().unwrap());
        let gs: Vec<Tensor> = vars.iter().map(|v| grad(v).to_device(&Device::Cpu).unwrap()).collect();
        (y.to_device(&Device::Cpu).unwrap(), gs)
    };
    let (y_cpu, g_cpu) = run(&host);
    let (y_gpu, g_gpu) = run(&dev);
    let close = |a: &Tensor, b: &Tensor, part: &str, tol: f64| {
        let scale = a.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap().max(1.0);
        let d = testing::max_diff(a, b);
        assert!(d <= tol * scale, "{what}: {part} differs by {d} (scale {scale})");
    };
    close(&y_cpu, &y_gpu, "forward", tol);
    for (i, (a, b)) in g_cpu.iter().zip(&g_gpu).enumerate() {
        close(a, b, &format!("gradient of input {i}"), tol);
    }
    // f32 on the device agrees with f64 on the CPU.
    let f32s: Vec<Tensor> = dev.iter().map(|v| v.as_tensor().to_dtype(DType::F32).unwrap()).collect();
    let y32 = f(&f32s).unwrap().to_dtype(DType::F64).unwrap().to_device(&Device::Cpu).unwrap();
    close(&y_cpu, &y32, "f32 forward", 1e-4);
}

#[test]
fn every_kernel_on_a_gpu_matches_the_fused_cpu_kernel_with_gradients() {
    let Some(gpu) = gpu() else { return };
    let (n, d, f, v) = (37, 12, 10, 19);
    // candle's GELU backward uses 6-digit constants: what goes through it is checked to 1e-5.
    check(&gpu, "gelu", &[&[n, d]], 1e-5, |x| super::gelu(&x[0]));
    check(&gpu, "softmax", &[&[n, v]], 1e-5, |x| super::softmax_last(&x[0]));
    check(&gpu, "layer norm", &[&[n, d], &[d], &[d]], 1e-5, |x| super::layer_norm(&x[0], &x[1], &x[2], 1e-5));
    check(&gpu, "linear", &[&[n, d], &[d, f], &[f]], 1e-5, |x| super::linear(&x[0], &x[1], &x[2]));
    check(&gpu, "attention", &[&[2, 9, 3 * d]], 1e-5, |x| super::causal_attention(&x[0], 3));
    let targets: Vec<u32> = (0..n as u32).map(|i| (i * 7 + 2) % v as u32).collect();
    check(&gpu, "cross entropy", &[&[n, v]], 1e-5, |x| super::cross_entropy(&x[0], &targets));
    let counts = [9usize, 0, 20, 8];
    check(
        &gpu,
        "grouped experts",
        &[&[n, d], &[d, f], &[f], &[f, d], &[d], &[d, f], &[f], &[f, d], &[d], &[d, f], &[f], &[f, d], &[d], &[d, f], &[f], &[f, d], &[d]],
        1e-5,
        |x| {
            let experts: Vec<[&Tensor; 4]> = (0..4).map(|e| [&x[1 + 4 * e], &x[2 + 4 * e], &x[3 + 4 * e], &x[4 + 4 * e]]).collect();
            super::grouped_expert_ffn(&x[0], &experts, &counts)
        },
    );
    let tokens: Vec<u32> = (0..2 * n as u32).map(|i| (i * 5 + 1) % n as u32).collect();
    check(&gpu, "gather and combine rows", &[&[n, d], &[2 * n]], 1e-5, |x| {
        super::combine_rows(&(super::gather_rows(&x[0], &tokens)? * 1.5)?, &x[1], &tokens, n)
    });
    // Out-of-range ids are refused before they reach a device kernel.
    let logits = Tensor::zeros((2, 3), DType::F32, &gpu).unwrap();
    assert!(super::cross_entropy(&logits, &[0, 3]).is_err());
    assert!(super::gather_rows(&logits, &[2]).is_err());
}
