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
            super::grouped_expert_ffn(&x[0], &experts, &counts, crate::config::Activation::Gelu)
        },
    );
    check(&gpu, "rms norm", &[&[n, d], &[d]], 1e-5, |x| super::rms_norm(&x[0], &x[1], 1e-5));
    check(&gpu, "rope", &[&[2, 9, 3 * d]], 1e-5, |x| super::rope(&x[0], 3, 1e4));
    check(&gpu, "swiglu expert", &[&[n, d], &[d, 2 * f], &[2 * f], &[f, d], &[d]], 1e-5, |x| {
        super::expert_ffn(&x[0], &x[1], &x[2], &x[3], &x[4], crate::config::Activation::Swiglu)
    });
    let tokens: Vec<u32> = (0..2 * n as u32).map(|i| (i * 5 + 1) % n as u32).collect();
    check(&gpu, "gather and combine rows", &[&[n, d], &[2 * n]], 1e-5, |x| {
        super::combine_rows(&(super::gather_rows(&x[0], &tokens)? * 1.5)?, &x[1], &tokens, n)
    });
    // Out-of-range ids are refused before they reach a device kernel.
    let logits = Tensor::zeros((2, 3), DType::F32, &gpu).unwrap();
    assert!(super::cross_entropy(&logits, &[0, 3]).is_err());
    assert!(super::gather_rows(&logits, &[2]).is_err());
}

/// Each GPU kernel's op against candle's composite form of it on the same GPU (the oracle, by
/// candle's kernels and autograd) in f64: forward and every gradient.
#[test]
fn every_gpu_kernel_matches_its_composite_on_the_gpu() {
    #[cfg(feature = "cuda")]
    on_the_gpu(kernels_against_composites);
}

/// `check` on the tests' GPU, when there is one.
#[cfg(feature = "cuda")]
fn on_the_gpu(check: fn(&Device)) {
    if let Some(gpu) = gpu() {
        check(&gpu);
    }
}

#[cfg(feature = "cuda")]
fn kernels_against_composites(gpu: &Device) {
    let gpu = gpu.clone();
    let mut var = testing::vars(43, 0.8);
    let run = |f: &dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>, vars: &[Var], probe: &Tensor| {
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = f(&ts).unwrap();
        let g = (&y * probe).unwrap().sum_all().unwrap().backward().unwrap();
        let grads: Vec<Tensor> =
            vars.iter().map(|v| g.get(v.as_tensor()).cloned().unwrap_or_else(|| v.as_tensor().zeros_like().unwrap())).collect();
        (y, grads)
    };
    type Op = Box<dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>>;
    /// (what, input shapes, output shape, the op).
    type Case = (&'static str, Vec<Vec<usize>>, Vec<usize>, Op);
    let (n, d, v) = (40, 64, 300);
    let targets: Vec<u32> = (0..n as u32).map(|i| (i * 13 + 5) % v as u32).collect();
    let tokens: Vec<u32> = (0..2 * n as u32).map(|i| (i * 7 + 1) % n as u32).collect();
    let cases: Vec<Case> = vec![
        ("layer norm", vec![vec![n, d], vec![d], vec![d]], vec![n, d], Box::new(|x| super::layer_norm(&x[0], &x[1], &x[2], 1e-5))),
        ("softmax", vec![vec![n, v]], vec![n, v], Box::new(|x| super::softmax_last(&x[0]))),
        ("cross entropy", vec![vec![n, v]], vec![], Box::new(move |x| super::cross_entropy(&x[0], &targets))),
        ("attention", vec![vec![2, 70, 3 * d]], vec![2, 70, d], Box::new(|x| super::causal_attention(&x[0], 2))),
        ("linear", vec![vec![n, d], vec![d, 48], vec![48]], vec![n, 48], Box::new(|x| super::linear(&x[0], &x[1], &x[2]))),
        (
            "gather and combine",
            vec![vec![n, d], vec![2 * n]],
            vec![n, d],
            Box::new(move |x| super::combine_rows(&(super::gather_rows(&x[0], &tokens)? * 1.5)?, &x[1], &tokens, n)),
        ),
        ("gelu", vec![vec![n, d]], vec![n, d], Box::new(|x| super::gelu(&x[0]))),
        ("rms norm", vec![vec![n, d], vec![d]], vec![n, d], Box::new(|x| super::rms_norm(&x[0], &x[1], 1e-5))),
        ("rope", vec![vec![2, 70, 3 * d]], vec![2, 70, 3 * d], Box::new(|x| super::rope(&x[0], 2, 1e6))),
        (
            "swiglu expert",
            vec![vec![n, d], vec![d, 96], vec![96], vec![48, d], vec![d]],
            vec![n, d],
            Box::new(|x| super::expert_ffn(&x[0], &x[1], &x[2], &x[3], &x[4], crate::config::Activation::Swiglu)),
        ),
    ];
    for (what, shapes, out, f) in cases {
        // candle's GELU backward, the composite's, uses 6-digit constants.
        let tol = if what == "gelu" { 1e-5 } else { 1e-9 };
        let host: Vec<Var> = shapes.iter().map(|s| var(s)).collect();
        let dev: Vec<Var> = host.iter().map(|h| Var::from_tensor(&h.as_tensor().to_device(&gpu).unwrap()).unwrap()).collect();
        let probe = Tensor::from_vec(testing::data(out.iter().product(), 9), out.as_slice(), &gpu).unwrap();
        let (y, g) = run(&*f, &dev, &probe);
        let (yc, gc) = super::cuda::composite(|| run(&*f, &dev, &probe));
        let host = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
        let scale = host(&yc).abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap().max(1.0);
        assert!(testing::max_diff(&host(&y), &host(&yc)) <= 1e-10 * scale, "{what}: forward");
        for (i, (a, b)) in g.iter().zip(&gc).enumerate() {
            let d = testing::max_diff(&host(a), &host(b));
            assert!(d <= tol * scale.max(1.0), "{what}: gradient of input {i} differs by {d}");
        }
    }
}

/// The GPU's bf16 paths (what mixed precision runs) against the f64 CPU kernels, to bf16's
/// rounding: LayerNorm and RMSNorm from f32 into bf16, a bf16 product into f32, rotary positions
/// and attention, and the grouped experts with their weights' gradients through the sink.
#[test]
fn the_bf16_paths_on_a_gpu_are_the_f64_results_to_bf16_rounding() {
    #[cfg(feature = "cuda")]
    on_the_gpu(bf16_paths);
}

#[cfg(feature = "cuda")]
fn bf16_paths(gpu: &Device) {
    let gpu = gpu.clone();
    let mut var = testing::vars(47, 0.6);
    let (n, d, f) = (48, 64, 96);
    let on = |t: &Tensor, dt: DType| t.to_dtype(dt).unwrap().to_device(&gpu).unwrap();
    let back = |t: &Tensor| t.to_dtype(DType::F64).unwrap().to_device(&Device::Cpu).unwrap();
    let close = |what: &str, want: &Tensor, got: &Tensor, tol: f64| {
        let scale = want.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap().max(1.0);
        let diff = testing::max_diff(want, &back(got));
        assert!(diff <= tol * scale, "{what}: {diff} (scale {scale})");
    };
    let (x, w, b) = (var(&[n, d]), var(&[d]), var(&[d]));
    let want = super::layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5).unwrap();
    let got = super::layer_norm_to(
        &on(x.as_tensor(), DType::F32),
        &on(w.as_tensor(), DType::F32),
        &on(b.as_tensor(), DType::F32),
        1e-5,
        DType::BF16,
    )
    .unwrap();
    assert_eq!(got.dtype(), DType::BF16);
    close("layer norm f32 → bf16", &want, &got, 1e-2);
    let want = super::rms_norm(x.as_tensor(), w.as_tensor(), 1e-5).unwrap();
    let got = super::rms_norm_to(&on(x.as_tensor(), DType::F32), &on(w.as_tensor(), DType::F32), 1e-5, DType::BF16).unwrap();
    assert_eq!(got.dtype(), DType::BF16);
    close("rms norm f32 → bf16", &want, &got, 1e-2);
    let (wl, bl) = (var(&[d, f]), var(&[f]));
    let want = super::linear(x.as_tensor(), wl.as_tensor(), bl.as_tensor()).unwrap();
    let copy = on(wl.as_tensor(), DType::BF16);
    let got = super::cuda::linear_to(
        &on(x.as_tensor(), DType::BF16),
        &on(wl.as_tensor(), DType::F32),
        Some(&on(bl.as_tensor(), DType::F32)),
        Some(&copy),
        DType::F32,
    )
    .unwrap();
    assert_eq!(got.dtype(), DType::F32);
    close("linear bf16 → f32", &want, &got, 3e-2);
    let qkv = var(&[2, 70, 3 * d]);
    let want = super::rope(qkv.as_tensor(), 2, 1e6).unwrap();
    close("rope bf16", &want, &super::rope(&on(qkv.as_tensor(), DType::BF16), 2, 1e6).unwrap(), 1e-2);
    let want = super::causal_attention(qkv.as_tensor(), 2).unwrap();
    close("attention bf16", &want, &super::causal_attention(&on(qkv.as_tensor(), DType::BF16), 2).unwrap(), 3e-2);
    // Heads of 64 columns take the tensor-core kernels: the forward and the gradient, over three
    // query tiles with a partial last one.
    let (qkv, probe) = (var(&[2, 150, 3 * 128]), var(&[2, 150, 128]));
    let want = super::causal_attention(qkv.as_tensor(), 2).unwrap();
    let grads = (&want * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
    let want_g = grads.get(qkv.as_tensor()).unwrap();
    let q16 = Var::from_tensor(&on(qkv.as_tensor(), DType::BF16)).unwrap();
    let got = super::causal_attention(q16.as_tensor(), 2).unwrap();
    close("attention bf16, heads of 64", &want, &got, 3e-2);
    let grads = (&got * on(probe.as_tensor(), DType::BF16)).unwrap().sum_all().unwrap().backward().unwrap();
    close("attention bf16 gradient, heads of 64", want_g, grads.get(q16.as_tensor()).unwrap(), 12e-2);
    // The experts: bf16 rows and working copies, f32 parameters receiving f32 gradients.
    grouped_experts_on_the_gpu(&gpu, crate::config::Activation::Gelu, true, DType::BF16, 5e-2, 6e-2);
    grouped_experts_on_the_gpu(&gpu, crate::config::Activation::Swiglu, false, DType::BF16, 5e-2, 6e-2);
}

/// The grouped experts on the GPU (the node the model trains with: weights' gradients through the
/// sink) in f64 against the CPU's, GELU with biases and SwiGLU without (null bias addresses).
#[test]
fn the_grouped_experts_on_a_gpu_match_the_cpu_with_each_activation() {
    let Some(gpu) = gpu() else { return };
    #[cfg(feature = "cuda")]
    for (act, bias) in [(crate::config::Activation::Gelu, true), (crate::config::Activation::Swiglu, false)] {
        grouped_experts_on_the_gpu(&gpu, act, bias, DType::F64, 1e-10, 1e-10);
    }
    let _ = gpu;
}

/// The grouped experts node on the GPU with rows of `rows_dt` (bf16: working copies of f32
/// parameters; else the parameters in that type) against the f64 CPU node, forward and every
/// gradient (the weights' through the sink) within `tol` / `grad_tol` of the largest value.
#[cfg(feature = "cuda")]
fn grouped_experts_on_the_gpu(gpu: &Device, act: crate::config::Activation, bias: bool, rows_dt: DType, tol: f64, grad_tol: f64) {
    let mut var = testing::vars(53, 0.6);
    let (d, f) = (64, 48);
    let f1 = if act == crate::config::Activation::Swiglu { 2 * f } else { f };
    let master_dt = if rows_dt == DType::BF16 { DType::F32 } else { rows_dt };
    let on = |t: &Tensor, dt: DType| t.to_dtype(dt).unwrap().to_device(gpu).unwrap();
    let back = |t: &Tensor| t.to_dtype(DType::F64).unwrap().to_device(&Device::Cpu).unwrap();
    let close = |what: &str, want: &Tensor, got: &Tensor, tol: f64| {
        let scale = want.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap().max(1.0);
        let diff = testing::max_diff(want, &back(got));
        assert!(diff <= tol * scale, "{what}: {diff} (scale {scale})");
    };
    let counts = [20usize, 0, 28];
    let rows: usize = counts.iter().sum();
    let xr = var(&[rows, d]);
    // [W1, b1, W2, b2], or [W1, W2] without biases (the CPU reference then takes zero biases).
    let weights: Vec<Vec<Var>> = counts
        .iter()
        .map(|_| if bias { vec![var(&[d, f1]), var(&[f1]), var(&[f, d]), var(&[d])] } else { vec![var(&[d, f1]), var(&[f, d])] })
        .collect();
    let probe = var(&[rows, d]);
    let sink = super::WeightGradSink::new();
    let masters: Vec<Vec<Tensor>> = weights.iter().map(|w| w.iter().map(|v| on(v.as_tensor(), master_dt)).collect()).collect();
    let copies: Vec<[Tensor; 2]> =
        masters.iter().map(|m| [m[0].to_dtype(DType::BF16).unwrap(), m[m.len() / 2].to_dtype(DType::BF16).unwrap()]).collect();
    let refs: Vec<Vec<&Tensor>> = masters.iter().map(|m| m.iter().collect()).collect();
    let slices: Vec<&[&Tensor]> = refs.iter().map(Vec::as_slice).collect();
    let xg = Var::from_tensor(&on(xr.as_tensor(), rows_dt)).unwrap();
    let with_copies = (rows_dt == DType::BF16).then_some(copies.as_slice());
    let y = super::cuda::grouped_expert_ffn_to_sink(xg.as_tensor(), &slices, with_copies, &counts, act, &sink).unwrap();
    let probe_dev = on(probe.as_tensor(), master_dt);
    let mut grads = (&y.to_dtype(master_dt).unwrap() * probe_dev).unwrap().sum_all().unwrap().backward().unwrap();
    sink.drain_into(&mut grads).unwrap();
    let cpu_tensors: Vec<Vec<&Tensor>> = weights.iter().map(|w| w.iter().map(|v| v.as_tensor()).collect()).collect();
    let cpu_weights: Vec<[Tensor; 4]> = cpu_tensors.iter().map(|w| super::ffn_weights(w).unwrap()).collect();
    let cpu_refs: Vec<[&Tensor; 4]> = cpu_weights.iter().map(|w| w.each_ref()).collect();
    let want = super::grouped_expert_ffn(xr.as_tensor(), &cpu_refs, &counts, act).unwrap();
    let what = format!("grouped {act:?} experts ({rows_dt:?}, biases: {bias})");
    close(&what, &want, &y, tol);
    let wg = (&want * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
    close(&format!("{what}: rows gradient"), wg.get(xr.as_tensor()).unwrap(), grads.get(xg.as_tensor()).unwrap(), grad_tol);
    for (e, (w, m)) in weights.iter().zip(&masters).enumerate() {
        for (k, (wk, mk)) in w.iter().zip(m).enumerate() {
            let got = grads.get(mk).unwrap_or_else(|| panic!("{what}: expert {e} tensor {k} has no gradient"));
            assert_eq!(got.dtype(), master_dt, "the gradient of a parameter is of its type");
            let want = wg.get(wk.as_tensor()).cloned().unwrap_or_else(|| wk.as_tensor().zeros_like().unwrap());
            close(&format!("{what}: expert {e} tensor {k} gradient"), &want, got, grad_tol);
        }
    }
}

/// AdamW over a list of tensors in one launch on the GPU against the per-tensor kernel, bit for
/// bit (the emulator checks the same; here nvcc's own code for each): tensors of one part, of
/// several, of one element; with and without working copies; different coefficients each.
#[test]
fn adamw_over_a_list_on_a_gpu_is_the_per_tensor_kernel_bit_for_bit() {
    #[cfg(feature = "cuda")]
    on_the_gpu(adamw_list_on);
}

#[cfg(feature = "cuda")]
fn adamw_list_on(gpu: &Device) {
    use super::cuda::{adamw_update, adamw_update_all, AdamWUpdate};
    let sizes = [3000usize, lazarus_kernels::ADAMW_PART * 2 + 5, 1, 700];
    let make = || -> Vec<AdamWUpdate> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let seed = 10 * i as u64;
                let t = |s: u64, shift: f64| {
                    let v: Vec<f32> = testing::data(n, seed + s).iter().map(|x| (x.abs() * 0.1 + shift) as f32).collect();
                    Tensor::from_vec(v, n, gpu).unwrap()
                };
                let copy = (i % 2 == 0).then(|| Tensor::zeros(n, DType::BF16, gpu).unwrap());
                let k = [0.9, 0.95, 0.7 + 0.01 * i as f32, 1e-2, 1.3, 1e-8, if i == 1 { 1.0 } else { 0.999 }];
                AdamWUpdate { p: t(0, 0.0), g: t(1, 0.0), m: t(2, 0.0), v: t(3, 0.01), copy, k }
            })
            .collect()
    };
    let bits = |us: &[AdamWUpdate]| -> Vec<Vec<u32>> {
        let of = |t: &Tensor| t.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect();
        us.iter()
            .flat_map(|u| [Some(&u.p), Some(&u.m), Some(&u.v), u.copy.as_ref()].into_iter().flatten().map(of).collect::<Vec<_>>())
            .collect()
    };
    let one = make();
    for u in &one {
        adamw_update(&u.p, &u.g, &u.m, &u.v, u.copy.as_ref(), u.k).unwrap();
    }
    let all = make();
    adamw_update_all(&all).unwrap();
    assert_eq!(bits(&one), bits(&all), "one launch over the list is the per-tensor kernel");
    assert_ne!(bits(&one), bits(&make()), "the update changed the tensors");
}
